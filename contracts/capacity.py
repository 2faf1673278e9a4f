"""The capacity model: how much memory a version needs, read from its artifact's headers.

A version's footprint is three figures, computed once when it is registered:

- weights: the parameter count (every floating-point tensor in the GGUF file or the
  folder's safetensors files, from their headers alone) times the bytes per parameter
  the engine keeps them in: 4 for float32, 2 for bfloat16, 1 for int8 (its per-row
  scales are left to the headroom). llama.cpp serves a GGUF file's tensors as they are
  stored, so its weights are the file's tensor bytes.
- KV cache: bytes per token (2 x layers x KV heads x head dim x element bytes: 4 for a
  float32 version, else 2) times the tokens the cache holds: max_model_len x max_num_seqs,
  every sequence at full length. The built-in engine allocates its pool up front from
  its own arguments instead, so for it the pool counts: `num_blocks` x `kv_block_size`
  tokens, or `kv_cache_memory_mb`, or that argument's default. An encoder (BERT) keeps
  no cache.
- headroom: HEADROOM_PERCENT of weights plus KV, for activations, logits and the
  allocator's slack. The runtime itself (Python, PyTorch, a CUDA context) is not counted:
  an operator reserves it by capping what an agent offers (`--memory-limit-bytes`).

vLLM and SGLang take a fraction of the device for their pool (`gpu_memory_percent`,
`mem_fraction_static_percent`) whatever the configuration needs: for them the footprint
is what the configuration needs, a lower bound. Pure functions, no Django: the registry
computes footprints, agents read them from load commands.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from contracts import engines

HEADROOM_PERCENT = 10
# The built-in engine's KV pool when a version names neither num_blocks nor
# kv_cache_memory_mb (engine.config.EngineConfig.kv_cache_memory_mb).
BUILTIN_KV_CACHE_MB = 1024
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}
SAFETENSORS_MAX_HEADER = 100 * 2**20
FLOAT_SAFETENSORS_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
# Models that encode a whole input at once and keep no KV cache between steps.
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "mpnet"})
GIB = 2**30


class CapacityError(ValueError):
    """The artifact's headers do not say what the footprint needs; the message says why."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What an artifact's headers say about memory."""

    parameters: int
    tensor_bytes: int  # the tensors as stored (quantized ones included)
    layers: int
    kv_heads: int
    head_dim: int
    has_kv_cache: bool


@dataclass(frozen=True, slots=True)
class Footprint:
    """A version's memory need, in bytes, with how it was reckoned."""

    weight_bytes: int
    kv_bytes: int
    headroom_bytes: int
    total_bytes: int
    parameters: int
    bytes_per_parameter: float
    kv_bytes_per_token: int
    kv_tokens: int
    kv_basis: str  # which figure sized the KV cache

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{gib(self.total_bytes)} (weights {gib(self.weight_bytes)}, "
            f"KV {gib(self.kv_bytes)}, headroom {gib(self.headroom_bytes)})"
        )


def gib(value: int) -> str:
    """Bytes as GiB with two decimals: how people read these figures."""
    return f"{value / GIB:.2f} GiB"


def footprint_total(stored: Any) -> int | None:
    """The total bytes of a stored footprint (a version's JSON), or None when it has none."""
    total = stored.get("total_bytes") if isinstance(stored, Mapping) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None


def footprint_describe(stored: Mapping[str, Any]) -> str:
    """A stored footprint (Footprint.to_dict()) as Footprint.describe() words it."""
    return Footprint(**{name: stored[name] for name in Footprint.__slots__}).describe()


# Reading headers.


def _gguf_value(fields: Mapping[str, Any], key: str) -> Any:
    field = fields.get(key)
    return None if field is None else field.contents()


def gguf_shape(path: Path) -> ModelShape:
    """The shape of a GGUF file: tensor shapes and counts from its header, the attention
    geometry from its metadata (`<arch>.block_count`, `.attention.head_count_kv`, ...)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, struct.error, IndexError, KeyError, TypeError) as exc:
        raise CapacityError(f"not a readable GGUF file: {exc}") from exc
    arch = _gguf_value(reader.fields, "general.architecture")
    if not isinstance(arch, str):
        raise CapacityError("the GGUF file names no general.architecture")

    def number(name: str) -> int | None:
        value = _gguf_value(reader.fields, f"{arch}.{name}")
        if isinstance(value, list):  # per-layer values (some architectures): the largest
            value = max(value, default=None)
        return (
            int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        )

    layers, heads = number("block_count"), number("attention.head_count")
    hidden = number("embedding_length")
    if not layers or not heads or not hidden:
        raise CapacityError(
            f"the GGUF metadata lacks {arch}.block_count, .attention.head_count "
            "or .embedding_length"
        )
    kv_heads = number("attention.head_count_kv") or heads
    head_dim = number("attention.key_length") or hidden // heads
    # Every tensor counts: a quantized one holds float weights the engine dequantizes.
    parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    tensor_bytes = sum(int(tensor.n_bytes) for tensor in reader.tensors)
    return ModelShape(
        parameters=parameters,
        tensor_bytes=tensor_bytes,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        has_kv_cache=True,
    )


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header: 8 bytes of little-endian length, then the JSON
    (read by hand: the control plane's image carries no safetensors package)."""
    try:
        with path.open("rb") as file:
            head = file.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = (
                file.read(length)
                if length is not None and length <= SAFETENSORS_MAX_HEADER
                else b""
            )
    except OSError as exc:
        raise CapacityError(f"{path.name}: {exc}") from exc
    if length is None:
        raise CapacityError(f"{path.name}: shorter than a safetensors header")
    if length > SAFETENSORS_MAX_HEADER:
        raise CapacityError(f"{path.name}: header of {length} bytes is too large")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CapacityError(f"{path.name}: the header is not JSON") from exc
    if not isinstance(header, dict):
        raise CapacityError(f"{path.name}: the header is not a JSON object")
    return header


