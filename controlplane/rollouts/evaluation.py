"""Evaluation jobs against a real engine: quality, latency and energy figures.

Plain functions over HTTP (httpx, a timeout on every call); no database.
`evaluation_jobs` picks the agents, calls these and records the result through the
registry's `evaluation_record`.

- **perplexity** of the held-out text, teacher-forced: for each position i the prompt is
  the text's first i token ids (`/v1/completions` accepts token ids), one token is asked
  for with `logprobs=20`, and the log-probability of the text's real next token is read
  from the top 20. The engine has no prompt log-probabilities (`echo`), so a real token
  outside the top 20 (reported as `top20_coverage` < 1) is given the probability mass the
  top 20 leave, spread evenly over the rest of the vocabulary: an estimate, not a bound.
- **exact_match**: greedy answers to the question set; an answer matches when it contains
  the expected answer as a whole word (case-insensitive).
- **agreement**: the share of questions whose greedy answer equals the baseline's.
- **latency**: TTFT and inter-token latency p95 (ms) of streamed requests at a fixed
  concurrency, measured by this client.
- **energy**: joules per generated token from the agent's cumulative heartbeat figures
  (`energy_joules`, `generated_tokens_total`) before and after a fixed workload.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from contracts.stats import percentile

DATASETS = Path(__file__).resolve().parent / "datasets"
TOP_LOGPROBS = 20
REQUEST_TIMEOUT_S = 60.0

QUALITY_METRICS = frozenset({"perplexity", "exact_match", "agreement"})
LATENCY_METRICS = frozenset({"ttft_p95_ms", "itl_p95_ms"})
ENERGY_METRICS = frozenset({"joules_per_token"})
KNOWN_METRICS = QUALITY_METRICS | LATENCY_METRICS | ENERGY_METRICS


@dataclass(frozen=True, slots=True)
class Question:
    question: str
    answer: str


def heldout_text() -> str:
    return (DATASETS / "heldout.txt").read_text().strip()


def questions() -> list[Question]:
    rows = json.loads((DATASETS / "questions.json").read_text())
    return [Question(question=row["question"], answer=row["answer"]) for row in rows]


@functools.lru_cache(maxsize=4)
def tokenizer_for(path: str) -> Any:
    """The engine's tokenizer built from a GGUF's metadata only (no weights are read)."""
    import gguf

    from contracts.tokenizer import TextTokenizer

    reader = gguf.GGUFReader(path)

    def field(key: str, default: Any = None) -> Any:
        item = reader.fields.get(key)
        return default if item is None else item.contents()

    tokens = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    return TextTokenizer(
        {
            "kind": "gguf",
            "tokens": list(tokens),
            "token_types": [int(t) for t in field("tokenizer.ggml.token_type", [1] * len(tokens))],
            "merges": list(merges) if merges is not None else [],
            "model": field("tokenizer.ggml.model", "gpt2"),
            "pre": field("tokenizer.ggml.pre", "default"),
            "bos_token_id": field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": field("tokenizer.ggml.eos_token_id"),
            "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
            "chat_template": field("tokenizer.chat_template"),
        }
    )


def served_model(client: httpx.Client, endpoint: str) -> str:
    response = client.get(f"{endpoint}/v1/models", timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def perplexity(
    *, client: httpx.Client, endpoint: str, tokenizer: Any, text: str, workers: int = 4
) -> dict[str, float]:
    ids = tokenizer.encode(text)
    model = served_model(client, endpoint)
    vocab = tokenizer.vocab_size

    def next_token_logprob(position: int) -> tuple[float, bool]:
        response = client.post(
            f"{endpoint}/v1/completions",
            json={
                "model": model,
                "prompt": ids[:position],
                "max_tokens": 1,
                "temperature": 0,
                "logprobs": TOP_LOGPROBS,
            },
            timeout=REQUEST_TIMEOUT_S,
        )
        response.raise_for_status()
        top: dict[str, float] = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        expected = tokenizer.decode([ids[position]], skip_special_tokens=False)
        if expected in top:
            return top[expected], True
        left = max(1.0 - sum(math.exp(value) for value in top.values()), 1e-12)
        return math.log(left / max(vocab - len(top), 1)), False

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(next_token_logprob, range(1, len(ids))))
    logprobs = [value for value, _ in results]
    return {
        "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
        "top20_coverage": sum(1 for _, hit in results if hit) / len(results),
        "tokens": float(len(results)),
    }


def greedy_answers(
    *, client: httpx.Client, endpoint: str, prompts: Sequence[str], max_tokens: int = 12
) -> list[str]:
    model = served_model(client, endpoint)
    answers = []
    for prompt in prompts:
        response = client.post(
            f"{endpoint}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
            timeout=REQUEST_TIMEOUT_S,
        )
        response.raise_for_status()
        answers.append(str(response.json()["choices"][0]["message"]["content"]))
    return answers


def exact_match(answers: Sequence[str], expected: Sequence[str]) -> float:
    hits = sum(
        1
        for answer, wanted in zip(answers, expected, strict=True)
        if re.search(rf"\b{re.escape(wanted)}\b", answer, flags=re.IGNORECASE)
    )
    return hits / len(expected)


def agreement(candidate: Sequence[str], baseline: Sequence[str]) -> float:
    same = sum(1 for a, b in zip(candidate, baseline, strict=True) if a.strip() == b.strip())
    return same / len(baseline)


def _one_stream(
    client: httpx.Client, endpoint: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) in seconds of one streamed chat completion."""
    started = time.perf_counter()
    stamps: list[float] = []
    with client.stream(
        "POST",
        f"{endpoint}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=REQUEST_TIMEOUT_S,
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("a streamed request produced no content")
    return stamps[0] - started, [b - a for a, b in itertools.pairwise(stamps)]


def latency(
    *,
    client: httpx.Client,
    endpoint: str,
    prompts: Sequence[str],
    concurrency: int = 2,
    max_tokens: int = 8,
) -> dict[str, float]:
    model = served_model(client, endpoint)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(
            pool.map(lambda p: _one_stream(client, endpoint, model, p, max_tokens), prompts)
        )
    ttfts = [ttft * 1000 for ttft, _ in results]
    gaps = [gap * 1000 for _, request_gaps in results for gap in request_gaps]
    return {
        "ttft_p95_ms": percentile(ttfts, 95) or 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) or 0.0,
        "itl_p95_ms": percentile(gaps, 95) or 0.0,
        "requests": float(len(results)),
        "concurrency": float(concurrency),
    }


def joules_per_token(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """From two heartbeats' cumulative figures of one agent process; None without tokens."""
    tokens = float(after.get("generated_tokens_total", 0)) - float(
        before.get("generated_tokens_total", 0)
    )
    joules = float(after.get("energy_joules", 0)) - float(before.get("energy_joules", 0))
    if tokens <= 0 or joules < 0:
        return None
    return joules / tokens
