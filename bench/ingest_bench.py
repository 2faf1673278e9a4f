"""Heartbeats ingested per second by one `manage.py ingest` process, with lag under 2 s.

    python -m bench.ingest_bench [--agents 5000] [--rates 2500,5000,7500] [--duration 10]
        [--backlog 20000] [--profile-entries 10000] [--profile]
    python -m bench --only ingest_bench        # the report step: run(out_dir, quick)

Stores of its own: the PostgreSQL database `BENCH_INGEST_DATABASE_URL` (default
`cp_bench_ingest`) is created afresh and migrated, and dropped at the end; the Redis
database `BENCH_INGEST_REDIS_URL` (default db 7) is flushed before and after.

Synthetic agents (registered in the database) are publisher processes that XADD real
heartbeat entries (`Heartbeat.to_fields`, cumulative totals growing, each signed with its
agent's stream key as agents sign theirs) to `telemetry:heartbeats`, round-robin over the
agents and paced every 100 ms. One real ingest process (`manage.py ingest`) consumes them.
For each offered rate, lowest first, the bench reports what was published and ingested
per second and the lag: the age of the oldest entry not yet acknowledged (pending or not
yet delivered), sampled every 250 ms.
A rate passes when the publishers offered it (>= 95 %), ingest kept up (>= 95 % of what
was published) and the lag stayed under 2 s throughout; the first rate that fails ends
the series.

Then a backlog of `--backlog` entries is published at once: the rate at which ingest
drains it is its capacity, and the CPU time of the ingest process and of its PostgreSQL
backend over the drain says how much each entry costs where. Last, ingest is stopped and
the same handlers drain another backlog in this process under cProfile, which gives the
shares of its time (Redis, parsing, each statement, acknowledgements, live events).

Lost-agent detection runs as usual (every tick) but with FLEET_LOST_AFTER_S at an hour:
the publishers pause between rates, and a fleet marked lost and back each time is not
what is being measured.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import pstats
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.stack import fresh_stores

BUDGET_S = 100
QUICK_BUDGET_S = 60
REPO_ROOT = Path(__file__).resolve().parent.parent
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/cp_bench_ingest"
REDIS_URL = "redis://127.0.0.1:6379/7"
TARGET_PER_S = 5000
LAG_LIMIT_S = 2.0
KEEP_UP_FRACTION = 0.95
AGENT_PREFIX = "bench-"
CONSUMER = "bench"


@dataclass
class Options:
    agents: int = 5000
    rates: tuple[int, ...] = (2500, 5000, 7500)
    duration_s: float = 10.0
    warmup_s: float = 3.0
    backlog: int = 20_000
    profile_entries: int = 10_000
    publishers: int = 2
    batch_size: int = 2000


QUICK = Options(rates=(5000,), duration_s=6.0, backlog=10_000, profile_entries=5_000)


# -- stores and processes ---------------------------------------------------------------


def drop_database(database_url: str) -> None:
    import psycopg

    base, name = database_url.rsplit("/", 1)
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def environment(database_url: str, redis_url: str) -> dict[str, str]:
    """What this process and `manage.py ingest` run with (on top of os.environ)."""
    return {
        "DEBUG": "1",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "CHANNELS_PREFIX": "bench-ingest",
        "CELERY_QUEUE": "bench-ingest",
        "LOG_LEVEL": "WARNING",
        "LOG_FORMAT": "text",
        "PYTHONUNBUFFERED": "1",
        "FLEET_LOST_AFTER_S": "3600",
    }


def process_cpu_s(pids: list[int]) -> float | None:
    """User plus system CPU seconds of processes on this machine (from /proc); None when
    one cannot be read (a database on another machine)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def database_backend_pids() -> list[int]:
    """PostgreSQL backends of other processes on this database (the ingest process's)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return [pid for (pid,) in cursor.fetchall()]


# -- publishers ---------------------------------------------------------------------------

# A synthetic agent: its name and its stream key (the publishers sign as agents do).
Agent = tuple[str, str]


def _entry_template() -> tuple[dict[str, str], dict[str, Any]]:
    """A real heartbeat entry (Heartbeat.to_fields) and its figures, to vary per entry."""
    from contracts.streams import AgentState, EnergySource, Heartbeat

    fields = Heartbeat(
        agent="bench", seq=0, sent_at=0.0, host="bench-host", endpoint="http://10.0.0.1:9100",
        state=AgentState.READY, version_id=None, version_digest="", detail="", running=3,
        waiting=1, kv_cache_usage=0.42, interval_s=1.0, tokens_per_second=55.5,
        prompt_tokens=120, generated_tokens=55, requests_ok=2, requests_failed=0,
        requests_aborted=0, ttft_p50_s=0.08, ttft_p95_s=0.12, itl_mean_s=0.018,
        itl_p95_s=0.025, prompt_tokens_total=0, generated_tokens_total=0, requests_ok_total=0,
        requests_failed_total=0, power_watts=310.0, energy_joules=0.0,
        energy_source=EnergySource.NVML, joules_per_token=5.6,
    ).to_fields()  # fmt: skip
    return fields, json.loads(fields["figures"])


def heartbeat_entry(
    template: tuple[dict[str, str], dict[str, Any]], agent: Agent, seq: int, sent_at: float
) -> dict[str, str]:
    """The agent's heartbeat number `seq`, signed: its cumulative totals grow with it."""
    from contracts.agent_mac import agent_fields_sign
    from contracts.streams import HEARTBEATS_STREAM

    name, stream_key = agent
    fields, figures = template
    totals = {
        "prompt_tokens_total": 120 * seq,
        "generated_tokens_total": 55 * seq,
        "requests_ok_total": 2 * seq,
        "energy_joules": 310.0 * seq,
    }
    entry = {
        **fields,
        "agent": name,
        "seq": str(seq),
        "sent_at": repr(sent_at),
        "figures": json.dumps({**figures, **totals}, separators=(",", ":")),
    }
    return agent_fields_sign(HEARTBEATS_STREAM, entry, stream_key)


