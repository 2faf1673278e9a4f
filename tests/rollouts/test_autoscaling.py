"""Autoscaling decisions: policy validation, each rule, and a fleet simulated second by
second under a load that steps up and back down."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from controlplane.core.errors import DomainError
from controlplane.rollouts.autoscaling import (
    DEFAULT_AUTOSCALING,
    AutoscalingPolicy,
    ReplicaSignals,
    ScalingDecision,
    autoscaling_policy_validate,
    replica_signals,
    scaling_decide,
)
from tests.fleet.support import heartbeat

ON = replace(DEFAULT_AUTOSCALING, enabled=True)
NOW = 10_000.0


def signals(
    *,
    waiting: int = 1,
    running: int = 4,
    kv_cache_usage: float = 0.6,
    ttft_p95_s: float | None = 0.3,
) -> ReplicaSignals:
    return ReplicaSignals(
        running=running, waiting=waiting, kv_cache_usage=kv_cache_usage, ttft_p95_s=ttft_p95_s
    )


IDLE = signals(waiting=0, running=0, kv_cache_usage=0.0, ttft_p95_s=None)
LOW = signals(waiting=0, running=1, kv_cache_usage=0.2, ttft_p95_s=0.2)


def decide(**changes: Any) -> ScalingDecision:
    arguments: dict[str, Any] = {
        "policy": ON,
        "role": "stable",
        "current": 4,
        "minimum": 1,
        "maximum": 10,
        "replicas": [signals()] * 4,
        "last_scaled_at": None,
        "now": NOW,
    }
    arguments.update(changes)
    return scaling_decide(**arguments)


# --- policy validation ---------------------------------------------------------------


def test_policy_defaults() -> None:
    assert autoscaling_policy_validate({}) == DEFAULT_AUTOSCALING
    assert autoscaling_policy_validate(None) == DEFAULT_AUTOSCALING
    assert DEFAULT_AUTOSCALING.to_dict() == {
        "enabled": False,
        "queue_per_replica_high": 4.0,
        "queue_per_replica_low": 0.5,
        "kv_cache_high": 0.85,
        "kv_cache_low": 0.5,
        "ttft_slo_s": None,
        "scale_up_cooldown_s": 30.0,
        "scale_down_cooldown_s": 300.0,
    }


def test_policy_overrides_and_round_trip() -> None:
    policy = autoscaling_policy_validate(
        {"enabled": True, "ttft_slo_s": 2, "kv_cache_high": 1, "scale_up_cooldown_s": 0}
    )
    assert policy == replace(
        DEFAULT_AUTOSCALING, enabled=True, ttft_slo_s=2, kv_cache_high=1, scale_up_cooldown_s=0
    )
    assert autoscaling_policy_validate(policy.to_dict()) == policy
    longest = {"scale_down_cooldown_s": 86400, "scale_up_cooldown_s": 86400.0}
    assert autoscaling_policy_validate(longest).scale_down_cooldown_s == 86400


@pytest.mark.parametrize(
    ("data", "field_name"),
    [
        ({"enabled": 1}, "enabled"),
        ({"enabled": "true"}, "enabled"),
        ({"queue_per_replica_high": 0}, "queue_per_replica_high"),
        ({"queue_per_replica_high": "4"}, "queue_per_replica_high"),
        ({"queue_per_replica_high": True}, "queue_per_replica_high"),
        ({"queue_per_replica_high": math.inf}, "queue_per_replica_high"),
        ({"queue_per_replica_low": -1}, "queue_per_replica_low"),
        ({"queue_per_replica_low": 4.0}, "queue_per_replica_low"),
        ({"kv_cache_high": 1.01}, "kv_cache_high"),
        ({"kv_cache_high": math.nan}, "kv_cache_high"),
        ({"kv_cache_low": 0}, "kv_cache_low"),
        ({"kv_cache_low": 0.9}, "kv_cache_low"),
        ({"ttft_slo_s": 0}, "ttft_slo_s"),
        ({"ttft_slo_s": "1"}, "ttft_slo_s"),
        ({"ttft_slo_s": math.inf}, "ttft_slo_s"),
        ({"scale_up_cooldown_s": -1}, "scale_up_cooldown_s"),
        ({"scale_down_cooldown_s": 86401}, "scale_down_cooldown_s"),
    ],
)
def test_policy_refusal_names_its_field(data: dict[str, Any], field_name: str) -> None:
    with pytest.raises(DomainError) as caught:
        autoscaling_policy_validate(data)
    assert caught.value.code == "invalid_autoscaling"
    assert caught.value.message.startswith(f"{field_name} ")
    assert caught.value.fields == {field_name: [caught.value.message]}


def test_policy_refuses_unknown_fields() -> None:
    with pytest.raises(DomainError) as caught:
        autoscaling_policy_validate({"enabled": True, "max_replicas": 3, "cooldown": 1})
    assert caught.value.code == "invalid_autoscaling"
    assert caught.value.message == "Unknown autoscaling fields: cooldown, max_replicas."
    assert caught.value.fields == {
        "cooldown": ["Unknown field."],
        "max_replicas": ["Unknown field."],
    }


@pytest.mark.parametrize("data", [[], "enabled", 1, True])
def test_policy_must_be_an_object(data: object) -> None:
    with pytest.raises(DomainError) as caught:
        autoscaling_policy_validate(data)
    assert caught.value.code == "invalid_autoscaling"
    assert set(caught.value.fields) == {"autoscaling"}


# --- heartbeat figures ---------------------------------------------------------------


def test_replica_signals_from_a_heartbeat() -> None:
    beat = heartbeat(running=3, waiting=7, kv_cache_usage=0.5, ttft_p95_s=1.25)
    assert replica_signals(beat.figures()) == ReplicaSignals(
        running=3, waiting=7, kv_cache_usage=0.5, ttft_p95_s=1.25
    )
    quiet = heartbeat(running=0, waiting=0, kv_cache_usage=0.0, ttft_p95_s=None)
    assert replica_signals(quiet.figures()) == ReplicaSignals(
        running=0, waiting=0, kv_cache_usage=0.0, ttft_p95_s=None
    )


def test_replica_signals_without_ttft_key() -> None:
    figures = {"running": 1, "waiting": 2, "kv_cache_usage": 0}
    assert replica_signals(figures) == ReplicaSignals(1, 2, 0.0, None)


@pytest.mark.parametrize(
    "changes",
    [
        {"running": None},
        {"running": 2.0},
        {"waiting": -1},
        {"waiting": True},
        {"waiting": "3"},
        {"kv_cache_usage": 1.5},
        {"kv_cache_usage": math.nan},
        {"kv_cache_usage": "0.5"},
        {"kv_cache_usage": None},
        {"ttft_p95_s": -0.1},
        {"ttft_p95_s": math.inf},
        {"ttft_p95_s": "fast"},
    ],
)
def test_replica_signals_refuse_malformed_figures(changes: dict[str, Any]) -> None:
    figures = heartbeat().figures() | changes
    assert replica_signals(figures) is None


@pytest.mark.parametrize("figures", [{}, None, [], "running", {"waiting": 1}])
def test_replica_signals_refuse_absent_figures(figures: Any) -> None:
    assert replica_signals(figures) is None


# --- the rules -----------------------------------------------------------------------


def test_disabled_policy_holds() -> None:
    decision = decide(policy=DEFAULT_AUTOSCALING, replicas=[signals(waiting=50)] * 4)
    assert decision == ScalingDecision(
        desired=4,
        direction="hold",
        reason="autoscaling is off: holding at 4",
        figures={"ready": 4.0, "current": 4.0},
    )


def test_disabled_policy_still_clamps() -> None:
    decision = decide(policy=DEFAULT_AUTOSCALING, current=12)
    assert (decision.desired, decision.direction) == (10, "down")
    assert decision.reason == "autoscaling is off; 12 is above the maximum 10: 12 -> 10"


def test_count_outside_bounds_is_clamped_without_cooldown() -> None:
    below = decide(current=0, minimum=2, replicas=[], last_scaled_at=NOW)
    assert (below.desired, below.direction) == (2, "up")
    assert below.reason == "0 is below the minimum 2: 0 -> 2"
    above = decide(current=12, replicas=[IDLE] * 12, last_scaled_at=NOW)
    assert (above.desired, above.direction) == (10, "down")
    assert above.reason == "12 is above the maximum 10: 12 -> 10"


def test_no_ready_replica_holds() -> None:
    decision = decide(current=3, replicas=[])
    assert (decision.desired, decision.direction) == (3, "hold")
    assert decision.reason == "no ready replica to measure: holding at 3"


def test_queue_scales_up_in_proportion() -> None:
    decision = decide(current=2, replicas=[signals(waiting=9), signals(waiting=10)])
    assert (decision.desired, decision.direction) == (5, "up")
    assert decision.reason == "waiting 9.5 per replica > 4.0 on 2 replicas: 2 -> 5"
    assert decision.figures["waiting_per_replica"] == 9.5


def test_small_excess_adds_one_replica() -> None:
    decision = decide(replicas=[signals(waiting=5), *[signals(waiting=4)] * 3])
    assert decision.desired == 5
    assert decision.reason == "waiting 4.25 per replica > 4.0 on 4 replicas: 4 -> 5"


def test_kv_cache_scales_up() -> None:
    decision = decide(replicas=[signals(kv_cache_usage=0.9)] * 4)
    assert decision.desired == 5
    assert decision.reason == "mean KV cache use 0.9 > 0.85 on 4 replicas: 4 -> 5"


def test_strongest_signal_sets_the_count() -> None:
    policy = replace(ON, ttft_slo_s=1.0)
    slow = [signals(waiting=5, ttft_p95_s=0.4)] * 3 + [signals(waiting=5, ttft_p95_s=1.5)]
    decision = decide(policy=policy, replicas=slow)
    assert decision.desired == 6
    assert decision.reason == "worst TTFT p95 1.5 s > 1.0 s on 4 replicas: 4 -> 6"
    assert decision.figures["ttft_p95_worst_s"] == 1.5


def test_one_step_up_at_most_doubles_the_count_or_adds_four() -> None:
    decision = decide(current=2, replicas=[signals(waiting=40)] * 2)
    assert decision.desired == 6  # 20 asked for: 2 + 4
    assert decision.reason == (
        "waiting 40.0 per replica > 4.0 on 2 replicas (one step adds at most 4): 2 -> 6"
    )
    assert decide(current=6, maximum=64, replicas=[signals(waiting=40)] * 6).desired == 12


def test_ttft_without_slo_is_no_signal() -> None:
    decision = decide(replicas=[signals(ttft_p95_s=60.0)] * 4)
    assert decision.direction == "hold"


def test_scale_up_stops_at_the_maximum() -> None:
    decision = decide(current=8, replicas=[signals(waiting=100)] * 8)
    assert decision.desired == 10
    at_maximum = decide(current=10, replicas=[signals(waiting=100)] * 10)
    assert (at_maximum.desired, at_maximum.direction) == (10, "hold")
    assert at_maximum.reason.endswith("but already at the maximum 10")


def test_scale_up_waits_for_its_cooldown() -> None:
    busy = [signals(waiting=6)] * 4
    waiting = decide(replicas=busy, last_scaled_at=NOW - 10)
    assert (waiting.desired, waiting.direction) == (4, "hold")
    assert waiting.reason == (
        "waiting 6.0 per replica > 4.0 on 4 replicas, but the scale-up cooldown (30.0 s)"
        " has 20.0 s left: holding at 4"
    )
    assert decide(replicas=busy, last_scaled_at=NOW - 30).desired == 6


def test_loading_replicas_that_cover_the_load_hold() -> None:
    # 4 ready of 6: the load needs 5, which the 2 loading already give.
    covered = decide(current=6, replicas=[signals(waiting=5)] * 4)
    assert (covered.desired, covered.direction) == (6, "hold")
    assert "but 2 replicas still loading will cover it" in covered.reason
    # The load needs 8: more than the 6 ready and loading.
    short = decide(current=6, replicas=[signals(waiting=8)] * 4)
    assert (short.desired, short.direction) == (8, "up")


def test_low_load_steps_down_by_one() -> None:
    decision = decide(replicas=[LOW] * 4, last_scaled_at=NOW - 300)
    assert (decision.desired, decision.direction) == (3, "down")
    assert decision.reason == (
        "load is low on 4 replicas (waiting 0.0 per replica < 0.5,"
        " mean KV cache use 0.2 < 0.5): 4 -> 3"
    )


def test_scale_down_waits_for_its_cooldown() -> None:
    decision = decide(replicas=[LOW] * 4, last_scaled_at=NOW - 299)
    assert (decision.desired, decision.direction) == (4, "hold")
    assert "the scale-down cooldown (300.0 s) has 1.0 s left" in decision.reason


def test_low_load_at_the_minimum_holds() -> None:
    decision = decide(current=1, replicas=[LOW])
    assert (decision.desired, decision.direction) == (1, "hold")
    assert decision.reason.endswith("already at the minimum 1")


@pytest.mark.parametrize(
    "replica",
    [
        signals(waiting=2, kv_cache_usage=0.6),  # both in the band
        signals(waiting=0, kv_cache_usage=0.6),  # one low, one in the band
        signals(waiting=4, kv_cache_usage=0.85),  # both exactly at high
        signals(waiting=0, kv_cache_usage=0.5),  # KV exactly at low
    ],
)
def test_band_holds(replica: ReplicaSignals) -> None:
    decision = decide(replicas=[replica] * 4)
    assert (decision.desired, decision.direction) == (4, "hold")
    assert decision.reason.startswith("load within band on 4 replicas (waiting ")


def test_ttft_must_be_low_too_for_a_step_down() -> None:
    policy = replace(ON, ttft_slo_s=1.0)
    middling = decide(policy=policy, replicas=[replace(LOW, ttft_p95_s=0.6)] * 4)
    assert middling.direction == "hold"
    fast = decide(policy=policy, replicas=[replace(LOW, ttft_p95_s=0.4)] * 4)
    assert fast.direction == "down"
    assert "worst TTFT p95 0.4 s < 0.5 s" in fast.reason
    # No request had a first token: latency says nothing, the rest is low.
    unmeasured = decide(policy=policy, replicas=[replace(LOW, ttft_p95_s=None)] * 4)
    assert unmeasured.direction == "down"


def test_step_down_that_would_be_high_holds() -> None:
    # Low on 2 (0.45 < 0.5), but 0.9 > 0.85 on 1: stepping down would call for a step up.
    decision = decide(current=2, replicas=[signals(waiting=0, kv_cache_usage=0.45)] * 2)
    assert (decision.desired, decision.direction) == (2, "hold")
    assert decision.reason.endswith(
        "but on 1 replica it would be mean KV cache use 0.9 > 0.85: holding at 2"
    )


def test_bounds_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="minimum <= maximum"):
        decide(minimum=5, maximum=4)


# --- simulation ----------------------------------------------------------------------

BASE_RPS = 0.6
STEP_UP_AT = 60  # seconds; the load climbs to its plateau in STAIRS steps, STAIR_S apart
STAIR_S = 30
STEP_DOWN_AT = 660  # back to BASE_RPS at once
SERVICE_S = 10  # each request is served in this long once a replica admits it
CONCURRENCY = 8  # requests one replica serves at once: it serves 0.8 requests a second
WARM_UP_S = 8  # a new replica is ready this long after it is asked for
PREFILL_S = 0.3
DECISION_EVERY_S = 5
MINIMUM, MAXIMUM = 2, 40
SEED = 7
# What an agent's heartbeat carries (Agent.figures); the simulation sets the load figures.
HEARTBEAT_FIGURES = heartbeat().figures()


def load_rps(now: int, plateau_rps: float, stairs: int) -> float:
    if not STEP_UP_AT <= now < STEP_DOWN_AT:
        return BASE_RPS
    stair = min(stairs, (now - STEP_UP_AT) // STAIR_S + 1)
    return BASE_RPS + (plateau_rps - BASE_RPS) * stair / stairs


@dataclass
class Fleet:
    """A discrete-time queue: one backlog shared by the ready replicas, each serving at
    most CONCURRENCY requests at once, each request for SERVICE_S seconds."""

    ready_at: list[int] = field(default_factory=list)  # per replica, when it is ready
    waiting: int = 0
    # Requests admitted in each of the last SERVICE_S seconds, oldest first.
    admitted: deque[int] = field(default_factory=deque)

    def ready(self, now: int) -> int:
        return sum(1 for ready_at in self.ready_at if ready_at <= now)

    @property
    def running(self) -> int:
        return sum(self.admitted)

    def step(self, now: int, arrivals: int) -> None:
        if len(self.admitted) == SERVICE_S:
            self.admitted.popleft()  # served
        self.waiting += arrivals
        capacity = self.ready(now) * CONCURRENCY
        excess = self.running - capacity
        while excess > 0:  # replicas went away: their newest requests queue again
            requeued = min(excess, self.admitted[-1])
            self.admitted[-1] -= requeued
            self.waiting += requeued
            excess -= requeued
            if not self.admitted[-1]:
                self.admitted.pop()
        admitted = min(self.waiting, capacity - self.running)
        self.admitted.append(admitted)
        self.waiting -= admitted

    def heartbeats(self, now: int, rng: np.random.Generator) -> list[dict[str, Any]]:
        """Each ready replica's figures: its share of the backlog and of the running."""
        ready = self.ready(now)
        if ready == 0:
            return []
        waiting_shares = rng.multinomial(self.waiting, [1 / ready] * ready).tolist()
        jitter = rng.uniform(1.0, 1.2, size=ready).tolist()
        base, extra = divmod(self.running, ready)
        first_busier = int(rng.integers(ready))  # which replicas run one request more
        beats = []
        for index, waiting in enumerate(waiting_shares):
            running = base + (1 if (index - first_busier) % ready < extra else 0)
            # The replica's own queue ahead of a request, at its service rate.
            ttft = PREFILL_S + waiting * SERVICE_S / CONCURRENCY
            beats.append(
                HEARTBEAT_FIGURES
                | {
                    "running": running,
                    "waiting": waiting,
                    "kv_cache_usage": running / CONCURRENCY,
                    "ttft_p95_s": ttft * jitter[index] if running else None,
                }
            )
        return beats

    def resize(self, desired: int, now: int) -> None:
        while len(self.ready_at) < desired:
            self.ready_at.append(now + WARM_UP_S)
        self.ready_at.sort()
        del self.ready_at[desired:]  # the newest (loading first) go first


