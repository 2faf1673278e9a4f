"""Per-tenant requests-per-minute and tokens-per-minute limits, atomic across gateways.

Fixed one-minute windows aligned to Redis's own clock (`TIME` inside the script), so
every gateway process agrees on the window whatever its own clock says. One Lua script
checks both counters and, only when both allow it, counts the request and reserves the
most tokens it can use (`token_reservation`): a refused request leaves no trace. After the
response, a settlement gives back what it did not use, in the window it was admitted in,
so the tokens admitted in one window never exceed the limit, however many requests are
in flight. The engine caps each request at its reservation (`x-token-budget`), so even a
prompt longer than its bound cannot overrun. Both are sent by
`recorder.RedisBatcher`, with other requests' commands in one pipeline, as EVALSHA of
the scripts' hashes (it loads them again when Redis has lost them).

Keys: `ratelimit:{<tenant_id>}:r:<window_start>` and `...:t:<window_start>` (the hash
tag keeps one tenant's keys on one cluster slot); they expire two minutes after use.

`Headroom` remembers which tenants were far below both limits at their last admission
in this process: for them the gateway sends the request on to the agent while the
admission is still on its way (see app.py), so the Redis round trip adds nothing to the
time to first token.
"""

import hashlib
from dataclasses import dataclass
from typing import Any

WINDOW_S = 60

# The bounds behind a reservation. A byte-level BPE token (SmolLM2's, GPT-2's, Llama 3's)
# covers at least one byte of text; a chat template adds tokens of its own (SmolLM2's, with
# its default system prompt, 35 around one message).
TEMPLATE_TOKENS = 64
TEMPLATE_TOKENS_PER_MESSAGE = 8
EMBEDDING_TOKENS_PER_INPUT = 2  # [CLS] and [SEP]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the engine's (and OpenAI's) default for /v1/completions

ADMIT_SCRIPT = """
local now = tonumber(redis.call('TIME')[1])
local window = now - (now % 60)
local prefix = 'ratelimit:{' .. ARGV[1] .. '}:'
local requests_key = prefix .. 'r:' .. window
local tokens_key = prefix .. 't:' .. window
local requests_limit = tonumber(ARGV[2])
local tokens_limit = tonumber(ARGV[3])
local reservation = tonumber(ARGV[4])
local retry_after = window + 60 - now
local requests_used = tonumber(redis.call('GET', requests_key) or '0')
local tokens_used = tonumber(redis.call('GET', tokens_key) or '0')
if requests_used + 1 > requests_limit then
  return {0, retry_after, window, 'requests', requests_used, tokens_used}
end
if tokens_used + reservation > tokens_limit then
  return {0, retry_after, window, 'tokens', requests_used, tokens_used}
end
requests_used = redis.call('INCR', requests_key)
redis.call('EXPIRE', requests_key, 120)
tokens_used = redis.call('INCRBY', tokens_key, reservation)
redis.call('EXPIRE', tokens_key, 120)
return {1, 0, window, '', requests_used, tokens_used}
"""

SETTLE_SCRIPT = """
local key = 'ratelimit:{' .. ARGV[1] .. '}:t:' .. ARGV[2]
if redis.call('EXISTS', key) == 1 then
  redis.call('INCRBY', key, tonumber(ARGV[3]))
end
return 1
"""

_ADMIT_SHA = hashlib.sha1(ADMIT_SCRIPT.encode(), usedforsecurity=False).hexdigest()
_SETTLE_SHA = hashlib.sha1(SETTLE_SCRIPT.encode(), usedforsecurity=False).hexdigest()


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, list):  # content parts, or a list of prompts
        return sum(
            _text_bytes(item.get("text")) if isinstance(item, dict) else _text_bytes(item)
            for item in value
        )
    return 0


