"""One streamed request to an OpenAI-compatible endpoint, timed on the client side.

TTFT is taken at the first chunk that carries content (the role-only first chunk of a chat
stream does not count), inter-token latencies between later content chunks. Completion
tokens come from the final usage chunk (`stream_options.include_usage`); a server that
sends none is counted by content chunks instead.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

CONNECT_ERROR = "connect_error"
TIMEOUT = "timeout"
STREAM_ERROR = "stream_error"
CLIENT_ERROR = "client_error"


@dataclass(slots=True)
class RequestSpec:
    tenant: str
    api_key: str | None
    prompt: str
    max_tokens: int
    session: str | None = None


@dataclass(slots=True)
class RequestResult:
    tenant: str
    status: str  # the HTTP status as text, or one of the *_ERROR names above
    started: float  # time.monotonic() at send
    e2e_s: float
    ttft_s: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    content_chunks: int = 0
    is_usage_reported: bool = False
    request_id: str | None = None
    error: str | None = None

    @property
    def is_success(self) -> bool:
        return self.status == "200" and self.error is None

    @property
    def is_connection_failure(self) -> bool:
        return self.status in (CONNECT_ERROR,)


def request_body(
    spec: RequestSpec,
    *,
    model: str,
    endpoint: str,
    temperature: float | None,
    ignore_eos: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if temperature is not None:
        body["temperature"] = temperature
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension; other servers ignore unknown fields
    if spec.session:
        body["user"] = spec.session
    return body


def _content(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    spec: RequestSpec,
    body: dict[str, Any],
    endpoint: str,
) -> RequestResult:
    """Send one streamed request and time it. Never raises for network or server errors."""
    headers = {"accept": "text/event-stream"}
    if spec.api_key:
        headers["authorization"] = f"Bearer {spec.api_key}"
    started = time.monotonic()
    result = RequestResult(tenant=spec.tenant, status="", started=started, e2e_s=0.0)
    last_token_at: float | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            result.status = str(response.status_code)
            result.request_id = response.headers.get("x-request-id")
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = text[:300] or response.reason_phrase
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.monotonic()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = chunk["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        result.status = STREAM_ERROR
                        result.error = str(message)[:300]
                        break
                    if _content(chunk, endpoint):
                        result.content_chunks += 1
                        if last_token_at is None:
                            result.ttft_s = now - started
                        else:
                            result.itls.append(now - last_token_at)
                        last_token_at = now
                    usage = chunk.get("usage")
                    if usage:
                        result.is_usage_reported = True
                        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        result.completion_tokens = int(usage.get("completion_tokens") or 0)
    except (httpx.ConnectError, httpx.ConnectTimeout) as error:
        result.status, result.error = CONNECT_ERROR, str(error) or type(error).__name__
    except httpx.TimeoutException as error:
        result.status, result.error = TIMEOUT, str(error) or type(error).__name__
    except (httpx.TransportError, json.JSONDecodeError) as error:
        result.status, result.error = STREAM_ERROR, str(error) or type(error).__name__
    except Exception as error:  # a load generator that crashes measures nothing
        result.status, result.error = CLIENT_ERROR, f"{type(error).__name__}: {error}"
    result.e2e_s = time.monotonic() - started
    if not result.is_usage_reported:
        result.completion_tokens = result.content_chunks
    return result
