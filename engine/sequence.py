"""A request's sampling parameters and its state as it moves through the scheduler."""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from contracts.openai_request import (
    GREEDY_TEMPERATURE,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)


@dataclass(slots=True)
class SamplingParams:
    """OpenAI-style sampling controls; `ValueError` messages name the offending field."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token, 0..20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not (0 <= self.temperature <= 2) or math.isnan(self.temperature):
            raise ValueError(f"temperature: must be in [0, 2], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (off) or >= 1, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        if len(self.stop) > MAX_STOP_STRINGS or any(
            not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop
        ):
            raise ValueError(
                f"stop: at most {MAX_STOP_STRINGS} non-empty strings "
                f"of at most {MAX_STOP_STRING_CHARS} characters"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed: must be in [0, {MAX_SEED}], got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        # A temperature below GREEDY_TEMPERATURE would turn the logits infinite.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) best first


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation request. KV for `token_ids[:num_computed_tokens]` lives in the cache.

    Decode and prefill are the same thing here: each step computes some of the
    tokens not yet in the cache; when the last one is computed, a token is sampled.
    Preemption just resets `num_computed_tokens`, so recompute replays prompt + output.
    """

    token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    last_block_hash: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Text produced so far (detokenized by the engine thread) and how much was sent.
    text: str = ""
    sent_text_length: int = 0
    # what each output token adds to the text (TextTokenizer.stream_decoder), made at the
    # first token
    decoder: Callable[[int], str] | None = None
    sent_token_count: int = 0
    sent_logprob_count: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    sink: Any = None  # where the engine delivers outputs (set by the engine)
    # speculative decoding (engine/speculative.py): the tokens guessed for the next step,
    # after the last one, and the request's n-gram index and acceptance counts
    draft_token_ids: list[int] = field(default_factory=list)
    draft_state: Any = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("prompt: must contain at least one token")
        self.num_prompt_tokens = len(self.token_ids)
        if not self.request_id:
            self.request_id = f"req-{self.seq_id}"
        if self.params.seed is not None and not self.params.is_greedy:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def tokens_at(self, start: int, count: int) -> list[int]:
        """`count` tokens from position `start`, the drafts after the last token included."""
        end = start + count
        if end <= len(self.token_ids):
            return self.token_ids[start:end]
        return self.token_ids[start:] + self.draft_token_ids[: end - len(self.token_ids)]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
