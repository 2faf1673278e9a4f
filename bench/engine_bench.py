"""Serving-engine benchmark: prints ratios measured in one run on this machine.

    python -m bench.engine_bench            # full workload (256 requests, 64 in flight)
    python -m bench.engine_bench --quick    # scaled-down smoke run

1. Serving throughput: useful output tokens/s of the engine over HTTP divided by
   HF transformers `generate` in static batches on the same weights and dtype.
2. Single-stream decode tokens/s divided by the memory roofline of the dtype
   (bytes of weights / measured read bandwidth); llama.cpp too where installed.
3. Time to first token at 1 and 32 concurrent requests.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]


def make_workload(count: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int = 1234) -> Workload:  # fmt: skip
    rng = random.Random(seed)
    prompts, limits = [], []
    for _ in range(count):
        length = rng.randint(*prompt_range)
        # ordinary text tokens of the SmolLM2 vocabulary (ids below ~100 are bytes/specials)
        prompts.append([rng.randint(300, 40000) for _ in range(length)])
        limits.append(rng.randint(*output_range))
    return Workload(prompts, limits)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_engine(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable, "-m", "engine", "serve", "--model", args.model, "--dtype", args.dtype,
        "--port", str(port), "--threads", str(args.threads), "--max-num-seqs", "64",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-memory-mb", str(args.kv_cache_mb), "--max-model-len", "1024",
        "--max-queue", "1024", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO_ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"engine exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("engine did not become ready")


async def stream_one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                     ignore_eos: bool = False) -> tuple[float, int]:  # fmt: skip
    """(time to first token, completion tokens) for one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}  # fmt: skip
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload["choices"] and first is None:
                first = time.perf_counter() - started
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    return (first if first is not None else time.perf_counter() - started), tokens


async def run_serving(base: str, workload: Workload, in_flight: int) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=in_flight + 4)
    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:
        gate = asyncio.Semaphore(in_flight)

        async def one(index: int) -> int:
            async with gate:
                _, tokens = await stream_one(
                    client, workload.prompts[index], workload.max_tokens[index]
                )
                return tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
        return time.perf_counter() - started, sum(counts)


async def run_ttft(base: str, concurrency: int, prompt_length: int) -> list[float]:
    rng = random.Random(99 + concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        prompts = [
            [rng.randint(300, 40000) for _ in range(prompt_length)] for _ in range(concurrency)
        ]
        results = await asyncio.gather(*(stream_one(client, p, 8, True) for p in prompts))
    return [ttft for ttft, _ in results]


def reference_model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loader import load_checkpoint, resolve_model_path

    checkpoint = load_checkpoint(resolve_model_path("smollm2"))
    c = checkpoint.config
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        )
    )  # fmt: skip
    model.load_state_dict(checkpoint.weights, strict=False)
    model.tie_weights()
    return model.to(dtype).eval(), 2  # eos id of SmolLM2


def run_reference(workload: Workload, batch_size: int, dtype: torch.dtype) -> tuple[float, int]:
    """HF generate in static batches (left padded); useful = tokens up to own limit or EOS."""
    model, eos = reference_model(dtype)
    model.generation_config.eos_token_id = eos
    useful = 0
    started = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        limits = workload.max_tokens[first : first + batch_size]
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max(limits),
                do_sample=False, pad_token_id=eos,
            )[:, longest:]  # fmt: skip
        for row, limit in enumerate(limits):
            tokens = out[row, :limit].tolist()
            useful += tokens.index(eos) + 1 if eos in tokens else len(tokens)
    return time.perf_counter() - started, useful


