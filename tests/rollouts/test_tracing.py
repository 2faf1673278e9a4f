"""An automatic rollback is one trace: analysis -> transition -> reconcile -> routing.

A real Celery worker (the project's app, on this run's queue and Redis) runs on a thread
of the test process, so the SDK's in-memory exporter sees its spans. The analysis task is
sent from inside a span of the test; the reconcile task the rollback sends after commit
carries the transition's trace context in its message headers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from celery import signals
from celery.contrib.testing.worker import start_worker
from django.db import connections
from django.utils import timezone
from opentelemetry.sdk.trace import ReadableSpan

from contracts import tracing
from controlplane.celery import app
from controlplane.rollouts.models import AnalysisRun, Rollout
from controlplane.rollouts.tasks import analysis_tick, rollout_analyze
from tests.rollouts.conftest import add_samples, backdate_stage, running_rollout
from tests.tracing_support import (
    in_memory_tracing,
    one_span,
    parent_id,
    span_id,
    trace_id,
    wait_for_span,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

POLICY = {"min_samples": 20, "alpha": 0.01}
STAGES = [
    {"weight": 10, "min_duration_s": 60, "min_requests": 20},
    {"weight": 100, "min_duration_s": 60, "min_requests": 20},
]


def _close_connections(**_: Any) -> None:
    connections.close_all()  # the worker thread's own, before the test database goes


@contextmanager
def worker() -> Iterator[None]:
    """A worker on this run's queue, with nothing queued before it started."""
    app.control.purge()  # the setup's own reconcile passes: not this trace's
    signals.task_postrun.connect(_close_connections, weak=False, dispatch_uid="test-close-db")
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
            yield
    finally:
        signals.task_postrun.disconnect(dispatch_uid="test-close-db")


def test_an_automatic_rollback_is_one_trace_from_analysis_to_routing(
    deployment, versions, tenant, redis_client
) -> None:
    rollout = backdate_stage(
        running_rollout(deployment, versions[1], stages=STAGES, policy=POLICY), 10
    )
    window_end = analysis_tick(timezone.now() + timedelta(seconds=30))
    start = window_end - timedelta(seconds=8)
    add_samples(
        version=versions[0], tenant=tenant, start=start, ttft_ms=[100.0 + i % 9 for i in range(40)]
    )
    add_samples(
        version=versions[1], tenant=tenant, start=start, ttft_ms=[400.0 + i % 7 for i in range(30)]
    )

    with worker(), in_memory_tracing() as spans:
        with tracing.tracer("tests").start_as_current_span("beat tick") as tick:
            rollout_analyze.delay(rollout.pk, window_end.isoformat())
        reconcile_task = wait_for_span(spans, "celery.task rollouts.reconcile")

    publish = one_span(spans, "rollouts.routing.publish")
    reconcile = one_span(spans, "rollouts.reconcile")
    analyze_task = one_span(spans, "celery.task rollouts.analyze")
    analysis = one_span(spans, "rollouts.analysis")
    transition = one_span(spans, "rollouts.transition")

    # tick -> analyze task -> analysis -> transition -> reconcile task -> reconcile -> publish
    chain = [analyze_task, analysis, transition, reconcile_task, reconcile, publish]
    parents: list[Any] = [tick, *chain[:-1]]
    assert [parent_id(span) for span in chain] == [span_id(p) for p in parents]
    assert {trace_id(span) for span in chain} == {tick.get_span_context().trace_id}

    run = AnalysisRun.objects.get()
    rollout.refresh_from_db()
    assert rollout.state == "rolled_back"
    assert attributes(analysis, "rollout_id", "analysis_run_id", "verdict", "action") == [
        rollout.pk,
        run.pk,
        "fail",
        "rollback",
    ]
    assert attributes(transition, "action", "state_from", "state_to", "canary_weight", "actor") == [
        "rollout.rollback",
        "running",
        "rolled_back",
        0,
        "system",
    ]
    assert attributes(reconcile, "deployment", "routing_revision", "rolled_back") == [
        deployment.name,
        Rollout.objects.get().deployment.routing_revision,
        False,
    ]
    # The published table: the stable version alone, at full weight.
    assert attributes(publish, "versions") == [f"{versions[0].pk}:100:stable"]


def attributes(span: ReadableSpan, *names: str) -> list[Any]:
    assert span.attributes is not None
    return [span.attributes.get(f"fleet.{name}") for name in names]
