"""Rollouts end to end, nothing mocked.

One set of processes serves the whole module: three agents (`python -m agent --threads 1`,
each running the real engine on SmolLM2-135M, or vLLM's CPU build for the vLLM
candidate), a Celery worker and beat on this run's
queue (analysis and reconcile every second), `manage.py ingest`, the gateway
(`uvicorn controlplane.asgi`, which also serves the control plane's REST API to the
agents), PostgreSQL and Redis. Two client threads stream chat completions through the
gateway for the whole module with the openai client. A routing monitor reads
`routing:smol` every 20 ms.

The module commits its rows (the processes must read them) and empties the database
and Redis when it ends. The tests do not depend on each other's order: each rolls out a
candidate against whatever version is stable when it starts.

The analysis policy's latency and energy tolerances are wide: on a shared 2-core machine
the versions' speeds say more about the scheduler than about the precision, and these
tests are about the machinery (stages, evaluation gate, rollback, routing, no failed
request), not about which precision is faster.
"""

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from django.db.models import Sum
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from contracts.routing import parse_routing_table, routing_key
from controlplane.audit.models import AuditEvent
from controlplane.core.roles import Role
from controlplane.fleet.engine_secrets import engine_secrets_payload
from controlplane.fleet.models import Agent, AgentCommand
from controlplane.registry import services as registry_services
from controlplane.registry.models import EvalKind, EvalSuite, Evaluation, Model, SigningKey
from controlplane.rollouts import deployments, replicas, transitions, undo
from controlplane.rollouts.models import ACTIVE_STATES, AnalysisRun, Deployment, Rollout
from controlplane.telemetry.models import RequestSample
from controlplane.tenants.models import UsageRecord
from controlplane.tenants.services import api_key_create, tenant_create
from tests.agent.test_agent_processes import (
    MODEL_FILE,
    _new_private_key,
    agent_args,
    free_port_pair,
    ingest_args,
)
from tests.agent.test_vllm_backend import VLLM_PYTHON, VLLM_READY_S, vllm_version
from tests.api.support import Signer, make_user
from tests.conftest import PYTHON, start_process, stop_process, wait_until
from tests.gateway.conftest import start_gateway

pytestmark = pytest.mark.slow

DEPLOYMENT = "smol"
CONFIG = {
    "max_model_len": 512,
    "kv_block_size": 16,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 512,
}
CHILD_ENV = {
    "ROLLOUTS_ANALYSIS_INTERVAL_S": "1",
    "ROLLOUTS_RECONCILE_INTERVAL_S": "1",
    "ROLLOUTS_DRAIN_GRACE_S": "2",
    "ROLLOUTS_AGENT_FRESH_S": "5",
    "GATEWAY_ROUTING_REFRESH_S": "1",
    "ROLLOUTS_PREVIOUS_STABLE_WARM_S": "3600",  # the tests' stables stay warm to the end
}
CELERY = [PYTHON, "-m", "celery", "-A", "controlplane"]
WIDE_POLICY = {
    "min_samples": 2,
    "window_s": 30.0,
    "latency_tolerance": 20.0,
    "energy_tolerance": 100.0,
    "ttft_p95_max_ms": 60000.0,
    "itl_p95_max_ms": 30000.0,
    "error_rate_max": 0.2,
    "extension_s": 3.0,
    "max_extensions": 20,
}
READY_S = 240
# What the client threads ask, streamed, over and over.
TRAFFIC_REQUEST: dict[str, Any] = {
    "model": DEPLOYMENT,
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 4,
    "temperature": 0,
}
# vLLM's CPU build: the candidate of the engine-changing rollouts; its attention takes KV
# blocks of a multiple of 32 tokens.
VLLM_CONFIG = {**CONFIG, "dtype": "bfloat16", "kv_block_size": 32}
# Eager mode starts in a third of the time (no torch.compile). vLLM 0.32.0's CPU build then
# answers SmolLM2 differently from the compiled model (docs/engines.md), which these tests
# do not read: they judge the machinery on latency and errors, as the analysis does.
VLLM_ROLLOUT_ARGS = {"enforce_eager": True}
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"vLLM's CPU build is not installed at {VLLM_PYTHON.parent.parent} "
    "(make engine-envs builds it)",
)
# vLLM starts in one to three minutes on two busy cores; its rollouts wait that long.
VLLM_ROLLOUT_S = VLLM_READY_S + 120


@dataclass
class Outcome:
    ok: bool
    request_id: str = ""
    status: int = 0
    detail: str = ""
    started: float = 0.0  # time.monotonic() when the client sent it


