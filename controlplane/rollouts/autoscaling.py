"""Replica autoscaling decisions as pure functions: no database, no clock.

`autoscaling_policy_validate` turns a deployment's JSON policy into an `AutoscalingPolicy`
(or a DomainError "invalid_autoscaling" naming the field); `replica_signals` reads one
ready replica's heartbeat figures; `scaling_decide` turns a role's replica count, its
bounds and its replicas' signals into the desired count with a one-sentence reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from controlplane.core.errors import DomainError
from controlplane.rollouts.analysis import is_number

ERROR_CODE = "invalid_autoscaling"
# The longest cooldown or idle period a policy may ask for (a day, in seconds).
MAX_PERIOD_S = 86400.0
# A step up adds at most this many replicas, or doubles the count when that is more.
STEP_UP_MAX = 4

Direction = Literal["up", "down", "hold"]
Role = Literal["stable", "canary"]


class _InvalidField(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class AutoscalingPolicy:
    """How one deployment scales its replicas. Every field has a default; a deployment
    overrides any. Checked on construction, so a policy that exists is a valid one."""

    enabled: bool = False
    # Waiting requests per ready replica: above high scales up, below low counts as low.
    queue_per_replica_high: float = 4.0
    queue_per_replica_low: float = 0.5
    # Mean KV cache use (0-1) over the ready replicas.
    kv_cache_high: float = 0.85
    kv_cache_low: float = 0.5
    # The worst replica's TTFT p95 above it scales up; below half of it counts as low.
    ttft_slo_s: float | None = None
    # Seconds since the last change of the replica count before the next step.
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise _InvalidField("enabled", "enabled must be true or false.")
        pairs = (
            ("queue_per_replica_low", "queue_per_replica_high", None),
            ("kv_cache_low", "kv_cache_high", 1.0),
        )
        for low_name, high_name, ceiling in pairs:
            for name in (low_name, high_name):
                value = getattr(self, name)
                if not is_number(value) or value <= 0:
                    raise _InvalidField(name, f"{name} must be a number > 0.")
                if ceiling is not None and value > ceiling:
                    raise _InvalidField(name, f"{name} must be at most {ceiling:g}.")
            low, high = getattr(self, low_name), getattr(self, high_name)
            if low >= high:
                raise _InvalidField(
                    low_name, f"{low_name} ({low:g}) must be below {high_name} ({high:g})."
                )
        if self.ttft_slo_s is not None and (not is_number(self.ttft_slo_s) or self.ttft_slo_s <= 0):
            raise _InvalidField("ttft_slo_s", "ttft_slo_s must be null or a number > 0.")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s"):
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value <= MAX_PERIOD_S:
                raise _InvalidField(name, f"{name} must be a number from 0 to {MAX_PERIOD_S:g}.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_AUTOSCALING = AutoscalingPolicy()
_POLICY_FIELDS = frozenset(AutoscalingPolicy.__dataclass_fields__)


def autoscaling_policy_validate(data: object) -> AutoscalingPolicy:
    """A deployment's autoscaling policy from its JSON object (None: every default).
    Missing keys take their defaults; unknown keys, wrong types and values out of range
    raise DomainError("invalid_autoscaling") naming the field."""
    if data is None:
        return DEFAULT_AUTOSCALING
    if not isinstance(data, dict):
        message = "The autoscaling policy must be a JSON object."
        raise DomainError(ERROR_CODE, message, fields={"autoscaling": [message]})
    unknown = sorted(str(key) for key in data if key not in _POLICY_FIELDS)
    if unknown:
        message = f"Unknown autoscaling fields: {', '.join(unknown)}."
        raise DomainError(
            ERROR_CODE, message, fields={name: ["Unknown field."] for name in unknown}
        )
    try:
        return AutoscalingPolicy(**data)
    except _InvalidField as exc:
        raise DomainError(ERROR_CODE, str(exc), fields={exc.field: [str(exc)]}) from exc


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """The load figures of one ready replica, from its latest heartbeat."""

    running: int
    waiting: int
    kv_cache_usage: float  # 0-1
    ttft_p95_s: float | None  # None: no request had its first token in the interval


def replica_signals(figures: Mapping[str, Any]) -> ReplicaSignals | None:
    """One replica's signals from its heartbeat figures (`Agent.figures`), or None when
    they are absent or malformed. Figures come from outside: this never raises."""
    if not isinstance(figures, Mapping):
        return None
    running, waiting = _count(figures.get("running")), _count(figures.get("waiting"))
    kv_cache_usage = _finite(figures.get("kv_cache_usage"))
    raw_ttft = figures.get("ttft_p95_s")
    ttft_p95_s = None if raw_ttft is None else _finite(raw_ttft)
    if running is None or waiting is None:
        return None
    if kv_cache_usage is None or not 0 <= kv_cache_usage <= 1:
        return None
    if raw_ttft is not None and (ttft_p95_s is None or ttft_p95_s < 0):
        return None
    return ReplicaSignals(
        running=running, waiting=waiting, kv_cache_usage=kv_cache_usage, ttft_p95_s=ttft_p95_s
    )


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _finite(value: object) -> float | None:
    return float(value) if is_number(value) else None


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    desired: int
    direction: Direction
    reason: str  # one sentence naming the figures and thresholds
    figures: dict[str, float]


@dataclass(frozen=True, slots=True)
class _Signal:
    """One pressure signal measured over the ready replicas, against its thresholds."""

    template: str  # how a reason names the figure: "waiting {} per replica"
    observed: float
    high: float
    low: float
    unit: str = ""
    # Load that spreads over the replicas (queue, KV use) falls as replicas are added;
    # latency is not taken to.
    is_spread: bool = True

    @property
    def is_high(self) -> bool:
        return self.observed > self.high

    @property
    def is_low(self) -> bool:
        return self.observed < self.low

    def figure(self, value: float | None = None) -> str:
        shown = self.observed if value is None else value
        return self.template.format(f"{_number(shown)}{self.unit}")

    def against(self, threshold: float, sign: str) -> str:
        return f"{self.figure()} {sign} {_number(threshold)}{self.unit}"


def scaling_decide(
    *,
    policy: AutoscalingPolicy,
    role: Role,
    current: int,
    minimum: int,
    maximum: int,
    replicas: Sequence[ReplicaSignals],
    last_scaled_at: float | None,
    now: float,
) -> ScalingDecision:
    """The replica count one role of a deployment should have now, and why.

    `current` is the desired count so far (ready and loading replicas), `replicas` the
    signals of the ready ones, `last_scaled_at` when the count last changed (None:
    never).

    In order: a disabled policy only clamps `current` into [minimum, maximum]; a count
    outside the bounds is clamped at once, whatever the cooldowns; without a ready
    replica nothing is measured and the count holds. Then the strongest high signal
    (waiting per replica, mean KV cache use, worst TTFT p95 against the SLO) scales up
    to max(current + 1, ceil(ready * observed / high)) (one step at most doubles the count
    or adds STEP_UP_MAX), once the scale-up cooldown has
    passed; while replicas still load and they already cover that, it holds. When every
    signal is low, the count steps down by one once the scale-down cooldown has passed,
    and only if the load spread over one replica fewer stays below every high threshold
    (otherwise the step down would itself call for a step up). Between the low and high
    thresholds it holds: that band is what keeps the count from flapping.
    """
    if minimum < 0 or maximum < minimum:
        raise ValueError(f"bounds must satisfy 0 <= minimum <= maximum, got {minimum}, {maximum}")
    lower = minimum
    ready = len(replicas)
    figures: dict[str, float] = {"ready": float(ready), "current": float(current)}

    def decide(desired: int, reason: str) -> ScalingDecision:
        direction: Direction = "hold"
        if desired > current:
            direction = "up"
        elif desired < current:
            direction = "down"
        return ScalingDecision(desired=desired, direction=direction, reason=reason, figures=figures)

    if not policy.enabled:
        desired = _clamp(current, lower, maximum)
        if desired == current:
            return decide(current, f"autoscaling is off: holding at {current}")
        return decide(desired, f"autoscaling is off; {_bounds(current, lower, maximum)}")
    if not lower <= current <= maximum:
        return decide(_clamp(current, lower, maximum), _bounds(current, lower, maximum))
    if ready == 0:
        return decide(current, f"no ready replica to measure: holding at {current}")

    signals = _measure(policy, replicas, figures)
    on_replicas = f"on {_replicas(ready)}"
    since_scaled = math.inf if last_scaled_at is None else now - last_scaled_at
    high = [signal for signal in signals if signal.is_high]
    if high:
        strongest = max(high, key=lambda signal: signal.observed / signal.high)
        pressure = f"{strongest.against(strongest.high, '>')} {on_replicas}"
        # Replicas for the observed load to sit at the threshold; the ready ones measured it.
        needed = math.ceil(ready * strongest.observed / strongest.high)
        if current >= maximum:
            return decide(current, f"{pressure}, but already at the maximum {maximum}")
        if ready < current and needed <= current:
            return decide(
                current,
                f"{pressure}, but {_replicas(current - ready)} still loading will cover it:"
                f" holding at {current}",
            )
        if since_scaled < policy.scale_up_cooldown_s:
            cooldown = _cooldown("scale-up", policy.scale_up_cooldown_s, since_scaled)
            return decide(current, f"{pressure}, but {cooldown}: holding at {current}")
        # One step at most doubles the count or adds STEP_UP_MAX: queue and TTFT also
        # measure the backlog piled up while replicas warmed, so they over-ask at a jump.
        step_limit = max(2 * current, current + STEP_UP_MAX)
        desired = _clamp(min(max(current + 1, needed), step_limit), lower, maximum)
        capped = f" (one step adds at most {step_limit - current})" if needed > step_limit else ""
        return decide(desired, f"{pressure}{capped}: {current} -> {desired}")

    if all(signal.is_low for signal in signals):
        low = ", ".join(signal.against(signal.low, "<") for signal in signals)
        pressure = f"load is low {on_replicas} ({low})"
        if current <= lower:
            floor = f"the minimum {lower}"
            return decide(current, f"{pressure}, already at {floor}")
        if current > 1:
            # The same load over one replica fewer must not be high, or this step down
            # would call for the next step up.
            for signal in signals:
                if not signal.is_spread:
                    continue
                projected = signal.observed * ready / (current - 1)
                if projected > signal.high:
                    return decide(
                        current,
                        f"{pressure}, but on {_replicas(current - 1)} it would be"
                        f" {signal.figure(projected)} > {_number(signal.high)}{signal.unit}:"
                        f" holding at {current}",
                    )
        if since_scaled < policy.scale_down_cooldown_s:
            cooldown = _cooldown("scale-down", policy.scale_down_cooldown_s, since_scaled)
            return decide(current, f"{pressure}, but {cooldown}: holding at {current}")
        return decide(current - 1, f"{pressure}: {current} -> {current - 1}")

    within = ", ".join(signal.figure() for signal in signals)
    return decide(current, f"load within band {on_replicas} ({within}): holding at {current}")


def _measure(
    policy: AutoscalingPolicy, replicas: Sequence[ReplicaSignals], figures: dict[str, float]
) -> list[_Signal]:
    """The pressure signals over the ready replicas; writes their figures into `figures`."""
    ready = len(replicas)
    waiting = sum(replica.waiting for replica in replicas) / ready
    kv_cache = sum(replica.kv_cache_usage for replica in replicas) / ready
    figures["waiting_per_replica"] = waiting
    figures["running_per_replica"] = sum(replica.running for replica in replicas) / ready
    figures["kv_cache_mean"] = kv_cache
    signals = [
        _Signal(
            "waiting {} per replica",
            waiting,
            high=policy.queue_per_replica_high,
            low=policy.queue_per_replica_low,
        ),
        _Signal(
            "mean KV cache use {}",
            kv_cache,
            high=policy.kv_cache_high,
            low=policy.kv_cache_low,
        ),
    ]
    ttfts = [replica.ttft_p95_s for replica in replicas if replica.ttft_p95_s is not None]
    if ttfts:
        figures["ttft_p95_worst_s"] = max(ttfts)
    # Without an SLO, or without a request that had its first token, latency says nothing.
    if policy.ttft_slo_s is not None and ttfts:
        slo = policy.ttft_slo_s
        signals.append(
            _Signal(
                "worst TTFT p95 {}", max(ttfts), high=slo, low=slo / 2, unit=" s", is_spread=False
            )
        )
    return signals


def _replicas(count: int) -> str:
    return f"{count} replica" if count == 1 else f"{count} replicas"


def _clamp(value: int, lower: int, upper: int) -> int:
    return max(lower, min(upper, value))


def _bounds(current: int, lower: int, maximum: int) -> str:
    if current < lower:
        return f"{current} is below the minimum {lower}: {current} -> {lower}"
    return f"{current} is above the maximum {maximum}: {current} -> {maximum}"


def _cooldown(kind: str, cooldown_s: float, since_scaled: float) -> str:
    left = cooldown_s - since_scaled
    return f"the {kind} cooldown ({_number(cooldown_s)} s) has {_number(left)} s left"


def _number(value: float) -> str:
    """Two decimals at most, one at least: 4.0, 9.5, 0.85."""
    text = f"{value:.2f}".rstrip("0")
    return text + "0" if text.endswith(".") else text
