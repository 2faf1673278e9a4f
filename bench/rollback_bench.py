"""Rollback time: fault onset -> canary weight 0, and manual rollback -> routing changed.

    python -m bench.rollback_bench [--quick] [--drills 5] [--manual 5]

Runs the product as the demo does, on stores of its own (a fresh PostgreSQL database
`BENCH_ROLLBACK_DB`, default `cp_bench_rollback`, and Redis database `BENCH_ROLLBACK_REDIS`,
default db 6): `manage.py seed_demo`, the web process (gateway and REST API), a Celery
worker and beat with the demo's intervals (analysis every 10 s, reconcile every 5 s),
`manage.py ingest` and two agents serving SmolLM2-135M. Four client threads stream chat
completions through the gateway the whole time.

Drill (median of 5): a rollout sends 50 % of traffic to the candidate; once the canary
has answered requests, the candidate's agent gets `faults error_rate=1.0`. The figure is
the time from sending that command to the first routing table (read every 5 ms) that
gives the candidate no weight: the agent applying the fault, the gateway's failed
requests reaching the requests stream, ingest's hard-breach check rolling back, the
reconciler task publishing the table.

Manual rollback (median of 5): `POST /api/v1/rollouts/{id}/rollback/` as on-call to the
routing table without the candidate.

The agents keep the candidate loaded between drills (`ROLLOUTS_DRAIN_GRACE_S` is long)
so each drill starts in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.stack import DEPLOYMENT, MODEL, DemoStack
from bench.stack import wait_for as _wait

BUDGET_S = 200
QUICK_BUDGET_S = 160
DRILL_TARGET_S = 3.0
MANUAL_TARGET_S = 0.5
CANDIDATE_LABEL = "q4_1-bf16"
STAGE = {"weight": 50, "min_duration_s": 3600, "min_requests": 1}
# The drills measure the fast path: analysis (every 10 s) stays inconclusive and holds.
POLICY = {
    "hard_breach_window": 4,
    "hard_error_rate_max": 0.5,
    "min_samples": 1_000_000,
    "on_inconclusive": "hold",
}
CLIENT_THREADS = 4


def log(message: str) -> None:
    print(f"[rollback_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


class RoutingMonitor:
    """Reads `routing:<deployment>` every 5 ms; keeps (monotonic time, weights) per change."""

    def __init__(self, redis_url: str) -> None:
        import redis

        from contracts.routing import routing_key

        self.client = redis.Redis.from_url(redis_url)
        self.key = routing_key(DEPLOYMENT)
        self.seen: list[tuple[float, dict[int, int]]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from contracts.routing import parse_routing_table

        last = None
        while not self.stop.is_set():
            raw = self.client.get(self.key)
            if raw is not None and raw != last:
                last = raw
                table = parse_routing_table(raw)
                weights = {v.version_id: v.weight for v in table.versions if v.endpoints}
                with self.lock:
                    self.seen.append((time.monotonic(), weights))
            time.sleep(0.005)

    def current(self) -> dict[int, int]:
        with self.lock:
            return dict(self.seen[-1][1]) if self.seen else {}

    def first_without(self, version_id: int, after: float) -> float | None:
        with self.lock:
            for at, weights in self.seen:
                if at >= after and weights.get(version_id, 0) == 0:
                    return at
        return None


class Traffic:
    """Client threads streaming short chat completions through the gateway."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.statuses: dict[int, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, daemon=True) for _ in range(CLIENT_THREADS)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 4,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                try:
                    with client.stream(
                        "POST", f"{self.url}/v1/chat/completions", json=body, headers=headers
                    ) as response:
                        for _ in response.iter_bytes():
                            pass
                        status = response.status_code
                except httpx.HTTPError:
                    status = 0
                with self.lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1
                if status != 200:
                    time.sleep(0.05)

    def close(self) -> dict[int, int]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)
        return dict(self.statuses)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(tmp: Path, drills: int, manual: int, ready_timeout: float) -> dict[str, Any]:
    database_url = os.environ.get(
        "BENCH_ROLLBACK_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/cp_bench_rollback"
    )
    redis_url = os.environ.get("BENCH_ROLLBACK_REDIS_URL", "redis://127.0.0.1:6379/6")
    log("fresh stores; seeding and starting web, worker, beat, ingest and two agents")
    stack = DemoStack.start(tmp, database_url, redis_url, ROLLOUTS_DRAIN_GRACE_S="3600")
    traffic: Traffic | None = None
    monitor: RoutingMonitor | None = None
    try:
        stack.django_setup()
        from django.contrib.auth import get_user_model

        from controlplane.accounts.services import access_token_create
        from controlplane.fleet import services as fleet_services
        from controlplane.fleet.models import Agent
        from controlplane.registry.models import ModelVersion
        from controlplane.rollouts import deployments
        from controlplane.rollouts.models import Deployment, Rollout, RolloutState
        from controlplane.telemetry.models import RequestSample

        monitor = RoutingMonitor(redis_url)
        deployment = Deployment.objects.get(name=DEPLOYMENT)
        baseline_id = deployment.stable_version_id
        candidate = ModelVersion.objects.get(model__name=MODEL, label=CANDIDATE_LABEL)
        credentials = stack.credentials
        oncall = get_user_model().objects.get(username="oncall")
        token = access_token_create(user=oncall, name="rollback-bench").raw_token

        def routed_baseline() -> bool:
            stack.check()
            return monitor.current() == {baseline_id: 100}

        started = time.monotonic()
        _wait(routed_baseline, ready_timeout, "the stable version routed to a ready agent", 0.5)
        log(f"stable version routed after {time.monotonic() - started:.0f} s; traffic starts")
        traffic = Traffic(stack.web_url, credentials["api_keys"]["acme"])

        def start_canary(reason: str) -> Rollout:
            rollout = deployments.rollout_create(
                actor=None, deployment=deployment, candidate=candidate, stages=[STAGE],
                policy=POLICY, reason=reason,
            )  # fmt: skip

            def canary_routed() -> bool:
                stack.check()
                return monitor.current().get(candidate.pk, 0) == STAGE["weight"]

            _wait(canary_routed, ready_timeout, "the candidate routed at 50 %", 0.1)
            return Rollout.objects.get(pk=rollout.pk)

        def finished(rollout: Rollout) -> Rollout:
            return _wait(
                lambda: Rollout.objects.filter(
                    pk=rollout.pk, state__in=[RolloutState.ROLLED_BACK, RolloutState.FAILED]
                ).first(),
                60,
                "the rollout to finish rolling back",
            )

        drill_s: list[float] = []
        reasons: list[str] = []
        for index in range(drills):
            rollout = start_canary(f"rollback bench: drill {index + 1}")
            stage_start = Rollout.objects.get(pk=rollout.pk).stage_started_at
            answered = RequestSample.objects.filter(
                version=candidate, is_error=False, finished_at__gte=stage_start
            )

            def two_answers(answered: Any = answered) -> bool:
                return answered.count() >= 2

            _wait(two_answers, 60, "two canary answers")
            agent = Agent.objects.get(loaded_version=candidate, state="ready")
            onset = time.monotonic()
            fleet_services.agent_command_send(
                actor=None, agent_name=agent.name, kind="faults", latency_ms_per_token=0,
                error_rate=1.0, reason="rollback bench drill",
            )  # fmt: skip
            at = _wait(
                partial(monitor.first_without, candidate.pk, onset), 60, "canary weight 0", 0.01
            )
            drill_s.append(at - onset)
            done = finished(rollout)
            reasons.append(done.state_reason)
            log(
                f"drill {index + 1}: canary weight 0 after {drill_s[-1]:.3f} s"
                f" ({done.state_reason})"
            )
            fleet_services.agent_command_send(
                actor=None, agent_name=agent.name, kind="faults", latency_ms_per_token=0,
                error_rate=0.0, reason="rollback bench drill over",
            )  # fmt: skip

        manual_s: list[float] = []
        api_s: list[float] = []
        with httpx.Client(base_url=stack.web_url, timeout=30) as api:
            for index in range(manual):
                rollout = start_canary(f"rollback bench: manual {index + 1}")
                sent = time.monotonic()
                response = api.post(
                    f"/api/v1/rollouts/{rollout.pk}/rollback/",
                    json={"reason": "rollback bench: manual"},
                    headers={"Authorization": f"Bearer {token}"},
                )
                api_s.append(time.monotonic() - sent)
                if response.status_code != 200:
                    raise RuntimeError(f"rollback answered {response.status_code}: {response.text}")
                at = _wait(
                    partial(monitor.first_without, candidate.pk, sent), 30, "canary gone", 0.01
                )
                manual_s.append(at - sent)
                finished(rollout)
                log(
                    f"manual {index + 1}: routing changed {manual_s[-1] * 1000:.0f} ms"
                    " after the call"
                )
        statuses = traffic.close()
        traffic = None
        return {
            "drill_s": drill_s,
            "drill_reasons": reasons,
            "manual_s": manual_s,
            "manual_api_s": api_s,
            "client_statuses": statuses,
        }
    finally:
        if traffic is not None:
            traffic.close()
        if monitor is not None:
            monitor.stop.set()
        stack.stop()