@dataclass
class Traffic:
    """Client threads streaming through the gateway; every request's outcome, in order."""

    url: str
    key: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=120
        )
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                stream = client.chat.completions.create(**TRAFFIC_REQUEST, stream=True)
                text = "".join(
                    chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
                )
                outcome = Outcome(ok=bool(text), detail="" if text else "empty answer")
            except openai.APIStatusError as exc:
                outcome = Outcome(
                    ok=False,
                    request_id=exc.response.headers.get("x-request-id", ""),
                    status=exc.status_code,
                    detail=str(exc)[:200],
                )
            except openai.APIError as exc:
                outcome = Outcome(ok=False, detail=f"{type(exc).__name__}: {exc}"[:200])
            outcome.started = started
            with self.lock:
                self.outcomes.append(outcome)

    def mark(self) -> int:
        with self.lock:
            return len(self.outcomes)

    def since(self, start: int) -> list[Outcome]:
        with self.lock:
            return list(self.outcomes[start:])


@dataclass
class RoutingMonitor:
    """Every routing table seen: (generation, {version_id: weight}) in order."""

    client: redis.Redis
    seen: list[tuple[int, dict[int, int], dict[int, int]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        last = -1
        while not self.stop.is_set():
            raw = self.client.get(routing_key(DEPLOYMENT))
            if raw:
                table = parse_routing_table(raw)
                if table.generation != last:
                    last = table.generation
                    # Versions that answer (a shadow route only gets copies).
                    answering = [v for v in table.versions if v.role != "shadow"]
                    weights = {v.version_id: v.weight for v in answering}
                    endpoints = {v.version_id: len(v.endpoints) for v in answering}
                    self.seen.append((table.generation, weights, endpoints))
            time.sleep(0.02)

    def mark(self) -> int:
        return len(self.seen)

    def weights_of(self, version_id: int, start: int = 0) -> list[int]:
        """The weights the version had, in order, counting only tables that could route it."""
        return [
            weights[version_id]
            for _, weights, endpoints in self.seen[start:]
            if version_id in weights and endpoints[version_id] > 0
        ]


@dataclass
class Stack:
    tmp: Path
    versions: dict[str, Any]
    deployment: Deployment
    traffic: Traffic
    monitor: RoutingMonitor
    redis: redis.Redis
    on_call: Any
    logs: list[Path]
    release_manager: Any
    agents: dict[str, Any] = field(default_factory=dict)  # name -> its process

    def tail(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text()[-3000:]}" for path in self.logs if path.exists()
        )

    def stable_id(self) -> int:
        return Deployment.objects.get(pk=self.deployment.pk).stable_version_id

    def routed(self) -> dict[int, int]:
        published = self.redis.get(routing_key(DEPLOYMENT))
        assert published is not None
        table = parse_routing_table(published)
        return {v.version_id: v.weight for v in table.versions if v.endpoints}


def _version(model: Model, signer: Signer, label: str, dtype: str, **overrides: int) -> Any:
    config = {**CONFIG, "dtype": dtype, **overrides}
    artifact, _ = registry_services.artifact_store_file(actor=None, path=MODEL_FILE)
    version = registry_services.version_register(
        actor=None, model=model, label=label, artifact_digest=artifact.digest, serving_config=config
    )
    return registry_services.version_verify(
        actor=None,
        version=version,
        key_id=signer.key_id,
        signature=signer.sign(artifact.digest, config),
    )


@pytest.fixture(scope="module")
def stack(committed_db, django_db_blocker, tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("rollouts-e2e")
    store = tmp / "store"
    client = redis.Redis.from_url(settings.REDIS_ADMIN_URL, decode_responses=True)
    client.flushdb()
    processes = []
    threads: list[threading.Thread] = []
    stops: list[threading.Event] = []
    logs: list[Path] = []
    env = {**CHILD_ENV, "ARTIFACT_ROOT": str(store)}
    with django_db_blocker.unblock(), override_settings(ARTIFACT_ROOT=store):
        try:
            on_call = make_user("on-call", Role.ON_CALL)
            release_manager = make_user("release-manager", Role.RELEASE_MANAGER)
            signer = Signer("release-key", _new_private_key())
            SigningKey.objects.create(
                key_id=signer.key_id, public_key=signer.public_key_b64, is_trusted=True
            )
            model = Model.objects.create(name=DEPLOYMENT, task="chat")
            versions = {
                "f32": _version(model, signer, "f32", "float32"),
                "bf16": _version(model, signer, "bf16", "bfloat16"),
                # The drill's candidate: float32 again, with another scheduler limit (the
                # registry's dtypes are float32 and bfloat16).
                "drill": _version(model, signer, "f32-drill", "float32", max_num_seqs=3),
            }

            def start(name: str, args: list[str], **role_env: str) -> None:
                log = tmp / f"{name}.log"
                logs.append(log)
                processes.append(start_process(args, log, **env, **role_env))

            # Ingest runs as its own Redis user, as in production.
            start("ingest", ingest_args(), REDIS_URL=settings.INGEST_REDIS_URL)
            start("worker", [*CELERY, "worker", "--pool", "threads", "--concurrency", "4",
                             "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                             "--without-heartbeat"])  # fmt: skip
            start("beat", [*CELERY, "beat", "--loglevel", "INFO",
                           "--schedule", str(tmp / "beat-schedule")])  # fmt: skip

            class Holder:  # agent_args keeps the agents' state under tmp_path
                tmp_path = tmp
                trusted_keys = {signer.key_id: signer.public_key_b64}

            # The gateway process serves the whole ASGI application: the agents reach the
            # control plane's REST API (registration, artifact downloads) through it too.
            gateway = start_gateway(
                tmp,
                tmp / "spool",
                **{k: v for k, v in env.items() if k != "GATEWAY_ROUTING_REFRESH_S"},
            )
            processes.append(gateway.process)
            logs.append(gateway.log)
            agents = {}
            for name in ("agent-1", "agent-2", "agent-3"):
                args = agent_args(name, free_port_pair(), settings.REDIS_URL, gateway.url, Holder())
                # vLLM takes minutes to start here, and this much memory for its KV cache (GiB).
                args += ["--engine-ready-timeout", str(VLLM_READY_S)]
                start(name, args, VLLM_CPU_KVCACHE_SPACE="1")
                agents[name] = processes[-1]

            deployment = deployments.deployment_create(
                actor=None, name=DEPLOYMENT, stable_version=versions["f32"]
            )
            tenant = tenant_create(
                actor=None,
                slug="e2e",
                name="E2E",
                requests_per_minute=100_000,
                tokens_per_minute=10_000_000,
                allowed_models=[model],
                prompt_logging="off",
            )
            key = api_key_create(actor=None, tenant=tenant, name="e2e").raw_key
            monitor = RoutingMonitor(client=client)
            traffic = Traffic(url=gateway.url, key=key)
            if VLLM_PYTHON.exists():
                versions["vllm"] = vllm_version(model, signer, tmp, VLLM_CONFIG, VLLM_ROLLOUT_ARGS)
            stack = Stack(
                tmp,
                versions,
                deployment,
                traffic,
                monitor,
                client,
                on_call,
                logs,
                release_manager,
                agents,
            )
            wait_until(
                lambda: (
                    stack.routed() == {versions["f32"].pk: 100}
                    if client.get(routing_key(DEPLOYMENT))
                    else False
                ),
                timeout=READY_S,
                interval=0.5,
                message=stack.tail,
            )
            stops += [monitor.stop, traffic.stop]
            threads = [threading.Thread(target=monitor.run, daemon=True)]
            threads += [threading.Thread(target=traffic.run, daemon=True) for _ in range(2)]
            for thread in threads:
                thread.start()
            wait_until(lambda: traffic.mark() >= 4, timeout=60, message=stack.tail)
            yield stack
        finally:
            for stop in stops:
                stop.set()
            for thread in threads:
                thread.join(timeout=150)
            for process in reversed(processes):
                stop_process(process, timeout=30)
            call_command("flush", interactive=False, verbosity=0)
            client.flushdb()
            client.close()


@pytest.fixture(autouse=True)
def no_rollout_left_active(stack, django_db_blocker) -> Iterator[None]:
    """A test that fails midway aborts its rollout, so the next one can start its own."""
    yield
    with django_db_blocker.unblock():
        for rollout in Rollout.objects.filter(deployment=stack.deployment, state__in=ACTIVE_STATES):
            transitions.rollout_abort(actor=None, rollout_id=rollout.pk, reason="e2e: test ended")


def audit_actions(rollout: Rollout) -> list[tuple[str, bool]]:
    events = AuditEvent.objects.filter(object_type="rollout", object_id=str(rollout.pk))
    return [(e.action, e.actor_id is None) for e in events.order_by("id")]


def quality_suite(name: str, *, perplexity_max: float, exact_match_min: float) -> EvalSuite:
    return EvalSuite.objects.create(
        name=name,
        kind=EvalKind.QUALITY,
        dataset="rollouts/datasets",
        metrics=[
            {"name": "perplexity", "threshold": perplexity_max, "higher_is_better": False},
            {"name": "exact_match", "threshold": exact_match_min, "higher_is_better": True},
            {"name": "agreement", "threshold": 0.0, "higher_is_better": True},
        ],
    )


def energy_suite(name: str) -> EvalSuite:
    """Latency and joules per token, thresholds no healthy CPU agent misses: the job's
    energy step (a retried task waiting for the agent's next heartbeat) must complete."""
    return EvalSuite.objects.create(
        name=name,
        kind=EvalKind.ENERGY,
        dataset="rollouts/datasets",
        metrics=[
            {"name": "ttft_p95_ms", "threshold": 60_000.0, "higher_is_better": False},
            {"name": "joules_per_token", "threshold": 1e6, "higher_is_better": False},
        ],
    )


def wait_state(stack: Stack, rollout: Rollout, states: set[str], timeout: float) -> Rollout:
    wait_until(
        lambda: Rollout.objects.get(pk=rollout.pk).state in states,
        timeout=timeout,
        interval=0.2,
        message=stack.tail,
    )
    return Rollout.objects.get(pk=rollout.pk)


def settle(stack: Stack, start: int) -> list[Outcome]:
    """The outcomes since `start`, once every request in flight at the call has finished."""
    target = stack.traffic.mark() + 4
    wait_until(lambda: stack.traffic.mark() >= target, timeout=120, message=stack.tail)
    return stack.traffic.since(start)


def test_a_healthy_candidate_is_promoted_through_every_stage(stack, django_db_blocker) -> None:
    with django_db_blocker.unblock():
        baseline_id = stack.stable_id()
        candidate = stack.versions["bf16"]
        suite = quality_suite("quality-smoke", perplexity_max=1000.0, exact_match_min=0.5)
        energy = energy_suite("energy-smoke")
        traffic_start = stack.traffic.mark()
        rollout = deployments.rollout_create(
            actor=None,
            deployment=stack.deployment,
            candidate=candidate,
            stages=[
                # Half the requests copied to the candidate; the stable version answers all.
                {"weight": 50, "min_duration_s": 2, "min_requests": 2, "shadow": True},
                {"weight": 25, "min_duration_s": 2, "min_requests": 2},
                {"weight": 50, "min_duration_s": 2, "min_requests": 2},
                {"weight": 100, "min_duration_s": 2, "min_requests": 2},
            ],
            policy=WIDE_POLICY,
            required_suites=[suite, energy],
            reason="e2e: healthy candidate",
        )
        rollout = wait_state(stack, rollout, {"promoted", "rolled_back", "failed"}, 240)
        assert rollout.state == "promoted", rollout.state_reason

        # The evaluation ran as a Celery job against the candidate's agent and passed.
        evaluation = Evaluation.objects.get(version=candidate, suite=suite)
        assert evaluation.passed is True
        assert evaluation.baseline_version_id == baseline_id
        assert sorted(evaluation.metrics) == ["agreement", "exact_match", "perplexity"]
        assert evaluation.metrics["exact_match"] >= 0.5
        energy_evaluation = Evaluation.objects.get(version=candidate, suite=energy)
        assert energy_evaluation.passed is True
        assert energy_evaluation.metrics["joules_per_token"] > 0

        # Every stage ended with an advancing analysis run, in order.
        advancing = AnalysisRun.objects.filter(rollout=rollout, action="advance")
        assert sorted(advancing.values_list("stage_index", flat=True)) == [0, 1, 2, 3]
        # (Extensions depend on how many requests a stage got in time: left out. The gate is
        # blocked once per change of its reasons: one or two suites still due.)
        actions = [a for a, _ in audit_actions(rollout) if a != "rollout.extend"]
        blocked = slice(actions.index("rollout.gate_blocked"), actions.index("rollout.stage_start"))
        assert actions[blocked] in (["rollout.gate_blocked"], ["rollout.gate_blocked"] * 2)
        actions[blocked] = ["rollout.gate_blocked"]
        assert actions == [
            "rollout.create",
            "rollout.start_gating",
            "rollout.gate_blocked",  # until both evaluation jobs have passed
            "rollout.stage_start",
            "rollout.stage_start",
            "rollout.stage_start",
            "rollout.stage_start",
            "rollout.promote",
        ]
        assert Deployment.objects.get(pk=stack.deployment.pk).stable_version_id == candidate.pk

        # The routing table walked 25 -> 50 -> 100 and the candidate now takes everything.
        wait_until(lambda: stack.routed() == {candidate.pk: 100}, timeout=30)
        weights = [w for w, _ in itertools.groupby(stack.monitor.weights_of(candidate.pk))]
        assert weights[:3] == [25, 50, 100]
        assert set(weights) == {25, 50, 100}

        # (d) No client request failed during the promotion.
        outcomes = settle(stack, traffic_start)
        assert [o for o in outcomes if not o.ok] == []
        assert RequestSample.objects.filter(version=candidate).exists()

        # The shadow stage: the candidate got copies and answered no client; the copies
        # were judged (its analysis run counted them) and billed to nobody.
        stage_starts = AuditEvent.objects.filter(
            object_type="rollout", object_id=str(rollout.pk), action="rollout.stage_start"
        ).order_by("id")
        shadow_end = stage_starts[1].created_at
        candidate_samples = RequestSample.objects.filter(version=candidate)
        assert candidate_samples.filter(is_shadow=True, finished_at__lt=shadow_end).count() >= 2
        assert not candidate_samples.filter(is_shadow=False, finished_at__lt=shadow_end).exists()
        # (a copy sent just before the stage changed may finish a moment after)
        copies_after = candidate_samples.filter(
            is_shadow=True, finished_at__gt=shadow_end + timedelta(seconds=10)
        )
        assert not copies_after.exists()

        def billed_requests() -> tuple[int, int]:
            billed = UsageRecord.objects.aggregate(total=Sum("requests"))["total"] or 0
            return billed, RequestSample.objects.filter(is_shadow=False).count()

        wait_until(
            lambda: billed_requests()[0] == billed_requests()[1],
            timeout=30,
            message=lambda: f"billed, client requests: {billed_requests()}",
        )


def faulty_canary_rolled_back(
    stack: Stack, candidate: Any, *, ready_s: float, before_drill: Any = None
) -> None:
    """A canary at 50 % whose agent then fails every request (the `faults` drill): the
    analysis rolls it back by itself, the stable version takes everything again, and the
    only failed client requests are those the fault failed on the canary."""
    baseline_id = stack.stable_id()
    traffic_start = stack.traffic.mark()
    rollout = deployments.rollout_create(
        actor=None,
        deployment=stack.deployment,
        candidate=candidate,
        stages=[
            {"weight": 50, "min_duration_s": 600, "min_requests": 2},
            {"weight": 100, "min_duration_s": 2, "min_requests": 2},
        ],
        policy={**WIDE_POLICY, "hard_breach_window": 4, "hard_error_rate_max": 0.5},
        reason=f"e2e: faulty candidate {candidate}",
    )
    wait_until(
        lambda: stack.routed() == {baseline_id: 50, candidate.pk: 50},
        timeout=ready_s,
        interval=0.2,
        message=stack.tail,
    )
    wait_until(
        lambda: RequestSample.objects.filter(version=candidate, is_error=False).count() >= 2,
        timeout=120,
        message=stack.tail,
    )
    agent = Agent.objects.get(loaded_version=candidate, state="ready")
    if before_drill is not None:
        before_drill(agent, traffic_start)
    api = APIClient()
    api.force_login(stack.on_call)
    response = api.post(
        f"/api/v1/fleet/agents/{agent.name}/commands/",
        {"kind": "faults", "latency_ms_per_token": 0, "error_rate": 1.0, "reason": "drill"},
        format="json",
    )
    assert response.status_code == 202, response.content

    rollout = wait_state(stack, rollout, {"rolled_back", "promoted", "failed"}, 120)
    assert rollout.state == "rolled_back", rollout.state_reason
    assert audit_actions(rollout)[-1] == ("rollout.rollback", True)  # nobody pressed it
    assert rollout.state_reason.startswith(("hard breach", "analysis")), rollout.state_reason
    wait_until(lambda: stack.routed() == {baseline_id: 100}, timeout=30)
    assert Deployment.objects.get(pk=stack.deployment.pk).stable_version_id == baseline_id

    # (d) The only failed requests are the ones the fault failed on the canary.
    failed = [o for o in settle(stack, traffic_start) if not o.ok]
    ids = [o.request_id for o in failed]
    wait_until(
        lambda: RequestSample.objects.filter(request_id__in=ids).count() == len(failed),
        timeout=30,
        message=repr(failed),
    )
    samples = RequestSample.objects.filter(request_id__in=ids)
    assert {(s.version_id, s.error_code) for s in samples} == {(candidate.pk, "injected_fault")}
    assert len(failed) >= 1
    # Reset the drill on that agent (it is drained once nothing routes to it).
    api.post(
        f"/api/v1/fleet/agents/{agent.name}/commands/",
        {"kind": "faults", "latency_ms_per_token": 0, "error_rate": 0.0, "reason": "reset"},
        format="json",
    )


def test_b_a_faulty_candidate_is_rolled_back_automatically(stack, django_db_blocker) -> None:
    with django_db_blocker.unblock():
        faulty_canary_rolled_back(stack, stack.versions["drill"], ready_s=READY_S)


def test_c_a_candidate_failing_evaluation_never_receives_traffic(stack, django_db_blocker) -> None:
    with django_db_blocker.unblock():
        stable_id = stack.stable_id()
        candidate = next(v for v in stack.versions.values() if v.pk != stable_id)
        samples_before = RequestSample.objects.filter(version=candidate).count()
        traffic_start, routing_start = stack.traffic.mark(), stack.monitor.mark()
        # Exact match of 1.01 cannot be reached: the suite fails whatever the answers.
        suite = quality_suite("quality-unreachable", perplexity_max=1000.0, exact_match_min=1.01)
        rollout = deployments.rollout_create(
            actor=None,
            deployment=stack.deployment,
            candidate=candidate,
            stages=[{"weight": 100, "min_duration_s": 2, "min_requests": 2}],
            policy=WIDE_POLICY,
            required_suites=[suite],
            reason="e2e: candidate failing evaluation",
        )
        wait_until(
            lambda: Evaluation.objects.filter(version=candidate, suite=suite).exists(),
            timeout=READY_S,
            interval=0.2,
            message=stack.tail,
        )
        evaluation = Evaluation.objects.get(version=candidate, suite=suite)
        assert evaluation.passed is False
        reasons = [
            f"quality-unreachable: failed (evaluation {evaluation.pk}: {evaluation.metrics})"
        ]
        # The next gate pass names the failure ...
        wait_until(
            lambda: Rollout.objects.get(pk=rollout.pk).gate_reasons == reasons,
            timeout=60,
            interval=0.2,
            message=stack.tail,
        )
        # ... and a few more analysis ticks later the gate still holds.
        time.sleep(3)
        rollout = Rollout.objects.get(pk=rollout.pk)
        assert rollout.state == "gating"
        assert rollout.gate_reasons == reasons
        transitions.rollout_abort(actor=None, rollout_id=rollout.pk, reason="e2e: done")
        wait_until(lambda: stack.routed() == {stable_id: 100}, timeout=30)

        # Never weighted in any routing table, never a request sample.
        assert stack.monitor.weights_of(candidate.pk, routing_start) == []
        assert all(
            candidate.pk not in weights for _, weights, _ in stack.monitor.seen[routing_start:]
        )
        outcomes = settle(stack, traffic_start)
        assert RequestSample.objects.filter(version=candidate).count() == samples_before
        assert [o for o in outcomes if not o.ok] == []


def test_d_revoking_the_candidate_mid_rollout_stops_serving_it(stack, django_db_blocker) -> None:
    with django_db_blocker.unblock():
        stable_id = stack.stable_id()
        candidate = stack.versions["drill"]
        rollout = deployments.rollout_create(
            actor=None,
            deployment=stack.deployment,
            candidate=candidate,
            stages=[{"weight": 50, "min_duration_s": 600, "min_requests": 2}],
            policy=WIDE_POLICY,
            reason="e2e: candidate revoked mid-rollout",
        )
        wait_until(
            lambda: stack.routed() == {stable_id: 50, candidate.pk: 50},
            timeout=READY_S,
            interval=0.2,
            message=stack.tail,
        )
        served_before = RequestSample.objects.filter(version=candidate).count()
        wait_until(
            lambda: RequestSample.objects.filter(version=candidate).count() >= served_before + 2,
            timeout=60,
            message=stack.tail,
        )
        traffic_start = stack.traffic.mark()
        agent = Agent.objects.get(loaded_version=candidate, state="ready")
        api = APIClient()
        api.force_login(stack.release_manager)
        response = api.post(
            f"/api/v1/versions/{candidate.pk}/revoke/", {"reason": "e2e: leaked"}, format="json"
        )
        assert response.status_code == 200, response.content

        # Ended by the system with the reason, within a reconcile interval or an analysis tick.
        rollout = wait_state(stack, rollout, {"rolled_back"}, 30)
        assert rollout.state_reason == f"the candidate {candidate} was revoked: e2e: leaked"
        assert audit_actions(rollout)[-1] == ("rollout.rollback", True)
        wait_until(lambda: stack.routed() == {stable_id: 100}, timeout=30)
        # Its agent is drained, and nothing loads it again.
        wait_until(
            lambda: Agent.objects.get(pk=agent.pk).loaded_version_id != candidate.pk,
            timeout=60,
            message=stack.tail,
        )
        drained_at = timezone.now()
        outcomes = settle(stack, traffic_start)
        # Revocation fails no request: the stable version takes the canary's share.
        assert [o for o in outcomes if not o.ok] == []
        # Once ingest has caught up past the drain, no request there was the candidate's.
        wait_until(
            lambda: RequestSample.objects.filter(finished_at__gt=drained_at).count() >= 4,
            timeout=30,
            message=stack.tail,
        )
        assert not RequestSample.objects.filter(
            version=candidate, finished_at__gt=drained_at
        ).exists()


def test_e_undo_puts_the_previous_stable_back_within_seconds(stack, django_db_blocker) -> None:
    with django_db_blocker.unblock():
        previous_id = undo.undo_target(Deployment.objects.get(pk=stack.deployment.pk))
        if previous_id is None:  # run alone: promote a candidate first
            previous_id = stack.stable_id()
            candidate = next(
                v for k, v in stack.versions.items() if k != "drill" and v.pk != previous_id
            )
            rollout = deployments.rollout_create(
                actor=None,
                deployment=stack.deployment,
                candidate=candidate,
                stages=[{"weight": 100, "min_duration_s": 600, "min_requests": 1}],
                policy=WIDE_POLICY,
                reason="e2e: promoted to be undone",
            )
            wait_until(
                lambda: stack.routed() == {candidate.pk: 100},
                timeout=READY_S,
                interval=0.2,
                message=stack.tail,
            )
            transitions.rollout_advance(
                actor=None, rollout_id=rollout.pk, reason="e2e: promoted to be undone", full=True
            )
        demoted_id = stack.stable_id()
        # The previous stable version is warm: an agent serves it, unrouted.
        wait_until(
            lambda: undo.is_warm(previous_id), timeout=READY_S, interval=0.2, message=stack.tail
        )
        assert stack.routed() == {demoted_id: 100}
        traffic_start, called_at = stack.traffic.mark(), timezone.now()
        api = APIClient()
        api.force_login(stack.on_call)
        called = time.monotonic()
        response = api.post(
            f"/api/v1/deployments/{DEPLOYMENT}/undo/", {"reason": "e2e: undo"}, format="json"
        )
        assert response.status_code == 200, response.content
        assert response.json()["switch"] == "immediate"
        # The requirement under test: the previous stable takes every request within 3 s.
        wait_until(
            lambda: stack.routed() == {previous_id: 100},
            timeout=max(3 - (time.monotonic() - called), 0.01),
            interval=0.05,
            message=stack.tail,
        )
        wait_until(
            lambda: RequestSample.objects.filter(
                version_id=previous_id, finished_at__gt=called_at
            ).exists(),
            timeout=30,
            message=stack.tail,
        )
        assert [o for o in settle(stack, traffic_start) if not o.ok] == []


def stable_endpoints(stack: Stack) -> tuple[str, ...]:
    published = stack.redis.get(routing_key(DEPLOYMENT))
    assert published is not None
    table = parse_routing_table(published)
    stable_id = stack.stable_id()
    return next((v.endpoints for v in table.versions if v.version_id == stable_id), ())


def kill_host(agent_process: Any, endpoint: str) -> None:
    """A lost host: the agent and its engine (found by its port) killed at once."""
    port = endpoint.rsplit(":", 1)[1].encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in args and args[args.index(b"--port") + 1 : args.index(b"--port") + 2] == [
            port
        ]:
            os.kill(int(proc.name), signal.SIGKILL)
    os.killpg(agent_process.pid, signal.SIGKILL)
    agent_process.wait(timeout=10)


def test_h_two_stable_replicas_share_the_traffic_and_a_lost_one_is_replaced(
    stack, django_db_blocker
) -> None:
    with django_db_blocker.unblock():
        stable_id = stack.stable_id()
        deployment = Deployment.objects.get(pk=stack.deployment.pk)
        replicas.deployment_replicas_set(
            actor=stack.release_manager,
            deployment=deployment,
            stable_min=2,
            stable_max=2,
            reason="e2e: two replicas",
        )
        try:
            wait_until(
                lambda: len(stable_endpoints(stack)) == 2,
                timeout=READY_S,
                interval=0.2,
                message=stack.tail,
            )
            both = set(stable_endpoints(stack))
            since = timezone.now()

            def served_by() -> set[str]:
                rows = RequestSample.objects.filter(
                    version_id=stable_id, finished_at__gt=since, is_error=False
                )
                return set(rows.values_list("agent", flat=True))

            wait_until(lambda: served_by() == both, timeout=60, message=stack.tail)

            victim = Agent.objects.get(endpoint=sorted(both)[0])
            traffic_start = stack.traffic.mark()
            killed_wall = timezone.now()
            kill_host(stack.agents[victim.name], victim.endpoint)
            # after the kill, not before: scanning /proc for the engine takes a moment, and
            # a request sent meanwhile may still reach the engine and break with it
            killed = time.monotonic()

            def replacement_sent() -> bool:
                loads = AgentCommand.objects.filter(
                    kind="load", version_id=stable_id, created_at__gt=killed_wall
                )
                return loads.exclude(agent=victim).exists()

            # The load goes to a spare agent within seconds: the agent is seen lost after
            # ROLLOUTS_AGENT_FRESH_S (5 s) and the reconciler runs every second.
            wait_until(replacement_sent, timeout=15, interval=0.2, message=stack.tail)
            wait_until(
                lambda: (
                    len(stable_endpoints(stack)) == 2
                    and victim.endpoint not in stable_endpoints(stack)
                ),
                timeout=READY_S,
                interval=0.2,
                message=stack.tail,
            )
            outcomes = settle(stack, traffic_start)
            # Only a request already under way on the lost host may fail with it.
            late = [o for o in outcomes if not o.ok and o.started >= killed]
            assert late == [], late
        finally:
            replicas.deployment_replicas_set(
                actor=stack.release_manager,
                deployment=Deployment.objects.get(pk=stack.deployment.pk),
                stable_min=1,
                stable_max=1,
                reason="e2e: back to one replica",
            )


def engine_usage(agent: Agent, version: Any) -> dict[str, int]:
    """The usage the engine on `agent` reports itself for the traffic's request, asked
    directly (not streamed) with the serving secret of its load."""
    load = AgentCommand.objects.filter(agent=agent, kind="load", version=version).latest("id")
    secret = engine_secrets_payload(agent_name=agent.name, command_id=load.command_id)
    answer = httpx.post(
        f"{agent.endpoint}/v1/chat/completions",
        json=TRAFFIC_REQUEST,
        headers={"Authorization": f"Bearer {secret['serving_secret']}"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def assert_usage_is_the_engines(version: Any, expected: dict[str, int]) -> None:
    """Every request the gateway metered for `version` counts what the engine counts (the
    traffic's requests are all the same, greedy), not the gateway's estimate."""
    samples = RequestSample.objects.filter(version=version, is_error=False)
    counted = set(samples.values_list("prompt_tokens", "completion_tokens"))
    assert counted == {(expected["prompt_tokens"], expected["completion_tokens"])}, json.dumps(
        sorted(counted)
    )


@needs_vllm
@pytest.mark.timeout(VLLM_ROLLOUT_S + 300)
def test_f_a_faulty_vllm_canary_is_rolled_back(stack, django_db_blocker) -> None:
    """Stable on our engine, canary on vLLM: the canary's fault (injected through the
    middleware the agent gives vLLM) rolls it back, as it would on our engine."""
    candidate = stack.versions["vllm"]

    def metered_exactly(agent: Agent, traffic_start: int) -> None:
        # The tenant's streamed chats through vLLM are metered with vLLM's own counts.
        assert_usage_is_the_engines(candidate, engine_usage(agent, candidate))
        assert [o for o in stack.traffic.since(traffic_start) if not o.ok] == []

    with django_db_blocker.unblock():
        faulty_canary_rolled_back(
            stack, candidate, ready_s=VLLM_ROLLOUT_S, before_drill=metered_exactly
        )


@needs_vllm
@pytest.mark.timeout(VLLM_ROLLOUT_S + 300)
def test_g_a_rollout_moves_the_deployment_from_our_engine_to_vllm(stack, django_db_blocker) -> None:
    """An ordinary rollout whose candidate runs on another engine: it walks its stages
    under traffic, judged on the same signals, and no client request fails."""
    with django_db_blocker.unblock():
        candidate = stack.versions["vllm"]
        traffic_start, routing_start = stack.traffic.mark(), stack.monitor.mark()
        rollout = deployments.rollout_create(
            actor=None,
            deployment=stack.deployment,
            candidate=candidate,
            stages=[
                {"weight": 25, "min_duration_s": 2, "min_requests": 2},
                {"weight": 50, "min_duration_s": 2, "min_requests": 2},
                {"weight": 100, "min_duration_s": 2, "min_requests": 2},
            ],
            policy=WIDE_POLICY,
            reason="e2e: our engine to vLLM",
        )
        rollout = wait_state(stack, rollout, {"promoted", "rolled_back", "failed"}, VLLM_ROLLOUT_S)
        assert rollout.state == "promoted", rollout.state_reason
        advancing = AnalysisRun.objects.filter(rollout=rollout, action="advance")
        assert sorted(advancing.values_list("stage_index", flat=True)) == [0, 1, 2]
        wait_until(lambda: stack.routed() == {candidate.pk: 100}, timeout=30)
        routed_weights = stack.monitor.weights_of(candidate.pk, routing_start)
        weights = [w for w, _ in itertools.groupby(routed_weights)]
        assert weights[:3] == [25, 50, 100]
        assert Deployment.objects.get(pk=stack.deployment.pk).stable_version_id == candidate.pk

        outcomes = settle(stack, traffic_start)
        assert [o for o in outcomes if not o.ok] == []
        agent = Agent.objects.get(loaded_version=candidate, state="ready")
        assert_usage_is_the_engines(candidate, engine_usage(agent, candidate))
