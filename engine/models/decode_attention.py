"""The fused bf16 decode attention kernel (decode_attention.c), built once per machine.

In PyTorch ops a decode step's K crosses memory three times (the gather reads it and
writes a copy, the scores read the copy), V once more (embedding_bag), and rows are
padded to their group's longest; the kernel walks each row's own blocks once. It is
built with the system C compiler at first use (about a second) into a cache folder
keyed by the source, the flags and the CPU, and is absent (None) where that fails:
no compiler, no AVX-512, not Linux on x86. Callers then keep the PyTorch path.
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

import torch

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
LIBRARIES = ["-lmvec"]  # glibc's vector expf
MAX_GROUP = 16
MAX_HEAD_DIM = 256

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_kernel: DecodeAttentionKernel | None = None
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


class DecodeAttentionKernel:
    def __init__(self, library: ctypes.CDLL):
        self.function = library.decode_attention_bf16
        self.function.restype = None
        c_int, c_long, pointer = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
        self.function.argtypes = [
            pointer,  # q
            c_long,  # q row stride (elements)
            pointer,  # layer cache
            pointer,  # block table
            c_int,  # block table width
            pointer,  # lengths
            pointer,  # out
            *(c_int,) * 6,  # rows, kv_heads, group, dim, num_blocks, block_size
            ctypes.c_float,  # scale
            c_int,  # threads
        ]

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


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    group = num_heads // num_kv_heads
    return head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and group <= MAX_GROUP


def load() -> DecodeAttentionKernel | None:
    """The kernel, built on first call (about a second), or None where it cannot run."""
    global _kernel, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            path = build()
            if path is not None:
                try:
                    _kernel = DecodeAttentionKernel(ctypes.CDLL(str(path)))
                except OSError:
                    _kernel = None
        return _kernel
