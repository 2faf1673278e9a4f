"""Process-level behaviour: drain, CLI validation, preemption under a small KV cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.engine.conftest import REPO_ROOT, new_secrets, start_server, stop_server

SECRETS = new_secrets()


def wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met")


@pytest.mark.parametrize("trigger", ["admin", "sigterm"])
def test_drain_finishes_in_flight_refuses_new_and_exits(tiny_llama: Path, tmp_path: Path, trigger):
    server = start_server(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--max-model-len", "256",
         "--num-blocks", "64", "--fault-latency-ms", "20"],
        tmp_path / "drain.log",
    )  # fmt: skip
    try:
        url = server.base_url
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
        results: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: results.append(
                httpx.post(f"{url}/v1/completions", json=body, headers=server.serving, timeout=60)
            )
        )
        worker.start()
        wait_for(lambda: server.stats()["running"] == 1)
        if trigger == "admin":
            assert httpx.post(f"{url}/admin/drain", headers=server.admin).status_code == 202
        else:
            server.process.send_signal(signal.SIGTERM)
            wait_for(lambda: server.stats()["state"] == "draining")
        refused = httpx.post(f"{url}/v1/completions", json=body, headers=server.serving)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        health = httpx.get(f"{url}/health", headers=server.serving)
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        worker.join(timeout=60)
        assert results[0].status_code == 200
        assert results[0].json()["usage"]["completion_tokens"] == 40
        assert server.process.wait(timeout=30) == 0
    finally:
        stop_server(server)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", "serve", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **SECRETS.environment()},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_flags_exit_non_zero_with_a_message(tiny_llama: Path):
    bad_dtype = run_cli("--model", str(tiny_llama), "--dtype", "float16")
    assert bad_dtype.returncode == 2
    assert "invalid choice: 'float16'" in bad_dtype.stderr
    bad_block = run_cli("--model", str(tiny_llama), "--block-size", "0")
    assert bad_block.returncode == 2
    assert "block_size must be positive, got 0" in bad_block.stderr
    missing = run_cli("--model", "/nonexistent/model.gguf")
    assert missing.returncode == 2
    assert "no such file or folder" in missing.stderr
    too_long = run_cli("--model", str(tiny_llama), "--max-model-len", "100000")
    assert too_long.returncode == 1
    assert "exceeds the model's context length (512)" in too_long.stderr


def test_preemption_by_recompute_loses_nothing(tiny_llama: Path, tmp_path: Path):
    from transformers import LlamaForCausalLM

    # 10 ms a step keeps all six requests running together even when their posts arrive
    # spread out on a busy machine: the tiny model alone can finish one before the next
    # arrives, and then nothing needs preempting.
    server = start_server(
        ["--model", str(tiny_llama), "--dtype", "float32", "--max-model-len", "256",
         "--num-blocks", "20", "--block-size", "16", "--max-num-batched-tokens", "64",
         "--fault-latency-ms", "10"],
        tmp_path / "small-kv.log",
    )  # fmt: skip
    try:
        prompts = [[3 + (i * 7 + j) % 400 for j in range(60)] for i in range(6)]

        def run(prompt: list[int]) -> dict:
            body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            response = httpx.post(
                f"{server.base_url}/v1/completions", json=body, headers=server.serving, timeout=600
            )
            assert response.status_code == 200, response.text
            return response.json()

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, prompts))
        metrics = httpx.get(f"{server.base_url}/metrics", headers=server.serving).text
        preemptions = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("engine:num_preemptions_total")
        )
        assert preemptions > 0
        assert server.stats()["kv_cache_usage"] == 0.0
    finally:
        stop_server(server)
    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=60,
                do_sample=False, pad_token_id=0,
            )[0, 60:].tolist()  # fmt: skip
        assert result["choices"][0]["token_ids"] == expected
