"""Request samples, prompt records and tenant usage, written from the requests stream.

Every write is idempotent: a request's sample is inserted once (by request id) and only
newly inserted requests are added to the per-minute UsageRecord rows, in one
transaction, so an entry delivered twice is counted once. A prompt record is kept only
for a tenant whose `prompt_logging` is `full` when the entry is applied; otherwise the
entry's prompt and completion text are discarded. A mirrored request (`is_shadow`: a copy
sent to a shadow version, answered to no one) gets its sample, for the canary analysis,
and nothing else: no usage and no prompt record.
"""

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import connection, transaction

from contracts.routing import RequestRecord
from controlplane.registry.models import ModelVersion
from controlplane.telemetry.models import PromptRecord, RequestSample
from controlplane.tenants.models import PromptLogging, Tenant, UsageRecord

logger = logging.getLogger(__name__)


def minute_of(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp - timestamp % 60, tz=UTC)


@transaction.atomic
def request_records_apply(*, records: Sequence[RequestRecord]) -> int:
    """Insert each request's sample once and add newly inserted ones to usage.

    Idempotent on request_id: the sample insert is ON CONFLICT DO NOTHING RETURNING, and
    only the ids it returns are added to `UsageRecord`, in the same transaction. Returns
    how many records were new. Records naming an unknown tenant or version are dropped.
    """
    unique: dict[str, RequestRecord] = {}
    for record in records:
        unique.setdefault(record.request_id, record)
    if not unique:
        return 0
    # tenant id -> its prompt_logging, read now: an entry's prompt text is
    # stored only if the tenant keeps prompts at ingest time, whatever the entry carries.
    prompt_logging_of = dict(
        Tenant.objects.filter(pk__in={r.tenant_id for r in unique.values()}).values_list(
            "pk", "prompt_logging"
        )
    )
    tenant_ids = set(prompt_logging_of)
    version_ids = set(
        ModelVersion.objects.filter(pk__in={r.version_id for r in unique.values()}).values_list(
            "pk", flat=True
        )
    )
    known = [
        r for r in unique.values() if r.tenant_id in tenant_ids and r.version_id in version_ids
    ]
    if len(known) < len(unique):
        logger.warning(
            "dropping request entries of unknown tenants or versions",
            extra={"count": len(unique) - len(known)},
        )
    if not known:
        return 0
    inserted = _samples_insert(known)
    new_records = [r for r in known if r.request_id in inserted]
    _usage_add([r for r in new_records if not r.is_shadow])
    prompts = [
        PromptRecord(
            request_id=r.request_id,
            tenant_id=r.tenant_id,
            version_id=r.version_id,
            prompt=r.prompt or "",
            completion=r.completion or "",
            finished_at=datetime.fromtimestamp(r.finished_at, tz=UTC),
        )
        for r in new_records
        if r.prompt is not None
        and not r.is_shadow
        and prompt_logging_of[r.tenant_id] == PromptLogging.FULL
    ]
    if prompts:
        PromptRecord.objects.bulk_create(prompts, ignore_conflicts=True)
    return len(new_records)


def _samples_insert(records: Sequence[RequestRecord]) -> set[str]:
    quote = connection.ops.quote_name
    adapt = connection.ops.adapt_datetimefield_value
    columns = [
        "request_id",
        "tenant_id",
        "version_id",
        "deployment",
        "agent",
        "endpoint_kind",
        "status",
        "is_error",
        "is_stream",
        "ttft_s",
        "itl_mean_s",
        "itl_p95_s",
        "e2e_s",
        "prompt_tokens",
        "completion_tokens",
        "finished_at",
        "error_code",
        "is_shadow",
    ]
    rows = []
    params: list[Any] = []
    for r in records:
        rows.append("(" + ", ".join(["%s"] * len(columns)) + ")")
        params.extend(
            [
                r.request_id,
                r.tenant_id,
                r.version_id,
                r.deployment,
                r.agent,
                r.endpoint_kind,
                r.status,
                r.is_server_fault,
                r.is_stream,
                r.ttft_s,
                r.itl_mean_s,
                r.itl_p95_s,
                r.e2e_s,
                r.prompt_tokens,
                r.completion_tokens,
                adapt(datetime.fromtimestamp(r.finished_at, tz=UTC)),
                r.error_code,
                r.is_shadow,
            ]
        )
    # Only quoted identifiers from the models are formatted in; values are parameters.
    sql = (
        f"INSERT INTO {quote(RequestSample._meta.db_table)} "  # noqa: S608
        f"({', '.join(quote(c) for c in columns)}) VALUES {', '.join(rows)} "
        f"ON CONFLICT ({quote('request_id')}) DO NOTHING RETURNING {quote('request_id')}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {row[0] for row in cursor.fetchall()}


@dataclass(slots=True)
class UsageDelta:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    energy_joules: float = 0.0


def _usage_add(records: Sequence[RequestRecord]) -> None:
    deltas: dict[tuple[int, int, datetime], UsageDelta] = defaultdict(UsageDelta)
    for r in records:
        delta = deltas[(r.tenant_id, r.version_id, minute_of(r.finished_at))]
        delta.requests += 1
        delta.prompt_tokens += r.prompt_tokens
        delta.completion_tokens += r.completion_tokens
        delta.errors += 1 if r.is_server_fault else 0
    usage_upsert(deltas)


def usage_upsert(deltas: Mapping[tuple[int, int, datetime], UsageDelta]) -> None:
    """Add to UsageRecord rows: INSERT ... ON CONFLICT DO UPDATE SET x = x + EXCLUDED.x."""
    if not deltas:
        return
    quote = connection.ops.quote_name
    adapt = connection.ops.adapt_datetimefield_value
    table = quote(UsageRecord._meta.db_table)
    counters = ["requests", "prompt_tokens", "completion_tokens", "errors", "energy_joules"]
    columns = ["tenant_id", "version_id", "minute", *counters]
    rows = []
    params: list[Any] = []
    # A stable order keeps concurrent ingesters from deadlocking on the same rows.
    for (tenant_id, version_id, minute), d in sorted(deltas.items()):
        rows.append("(" + ", ".join(["%s"] * len(columns)) + ")")
        params.extend(
            [
                tenant_id,
                version_id,
                adapt(minute),
                d.requests,
                d.prompt_tokens,
                d.completion_tokens,
                d.errors,
                d.energy_joules,
            ]
        )
    updates = ", ".join(f"{quote(c)} = {table}.{quote(c)} + EXCLUDED.{quote(c)}" for c in counters)
    sql = (
        f"INSERT INTO {table} ({', '.join(quote(c) for c in columns)}) VALUES {', '.join(rows)} "  # noqa: S608
        f"ON CONFLICT ({quote('tenant_id')}, {quote('version_id')}, {quote('minute')}) "
        f"DO UPDATE SET {updates}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
