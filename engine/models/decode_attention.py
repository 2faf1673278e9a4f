"""The engine's bf16 CPU kernels (decode_attention.c), built once per machine: the fused
decode attention and the residual add fused with RMSNorm.

In PyTorch ops a decode step's K crosses memory three times (the gather reads it and
writes a copy, the scores read the copy), V once more (embedding_bag), and rows are
padded to their group's longest; the kernel walks each row's own blocks once. It is
built with the system C compiler at first use (about a second) into a cache folder
keyed by the source, the flags and the CPU, and is absent (None) where that fails:
no compiler, no AVX-512, not Linux on x86. Callers then keep the PyTorch path.

The add + RMSNorm follows HF's order of operations for bf16 (normalise in fp32, round,
then scale by the weight), where PyTorch's `F.rms_norm` rounds once: it is closer to HF
and, at 512 rows, about ten times faster than the eight ops it replaces.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
LIBRARIES = ["-lmvec"]  # glibc's vector expf
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


def build() -> Path | None:
    """The compiled library, built now unless a cached one matches; None if it cannot be built."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None or platform.system() != "Linux" or platform.machine() != "x86_64":
        logger.info("fused decode attention off: no C compiler, or not Linux on x86-64")
        return None
    if "avx512f" not in cpu_flags():
        logger.info("fused decode attention off: the CPU has no AVX-512")
        return None
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(FLAGS + LIBRARIES).encode() + cpu_flags().encode()
    ).hexdigest()[:16]
    target = cache_folder() / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: engines starting together never load half a file.
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    command = [compiler, *FLAGS, "-o", temporary, str(SOURCE), *LIBRARIES]
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
        return _library


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
