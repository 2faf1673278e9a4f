"""Retention: a tenant's prompt records and request samples are kept `retention_days`.

`retention_apply` deletes, per tenant, the rows that finished before now minus the
tenant's `retention_days`, in batches that each commit on their own, so a run never holds
a long transaction; it is safe to run again or alongside itself (a row is deleted once,
whoever deletes it). Usage rows (`tenants.UsageRecord`) are never deleted here: billing
reads them. The API accepts 1 to 3650 days (`tenants.serializers`); the column cannot be
null, and a 0 set outside the API counts as one day, so that a typo in the admin cannot
delete the request samples a running canary analysis is reading.

Request samples a higher floor still reads are kept past their tenant's retention: the
rollouts app says at start-up which ones its running analyses read
(`request_samples_in_use_add`; telemetry is a floor below rollouts and does not import
it). Prompt records are never kept longer than the tenant's policy.
"""

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from django.db.models import Q, QuerySet
from django.utils import timezone

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


@dataclass(frozen=True, slots=True)
class SamplesInUse:
    """Request samples of these versions that finished at or after `since`."""

    version_ids: tuple[int, ...]
    since: datetime


class SamplesInUseReader(Protocol):
    def __call__(self) -> Iterable[SamplesInUse]: ...


SAMPLES_IN_USE_READERS: list[SamplesInUseReader] = []


def request_samples_in_use_add(reader: SamplesInUseReader) -> None:
    """Keep, on every run, the request samples `reader()` names, whatever their age."""
    if reader not in SAMPLES_IN_USE_READERS:
        SAMPLES_IN_USE_READERS.append(reader)


def _samples_in_use() -> Q | None:
    """The request samples some reader still needs, or None if none does."""
    kept: Q | None = None
    for reader in SAMPLES_IN_USE_READERS:
        for in_use in reader():
            rows = Q(version_id__in=in_use.version_ids, finished_at__gte=in_use.since)
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
    in_use = _samples_in_use()
    pending: list[tuple[Tenant, QuerySet]] = []
    for tenant in Tenant.objects.order_by("pk").only("slug", "retention_days"):
        cutoff = now - timedelta(days=retention_days_of(tenant))
        samples = RequestSample.objects.filter(tenant=tenant, finished_at__lt=cutoff)
        if in_use is not None:
            samples = samples.exclude(in_use)
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
