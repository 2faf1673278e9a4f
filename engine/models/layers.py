"""Building blocks shared by the models: weight-only linear layers, RMSNorm, rotary tables."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.decode_attention import TILE_ROWS, LinearRowsKernel

# On CPUs without native bf16 dot products (AVX2, AVX-512 before avx512_bf16), a bf16
# GEMM runs several times slower than fp32, so batched rows multiply an fp32 copy of
# the weight; a single row is memory bound and reads the narrow weight directly.
SMALL_BATCH_ROWS = 4


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 GEMMs run ~4x faster than fp32 (measured: AMD EPYC)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def cpu_has_amx() -> bool:
    """AMX tiles (Intel Xeon since Sapphire Rapids): oneDNN's bf16 kernels run on them."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered into oneDNN's blocked layout, or None where that is unavailable.

    oneDNN's matmul on a packed bf16 weight reads it about twice as fast for one to four
    rows (decode) as `F.linear` on the plain tensor, and is no slower for large batches.
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.zeros((1, weight.shape[1]), dtype=weight.dtype)
        linear_packed(probe, packed)
    except (RuntimeError, AttributeError):
        return None
    return packed


def linear_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # x: [rows, in] -> [rows, out], the weight packed by pack_for_onednn
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: weight ~= q * scale[:, None]."""
    # weight: [out, in] float
    scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scale.float()


class Linear(nn.Module):
    """y = x @ W.T with W stored as float32, bfloat16 or int8 (+ per-row scale)."""

    def __init__(self, weight: torch.Tensor, storage: str, compute_dtype: torch.dtype):
        super().__init__()
        self.storage = storage
        self.compute_dtype = compute_dtype
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        self.scale: torch.Tensor | None
        # The plain weight: None once release_plain() dropped it for another full copy.
        self.weight: nn.Parameter | None
        # The weight in the compute dtype for batched rows, when the storage dtype differs
        # (bf16 storage, fp32 compute): widening per matmul cost as much as the matmul.
        self.wide_weight: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        # decode_attention's pack_rows copy, and its kernel: with tiles for steps of 5 to 64
        # rows, with fp32 compute for steps of up to 4 rows the step kernel does not run
        self.rows_packed: torch.Tensor | None = None
        self.rows_kernel: LinearRowsKernel | None = None
        if storage == "int8":
            quantized, scale = quantize_per_channel(weight.float())
            self.weight = nn.Parameter(quantized, requires_grad=False)
            self.scale = scale.to(weight.device)
            self.scale_bf16 = self.scale.to(torch.bfloat16)
        else:
            dtype = torch.bfloat16 if storage == "bfloat16" else torch.float32
            self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
            self.scale = None
            if dtype != compute_dtype:
                self.wide_weight = self.weight.detach().to(compute_dtype)
            elif dtype == torch.bfloat16:
                self.packed = pack_for_onednn(self.weight.detach())

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """The projection with fp32 outputs, for logits. On CUDA a bf16 matmul accumulates
        in fp32 and keeps it (mm's out_dtype) instead of rounding each output to bf16: a
        logit near 25 would move by up to 1/16, more than SmolLM2's own margin between
        "The" and "L" on the Paris prompt (0.08 in fp32)."""
        weight = self.weight
        if x.is_cuda and weight is not None and x.dtype == weight.dtype == torch.bfloat16:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return self(x).float()

    @property
    def storage_bytes(self) -> int:
        """The matrix's size in its storage dtype: what one pass over it reads at least."""
        element = {"int8": 1, "bfloat16": 2}.get(self.storage, 4)
        return self.out_features * self.in_features * element

    def release_plain(self) -> bool:
        """Drop the plain weight where another copy serves every row count: oneDNN's packed
        one (bf16 compute), or the fp32 copy (bf16 weights, fp32 compute; few rows then
        multiply their bf16-rounded values by it). Whether it was dropped."""
        if self.storage != "bfloat16" or (self.packed is None and self.wide_weight is None):
            return False
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] in compute dtype -> [rows, out] in compute dtype
        weight = self.weight
        rows = x.shape[0]
        if self.storage == "int8":
            assert self.scale is not None and weight is not None
            if x.device.type == "cpu" and rows <= SMALL_BATCH_ROWS:
                # fused int8 GEMV: reads 1 byte per weight instead of 4
                out = torch._weight_int8pack_mm(x.to(torch.bfloat16), weight, self.scale_bf16)
                return out.to(self.compute_dtype)
            return F.linear(x, weight.to(x.dtype)) * self.scale.to(x.dtype)
        wide = self.wide_weight
        if wide is None:  # the storage dtype is the compute dtype
            low, high = TILE_ROWS
            if self.rows_kernel is not None and low <= rows <= high:
                assert self.rows_packed is not None
                return self.rows_kernel(x.contiguous(), self.rows_packed, self.out_features)
            if self.packed is not None:
                return linear_packed(x, self.packed)
            assert weight is not None
            return F.linear(x, weight)
        if rows > SMALL_BATCH_ROWS:
            return F.linear(x, wide)
        # Few rows: bf16 in, bf16 out, as a bf16 matmul gives (its products are exact in
        # fp32), from a bf16 copy where there is one: it reads half the bytes.
        narrow = x.to(torch.bfloat16)
        if self.rows_kernel is not None and self.rows_packed is not None:
            return self.rows_kernel(narrow.contiguous(), self.rows_packed, self.out_features).to(
                x.dtype
            )
        if weight is not None:
            return F.linear(narrow, weight).to(x.dtype)
        return F.linear(narrow.to(x.dtype), wide).to(torch.bfloat16).to(x.dtype)


class Embedding(nn.Module):
    """Token embedding that can double as the (tied) output projection."""

    def __init__(self, weight: torch.Tensor, storage: str, compute_dtype: torch.dtype):
        super().__init__()
        self.as_linear = Linear(weight, storage, compute_dtype)
        self.compute_dtype = compute_dtype

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [tokens] -> [tokens, hidden]; the plain weight is always kept here
        table = self.as_linear.weight
        assert table is not None
        rows = table[token_ids].to(self.compute_dtype)
        if self.as_linear.scale is not None:
            rows = rows * self.as_linear.scale[token_ids, None].to(self.compute_dtype)
        return rows


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, compute_dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight.to(compute_dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            # one fused op instead of eight (variance in fp32 as well); within a bf16 ulp
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Same order of operations as HF LlamaRMSNorm (variance in fp32), for token parity.
        dtype = x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


def rotary_tables(
    head_dim: int, max_positions: int, base: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: [max_positions, head_dim] in fp32, HF's rotate-half layout.

    The first half of sin is negated, so apply_rotary needs a roll instead of
    rotate_half's slice, negate and cat (two fewer ops per layer, same values).
    """
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    positions = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    sign = torch.ones(head_dim, device=device)
    sign[: head_dim // 2] = -1.0
    return angles.cos(), angles.sin() * sign


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [tokens, heads, head_dim]; cos/signed_sin: [tokens, 1, head_dim]. HF's
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) = roll(x) * sign.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
