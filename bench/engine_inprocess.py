"""The engine benchmark's in-process figures: read bandwidth, single-stream decode against
the memory roofline, prefill time, and the kernel ceilings of this machine."""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from bench.engine_workload import (
    DECODE_PROMPT,
    DECODE_ROUNDS,
    DECODE_WINDOW,
    DEVICE,
    WINDOW_READ_MIB,
    Options,
    random_prompts,
    synchronize,
)


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

    # one token per step: these figures are the kernels' (bench/spec_bench.py measures drafts)
    engine = LLMEngine(
        EngineConfig(
            model=options.model, dtype=options.dtype, max_model_len=1024, device=DEVICE.type,
            speculative="off",
        )
    )  # fmt: skip
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


# Run by llama-cpp-python's own environment: argv model path, threads, tokens, prompt.
LLAMA_CPP_DECODE = """
import json, sys, time
import llama_cpp
path, threads, tokens, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = llama_cpp.Llama(path, n_threads=threads, verbose=False)
llm("Hello", max_tokens=4)
no_eos = {llm.token_eos(): -1000.0}  # every token decoded, as the engine's ignore_eos
started = time.perf_counter()
out = llm(prompt, max_tokens=tokens, temperature=0, logit_bias=no_eos)
print(json.dumps(out["usage"]["completion_tokens"] / (time.perf_counter() - started)))
"""


def llama_cpp_decode(options: Options, timeout: float = 600) -> tuple[float | None, str]:
    """llama.cpp's single-stream decode of the same GGUF, same threads: in this process
    where llama-cpp-python is installed, else in the environment the llama.cpp backend
    runs in (scripts/ensure_engine_env.sh llama.cpp); (None, why) where neither is or it
    takes over `timeout` seconds."""
    from agent.engines.llamacpp import llama_cpp_env_is_built, llama_cpp_python
    from engine.loader import smollm2_path

    arguments = [str(smollm2_path()), str(options.threads), str(options.decode_tokens)]
    if importlib.util.find_spec("llama_cpp") is not None:
        command = [sys.executable, "-c", LLAMA_CPP_DECODE, *arguments, DECODE_PROMPT]
    elif llama_cpp_env_is_built():
        command = [llama_cpp_python(), "-c", LLAMA_CPP_DECODE, *arguments, DECODE_PROMPT]
    else:
        return None, "llama-cpp-python not installed (make engine-envs builds its environment)"
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=environment, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, f"llama.cpp decode did not finish within {timeout:.0f} s"
    if done.returncode != 0:
        return None, f"llama.cpp decode failed: {done.stderr.strip().splitlines()[-1:]}"
    return float(done.stdout.strip().splitlines()[-1]), ""