def read_bandwidth_gbs() -> float:
    data = torch.ones(128 * 2**20 // 4 * 4)  # 512 MiB of fp32
    data.sum()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def single_stream(args: argparse.Namespace, dtype: str) -> tuple[float, int]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sequence import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=dtype, max_model_len=1024))
    engine.load()
    engine.warm_up()
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper.")
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    seq = engine.add_request(prompt, params, "single", lambda out: None)
    engine.scheduler.add(engine._submitted.pop())
    engine._step()  # prefill + first token
    started = time.perf_counter()
    while not seq.is_finished:
        engine._step()
    elapsed = time.perf_counter() - started
    return (seq.num_output_tokens - 1) / elapsed, engine.weight_bytes


def llama_cpp_decode(args: argparse.Namespace) -> float | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    from engine.loader import smollm2_path

    llm = llama_cpp.Llama(str(smollm2_path()), n_threads=args.threads, verbose=False)
    llm("Hello", max_tokens=4)
    started = time.perf_counter()
    out = llm("Write a long story about a lighthouse keeper.", max_tokens=args.decode_tokens,
              temperature=0)  # fmt: skip
    return int(out["usage"]["completion_tokens"]) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="scaled-down workload for a smoke run")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-mb", type=int, default=2048)
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        workload = make_workload(16, (32, 128), (16, 64))
        in_flight, batch_size, args.decode_tokens, ttft_many = 8, 8, 32, 8
    else:
        workload = make_workload(256, (32, 512), (32, 256))
        in_flight, batch_size, args.decode_tokens, ttft_many = 64, 64, 128, 32
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, threads {args.threads}, "
          f"cuda {torch.cuda.is_available()}, dtype {args.dtype}")  # fmt: skip

    process, base = start_engine(args)
    try:
        ttft_one = asyncio.run(run_ttft(base, 1, 128))
        ttft_group = asyncio.run(run_ttft(base, ttft_many, 128))
        serve_seconds, serve_tokens = asyncio.run(run_serving(base, workload, in_flight))
        stats = httpx.get(f"{base}/admin/stats").json()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    engine_rate = serve_tokens / serve_seconds
    print(f"engine serving: {len(workload.prompts)} requests, {in_flight} in flight, "
          f"{serve_tokens} useful tokens in {serve_seconds:.1f}s = {engine_rate:.1f} tok/s "
          f"(prefix hits {stats.get('prefix_cache_hits_total', 0)}, "
          f"preemptions {stats.get('num_preemptions_total', 0)})")  # fmt: skip
    if not args.skip_reference:
        ref_dtype = {"float32": torch.float32}.get(args.dtype, torch.bfloat16)
        ref_seconds, ref_tokens = run_reference(workload, batch_size, ref_dtype)
        ref_rate = ref_tokens / ref_seconds
        print(f"HF generate ({ref_dtype}, static batches of {batch_size}): {ref_tokens} useful "
              f"tokens in {ref_seconds:.1f}s = {ref_rate:.1f} tok/s")  # fmt: skip
        print(f"RATIO serving throughput engine/HF = {engine_rate / ref_rate:.2f}x (target >= 5x)")

    bandwidth = read_bandwidth_gbs()
    rate, weight_bytes = single_stream(args, args.dtype)
    roofline = bandwidth * 1e9 / weight_bytes
    print(f"single stream decode ({args.dtype}): {rate:.1f} tok/s; "
          f"weights {weight_bytes / 1e6:.0f} MB, read bandwidth {bandwidth:.1f} GB/s, "
          f"roofline {roofline:.1f} tok/s")  # fmt: skip
    print(f"RATIO single-stream decode / memory roofline = {rate / roofline:.2f} (target >= 0.8)")
    cpp = llama_cpp_decode(args)
    if cpp is None:
        print("llama.cpp: llama-cpp-python not installed, skipped")
    else:
        print(f"llama.cpp decode: {cpp:.1f} tok/s; RATIO engine/llama.cpp = {rate / cpp:.2f}")
    print(f"TTFT 1 request: {ttft_one[0] * 1000:.0f} ms; {ttft_many} concurrent: "
          f"p50 {statistics.median(ttft_group) * 1000:.0f} ms, "
          f"max {max(ttft_group) * 1000:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
