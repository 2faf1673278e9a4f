"""The OpenAI request bodies the engine serves, checked in one place.

The engine checks every body with these functions before it parses it, and the gateway
checks with the same functions before it forwards one, so a body the engine would
refuse never reaches an agent, and both refuse it alike: 400, the offending field in
`param`, a stable `code`:

- `unsupported_field`: a field of OpenAI's API the engine does not implement (tools,
  logit_bias, response_format, ...), refused rather than silently ignored;
- `unknown_field`: a field that is not part of the request at all (a typo);
- `invalid_value`: a value of the wrong type or outside its range.

Ranges keep every request cheap for the engine's one step thread and safe for the
batch it shares: at most 16 stop strings of 256 characters, 32 stop token ids, 20
logprobs; `seed` in [0, 2^63); `temperature` in [0, 2], where anything below
`GREEDY_TEMPERATURE` is greedy (as vLLM does: dividing logits by 1e-300 makes them
infinite); `n` only 1. Token ids are checked against the vocabulary by the engine,
which alone knows it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's _SAMPLING_EPS)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 32
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_TOKENS = 2**31 - 1
MAX_MESSAGES = 4096
MAX_EMBEDDING_INPUTS = 2048
MAX_USER_CHARS = 256
ROLES = ("system", "user", "assistant", "developer", "tool")

# Parts of OpenAI's API the engine does not implement: refused by name.
UNSUPPORTED_FIELDS = frozenset(
    {
        "audio",
        "best_of",
        "echo",
        "function_call",
        "functions",
        "logit_bias",
        "modalities",
        "parallel_tool_calls",
        "prediction",
        "reasoning_effort",
        "response_format",
        "suffix",
        "tool_choice",
        "tools",
        "web_search_options",
    }
)
_SAMPLING_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "n",
        "user",
        "return_token_ids",
    }
)
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs"}
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "user"})
MESSAGE_FIELDS = frozenset({"role", "content", "name"})


class RequestFieldError(ValueError):
    """A body the engine refuses; `param` names the field, `code` says why."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = f"{param}: {message}"
        self.code = code


def _present(body: Mapping[str, Any], name: str) -> bool:
    return body.get(name) is not None


def _integer(body: Mapping[str, Any], name: str, low: int, high: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestFieldError(name, f"must be an integer, got {_show(value)}")
    if not low <= value <= high:
        raise RequestFieldError(name, f"must be in [{low}, {high}], got {value}")


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestFieldError(name, f"must be a number, got {_show(value)}")
    if not math.isfinite(value) or not low <= value <= high:
        raise RequestFieldError(name, f"must be in [{low:g}, {high:g}], got {_show(value)}")


def _boolean(body: Mapping[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestFieldError(name, f"must be a boolean, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str], where: str = "") -> None:
    for name in sorted(body, key=str):
        if name in allowed:
            continue
        param = f"{where}{name}"
        if name in UNSUPPORTED_FIELDS:
            raise RequestFieldError(param, "is not supported by this server", "unsupported_field")
        raise RequestFieldError(param, "is not a field of this request", "unknown_field")


def _check_common(body: Mapping[str, Any]) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestFieldError("model", "must be a string")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise RequestFieldError("user", f"must be a string of at most {MAX_USER_CHARS} characters")


def _check_sampling(body: Mapping[str, Any]) -> None:
    _check_common(body)
    _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestFieldError("stream_options", "must be an object with include_usage")
        _boolean(options, "include_usage")
    _integer(body, "n", 1, 1)
    _integer(body, "max_tokens", 1, MAX_TOKENS)
    _number(body, "temperature", 0.0, 2.0)
    top_p = body.get("top_p")
    _number(body, "top_p", 0.0, 1.0)
    if top_p == 0:
        raise RequestFieldError("top_p", "must be in (0, 1], got 0")
    top_k = body.get("top_k")
    _integer(body, "top_k", -1, MAX_TOKENS)
    if top_k == 0:
        raise RequestFieldError("top_k", "must be -1 (off) or at least 1, got 0")
    _integer(body, "seed", 0, MAX_SEED)
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _boolean(body, "ignore_eos")
    _boolean(body, "return_token_ids")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops)
        ):
            raise RequestFieldError(
                "stop",
                f"must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
                f"of at most {MAX_STOP_STRING_CHARS} characters",
            )
    ids = body.get("stop_token_ids")
    if ids is not None and (
        not isinstance(ids, list)
        or len(ids) > MAX_STOP_TOKEN_IDS
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise RequestFieldError(
            "stop_token_ids",
            f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)",
        )


def _message_text(content: Any, index: int) -> None:
    where = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestFieldError(where, "must be a string or a list of text parts")
    for position, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
            or set(part) - {"type", "text"}
        ):
            raise RequestFieldError(
                f"{where}[{position}]", "only text parts ({type: text, text}) are supported"
            )


def check_chat_request(body: Mapping[str, Any]) -> None:
    """Raise RequestFieldError for the first bad field of a /v1/chat/completions body."""
    _check_fields(body, CHAT_FIELDS)
    _check_sampling(body)
    _integer(body, "max_completion_tokens", 1, MAX_TOKENS)
    _boolean(body, "logprobs")
    _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if _present(body, "top_logprobs") and body.get("logprobs") is not True:
        raise RequestFieldError("top_logprobs", "requires logprobs to be true")
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise RequestFieldError("messages", f"must be a list of 1 to {MAX_MESSAGES} messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestFieldError(where, "must be an object with a role and content")
        _check_fields(message, MESSAGE_FIELDS, f"{where}.")
        if message.get("role") not in ROLES:
            raise RequestFieldError(f"{where}.role", f"must be one of {', '.join(ROLES)}")
        _message_text(message.get("content"), index)
        name = message.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > MAX_USER_CHARS):
            raise RequestFieldError(f"{where}.name", "must be a short string")


def check_completion_request(body: Mapping[str, Any]) -> None:
    """Raise RequestFieldError for the first bad field of a /v1/completions body."""
    _check_fields(body, COMPLETION_FIELDS)
    _check_sampling(body)
    _integer(body, "logprobs", 0, MAX_LOGPROBS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list
    is_text = isinstance(prompt, str) and prompt != ""
    is_ids = (
        isinstance(prompt, list)
        and prompt != []
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    )
    if not (is_text or is_ids):
        raise RequestFieldError(
            "prompt", "must be a non-empty string or list of token ids (one prompt)"
        )


def check_embedding_request(body: Mapping[str, Any]) -> None:
    """Raise RequestFieldError for the first bad field of a /v1/embeddings body."""
    _check_fields(body, EMBEDDING_FIELDS)
    _check_common(body)
    inputs = body.get("input")
    items = [inputs] if isinstance(inputs, str) else inputs
    if (
        not isinstance(items, list)
        or not 0 < len(items) <= MAX_EMBEDDING_INPUTS
        or not all(isinstance(item, str) for item in items)
    ):
        raise RequestFieldError(
            "input", f"must be a string or a list of 1 to {MAX_EMBEDDING_INPUTS} strings"
        )
    if body.get("encoding_format") not in (None, "float", "base64"):
        raise RequestFieldError("encoding_format", "must be float or base64")


CHECKS = {
    "chat": check_chat_request,
    "completions": check_completion_request,
    "embeddings": check_embedding_request,
}
