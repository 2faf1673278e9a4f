"""Serving-engine benchmark: ratios measured in one run on this machine.

    python -m bench.engine_bench            # full workload (256 requests, 64 in flight)
    python -m bench.engine_bench --quick    # scaled-down smoke run
    python -m bench --only engine_bench     # as a step of `make bench` (docs/loadgen.md)

1. Serving throughput: useful output tokens/s of the engine over HTTP divided by
   HF transformers `generate` in static batches on the same weights and dtype (on a
   CPU without native bf16, HF in float32 on the bf16 weights: see reference_dtype).
2. Single-stream decode tokens/s divided by the memory roofline of the dtype
   (bytes of weights / measured read bandwidth); llama.cpp too where installed.
3. Time to first token at 1 and 32 concurrent requests, against the engine's own
   prefill time for the same prompts measured in-process in the same run.
4. Kernel ceilings, so that 1 and 2 read against what this machine allows: the
   engine's own matmul kernels timed alone, (a) at the step's token budget in rows,
   turned into the useful tok/s of the whole workload if every FLOP ran at that rate
   and attention cost nothing; (b) at one row, the floor of a decode step.

Everything runs under one time budget: the serving run stops submitting requests at
a deadline, and HF `generate` gets `max_time`, so the step ends within `BUDGET_S`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import torch

from engine.config import EngineSecrets

REPO_ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 400  # `make bench` has 840 s for its five steps
QUICK_BUDGET_S = 150
SMOLLM2_EOS = 2
DECODE_PROMPT = "Write a long story about a lighthouse keeper."
DECODE_ROUNDS = 3
# The headline decode ratio: windows of this many decode steps, each with a short read of
# memory either side of it (the read bandwidth of the shared VM moves by 2x within
# seconds, so a decode and a read seconds apart can see different machines)
DECODE_WINDOW = 16
WINDOW_READ_MIB = 256


@dataclass(slots=True)
class Options:
    model: str = "smollm2"
    dtype: str = "bfloat16"
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_num_batched_tokens: int = 512
    kv_cache_mb: int = 2048
    requests: int = 256
    prompt_range: tuple[int, int] = (32, 512)
    output_range: tuple[int, int] = (32, 256)
    in_flight: int = 64
    batch_size: int = 64  # HF static batch
    reference_batches: int = 1  # HF is timed on the first batches only (its rate, tok/s)
    decode_tokens: int = 128
    ttft_prompt: int = 128
    ttft_many: int = 32
    budget_s: float = BUDGET_S
    skip_reference: bool = False
    reference_dtype: str | None = None  # None: the engine's dtype where it runs natively


QUICK = Options(
    requests=32, prompt_range=(32, 256), output_range=(16, 64), in_flight=16, batch_size=16,
    decode_tokens=32, ttft_many=8, budget_s=QUICK_BUDGET_S,
)  # fmt: skip


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


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(300, 40000) for _ in range(length)] for _ in range(count)]


# The engine serves on CUDA where present (engine.llm_engine.pick_device); the reference,
# the reads and the kernel ceilings run where it runs.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    """Wait for queued GPU work before a clock is read (nothing to wait for on CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- the engine over HTTP ---------------------------------------------------------------
# The engine's secrets for this run; the serving one goes with every request (a header
# costs nothing measurable), the admin one with the /admin/stats readings.
SECRETS = EngineSecrets.generate()
SERVING_HEADERS = {"Authorization": f"Bearer {SECRETS.serving}"}
ADMIN_HEADERS = {"Authorization": f"Bearer {SECRETS.admin}"}


def start_engine(options: Options) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable, "-m", "engine", "serve", "--model", options.model,
        "--dtype", options.dtype, "--port", str(port), "--threads", str(options.threads),
        "--max-num-seqs", str(max(64, options.in_flight)),
        "--max-num-batched-tokens", str(options.max_num_batched_tokens),
        "--kv-cache-memory-mb", str(options.kv_cache_mb), "--max-model-len", "1024",
        "--max-queue", "1024", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, **SECRETS.environment()},
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"engine exited with {process.returncode}")
        try:
            health = httpx.get(f"{base}/health", headers=SERVING_HEADERS, timeout=2)
            if health.status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("engine did not become ready")


def stop_engine(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)  # drains in-flight requests, then exits
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


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


@dataclass(slots=True)
class ServingResult:
    seconds: float
    tokens: int  # useful tokens of the requests that ran
    submitted: int


