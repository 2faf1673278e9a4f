"""Write a GGUF checkpoint out as a Hugging Face folder (safetensors, config, tokenizer).

Engines that load only HF folders (vLLM) serve the same weights our engine serves from the
GGUF: the tensors are dequantized by engine/loader.py (Q/K already in HF's rotate-half
layout) and the tokenizer is the one contracts/tokenizer.py builds from the GGUF metadata.

    python -m engine.hf_export smollm2 OUT_DIR [--dtype bfloat16]

The folder registers as an `hf-safetensors` artifact as it is (docs/engines.md): every file
it writes is of a type the registry takes. Idempotent: a folder holding a finished export
(its stamp, hf_export.json, written last) is left as is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from contracts.tokenizer import TextTokenizer
from engine.loader import Checkpoint, load_gguf, resolve_model_path

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
STAMP = "hf_export.json"  # what it was written from; written last


def hf_config(checkpoint: Checkpoint, dtype: str) -> dict[str, Any]:
    c = checkpoint.config
    source = checkpoint.tokenizer_source
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": source.get("bos_token_id"),
        "eos_token_id": source.get("eos_token_id"),
        "torch_dtype": dtype,
    }


def tokenizer_config(checkpoint: Checkpoint, tokenizer: TextTokenizer) -> dict[str, Any]:
    source = checkpoint.tokenizer_source
    eos_id = source.get("eos_token_id")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.token(tokenizer.bos_token_id) or None,
        "eos_token": tokenizer.token(eos_id if isinstance(eos_id, int) else None) or None,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": bool(source.get("add_eos_token")),
        "chat_template": source.get("chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": checkpoint.config.max_position_embeddings,
    }


def export_hf_folder(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """The HF folder for `gguf_path` at `out_dir`, written unless a finished one is there."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if (out_dir / STAMP).exists():
        return out_dir
    from safetensors.torch import save_file

    checkpoint = load_gguf(gguf_path)
    tokenizer = TextTokenizer(checkpoint.tokenizer_source)
    # Its own partial folder: two agents of one host may write the same folder at once.
    partial = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weights = {
        name: tensor.to(DTYPES[dtype]).contiguous()
        for name, tensor in checkpoint.weights.items()
        # A tied head is the embedding: HF folders leave it out.
        if not (name == "lm_head.weight" and checkpoint.config.tie_word_embeddings)
    }
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(hf_config(checkpoint, dtype), indent=2))
    tokenizer.tokenizer.save(str(partial / "tokenizer.json"))
    (partial / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(checkpoint, tokenizer), indent=2)
    )
    source = checkpoint.tokenizer_source
    generation = {
        "bos_token_id": source.get("bos_token_id"),
        "eos_token_id": source.get("eos_token_id"),
    }
    (partial / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (partial / STAMP).write_text(json.dumps({"source": gguf_path.name, "dtype": dtype}))
    if (out_dir / STAMP).exists():  # another writer finished first: the same bytes
        shutil.rmtree(partial)
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)  # an unfinished one
    try:
        partial.rename(out_dir)
    except OSError:
        if not (out_dir / STAMP).exists():
            raise
        shutil.rmtree(partial)  # another writer renamed its own in between
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.hf_export", description=__doc__)
    parser.add_argument("model", help="a .gguf path, or smollm2")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    try:
        folder = export_hf_folder(resolve_model_path(args.model), args.out_dir, args.dtype)
    except (OSError, ValueError) as exc:
        print(f"hf_export: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
