"""Retention: a tenant's prompt records and request samples are kept `retention_days`.

`retention_apply` deletes, per tenant, the rows that finished before now minus the
tenant's `retention_days`, in batches that each commit on their own, so a run never holds
a long transaction; it is safe to run again or alongside itself (a row is deleted once,
whoever deletes it). Usage rows (`tenants.UsageRecord`) are never deleted here: billing
reads them. The API accepts 1 to 3650 days (`tenants.serializers`); the column cannot be
null, and a 0 set outside the API counts as one day, so that a typo in the admin cannot
delete the request samples a running canary analysis is reading.

Request samples a running rollout still reads are kept past their tenant's retention:
those of its baseline and candidate versions since one analysis window before its stage
started (a full-weight stage compares the canary with the baseline's window before it).
Prompt records are never kept longer than the tenant's policy.
"""

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Q, QuerySet
from django.utils import timezone

from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.rollouts.stages import rollout_policy
from controlplane.telemetry.models import PromptRecord, RequestSample
from controlplane.tenants.models import Tenant

logger = logging.getLogger(__name__)

MINIMUM_RETENTION_DAYS = 1
BATCH_SIZE = 5000
# Under the Celery broker's visibility timeout (600 s), so a long run is not handed to a
# second worker; what is left waits for the next run.
TIME_BUDGET_S = 300.0


@dataclass(frozen=True, slots=True)
class RetentionResult:
    prompt_records: int  # deleted by this run
    request_samples: int
    is_complete: bool  # False when the time budget ran out with rows left to delete


def retention_days_of(tenant: Tenant) -> int:
    """The days the tenant's prompt records and request samples are kept."""
    return max(tenant.retention_days, MINIMUM_RETENTION_DAYS)


def _read_by_running_rollouts() -> Q | None:
    """Request samples a running rollout's analysis still reads, or None if none does."""
    kept: Q | None = None
    running = Rollout.objects.filter(state=RolloutState.RUNNING, stage_started_at__isnull=False)
    for rollout in running.only("baseline_id", "candidate_id", "stage_started_at", "policy"):
        if rollout.stage_started_at is None:  # filtered out above; this tells the type checker
            continue
        since = rollout.stage_started_at - timedelta(seconds=rollout_policy(rollout).window_s)
        rows = Q(version_id__in=[rollout.baseline_id, rollout.candidate_id], finished_at__gte=since)
        kept = rows if kept is None else kept | rows
    return kept


def _delete_batch(rows: QuerySet, batch_size: int) -> int:
    """Delete up to `batch_size` of the rows in one short transaction; how many went."""
    ids = list(rows.order_by().values_list("pk", flat=True)[:batch_size])
    if not ids:
        return 0
    deleted, _ = rows.model.objects.filter(pk__in=ids).delete()
    return deleted


def retention_apply(
    *,
    now: datetime | None = None,
    batch_size: int = BATCH_SIZE,
    time_budget_s: float = TIME_BUDGET_S,
) -> RetentionResult:
    """Delete every tenant's prompt records and request samples past its retention.

    Tenants take turns, one batch each, so one tenant's backlog does not keep the others
    waiting for the next run when the time budget runs out.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    now = now or timezone.now()
    deadline = time.monotonic() + time_budget_s
    kept_for_analysis = _read_by_running_rollouts()
    pending: list[tuple[Tenant, QuerySet]] = []
    for tenant in Tenant.objects.order_by("pk").only("slug", "retention_days"):
        cutoff = now - timedelta(days=retention_days_of(tenant))
        samples = RequestSample.objects.filter(tenant=tenant, finished_at__lt=cutoff)
        if kept_for_analysis is not None:
            samples = samples.exclude(kept_for_analysis)
        pending.append((tenant, PromptRecord.objects.filter(tenant=tenant, finished_at__lt=cutoff)))
        pending.append((tenant, samples))
    deleted: dict[tuple[str, type[PromptRecord] | type[RequestSample]], int] = {}
    while pending and time.monotonic() < deadline:
        left: list[tuple[Tenant, QuerySet]] = []
        for tenant, rows in pending:
            if time.monotonic() >= deadline:
                left.append((tenant, rows))
                continue
            count = _delete_batch(rows, batch_size)
            key = (tenant.slug, rows.model)
            deleted[key] = deleted.get(key, 0) + count
            if count == batch_size:  # maybe more
                left.append((tenant, rows))
        pending = left
    result = RetentionResult(
        prompt_records=sum(n for (_, model), n in deleted.items() if model is PromptRecord),
        request_samples=sum(n for (_, model), n in deleted.items() if model is RequestSample),
        is_complete=not pending,
    )
    for (slug, model), count in sorted(deleted.items(), key=lambda item: item[0][0]):
        if count:
            logger.info(
                "retention deleted rows",
                extra={"tenant": slug, "table": model._meta.db_table, "count": count},
            )
    logger.info(
        "retention run done",
        extra={
            "prompt_records": result.prompt_records,
            "request_samples": result.request_samples,
            "is_complete": result.is_complete,
        },
    )
    return result
