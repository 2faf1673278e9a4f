"""The engine's bf16 CPU kernels (decode_attention.c), built once per machine: the fused
decode attention, the small ops fused between the matmuls, a linear layer for a decode
step's rows (on tiles where the CPU has avx512_bf16: AMX's, or their product on
vdpbf16ps) and the whole decode step in one call.

In PyTorch ops a decode step's K crosses memory three times (the gather reads it and
writes a copy, the scores read the copy), V once more (embedding_bag), and rows are
padded to their group's longest; the kernel walks each row's own blocks once. It is
built with the system C compiler at first use (about a second) into a cache folder
keyed by the source, the flags and the CPU, and is absent (None) where that fails:
no compiler, no AVX2 and FMA, not Linux on x86. Callers then keep the PyTorch path.
With AVX-512 the kernels compute 16 lanes per instruction (and, with avx512_bf16, the
products on vdpbf16ps); with AVX2 the same code runs on pairs of 8-lane registers.
`FLEET_ENGINE_KERNEL_ARCH` (a GCC `-march` name, `native` by default) builds for an
older CPU than this one: the tests run every code path this CPU can execute that way.

The add + RMSNorm follows HF's order of operations for bf16 (normalise in fp32, round,
then scale by the weight), where PyTorch's `F.rms_norm` rounds once: it is closer to HF
and, at 512 rows, about ten times faster than the eight ops it replaces.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ARCH_VARIABLE = "FLEET_ENGINE_KERNEL_ARCH"
MAX_GROUP = 16
MAX_HEAD_DIM = 256

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_loaded = False


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fleet-engine" / "kernels"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def target_arch() -> str:
    """The `-march` the kernels are built for: `native` unless FLEET_ENGINE_KERNEL_ARCH says."""
    arch = os.environ.get(ARCH_VARIABLE, "").strip() or "native"
    if not re.fullmatch(r"[a-z][a-z0-9.-]{0,39}", arch):
        raise ValueError(f"{ARCH_VARIABLE}={arch!r} is not a GCC -march name (like haswell)")
    return arch


def build() -> Path | None:
    """The compiled library, built now unless a cached one matches; None if it cannot be built."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None or platform.system() != "Linux" or platform.machine() != "x86_64":
        logger.info("fused decode attention off: no C compiler, or not Linux on x86-64")
        return None
    cpu = cpu_flags().split()
    if "avx2" not in cpu or "fma" not in cpu:
        logger.info("fused decode attention off: the CPU has no AVX2 and FMA")
        return None
    flags = [*FLAGS, f"-march={target_arch()}"]
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(flags).encode() + cpu_flags().encode()
    ).hexdigest()[:16]
    target = cache_folder() / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: engines starting together never load half a file.
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    command = [compiler, *flags, "-o", temporary, str(SOURCE)]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(temporary, target)
    except (OSError, subprocess.SubprocessError) as error:
        Path(temporary).unlink(missing_ok=True)
        logger.warning("fused decode attention off: building it failed: %s", error)
        return None
    return target


# C argument types of the kernels' signatures
POINTER, C_INT, C_LONG, C_FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


