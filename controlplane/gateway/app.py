"""The tenants' OpenAI-compatible entry point, as a raw ASGI application.

No Django middleware, URL resolver or database query runs per request: keys and routes
come from in-memory caches (caches.py), limits from one Redis script (ratelimit.py), and
the response streams through from the agent as it arrives (pooled keep-alive
connections, relay.py and upstream.py). After the response, its requests-stream entry and token
settlement are queued; the admission, the entry and the settlement go to Redis with other
requests' commands in one pipeline (recorder.py), and entries Redis does not take are
spooled. While a routing table has a shadow route, admitted requests are copied to it in
the background (shadow.py).

`gateway_mount(django_app)` serves /v1/ here and everything else through Django.
"""

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any

import redis
from django.conf import settings
from prometheus_client import Counter

from contracts import tracing
from contracts.openai_request import CHECKS, RequestFieldError
from contracts.routing import (
    Affinity,
    RequestRecord,
    RoutingTable,
)
from controlplane.core.redis_clients import async_pubsub_client, async_redis_client, redis_client
from controlplane.gateway import spans
from controlplane.gateway.auth_throttle import AuthFailures
from controlplane.gateway.caches import KeyCache, RoutingCache, choose_version
from controlplane.gateway.http_io import (
    CLIENT_CLOSED,
    ClientGone,
    GatewayRequestError,
    error_body,
    read_body,
    send_json,
)
from controlplane.gateway.loops import KEY_TOUCH_INTERVAL_S, GatewayLoops
from controlplane.gateway.metering import StreamMeter, prompt_text
from controlplane.gateway.outcome import Outcome, request_record, watch_disconnect
from controlplane.gateway.ratelimit import Admission, Headroom, token_reservation
from controlplane.gateway.recorder import (
    KeyUses,
    RedisBatcher,
)
from controlplane.gateway.relay import AgentRequest, Relay
from controlplane.gateway.request_metrics import (
    RequestLabels,
    rate_limit_count,
    refusal_observe,
    request_observe,
)
from controlplane.gateway.selectors import KeyGrant
from controlplane.gateway.shadow import Mirror, ShadowMirror
from controlplane.gateway.spool import Spool
from controlplane.gateway.upstream import UpstreamPool

logger = logging.getLogger(__name__)

REQUESTS_TOTAL = Counter("gateway_requests_total", "Gateway requests by status", ["status"])
RATE_LIMIT_UNAVAILABLE = Counter(
    "gateway_rate_limit_unavailable_total", "Requests admitted without a limit check (Redis down)"
)
AUTH_THROTTLED = Counter(
    "gateway_auth_throttled_total", "Unknown keys refused unlooked-up: too many failures"
)

# path -> (endpoint kind, the key scope it needs)
ROUTES = {
    "/v1/chat/completions": ("chat", "chat"),
    "/v1/completions": ("completions", "chat"),
    "/v1/embeddings": ("embeddings", "embeddings"),
}


