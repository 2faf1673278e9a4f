"""Energy attribution: each settled fleet rollup's joules split among tenants by tokens."""

from collections import defaultdict
from collections.abc import Hashable, Mapping
from datetime import UTC, datetime
from typing import TypeVar

from django.db import IntegrityError, transaction

from controlplane.core.errors import DomainError
from controlplane.fleet.models import AgentSample
from controlplane.telemetry.models import EnergyAllocation, RequestSample
from controlplane.telemetry.usage import UsageDelta, minute_of, usage_upsert

K = TypeVar("K", bound=Hashable)


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

    Tokens are those of requests the agent (endpoint) finished in [start, end), mirrored
    ones left out. The shares
    go to each tenant x version's UsageRecord of the interval's first minute. Done at most
    once per `source_key` (None when it was done before): safe to call again on replays.
    """
    if interval_end <= interval_start:
        raise DomainError("invalid_interval", "The interval must end after it starts.")
    if energy_joules < 0:
        raise DomainError("invalid_energy", "Energy cannot be negative.")
    tokens: dict[tuple[int, int], int] = defaultdict(int)
    # Mirrored requests are no tenant's usage: a shadow version's energy goes to no one.
    rows = RequestSample.objects.filter(
        agent=agent.rstrip("/"),
        finished_at__gte=interval_start,
        finished_at__lt=interval_end,
        is_shadow=False,
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
            minute = minute_of(interval_start.timestamp())
            usage_upsert(
                {
                    (tenant_id, version_id, minute): UsageDelta(energy_joules=joules)
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
