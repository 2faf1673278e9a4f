"""Reading an OpenAI-style response on its way through: tokens, timings, usage.

Server-sent events are forwarded whole (an event is never split across writes to the
client), so the gateway can look at each one: it timestamps content-bearing events
(TTFT, inter-token gaps), keeps the engine's `usage`, and drops the usage-only final
chunk when the client did not ask for it (the gateway always asks the engine for it).

Most events are scanned, not decoded: an event that is one `data:` line holding a JSON
object with no `error` member and no `usage` object (every token chunk) only needs "does
it carry text" and "cut `"usage": null`", which a few byte searches answer exactly (inside
a JSON string every `"` is escaped, so `"content": "x` can only be a member, never text).
The others (the usage chunk, errors, anything unusual) and every event of a tenant whose
completions are kept are decoded as JSON.
"""

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4  # the fallback estimate when the engine reports no usage
# `"usage": null` as a top-level member (a string inside the chunk would have its quotes
# escaped): what every chunk carries once the gateway has asked for usage.
_NULL_USAGE = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*})|"usage"\s*:\s*null\s*,\s*')
# For the scan: a `content` (chat delta) or `text` (completion) member holding a non-empty
# string; a `usage` member, and whether it is null; an empty `choices` list.
_HAS_TEXT = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')
_IS_NULL = re.compile(rb"\s*:\s*null")  # after a member's name
_ENDS = re.compile(rb"\s*}\n\n")  # the `}` that closes the event's object
_HAS_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{')
_DECODE = object()  # the scan's answer for an event it leaves to the JSON decoder


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (each with its blank-line terminator) and the remainder."""
    events: list[bytes] = []
    start = 0
    while True:
        lf = buffer.find(b"\n\n", start)
        crlf = buffer.find(b"\r\n\r\n", start)
        if lf < 0 and crlf < 0:
            break
        end = crlf + 4 if crlf >= 0 and (lf < 0 or crlf < lf) else lf + 2
        events.append(buffer[start:end])
        start = end
    return events, buffer[start:]


def _event_data(event: bytes) -> bytes | None:
    data = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    if not data:
        return None
    return b"\n".join(data)


def estimate_tokens(text_chars: int) -> int:
    return math.ceil(text_chars / CHARS_PER_TOKEN) if text_chars > 0 else 0


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt's text (messages, prompt or input), for estimates and prompt logging."""
    parts: list[str] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(
                    str(item.get("text", ""))
                    for item in content
                    if isinstance(item, dict) and item.get("type") == "text"
                )
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(item for item in value if isinstance(item, str))
    return "\n".join(parts)


@dataclass(slots=True)
class StreamMeter:
    started: float  # perf_counter() when the gateway received the request
    is_usage_stripped: bool  # the client did not ask for usage: drop the usage chunk
    is_capturing: bool  # keep the completion's text (the tenant's policy keeps prompts)
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    token_events: int = 0
    usage: dict[str, Any] | None = None
    has_error: bool = False
    is_done: bool = False  # `data: [DONE]` seen: the stream is complete for the client
    text: list[str] = field(default_factory=list)

    def feed(self, events: list[bytes], now: float) -> bytes:
        """The bytes to forward for these events (usage chunks removed when asked)."""
        out: list[bytes] = []
        for event in events:
            forwarded = self._feed_one(event, now)
            if forwarded:
                out.append(forwarded)
        return b"".join(out)

    def feed_bytes(self, data: bytes, now: float) -> tuple[bytes, bytes]:
        """The bytes to forward for the whole events in `data`, and the incomplete rest."""
        end = data.find(b"\n\n")
        if end >= 0 and end == len(data) - 2 and b"\r" not in data:
            # One whole event, LF-terminated: what the engine writes per token.
            return self._feed_one(data, now) or b"", b""
        events, rest = split_events(data)
        return self.feed(events, now), rest

    def _feed_one(self, event: bytes, now: float) -> bytes | None:
        forwarded = self._scan(event, now)
        if forwarded is _DECODE:
            return self._feed_decoded(event, now)
        return forwarded  # type: ignore[return-value]

    def _scan(self, event: bytes, now: float) -> bytes | object | None:
        """The bytes to forward for a plain token chunk, without decoding it; else _DECODE."""
        if (
            self.is_capturing
            or not event.startswith(b"data: {")
            or not event.endswith(b"}\n\n")
            or event.find(b"\n") != len(event) - 2  # one line: a single `data:` field
            or event.find(b'"error"') >= 0
        ):
            return _DECODE
        forwarded = event
        usage_at = event.find(b'"usage"')
        if usage_at >= 0:
            # Scanned only as the engine writes it: `"usage": null` as the last member of
            # the event's object (the `}` after it ends the event, so it is not nested,
            # and it is the only `"usage"`). Anything else, the usage object included
            # (once per stream), is decoded.
            null = _IS_NULL.match(event, usage_at + 7)
            if null is None or _ENDS.fullmatch(event, null.end()) is None:
                return _DECODE
            if self.is_usage_stripped:
                comma = event.rfind(b",", 0, usage_at)
                if (
                    comma < 0
                    or event[comma + 1 : usage_at].strip()
                    or _HAS_CHOICE.search(event) is None  # a usage-only chunk is dropped
                ):
                    return _DECODE
                # Cut the member out of the bytes rather than re-encoding the chunk: the
                # same bytes as _NULL_USAGE would cut.
                forwarded = event[:comma] + event[null.end() :]
        if _HAS_TEXT.search(event) is not None:
            self._token(now)
        return forwarded

    def _token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.gaps.append(now - self.last_token_at)  # type: ignore[operator]
        self.last_token_at = now
        self.token_events += 1

    def _feed_decoded(self, event: bytes, now: float) -> bytes | None:
        payload = _event_data(event)
        if not payload:
            return event
        if payload == b"[DONE]":
            self.is_done = True
            return event
        try:
            chunk = json.loads(payload)
        except (ValueError, RecursionError):
            return event
        if not isinstance(chunk, dict):
            return event
        if chunk.get("error"):
            self.has_error = True
            return event
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = chunk.get("choices") or []
        has_token = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                has_token = True
                if self.is_capturing:
                    self.text.append(text)
        if has_token:
            self._token(now)
        if "usage" in chunk and self.is_usage_stripped:
            if not choices:
                return None
            if chunk["usage"] is None:
                # Cut the member out of the bytes rather than re-encoding every chunk.
                stripped, count = _NULL_USAGE.subn(b"", event, count=1)
                if count == 1:
                    return stripped
            chunk.pop("usage")
            return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        return event

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def itl_mean_s(self) -> float | None:
        return sum(self.gaps) / len(self.gaps) if self.gaps else None

    @property
    def itl_p95_s(self) -> float | None:
        if not self.gaps:
            return None
        ordered = sorted(self.gaps)
        return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def response_usage_and_text(body: bytes, *, is_capturing: bool) -> tuple[dict | None, str]:
    """The `usage` of a whole (non-streamed) response and, when asked, its text."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None, ""
    if not isinstance(data, dict):
        return None, ""
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    text = ""
    if is_capturing:
        parts = []
        for choice in data.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            message = choice.get("message")
            content = message.get("content") if isinstance(message, dict) else choice.get("text")
            if isinstance(content, str):
                parts.append(content)
        text = "".join(parts)
    return usage, text