def publisher(
    redis_url: str, agents: list[Agent], rate: float, stop_at: float, counter: Any
) -> None:
    """Publish `rate` heartbeats a second, round-robin over `agents`, until `stop_at`."""
    import redis

    from contracts.streams import HEARTBEATS_MAXLEN, HEARTBEATS_STREAM

    client = redis.Redis.from_url(redis_url)
    template = _entry_template()
    seqs = [0] * len(agents)
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
                next_index = (next_index + 1) % len(agents)
                seqs[index] += 1
                entry: dict[Any, Any] = heartbeat_entry(template, agents[index], seqs[index], now)
                pipe.xadd(HEARTBEATS_STREAM, entry, maxlen=HEARTBEATS_MAXLEN, approximate=True)
            pipe.execute()
            sent += due
            with counter.get_lock():
                counter.value += due
        time.sleep(0.1)


# -- measuring ------------------------------------------------------------------------------


@dataclass
class LagProbe:
    client: Any
    group: str

    def _group(self) -> dict[str, Any]:
        from contracts.streams import HEARTBEATS_STREAM

        for group in self.client.xinfo_groups(HEARTBEATS_STREAM):
            if group["name"] == self.group:
                return dict(group)
        return {}

    def acknowledged(self) -> int:
        group = self._group()
        return int(group.get("entries-read") or 0) - int(group.get("pending") or 0)

    def lag_s(self) -> float:
        """Age of the oldest heartbeat not yet acknowledged (pending or undelivered)."""
        from contracts.streams import HEARTBEATS_STREAM

        oldest: list[int] = []
        summary = self.client.xpending(HEARTBEATS_STREAM, self.group)
        if summary["pending"]:
            oldest.append(_millis(summary["min"]))
        last = self._group().get("last-delivered-id", "0-0")
        after = self.client.xrange(HEARTBEATS_STREAM, min=f"({last}", count=1)
        if after:
            oldest.append(_millis(after[0][0]))
        return max(0.0, time.time() - min(oldest) / 1000) if oldest else 0.0

    def wait_caught_up(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.lag_s() > 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


def _millis(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


@dataclass
class RateResult:
    offered: int
    published_per_s: float
    ingested_per_s: float
    lags: list[tuple[float, float]] = field(repr=False)  # (seconds into the window, lag)

    @property
    def lag_values(self) -> list[float]:
        return [lag for _, lag in self.lags]

    @property
    def lag_p95_s(self) -> float:
        values = sorted(self.lag_values)
        return values[round(0.95 * (len(values) - 1))]

    @property
    def lag_max_s(self) -> float:
        return max(self.lag_values)

    @property
    def is_offered(self) -> bool:
        return self.published_per_s >= KEEP_UP_FRACTION * self.offered

    @property
    def passed(self) -> bool:
        return (
            self.is_offered
            and self.ingested_per_s >= KEEP_UP_FRACTION * self.published_per_s
            and self.lag_max_s < LAG_LIMIT_S
        )


def run_rate(
    redis_url: str, agents: list[Agent], rate: int, probe: LagProbe, options: Options
) -> RateResult:
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)
    stop_at = time.time() + options.warmup_s + options.duration_s
    processes = [
        context.Process(
            target=publisher,
            args=(
                redis_url,
                agents[i :: options.publishers],
                rate / options.publishers,
                stop_at,
                counter,
            ),
        )
        for i in range(options.publishers)
    ]
    for process in processes:
        process.start()
    time.sleep(options.warmup_s)
    start_acked, start_sent, start = probe.acknowledged(), counter.value, time.monotonic()
    lags = []
    while time.time() < stop_at:
        lags.append((time.monotonic() - start, probe.lag_s()))
        time.sleep(0.25)
    elapsed = time.monotonic() - start
    acked, sent = probe.acknowledged() - start_acked, counter.value - start_sent
    for process in processes:
        process.join()
    return RateResult(rate, sent / elapsed, acked / elapsed, lags)


def publish_backlog(redis_url: str, agents: list[Agent], count: int, first_seq: int) -> None:
    import redis

    from contracts.streams import HEARTBEATS_MAXLEN, HEARTBEATS_STREAM

    client = redis.Redis.from_url(redis_url)
    template = _entry_template()
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        seq = first_seq + i // len(agents)
        entry: dict[Any, Any] = heartbeat_entry(template, agents[i % len(agents)], seq, time.time())
        pipe.xadd(HEARTBEATS_STREAM, entry, maxlen=max(HEARTBEATS_MAXLEN, count), approximate=True)
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    client.close()


def run_backlog(
    redis_url: str, agents: list[Agent], count: int, probe: LagProbe, ingest_pid: int
) -> dict[str, Any]:
    """Publish `count` heartbeats at once; time ingest from the last one published until
    all are acknowledged, with the CPU its process and its database backends used."""
    processes = {"ingest process": [ingest_pid], "its PostgreSQL backend": database_backend_pids()}
    start_acked = probe.acknowledged()
    publish_backlog(redis_url, agents, count, first_seq=1_000_000)
    acked_at_start, start = probe.acknowledged(), time.monotonic()
    cpu_before = {label: process_cpu_s(pids) for label, pids in processes.items()}
    deadline = start + 120
    while probe.acknowledged() - start_acked < count and time.monotonic() < deadline:
        time.sleep(0.02)
    elapsed = time.monotonic() - start
    applied = probe.acknowledged() - acked_at_start
    cpu_us: dict[str, float | None] = {}
    for label, pids in processes.items():
        before, after = cpu_before[label], process_cpu_s(pids)
        cpu_us[label] = (
            None if before is None or after is None else 1e6 * (after - before) / applied
        )
    return {"entries": count, "drain_s": elapsed, "per_s": applied / elapsed, "cpu_us": cpu_us}


def cpu_text(cpu_us: dict[str, float | None]) -> str:
    return ", ".join(
        f"{label} {'unknown' if us is None else f'{us:.0f} us'}" for label, us in cpu_us.items()
    )


# Where ingest's time goes: (label, file suffix, function) whose cumulative time counts;
# an indented label is a part of the one above it, the last cuts across all of them.
PHASES = [
    ("Redis read (XREADGROUP, reply parsing)", "redis/commands/core.py", "xreadgroup"),
    ("parse + validate entries", "telemetry/ingest.py", "parse"),
    ("apply each batch", "telemetry/ingest.py", "apply"),
    ("  lock agents (SELECT ... FOR UPDATE)", "telemetry/heartbeats.py", "_lock_agents"),
    (
        "  update agents (UPDATE ... FROM json_to_recordset)",
        "telemetry/heartbeats.py",
        "_update_agents",
    ),
    ("  upsert rollups (INSERT ... ON CONFLICT)", "telemetry/heartbeats.py", "_upsert_samples"),
    ("  of those three, encoding rows as JSON", "json/encoder.py", "encode"),
    ("  commit", "django/db/transaction.py", "__exit__"),
    ("Redis ack (XACK)", "redis/commands/core.py", "xack"),
    ("ticker (lost check, live figures, retention)", "telemetry/ingest.py", "__call__"),
    ("waiting on PostgreSQL, in all of the above", "psycopg/connection.py", "wait"),
]


def profile_note(shares: list[tuple[str, float]]) -> str:
    """One line: top-level phases, their parts in parentheses."""
    groups: list[tuple[str, list[str]]] = []
    for label, share in shares:
        text = f"{label.strip()} {100 * share:.0f}%"
        if label.startswith("  ") and groups:
            groups[-1][1].append(text)
        else:
            groups.append((text, []))
    return "; ".join(f"{top} ({', '.join(parts)})" if parts else top for top, parts in groups)


def profile_ingest(
    redis_url: str, agents: list[Agent], count: int, batch_size: int
) -> tuple[list[tuple[str, float]], pstats.Stats]:
    """Drain a backlog with the ingest handlers in this process under cProfile."""
    from contracts.streams import INGEST_GROUP
    from controlplane.core.redis_clients import stream_reader
    from controlplane.telemetry.ingest import ingest_ticker, stream_handlers
    from controlplane.telemetry.streams import StreamIngestor

    publish_backlog(redis_url, agents, count, first_seq=2_000_000)
    client = stream_reader(redis_url)
    ingestor = StreamIngestor(
        client=client,
        group=INGEST_GROUP,
        consumer="bench-profile",
        handlers=stream_handlers(),
        batch_size=batch_size,
        block_ms=100,
        on_tick=ingest_ticker(),
    )
    ingestor.ensure_groups()
    profiler = cProfile.Profile()
    profiler.enable()
    handled = 0
    while handled < count:
        round_handled = ingestor.run_once()
        ingestor.tick()
        handled += round_handled
        if round_handled == 0 and ingestor.is_caught_up:
            break
    profiler.disable()
    client.close()
    stats = pstats.Stats(profiler)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = stats.total_tt  # type: ignore[attr-defined]

    def cumulative(suffix: str, function: str) -> float:
        # Outermost calls only (recursive ones are inside them).
        return sum(
            cumulative_s
            for (path, _, name), (_, _, _, cumulative_s, _) in raw.items()
            if name == function and path.endswith(suffix)
        )

    return [(label, cumulative(suffix, name) / total) for label, suffix, name in PHASES], stats


# -- the step -----------------------------------------------------------------------------


def measure(options: Options, out_dir: Path | None, log: Any = print) -> dict[str, Any]:
    database_url = os.environ.get("BENCH_INGEST_DATABASE_URL", DATABASE_URL)
    redis_url = os.environ.get("BENCH_INGEST_REDIS_URL", REDIS_URL)
    os.environ.update(environment(database_url, redis_url))  # this process, and its children
    fresh_stores(database_url, redis_url)
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO_ROOT, check=True
    )
    import django

    django.setup()
    import redis
    from django.utils import timezone

    from contracts.streams import HEARTBEATS_STREAM, INGEST_GROUP
    from controlplane.fleet.models import Agent as AgentRow
    from controlplane.fleet.stream_keys import agent_stream_key

    names = [f"{AGENT_PREFIX}{i:05d}" for i in range(options.agents)]
    agents = [(name, agent_stream_key(name)) for name in names]
    now = timezone.now()
    AgentRow.objects.bulk_create(
        [
            # The endpoint the heartbeats name is registered: ingest refuses any other.
            AgentRow(
                name=name,
                host="bench-host",
                endpoints=["http://10.0.0.1:9100", "http://10.0.0.1:9101"],
                registered_at=now,
                last_seen=now,
            )
            for name in names
        ],
        batch_size=1000,
    )
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    probe = LagProbe(client, INGEST_GROUP)
    ingest_log = open(out_dir / "ingest.log", "wb") if out_dir else None  # noqa: SIM115
    ingest = subprocess.Popen(
        [sys.executable, "manage.py", "ingest", "--consumer", CONSUMER,
         "--batch-size", str(options.batch_size)],
        cwd=REPO_ROOT, stdout=ingest_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    rates: list[RateResult] = []
    result: dict[str, Any] = {"rates": rates, "options": options}
    try:
        deadline = time.monotonic() + 30
        while not client.exists(HEARTBEATS_STREAM) or not probe._group():
            if ingest.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("manage.py ingest did not start (see ingest.log)")
            time.sleep(0.1)
        log(
            f"one ingest process, {options.agents} agents, batch {options.batch_size}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        )
        log(
            f"{'offered/s':>10} {'published/s':>12} {'ingested/s':>11} "
            f"{'lag p50':>8} {'lag p95':>8} {'lag max':>8}  lag<2s and keeping up"
        )
        for rate in options.rates:
            outcome = run_rate(redis_url, agents, rate, probe, options)
            rates.append(outcome)
            log(
                f"{rate:>10} {outcome.published_per_s:>12.0f} {outcome.ingested_per_s:>11.0f} "
                f"{statistics.median(outcome.lag_values):>7.2f}s {outcome.lag_p95_s:>7.2f}s "
                f"{outcome.lag_max_s:>7.2f}s  {'yes' if outcome.passed else 'NO'}"
            )
            if not probe.wait_caught_up(30) or not outcome.passed:
                break
        if options.backlog:
            probe.wait_caught_up(30)
            backlog = run_backlog(redis_url, agents, options.backlog, probe, ingest.pid)
            result["backlog"] = backlog
            log(
                f"backlog of {backlog['entries']} drained at {backlog['per_s']:.0f} heartbeats/s; "
                f"CPU per heartbeat: {cpu_text(backlog['cpu_us'])}"
            )
        ingest.terminate()
        ingest.wait(timeout=30)
        if options.profile_entries:
            shares, stats = profile_ingest(
                redis_url, agents, options.profile_entries, options.batch_size
            )
            result["profile"] = shares
            result["profile_stats"] = stats
    finally:
        if ingest.poll() is None:
            ingest.kill()
            ingest.wait()
        if ingest_log:
            ingest_log.close()
        client.flushdb()
        client.close()
        from django.db import connections

        connections.close_all()
        drop_database(database_url)
    return result


def figures_of(result: dict[str, Any]) -> dict[str, Any]:
    """The report's figures and notes (docs/loadgen.md, the step interface)."""
    rates: list[RateResult] = result["rates"]
    passing = [r for r in rates if r.passed]
    best = max(passing, key=lambda r: r.offered) if passing else None
    reference = f"the {TARGET_PER_S:,}/s target (one ingest process, lag under {LAG_LIMIT_S:.0f} s)"
    figures: list[dict[str, Any]] = [
        {
            "name": "heartbeats ingested per second with lag under 2 s, one ingest process",
            "value": float(best.offered if best else 0),
            "unit": "heartbeats/s",
            "reference": reference,
            "reference_value": float(TARGET_PER_S),
            "target": f"value >= {TARGET_PER_S}",
        },
        {
            "name": "lag p95 at that rate",
            "value": round(best.lag_p95_s, 3) if best else None,
            "unit": "s",
            "reference": "the 2 s lag limit",
            "reference_value": LAG_LIMIT_S,
            "target": f"value < {LAG_LIMIT_S:.0f}",
            **({} if best else {"skipped": "no offered rate was ingested with lag under 2 s"}),
        },
    ]
    backlog = result.get("backlog")
    figures.append(
        {
            "name": "backlog drain rate (capacity), one ingest process",
            "value": round(backlog["per_s"]) if backlog else None,
            "unit": "heartbeats/s",
            "reference": reference,
            "reference_value": float(TARGET_PER_S),
            "target": f"value >= {TARGET_PER_S}",
            **({} if backlog else {"skipped": "no backlog was run"}),
        }
    )
    notes = [
        f"{r.offered}/s offered: {r.published_per_s:.0f}/s published, {r.ingested_per_s:.0f}/s "
        f"ingested, lag p95 {r.lag_p95_s:.2f} s, max {r.lag_max_s:.2f} s: "
        + ("passed" if r.passed else "publishers fell short" if not r.is_offered else "failed")
        for r in rates
    ]
    if backlog:
        notes.append(
            f"backlog of {backlog['entries']:,} drained in {backlog['drain_s']:.1f} s; CPU per "
            f"heartbeat: {cpu_text(backlog['cpu_us'])}"
        )
    if result.get("profile"):
        notes.append(
            "where ingest's time goes (cProfile, which inflates Python time against waits): "
            + profile_note(result["profile"])
        )
    options: Options = result["options"]
    notes.append(
        f"{options.agents} agents, batch {options.batch_size}, {os.cpu_count()} CPUs shared "
        "with the publishers, Redis and PostgreSQL"
    )
    return {"figures": figures, "notes": notes}


def plot_lag(rates: list[RateResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 3.5))
    for rate in rates:
        axes.plot([t for t, _ in rate.lags], rate.lag_values, label=f"{rate.offered}/s offered")
    axes.axhline(LAG_LIMIT_S, color="grey", linestyle="--", linewidth=1)
    axes.set_xlabel("seconds into the measured window")
    axes.set_ylabel("lag (s)")
    axes.set_title("Heartbeat ingest lag, one ingest process")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    """The bench step (docs/loadgen.md): measure, plot the lag, return the figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = measure(QUICK if quick else Options(), out_dir)
    report = figures_of(result)
    if result["rates"] and plot_lag(result["rates"], out_dir / "ingest_lag.png"):
        report["plots"] = ["ingest_lag.png"]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Options()
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--rates", default=",".join(map(str, defaults.rates)))
    parser.add_argument("--duration", type=float, default=defaults.duration_s)
    parser.add_argument("--backlog", type=int, default=defaults.backlog)
    parser.add_argument("--profile-entries", type=int, default=defaults.profile_entries)
    parser.add_argument("--publishers", type=int, default=defaults.publishers)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--profile", action="store_true", help="print the top functions too")
    args = parser.parse_args()
    options = Options(
        agents=args.agents,
        rates=tuple(int(rate) for rate in args.rates.split(",")),
        duration_s=args.duration,
        backlog=args.backlog,
        profile_entries=args.profile_entries,
        publishers=args.publishers,
        batch_size=args.batch_size,
    )
    result = measure(options, None)
    report = figures_of(result)
    print()
    for figure in report["figures"]:
        print(f"{figure['name']}: {figure['value']} {figure['unit']} ({figure['target']})")
    for note in report["notes"]:
        print(f"- {note}")
    if args.profile and result.get("profile_stats"):
        result["profile_stats"].sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
