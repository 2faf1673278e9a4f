"""Heartbeats ingested per second by one `manage.py ingest` process, with lag under 2 s.

    DATABASE_URL=postgres://... REDIS_URL=redis://127.0.0.1:6379/9 \\
        python -m bench.ingest_bench [--agents 5000] [--rates 2000,5000,8000] [--duration 15]
        [--backlog 50000] [--profile]

The database must be migrated; use a database and a Redis database of the bench's own (it
creates agents named bench-NNNNN, and deletes them and their rollups at the end).

Synthetic agents are publisher processes that XADD real heartbeat entries
(contracts.streams.Heartbeat.to_fields) to `telemetry:heartbeats`, paced every 100 ms.
One real ingest process (`manage.py ingest`) consumes them. For each offered rate the
bench reports what was ingested per second and the lag: the age of the oldest entry not
yet acknowledged (pending or not yet delivered), sampled every 250 ms. A rate passes when
ingest keeps up (>= 95% of what was published) with the lag under 2 s throughout.

Then a backlog of `--backlog` entries is published at once and the time ingest takes to
drain it gives its capacity. `--profile` runs ingest under cProfile and prints where its
time went (Redis reads, parsing, the database writes, acknowledgements).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pstats
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
FIGURES: dict[str, Any] = {}
LAG_LIMIT_S = 2.0
KEEP_UP_FRACTION = 0.95


def _setup_django() -> None:
    os.environ.setdefault("DEBUG", "1")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ.setdefault("LOG_FORMAT", "plain")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()


def _template(name: str) -> dict[str, str]:
    from contracts.streams import AgentState, EnergySource, Heartbeat

    return Heartbeat(
        agent=name,
        seq=0,
        sent_at=time.time(),
        host="bench-host",
        endpoint="http://10.0.0.1:9100",
        state=AgentState.READY,
        version_id=None,
        version_digest="",
        detail="",
        running=3,
        waiting=1,
        kv_cache_usage=0.42,
        interval_s=1.0,
        tokens_per_second=55.5,
        prompt_tokens=120,
        generated_tokens=55,
        requests_ok=2,
        requests_failed=0,
        requests_aborted=0,
        ttft_p50_s=0.08,
        ttft_p95_s=0.12,
        itl_mean_s=0.018,
        itl_p95_s=0.025,
        prompt_tokens_total=0,
        generated_tokens_total=0,
        requests_ok_total=0,
        requests_failed_total=0,
        power_watts=310.0,
        energy_joules=0.0,
        energy_source=EnergySource.NVML,
        joules_per_token=5.6,
    ).to_fields()


def publisher(redis_url: str, names: list[str], rate: float, stop_at: float, counter: Any) -> None:
    """Publish `rate` heartbeats a second, round-robin over `names`, until `stop_at`."""
    import redis

    from contracts.streams import HEARTBEATS_MAXLEN, HEARTBEATS_STREAM

    client = redis.Redis.from_url(redis_url)
    templates = [_template(name) for name in names]
    FIGURES.update(json.loads(templates[0]["figures"]))
    seqs = [0] * len(names)
    tick = 0.1
    next_index = 0
    sent = 0
    started = time.monotonic()
    while time.time() < stop_at:
        due = int((time.monotonic() - started) * rate) - sent
        if due > 0:
            pipe = client.pipeline(transaction=False)
            now = time.time()
            for _ in range(due):
                index = next_index
                next_index = (next_index + 1) % len(names)
                seqs[index] += 1
                seq = seqs[index]
                fields = dict(templates[index])
                fields["seq"] = str(seq)
                fields["sent_at"] = repr(now)
                figures = {
                    **FIGURES,
                    "energy_joules": 310.0 * seq,
                    "generated_tokens_total": 55 * seq,
                    "prompt_tokens_total": 120 * seq,
                    "requests_ok_total": 2 * seq,
                }
                fields["figures"] = json.dumps(figures, separators=(",", ":"))
                pipe.xadd(HEARTBEATS_STREAM, fields, maxlen=HEARTBEATS_MAXLEN, approximate=True)
            pipe.execute()
            sent += due
            with counter.get_lock():
                counter.value += due
        time.sleep(tick)


@dataclass
class LagProbe:
    client: Any
    group: str

    def acknowledged(self) -> int:
        from contracts.streams import HEARTBEATS_STREAM

        for group in self.client.xinfo_groups(HEARTBEATS_STREAM):
            if group["name"] in (self.group, self.group.encode()):
                return int(group["entries-read"] or 0) - int(group["pending"])
        return 0

    def lag_s(self) -> float:
        """Age of the oldest heartbeat not yet acknowledged (pending or undelivered)."""
        from contracts.streams import HEARTBEATS_STREAM

        oldest: list[int] = []
        summary = self.client.xpending(HEARTBEATS_STREAM, self.group)
        if summary["pending"]:
            oldest.append(_millis(summary["min"]))
        groups = self.client.xinfo_groups(HEARTBEATS_STREAM)
        last = next(g for g in groups if g["name"] in (self.group, self.group.encode()))
        after = self.client.xrange(
            HEARTBEATS_STREAM, min=f"({_text(last['last-delivered-id'])}", count=1
        )
        if after:
            oldest.append(_millis(after[0][0]))
        if not oldest:
            return 0.0
        return max(0.0, time.time() - min(oldest) / 1000)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _millis(entry_id: Any) -> int:
    return int(_text(entry_id).split("-", 1)[0])


def run_rate(
    redis_url: str, names: list[str], rate: int, duration: float, probe: LagProbe, workers: int
) -> dict[str, Any]:
    counter = multiprocessing.Value("q", 0)
    warmup = 3.0
    stop_at = time.time() + warmup + duration
    chunks = [names[i::workers] for i in range(workers)]
    processes = [
        multiprocessing.Process(
            target=publisher, args=(redis_url, chunk, rate / workers, stop_at, counter)
        )
        for chunk in chunks
    ]
    for process in processes:
        process.start()
    time.sleep(warmup)
    start_acked, start_sent, start = probe.acknowledged(), counter.value, time.monotonic()
    lags = []
    while time.time() < stop_at:
        lags.append(probe.lag_s())
        time.sleep(0.25)
    elapsed = time.monotonic() - start
    acked, sent = probe.acknowledged() - start_acked, counter.value - start_sent
    for process in processes:
        process.join()
    # Let ingest catch up before the next rate.
    deadline = time.monotonic() + 60
    while probe.lag_s() > 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    ingested = acked / elapsed
    published = sent / elapsed
    return {
        "offered": rate,
        "published_per_s": published,
        "ingested_per_s": ingested,
        "lag_p50_s": statistics.median(lags),
        "lag_p95_s": sorted(lags)[int(0.95 * (len(lags) - 1))],
        "lag_max_s": max(lags),
        "passed": ingested >= KEEP_UP_FRACTION * published and max(lags) < LAG_LIMIT_S,
    }


def run_backlog(redis_url: str, names: list[str], count: int, probe: LagProbe) -> dict[str, Any]:
    """Publish `count` heartbeats at once, then time how long ingest takes to apply them."""
    import redis

    from contracts.streams import HEARTBEATS_MAXLEN, HEARTBEATS_STREAM

    client = redis.Redis.from_url(redis_url)
    templates = [_template(name) for name in names]
    start_acked = probe.acknowledged()
    start = time.monotonic()
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        fields = dict(templates[i % len(names)])
        fields["seq"] = str(10_000_000 + i)
        fields["sent_at"] = repr(time.time())
        pipe.xadd(HEARTBEATS_STREAM, fields, maxlen=max(HEARTBEATS_MAXLEN, count), approximate=True)
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    published_in = time.monotonic() - start
    deadline = time.monotonic() + 600
    while probe.acknowledged() - start_acked < count and time.monotonic() < deadline:
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    return {
        "entries": count,
        "publish_s": published_in,
        "drain_s": elapsed,
        "ingested_per_s": (probe.acknowledged() - start_acked) / elapsed,
    }


PHASES = [
    ("redis read (XREADGROUP)", "xreadgroup"),
    ("parse + validate entries", "parse_heartbeat"),
    ("database: heartbeats_apply (all)", "heartbeats_apply"),
    ("  lock agents (SELECT ... FOR UPDATE)", "_lock_agents"),
    ("  update agents (UPDATE ... FROM UNNEST)", "_update_agents"),
    ("  upsert rollups (INSERT ... ON CONFLICT)", "_upsert_samples"),
    ("redis ack (XACK)", "xack"),
    ("live events (Channels group_send)", "fleet_event_publish"),
    ("lost-agent check", "agents_mark_lost"),
]


def print_profile(path: Path) -> None:
    stats = pstats.Stats(str(path))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = stats.total_tt  # type: ignore[attr-defined]

    def cumulative_of(name: str) -> float:
        return sum(
            cumulative
            for (_, _, function), (_, _, _, cumulative, _) in raw.items()
            if function == name
        )

    print(f"\nWhere ingest's time went (cProfile, {total:.1f}s of the process):")
    for label, function in PHASES:
        seconds = cumulative_of(function)
        print(f"  {label:<45} {seconds:7.2f}s  {100 * seconds / total:5.1f}%")
    print("\nTop functions by own time:")
    stats.sort_stats("tottime").print_stats(12)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=5000)
    parser.add_argument("--rates", default="2000,5000,8000")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--backlog", type=int, default=50_000)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--profile", action="store_true")
    options = parser.parse_args()
    _setup_django()
    import redis
    from django.conf import settings
    from django.utils import timezone

    from contracts.streams import HEARTBEATS_STREAM, INGEST_GROUP
    from controlplane.fleet.models import Agent

    redis_url = settings.REDIS_URL
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.delete(HEARTBEATS_STREAM)
    names = [f"bench-{i:05d}" for i in range(options.agents)]
    Agent.objects.filter(name__startswith="bench-").delete()
    now = timezone.now()
    Agent.objects.bulk_create(
        [Agent(name=name, host="bench-host", registered_at=now, last_seen=now) for name in names],
        batch_size=1000,
    )
    profile_path = REPO_ROOT / "bench" / "results" / "ingest.prof"
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable]
    if options.profile:
        command += ["-m", "cProfile", "-o", str(profile_path)]
    command += [
        "manage.py",
        "ingest",
        "--consumer",
        "bench",
        "--batch-size",
        str(options.batch_size),
    ]
    # Bench agents stop and start between rates: do not judge them lost meanwhile.
    env = dict(os.environ, FLEET_LOST_AFTER_S="3600", PYTHONUNBUFFERED="1")
    ingest = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    probe = LagProbe(client, INGEST_GROUP)
    results = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if any(g["name"] == INGEST_GROUP for g in client.xinfo_groups(HEARTBEATS_STREAM)):
                    break
            except redis.ResponseError:
                pass
            time.sleep(0.2)
        print(
            f"one ingest process, {options.agents} agents, batch {options.batch_size}, "
            f"{os.cpu_count()} CPUs, database {settings.DATABASES['default']['ENGINE']}"
        )
        print(
            f"{'offered/s':>10} {'published/s':>12} {'ingested/s':>11} "
            f"{'lag p50':>8} {'lag p95':>8} {'lag max':>8}  lag<2s and keeping up"
        )
        for rate in [int(r) for r in options.rates.split(",")]:
            result = run_rate(redis_url, names, rate, options.duration, probe, options.publishers)
            results.append(result)
            print(
                f"{result['offered']:>10} {result['published_per_s']:>12.0f} "
                f"{result['ingested_per_s']:>11.0f} {result['lag_p50_s']:>7.2f}s "
                f"{result['lag_p95_s']:>7.2f}s {result['lag_max_s']:>7.2f}s  "
                f"{'yes' if result['passed'] else 'NO'}",
                flush=True,
            )
        if options.backlog:
            backlog = run_backlog(redis_url, names, options.backlog, probe)
            print(
                f"\nbacklog of {backlog['entries']} published in {backlog['publish_s']:.1f}s, "
                f"applied in {backlog['drain_s']:.1f}s: capacity "
                f"{backlog['ingested_per_s']:.0f} heartbeats/s"
            )
        passing = [r["offered"] for r in results if r["passed"]]
        print(
            f"\nhighest offered rate ingested with lag under {LAG_LIMIT_S:.0f}s: "
            f"{max(passing) if passing else 'none'} heartbeats/s"
        )
    finally:
        ingest.send_signal(signal.SIGTERM)
        ingest.wait(timeout=60)
        Agent.objects.filter(name__startswith="bench-").delete()
        client.delete(HEARTBEATS_STREAM)
    if options.profile and profile_path.exists():
        print_profile(profile_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