def _tensor_counts(header: Mapping[str, Any], name: str) -> tuple[int, int]:
    """(floating-point parameters, bytes of every tensor) of one safetensors header."""
    parameters = tensor_bytes = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(
            isinstance(size, int) and size >= 0 for size in shape
        ):
            raise CapacityError(f"{name}: tensor {key!r} has no valid shape")
        if (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(offset, int) for offset in offsets)
        ):
            tensor_bytes += max(0, offsets[1] - offsets[0])
        if info.get("dtype") in FLOAT_SAFETENSORS_DTYPES:  # integer tensors are buffers
            parameters += math.prod(shape)
    return parameters, tensor_bytes


def folder_shape(config: Mapping[str, Any], weight_files: Iterable[Path]) -> ModelShape:
    """The shape of a Hugging Face folder: parameters from its safetensors headers, the
    attention geometry from its config.json."""

    def number(*names: str) -> int | None:
        for name in names:
            value = config.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    parameters = tensor_bytes = 0
    files = list(weight_files)
    if not files:
        raise CapacityError("the folder has no .safetensors file")
    for path in files:
        counted, stored = _tensor_counts(safetensors_header(path), path.name)
        parameters += counted
        tensor_bytes += stored
    layers = number("num_hidden_layers", "n_layer", "num_layers")
    heads = number("num_attention_heads", "n_head")
    hidden = number("hidden_size", "n_embd", "d_model")
    if not layers or not heads or not hidden:
        raise CapacityError(
            "config.json lacks num_hidden_layers, num_attention_heads or hidden_size"
        )
    return ModelShape(
        parameters=parameters,
        tensor_bytes=tensor_bytes,
        layers=layers,
        kv_heads=number("num_key_value_heads") or heads,
        head_dim=number("head_dim") or hidden // heads,
        has_kv_cache=config.get("model_type") not in ENCODER_MODEL_TYPES,
    )


# The footprint.


def _kv_tokens(
    serving_config: Mapping[str, Any], engine: str, engine_args: Mapping[str, Any], per_token: int
) -> tuple[int, str]:
    """The tokens the KV cache holds, and which figure said so."""
    if engine == engines.BUILTIN:
        num_blocks = engine_args.get("num_blocks") or 0
        if num_blocks:
            return num_blocks * serving_config["kv_block_size"], "engine_args.num_blocks"
        mb = engine_args.get("kv_cache_memory_mb")
        basis = "engine_args.kv_cache_memory_mb"
        if not mb:
            mb, basis = BUILTIN_KV_CACHE_MB, "the built-in engine's default KV pool"
        # the engine's own arithmetic: whole blocks that fit in the pool
        block = per_token * serving_config["kv_block_size"]
        blocks = max(1, mb * 2**20 // block)
        return blocks * serving_config["kv_block_size"], basis
    if engine == engines.LLAMA_CPP:  # one context of n_ctx tokens, shared by its slots
        return serving_config["max_model_len"], "max_model_len"
    tokens = serving_config["max_model_len"] * serving_config["max_num_seqs"]
    return tokens, "max_model_len x max_num_seqs"


def footprint_compute(
    shape: ModelShape,
    *,
    serving_config: Mapping[str, Any],
    engine: str,
    engine_args: Mapping[str, Any],
) -> Footprint:
    """What serving `shape` with this configuration, engine and arguments needs."""
    dtype = serving_config["dtype"]
    if engine == engines.LLAMA_CPP:
        weight_bytes = shape.tensor_bytes  # served as stored
        kv_element = 2  # its f16 cache (q8_0 and q4_0 caches are smaller: counted as f16)
    else:
        weight_bytes = shape.parameters * WEIGHT_BYTES[dtype]
        kv_element = 4 if dtype == "float32" else 2
    per_token = (
        2 * shape.layers * shape.kv_heads * shape.head_dim * kv_element if shape.has_kv_cache else 0
    )
    if per_token:
        kv_tokens, kv_basis = _kv_tokens(serving_config, engine, engine_args, per_token)
    else:
        kv_tokens, kv_basis = 0, "no KV cache (an encoder)"
    kv_bytes = per_token * kv_tokens
    headroom = -(-(weight_bytes + kv_bytes) * HEADROOM_PERCENT // 100)
    return Footprint(
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
        headroom_bytes=headroom,
        total_bytes=weight_bytes + kv_bytes + headroom,
        parameters=shape.parameters,
        bytes_per_parameter=round(weight_bytes / shape.parameters, 4) if shape.parameters else 0.0,
        kv_bytes_per_token=per_token,
        kv_tokens=kv_tokens,
        kv_basis=kv_basis,
    )