def figures(result: dict[str, Any]) -> list[dict[str, Any]]:
    drill, manual = result["drill_s"], result["manual_s"]
    return [
        {
            "name": f"rollback drill: fault onset -> canary weight 0, median of {len(drill)}",
            "value": round(_median(drill), 3),
            "unit": "s",
            "reference": "target",
            "reference_value": DRILL_TARGET_S,
            "target": f"value <= {DRILL_TARGET_S}",
        },
        {
            "name": f"manual rollback: API call -> routing changed, median of {len(manual)}",
            "value": round(_median(manual), 3),
            "unit": "s",
            "reference": "target",
            "reference_value": MANUAL_TARGET_S,
            "target": f"value <= {MANUAL_TARGET_S}",
        },
    ]


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    drills, manual = (2, 2) if quick else (5, 5)
    with tempfile.TemporaryDirectory(prefix="rollback-bench-") as tmp:
        result = measure(Path(tmp), drills, manual, ready_timeout=120)
    (out_dir / "rollback.json").write_text(json.dumps(result, indent=2) + "\n")
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(result["client_statuses"].items()))
    return {
        "figures": figures(result),
        "notes": [
            "drills (s): " + ", ".join(f"{v:.3f}" for v in result["drill_s"]),
            "manual (s): "
            + ", ".join(f"{v:.3f}" for v in result["manual_s"])
            + "; API answer (s): "
            + ", ".join(f"{v:.3f}" for v in result["manual_api_s"]),
            f"client statuses during the run: {statuses} (the failed ones are the drills' "
            "injected faults on the canary)",
            "fault onset is when the control plane sent the faults command; the agent's "
            "delivery is inside the figure",
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 drills and 2 manual rollbacks")
    parser.add_argument("--drills", type=int, default=None, help="drills to run (default 5)")
    parser.add_argument("--manual", type=int, default=None, help="manual rollbacks (default 5)")
    parser.add_argument("--ready-timeout", type=float, default=180, help="seconds per wait")
    args = parser.parse_args()
    drills = args.drills if args.drills is not None else (2 if args.quick else 5)
    manual = args.manual if args.manual is not None else (2 if args.quick else 5)
    if drills < 1 or manual < 1:
        parser.error("--drills and --manual must be at least 1")
    with tempfile.TemporaryDirectory(prefix="rollback-bench-") as tmp:
        result = measure(Path(tmp), drills, manual, args.ready_timeout)
    for figure in figures(result):
        print(f"{figure['name']}: {figure['value']} {figure['unit']} ({figure['target']})")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
