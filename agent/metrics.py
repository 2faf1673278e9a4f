"""The agent's Prometheus metrics, in a registry of its own (served on /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from contracts.streams import AgentState, EngineFailure

LOAD_PHASES = ("fetch", "verify", "warm")
LOAD_PHASE_BUCKETS = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip
NO_VERSION = "none"  # the `version` label of energy spent with nothing loaded


class _StateCollector(Collector):
    """`agent_state{state}`: 1 for the state the agent is in now, 0 for the others (read
    at scrape time, so it is never a heartbeat behind)."""

    def __init__(self, current_state: Callable[[], AgentState]) -> None:
        self._current_state = current_state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        current = self._current_state()
        family = GaugeMetricFamily(
            "agent_state", "The agent's state (1 for the current one).", labels=["state"]
        )
        for state in AgentState:
            family.add_metric([state.value], 1.0 if state is current else 0.0)
        yield family


class AgentMetrics:
    def __init__(self, current_state: Callable[[], AgentState]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(current_state))
        self.running = Gauge(
            "agent_engine_requests_running",
            "Requests in the running batch of the agent's engines.",
            registry=self.registry,
        )
        self.waiting = Gauge(
            "agent_engine_requests_waiting",
            "Requests waiting to be scheduled on the agent's engines.",
            registry=self.registry,
        )
        self.kv_cache_usage = Gauge(
            "agent_engine_kv_cache_usage_ratio",
            "KV cache usage of the current engine, 1 is full.",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "agent_prompt_tokens",
            "Prompt tokens processed (warm-up excluded).",
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "agent_generated_tokens", "Tokens generated (warm-up excluded).", registry=self.registry
        )
        self.preemptions = Counter(
            "agent_engine_preemptions",
            "Requests the engines preempted (their KV cache was full; warm-up excluded).",
            registry=self.registry,
        )
        self.energy = Counter(
            "agent_energy_joules",
            "Energy spent, by the version loaded while it was spent.",
            ["version"],
            registry=self.registry,
        )
        self.load_phase = Histogram(
            "agent_load_phase_seconds",
            "Duration of each completed phase of a load.",
            ["phase"],
            buckets=LOAD_PHASE_BUCKETS,
            registry=self.registry,
        )
        for phase in LOAD_PHASES:
            self.load_phase.labels(phase)  # export every series from the start, at zero
        # The reasons are the heartbeat's engine_error codes (contracts.streams.EngineFailure).
        self.engine_failures = Counter(
            "agent_engine_failures",
            "Engines that failed, by reason: spawn_failed, exited, killed, not_ready, step_failed.",
            ["reason"],
            registry=self.registry,
        )
        for reason in EngineFailure:
            self.engine_failures.labels(reason.value)

    def observe_interval(
        self,
        *,
        running: int,
        waiting: int,
        kv_cache_usage: float,
        prompt_tokens: int,
        generated_tokens: int,
        preemptions: int = 0,
        joules: float,
        version_id: int | None,
    ) -> None:
        """One heartbeat interval's figures."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_cache_usage.set(kv_cache_usage)
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated_tokens)
        self.preemptions.inc(preemptions)
        self.energy.labels(NO_VERSION if version_id is None else str(version_id)).inc(joules)

    def observe_load_phase(self, phase: str, seconds: float) -> None:
        self.load_phase.labels(phase).observe(seconds)

    def count_engine_failure(self, reason: EngineFailure) -> None:
        self.engine_failures.labels(reason.value).inc()
