"""Sending a request to an agent and its response back to the client.

The agent is the version's least busy ready one; a refusal (connection refused, 503, or
401: its engine refused the serving secret the routing table gave, a table older than
its engine) is retried once on another. Each request presents the endpoint's serving
secret (`Authorization: Bearer`); an engine's 401 never reaches the client. Responses
stream through as they arrive; a stream's tokens are metered on the way
(metering.StreamMeter). With tracing on, each attempt is a span whose `traceparent` the
engine gets (spans.py).
"""

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client import Counter

from contracts import tracing
from contracts.routing import VersionRoute
from controlplane.gateway import spans
from controlplane.gateway.caches import choose_endpoint
from controlplane.gateway.http_io import error_body, send_json
from controlplane.gateway.outcome import Outcome
from controlplane.gateway.ratelimit import Admission
from controlplane.gateway.upstream import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)

logger = logging.getLogger(__name__)

UPSTREAM_RETRIES = Counter("gateway_upstream_retries_total", "Requests retried on another agent")
UPSTREAM_UNAUTHORIZED = Counter(
    "gateway_upstream_unauthorized_total", "Engine answers refusing the serving secret presented"
)


def engine_headers(version: VersionRoute, endpoint: str, headers: list[tuple[str, str]]):
    """`headers` and the endpoint's serving secret, when the routing table has one."""
    secret = version.endpoint_secrets.get(endpoint)
    return headers if secret is None else [*headers, ("authorization", f"Bearer {secret}")]


@dataclass(frozen=True, slots=True)
class AgentRequest:
    """One request for an agent of `version`: the body as the client sent it (or with
    usage asked for), under the gateway's request id, held to the tokens reserved."""

    version: VersionRoute
    path: str
    body: bytes
    request_id: str
    token_budget: int