@dataclass(frozen=True)
class Tick:
    at: int
    decision: ScalingDecision


def simulate(policy: AutoscalingPolicy, plateau_rps: float, stairs: int) -> list[Tick]:
    """Decisions every DECISION_EVERY_S, as the control loop takes them, until the fleet has
    been back at the minimum for a scale-down cooldown (or a simulated day has passed)."""
    rng = np.random.default_rng(SEED)
    fleet = Fleet()
    fleet.resize(MINIMUM, now=-WARM_UP_S)
    current, last_scaled_at = MINIMUM, None
    ticks = []
    carried = 0.0  # arrivals are whole requests; the fractions add up
    for now in range(86400):
        carried += load_rps(now, plateau_rps, stairs)
        arrivals = int(carried)
        carried -= arrivals
        fleet.step(now, arrivals)
        if now % DECISION_EVERY_S:
            continue
        replicas = [replica_signals(figures) for figures in fleet.heartbeats(now, rng)]
        decision = scaling_decide(
            policy=policy,
            role="stable",
            current=current,
            minimum=MINIMUM,
            maximum=MAXIMUM,
            replicas=[replica for replica in replicas if replica is not None],
            last_scaled_at=last_scaled_at,
            now=float(now),
        )
        ticks.append(Tick(now, decision))
        if decision.desired != current:
            current, last_scaled_at = decision.desired, float(now)
            fleet.resize(current, now)
        elif now > STEP_DOWN_AT and current == MINIMUM:
            assert last_scaled_at is not None
            if now - last_scaled_at > policy.scale_down_cooldown_s:
                break
    return ticks