def bind(library: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
    """One of the library's void functions, with its argument types declared."""
    function = getattr(library, name)
    function.restype = None
    function.argtypes = argtypes
    return function


class DecodeAttentionKernel:
    def __init__(self, library: ctypes.CDLL):
        self.function = bind(
            library,
            "decode_attention_bf16",
            [
                POINTER,  # q
                C_LONG,  # q row stride (elements)
                POINTER,  # layer cache
                POINTER,  # block table
                C_INT,  # block table width
                POINTER,  # lengths
                POINTER,  # out
                *(C_INT,) * 6,  # rows, kv_heads, group, dim, num_blocks, block_size
                C_FLOAT,  # scale
                C_INT,  # threads
            ],
        )

    def __call__(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        block_table: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [rows, heads, dim] bf16 (rows may be strided, heads and dim contiguous);
        cache: one layer's [2 * kv_heads, blocks, block_size, dim] bf16, contiguous;
        block_table: [rows, width] int32; lengths: [rows] int32, keys per row, >= 1.
        Returns [rows, heads, dim] bf16."""
        rows, heads, dim = q.shape
        planes, num_blocks, block_size, _ = cache.shape
        kv_heads = planes // 2
        if q.dtype != torch.bfloat16 or cache.dtype != torch.bfloat16:
            raise ValueError("decode attention needs bf16 q and cache")
        if q.stride(2) != 1 or q.stride(1) != dim or not cache.is_contiguous():
            raise ValueError("decode attention needs q's heads and dim contiguous, a dense cache")
        if not (block_table.is_contiguous() and lengths.is_contiguous()):
            raise ValueError("decode attention needs a contiguous block table and lengths")
        out = torch.empty((rows, heads, dim), dtype=q.dtype)
        self.function(
            q.data_ptr(),
            q.stride(0),
            cache.data_ptr(),
            block_table.data_ptr(),
            block_table.shape[1],
            lengths.data_ptr(),
            out.data_ptr(),
            rows,
            kv_heads,
            heads // kv_heads,
            dim,
            num_blocks,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        return out


class AddRMSNormKernel:
    def __init__(self, library: ctypes.CDLL):
        self.function = bind(
            library,
            "add_rms_norm_bf16",
            [
                POINTER,  # x, or None: normalise the residual as it is
                POINTER,  # residual, updated in place
                POINTER,  # weight
                POINTER,  # out
                C_INT,  # rows
                C_INT,  # dim
                C_FLOAT,  # eps
                C_INT,  # threads
            ],
        )

    def __call__(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (when given, in place, rounded to bf16); returns RMSNorm(residual).
        All bf16 and contiguous: x and residual [rows, dim], weight [dim]."""
        rows, dim = residual.shape
        tensors = (residual, weight) if x is None else (x, residual, weight)
        if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in tensors):
            raise ValueError("add_rms_norm needs contiguous bf16 tensors")
        if dim % 16 or weight.shape != (dim,) or (x is not None and x.shape != residual.shape):
            raise ValueError("add_rms_norm needs [rows, dim] rows, dim a multiple of 16")
        out = torch.empty_like(residual)
        self.function(
            None if x is None else x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out


class RotaryCacheWriteKernel:
    def __init__(self, library: ctypes.CDLL):
        self.function = bind(
            library,
            "rotary_cache_write_bf16",
            [
                POINTER,  # qkv, rotated in place
                C_LONG,  # qkv row stride (elements)
                POINTER,  # cos rows
                POINTER,  # signed sin rows
                POINTER,  # slot mapping
                POINTER,  # layer cache
                C_LONG,  # slots per plane
                *(C_INT,) * 5,  # tokens, heads, kv_heads, dim, threads
            ],
        )

    def __call__(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        cache: torch.Tensor,
        heads: int,
    ) -> None:
        """Rotate q and k in qkv ([tokens, (heads + 2 * kv_heads) * dim] bf16, rows
        contiguous) in place and write k and v to their slots: cos, signed_sin [tokens, dim]
        bf16; slot_mapping [tokens] int64; cache: one layer's [2 * kv_heads, blocks,
        block_size, dim] bf16."""
        tokens = qkv.shape[0]
        planes, num_blocks, block_size, dim = cache.shape
        kv_heads = planes // 2
        if dim % 32 or dim > MAX_HEAD_DIM or qkv.shape[1] != (heads + planes) * dim:
            raise ValueError("rotary_cache_write needs [tokens, (heads + 2 kv) * dim], dim % 32")
        if qkv.stride(1) != 1 or not (cos.is_contiguous() and signed_sin.is_contiguous()):
            raise ValueError("rotary_cache_write needs contiguous rows, cos and sin")
        if cos.numel() != tokens * dim or signed_sin.numel() != tokens * dim:
            raise ValueError("rotary_cache_write needs one cos and sin row per token")
        tensors = (qkv, cos, signed_sin, cache)
        if any(t.dtype != torch.bfloat16 for t in tensors) or not cache.is_contiguous():
            raise ValueError("rotary_cache_write needs bf16 tensors and a dense cache")
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (tokens,):
            raise ValueError("rotary_cache_write needs one int64 slot per token")
        self.function(
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            slot_mapping.contiguous().data_ptr(),
            cache.data_ptr(),
            num_blocks * block_size,
            tokens,
            heads,
            kv_heads,
            dim,
            torch.get_num_threads(),
        )


class SiluMulKernel:
    def __init__(self, library: ctypes.CDLL):
        self.function = bind(library, "silu_mul_bf16", [POINTER, POINTER, C_INT, C_INT, C_INT])

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * width] bf16 rows of [gate | up] -> silu(gate) * up."""
        rows, double = gate_up.shape
        width = double // 2
        if gate_up.dtype != torch.bfloat16 or not gate_up.is_contiguous() or width % 16:
            raise ValueError("silu_mul needs contiguous bf16 [rows, 2 * width], width % 16")
        out = torch.empty((rows, width), dtype=torch.bfloat16)
        self.function(gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
        return out


class ArgmaxKernel:
    def __init__(self, library: ctypes.CDLL):
        self.function = bind(library, "argmax_rows_f32", [POINTER, C_INT, C_INT, POINTER, C_INT])

    def __call__(self, logits: torch.Tensor) -> list[int]:
        """logits: [rows, vocab] fp32, contiguous, on the CPU -> each row's first maximum."""
        rows, vocab = logits.shape
        if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.is_cuda:
            raise ValueError("argmax needs contiguous fp32 logits on the CPU")
        out = torch.empty(rows, dtype=torch.int32)
        self.function(logits.data_ptr(), rows, vocab, out.data_ptr(), torch.get_num_threads())
        return out.tolist()


LINEAR_TILE, LINEAR_DEPTH = 16, 32  # the packed weight layout of linear_rows (C)
STEP_MAX_ROWS = 4  # decode steps of up to this many rows run in decode_step_bf16
# With tiles (row_tiles), linear_rows also takes steps of this many rows, where it beats
# oneDNN's matmul, and so does decode_step_bf16
TILE_ROWS = (STEP_MAX_ROWS + 1, 64)


def packed_shape(weight: torch.Tensor) -> tuple[int, int, int, int]:
    """The shape pack_rows gives a bf16 [out, in] weight."""
    out, width = weight.shape
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or width % LINEAR_DEPTH:
        raise ValueError("pack_rows needs a bf16 [out, in] weight with in % 32 == 0")
    return (-(-out // LINEAR_TILE), width // LINEAR_DEPTH, LINEAR_TILE, LINEAR_DEPTH)


def pack_rows(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 [out, in] weight as [tiles, in / 32, 16, 32], its rows padded with zeros to
    whole tiles of 16: the order in which the few-row linear kernel reads it, one
    sequential stream per tile. Written into `out` (contiguous, of packed_shape) if given."""
    shape = packed_shape(weight)
    weight = F.pad(weight, (0, 0, 0, -weight.shape[0] % LINEAR_TILE))
    tiles = weight.view(shape[0], LINEAR_TILE, shape[1], LINEAR_DEPTH).permute(0, 2, 1, 3)
    if out is None:
        return tiles.contiguous()
    if out.shape != shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"pack_rows writes a contiguous bf16 tensor of shape {shape}")
    return out.copy_(tiles)


class LinearRowsKernel:
    """x @ W.T for bf16 rows against a weight packed by pack_rows: a few rows on vector
    registers, more on tiles where the CPU has avx512_bf16 (row_tiles)."""

    def __init__(self, library: ctypes.CDLL):
        self.function = bind(
            library, "linear_rows_bf16", [POINTER, POINTER, POINTER, *(C_INT,) * 4]
        )

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x: [rows, in] bf16 contiguous; packed: pack_rows of an [out_features, in] weight."""
        tiles, depth, _, _ = packed.shape
        rows, width = x.shape
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or width != depth * LINEAR_DEPTH:
            raise ValueError("linear_rows needs contiguous bf16 rows as wide as the weight")
        if not (tiles - 1) * LINEAR_TILE < out_features <= tiles * LINEAR_TILE:
            raise ValueError("linear_rows: out_features does not match the packed weight")
        out = torch.empty((rows, out_features), dtype=torch.bfloat16)
        self.function(
            x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, width, out_features,
            torch.get_num_threads(),
        )  # fmt: skip
        return out


class DecodeStepShape(ctypes.Structure):
    """step_shape in decode_attention.c."""

    INTS = "layers hidden heads kv_heads dim intermediate vocab num_blocks block_size positions"
    _fields_ = [*((name, C_INT) for name in INTS.split()), ("eps", C_FLOAT), ("scale", C_FLOAT)]


@dataclass(slots=True)
class StepModel:
    """The weights decode_step_bf16 reads outside the layers, bf16: the final norm's, the
    packed vocabulary projection, the embedding table [vocab, hidden] and the rotary
    tables [positions, dim]."""

    final_norm: torch.Tensor
    head: torch.Tensor
    embedding: torch.Tensor
    cos: torch.Tensor
    signed_sin: torch.Tensor


@dataclass(slots=True)
class StepLayer:
    """One decoder layer's weights as decode_step_bf16 reads them: bf16, the norms' as
    they are, the matrices packed by pack_rows."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    output: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DecodeStepKernel:
    """A whole decode step in one call: each row's embedding, every layer's norms, linears,
    rotary + cache write and attention, then the final norm and the vocabulary projection.
    Up to STEP_MAX_ROWS rows on vector registers, or with tiles (row_tiles) up to
    TILE_ROWS[1]. Takes the packed matrices of pack_rows."""

    def __init__(
        self,
        library: ctypes.CDLL,
        shape: DecodeStepShape,
        layers: list[StepLayer],
        model: StepModel,
    ):
        self.function = bind(
            library,
            "decode_step_bf16",
            [
                ctypes.POINTER(DecodeStepShape),
                POINTER,  # weights: the pointer array
                POINTER,  # cache
                POINTER,  # token ids
                POINTER,  # block table
                C_INT,  # block table width
                POINTER,  # lengths
                POINTER,  # logits
                POINTER,  # greedy tokens, or NULL
                C_INT,  # rows
                C_INT,  # rows kept on vectors (0: the target's choice)
                C_INT,  # threads
            ],
        )
        self.function.restype = C_INT
        self.shape = shape
        self.max_rows = TILE_ROWS[1] if row_tiles() else STEP_MAX_ROWS
        # the most rows a step with same_as_alone keeps on vectors, which compute each row
        # as a one-row step does (tiles, AMX's from 5 rows, sum in another order)
        self.vector_rows = min(self.max_rows, library.decode_vector_rows())
        tensors = [t for layer in layers for t in (
            layer.input_norm, layer.qkv, layer.output, layer.post_norm, layer.gate_up, layer.down
        )] + [
            model.final_norm, model.head, model.embedding, model.cos, model.signed_sin
        ]  # fmt: skip
        if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in tensors):
            raise ValueError("decode_step needs contiguous bf16 weights")
        shapes = (model.embedding.shape, model.cos.shape, model.signed_sin.shape)
        rotary = (shape.positions, shape.dim)
        if shapes != ((shape.vocab, shape.hidden), rotary, rotary):
            raise ValueError(
                "decode_step needs [vocab, hidden] embeddings, [positions, dim] rotary"
            )
        self.model = model
        self.cache: torch.Tensor | None = None  # the KV cache checked last (_check_cache)
        self.cache_pointer = 0
        self.tensors = tensors  # the pointers below point into these
        self.pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))

    def _check_cache(self, cache: torch.Tensor) -> None:
        shape = self.shape
        expected = (shape.layers, 2 * shape.kv_heads, shape.dim)
        if (
            cache.dtype != torch.bfloat16
            or cache.dim() != 5
            or (*cache.shape[:2], cache.shape[4]) != expected
            or not cache.is_contiguous()
        ):
            raise ValueError("decode_step needs the model's contiguous bf16 KV cache")
        shape.num_blocks, shape.block_size = cache.shape[2], cache.shape[3]
        self.cache, self.cache_pointer = cache, cache.data_ptr()

    def __call__(
        self,
        token_ids: list[int],
        cache: torch.Tensor,
        block_table: list[int],
        lengths: list[int],
        greedy: bool = False,
        same_as_alone: bool = False,
    ) -> tuple[torch.Tensor, list[int] | None]:
        """token_ids: each row's token; cache: every layer's [layers, 2 * kv_heads, blocks,
        block_size, dim] bf16; block_table: the rows' block tables one after another, each
        padded to the widest; lengths: each row's keys, its token at position length - 1.
        Returns the logits [rows, vocab] fp32 and, if greedy, each row's first maximum
        (ArgmaxKernel's), found inside the step. same_as_alone: each row's logits exactly
        as in a step of its own (drafts' verification), for up to vector_rows rows.

        The step's few integers come as lists and go to C as `array` buffers: between
        two steps every tensor op ran from memory (the weights a step streams fill the
        caches), 10 to 50 us each, and building the inputs as tensors took 130 us (and a
        64-row table of 3072 ids, 178 us as a tensor, 311 as a ctypes array, 51 here)."""
        rows = len(token_ids)
        if not 1 <= rows <= self.max_rows or len(lengths) != rows:
            raise ValueError(f"decode_step takes 1 to {self.max_rows} rows, one length each")
        if same_as_alone and rows > self.vector_rows:
            raise ValueError(f"decode_step computes up to {self.vector_rows} rows as alone")
        if not block_table or len(block_table) % rows:
            raise ValueError("decode_step needs one block table row per row, all as wide")
        if cache is not self.cache:
            self._check_cache(cache)
        tokens = array.array("i", bytes(4 * rows)) if greedy else None
        logits = torch.empty((rows, self.shape.vocab), dtype=torch.float32)
        ids, table, keys = (
            array.array("q", token_ids),
            array.array("i", block_table),
            array.array("i", lengths),
        )
        status = self.function(
            ctypes.byref(self.shape),
            self.pointers,
            self.cache_pointer,
            ids.buffer_info()[0],
            table.buffer_info()[0],
            len(block_table) // rows,
            keys.buffer_info()[0],
            logits.data_ptr(),
            None if tokens is None else tokens.buffer_info()[0],
            rows,
            self.vector_rows if same_as_alone else 0,
            torch.get_num_threads(),
        )
        if status == -2:
            raise ValueError(
                "decode_step: a token id, a length or its block is out of range (nothing written)"
            )
        if status != 0:
            raise MemoryError("decode_step could not allocate its scratch rows")
        return logits, None if tokens is None else list(tokens)


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    group = num_heads // num_kv_heads
    return head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and group <= MAX_GROUP


def library() -> ctypes.CDLL | None:
    """The kernels' library, built on first call (about a second), or None."""
    global _library, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            path = build()
            if path is not None:
                try:
                    _library = ctypes.CDLL(str(path))
                except OSError:
                    _library = None
            # AMX's tile state is Linux's to grant, once per process (amx_enable in the C;
            # where Linux refuses, row_tiles says "vnni")
            if _library is not None and hasattr(_library, "amx_enable"):
                _library.amx_enable()
        return _library


def row_tiles() -> str | None:
    """How linear_rows and decode_step_bf16 multiply more than a decode step's few rows
    (TILE_ROWS): "amx" on AMX tiles, "vnni" on the same tiles' product in vdpbf16ps
    (avx512_bf16 without AMX), None where they do not (oneDNN's matmul takes them)."""
    lib = library()
    kind = 0 if lib is None or not hasattr(lib, "row_tiles_kind") else lib.row_tiles_kind()
    return {2: "amx", 1: "vnni"}.get(kind)


def load() -> DecodeAttentionKernel | None:
    """The decode attention kernel, or None where it cannot run."""
    lib = library()
    return None if lib is None else DecodeAttentionKernel(lib)


def load_add_rms_norm() -> AddRMSNormKernel | None:
    """The fused residual add + RMSNorm, or None where it cannot run."""
    lib = library()
    return None if lib is None else AddRMSNormKernel(lib)


def load_rotary_cache_write() -> RotaryCacheWriteKernel | None:
    """The rotary embedding fused with the KV cache write, or None where it cannot run."""
    lib = library()
    return None if lib is None else RotaryCacheWriteKernel(lib)


def load_silu_mul() -> SiluMulKernel | None:
    """SwiGLU's silu(gate) * up in one pass, or None where it cannot run."""
    lib = library()
    return None if lib is None else SiluMulKernel(lib)


def load_argmax() -> ArgmaxKernel | None:
    """Each row's first maximum over fp32 logits, or None where it cannot run."""
    lib = library()
    return None if lib is None else ArgmaxKernel(lib)


def has_decode_step() -> bool:
    """Whether the library has the few-row kernels."""
    lib = library()
    return lib is not None and hasattr(lib, "decode_step_bf16")


def load_linear_rows() -> LinearRowsKernel | None:
    """The few-row linear kernel on pack_rows weights, or None where it cannot run."""
    return LinearRowsKernel(library()) if has_decode_step() else None  # type: ignore[arg-type]


def load_decode_step(
    shape: DecodeStepShape, layers: list[StepLayer], model: StepModel
) -> DecodeStepKernel | None:
    """The whole-step kernel for a few decode rows, or None where it cannot run."""
    lib = library()
    if lib is None or not hasattr(lib, "decode_step_bf16"):
        return None
    return DecodeStepKernel(lib, shape, layers, model)
