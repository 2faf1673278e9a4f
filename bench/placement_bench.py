"""Placement and reconcile time: one full reconcile pass over every deployment of a fleet.

    python -m bench.placement_bench [--agents 1000] [--hosts 250] [--deployments 100]
        [--rollouts 20] [--steady-passes 5] [--profile]
    python -m bench --only placement_bench     # the report step: run(out_dir, quick)

The step has its own stores: the PostgreSQL database `cp_bench_placement` (created afresh,
migrated, dropped at the end) and Redis db 9 (emptied before and after). It builds a
synthetic fleet in the database: agents spread over hosts, each with its own GPU (80 GiB,
offering 80 or 40 GiB), one model per deployment with two signed versions whose footprints
run from 6 to 30 GiB, and the deployments, made by the real services
(`deployment_create`, `deployment_replicas_set` with 2 to 4 stable replicas, and for some a
rollout through `rollout_create` and `rollout_gate_check`, its canary on 1 or 2 replicas).
Bulk inserts make only the rows those services read (models, versions, agents).

What is measured is the real reconciler in this process, against the local stores: a full
pass is `reconcile_deployments` over every deployment, as `rollouts.reconcile_all` runs it
(the fleet read once for the pass):

1. the first pass, when every replica must be placed: the loads it sends are counted and
   every replica asked for must have a load or a reason it is unplaced;
2. the steady state: the loads are then made to have succeeded as ingest would record them
   (each agent ready with its version, seen now, its load succeeded an hour ago, its
   endpoint proven for that load as after a successful identity challenge), and several
   full passes are timed (the median reported); they must send nothing and route every
   replica;
3. placement alone: `Placement.choose` for every replica on the idle fleet;
4. for comparison, one steady-state pass of `reconcile_deployment` for each deployment
   alone (as the task sent after a change runs it, reading the fleet itself).

Each pass reports its wall time, per deployment, its CPU time in this process (steadier
than wall time on a busy machine) and the SQL statements it ran. Agents'
freshness (ROLLOUTS_AGENT_FRESH_S) is set to 600 s here: no heartbeats arrive, `last_seen`
is set once before each pass, and a slow pass must not see its agents go stale midway.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import gc
import hashlib
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.stack import fresh_stores

BUDGET_S = 120
QUICK_BUDGET_S = 90
REPO_ROOT = Path(__file__).resolve().parent.parent
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/cp_bench_placement"
REDIS_URL = "redis://127.0.0.1:6379/9"  # no other step uses db 9
TARGET_PASS_S = 1.0
GIB = 2**30
GPU_MEMORY_GIB = 80
SERVING_CONFIG = {"dtype": "bfloat16", "max_model_len": 4096, "kv_block_size": 16}


@dataclass
class Options:
    agents: int = 1000
    hosts: int = 250
    deployments: int = 100
    rollouts: int = 20
    steady_passes: int = 5
    profile: bool = False


QUICK = Options(steady_passes=3)  # the target is for this fleet: only fewer passes


def environment(database_url: str, redis_url: str) -> dict[str, str]:
    return {
        "DEBUG": "0",  # as in production: DEBUG would record every statement
        "SECRET_KEY": "bench-placement-not-a-secret",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "CHANNELS_PREFIX": "bench-placement",
        "CELERY_QUEUE": "bench-placement",  # the services' after-commit tasks: never consumed
        "LOG_LEVEL": "ERROR",
        "LOG_FORMAT": "text",
        "ROLLOUTS_AGENT_FRESH_S": "600",
    }


def drop_database(database_url: str) -> None:
    import psycopg

    base, name = database_url.rsplit("/", 1)
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- the fleet ------------------------------------------------------------------------------


def footprint(total_gib: int) -> dict[str, Any]:
    """A stored footprint of `total_gib`: weights 1/4, KV 2/3, headroom the rest."""
    total = total_gib * GIB
    weights, kv = total // 4, total * 2 // 3
    return {
        "weight_bytes": weights,
        "kv_bytes": kv,
        "headroom_bytes": total - weights - kv,
        "total_bytes": total,
        "parameters": weights // 2,
        "bytes_per_parameter": 2.0,
        "kv_bytes_per_token": 23_040,
        "kv_tokens": kv // 23_040,
        "kv_basis": "max_model_len x max_num_seqs",
    }


@dataclass
class Fleet:
    deployment_ids: list[int]
    replicas: dict[int, dict[int, int]]  # deployment id -> {version id: replicas asked}
    rollouts: int


def build_fleet(options: Options, log: Callable[[str], None]) -> Fleet:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from django.utils import timezone

    from contracts.signing import signed_message
    from controlplane.fleet.models import Agent, AgentState
    from controlplane.registry.models import (
        Artifact,
        Model,
        ModelVersion,
        SigningKey,
        VersionStatus,
    )
    from controlplane.rollouts import deployments, replicas, transitions

    started = time.monotonic()
    now = timezone.now()
    per_host = max(options.agents // options.hosts, 1)
    Agent.objects.bulk_create(
        [
            Agent(
                name=f"agent-{index:05d}",
                host=f"host-{index // per_host:04d}",
                endpoint=(
                    endpoint := f"http://host-{index // per_host:04d}:{9100 + index % per_host}"
                ),
                endpoints=[endpoint],
                state=AgentState.IDLE,
                last_seen=now,
                registered_at=now,
                inventory={
                    "kind": "gpu",
                    "accelerator": "NVIDIA H100",
                    "gpu_uuid": f"GPU-{index:05d}",
                    "memory_total_bytes": GPU_MEMORY_GIB * GIB,
                    "memory_available_bytes": GPU_MEMORY_GIB * GIB,
                    # One agent in four is capped at half its GPU.
                    "memory_offered_bytes": (GPU_MEMORY_GIB // (2 if index % 4 == 3 else 1)) * GIB,
                },
            )
            for index in range(options.agents)
        ],
        batch_size=1000,
    )
    private_key = Ed25519PrivateKey.generate()
    public_key = private_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    signing_key = SigningKey.objects.create(
        key_id="bench-release-key",
        public_key=base64.b64encode(public_key).decode(),
        is_trusted=True,
    )
    models = Model.objects.bulk_create(
        [Model(name=f"model-{index:04d}", task="chat") for index in range(options.deployments)]
    )
    artifacts = Artifact.objects.bulk_create(
        [
            Artifact(
                digest=hashlib.sha256(f"{model.name}/{label}".encode()).hexdigest(),
                format="gguf",
                size_bytes=GIB,
            )
            for model in models
            for label in ("v1", "v2")
        ]
    )
    versions = ModelVersion.objects.bulk_create(
        [
            ModelVersion(
                model=models[index // 2],
                label=("v1", "v2")[index % 2],
                artifact=artifact,
                serving_config=SERVING_CONFIG,
                status=VersionStatus.VERIFIED,
                signature=base64.b64encode(
                    private_key.sign(
                        signed_message(digest=artifact.digest, serving_config=SERVING_CONFIG)
                    )
                ).decode(),
                signing_key=signing_key,
                footprint=footprint(6 + 6 * ((index // 2) % 5)),
            )
            for index, artifact in enumerate(artifacts)
        ]
    )
    log(
        f"{options.agents} agents on {options.hosts} hosts, {len(models)} models with "
        f"{len(versions)} signed versions ({time.monotonic() - started:.1f} s)"
    )

    started = time.monotonic()
    every = max(options.deployments // max(options.rollouts, 1), 1)
    fleet = Fleet(deployment_ids=[], replicas={}, rollouts=0)
    for index in range(options.deployments):
        stable, candidate = versions[2 * index], versions[2 * index + 1]
        deployment = deployments.deployment_create(
            actor=None, name=f"deployment-{index:04d}", stable_version=stable, reason="bench"
        )
        count = 2 + index % 3
        replicas.deployment_replicas_set(
            actor=None, deployment=deployment, stable_min=count, stable_max=count, reason="bench"
        )
        asked = {stable.pk: count}
        if index % every == 0 and fleet.rollouts < options.rollouts:
            canary = 1 + fleet.rollouts % 2
            rollout = deployments.rollout_create(
                actor=None,
                deployment=deployment,
                candidate=candidate,
                reason="bench",
                canary_replicas_min=canary,
                canary_replicas_max=2,
            )
            transitions.rollout_gate_check(rollout_id=rollout.pk)
            asked[candidate.pk] = canary
            fleet.rollouts += 1
        fleet.deployment_ids.append(deployment.pk)
        fleet.replicas[deployment.pk] = asked
    log(
        f"{options.deployments} deployments ({fleet.rollouts} with a running rollout), "
        f"{sum(sum(asked.values()) for asked in fleet.replicas.values())} replicas asked for "
        f"({time.monotonic() - started:.1f} s)"
    )
    return fleet


def agents_seen_now() -> None:
    from django.utils import timezone

    from controlplane.fleet.models import Agent

    Agent.objects.update(last_seen=timezone.now())


def loads_succeed() -> int:
    """Record every load sent as done, as ingest would from the agents' heartbeats and
    results: the agent ready with the version, the load succeeded an hour ago, and its
    endpoint proven for that load (as after a successful identity challenge)."""
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.fleet.models import Agent, AgentCommand, AgentState, CommandStatus

    long_ago = timezone.now() - timedelta(hours=1)
    commands = list(
        AgentCommand.objects.filter(kind="load", status=CommandStatus.PENDING).values_list(
            "agent_id", "version_id", "command_id"
        )
    )
    agents = Agent.objects.in_bulk([agent_id for agent_id, _, _ in commands])
    for agent_id, version_id, command_id in commands:
        agent = agents[agent_id]
        agent.state = AgentState.READY
        agent.loaded_version_id = version_id
        agent.verified_endpoint = agent.endpoint
        agent.verified_load_command_id = command_id
    Agent.objects.bulk_update(
        agents.values(),
        ["state", "loaded_version", "verified_endpoint", "verified_load_command_id"],
        batch_size=500,
    )
    AgentCommand.objects.filter(kind="load", status=CommandStatus.PENDING).update(
        status=CommandStatus.SUCCEEDED, created_at=long_ago, finished_at=long_ago
    )
    return len(commands)


# -- measuring ------------------------------------------------------------------------------


@dataclass
class PassResult:
    seconds: float
    queries: int
    cpu_seconds: float  # this process's: less shaken than wall time by a busy machine
    reports: list[Any] = field(repr=False)

    @property
    def loads(self) -> int:
        return sum(len(report.loads) for report in self.reports)

    @property
    def drains(self) -> int:
        return sum(len(report.drains) for report in self.reports)


@contextmanager
def counting_queries() -> Iterator[list[int]]:
    """Count the SQL statements this process runs (without keeping them)."""
    from django.db import connection

    counter = [0]

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        counter[0] += 1
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        yield counter


def full_pass(
    deployment_ids: list[int],
    client: Any,
    profiler: cProfile.Profile | None = None,
    *,
    is_shared: bool = True,
) -> PassResult:
    """Every deployment reconciled, one after another, timed: as `rollouts.reconcile_all`
    does (`reconcile_deployments`, the fleet read once), or, not `is_shared`, each by
    `reconcile_deployment` alone (as the task after a change runs it)."""
    from controlplane.rollouts.reconciler import reconcile_deployment, reconcile_deployments

    agents_seen_now()
    # The garbage of the bench's own steps (building the fleet, placement alone) is
    # collected first: otherwise its collection lands in the timed pass (about 0.15 s).
    gc.collect()
    with counting_queries() as queries:
        if profiler is not None:
            profiler.enable()
        started, cpu_started = time.perf_counter(), time.process_time()
        if is_shared:
            reports = reconcile_deployments(deployment_ids=deployment_ids, client=client)
        else:
            reports = [
                reconcile_deployment(deployment_id=deployment_id, client=client)
                for deployment_id in deployment_ids
            ]
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        if profiler is not None:
            profiler.disable()
    return PassResult(seconds=seconds, queries=queries[0], cpu_seconds=cpu_seconds, reports=reports)


def placement_alone(fleet: Fleet) -> tuple[float, int, int]:
    """Placement.choose for every replica asked for, on the idle fleet as the first pass
    saw it: (seconds, placed, unplaced)."""
    from controlplane.fleet.models import Agent, AgentState
    from controlplane.registry.models import ModelVersion
    from controlplane.rollouts.placement import Placement

    alive = [agent for agent in Agent.objects.all() if agent.state != AgentState.LOST]
    asked = [
        (version_id, count)
        for replicas in fleet.replicas.values()
        for version_id, count in replicas.items()
    ]
    footprints = dict(
        ModelVersion.objects.filter(pk__in=[v for v, _ in asked]).values_list("pk", "footprint")
    )
    started = time.perf_counter()
    placement = Placement(agents=alive, footprints=footprints, engines={})
    spare = list(alive)
    placed = unplaced = 0
    for version_id, count in asked:
        for _ in range(count):
            agent, _why = placement.choose(version_id, spare)
            if agent is None:
                unplaced += 1
                continue
            spare.remove(agent)
            placed += 1
    return time.perf_counter() - started, placed, unplaced


def unaccounted_replicas(fleet: Fleet, first: PassResult) -> list[str]:
    """Replicas the first pass neither loaded nor gave a reason for."""
    missing = []
    for deployment_id, report in zip(fleet.deployment_ids, first.reports, strict=True):
        for version_id, count in fleet.replicas[deployment_id].items():
            sent = sum(1 for _, loaded in report.loads if loaded == version_id)
            explained = any(f"version {version_id} " in why for why in report.unplaced)
            if sent < count and not explained:
                missing.append(f"{report.deployment}: version {version_id} {sent} of {count}")
    return missing


def misrouted(fleet: Fleet, steady: PassResult) -> list[str]:
    """Deployments whose routing table does not list every replica asked for."""
    wrong = []
    for deployment_id, report in zip(fleet.deployment_ids, steady.reports, strict=True):
        routed = {version_id: len(endpoints) for version_id, endpoints in report.endpoints.items()}
        if routed != fleet.replicas[deployment_id]:
            wrong.append(
                f"{report.deployment}: routed {routed}, asked {fleet.replicas[deployment_id]}"
            )
    return wrong


def profile_text(profiler: cProfile.Profile, lines: int = 25) -> str:
    import io

    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("cumulative").print_stats(lines)
    stats.sort_stats("tottime").print_stats(lines)
    return stream.getvalue()


def measure(options: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    database_url = os.environ.get("BENCH_PLACEMENT_DATABASE_URL", DATABASE_URL)
    redis_url = os.environ.get("BENCH_PLACEMENT_REDIS_URL", REDIS_URL)
    os.environ.update(environment(database_url, redis_url))
    fresh_stores(database_url, redis_url)
    try:
        log("migrating the bench database")
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=REPO_ROOT,
            check=True,
        )
        import django

        django.setup()
        from controlplane.core.redis_clients import redis_client

        fleet = build_fleet(options, log)
        seconds, placed, unplaced = placement_alone(fleet)
        log(
            f"placement alone: {placed} replicas placed, {unplaced} not, in {seconds * 1000:.1f} ms"
        )
        result: dict[str, Any] = {
            "options": options,
            "fleet": fleet,
            "placement": (seconds, placed, unplaced),
        }
        client = redis_client(decode_responses=True)
        try:
            profiler = cProfile.Profile() if options.profile else None
            first = full_pass(fleet.deployment_ids, client, profiler)
            result["first"] = first
            result["unaccounted"] = unaccounted_replicas(fleet, first)
            unplaced_reasons = sum(len(report.unplaced) for report in first.reports)
            log(
                f"first pass: {first.seconds:.3f} s ({first.cpu_seconds:.3f} s CPU), "
                f"{first.queries} queries, {first.loads} "
                f"loads sent, {unplaced_reasons} unplaced reasons, "
                f"{len(result['unaccounted'])} replicas unaccounted for"
            )
            if profiler is not None:
                log(profile_text(profiler))
            log(f"{loads_succeed()} loads recorded as succeeded, endpoints proven")
            steady: list[PassResult] = []
            for index in range(options.steady_passes):
                profiler = cProfile.Profile() if options.profile and index == 0 else None
                outcome = full_pass(fleet.deployment_ids, client, profiler)
                steady.append(outcome)
                log(
                    f"steady pass {index + 1}: {outcome.seconds:.3f} s "
                    f"({outcome.cpu_seconds:.3f} s CPU), {outcome.queries} "
                    f"queries, {outcome.loads} loads, {outcome.drains} drains"
                )
                if profiler is not None:
                    log(profile_text(profiler))
            result["steady"] = steady
            alone = full_pass(fleet.deployment_ids, client, is_shared=False)
            result["alone"] = alone
            log(
                f"steady pass, each deployment alone: {alone.seconds:.3f} s, "
                f"{alone.queries} queries, {alone.loads} loads, {alone.drains} drains"
            )
            result["misrouted"] = misrouted(fleet, steady[-1]) if steady else []
        finally:
            client.close()
    finally:
        if "django" in sys.modules:
            from django.db import connections

            connections.close_all()
        import redis

        cleanup = redis.Redis.from_url(redis_url)
        cleanup.flushdb()
        cleanup.close()
        drop_database(database_url)
    return result


def figures_of(result: dict[str, Any]) -> dict[str, Any]:
    """The report's figures and notes (docs/loadgen.md, the step interface)."""
    options: Options = result["options"]
    fleet: Fleet = result["fleet"]
    first: PassResult = result["first"]
    steady: list[PassResult] = result["steady"]
    count = len(fleet.deployment_ids)
    asked = sum(sum(replicas.values()) for replicas in fleet.replicas.values())
    steady_s = statistics.median(outcome.seconds for outcome in steady)
    steady_queries = statistics.median(outcome.queries for outcome in steady)
    reference = f"the {TARGET_PASS_S:.0f} s target for a full pass"
    size = f"{count} deployments, {options.agents} agents"
    placement_s, placed, unplaced = result["placement"]
    figures: list[dict[str, Any]] = [
        {
            "name": f"full reconcile pass, steady state ({size}), median of {len(steady)}",
            "value": round(steady_s, 4),
            "unit": "s",
            "reference": reference,
            "reference_value": TARGET_PASS_S,
            "target": f"value < {TARGET_PASS_S:.0f}",
        },
        {
            "name": f"first full reconcile pass, every replica placed ({size})",
            "value": round(first.seconds, 4),
            "unit": "s",
            "reference": reference,
            "reference_value": TARGET_PASS_S,
            "target": f"value < {TARGET_PASS_S:.0f}",
        },
        {
            "name": "loads sent by the first pass",
            "value": first.loads,
            "unit": "loads",
            "reference": "replicas asked for",
            "reference_value": asked,
            "target": "exact",
        },
        {
            "name": "SQL statements per steady-state pass",
            "value": steady_queries,
            "unit": "queries",
            "reference": "",
            "reference_value": None,
            "target": "",
        },
        {
            "name": "SQL statements in the first pass",
            "value": first.queries,
            "unit": "queries",
            "reference": "",
            "reference_value": None,
            "target": "",
        },
        {
            "name": f"placement alone, Placement.choose for {placed + unplaced} replicas",
            "value": round(placement_s, 4),
            "unit": "s",
            "reference": "",
            "reference_value": None,
            "target": "",
        },
    ]
    alone: PassResult = result["alone"]
    notes = [
        f"steady state: {1000 * steady_s / count:.1f} ms and {steady_queries / count:.1f} "
        f"queries per deployment; passes "
        + ", ".join(f"{outcome.seconds:.3f} s" for outcome in steady)
        + " (CPU in this process "
        + ", ".join(f"{outcome.cpu_seconds:.3f} s" for outcome in steady)
        + f"; load average {os.getloadavg()[0]:.1f})",
        f"steady state, each deployment reconciled alone (reading the fleet itself, as after "
        f"a change): {alone.seconds:.3f} s, {alone.queries} queries for the {count}",
        f"first pass: {1000 * first.seconds / count:.1f} ms and {first.queries / count:.1f} "
        f"queries per deployment, {first.loads} loads for {asked} replicas, "
        f"{first.cpu_seconds:.3f} s CPU in this process",
        f"{options.agents} agents on {options.hosts} hosts, {count} deployments "
        f"({fleet.rollouts} with a running rollout); the reconciler in this process against "
        f"local PostgreSQL and Redis, {os.cpu_count()} CPUs",
    ]
    if result["unaccounted"]:
        notes.append(
            "replicas with neither a load nor a reason: " + "; ".join(result["unaccounted"])
        )
    if any(outcome.loads or outcome.drains for outcome in [*steady, alone]):
        notes.append("a steady-state pass sent commands: the fleet did not converge")
    if result["misrouted"]:
        notes.append("not every replica routed: " + "; ".join(result["misrouted"][:5]))
    if unplaced:
        notes.append(f"placement alone left {unplaced} replicas unplaced")
    return {"figures": figures, "notes": notes}


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    """The bench step (docs/loadgen.md): build the fleet, time the passes, return figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return figures_of(measure(QUICK if quick else Options()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Options()
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--hosts", type=int, default=defaults.hosts)
    parser.add_argument("--deployments", type=int, default=defaults.deployments)
    parser.add_argument("--rollouts", type=int, default=defaults.rollouts)
    parser.add_argument("--steady-passes", type=int, default=defaults.steady_passes)
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the first and one steady pass"
    )
    args = parser.parse_args()
    for name in ("agents", "hosts", "deployments", "steady_passes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rollouts < 0 or args.rollouts > args.deployments:
        parser.error("--rollouts must be between 0 and --deployments")
    options = Options(
        agents=args.agents,
        hosts=min(args.hosts, args.agents),
        deployments=args.deployments,
        rollouts=args.rollouts,
        steady_passes=args.steady_passes,
        profile=args.profile,
    )
    report = figures_of(measure(options))
    print()
    for figure in report["figures"]:
        print(f"{figure['name']}: {figure['value']} {figure['unit']} {figure['target']}".rstrip())
    for note in report["notes"]:
        print(f"- {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
