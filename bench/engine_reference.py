"""The HF transformers reference of the engine benchmark: `generate` in static batches on
the same weights, and its dtype where the CPU has no native bf16."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.engine_workload import (
    DEVICE,
    SMOLLM2_EOS,
    Options,
    Workload,
    random_prompts,
    synchronize,
)


def reference_model(model: str, dtype: torch.dtype) -> Any:
    from engine.loader import load_checkpoint, resolve_model_path

    return reference_from_checkpoint(load_checkpoint(resolve_model_path(model)), dtype, DEVICE)


def reference_from_checkpoint(checkpoint: Any, dtype: torch.dtype, device: Any) -> Any:
    """HF transformers' Llama on the weights our engine loaded (the tests compare to it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

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
    return reference.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


@dataclass(slots=True)
class ReferenceResult:
    seconds: float
    tokens: int
    requests: int
    hit_time_limit: bool
    # per static batch: (rows, padded prompt length, steps generated): the work HF did
    batches: list[tuple[int, int, int]] = field(default_factory=list)


def run_reference(
    options: Options,
    workload: Workload,
    dtype: torch.dtype,
    deadline: float,
    batch_size: int | None = None,
    batches: int | None = None,
    ignore_eos: bool = False,
    model: Any = None,
) -> ReferenceResult:
    """HF generate in static batches (left padded) of `batch_size` (default
    options.batch_size), the first `batches` of them (default options.reference_batches);
    useful = tokens up to each request's own limit or EOS (with ignore_eos: to its limit,
    as the engine serves with ignore_eos). `model`: one already loaded, reused."""
    model = reference_model(options.model, dtype) if model is None else model
    max_time = max(10.0, deadline - time.monotonic())
    eos = SMOLLM2_EOS
    model.generation_config.eos_token_id = None if ignore_eos else eos
    useful = requests = 0
    hit_time_limit = False
    shapes: list[tuple[int, int, int]] = []
    size = batch_size or options.batch_size
    count = batches or options.reference_batches
    synchronize()  # the model's move to the device is not HF's time
    started = time.perf_counter()
    for first in range(0, min(len(workload.prompts), size * count), size):
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
        all_stopped = not ignore_eos and bool((out == eos).any(dim=1).all())
        if out.shape[1] < max(limits) and not all_stopped:
            hit_time_limit = True
        shapes.append((len(prompts), longest, int(out.shape[1])))
        for row, limit in enumerate(limits):
            tokens = out[row, :limit].tolist()
            stop = not ignore_eos and eos in tokens
            useful += tokens.index(eos) + 1 if stop else len(tokens)
        requests += len(prompts)
        if hit_time_limit:
            break
    return ReferenceResult(time.perf_counter() - started, useful, requests, hit_time_limit, shapes)


# HF's static batch sizes on CUDA: generate there runs its batch in parallel, so a larger
# batch is faster per token and the reference takes the faster of the two (at 64 alone an
# H200's ratio read 7x higher than against HF's best). On CPU the one of options.batch_size.
CUDA_REFERENCE_BATCHES = (64, 256)


def reference_batch_sizes(options: Options) -> tuple[int, ...]:
    return CUDA_REFERENCE_BATCHES if DEVICE.type == "cuda" else (options.batch_size,)


@dataclass(slots=True)
class BestReference:
    best: ReferenceResult
    batch_size: int  # the best one's
    by_batch_size: dict[int, ReferenceResult]

    @property
    def rate(self) -> float:
        return self.best.tokens / self.best.seconds


def best_reference(
    options: Options,
    workload: Workload,
    dtype: torch.dtype,
    deadline: float,
    sizes: tuple[int, ...],
    ignore_eos: bool = False,
) -> BestReference:
    """HF at each static batch size on the same first requests (as many as the largest
    size's options.reference_batches cover; each size gets an equal share of the time
    left), the model loaded once; the one of the most useful tokens per second is best."""
    model = reference_model(options.model, dtype)
    if DEVICE.type == "cuda":  # CUDA loads each kernel at its first use: not HF's rate
        with torch.inference_mode():
            model.generate(input_ids=torch.ones(2, 8, dtype=torch.long, device=DEVICE),
                           max_new_tokens=4, do_sample=False, pad_token_id=SMOLLM2_EOS)  # fmt: skip
    covered = max(sizes) * options.reference_batches
    results: dict[int, ReferenceResult] = {}
    for index, size in enumerate(sizes):
        share = (deadline - time.monotonic()) / (len(sizes) - index)
        results[size] = run_reference(
            options, workload, dtype, time.monotonic() + share, batch_size=size,
            batches=max(1, covered // size), ignore_eos=ignore_eos, model=model,
        )  # fmt: skip
    del model
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()  # its weights and KV cache, for what runs next
    size = max(results, key=lambda s: results[s].tokens / results[s].seconds)
    return BestReference(results[size], size, results)


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
