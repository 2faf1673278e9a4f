"""OpenAI request parsing and response shapes. Parsing errors name the offending field."""

from __future__ import annotations

from typing import Any

from contracts.openai_request import RequestFieldError
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


def field_error(error: RequestFieldError) -> ApiError:
    return ApiError(400, error.message, param=error.param, code=error.code)


def _value(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def parse_sampling(
    body: dict[str, Any], *, chat: bool, remaining_context: int
) -> tuple[SamplingParams, bool]:
    """SamplingParams from a body the contract has checked (`contracts.openai_request`),
    and whether max_tokens was given explicitly."""
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = body["max_completion_tokens"]
    explicit = max_tokens is not None
    if max_tokens is None:
        max_tokens = max(1, remaining_context) if chat else 16
    if chat:
        logprobs = _value(body, "top_logprobs", 0) if body.get("logprobs") else None
    else:
        logprobs = body.get("logprobs")
    stop = _value(body, "stop", [])
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_value(body, "temperature", 1.0)),
        top_p=float(_value(body, "top_p", 1.0)),
        top_k=_value(body, "top_k", -1),
        seed=body.get("seed"),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(_value(body, "stop_token_ids", [])),
        ignore_eos=_value(body, "ignore_eos", False),
        logprobs=logprobs,
        presence_penalty=float(_value(body, "presence_penalty", 0.0)),
        frequency_penalty=float(_value(body, "frequency_penalty", 0.0)),
    )
    return params, explicit


def _message_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages of a checked body, as the template takes them."""
    return [
        {
            "role": "system" if message["role"] == "developer" else message["role"],
            "content": _message_text(message.get("content")),
        }
        for message in body["messages"]
    ]


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
