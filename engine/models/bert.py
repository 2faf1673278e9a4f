"""BERT encoder (all-MiniLM-L6-v2 shape) with mean pooling and L2 normalization."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn


@dataclass(slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        raw = json.loads(path.read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
        )


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        # Plain tensors in a dict keyed by the checkpoint's names: the forward below reads
        # them directly, so no module tree has to mirror HF's naming.
        self.weights = {name: tensor.float() for name, tensor in weights.items()}

    def _layer_norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.weights
        return F.layer_norm(
            x,
            (x.shape[-1],),
            w[f"{prefix}.weight"],
            w[f"{prefix}.bias"],
            self.config.layer_norm_eps,
        )

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.weights[f"{prefix}.weight"], self.weights[f"{prefix}.bias"])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: [batch, length] -> normalized mean-pooled [batch, hidden]."""
        w = self.weights
        batch, length = input_ids.shape
        heads = self.config.num_heads
        dim = self.config.hidden_size // heads
        positions = torch.arange(length, device=input_ids.device)
        hidden = (
            w["embeddings.word_embeddings.weight"][input_ids]
            + w["embeddings.position_embeddings.weight"][positions]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        hidden = self._layer_norm(hidden, "embeddings.LayerNorm")  # [batch, length, hidden]
        # Padding keys are masked out; [batch, 1, 1, length] broadcasts over heads and queries.
        key_mask = attention_mask.bool()[:, None, None, :]
        for i in range(self.config.num_layers):
            p = f"encoder.layer.{i}"

            def split(x: torch.Tensor) -> torch.Tensor:
                return x.view(batch, length, heads, dim).transpose(1, 2)  # [b, heads, len, dim]

            q = split(self._linear(hidden, f"{p}.attention.self.query"))
            k = split(self._linear(hidden, f"{p}.attention.self.key"))
            v = split(self._linear(hidden, f"{p}.attention.self.value"))
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            attended = attended.transpose(1, 2).reshape(batch, length, heads * dim)
            hidden = self._layer_norm(
                self._linear(attended, f"{p}.attention.output.dense") + hidden,
                f"{p}.attention.output.LayerNorm",
            )
            intermediate = F.gelu(self._linear(hidden, f"{p}.intermediate.dense"))
            hidden = self._layer_norm(
                self._linear(intermediate, f"{p}.output.dense") + hidden, f"{p}.output.LayerNorm"
            )
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [batch, length, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


def load_bert(folder: Path) -> BertEncoder:
    config = BertConfig.from_file(folder / "config.json")
    weights = load_file(str(folder / "model.safetensors"))
    return BertEncoder(config, weights)
