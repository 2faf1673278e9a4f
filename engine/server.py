"""OpenAI-compatible HTTP API as a small ASGI app (served by uvicorn).

The step loop runs in the engine's thread; handlers submit requests and await a
per-request asyncio.Queue that the engine fills via call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from contracts.engine_identity import IDENTITY_PATH
from contracts.openai_request import (
    RequestFieldError,
    check_chat_request,
    check_completion_request,
    check_embedding_request,
)
from engine import spans
from engine.config import EngineConfig, EngineSecrets
from engine.embedder import EmbeddingService
from engine.http_auth import EngineAuth
from engine.llm_engine import EngineFailedError, LLMEngine, QueueFullError, RequestOutput
from engine.protocol import (
    ApiError,
    bad_request,
    chat_logprobs,
    completion_logprobs,
    field_error,
    parse_messages,
    parse_sampling,
)
from engine.request_ids import REQUEST_ID_HEADER, request_id_from
from engine.sequence import SamplingParams

logger = logging.getLogger("engine.server")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
MAX_BODY_BYTES = 8 * 2**20


def _put(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[RequestOutput], out: RequestOutput
) -> None:
    # Called from the engine thread: hand the output to the request's event loop.
    loop.call_soon_threadsafe(queue.put_nowait, out)


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of a header (`name` in lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class HttpRequest:
    def __init__(self, scope: Scope, receive: Receive, send: Send, request_id: str = ""):
        self.scope = scope
        self.request_id = request_id
        self.receive = receive
        self.send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.disconnected = asyncio.Event()

    def header(self, name: bytes) -> str | None:
        """The first value of a header (`name` in lower case), or None."""
        return _header(self.scope, name)

    async def json(self) -> dict[str, Any]:
        chunks = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                raise ApiError(400, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deeply
            raise ApiError(400, f"malformed JSON body: {error}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        return body

    async def watch_disconnect(self, on_disconnect: Callable[[], None]) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                on_disconnect()
                return

    async def respond(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        raw_headers = [
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        for name, value in (headers or {}).items():
            raw_headers.append((name.lower().encode(), value.encode()))
        await self.send({"type": "http.response.start", "status": status, "headers": raw_headers})
        await self.send({"type": "http.response.body", "body": body})

    async def respond_json(
        self, status: int, payload: Any, headers: dict[str, str] | None = None
    ) -> None:
        await self.respond(status, json.dumps(payload).encode(), "application/json", headers)


class EngineApp:
    """The ASGI application: one LLM engine (or none, for embedding-only servers)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        secrets: EngineSecrets,
        embedding_only: bool = False,
        agent_name: str = "",
    ):
        self.config = config
        self.registry = CollectorRegistry()  # the server's own series, beside the engine's
        # agent_name: "" for an engine started by hand.
        self.auth = EngineAuth(secrets, agent_name=agent_name, registry=self.registry)
        self.embedding_only = embedding_only
        self.engine = None if embedding_only else LLMEngine(config)
        # An embedding-only server given a folder serves that folder's encoder.
        folder = Path(config.model) if embedding_only and config.model != "minilm" else None
        self.embeddings = EmbeddingService(config.embedding_batch_size, config.threads, folder)
        self.state = "loading"
        self.active_requests = 0
        self.load_error: str | None = None
        self.on_drained: Callable[[], None] | None = None
        self.on_failed: Callable[[], None] | None = None
        self._loader: threading.Thread | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.created = int(time.time())

    # ---- lifecycle -----------------------------------------------------------------
    def start_loading(self) -> None:
        self._loader = threading.Thread(target=self._load, name="engine-loader", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        try:
            if self.engine is not None:
                self.engine.load()
                self.engine.warm_up()
                self.engine.start()
            else:
                self.embeddings.load()
            if self.state == "loading":
                self.state = "ready"
            logger.info("ready: serving %s", self.config.served_model_name)
        except Exception as error:
            logger.exception("loading failed")
            self.load_error = str(error)
            self.state = "failed"
            if self.on_failed is not None:
                self.on_failed()

    def wait_loaded(self, timeout: float | None = None) -> None:
        if self._loader is not None:
            self._loader.join(timeout)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.embeddings.stop()

    def drain(self) -> None:
        """Refuse new requests, let in-flight ones finish, then call on_drained."""
        if self.state == "draining":
            return
        self.state = "draining"
        if self.engine is not None:
            self.engine.state = "draining"
        loop = asyncio.get_running_loop()
        self._drain_task = loop.create_task(self._finish_drain())

    async def _finish_drain(self) -> None:
        while self.active_requests or (self.engine is not None and self.engine.num_unfinished):
            await asyncio.sleep(0.05)
        logger.info("drained")
        if self.on_drained is not None:
            self.on_drained()

    # ---- ASGI ----------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request_id = request_id_from(_header(scope, REQUEST_ID_HEADER))
        started = time.monotonic()
        status: int | None = None

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (REQUEST_ID_HEADER, request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self._route(HttpRequest(scope, receive, send_with_id, request_id))
        finally:
            path = str(scope["path"])
            # One line per API request; probes and the agent's polls only at debug.
            logger.log(
                logging.INFO if path.startswith("/v1/") else logging.DEBUG,
                "%s %s %s",
                scope["method"],
                path[:200],
                status,
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": path[:200],
                    "status": status,
                    "duration_ms": round((time.monotonic() - started) * 1000, 1),
                },
            )

    async def _route(self, request: HttpRequest) -> None:
        routes: dict[tuple[str, str], Callable[[HttpRequest], Awaitable[None]]] = {
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/embeddings"): self.create_embeddings,
            ("GET", "/metrics"): self.prometheus,
            ("GET", "/admin/stats"): self.admin_stats,
            ("POST", "/admin/drain"): self.admin_drain,
            ("POST", "/admin/faults"): self.admin_faults,
            ("GET", "/admin/faults"): self.admin_faults,
        }
        handler = routes.get((request.method, request.path.rstrip("/") or "/"))
        try:
            if request.method == "GET" and request.path == IDENTITY_PATH:
                await self.identity(request)  # no credential: it proves, it opens nothing
                return
            # Before anything else, unknown paths included: a refused request touches nothing.
            self.auth.authenticate(request.path, request.header(b"authorization"))
            if handler is None:
                known = {path for _, path in routes}
                if request.path in known:
                    raise ApiError(
                        405, f"method {request.method} not allowed", code="method_not_allowed"
                    )
                raise ApiError(
                    404, f"no route {request.path}", type="not_found_error", code="not_found"
                )
            await handler(request)
        except ApiError as error:
            await request.respond_json(error.status, error.body(), error.headers)
        except Exception:
            logger.exception(
                "unhandled error on %s", request.path, extra={"request_id": request.request_id}
            )
            internal = ApiError(
                500, "internal server error", type="server_error", code="internal_error"
            )
            await request.respond_json(500, internal.body())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self._loader is None:
                    self.start_loading()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.to_thread(self.shutdown)
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- simple endpoints ----------------------------------------------------------
    @property
    def status(self) -> str:
        """loading, ready, draining, or failed: at load, or since the step loop failed."""
        if self.engine is not None and self.engine.state == "failed":
            return "failed"
        return self.state

    @property
    def failure(self) -> str | None:
        if self.engine is not None and self.engine.error is not None:
            return str(self.engine.error)
        return self.load_error

    async def health(self, request: HttpRequest) -> None:
        status = self.status
        if status == "ready":
            await request.respond_json(200, {"status": "ready"})
        elif status == "failed":
            await request.respond_json(503, {"status": "failed", "error": self.failure})
        else:
            await request.respond_json(503, {"status": status})

    async def identity(self, request: HttpRequest) -> None:
        """Which agent this engine serves for, proved (engine/http_auth.py)."""
        query_string = bytes(request.scope.get("query_string", b""))
        await request.respond_json(200, self.auth.identity(query_string))

    async def models(self, request: HttpRequest) -> None:
        names = [self.config.served_model_name]
        if not self.embedding_only and self.embeddings.is_available:
            names.append(self.embeddings.model_name)
        data = [{"id": n, "object": "model", "created": self.created, "owned_by": "engine",
                 "max_model_len": self.config.max_model_len} for n in names]  # fmt: skip
        await request.respond_json(200, {"object": "list", "data": data})

    async def prometheus(self, request: HttpRequest) -> None:
        body = generate_latest(self.registry)
        if self.engine is not None:
            body = generate_latest(self.engine.metrics.registry) + body
        await request.respond(200, body, CONTENT_TYPE_LATEST)

    async def admin_stats(self, request: HttpRequest) -> None:
        engine = self.engine
        stats: dict[str, Any] = {
            "model": self.config.model,
            "served_model_name": self.config.served_model_name,
            "dtype": self.config.dtype,
            "state": self.status,
        }
        if engine is not None:
            stats.update(engine.stats())
            stats["faults"] = self._faults()
            stats["recent"] = engine.metrics.recent_list()
        else:
            stats.update(
                {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "prompt_tokens_total": 0,
                 "generation_tokens_total": 0, "requests_finished_total": 0,
                 "requests_failed_total": 0, "faults": self._faults(), "recent": []}
            )  # fmt: skip
        await request.respond_json(200, stats)

    def _faults(self) -> dict[str, float]:
        if self.engine is None:
            return {"latency_ms_per_token": 0.0, "error_rate": 0.0}
        return {
            "latency_ms_per_token": self.engine.fault_latency_ms,
            "error_rate": self.engine.fault_error_rate,
        }

    async def admin_drain(self, request: HttpRequest) -> None:
        self.drain()
        await request.respond_json(202, {"status": "draining"})

    async def admin_faults(self, request: HttpRequest) -> None:
        if request.method == "POST":
            body = await request.json()
            current = self._faults()
            values = {}
            for name in ("latency_ms_per_token", "error_rate"):
                value = body.get(name, current[name])
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise bad_request(name, f"must be a number, got {value!r}")
                values[name] = float(value)
            if self.engine is None:
                raise ApiError(400, "this server has no generation engine", code="no_engine")
            try:
                self.engine.set_faults(values["latency_ms_per_token"], values["error_rate"])
            except ValueError as error:
                param = str(error).split(" ", 1)[0]
                raise bad_request(param, str(error).split(" ", 1)[1]) from None
            logger.warning("faults set: %s", values)
        await request.respond_json(200, self._faults())

    # ---- generation ----------------------------------------------------------------
    def _check_accepting(self) -> LLMEngine:
        if self.status == "failed":
            raise ApiError(
                503, f"the engine failed: {self.failure}", type="service_unavailable",
                code="engine_failed",
            )  # fmt: skip
        if self.state == "draining":
            raise ApiError(503, "server is draining", type="service_unavailable", code="draining")
        if self.state != "ready" or self.engine is None:
            if self.engine is None and self.state == "ready":
                raise ApiError(404, "this server only serves embeddings", code="model_not_found")
            raise ApiError(503, "model is loading", type="service_unavailable", code="loading")
        return self.engine

    def _check_length(
        self, prompt_tokens: int, params: SamplingParams, explicit: bool, param: str
    ) -> None:
        limit = self.config.max_model_len
        if prompt_tokens >= limit or (explicit and prompt_tokens + params.max_tokens > limit):
            requested = prompt_tokens + (params.max_tokens if explicit else 0)
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{requested} tokens ({prompt_tokens} in the prompt, "
                f"{params.max_tokens if explicit else 0} for the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                param=param,
                code="context_length_exceeded",
            )

    @staticmethod
    def _within_budget(
        request: HttpRequest, params: SamplingParams, prompt_tokens: int, chat: bool
    ) -> SamplingParams:
        """Cap the completion so prompt and completion fit the tokens the gateway reserved
        for this request (`x-token-budget`): a tenant's token limit then holds exactly."""
        raw = request.header(b"x-token-budget")
        if raw is None:
            return params
        if not re.fullmatch(r"[0-9]{1,12}", raw) or int(raw) < 1:
            raise bad_request("x-token-budget", f"must be a positive integer, got {raw[:20]!r}")
        budget = int(raw)
        available = budget - prompt_tokens
        if available < 1:
            raise ApiError(
                400,
                f"The prompt's {prompt_tokens} tokens leave nothing of the {budget} tokens "
                "reserved for this request.",
                param="messages" if chat else "prompt",
                code="token_budget_exceeded",
            )
        if params.max_tokens > available:
            return dataclasses.replace(params, max_tokens=available)
        return params

    def _inject_fault(self, engine: LLMEngine) -> None:
        if engine.fault_error_rate > 0 and random.random() < engine.fault_error_rate:
            engine.metrics.record_finished(
                status="error", reason="error", ttft_s=None, inter_token_latencies=[],
                e2e_s=0.0, queue_s=None, prompt_tokens=0, completion_tokens=0,
            )  # fmt: skip
            raise ApiError(500, "injected fault", type="server_error", code="injected_fault")

    async def _generate(
        self, request: HttpRequest, engine: LLMEngine, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = uuid.uuid4().hex
        try:
            sequence = engine.add_request(
                prompt_ids, params, request_id, lambda out: _put(loop, queue, out)
            )
        except EngineFailedError as error:
            raise ApiError(503, str(error), type="service_unavailable",
                           code="engine_failed") from None  # fmt: skip
        except QueueFullError as error:
            raise ApiError(429, str(error), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None  # fmt: skip
        spans.sequence_added(sequence)
        watcher = loop.create_task(request.watch_disconnect(lambda: engine.abort(request_id)))
        finished = False
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            watcher.cancel()
            if not finished:
                engine.abort(request_id)

    async def _handle(self, request: HttpRequest, chat: bool) -> None:
        engine = self._check_accepting()
        body = await request.json()
        try:
            (check_chat_request if chat else check_completion_request)(body)
        except RequestFieldError as error:
            raise field_error(error) from None
        self._check_model(body, (self.config.served_model_name,))
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if chat:
            messages = parse_messages(body)
            try:
                prompt_ids = engine.tokenizer.encode_chat(messages)
            except ValueError as error:
                raise bad_request("messages", str(error)) from None
        else:
            prompt_ids = self._completion_prompt(engine, body["prompt"])
        vocab = engine.model_config.vocab_size
        if any(token >= vocab for token in body.get("stop_token_ids") or ()):
            raise bad_request("stop_token_ids", f"token ids must be in [0, {vocab})")
        params, explicit = parse_sampling(
            body, chat=chat, remaining_context=self.config.max_model_len - len(prompt_ids)
        )
        self._check_length(len(prompt_ids), params, explicit, "messages" if chat else "prompt")
        params = self._within_budget(request, params, len(prompt_ids), chat)
        return_token_ids = bool(body.get("return_token_ids", False))
        self._inject_fault(engine)
        self.active_requests += 1
        try:
            outputs = self._generate(request, engine, prompt_ids, params)
            response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            if stream:
                await self._stream(
                    request, engine, outputs, response_id, chat, include_usage, params
                )
            else:
                await self._collect(request, engine, outputs, response_id, chat, params,
                                    prompt_ids if return_token_ids else None)  # fmt: skip
        finally:
            self.active_requests -= 1

    @staticmethod
    def _check_model(body: dict[str, Any], names: tuple[str, ...]) -> None:
        model = body.get("model")
        if model is not None and model not in names:
            raise ApiError(
                404, f"The model {model[:100]!r} does not exist.", param="model",
                code="model_not_found",
            )  # fmt: skip

    def _completion_prompt(self, engine: LLMEngine, prompt: Any) -> list[int]:
        """The token ids of a checked prompt (a string, or ids, alone or in a list of one)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return engine.tokenizer.encode(prompt)
        vocab = engine.model_config.vocab_size
        if any(t >= vocab for t in prompt):
            raise bad_request("prompt", f"token ids must be in [0, {vocab})")
        return list(prompt)

    def _token_text(self, engine: LLMEngine) -> Callable[[int], str]:
        def text(token_id: int) -> str:
            return engine.tokenizer.decode([token_id], skip_special_tokens=False)

        return text

    async def _collect(
        self,
        request: HttpRequest,
        engine: LLMEngine,
        outputs: AsyncIterator[RequestOutput],
        response_id: str,
        chat: bool,
        params: SamplingParams,
        prompt_ids: list[int] | None,
    ) -> None:
        text_parts: list[str] = []
        token_ids: list[int] = []
        logprob_entries = []
        last: RequestOutput | None = None
        async for out in outputs:
            text_parts.append(out.text)
            token_ids.extend(out.token_ids)
            logprob_entries.extend(out.logprobs)
            last = out
        assert last is not None
        if last.finish_reason == "abort" or request.disconnected.is_set():
            return
        if last.finish_reason == "error":
            raise ApiError(
                500, f"generation failed: {last.error}", type="server_error", code="engine_error"
            )
        text = "".join(text_parts)
        usage = self._usage(last)
        token_text = self._token_text(engine)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(logprob_entries, token_text)
                if params.logprobs is not None
                else None,
                "finish_reason": last.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": completion_logprobs(logprob_entries, token_text, 0)
                if params.logprobs is not None
                else None,
                "finish_reason": last.finish_reason,
            }
        if prompt_ids is not None:
            choice["token_ids"] = token_ids
            choice["prompt_token_ids"] = prompt_ids
        payload = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.served_model_name,
            "choices": [choice],
            "usage": usage,
        }
        await request.respond_json(200, payload)

    @staticmethod
    def _usage(out: RequestOutput) -> dict[str, Any]:
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }

    async def _stream(
        self,
        request: HttpRequest,
        engine: LLMEngine,
        outputs: AsyncIterator[RequestOutput],
        response_id: str,
        chat: bool,
        include_usage: bool,
        params: SamplingParams,
    ) -> None:
        created = int(time.time())
        model = self.config.served_model_name
        token_text = self._token_text(engine)
        started = False
        text_offset = 0

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": response_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if include_usage:
                payload["usage"] = usage
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        async def send(data: bytes) -> None:
            nonlocal started
            if not started:
                started = True
                await request.send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                ]})  # fmt: skip
            await request.send({"type": "http.response.body", "body": data, "more_body": True})

        last: RequestOutput | None = None
        if chat:
            await send(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]))  # fmt: skip
        async for out in outputs:
            last = out
            if request.disconnected.is_set():
                continue
            if out.finish_reason == "error":
                error = ApiError(
                    500, f"generation failed: {out.error}", type="server_error", code="engine_error"
                )
                await send(b"data: " + json.dumps(error.body()).encode() + b"\n\n")
                break
            if out.finish_reason == "abort":
                break
            if not out.text and not out.finished and not out.logprobs:
                continue
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }
            if chat:
                choice["delta"] = {"content": out.text} if out.text or not out.finished else {}
                if params.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(out.logprobs, token_text)
            else:
                choice["text"] = out.text
                if params.logprobs is not None:
                    choice["logprobs"] = completion_logprobs(out.logprobs, token_text, text_offset)
                text_offset += len(out.text)
            await send(chunk([choice]))
        if request.disconnected.is_set():
            return
        if (
            last is not None
            and last.finished
            and last.finish_reason not in ("abort", "error")
            and include_usage
        ):
            await send(chunk([], self._usage(last)))
        await send(b"data: [DONE]\n\n")
        await request.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def chat_completions(self, request: HttpRequest) -> None:
        with spans.request_span(request.scope["headers"], "chat"):
            await self._handle(request, chat=True)

    async def completions(self, request: HttpRequest) -> None:
        with spans.request_span(request.scope["headers"], "completions"):
            await self._handle(request, chat=False)

    # ---- embeddings ----------------------------------------------------------------
    async def create_embeddings(self, request: HttpRequest) -> None:
        if self.state == "draining":
            raise ApiError(503, "server is draining", type="service_unavailable", code="draining")
        if self.state != "ready":
            raise ApiError(503, "model is loading", type="service_unavailable", code="loading")
        body = await request.json()
        try:
            check_embedding_request(body)
        except RequestFieldError as error:
            raise field_error(error) from None
        if not self.embeddings.is_available:
            raise ApiError(404, "no embedding model installed", code="model_not_found")
        self._check_model(body, (self.config.served_model_name, self.embeddings.model_name))
        inputs = body["input"]
        if isinstance(inputs, str):
            inputs = [inputs]
        encoding = body.get("encoding_format") or "float"
        self.active_requests += 1
        try:
            vectors, tokens = await self.embeddings.embed(inputs)
        finally:
            self.active_requests -= 1
        data = []
        for index, vector in enumerate(vectors):
            value: Any = vector.tolist()
            if encoding == "base64":
                import base64

                value = base64.b64encode(vector.astype("<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": index, "embedding": value})
        await request.respond_json(200, {
            "object": "list", "data": data, "model": self.embeddings.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })  # fmt: skip