async def _bounded(step: Awaitable[Any], what: str, timeout_s: float) -> None:
    """Await `step` for at most `timeout_s`; log and go on if it fails or takes longer
    (asyncio.wait, not wait_for: it does not wait for the step to honour its cancel)."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        logger.error("gateway stop: %s did not finish within %s s; going on", what, timeout_s)
    elif not task.cancelled() and task.exception() is not None:
        logger.warning("gateway stop: %s failed", what, extra={"error": str(task.exception())})


class Gateway:
    def __init__(self) -> None:
        self.is_started = False
        self._start_lock: asyncio.Lock | None = None
        self._tasks: list[asyncio.Task] = []

    # Lifecycle.

    async def start(self) -> None:
        if self.is_started:
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.is_started:
                return
            self.redis = async_redis_client()
            self.pubsub_redis = async_pubsub_client(settings.GATEWAY_REDIS_URL)
            self.sync_redis = redis_client(url=settings.GATEWAY_REDIS_URL)
            self.relay = Relay(
                UpstreamPool(
                    connect_timeout_s=settings.GATEWAY_UPSTREAM_CONNECT_TIMEOUT_S,
                    read_timeout_s=settings.GATEWAY_UPSTREAM_READ_TIMEOUT_S,
                )
            )
            self.keys = KeyCache(ttl_s=settings.GATEWAY_KEY_CACHE_TTL_S)
            self.auth_failures = AuthFailures(
                limit=settings.GATEWAY_AUTH_FAILURES_PER_MINUTE, window_s=60.0
            )
            key_uses = KeyUses(interval_s=KEY_TOUCH_INTERVAL_S)
            self.routing = RoutingCache()
            self.headroom = Headroom()
            self.spool = Spool(
                settings.GATEWAY_SPOOL_DIR, max_bytes=settings.GATEWAY_SPOOL_MAX_BYTES
            )
            self.batcher = RedisBatcher(self.redis, self.spool)
            self.shadow = ShadowMirror(
                self.relay.upstream,
                self.batcher,
                max_in_flight=settings.GATEWAY_SHADOW_MAX_IN_FLIGHT,
            )
            self.loops = GatewayLoops(
                redis_client=self.redis,
                pubsub_redis=self.pubsub_redis,
                sync_redis=self.sync_redis,
                routing=self.routing,
                keys=self.keys,
                spool=self.spool,
                key_uses=key_uses,
            )
            try:
                await self.routing.refresh_all(self.redis)
            except (redis.RedisError, OSError) as exc:
                logger.warning("routing tables unavailable at start", extra={"error": str(exc)})
            self._batcher_task = asyncio.create_task(self.batcher.run())
            self._tasks = self.loops.start()
            self.is_started = True

    async def stop(self) -> None:
        """Stop the background loops, write or spool what is queued, close the clients.

        Every step is bounded and none waits for a cancellation to be honoured: a client
        library that swallows a cancel, or waits on a socket while closing it (redis-py's
        pub/sub has done both), costs a step its bound, never the process its exit.
        """
        if not self.is_started:
            return
        started = time.monotonic()
        logger.info("gateway stopping")
        self.loops.stopping.set()  # the loops end at their next turn, cancelled or not
        for task in self._tasks:
            task.cancel()
        await _bounded(asyncio.gather(*self._tasks, return_exceptions=True), "loops", 5)
        await _bounded(self.shadow.aclose(), "shadow requests", 2)  # copies: not waited for
        # The batcher finishes what is queued (or spools it) before the spool's last replay.
        self.batcher.close()
        await _bounded(self._batcher_task, "batcher", 15)
        await _bounded(self.loops.touch_keys(), "key last-used times", 5)
        await _bounded(asyncio.to_thread(self.spool.replay, self.loops.write_entries), "replay", 10)
        await self.relay.upstream.aclose()
        await _bounded(self.redis.aclose(), "redis client", 2)
        await _bounded(self.pubsub_redis.aclose(), "pub/sub client", 2)
        self.sync_redis.close()
        self.is_started = False
        logger.info("gateway stopped", extra={"seconds": round(time.monotonic() - started, 3)})

    # ASGI.

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if not self.is_started:
            await self.start()
        labels = RequestLabels(time.perf_counter())
        if tracing.is_enabled():
            with spans.request_span(scope):
                await self._respond(scope, receive, send, labels)
        else:
            await self._respond(scope, receive, send, labels)

    async def _respond(self, scope, receive, send, labels: RequestLabels) -> None:
        try:
            await self._handle(scope, receive, send, labels)
        except ClientGone:
            REQUESTS_TOTAL.labels(str(CLIENT_CLOSED)).inc()
            refusal_observe(
                labels,
                status=CLIENT_CLOSED,
                code="client_closed",
                seconds=time.perf_counter() - labels.started,
            )
        except GatewayRequestError as exc:
            REQUESTS_TOTAL.labels(str(exc.status)).inc()
            refusal_observe(
                labels,
                status=exc.status,
                code=exc.code,
                seconds=time.perf_counter() - labels.started,
            )
            if tracing.is_enabled():
                spans.refused(exc.status, exc.code)
            await send_json(
                send,
                exc.status,
                error_body(exc.status, exc.code, exc.message, exc.error_type, exc.param),
                exc.headers,
            )

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _handle(self, scope, receive, send, labels: RequestLabels) -> None:
        path = scope["path"]
        method = scope["method"]
        authorization = b""
        session_id = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-session-id":
                session_id = value.decode("latin-1")
        if path == "/v1/models" or path in ROUTES:
            client = scope.get("client")
            authenticate = self._authenticate_traced if tracing.is_enabled() else self._authenticate
            grant = await authenticate(authorization, client[0] if client else "")
        else:
            raise GatewayRequestError(404, "not_found", f"No route for {path}.")
        if path == "/v1/models":
            if method != "GET":
                raise GatewayRequestError(405, "method_not_allowed", "Use GET.")
            await self._models(grant, send)
            return
        if method != "POST":
            raise GatewayRequestError(405, "method_not_allowed", "Use POST.")
        kind, scope_needed = ROUTES[path]
        raw = await read_body(receive, settings.GATEWAY_MAX_BODY_BYTES)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past the limit
            raise GatewayRequestError(400, "invalid_json", "The body is not JSON.") from exc
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise GatewayRequestError(400, "invalid_request", "`model` (a string) is required.")
        model = body["model"]
        if scope_needed not in grant.scopes:
            raise GatewayRequestError(
                403, "insufficient_scope", f"This key may not call {path}.", "permission_error"
            )
        deployment = self.routing.by_model.get(model)
        if model not in grant.allowed_models or deployment is None:
            # One answer whether the model is unknown, not the tenant's, or not deployed:
            # a key learns nothing about other tenants' models.
            raise GatewayRequestError(
                404, "model_not_found", f"The model {model[:100]!r} does not exist.", param="model"
            )
        labels.model = model  # a model the routing tables name: a bounded label
        try:
            CHECKS[kind](body)  # the engine's own checks: a bad body never reaches an agent
        except RequestFieldError as exc:
            raise GatewayRequestError(400, exc.code, exc.message, param=exc.param) from exc
        table = self.routing.tables[deployment]
        await self._proxy(
            scope, receive, send, grant, table, kind, path, body, raw, session_id, labels
        )

    async def _authenticate_traced(self, authorization: bytes, address: str) -> KeyGrant:
        with spans.auth_span() as span:
            try:
                grant = await self._authenticate(authorization, address)
            except GatewayRequestError as exc:
                span.set_attribute("error.type", exc.code)
                raise
            span.set_attribute("fleet.tenant.id", grant.tenant_id)
            return grant

    async def _authenticate(self, authorization: bytes, address: str) -> KeyGrant:
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise GatewayRequestError(
                401,
                "invalid_api_key",
                "Missing API key: send Authorization: Bearer <key>.",
                "invalid_request_error",
            )
        now = time.monotonic()
        throttled_for = self.auth_failures.retry_after_s(address, now)
        grant = await self.keys.get(token, may_look_up=throttled_for is None)
        if grant is None and throttled_for is not None:
            AUTH_THROTTLED.inc()
            seconds = max(1, math.ceil(throttled_for))
            raise GatewayRequestError(
                429,
                "too_many_failed_authentications",
                f"Too many failed authentications from your address; retry after {seconds} s.",
                "invalid_request_error",
                headers=[(b"retry-after", str(seconds).encode())],
            )
        if grant is None:
            self.auth_failures.record(address, now)
            raise GatewayRequestError(
                401, "invalid_api_key", "Incorrect API key provided.", "invalid_request_error"
            )
        self.loops.key_uses.note(grant.key_id, time.monotonic())
        return grant

    async def _models(self, grant: KeyGrant, send) -> None:
        # Listed once servable: a version of its deployment has ready engines and weight for
        # this tenant (a table published before any engine is ready lists nothing yet).
        names = sorted(
            name
            for name in grant.allowed_models
            if name in self.routing.by_model
            and self.routing.is_servable(self.routing.by_model[name], grant.tenant_slug)
        )
        body = json.dumps(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "fleet"}
                    for name in names
                ],
            }
        ).encode()
        REQUESTS_TOTAL.labels("200").inc()
        await send_json(send, 200, body)

    # Proxying.

    async def _admit_traced(
        self, grant: KeyGrant, reservation: int, *, is_urgent: bool
    ) -> Admission | None:
        with spans.rate_limit_span(is_early=not is_urgent) as span:
            try:
                admission = await self._admit(grant, reservation, is_urgent=is_urgent)
            except GatewayRequestError as exc:
                span.set_attribute("fleet.admission.is_allowed", False)
                span.set_attribute("error.type", exc.code)
                raise
            spans.rate_limit_result(span, admission)
            return admission

    async def _admit(
        self, grant: KeyGrant, reservation: int, *, is_urgent: bool
    ) -> Admission | None:
        """The request's admission; GatewayRequestError(429) when a limit refuses it."""
        try:
            admission = await self.batcher.admit(
                tenant_id=grant.tenant_id,
                requests_per_minute=grant.requests_per_minute,
                tokens_per_minute=grant.tokens_per_minute,
                reservation=reservation,
                is_urgent=is_urgent,
            )
        except (redis.RedisError, OSError) as exc:
            # Serving without limits beats refusing everyone while Redis is away.
            RATE_LIMIT_UNAVAILABLE.inc()
            logger.warning("rate limit unavailable; admitting", extra={"error": str(exc)})
            return None
        self.headroom.record(
            grant.tenant_id,
            admission,
            requests_per_minute=grant.requests_per_minute,
            tokens_per_minute=grant.tokens_per_minute,
            now=time.monotonic(),
        )
        if not admission.is_allowed:
            rate_limit_count(admission.limit)
            raise GatewayRequestError(
                429,
                "rate_limit_exceeded",
                f"Rate limit reached: {admission.limit} per minute. "
                f"Retry after {admission.retry_after_s} s.",
                admission.limit,
                headers=[(b"retry-after", str(admission.retry_after_s).encode())],
            )
        return admission

    async def _proxy(
        self,
        scope,
        receive,
        send,
        grant: KeyGrant,
        table: RoutingTable,
        kind: str,
        path: str,
        body: dict[str, Any],
        raw: bytes,
        session_id: str | None,
        labels: RequestLabels,
    ) -> None:
        started_wall = time.time()
        started = time.perf_counter()
        is_stream = bool(body.get("stream")) and kind != "embeddings"
        text = prompt_text(body)
        affinity_value = None
        if table.affinity is Affinity.TENANT:
            affinity_value = str(grant.tenant_id)
        elif table.affinity is Affinity.SESSION:
            affinity_value = session_id
        is_tracing = tracing.is_enabled()
        route_started_ns = time.time_ns() if is_tracing else 0
        version = choose_version(table, affinity_value, grant.tenant_slug)
        shadows = self.shadow.draw(table, grant.tenant_slug) if version is not None else []
        if is_tracing:
            spans.route_chosen(route_started_ns, table, version, grant.tenant_slug)
        if version is None:
            raise GatewayRequestError(
                503,
                "no_ready_agent",
                f"No agent is ready to serve {table.model!r}; retry shortly.",
                "server_error",
            )
        labels.version = str(version.version_id)
        reservation = token_reservation(
            body,
            kind,
            max_model_len=version.max_model_len,
            default_completion_tokens=settings.GATEWAY_DEFAULT_COMPLETION_TOKENS,
        )
        if reservation > grant.tokens_per_minute:
            # No window would ever admit it: say so, rather than "retry after".
            rate_limit_count("tokens")
            raise GatewayRequestError(
                429,
                "request_exceeds_token_limit",
                f"This request may use up to {reservation} tokens (its prompt and max_tokens, "
                f"or the model's context when max_tokens is absent), more than your limit of "
                f"{grant.tokens_per_minute} tokens per minute. Set a lower max_tokens.",
                "tokens",
            )
        # A stream's admission (a round trip to Redis) runs alongside the request to the
        # agent, whose answer starts with the response head before any token; the
        # admission is awaited before anything goes to the client. Only tenants that were
        # far below their limits moments ago get this: for the others, and for whole
        # responses, the admission comes first, so refused requests never reach an agent.
        # An early admission rides with other requests' Redis commands (recorder.py).
        is_early = is_stream and self.headroom.is_plenty(grant.tenant_id, time.monotonic())
        admit_for = self._admit_traced if is_tracing else self._admit
        admit = asyncio.ensure_future(admit_for(grant, reservation, is_urgent=not is_early))
        if not is_early:
            await admit

        is_usage_stripped = False
        if is_stream:
            options = body.get("stream_options")
            options = options if isinstance(options, dict) else {}
            if not options.get("include_usage"):
                is_usage_stripped = True
                body = {**body, "stream_options": {**options, "include_usage": True}}
                raw = json.dumps(body, separators=(",", ":")).encode()
        if shadows:
            mirrors = [
                Mirror(
                    version=shadow,
                    table=table,
                    grant=grant,
                    kind=kind,
                    path=path,
                    body=raw,
                    is_stream=is_stream,
                    text=text,
                    token_budget=reservation,
                )
                for shadow in shadows
            ]
            admit.add_done_callback(lambda future: self._mirror(future, mirrors))
        request_id = uuid.uuid4().hex
        outcome = Outcome()
        if is_stream:
            outcome.meter = StreamMeter(
                started=started,
                is_usage_stripped=is_usage_stripped,
                is_capturing=grant.is_prompt_logging,
            )
        # The relay runs in this task; a watcher cancels it if the client goes away (the
        # upstream connection is then closed, and the engine aborts the sequence).
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(watch_disconnect(receive, outcome, task))
        try:
            request = AgentRequest(version, path, raw, request_id, token_budget=reservation)
            await self.relay.relay(send, outcome, request, admit)
        except asyncio.CancelledError:
            if not outcome.is_client_gone:
                raise
            task.uncancel()
            outcome.status = CLIENT_CLOSED
        except BaseException:
            if outcome.status == 0:
                outcome.status = CLIENT_CLOSED
            raise
        finally:
            watcher.cancel()
            finished = time.perf_counter()
            record = request_record(
                request_id=request_id,
                grant=grant,
                table=table,
                version=version,
                kind=kind,
                is_stream=is_stream,
                started_wall=started_wall,
                e2e_s=finished - started,
                outcome=outcome,
                text=text,
            )
            gaps = outcome.meter.gaps if outcome.meter is not None else ()
            is_tokens = kind != "embeddings"
            if is_tracing:
                spans.request_finished(record, outcome.meter, started_wall, started)
            if admit.done():
                self._finish(admit, record, reservation, labels, gaps, is_tokens)
            else:  # the client left before the admission came back
                admit.add_done_callback(
                    lambda future: self._finish(
                        future, record, reservation, labels, gaps, is_tokens
                    )
                )

    def _mirror(self, admit: "asyncio.Future[Admission | None]", mirrors: list[Mirror]) -> None:
        """Copy an admitted request to its shadow versions (a refused one to none)."""
        if admit.cancelled() or admit.exception() is not None:
            return
        for mirror in mirrors:
            self.shadow.start(mirror)

    def _finish(
        self,
        admit: "asyncio.Future[Admission | None]",
        record: RequestRecord,
        reservation: int,
        labels: RequestLabels,
        gaps: Sequence[float],
        is_tokens: bool,
    ) -> None:
        """Count the request and queue its stream entry and settlement, unless it was
        refused (a refusal is counted where it is answered, in __call__)."""
        if admit.cancelled() or admit.exception() is not None:
            return  # refused (429): no usage, no entry, nothing to settle
        REQUESTS_TOTAL.labels(str(record.status)).inc()
        request_observe(labels, record, gaps=gaps, is_tokens=is_tokens)
        admission = admit.result()
        delta = record.prompt_tokens + record.completion_tokens - reservation
        settlement = (
            (record.tenant_id, admission.window, delta) if admission is not None and delta else None
        )
        self.batcher.put(record.to_fields(), settlement)


def gateway_mount(django_application, gateway: Gateway | None = None):
    """One ASGI app: /v1/ to the gateway (and the lifespan, to start it), the rest to Django."""
    gateway = gateway or Gateway()

    async def application(scope, receive, send) -> None:
        is_gateway_path = scope["type"] == "http" and scope["path"].startswith("/v1/")
        if scope["type"] == "lifespan" or is_gateway_path:
            await gateway(scope, receive, send)
        else:
            await django_application(scope, receive, send)

    application.gateway = gateway  # type: ignore[attr-defined]
    return application
