"""Writes for the gateway: cache invalidation, request ingest, energy."""

import logging
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import redis
from django.db import IntegrityError, connection, transaction

from contracts.routing import (
    RequestRecord,
)
from controlplane.core.errors import DomainError
from controlplane.core.redis_clients import redis_client
from controlplane.gateway.models import EnergyAllocation, PromptRecord, RequestSample
from controlplane.registry.models import ModelVersion
from controlplane.tenants.models import Tenant, UsageRecord

logger = logging.getLogger(__name__)

INVALIDATE_CHANNEL = "gateway:invalidate"

K = TypeVar("K", bound=Hashable)


def gateway_cache_invalidate(
    *, tenant_id: int | None = None, client: redis.Redis | None = None
) -> None:
    """Tell every gateway to forget cached key grants (of one tenant, or all).

    Call after commit when a key is revoked or a tenant's limits, models or policy change.
    """
    client = client or redis_client()
    client.publish(INVALIDATE_CHANNEL, "all" if tenant_id is None else f"tenant:{tenant_id}")


# Ingest of the requests stream.


def _minute(timestamp: float) -> datetime:
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
    tenant_ids = set(
        Tenant.objects.filter(pk__in={r.tenant_id for r in unique.values()}).values_list(
            "pk", flat=True
        )
    )
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
    _usage_add(new_records)
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
class _UsageDelta:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    energy_joules: float = 0.0


def _usage_add(records: Sequence[RequestRecord]) -> None:
    deltas: dict[tuple[int, int, datetime], _UsageDelta] = defaultdict(_UsageDelta)
    for r in records:
        delta = deltas[(r.tenant_id, r.version_id, _minute(r.finished_at))]
        delta.requests += 1
        delta.prompt_tokens += r.prompt_tokens
        delta.completion_tokens += r.completion_tokens
        delta.errors += 1 if r.is_server_fault else 0
    _usage_upsert(deltas)


def _usage_upsert(deltas: Mapping[tuple[int, int, datetime], _UsageDelta]) -> None:
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


# Energy attribution.

MICROJOULES = 1_000_000


