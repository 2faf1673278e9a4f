"""Llama-family decoder over a paged KV cache: RMSNorm, RoPE, grouped-query attention, SwiGLU.

All sequences of a step are flattened into one token axis so every matmul sees the
whole batch. Only attention is per sequence: single-token rows (decodes) are
batched against their gathered, padded KV; prefill chunks run one SDPA each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LlamaConfig
from engine.models.layers import Embedding, Linear, RMSNorm, apply_rotary, rotary_tables


@dataclass(slots=True)
class PrefillChunk:
    start: int  # offset of the chunk in the flattened token axis
    length: int  # query tokens in this chunk
    context: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None  # [blocks] holding context + chunk; None when context == 0
    mask: torch.Tensor | None  # [length, blocks * block_size] bool; None when context == 0


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] cache slot written by each token
    num_decode: int = 0  # the first num_decode tokens are single-token rows
    decode_block_ids: torch.Tensor | None = None  # [num_decode * blocks] flattened block tables
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, blocks * block_size] True=valid
    prefills: list[PrefillChunk] = field(default_factory=list)


class KVCache:
    """Per layer K and V blocks: [layers, num_blocks, block_size, kv_heads, head_dim].

    Gathering whole blocks (index_select on dim 0) copies block_size * kv_heads *
    head_dim contiguous values at a time, several times faster than a per-slot gather.
    """

    def __init__(
        self,
        config: LlamaConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # zeros, not empty: padded decode rows read unused slots under a mask, and 0 * NaN = NaN.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, rows: int, dtype: torch.dtype
) -> torch.Tensor:
    # cache: [num_blocks, block_size, kv_heads, dim] -> [rows, kv_heads, blocks*block_size, dim]
    gathered = cache.index_select(0, block_ids).to(dtype)
    kv_heads, dim = cache.shape[2], cache.shape[3]
    return gathered.view(rows, -1, kv_heads, dim).transpose(1, 2)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, qkv: Linear, output: Linear):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.qkv = qkv  # fused [q; k; v] rows: one matmul instead of three
        self.output = output

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(hidden)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = apply_rotary(q.view(tokens, heads, dim), cos, sin)  # [tokens, heads, dim]
        k = apply_rotary(k.view(tokens, kv_heads, dim), cos, sin)  # [tokens, kv_heads, dim]
        v = v.view(tokens, kv_heads, dim)
        flat_shape = (-1, kv_heads, dim)
        key_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, k.to(key_cache.dtype))
        value_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, v.to(value_cache.dtype))

        out = torch.empty_like(q)
        group = heads // kv_heads
        decode = meta.num_decode
        if decode:
            assert meta.decode_block_ids is not None and meta.decode_mask is not None
            # One query per row, so the `group` query heads sharing a KV head act as
            # `group` queries against it: no repeat of K/V needed.
            qd = q[:decode].view(decode, kv_heads, group, dim)
            kd = gather_blocks(
                key_cache, meta.decode_block_ids, decode, q.dtype
            )  # [D, kvh, L, dim]
            vd = gather_blocks(value_cache, meta.decode_block_ids, decode, q.dtype)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
            out[:decode] = od.reshape(decode, heads, dim)
        for chunk in meta.prefills:
            end = chunk.start + chunk.length
            qp = q[chunk.start : end].transpose(0, 1)  # [heads, length, dim]
            if chunk.block_ids is None:
                kp = k[chunk.start : end].transpose(0, 1)  # [kv_heads, length, dim]
                vp = v[chunk.start : end].transpose(0, 1)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                kp = gather_blocks(key_cache, chunk.block_ids, 1, q.dtype)[0]  # [kvh, L, dim]
                vp = gather_blocks(value_cache, chunk.block_ids, 1, q.dtype)[0]
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=chunk.mask, enable_gqa=True
                )
            out[chunk.start : end] = op.transpose(0, 1)
        return self.output(out.view(tokens, heads * dim))


class LlamaMLP(nn.Module):
    def __init__(self, gate_up: Linear, down: Linear):
        super().__init__()
        self.gate_up = gate_up  # fused [gate; up] rows
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(
        self,
        attention: LlamaAttention,
        mlp: LlamaMLP,
        input_norm: RMSNorm,
        post_attention_norm: RMSNorm,
    ):
        super().__init__()
        self.attention = attention
        self.mlp = mlp
        self.input_norm = input_norm
        self.post_attention_norm = post_attention_norm


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        storage: str,
        device: torch.device,
        compute_dtype: torch.dtype,
    ):
        """`weights` uses HF names (model.layers.N.self_attn.q_proj.weight, ...), fp32."""
        super().__init__()
        self.config = config
        self.compute_dtype = compute_dtype

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device)

        def linear(*names: str) -> Linear:
            return Linear(torch.cat([take(n) for n in names]), storage, compute_dtype)

        eps = config.rms_norm_eps
        self.embed = Embedding(take("model.embed_tokens.weight"), storage, compute_dtype)
        layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            attention = LlamaAttention(
                config,
                linear(*(f"{prefix}self_attn.{p}_proj.weight" for p in "qkv")),
                linear(f"{prefix}self_attn.o_proj.weight"),
            )
            mlp = LlamaMLP(
                linear(f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"),
                linear(f"{prefix}mlp.down_proj.weight"),
            )
            layers.append(
                LlamaLayer(
                    attention,
                    mlp,
                    RMSNorm(take(f"{prefix}input_layernorm.weight"), eps, compute_dtype),
                    RMSNorm(take(f"{prefix}post_attention_layernorm.weight"), eps, compute_dtype),
                )
            )
            # Free the fp32 copies layer by layer to keep peak memory near the final size.
        self.layers = nn.ModuleList(layers)
        self.layer_list: list[LlamaLayer] = layers  # typed, and cheaper to iterate
        self.norm = RMSNorm(take("model.norm.weight"), eps, compute_dtype)
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.lm_head = linear("lm_head.weight")
        else:
            self.lm_head = self.embed.as_linear
        cos, sin = rotary_tables(
            config.head_dim, config.max_position_embeddings, config.rope_theta, device
        )
        self.cos = cos.to(compute_dtype)
        self.sin = sin.to(compute_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        # input_ids, positions: [tokens]; returns logits [len(logits_indices), vocab] fp32
        hidden = self.embed(input_ids)  # [tokens, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        for index, layer in enumerate(self.layer_list):
            residual = hidden
            hidden = layer.attention(
                layer.input_norm(hidden), cos, sin, cache.keys[index], cache.values[index], meta
            )
            hidden = residual + hidden
            hidden = hidden + layer.mlp(layer.post_attention_norm(hidden))
        # Only rows that sample need the (large) vocabulary projection.
        hidden = self.norm(hidden[logits_indices])
        return self.lm_head(hidden).float()
