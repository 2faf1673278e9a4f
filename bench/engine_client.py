"""The engine benchmark's HTTP client: streamed completions of token-id prompts against an
OpenAI-compatible /v1/completions, ours or vLLM's, timed the same way for both."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench.engine_workload import Workload


@dataclass(slots=True)
class Streamed:
    ttft: float  # seconds to the first chunk with a choice
    tokens: int  # completion tokens, from the usage chunk
    seconds: float  # the whole request

    @property
    def itl(self) -> float | None:
        """Mean seconds between output tokens after the first; None for one token."""
        return (self.seconds - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


async def stream_one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                     ignore_eos: bool = False) -> Streamed:  # fmt: skip
    """One streamed completion, greedy, with its usage."""
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
    seconds = time.perf_counter() - started
    return Streamed(first if first is not None else seconds, tokens, seconds)


@dataclass(slots=True)
class ServingResult:
    seconds: float
    tokens: int  # useful tokens of the requests that ran
    submitted: int
    itls: list[float] = field(default_factory=list)  # per request of more than one token

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def itl_p50(self) -> float | None:
        return statistics.median(self.itls) if self.itls else None


async def run_serving(
    base: str,
    headers: dict[str, str],
    workload: Workload,
    in_flight: int,
    submit_deadline: float,
    ignore_eos: bool = False,
) -> ServingResult:
    """All requests with `in_flight` open at a time; none is started after the deadline.
    ignore_eos: every request runs to its max_tokens (random weights, a fixed workload)."""
    limits = httpx.Limits(max_connections=in_flight + 4)
    async with httpx.AsyncClient(
        base_url=base, timeout=3600, limits=limits, headers=headers
    ) as client:
        gate = asyncio.Semaphore(in_flight)
        submitted = 0

        async def one(index: int) -> Streamed | None:
            nonlocal submitted
            async with gate:
                if time.monotonic() > submit_deadline:
                    return None
                submitted += 1
                return await stream_one(
                    client, workload.prompts[index], workload.max_tokens[index], ignore_eos
                )

        started = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
        seconds = time.perf_counter() - started
    ran = [s for s in done if s is not None]
    itls = [itl for s in ran if (itl := s.itl) is not None]
    return ServingResult(seconds, sum(s.tokens for s in ran), submitted, itls)


async def run_ttft(base: str, headers: dict[str, str], prompts: list[list[int]]) -> list[float]:
    """Time to first token of these prompts sent at once (8 tokens each, EOS ignored)."""
    async with httpx.AsyncClient(base_url=base, timeout=600, headers=headers) as client:
        results = await asyncio.gather(*(stream_one(client, p, 8, True) for p in prompts))
    return [r.ttft for r in results]


def measure_ttft(
    base: str, headers: dict[str, str], one: list[list[int]], many: list[list[int]]
) -> tuple[list[float], list[float]]:
    """TTFT of each of `one` alone, then of `many` sent together."""
    alone = [asyncio.run(run_ttft(base, headers, [p]))[0] for p in one]
    return alone, asyncio.run(run_ttft(base, headers, many))
