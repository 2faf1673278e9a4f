"""Fixtures: a tiny random Llama saved as a HF folder, and engine servers in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engine.config import EngineSecrets

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Continuous batching mixes prefill chunks with decode tokens in every step.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Numbers like 12345 and 67890 are split into digits.",
    "Hello world! How are you today? I am fine, thank you.",
] * 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_tiny_llama(folder: Path, hidden_size: int = 64, intermediate_size: int = 128) -> None:
    """A 2-layer random Llama with a 512-token byte-level BPE tokenizer and a ChatML template;
    4 query heads over 2 KV heads, head_dim = hidden_size / 4."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "add_bos_token": False})
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
        initializer_range=0.2,  # spread logits so greedy ties cannot flip on rounding
    )
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dim32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with head_dim 32: the smallest the bf16 rotary kernel, and so the
    whole decode step kernel, takes."""
    folder = tmp_path_factory.mktemp("tiny-llama-dim32")
    build_tiny_llama(folder, hidden_size=128, intermediate_size=256)
    return folder


def new_secrets() -> EngineSecrets:
    return EngineSecrets.generate()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@dataclass
class EngineServer:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    secrets: EngineSecrets

    @property
    def serving(self) -> dict[str, str]:
        """Headers that open /v1/*, /health and /metrics."""
        return bearer(self.secrets.serving)

    @property
    def admin(self) -> dict[str, str]:
        """Headers that open /admin/*."""
        return bearer(self.secrets.admin)

    @property
    def client(self) -> openai.OpenAI:
        # The OpenAI client sends its API key as the bearer secret.
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.secrets.serving, max_retries=0
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=600, headers=self.serving)

    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/admin/stats", headers=self.admin, timeout=10).json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    args: list[str], log_path: Path, timeout: float = 180, **environment: str
) -> EngineServer:
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
    engine_secrets = new_secrets()
    process = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--port", str(port), "--threads", "1", *args],
        cwd=REPO_ROOT,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **engine_secrets.environment(),
            **environment,
        },
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = EngineServer(process, f"http://127.0.0.1:{port}", log_path, engine_secrets)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"engine exited with {process.returncode}:\n{server.log()}")
        try:
            health = httpx.get(f"{server.base_url}/health", headers=server.serving, timeout=2)
            if health.status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_server(server)
    raise AssertionError(f"engine not ready within {timeout}s:\n{server.log()}")


def stop_server(server: EngineServer) -> int:
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # drains, then exits
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    return process.returncode


@pytest.fixture(scope="session")
def tiny_server(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("logs") / "tiny-server.log"
    server = start_server(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32",
         "--max-model-len", "256", "--num-blocks", "256", "--block-size", "16"],
        log,
    )  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def narrow_server(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """One sequence at a time, a queue of one, and slow tokens: for admission tests."""
    log = tmp_path_factory.mktemp("logs") / "narrow-server.log"
    server = start_server(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--max-model-len", "256",
         "--num-blocks", "64", "--max-num-seqs", "1", "--max-queue", "1",
         "--fault-latency-ms", "20"],
        log,
    )  # fmt: skip
    yield server
    stop_server(server)
