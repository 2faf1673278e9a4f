"""What happened to one request, and the requests-stream record made of it."""

import asyncio
import json
from dataclasses import dataclass

from contracts.routing import RequestRecord, RoutingTable, VersionRoute, error_code_of
from controlplane.gateway.http_io import CLIENT_CLOSED
from controlplane.gateway.metering import StreamMeter, estimate_tokens, response_usage_and_text
from controlplane.gateway.selectors import KeyGrant


@dataclass(slots=True)
class Outcome:
    """What happened to one request; filled in as it goes (so a cancel keeps it)."""

    status: int = 0
    agent: str = ""
    attempts: int = 0
    is_complete: bool = False
    is_client_gone: bool = False
    response_body: bytes = b""
    meter: StreamMeter | None = None
    error_code: str = ""  # the code of an error the gateway answered itself


async def watch_disconnect(receive, outcome: Outcome, task: asyncio.Task) -> None:
    """Cancel the request's task when the client goes away before its response is sent."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if not outcome.is_complete:
        outcome.is_client_gone = True
        task.cancel()


def request_record(
    *,
    request_id: str,
    grant: KeyGrant,
    table: RoutingTable,
    version: VersionRoute,
    kind: str,
    is_stream: bool,
    started_wall: float,
    e2e_s: float,
    outcome: Outcome,
    text: str,
) -> RequestRecord:
    meter = outcome.meter
    completion_text = ""
    usage = None
    if meter is not None:
        usage = meter.usage
        completion_text = "".join(meter.text)
    elif outcome.response_body:
        usage, completion_text = response_usage_and_text(
            outcome.response_body, is_capturing=grant.is_prompt_logging
        )
    prompt_tokens = usage.get("prompt_tokens") if usage else None
    completion_tokens = usage.get("completion_tokens", 0) if usage else None
    is_engine_usage = isinstance(prompt_tokens, int) and isinstance(completion_tokens, int)
    if not is_engine_usage:
        # Nothing from the engine: count streamed content events, estimate the prompt.
        # An unanswered request (no agent, or the client left before any token) is 0.
        answered = outcome.agent != "" and outcome.status < 500
        prompt_tokens = estimate_tokens(len(text)) if answered else 0
        completion_tokens = meter.token_events if meter is not None else 0
    status = outcome.status or 500
    error_code = outcome.error_code
    if meter is not None and meter.has_error and status < 400:
        status = 500  # an error event inside a 200 stream is still a failed request
        error_code = "stream_error"
    elif status == CLIENT_CLOSED:
        error_code = "client_closed"
    elif status >= 400 and not error_code:
        try:
            error_code = error_code_of(json.loads(outcome.response_body))
        except (ValueError, RecursionError):
            error_code = ""
        error_code = error_code or f"http_{status}"
    return RequestRecord(
        request_id=request_id,
        tenant_id=grant.tenant_id,
        api_key_id=grant.key_id,
        deployment=table.deployment,
        version_id=version.version_id,
        agent=outcome.agent,
        endpoint_kind=kind,
        status=status,
        is_stream=is_stream,
        started_at=started_wall,
        finished_at=started_wall + e2e_s,
        e2e_s=e2e_s,
        ttft_s=meter.ttft_s if meter is not None else None,
        itl_mean_s=meter.itl_mean_s if meter is not None else None,
        itl_p95_s=meter.itl_p95_s if meter is not None else None,
        prompt_tokens=int(prompt_tokens),  # type: ignore[arg-type]
        completion_tokens=int(completion_tokens),  # type: ignore[arg-type]
        usage_source="engine" if is_engine_usage else "gateway",
        attempts=max(1, outcome.attempts),
        prompt=text if grant.is_prompt_logging else None,
        completion=completion_text if grant.is_prompt_logging else None,
        error_code=error_code,
    )
