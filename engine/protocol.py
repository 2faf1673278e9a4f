"""OpenAI request parsing and response shapes. Parsing errors name the offending field."""

from __future__ import annotations

import math
from typing import Any

from engine.sequence import SamplingParams, TokenLogprob


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise bad_request(name, f"must be a number, got {value!r}")
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"must be an integer, got {value!r}")
    return value


def _boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"must be a boolean, got {value!r}")
    return value


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise bad_request("stop", "must be a string or a list of strings")


def _token_ids(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return list(value)
    raise bad_request(name, "must be a list of integers")


def parse_sampling(
    body: dict[str, Any], *, chat: bool, remaining_context: int
) -> tuple[SamplingParams, bool]:
    """SamplingParams from an OpenAI body, and whether max_tokens was given explicitly."""
    n = _integer(body, "n", 1)
    if n != 1:
        raise bad_request("n", "only n=1 is supported")
    max_tokens_name = "max_tokens"
    max_tokens = _integer(body, "max_tokens", None)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens_name = "max_completion_tokens"
        max_tokens = _integer(body, "max_completion_tokens", None)
    explicit = max_tokens is not None
    if max_tokens is None:
        max_tokens = max(1, remaining_context) if chat else 16
    if max_tokens < 1:
        raise bad_request(max_tokens_name, f"must be >= 1, got {max_tokens}")
    if chat:
        logprobs: int | None = None
        if _boolean(body, "logprobs", False):
            logprobs = _integer(body, "top_logprobs", 0)
        elif body.get("top_logprobs") is not None:
            raise bad_request("top_logprobs", "requires logprobs to be true")
    else:
        logprobs = _integer(body, "logprobs", None)
    seed = _integer(body, "seed", None)
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0),
        "top_p": _number(body, "top_p", 1.0),
        "top_k": _integer(body, "top_k", -1),
        "seed": seed,
        "stop": _stop_strings(body),
        "stop_token_ids": _token_ids(body, "stop_token_ids"),
        "ignore_eos": _boolean(body, "ignore_eos", False),
        "logprobs": logprobs,
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
    }
    try:
        return SamplingParams(**fields), explicit
    except ValueError as error:
        param, _, message = str(error).partition(": ")
        if param == "logprobs" and chat:
            param = "top_logprobs"
        raise bad_request(param, message) from None


def message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"messages[{index}].content", "only text parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"messages[{index}].content", "must be a string or a list of text parts")


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "must be a non-empty list")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{index}]", "must be an object with a string role")
        role = message["role"]
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_request(f"messages[{index}].role", f"unknown role {role!r}")
        parsed.append({"role": "system" if role == "developer" else role,
                       "content": message_text(message.get("content"), index)})  # fmt: skip
    return parsed


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob], token_text: Any) -> dict[str, Any]:
    content = []
    for entry in entries:
        token = token_text(entry.token_id)
        content.append(
            {
                "token": token,
                "logprob": entry.logprob,
                "bytes": token_bytes(token),
                "top_logprobs": [
                    {"token": (t := token_text(i)), "logprob": lp, "bytes": token_bytes(t)}
                    for i, lp in entry.top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    entries: list[TokenLogprob], token_text: Any, offset: int
) -> dict[str, Any]:
    tokens = [token_text(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(i): lp for i, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