@pytest.mark.parametrize(
    ("plateau_rps", "stairs", "ttft_slo_s"),
    [(12.0, 4, None), (12.0, 4, 5.0), (40.0, 1, None)],
    ids=["within-bounds", "within-bounds-with-ttft-slo", "beyond-the-maximum"],
)
def test_simulated_fleet_scales_up_settles_and_comes_back(
    plateau_rps: float, stairs: int, ttft_slo_s: float | None
) -> None:
    policy = replace(ON, ttft_slo_s=ttft_slo_s)
    ticks = simulate(policy, plateau_rps, stairs)
    counts = [tick.decision.desired for tick in ticks]
    changes = [tick for tick in ticks if tick.decision.direction != "hold"]

    # Up under the queue within two decisions of the first step, never past the maximum.
    first_up = next(tick for tick in changes if tick.decision.direction == "up")
    assert STEP_UP_AT <= first_up.at <= STEP_UP_AT + 2 * DECISION_EVERY_S
    assert max(counts) <= MAXIMUM

    # Settled within 3 minutes of the first step, then constant until the load drops.
    settled = [tick for tick in ticks if STEP_UP_AT + 180 <= tick.at < STEP_DOWN_AT]
    assert {tick.decision.desired for tick in settled} == {max(counts)}
    plateau_count = max(counts)
    last = settled[-1].decision.figures
    if plateau_rps * SERVICE_S < MAXIMUM * CONCURRENCY * policy.kv_cache_high:
        # The load fits: it sits in the band, the queue drained, short of the maximum.
        assert plateau_count < MAXIMUM
        assert policy.kv_cache_low <= last["kv_cache_mean"] <= policy.kv_cache_high
        assert last["waiting_per_replica"] == 0
    else:
        assert plateau_count == MAXIMUM
        assert last["kv_cache_mean"] == 1.0

    # Down only after the load dropped, one replica a cooldown, all the way to the minimum.
    downs = [tick for tick in changes if tick.decision.direction == "down"]
    assert downs[0].at >= STEP_DOWN_AT
    assert [tick.decision.desired for tick in downs] == list(range(plateau_count - 1, 1, -1))
    for tick in downs:
        before = changes[changes.index(tick) - 1]
        assert tick.at - before.at >= policy.scale_down_cooldown_s
    assert counts[-1] == MINIMUM

    # No flapping: one up phase, then one down phase.
    directions = [tick.decision.direction for tick in changes]
    phases = [d for index, d in enumerate(directions) if index == 0 or directions[index - 1] != d]
    assert phases == ["up", "down"]

    # Every change says which figure moved it, and from what count to what.
    for tick in changes:
        reason = tick.decision.reason
        assert any(name in reason for name in ("waiting", "KV cache", "TTFT")), reason
        assert reason.endswith(
            f"{int(tick.decision.figures['current'])} -> {tick.decision.desired}"
        )
