"""Rollout reads: lists for the API, and the request samples analysis compares."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.db.models import QuerySet

from controlplane.rollouts.analysis import Samples
from controlplane.rollouts.models import (
    AnalysisRun,
    Deployment,
    DeploymentRevision,
    Rollout,
    ScalingDecision,
    WebhookDelivery,
    WebhookEndpoint,
)
from controlplane.telemetry.models import EnergyAllocation, RequestSample


def deployment_list() -> QuerySet[Deployment]:
    return Deployment.objects.select_related("stable_version", "stable_version__model")


def deployment_revision_list(*, deployment: Deployment) -> QuerySet[DeploymentRevision]:
    """The deployment's stable versions, newest first."""
    return DeploymentRevision.objects.filter(deployment=deployment).select_related(
        "version", "previous_version", "rollout__created_by"
    )


def scaling_decision_list(*, deployment: Deployment) -> QuerySet[ScalingDecision]:
    """The deployment's changes of desired replicas, newest first."""
    return ScalingDecision.objects.filter(deployment=deployment).select_related(
        "deployment", "actor"
    )


def rollout_list() -> QuerySet[Rollout]:
    return Rollout.objects.select_related(
        "deployment", "baseline", "candidate", "created_by"
    ).prefetch_related("required_suites")


def analysis_run_list(*, rollout: Rollout) -> QuerySet[AnalysisRun]:
    return AnalysisRun.objects.filter(rollout=rollout)


def webhook_endpoint_list() -> QuerySet[WebhookEndpoint]:
    return WebhookEndpoint.objects.all()


def webhook_delivery_list() -> QuerySet[WebhookDelivery]:
    return WebhookDelivery.objects.select_related("endpoint")


def request_samples_window(
    *,
    version_id: int,
    start: datetime,
    end: datetime,
    tenant_slugs: Sequence[str] | None = None,
    is_shadow: bool = False,
) -> Samples:
    """One version's samples finished in (start, end], latencies in milliseconds: of the
    requests it answered, or (`is_shadow`) of those mirrored to it in a shadow stage.

    ITL is each request's mean inter-token latency; TTFT and ITL exist for streamed
    requests only, errors for every request. Joules per token and the load (tokens per
    agent-second) come from the gateway's energy attribution for intervals ending in the
    window.
    """
    rows = RequestSample.objects.filter(
        version_id=version_id, finished_at__gt=start, finished_at__lte=end, is_shadow=is_shadow
    )
    if tenant_slugs:
        rows = rows.filter(tenant__slug__in=list(tenant_slugs))
    ttft: list[float] = []
    itl: list[float] = []
    errors: list[bool] = []
    for is_error, ttft_s, itl_s in rows.values_list("is_error", "ttft_s", "itl_mean_s"):
        errors.append(bool(is_error))
        if ttft_s is not None and not is_error:
            ttft.append(ttft_s * 1000.0)
        if itl_s is not None and not is_error:
            itl.append(itl_s * 1000.0)
    per_token, load = energy_figures(version_id=version_id, start=start, end=end)
    return Samples(
        ttft_ms=ttft,
        itl_ms=itl,
        errors=errors,
        joules_per_token=per_token,
        tokens_per_agent_s=load,
    )


def energy_figures(
    *, version_id: int, start: datetime, end: datetime
) -> tuple[float | None, float | None]:
    """(joules per token, tokens per second per agent) of the version over the window, from
    the energy intervals ending in it; (None, None) where it served no tokens."""
    joules = 0.0
    tokens = 0
    agents: set[str] = set()
    allocations = EnergyAllocation.objects.filter(
        interval_end__gt=start, interval_end__lte=end
    ).values_list("agent", "shares")
    for agent, shares in allocations:
        for share in shares or []:
            if share.get("version_id") == version_id:
                joules += float(share.get("joules", 0.0))
                tokens += int(share.get("tokens", 0))
                agents.add(agent)
    if not tokens:
        return None, None
    return joules / tokens, tokens / len(agents) / (end - start).total_seconds()


def request_count(
    *, version_id: int, start: datetime, end: datetime, is_shadow: bool = False
) -> int:
    """The version's requests answered (or, `is_shadow`, mirrored to it) in (start, end]."""
    return RequestSample.objects.filter(
        version_id=version_id, finished_at__gt=start, finished_at__lte=end, is_shadow=is_shadow
    ).count()


def recent_error_flags(*, version_id: int, since: datetime, limit: int) -> list[bool]:
    """The error flags of the version's last `limit` requests since `since`, oldest first."""
    flags = list(
        RequestSample.objects.filter(version_id=version_id, finished_at__gt=since)
        .order_by("-finished_at", "-id")
        .values_list("is_error", flat=True)[:limit]
    )
    flags.reverse()
    return flags
