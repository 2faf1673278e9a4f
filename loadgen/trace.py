"""Trace files (JSON Lines) and the synthetic prompts that stand in for a prompt length.

One request per line:

    {"offset_s": 0.42, "prompt_tokens": 180, "max_tokens": 64, "tenant": "acme", "session": "s7"}
    {"offset_s": 1.10, "prompt": "Summarize ...", "max_tokens": 128, "tenant": "globex"}

`offset_s` is the arrival time in seconds from the start of the run. Either `prompt` (text)
or `prompt_tokens` (a length; the text is synthesized) is required. `tenant` defaults to
"default"; `session` is optional and makes the synthesized prompts of one session share a
prefix, like the turns of a conversation.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SAMPLE_TRACE = Path(__file__).resolve().parent / "traces" / "sample.jsonl"

_KNOWN_FIELDS = {"offset_s", "prompt", "prompt_tokens", "max_tokens", "tenant", "session"}

# Common English words: with a GPT-2 style BPE each, led by a space, is one token, so a
# synthesized prompt of n words is close to n tokens.
_WORD_TEXT = (
    "the of and to in is was for on are with as at be by this have from or one had not but "
    "what all were when we there can an your which their said if do will each about how up "
    "out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way "
    "find use may water long little very after words called just where most know get through "
    "back much before go good new write our used me man too any day same right look think "
    "also around another came come work three word must because does part even place well"
)
_WORDS = tuple(_WORD_TEXT.split())


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and line."""


@dataclass(slots=True, frozen=True)
class TraceRequest:
    offset_s: float
    max_tokens: int
    tenant: str = "default"
    prompt: str | None = None
    prompt_tokens: int | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        if self.offset_s < 0:
            raise ValueError("offset_s must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.prompt is None and self.prompt_tokens is None:
            raise ValueError("either prompt or prompt_tokens is required")
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        if not self.tenant:
            raise ValueError("tenant must not be empty")

    def prompt_text(self, index: int = 0) -> str:
        """The prompt to send: the given text, or one synthesized to the given length."""
        if self.prompt is not None:
            return self.prompt
        assert self.prompt_tokens is not None  # guaranteed by __post_init__
        seed = f"session:{self.session}" if self.session else f"request:{index}"
        return synthetic_prompt(self.prompt_tokens, seed)


def synthetic_prompt(tokens: int, seed: str | int) -> str:
    """About `tokens` tokens of filler words, the same for the same seed.

    Prompts with the same seed are prefixes of each other, so a session's growing turns
    share their beginning (prefix caching sees them as a conversation would look).
    """
    rng = random.Random(str(seed))
    return " ".join(rng.choice(_WORDS) for _ in range(max(tokens, 1)))


def _float(record: dict[str, object], name: str, where: str) -> float:
    value = record.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TraceError(f"{where}: {name} must be a number, got {value!r}")
    return float(value)


def _int(record: dict[str, object], name: str, where: str) -> int | None:
    value = record.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value != int(value):
        raise TraceError(f"{where}: {name} must be a whole number, got {value!r}")
    return int(value)


def _str(record: dict[str, object], name: str, where: str) -> str | None:
    value = record.get(name)
    if value is None or isinstance(value, str):
        return value
    raise TraceError(f"{where}: {name} must be a string, got {value!r}")


def parse_trace_line(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - _KNOWN_FIELDS)
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for required in ("offset_s", "max_tokens"):
        if required not in record:
            raise TraceError(f"{where}: {required} is required")
    max_tokens = _int(record, "max_tokens", where)
    try:
        return TraceRequest(
            offset_s=_float(record, "offset_s", where),
            max_tokens=max_tokens if max_tokens is not None else 0,
            tenant=_str(record, "tenant", where) or "default",
            prompt=_str(record, "prompt", where),
            prompt_tokens=_int(record, "prompt_tokens", where),
            session=_str(record, "session", where),
        )
    except TraceError:
        raise
    except ValueError as error:
        raise TraceError(f"{where}: {error}") from None


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a trace file, in arrival order. Blank lines are skipped.

    Raises TraceError naming `path:line` for the first bad line.
    """
    path = SAMPLE_TRACE if str(path) == "sample" else Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise TraceError(f"{path}: cannot read trace ({error.strerror})") from None
    requests = [
        parse_trace_line(line, f"{path}:{number}")
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return sorted(requests, key=lambda request: request.offset_s)