async def run_serving(
    base: str, workload: Workload, in_flight: int, submit_deadline: float
) -> ServingResult:
    """All requests with `in_flight` open at a time; none is started after the deadline."""
    limits = httpx.Limits(max_connections=in_flight + 4)
    async with httpx.AsyncClient(
        base_url=base, timeout=3600, limits=limits, headers=SERVING_HEADERS
    ) as client:
        gate = asyncio.Semaphore(in_flight)
        submitted = 0

        async def one(index: int) -> int:
            nonlocal submitted
            async with gate:
                if time.monotonic() > submit_deadline:
                    return 0
                submitted += 1
                _, tokens = await stream_one(
                    client, workload.prompts[index], workload.max_tokens[index]
                )
                return tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
        return ServingResult(time.perf_counter() - started, sum(counts), submitted)


async def run_ttft(base: str, prompts: list[list[int]]) -> list[float]:
    async with httpx.AsyncClient(base_url=base, timeout=600, headers=SERVING_HEADERS) as client:
        results = await asyncio.gather(*(stream_one(client, p, 8, True) for p in prompts))
    return [ttft for ttft, _ in results]


def step_breakdown(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The steps between two /admin/stats readings by the way they ran (ModelRunner.last_path):
    how many, their seconds, and the mean of one."""
    parts = []
    counts, seconds = after.get("steps", {}), after.get("step_seconds", {})
    for path in sorted(counts):
        count = counts[path] - before.get("steps", {}).get(path, 0)
        spent = seconds.get(path, 0.0) - before.get("step_seconds", {}).get(path, 0.0)
        if count > 0:
            parts.append(f"{path} {count} in {spent:.1f}s ({spent / count * 1000:.1f} ms each)")
    return ", ".join(parts) or "none recorded"


# ---- HF transformers reference ----------------------------------------------------------
def reference_model(model: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loader import load_checkpoint, resolve_model_path

    checkpoint = load_checkpoint(resolve_model_path(model))
    c = checkpoint.config
    reference = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
            max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        )
    )  # fmt: skip
    reference.load_state_dict(checkpoint.weights, strict=False)
    reference.tie_weights()
    return reference.to(device=DEVICE, dtype=dtype).eval()  # type: ignore[call-arg]


@dataclass(slots=True)
class ReferenceResult:
    seconds: float
    tokens: int
    requests: int
    hit_time_limit: bool
    # per static batch: (rows, padded prompt length, steps generated): the work HF did
    batches: list[tuple[int, int, int]] = field(default_factory=list)


def run_reference(
    options: Options, workload: Workload, dtype: torch.dtype, deadline: float
) -> ReferenceResult:
    """HF generate in static batches (left padded); useful = tokens up to own limit or EOS."""
    model = reference_model(options.model, dtype)
    max_time = max(10.0, deadline - time.monotonic())
    eos = SMOLLM2_EOS
    model.generation_config.eos_token_id = eos
    useful = requests = 0
    hit_time_limit = False
    batches: list[tuple[int, int, int]] = []
    size = options.batch_size
    started = time.perf_counter()
    for first in range(0, min(len(workload.prompts), size * options.reference_batches), size):
        prompts = workload.prompts[first : first + size]
        limits = workload.max_tokens[first : first + size]
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        left = max_time - (time.perf_counter() - started)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE),
                max_new_tokens=max(limits), do_sample=False, pad_token_id=eos,
                max_time=max(left, 1.0),
            )[:, longest:]  # fmt: skip
        if out.shape[1] < max(limits) and not bool((out == eos).any(dim=1).all()):
            hit_time_limit = True
        batches.append((len(prompts), longest, int(out.shape[1])))
        for row, limit in enumerate(limits):
            tokens = out[row, :limit].tolist()
            useful += tokens.index(eos) + 1 if eos in tokens else len(tokens)
        requests += len(prompts)
        if hit_time_limit:
            break
    return ReferenceResult(time.perf_counter() - started, useful, requests, hit_time_limit, batches)


def reference_dtype(options: Options) -> tuple[torch.dtype, str | None]:
    """HF's dtype for the reference, and why it is not the engine's dtype when it is not.

    The reference computes in the engine's dtype (bfloat16 for int8 too). On a CPU
    without native bf16 dot products (AVX2, AVX-512 before avx512_bf16) PyTorch's bf16
    GEMMs run many times slower than fp32 (a 64-request static batch of this workload
    took over 480 s to prefill on an AMD EPYC Zen 3), so such a reference measures only
    the missing instructions; it runs in float32 on the same bf16-rounded weights
    instead, HF's fastest dtype there. The engine itself computes batches in fp32 there.
    """
    if options.reference_dtype is not None:
        return getattr(torch, options.reference_dtype), None
    if options.dtype == "float32":
        return torch.float32, None
    from engine.models.layers import cpu_has_native_bf16

    if torch.cuda.is_available() or cpu_has_native_bf16():
        return torch.bfloat16, None
    return torch.float32, (
        "this CPU has no native bf16 dot products: HF runs in float32 on the same "
        "bf16-rounded weights (its fastest dtype here; --reference-dtype bfloat16 forces bf16)"
    )


def reference_forward_seconds(options: Options, tokens: int) -> dict[str, float]:
    """One HF forward pass of a `tokens`-token prompt in each dtype: why fp32 is chosen."""
    model = reference_model(options.model, torch.float32)
    ids = torch.tensor([random_prompts(1, tokens, seed=5)[0]], device=DEVICE)
    seconds: dict[str, float] = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            model = model.to(dtype)
            model(input_ids=ids[:, :8])  # warm the kernels
            synchronize()
            started = time.perf_counter()
            model(input_ids=ids)
            synchronize()
            seconds[str(dtype).removeprefix("torch.")] = time.perf_counter() - started
    return seconds


# ---- in-process figures: bandwidth, single-stream decode, prefill time -------------------
def read_bandwidth_gbs() -> float:
    data = torch.ones(128 * 2**20, device=DEVICE)  # 512 MiB of fp32, far beyond any cache
    data.sum()
    best = float("inf")
    for _ in range(5):
        synchronize()
        started = time.perf_counter()
        data.sum()
        synchronize()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


class WindowReader:
    """Read bandwidth between decode windows: a fresh sum over WINDOW_READ_MIB, the
    better of two (about 12 ms at 45 GB/s, against a window's 100 or so)."""

    def __init__(self) -> None:
        self.data = torch.ones(WINDOW_READ_MIB * 2**20 // 4, device=DEVICE)
        self.data.sum()

    def __call__(self) -> float:
        best = float("inf")
        for _ in range(2):
            synchronize()
            started = time.perf_counter()
            self.data.sum()
            synchronize()
            best = min(best, time.perf_counter() - started)
        return self.data.numel() * 4 / best / 1e9


@dataclass(slots=True)
class DecodeWindow:
    rate: float  # tokens/s over DECODE_WINDOW decode steps
    bandwidth: float  # GB/s, the faster of the reads right before and right after

    def ratio(self, weight_bytes: int) -> float:
        return self.rate * weight_bytes / 1e9 / self.bandwidth


@dataclass(slots=True)
class InProcessResult:
    decode_rates: list[float]  # tokens/s, one sequence, after its prefill, per round
    bandwidths: list[float]  # GB/s, read before the first round and after each
    windows: list[DecodeWindow]  # the paired decode windows of every round
    weight_bytes: int
    prefill_seconds: float  # one ttft_prompt-token prompt: prefill + first token, median
    ceilings: KernelCeilings
    config: Any  # the model's LlamaConfig
    model: Any  # kept to time its kernels again later in the run

    @property
    def decode_rate(self) -> float:
        return max(self.decode_rates)

    def median_window(self) -> DecodeWindow:
        """The window of the median decode / roofline ratio (the lower middle one)."""
        ranked = sorted(self.windows, key=lambda w: w.ratio(self.weight_bytes))
        return ranked[(len(ranked) - 1) // 2]

    def round_ratios(self) -> list[float]:
        """Each decode run against the roofline of the faster read either side of it: the
        read bandwidth moves within seconds on a shared VM, so the best read of the whole
        measurement can come from a moment no decode run saw."""
        return [
            rate * self.weight_bytes / 1e9 / max(before, after)
            for rate, before, after in zip(
                self.decode_rates, self.bandwidths, self.bandwidths[1:], strict=False
            )
        ]


@dataclass(slots=True)
class KernelCeilings:
    """What the engine's own matmul kernels allow on this machine, measured in this run.

    A pass is one multiplication by every weight matrix of the model (the vocabulary
    projection included), as one token's forward pass does; nothing else is timed.
    """

    layer_params: int  # weights of the decoder layers' matrices
    head_params: int  # weights of the vocabulary projection
    batched_flops: float  # FLOP/s of a pass at the step's token budget in rows
    batched_rows: int
    gemv_seconds: float  # one pass at a single row, as the decode runs it: a decode step's floor
    # GB/s of torch's sum over the matrices the decode step reads (None without the step
    # kernel): a read of the weights where they lie, beside the roofline's fresh buffer
    weights_read_gbs: float | None = None

    def flops(self, rows: int, tokens: int, outputs: int, config: Any) -> float:
        """FLOPs of `rows` sequences that each compute `tokens` tokens, `outputs` of them
        through the vocabulary projection; attention scores and the weighted sum cost
        4 * heads * head_dim FLOPs per key and layer, token t attending to t + 1 keys."""
        keys = tokens * (tokens + 1) / 2
        attention = 4 * config.num_heads * config.head_dim * config.num_layers * keys
        return rows * (2 * tokens * self.layer_params + 2 * outputs * self.head_params + attention)

    def useful_flops(self, prompts: list[list[int]], limits: list[int], config: Any) -> float:
        """The least work that serves these requests: every prompt token and every output
        token but the last through the layers once, every output token through the
        vocabulary projection once. Output lengths are taken as their limits (a request
        ending at EOS does less)."""
        return sum(
            self.flops(1, len(prompt) + limit - 1, limit, config)
            for prompt, limit in zip(prompts, limits, strict=True)
        )


def measure_ceilings(model: Any, rows: int) -> KernelCeilings:
    from engine.models.layers import Linear

    head = model.lm_head
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    layer_params = sum(m.out_features * m.in_features for m in linears if m is not head)
    head_params = head.out_features * head.in_features

    def best_pass(count: int, repeats: int) -> float:
        inputs = {m.in_features: torch.randn(count, m.in_features) for m in linears}
        inputs = {w: x.to(DEVICE, model.compute_dtype) for w, x in inputs.items()}
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first pass warms the kernels
                synchronize()
                started = time.perf_counter()
                for module in linears:
                    module(inputs[module.in_features])
                synchronize()
                best = min(best, time.perf_counter() - started)
        return best

    # the step kernel's packed matrices, [tiles, in / 32, 16, 32] each, as a decode reads them
    step = model.step_kernel
    step_matrices = None if step is None else [t for t in step.tensors if t.dim() == 4]

    def single_row_pass(repeats: int) -> float:
        """The pass a one-row decode step makes: the few-row kernel on the step kernel's
        packed matrices where the model has it, else the Linear modules at one row."""
        from engine.models import decode_attention

        kernel = decode_attention.load_linear_rows()
        if step_matrices is None or kernel is None:
            return best_pass(1, repeats)
        depth = decode_attention.LINEAR_DEPTH
        inputs = {
            t.shape[1]: torch.randn(1, t.shape[1] * depth).to(torch.bfloat16) for t in step_matrices
        }
        best = float("inf")
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for t in step_matrices:
                kernel(inputs[t.shape[1]], t, t.shape[0] * decode_attention.LINEAR_TILE)
            best = min(best, time.perf_counter() - started)
        return best

    def weights_read(repeats: int) -> float | None:
        """torch's sum over the step kernel's packed matrices, one after another."""
        if step_matrices is None:
            return None
        best = float("inf")
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for t in step_matrices:
                t.sum()
            best = min(best, time.perf_counter() - started)
        return sum(t.numel() * t.element_size() for t in step_matrices) / best / 1e9

    batched = best_pass(rows, 3)
    return KernelCeilings(
        layer_params=layer_params,
        head_params=head_params,
        batched_flops=2 * rows * (layer_params + head_params) / batched,
        batched_rows=rows,
        gemv_seconds=single_row_pass(10),
        weights_read_gbs=weights_read(5),
    )


def in_process(options: Options) -> InProcessResult:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sequence import SamplingParams, Sequence

    engine = LLMEngine(
        EngineConfig(
            model=options.model, dtype=options.dtype, max_model_len=1024, device=DEVICE.type
        )
    )
    engine.load()
    engine.warm_up()

    def generate(
        prompt: list[int], max_tokens: int, reader: WindowReader | None = None
    ) -> tuple[float, float, int, list[DecodeWindow]]:
        """(seconds for the first step, seconds for the rest, tokens after the first, and
        with a reader the windows of DECODE_WINDOW steps paired with reads around them,
        whose time is not counted in the rest)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        seq = Sequence(token_ids=prompt, params=params)
        engine.scheduler.add(seq)
        started = time.perf_counter()
        engine._step(record=False)  # the whole prompt fits one step: prefill + first token
        first = time.perf_counter() - started
        rest, rates, reads = 0.0, [], [reader()] if reader else []
        while not seq.is_finished:
            steps, started = 0, time.perf_counter()
            while not seq.is_finished and (reader is None or steps < DECODE_WINDOW):
                engine._step(record=False)
                steps += 1
            elapsed = time.perf_counter() - started
            rest += elapsed
            if reader is not None and steps == DECODE_WINDOW:  # whole windows only
                rates.append(steps / elapsed)
                reads.append(reader())
        engine.block_manager.free(seq)
        windows = [
            DecodeWindow(rate, max(before, after))
            for rate, before, after in zip(rates, reads, reads[1:], strict=False)
        ]
        return first, rest, seq.num_output_tokens - 1, windows

    prefill = [
        generate(prompt, 1)[0]
        for prompt in random_prompts(3, options.ttft_prompt, seed=7)  # no prefix cache hits
    ]
    # The machine's read bandwidth moves run to run (a shared VM): each decode run sits
    # between two bandwidth reads, and the best decode is compared with the best read.
    bandwidths, decode_rates = [read_bandwidth_gbs()], []
    reader, windows = WindowReader(), []
    for _ in range(DECODE_ROUNDS):
        _, decode_seconds, decode_tokens, _ = generate(
            engine.tokenizer.encode(DECODE_PROMPT), options.decode_tokens
        )
        decode_rates.append(decode_tokens / decode_seconds)
        bandwidths.append(read_bandwidth_gbs())
        windows += generate(engine.tokenizer.encode(DECODE_PROMPT), options.decode_tokens, reader)[
            3
        ]
    del reader
    return InProcessResult(
        decode_rates,
        bandwidths,
        windows,
        engine.weight_bytes,
        statistics.median(prefill),
        measure_ceilings(engine.runner.model, options.max_num_batched_tokens),
        engine.model_config,
        engine.runner.model,
    )


def llama_cpp_decode(options: Options) -> float | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    from engine.loader import smollm2_path

    llm = llama_cpp.Llama(str(smollm2_path()), n_threads=options.threads, verbose=False)
    llm("Hello", max_tokens=4)
    started = time.perf_counter()
    out = llm(DECODE_PROMPT, max_tokens=options.decode_tokens, temperature=0)
    return int(out["usage"]["completion_tokens"]) / (time.perf_counter() - started)


# ---- the whole measurement ----------------------------------------------------------------
def measure(options: Options) -> dict[str, Any]:
    """Run every measurement within options.budget_s, print as it goes, return the report."""
    started = time.monotonic()
    end = started + options.budget_s
    torch.set_num_threads(options.threads)
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "none"
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, threads "
          f"{options.threads}, GPU {gpu}, dtype {options.dtype}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    notes = [
        f"{os.cpu_count()} CPUs, {options.threads} threads, GPU {gpu}, torch {torch.__version__}, "
        f"dtype {options.dtype}; load average {os.getloadavg()[0]:.1f} at the start "
        "(other work on the machine slows every figure)"
    ]
    workload = make_workload(options.requests, options.prompt_range, options.output_range)

    local = in_process(options)
    gc.collect()
    bandwidth = max(local.bandwidths)
    roofline = bandwidth * 1e9 / local.weight_bytes
    print(f"single stream decode ({options.dtype}): {local.decode_rate:.1f} tok/s, best of "
          f"{' '.join(f'{r:.1f}' for r in local.decode_rates)}; weights "
          f"{local.weight_bytes / 1e6:.0f} MB, read bandwidth {bandwidth:.1f} GB/s, best of "
          f"{' '.join(f'{b:.1f}' for b in local.bandwidths)} (read around each decode run); "
          f"roofline {roofline:.1f} tok/s", flush=True)  # fmt: skip
    middle = local.median_window()
    window_ratios = sorted(w.ratio(local.weight_bytes) for w in local.windows)
    listed = " ".join(f"{r:.2f}" for r in window_ratios)
    print(f"RATIO single-stream decode / memory roofline = "
          f"{middle.ratio(local.weight_bytes):.2f} (target >= 0.8): the median of "
          f"{len(window_ratios)} windows of {DECODE_WINDOW} decode steps, each against the "
          f"faster of the reads right before and after it ({listed}); the median window "
          f"ran {middle.rate:.1f} tok/s beside reads of {middle.bandwidth:.1f} GB/s",
          flush=True)  # fmt: skip
    print(f"the best decode run against the best read of the whole measurement: "
          f"{local.decode_rate / roofline:.2f}", flush=True)  # fmt: skip
    notes.append(
        f"decode / roofline: the median of {len(window_ratios)} windows of {DECODE_WINDOW} "
        "decode steps, each against the faster read right before or after it (the read "
        "bandwidth of a shared VM moves by 2x within seconds); the best decode run against "
        f"the best read: {local.decode_rate / roofline:.2f}"
    )
    round_ratios = local.round_ratios()
    print(f"each decode run against the faster read either side of it: "
          f"{' '.join(f'{r:.2f}' for r in round_ratios)}", flush=True)  # fmt: skip
    notes.append(
        "decode / roofline per decode run, against the faster read either side of it: "
        + " ".join(f"{r:.2f}" for r in round_ratios)
    )
    ceilings = local.ceilings
    gemv_rate = 1 / ceilings.gemv_seconds
    print(f"kernel ceiling, decode: one single-row pass through every weight matrix takes "
          f"{ceilings.gemv_seconds * 1000:.1f} ms = {gemv_rate:.1f} tok/s = "
          f"{gemv_rate / roofline:.2f} of the roofline; the decode reaches "
          f"{local.decode_rate / gemv_rate:.2f} of it", flush=True)  # fmt: skip
    if ceilings.weights_read_gbs is not None:
        # A fresh 512 MiB buffer's read moved between 28 and 56 GB/s from one allocation to
        # the next on the AMD EPYC VM while the weights read 23 to 25: this says which.
        weights_rate = ceilings.weights_read_gbs * 1e9 / local.weight_bytes
        print(f"the weights where they lie: torch's sum over the matrices the decode reads "
              f"{ceilings.weights_read_gbs:.1f} GB/s ({ceilings.weights_read_gbs / bandwidth:.2f} "
              f"of the roofline's read); the decode reaches {local.decode_rate / weights_rate:.2f} "
              "of that rate", flush=True)  # fmt: skip
    config = local.config
    ceiling_seconds = (
        ceilings.useful_flops(workload.prompts, workload.max_tokens, config)
        / ceilings.batched_flops
    )
    ceiling_rate = sum(workload.max_tokens) / ceiling_seconds
    print(f"kernel ceiling, serving: the matmuls run {ceilings.batched_flops / 1e9:.0f} GFLOP/s "
          f"at {ceilings.batched_rows} rows; the workload's FLOPs at that rate, all else free: "
          f"{ceiling_seconds:.0f}s = {ceiling_rate:.0f} useful tok/s", flush=True)  # fmt: skip
    print(f"in-process prefill + first token, {options.ttft_prompt}-token prompt: "
          f"{local.prefill_seconds * 1000:.0f} ms", flush=True)  # fmt: skip

    # The engine over HTTP; leave time for HF's share and for draining in-flight requests.
    reference_share = 0.0 if options.skip_reference else 0.3 * options.budget_s
    process, base = start_engine(options)
    try:
        ttft_one = [asyncio.run(run_ttft(base, [p]))[0]
                    for p in random_prompts(3, options.ttft_prompt, seed=11)]  # fmt: skip
        ttft_group = asyncio.run(
            run_ttft(base, random_prompts(options.ttft_many, options.ttft_prompt, seed=12))
        )
        submit_deadline = end - reference_share - 0.15 * options.budget_s
        before = httpx.get(f"{base}/admin/stats", headers=ADMIN_HEADERS, timeout=10).json()
        serving = asyncio.run(run_serving(base, workload, options.in_flight, submit_deadline))
        stats = httpx.get(f"{base}/admin/stats", headers=ADMIN_HEADERS, timeout=10).json()
    finally:
        stop_engine(process)
    engine_rate = serving.tokens / serving.seconds
    print(f"engine serving: {serving.submitted} of {len(workload.prompts)} requests, "
          f"{options.in_flight} in flight, {serving.tokens} useful tokens in "
          f"{serving.seconds:.1f}s = {engine_rate:.1f} tok/s (prefix hits "
          f"{stats.get('prefix_cache_hits_total', 0)}, preemptions "
          f"{stats.get('num_preemptions_total', 0)}, decode graphs "
          f"{stats.get('decode_graphs', 0)})", flush=True)  # fmt: skip
    print(f"engine steps of the serving run, forward pass and sampling, by the way they ran: "
          f"{step_breakdown(before, stats)}", flush=True)  # fmt: skip
    if serving.submitted < len(workload.prompts):
        notes.append(
            f"serving: the time budget stopped submissions after {serving.submitted} of "
            f"{len(workload.prompts)} requests; the rate is over those that ran"
        )

    reference: ReferenceResult | None = None
    ref_dtype, ref_reason = reference_dtype(options)
    ref_name = str(ref_dtype).removeprefix("torch.")
    if not options.skip_reference:
        if ref_reason is not None:
            probe = reference_forward_seconds(options, options.ttft_prompt)
            print(f"HF reference dtype: {ref_reason}. One HF forward of a "
                  f"{options.ttft_prompt}-token prompt: float32 {probe['float32']:.2f}s, "
                  f"bfloat16 {probe['bfloat16']:.2f}s "
                  f"({probe['bfloat16'] / probe['float32']:.1f}x slower)", flush=True)  # fmt: skip
            notes.append(
                f"HF reference in float32, not {options.dtype}: {ref_reason}; one HF "
                f"forward of a {options.ttft_prompt}-token prompt took "
                f"{probe['bfloat16']:.2f}s in bfloat16 against {probe['float32']:.2f}s"
            )
        reference = run_reference(options, workload, ref_dtype, end - 10)
        gc.collect()
        ref_rate = reference.tokens / reference.seconds
        print(f"HF generate ({ref_name}, static batches of {options.batch_size}, first "
              f"{reference.requests} requests): {reference.tokens} useful tokens in "
              f"{reference.seconds:.1f}s = {ref_rate:.1f} tok/s", flush=True)  # fmt: skip
        print(f"RATIO serving throughput engine ({options.dtype})/HF ({ref_name}) = "
              f"{engine_rate / ref_rate:.2f}x (target >= 5x)", flush=True)  # fmt: skip
        # The kernels again, after HF: the machine's speed drifts, and the ceiling takes
        # its best moment.
        again = measure_ceilings(local.model, options.max_num_batched_tokens).batched_flops
        print(f"matmuls at {ceilings.batched_rows} rows, timed again after HF: "
              f"{again / 1e9:.0f} GFLOP/s", flush=True)  # fmt: skip
        if again > ceilings.batched_flops:
            ceiling_rate *= again / ceilings.batched_flops
            ceilings.batched_flops = again
        # What HF computed (padded prompts, every row to the batch's last step) against
        # the least the same requests need: the ratio's share that scheduling can win.
        done = reference.requests
        hf_flops = sum(ceilings.flops(rows, length + steps - 1, steps, config)
                       for rows, length, steps in reference.batches)  # fmt: skip
        hf_useful = ceilings.useful_flops(
            workload.prompts[:done], workload.max_tokens[:done], config
        )
        engine_flops = ceilings.useful_flops(
            workload.prompts[: serving.submitted], workload.max_tokens[: serving.submitted], config
        )
        hf_rate = hf_flops / reference.seconds
        engine_useful_rate = engine_flops / serving.seconds
        print(f"work: HF computed {hf_flops / 1e12:.1f} TFLOP for {hf_useful / 1e12:.1f} TFLOP "
              f"of useful work ({hf_flops / hf_useful:.2f}x) at {hf_rate / 1e9:.0f} GFLOP/s; "
              f"the engine's useful work ran at {engine_useful_rate / 1e9:.0f} GFLOP/s; "
              f"engine/HF ~ {hf_flops / hf_useful:.2f} (work saved) x "
              f"{engine_useful_rate / hf_rate:.2f} (FLOP rate)", flush=True)  # fmt: skip
        print(f"RATIO kernel ceiling/HF = {ceiling_rate / ref_rate:.2f}x: the most any "
              "scheduler could reach with these matmul kernels on this machine; the engine "
              f"reaches {engine_rate / ceiling_rate:.2f} of the ceiling", flush=True)  # fmt: skip
        notes.append(
            f"HF reference rate measured on its first {reference.requests} requests "
            f"(static batches of {options.batch_size}) to fit the time budget; the engine "
            f"served {serving.submitted} requests of the same workload"
            + ("; HF generate hit its max_time" if reference.hit_time_limit else "")
        )

    cpp = llama_cpp_decode(options)
    if cpp is None:
        print("llama.cpp: llama-cpp-python not installed, skipped")
    else:
        print(f"llama.cpp decode: {cpp:.1f} tok/s; RATIO engine/llama.cpp = "
              f"{local.decode_rate / cpp:.2f}")  # fmt: skip
    ttft_p50 = statistics.median(ttft_group)
    print(f"TTFT 1 request: {statistics.median(ttft_one) * 1000:.0f} ms (median of 3); "
          f"{options.ttft_many} concurrent: p50 {ttft_p50 * 1000:.0f} ms, max "
          f"{max(ttft_group) * 1000:.0f} ms", flush=True)  # fmt: skip
    notes.append(f"load average {os.getloadavg()[0]:.1f} at the end; step took "
                 f"{time.monotonic() - started:.0f}s")  # fmt: skip

    shape = f"{len(workload.prompts)} requests, {options.in_flight} in flight"
    figures: list[dict[str, Any]] = [
        {
            "name": f"serving throughput ({shape}, HTTP)",
            "value": engine_rate,
            "unit": "useful tok/s",
            "reference": f"HF transformers generate, static batches of {options.batch_size}, "
            f"{ref_name}, same weights",
            "reference_value": None if reference is None else reference.tokens / reference.seconds,
            "target": "ratio >= 5",
            **({"skipped": "--skip-reference"} if reference is None else {}),
        },
        {
            "name": f"single-stream decode ({options.dtype}), the median of "
            f"{len(local.windows)} windows of {DECODE_WINDOW} steps",
            "value": middle.rate,
            "unit": "tok/s",
            "reference": f"memory roofline: {local.weight_bytes / 1e6:.0f} MB of weights at "
            f"{middle.bandwidth:.1f} GB/s, the faster read right before or after the window",
            "reference_value": middle.bandwidth * 1e9 / local.weight_bytes,
            "target": "ratio >= 0.8",
        },
        {
            "name": "serving throughput vs the kernel ceiling",
            "value": engine_rate,
            "unit": "useful tok/s",
            "reference": f"the workload's FLOPs at the matmuls' measured "
            f"{ceilings.batched_flops / 1e9:.0f} GFLOP/s ({ceilings.batched_rows} rows), "
            "attention and all else free",
            "reference_value": ceiling_rate,
            "target": "reported",
        },
        {
            "name": f"single-stream decode vs the kernel ceiling ({options.dtype})",
            "value": local.decode_rate,
            "unit": "tok/s",
            "reference": "one single-row pass through every weight matrix, nothing else",
            "reference_value": gemv_rate,
            "target": "reported",
        },
        {
            "name": "single-stream decode vs llama.cpp (same GGUF)",
            "value": local.decode_rate,
            "unit": "tok/s",
            "reference": "llama-cpp-python, same thread count",
            "reference_value": cpp,
            "target": "reported",
            **({"skipped": "llama-cpp-python not installed"} if cpp is None else {}),
        },
        {
            "name": f"TTFT, 1 request ({options.ttft_prompt}-token prompt, HTTP streaming)",
            "value": statistics.median(ttft_one) * 1000,
            "unit": "ms",
            "reference": "the engine's prefill + first token for such a prompt, in-process",
            "reference_value": local.prefill_seconds * 1000,
            "target": "ratio <= 1.5",
        },
        {
            "name": f"TTFT p50, {options.ttft_many} concurrent requests "
            f"({options.ttft_prompt}-token prompts)",
            "value": ttft_p50 * 1000,
            "unit": "ms",
            "reference": f"{options.ttft_many} in-process prefills one after another",
            "reference_value": options.ttft_many * local.prefill_seconds * 1000,
            "target": "ratio <= 1",
        },
    ]
    return {"figures": figures, "notes": notes}


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figures = [f for f in report["figures"] if not f.get("skipped") and f.get("reference_value")]
    figure, axes = plt.subplots(1, len(figures), figsize=(3.2 * len(figures), 3.4))
    for axis, item in zip(figure.axes if len(figures) > 1 else [axes], figures, strict=True):
        axis.bar(["engine", "reference"], [item["value"], item["reference_value"]],
                 color=["tab:blue", "tab:grey"])  # fmt: skip
        axis.set_title(item["name"].split(" (")[0], fontsize=9)
        axis.set_ylabel(item["unit"], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    """The bench step (docs/loadgen.md): measure within the budget, plot, return figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    options = QUICK if quick else Options()
    # Leave a margin inside the step's limit for start-up and the plot.
    report = measure(replace(options, budget_s=options.budget_s - 20))
    if plot(report, out_dir / "engine_bench.png"):
        report["plots"] = ["engine_bench.png"]
    return report


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
    parser.add_argument("--budget", type=float, help="seconds (default: the step's budget)")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument(
        "--reference-dtype", choices=["float32", "bfloat16"],
        help="HF's dtype (default: the engine's, or float32 on a CPU without native bf16)",
    )  # fmt: skip
    args = parser.parse_args()
    options = replace(
        QUICK if args.quick else Options(),
        model=args.model, dtype=args.dtype, threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_mb=args.kv_cache_mb,
        skip_reference=args.skip_reference, reference_dtype=args.reference_dtype,
    )  # fmt: skip
    if args.budget:
        options.budget_s = args.budget
    measure(options)


if __name__ == "__main__":
    main()