def energy_split(total_joules: float, weights: Mapping[K, int]) -> dict[K, float]:
    """Split energy in proportion to integer weights (tokens), by largest remainder.

    Computed in whole microjoules, so the shares add up exactly to the total rounded to
    a microjoule. Keys with zero weight get nothing; no positive weight, no split.
    """
    total = round(total_joules * MICROJOULES)
    positive = {key: weight for key, weight in weights.items() if weight > 0}
    weight_sum = sum(positive.values())
    if weight_sum == 0 or total <= 0:
        return {}
    floors = {key: total * weight // weight_sum for key, weight in positive.items()}
    remainders = {key: total * weight % weight_sum for key, weight in positive.items()}
    leftover = total - sum(floors.values())
    order = sorted(positive, key=lambda key: remainders[key], reverse=True)
    for key in order[:leftover]:
        floors[key] += 1
    return {key: microjoules / MICROJOULES for key, microjoules in floors.items()}


def energy_interval_attribute(
    *,
    source_key: str,
    agent: str,
    interval_start: datetime,
    interval_end: datetime,
    energy_joules: float,
) -> EnergyAllocation | None:
    """Attribute one agent's measured energy over an interval to tenants by tokens.

    Tokens are those of requests the agent (endpoint) finished in [start, end). The shares
    go to each tenant x version's UsageRecord of the interval's first minute. Done at most
    once per `source_key` (None when it was done before): safe to call again on replays.
    """
    if interval_end <= interval_start:
        raise DomainError("invalid_interval", "The interval must end after it starts.")
    if energy_joules < 0:
        raise DomainError("invalid_energy", "Energy cannot be negative.")
    tokens: dict[tuple[int, int], int] = defaultdict(int)
    rows = RequestSample.objects.filter(
        agent=agent.rstrip("/"), finished_at__gte=interval_start, finished_at__lt=interval_end
    ).values_list("tenant_id", "version_id", "prompt_tokens", "completion_tokens")
    for tenant_id, version_id, prompt_tokens, completion_tokens in rows:
        tokens[(tenant_id, version_id)] += prompt_tokens + completion_tokens
    shares = energy_split(energy_joules, tokens)
    try:
        with transaction.atomic():
            allocation = EnergyAllocation.objects.create(
                source_key=source_key,
                agent=agent,
                interval_start=interval_start,
                interval_end=interval_end,
                energy_joules=energy_joules,
                attributed_joules=sum(round(j * MICROJOULES) for j in shares.values())
                / MICROJOULES,
                tokens=sum(tokens.values()),
                shares=[
                    {
                        "tenant_id": tenant_id,
                        "version_id": version_id,
                        "tokens": tokens[(tenant_id, version_id)],
                        "joules": joules,
                    }
                    for (tenant_id, version_id), joules in sorted(shares.items())
                ],
            )
            minute = _minute(interval_start.timestamp())
            _usage_upsert(
                {
                    (tenant_id, version_id, minute): _UsageDelta(energy_joules=joules)
                    for (tenant_id, version_id), joules in shares.items()
                }
            )
    except IntegrityError:
        if EnergyAllocation.objects.filter(source_key=source_key).exists():
            return None
        raise
    return allocation


ENERGY_SETTLE_S = 30.0  # a fleet bucket still changes until its last heartbeats are in
ENERGY_LOOKBACK_S = 3600.0
ENERGY_MAX_GAP_S = 60.0


def energy_attribute_fleet_samples(*, now: datetime | None = None, limit: int = 1000) -> int:
    """Attribute every settled fleet rollup (AgentSample) not yet attributed; returns how many.

    A bucket's energy is the rise of the agent's cumulative energy counter since the end of
    its previous bucket (so nothing falls between buckets), over the interval between the two
    buckets' last heartbeats; without a usable previous bucket (first one, agent restarted,
    long gap), the rise within the bucket. Idempotent: each bucket has one source key.
    """
    from controlplane.fleet.models import AgentSample  # the fleet app's rollups

    now = now or datetime.now(tz=UTC)
    cutoff = datetime.fromtimestamp(now.timestamp() - ENERGY_SETTLE_S - 10, tz=UTC)
    since = datetime.fromtimestamp(now.timestamp() - ENERGY_LOOKBACK_S, tz=UTC)
    samples = list(
        AgentSample.objects.filter(bucket_start__gte=since, bucket_start__lt=cutoff)
        .select_related("agent")
        .order_by("agent_id", "bucket_start")
    )
    keys = {
        sample.pk: f"fleet:{sample.agent_id}:{sample.bucket_start.isoformat()}"
        for sample in samples
    }
    done = set(
        EnergyAllocation.objects.filter(source_key__in=list(keys.values())).values_list(
            "source_key", flat=True
        )
    )
    attributed = 0
    previous = None
    for sample in samples:
        prior, previous = previous, sample
        if keys[sample.pk] in done or not sample.agent.endpoint:
            continue
        if attributed >= limit:
            break
        if prior is None or prior.agent_id != sample.agent_id:
            prior = (
                AgentSample.objects.filter(
                    agent_id=sample.agent_id, bucket_start__lt=sample.bucket_start
                )
                .order_by("-bucket_start")
                .first()
            )
        is_continuous = (
            prior is not None
            and sample.energy_joules_min >= prior.energy_joules_max
            and (sample.first_sent_at - prior.last_sent_at).total_seconds() <= ENERGY_MAX_GAP_S
        )
        if is_continuous and prior is not None:
            start, energy = prior.last_sent_at, sample.energy_joules_max - prior.energy_joules_max
        else:
            start, energy = (
                sample.first_sent_at,
                sample.energy_joules_max - sample.energy_joules_min,
            )
        if sample.last_sent_at <= start:
            continue
        allocation = energy_interval_attribute(
            source_key=keys[sample.pk],
            agent=sample.agent.endpoint,
            interval_start=start,
            interval_end=sample.last_sent_at,
            energy_joules=max(0.0, energy),
        )
        attributed += 1 if allocation is not None else 0
    return attributed
