"""Gateway overhead: TTFT through the gateway minus TTFT straight to the same agent.

    DATABASE_URL=... REDIS_URL=... python -m bench.gateway_bench [--engine URL] [--mount]

Starts a real engine (unless --engine is given) and a gateway process (its own uvicorn
process by default; --mount serves it from controlplane.asgi like `web` does), creates a
bench tenant and routing table, then runs rounds that alternate direct and gateway
streams (so both see the same engine state) at 1 and 32 concurrent streams. Prints TTFT
p50/p95 for both paths, the added latency, and the throughput ratio, in one run.
The database must be migrated.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(url: str, timeout: float, expect_ok: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=1)
            if response.status_code == 200 or not expect_ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not come up in {timeout}s")


def _setup(model_name: str) -> tuple[str, int]:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    django.setup()
    from controlplane.registry.models import Artifact, Model, ModelVersion
    from controlplane.tenants.services import api_key_create, tenant_create

    model, _ = Model.objects.get_or_create(name=model_name, defaults={"task": "chat"})
    version = ModelVersion.objects.filter(model=model).first()
    if version is None:
        artifact = Artifact.objects.create(digest=uuid.uuid4().hex * 2, format="gguf", size_bytes=1)
        version = ModelVersion.objects.create(
            model=model,
            label="bench",
            artifact=artifact,
            serving_config={
                "dtype": "float32",
                "max_model_len": 2048,
                "kv_block_size": 16,
                "max_num_seqs": 64,
                "max_num_batched_tokens": 4096,
            },
        )
    tenant = tenant_create(
        actor=None,
        slug=f"bench-{uuid.uuid4().hex[:8]}",
        name="Bench",
        requests_per_minute=1_000_000,
        tokens_per_minute=1_000_000_000,
        allowed_models=[model],
    )
    return api_key_create(actor=None, tenant=tenant, name="bench").raw_key, version.pk


async def _stream(client: httpx.AsyncClient, url: str, key: str, max_tokens: int):
    """(TTFT seconds, completion chunks) of one streamed chat completion."""
    started = time.perf_counter()
    ttft = None
    chunks = 0
    body = {"model": "bench", "messages": MESSAGES, "max_tokens": max_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - started
    return ttft, chunks


async def _round(url: str, key: str, concurrency: int, max_tokens: int, client):
    started = time.perf_counter()
    results = await asyncio.gather(
        *(_stream(client, url, key, max_tokens) for _ in range(concurrency))
    )
    wall = time.perf_counter() - started
    return [r[0] for r in results if r[0] is not None], sum(r[1] for r in results), wall


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))]


async def _measure(engine: str, gateway: str, key: str, concurrency: int, rounds: int, tokens):
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        for url in (engine, gateway):  # warm both paths (connections, caches)
            await _round(url, key, min(concurrency, 4), 2, client)
        figures = {"direct": ([], 0, 0.0), "gateway": ([], 0, 0.0)}
        for index in range(rounds):
            order = [("direct", engine), ("gateway", gateway)]
            if index % 2:
                order.reverse()
            for name, url in order:
                ttfts, chunk_count, wall = await _round(url, key, concurrency, tokens, client)
                old = figures[name]
                figures[name] = (old[0] + ttfts, old[1] + chunk_count, old[2] + wall)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", help="base URL of a running engine (default: start one)")
    parser.add_argument("--mount", action="store_true", help="serve via controlplane.asgi")
    parser.add_argument("--rounds-1", type=int, default=20)
    parser.add_argument("--rounds-32", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()

    key, version_id = _setup("bench")
    from controlplane.gateway.services import routing_table_publish

    processes = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        engine = args.engine
        if engine is None:
            port = _free_port()
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "engine", "serve", "--model", "smollm2",
                     "--threads", "1", "--port", str(port), "--served-model-name", "bench",
                     "--log-level", "warning"],
                    cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
            engine = f"http://127.0.0.1:{port}"
        gateway_port = _free_port()
        app = (
            "controlplane.asgi:application"
            if args.mount
            else "controlplane.gateway.asgi:application"
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "uvicorn", app, "--port", str(gateway_port),
                 "--no-access-log", "--log-level", "warning"],
                cwd=REPO_ROOT, env=env,
            )
        )  # fmt: skip
        gateway = f"http://127.0.0.1:{gateway_port}"
        _wait(f"{engine}/health", 300)
        _wait(f"{gateway}/v1/models", 60, expect_ok=False)
        routing_table_publish(
            deployment="bench",
            model="bench",
            versions=[
                {"version_id": version_id, "label": "bench", "weight": 100, "endpoints": [engine]}
            ],
        )
        time.sleep(1.0)
        print(f"engine {engine}  gateway {gateway} ({app})  max_tokens={args.max_tokens}")
        for concurrency, rounds in ((1, args.rounds_1), (32, args.rounds_32)):
            figures = asyncio.run(
                _measure(engine, gateway, key, concurrency, rounds, args.max_tokens)
            )
            direct_ttft, direct_chunks, direct_wall = figures["direct"]
            gw_ttft, gw_chunks, gw_wall = figures["gateway"]
            p50_d, p95_d = _percentile(direct_ttft, 0.5), _percentile(direct_ttft, 0.95)
            p50_g, p95_g = _percentile(gw_ttft, 0.5), _percentile(gw_ttft, 0.95)
            mean_added_ms = (statistics.fmean(gw_ttft) - statistics.fmean(direct_ttft)) * 1000
            throughput_d = direct_chunks / direct_wall
            throughput_g = gw_chunks / gw_wall
            print(
                f"concurrency {concurrency:>2}: n={len(gw_ttft)}  "
                f"TTFT p50 direct {p50_d * 1000:.2f} ms gateway {p50_g * 1000:.2f} ms "
                f"(added {(p50_g - p50_d) * 1000:+.2f} ms)  "
                f"p95 direct {p95_d * 1000:.2f} ms gateway {p95_g * 1000:.2f} ms "
                f"(added {(p95_g - p95_d) * 1000:+.2f} ms)  "
                f"mean added {mean_added_ms:+.2f} ms  "
                f"throughput {throughput_g:.1f}/{throughput_d:.1f} tok/s "
                f"= {throughput_g / throughput_d:.3f} of direct"
            )  # fmt: skip
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=20)


if __name__ == "__main__":
    main()