class Relay:
    def __init__(self, upstream: UpstreamPool) -> None:
        self.upstream = upstream
        self.outstanding: dict[str, int] = defaultdict(int)  # agent endpoint -> requests

    async def connect(
        self, outcome: Outcome, request: AgentRequest
    ) -> tuple[UpstreamResponse, str] | None:
        """The first agent response, retrying once on another agent when one refuses."""
        tried: list[str] = []
        version = request.version
        headers = [
            ("content-type", "application/json"),
            ("x-request-id", request.request_id),
            # The engine stops the request at the tokens reserved for it.
            ("x-token-budget", str(request.token_budget)),
        ]
        while outcome.attempts < 2:
            endpoint = choose_endpoint(version, self.outstanding, tried)
            if endpoint is None:
                return None
            if tried:
                UPSTREAM_RETRIES.inc()
            tried.append(endpoint)
            outcome.attempts += 1
            self.outstanding[endpoint] += 1
            sent = engine_headers(version, endpoint, headers)
            try:
                response = await (
                    # a span of its own, whose `traceparent` the engine gets
                    spans.upstream_post(
                        self.upstream, endpoint, request.path, request.body, sent, outcome.attempts
                    )
                    if tracing.is_enabled()
                    else self.upstream.post(endpoint, request.path, request.body, sent)
                )
            except UpstreamConnectError as exc:
                self.outstanding[endpoint] -= 1
                logger.warning("agent refused", extra={"agent": endpoint, "error": str(exc)})
                continue
            except BaseException:
                self.outstanding[endpoint] -= 1
                raise
            if response.status == 401:
                # Our credentials, not the client's: another agent, else no_ready_agent.
                UPSTREAM_UNAUTHORIZED.inc()
                logger.error("agent refused the serving secret", extra={"agent": endpoint})
                response.close()
                self.outstanding[endpoint] -= 1
                continue
            is_refusal = response.status == 503
            if (
                is_refusal
                and outcome.attempts < 2
                and choose_endpoint(version, self.outstanding, tried) is not None
            ):
                response.close()
                self.outstanding[endpoint] -= 1
                continue
            return response, endpoint
        return None

    async def relay(
        self,
        send,
        outcome: Outcome,
        request: AgentRequest,
        admit: "asyncio.Future[Admission | None]",
    ) -> None:
        request_id = request.request_id
        try:
            connected = await self.connect(outcome, request)
        except UpstreamError as exc:
            # Reached, but no answer (read timeout, malformed head): no retry, the
            # agent may be working on it.
            logger.warning("agent did not answer", extra={"error": str(exc)})
            await asyncio.shield(admit)  # a refusal (429) comes first
            await self.send_upstream_error(send, outcome, exc)
            return
        # Shielded: a client leaving now must not cancel an admission Redis may have
        # counted; the request's entry and settlement wait for it (see _proxy).
        if connected is None:
            await asyncio.shield(admit)  # a refusal (429) comes first
        else:
            try:
                await asyncio.shield(admit)  # a refusal (429) before any byte to the client
            except BaseException:
                # Refused (or the client left): the agent's request is cancelled.
                self.outstanding[connected[1]] -= 1
                connected[0].close()
                raise
        if connected is None:
            outcome.status = 503
            outcome.error_code = "no_ready_agent"
            outcome.is_complete = True
            await send_json(
                send,
                503,
                error_body(
                    503, "no_ready_agent", "No agent answered; retry shortly.", "server_error"
                ),
            )
            return
        response, endpoint = connected
        outcome.agent = endpoint
        try:
            outcome.status = response.status
            content_type = response.headers.get("content-type", "application/json")
            meter = outcome.meter
            if meter is None or response.status != 200 or "event-stream" not in content_type:
                outcome.meter = None
                try:
                    body = await response.read()
                except UpstreamError as exc:
                    await self.send_upstream_error(send, outcome, exc)
                    return
                outcome.response_body = body
                outcome.is_complete = True
                await send_json(
                    send, response.status, body, [(b"x-request-id", request_id.encode())]
                )
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", content_type.encode()),
                        (b"cache-control", b"no-cache"),
                        (b"x-request-id", request_id.encode()),
                    ],
                }
            )
            buffer = b""
            try:
                while piece := await response.read_some():
                    out, buffer = meter.feed_bytes(
                        buffer + piece if buffer else piece, time.perf_counter()
                    )
                    if meter.is_done:
                        # `data: [DONE]` ends the stream for the client: the body ends with
                        # it, in one write; what the agent still sends (the body's last
                        # chunk) is read after, so that its connection can be reused.
                        outcome.is_complete = True
                        await send({"type": "http.response.body", "body": out + buffer})
                        buffer = b""
                        while await response.read_some():
                            pass
                        return
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        if meter.first_token_at is not None and not response.is_yielding:
                            # Its first token is out: on an engine step that brings tokens
                            # for many streams, those still waiting for one go first.
                            response.is_yielding = True
            except UpstreamError as exc:
                if outcome.is_complete:
                    return  # the client has its whole stream
                # After the first byte there is no retry: end the stream, count it failed.
                logger.warning("agent stream broke", extra={"agent": endpoint, "error": str(exc)})
                outcome.status = 502
                outcome.error_code = "upstream_error"
            outcome.is_complete = True
            await send({"type": "http.response.body", "body": buffer, "more_body": False})
        finally:
            self.outstanding[endpoint] -= 1
            response.close()

    @staticmethod
    async def send_upstream_error(send, outcome: Outcome, exc: UpstreamError) -> None:
        upstream_failure_note(outcome, exc)
        outcome.is_complete = True
        body = error_body(
            outcome.status,
            outcome.error_code,
            "The agent did not answer in time."
            if isinstance(exc, UpstreamTimeout)
            else "The agent failed.",
            "server_error",
        )
        await send_json(send, outcome.status, body)


def upstream_failure_note(outcome: Outcome, exc: UpstreamError) -> None:
    """The status and code of a request its agent did not answer: 504 when it timed out."""
    is_timeout = isinstance(exc, UpstreamTimeout)
    outcome.status = 504 if is_timeout else 502
    outcome.error_code = "upstream_timeout" if is_timeout else "upstream_error"
