"""Tokenizer and chat template, built from GGUF metadata or a HF tokenizer.json.

Shared by the engine (which serves with it) and the control plane (which counts the tokens
of its evaluations with it) and free of PyTorch, so the control plane runs without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp): 3 control, 4 user defined: matched whole in text.
SPECIAL_TOKEN_TYPES = (3, 4)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_tokenizer(source: dict[str, Any]) -> Tokenizer:
    if source["model"] != "gpt2":
        raise ValueError(f"tokenizer model {source['model']!r} is not supported (gpt2 BPE only)")
    tokens: list[str] = source["tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in source["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = source.get("pre", "default")
    if pre in ("smollm", "starcoder", "refact"):
        # These split every digit on its own before the GPT-2 regex.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, source["token_types"], strict=True)
        if kind in SPECIAL_TOKEN_TYPES
    ]
    tokenizer.add_special_tokens(special)
    return tokenizer


class TextTokenizer:
    """encode/decode plus the chat template and the ids that end a generation."""

    def __init__(self, source: dict[str, Any]):
        if source["kind"] == "gguf":
            self.tokenizer = _gguf_tokenizer(source)
        else:
            self.tokenizer = Tokenizer.from_file(source["path"])
        self.bos_token_id: int | None = _first_id(source.get("bos_token_id"))
        self.add_bos_token = bool(source.get("add_bos_token")) and self.bos_token_id is not None
        eos = source.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        for token in END_OF_TURN_TOKENS:
            token_id = self.tokenizer.token_to_id(token)
            if token_id is not None and token_id not in eos_ids:
                eos_ids.append(token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self.vocab_size = self.tokenizer.get_vocab_size()
        template = source.get("chat_template")
        self.chat_template = None
        if template:
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = _raise_template_error
            self.chat_template = environment.from_string(template)

    def token(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(token_id) or ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def stream_decoder(self) -> Callable[[int], str]:
        """A generation's text one token at a time: what each token adds, "" while a
        character split across tokens is still incomplete (special tokens skipped). The
        same text as decoding every token so far, at about 1 us a token against 4 to 6
        for decoding a window twice (tokenizers' DecodeStream)."""
        stream = decoders.DecodeStream(skip_special_tokens=True)
        tokenizer = self.tokenizer

        def step(token_id: int) -> str:
            return stream.step(tokenizer, token_id) or ""

        return step

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self.chat_template is None:
            # No template in the file: a plain transcript the base model can continue.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        rendered: str = self.chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_token_id),
            eos_token=self.token(self.eos_token_ids[0] if self.eos_token_ids else None),
        )
        return rendered

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.render_chat(messages)
        bos = self.token(self.bos_token_id)
        # Templates that write the BOS text themselves must not get a second one.
        return self.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")
