"""Mirroring requests to a shadow version (a rollout's shadow stage).

A routing table's shadow route (`contracts.routing`, role `shadow`) never answers: for a
request another version answers, the gateway draws, with probability share / 100, a copy
of the request body for the shadow version (`ShadowMirror.draw`, before the request is
admitted), and sends it once the client's request has been admitted (never for a refused
one). The copy runs in a task of its own: it reads the shadow engine's whole answer and
discards it, so it never delays, fails or changes the client's response. At most
`max_in_flight` copies run at once per gateway process; one beyond that is dropped.
`gateway_shadow_requests_total{outcome}` counts them: `sent` (the engine answered, with
whatever status), `failed` (no answer: no agent, refused, timed out, a broken stream),
`dropped` (over the bound); `gateway_shadow_requests_in_flight` is those under way.

Each copy becomes a requests-stream entry with `is_shadow` set, under the tenant and key
of the request it copies (a tenant-scoped stage's analysis reads by tenant), with its own
request id, latencies and status: the canary analysis reads it as the shadow version's
sample. It takes no admission, no settlement and no prompt text, and ingest counts it as
no usage.
"""

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from contracts.routing import RoutingTable, VersionRoute
from controlplane.gateway.metering import StreamMeter
from controlplane.gateway.outcome import Outcome, request_record
from controlplane.gateway.recorder import RedisBatcher
from controlplane.gateway.relay import AgentRequest, Relay, upstream_failure_note
from controlplane.gateway.selectors import KeyGrant
from controlplane.gateway.upstream import UpstreamError, UpstreamPool

logger = logging.getLogger(__name__)

SHADOW_REQUESTS = Counter(
    "gateway_shadow_requests_total",
    "Copies of requests mirrored to a shadow version: sent (answered), failed, dropped",
    ["outcome"],
)
for _outcome in ("sent", "failed", "dropped"):  # every series exists from the start
    SHADOW_REQUESTS.labels(_outcome)
SHADOW_IN_FLIGHT = Gauge(
    "gateway_shadow_requests_in_flight", "Copies of requests under way to a shadow version"
)


@dataclass(frozen=True, slots=True)
class Mirror:
    """One copy of a client's request for a shadow version."""

    version: VersionRoute
    table: RoutingTable
    grant: KeyGrant
    kind: str
    path: str
    body: bytes  # as sent to the answering version (a stream asks for usage)
    is_stream: bool
    text: str  # the prompt's text: the token estimate when the engine reports no usage
    token_budget: int


class ShadowMirror:
    def __init__(self, upstream: UpstreamPool, batcher: RedisBatcher, *, max_in_flight: int):
        # A relay of its own: its agents' in-flight counts are the mirrors' alone.
        self.relay = Relay(upstream)
        self.batcher = batcher
        self.max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task[None]] = set()

    @staticmethod
    def draw(table: RoutingTable, tenant_slug: str | None) -> list[VersionRoute]:
        """The shadow versions this request is to be copied to: each with its share."""
        return [
            version
            for version, share in table.shadow_shares_for(tenant_slug)
            if random.random() * 100 < share
        ]

    def start(self, mirror: Mirror) -> None:
        """Send the copy in the background, unless `max_in_flight` already run."""
        if len(self._tasks) >= self.max_in_flight:
            SHADOW_REQUESTS.labels("dropped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._send(mirror))
        self._tasks.add(task)
        SHADOW_IN_FLIGHT.inc()
        task.add_done_callback(self._done)

    def _done(self, task: "asyncio.Task[None]") -> None:
        self._tasks.discard(task)
        SHADOW_IN_FLIGHT.dec()

    async def aclose(self) -> None:
        """Cancel the copies under way (their entries are not written)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _send(self, mirror: Mirror) -> None:
        started_wall = time.time()
        started = time.perf_counter()
        outcome = Outcome()
        if mirror.is_stream:
            outcome.meter = StreamMeter(
                started=started, is_usage_stripped=False, is_capturing=False
            )
        request = AgentRequest(
            mirror.version, mirror.path, mirror.body, uuid.uuid4().hex, mirror.token_budget
        )
        try:
            is_answered = await self._exchange(outcome, request)
        except Exception as exc:  # a mirror never takes anything else down with it
            logger.warning("shadow request failed", extra={"error": str(exc)})
            SHADOW_REQUESTS.labels("failed").inc()
            return
        # Never the tenant's prompt or completion: the grant as one that keeps none.
        grant = dataclasses.replace(mirror.grant, is_prompt_logging=False)
        record = request_record(
            request_id=request.request_id,
            grant=grant,
            table=mirror.table,
            version=mirror.version,
            kind=mirror.kind,
            is_stream=mirror.is_stream,
            started_wall=started_wall,
            e2e_s=time.perf_counter() - started,
            outcome=outcome,
            text=mirror.text,
        )
        self.batcher.put(dataclasses.replace(record, is_shadow=True).to_fields())
        SHADOW_REQUESTS.labels("sent" if is_answered else "failed").inc()

    async def _exchange(self, outcome: Outcome, request: AgentRequest) -> bool:
        """Send the copy and read its whole answer into `outcome`; whether an engine
        answered (an answer that broke off midway is not one)."""
        try:
            connected = await self.relay.connect(outcome, request)
        except UpstreamError as exc:
            upstream_failure_note(outcome, exc)
            return False
        if connected is None:
            outcome.status = 503
            outcome.error_code = "no_ready_agent"
            return False
        response, endpoint = connected
        outcome.agent = endpoint
        try:
            outcome.status = response.status
            meter = outcome.meter
            content_type = response.headers.get("content-type", "")
            if meter is None or response.status != 200 or "event-stream" not in content_type:
                outcome.meter = None
                outcome.response_body = await response.read()
                return True
            buffer = b""
            while piece := await response.read_some():
                data = buffer + piece if buffer else piece
                _, buffer = meter.feed_bytes(data, time.perf_counter())
            return True
        except UpstreamError as exc:
            upstream_failure_note(outcome, exc)
            return False
        finally:
            self.relay.outstanding[endpoint] -= 1
            response.close()