def _prompt_bound(body: dict[str, Any], kind: str) -> int:
    """At most how many tokens the request's input becomes."""
    if kind == "embeddings":
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        return sum(_text_bytes(item) + EMBEDDING_TOKENS_PER_INPUT for item in inputs)
    if kind == "chat":
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        return TEMPLATE_TOKENS + sum(
            TEMPLATE_TOKENS_PER_MESSAGE
            + (_text_bytes(message.get("content")) if isinstance(message, dict) else 0)
            for message in messages
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in prompt
    ):
        return len(prompt)  # token ids
    return TEMPLATE_TOKENS + _text_bytes(prompt)


def token_reservation(
    body: dict[str, Any], kind: str, *, max_model_len: int, default_completion_tokens: int
) -> int:
    """The most tokens (prompt and completion) the request can use, reserved at admission.

    The completion's bound is max_tokens when given; without it a chat completion may
    fill the context (so the request is bounded by `max_model_len`, its version's context,
    when known; else the prompt's bound plus `default_completion_tokens`, which the
    engine then enforces).
    """
    prompt = _prompt_bound(body, kind)
    if kind == "embeddings":
        return prompt
    max_tokens = body.get("max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = body["max_completion_tokens"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        max_tokens = None  # absent, or invalid (the engine refuses it)
    if max_tokens is None:
        if kind != "chat":
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        elif max_model_len:
            return max_model_len
        else:
            max_tokens = default_completion_tokens
    total = prompt + max_tokens
    return min(total, max_model_len) if max_model_len else total


@dataclass(slots=True, frozen=True)
class Admission:
    is_allowed: bool
    retry_after_s: int
    window: int  # start of the window the request was counted in (unix seconds)
    limit: str  # "requests" or "tokens" when refused
    requests_used: int = 0  # the window's counts, this request's included when allowed
    tokens_used: int = 0


def admission_command(
    tenant_id: int, requests_per_minute: int, tokens_per_minute: int, reservation: int
) -> tuple[Any, ...]:
    """The admission as one Redis command (for a pipeline)."""
    return (
        "EVALSHA",
        _ADMIT_SHA,
        0,
        tenant_id,
        requests_per_minute,
        tokens_per_minute,
        max(0, reservation),
    )


def admission_from_reply(reply: list[Any]) -> Admission:
    allowed, retry_after, window, limit, requests_used, tokens_used = reply
    return Admission(
        bool(allowed),
        max(1, int(retry_after)),
        int(window),
        limit.decode() if isinstance(limit, bytes) else str(limit),
        int(requests_used),
        int(tokens_used),
    )


class Headroom:
    """Which tenants were far below both limits at their last admission, moments ago.

    Only a hint: the Redis script still decides every request. A wrong hint costs the
    agent a request that is cancelled before any byte of it reaches the client.
    """

    FRACTION = 0.5  # both counts at most half their limit...
    FRESH_S = 5.0  # ...at an admission at most this long ago

    def __init__(self) -> None:
        self._plenty_until: dict[int, float] = {}  # tenant id -> monotonic deadline

    def record(
        self,
        tenant_id: int,
        admission: Admission,
        *,
        requests_per_minute: int,
        tokens_per_minute: int,
        now: float,
    ) -> None:
        if (
            admission.is_allowed
            and admission.requests_used <= requests_per_minute * self.FRACTION
            and admission.tokens_used <= tokens_per_minute * self.FRACTION
        ):
            if len(self._plenty_until) > 100_000:
                self._plenty_until.clear()
            self._plenty_until[tenant_id] = now + self.FRESH_S
        else:
            self._plenty_until.pop(tenant_id, None)

    def is_plenty(self, tenant_id: int, now: float) -> bool:
        return self._plenty_until.get(tenant_id, 0.0) > now


def settle_command(tenant_id: int, window: int, delta: int) -> tuple[Any, ...]:
    """The correction of a window's token count by `delta` (used minus reserved)."""
    return ("EVALSHA", _SETTLE_SHA, 0, tenant_id, window, delta)
