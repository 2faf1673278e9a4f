"""The control plane's decisions as Prometheus series, counted from their rows at scrape
time (controlplane/core/state_metrics.py): rollouts by state, rollbacks by trigger,
analysis runs by verdict and action, their signals by verdict, agent commands by kind and
status (and those no agent has acknowledged yet), and how far the reconciler is behind
the desired routing. Counters stay monotonic: these rows are never deleted."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count, F, Min, Q
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import FINAL_COMMAND_STATUSES, AgentCommand, CommandStatus
from controlplane.rollouts.analysis import SIGNALS, Verdict
from controlplane.rollouts.models import AnalysisRun, Deployment, Rollout, RolloutState


class DecisionsCollector:
    def collect(self) -> Iterator[Metric]:
        by_state = GaugeMetricFamily("rollouts", "Rollouts by state", labels=["state"])
        counts = dict(Rollout.objects.values_list("state").annotate(n=Count("id")))
        for state in RolloutState.values:
            by_state.add_metric([state], counts.get(state, 0))
        yield by_state

        rollbacks = CounterMetricFamily(
            "rollouts_rollbacks",
            "Rollouts rolled back: automatic (the analysis, a hard breach, lost agents) or "
            "manual (a person)",
            labels=["trigger"],
        )
        events = AuditEvent.objects.filter(action="rollout.rollback")
        manual = events.filter(actor__isnull=False).count()
        rollbacks.add_metric(["automatic"], events.count() - manual)
        rollbacks.add_metric(["manual"], manual)
        yield rollbacks

        verdicts = CounterMetricFamily(
            "rollouts_analysis_runs", "Canary analysis runs", labels=["verdict", "action"]
        )
        for verdict, action, n in AnalysisRun.objects.values_list("verdict", "action").annotate(
            n=Count("id")
        ):
            verdicts.add_metric([verdict, action], n)
        yield verdicts
        yield _signal_verdicts()

        # A command moves pending -> accepted -> a final status: only the final statuses
        # are counters (they never fall); the others are a gauge of commands still open.
        finished = CounterMetricFamily(
            "fleet_commands", "Agent commands finished, by final status", labels=["kind", "status"]
        )
        still_open = GaugeMetricFamily(
            "fleet_commands_open",
            "Agent commands not finished yet, by status (pending or accepted)",
            labels=["kind", "status"],
        )
        for kind, status, n in AgentCommand.objects.values_list("kind", "status").annotate(
            n=Count("id")
        ):
            family = finished if status in FINAL_COMMAND_STATUSES else still_open
            family.add_metric([kind, status], n)
        yield finished
        yield still_open
        yield from _unacknowledged_commands()

        behind = Deployment.objects.filter(applied_revision__lt=F("routing_revision"))
        pending = GaugeMetricFamily(
            "rollouts_reconcile_pending_deployments",
            "Deployments whose desired routing the reconciler has not applied yet",
        )
        pending.add_metric([], behind.count())
        yield pending
        oldest = behind.aggregate(oldest=Min("updated_at"))["oldest"]
        lag = GaugeMetricFamily(
            "rollouts_reconcile_lag_seconds",
            "How long the oldest unapplied routing change has waited (0 when none)",
        )
        lag.add_metric([], (timezone.now() - oldest).total_seconds() if oldest else 0.0)
        yield lag


def _signal_verdicts() -> Metric:
    """Each analysis run's signals by their verdicts (a run's `signals` maps a signal to
    its verdict), counted by the database in one query."""
    family = CounterMetricFamily(
        "rollouts_analysis_signal_verdicts",
        "Signals judged by canary analysis runs, by signal and verdict",
        labels=["signal", "verdict"],
    )
    pairs = [(signal, verdict.value) for signal in SIGNALS for verdict in Verdict]
    counts = AnalysisRun.objects.aggregate(
        **{
            f"n{index}": Count("id", filter=Q(**{f"signals__{signal}": verdict}))
            for index, (signal, verdict) in enumerate(pairs)
        }
    )
    for index, (signal, verdict) in enumerate(pairs):
        family.add_metric([signal, verdict], counts[f"n{index}"])
    return family


def _unacknowledged_commands() -> Iterator[Metric]:
    """Commands in an agent's stream that it has not acknowledged (accepted or answered)
    yet, and how long the oldest has waited: an agent that stops reading shows here."""
    pending = AgentCommand.objects.filter(status=CommandStatus.PENDING)
    waiting = GaugeMetricFamily(
        "fleet_commands_unacknowledged",
        "Agent commands not acknowledged by their agent yet",
        labels=["kind"],
    )
    for kind, n in pending.values_list("kind").annotate(n=Count("id")):
        waiting.add_metric([kind], n)
    yield waiting
    oldest = pending.aggregate(oldest=Min("created_at"))["oldest"]
    age = GaugeMetricFamily(
        "fleet_commands_oldest_unacknowledged_seconds",
        "How long the oldest unacknowledged agent command has waited (0 when none)",
    )
    age.add_metric([], (timezone.now() - oldest).total_seconds() if oldest else 0.0)
    yield age
