"""What a run leaves behind: a summary table, JSON, CSV and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from loadgen.runner import RunResult, SweepResult

REQUEST_COLUMNS = (
    "tenant",
    "status",
    "request_id",
    "start_offset_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "itl_mean_s",
    "prompt_tokens",
    "completion_tokens",
    "content_chunks",
    "usage_reported",
    "error",
)


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}"


def summary_table(summary: dict[str, Any]) -> str:
    """The end-of-run table: latencies in ms, throughput, goodput, errors, energy."""
    lines = [f"{'metric':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}{'n':>8}"]
    for key, label in (("ttft_s", "TTFT ms"), ("itl_s", "ITL ms"), ("tpot_s", "TPOT ms"),
                       ("e2e_s", "E2E ms")):  # fmt: skip
        row = summary[key]
        cells = "".join(f"{_fmt(row[c], 1000):>10}" for c in ("mean", "p50", "p90", "p95", "p99"))
        lines.append(f"{label:<14}{cells}{row['count']:>8}")
    slo = summary["slo"]
    attainment = summary["slo_attainment"]
    lines += [
        "",
        f"requests        {summary['requests']} ({summary['successes']} ok, "
        f"{summary['errors']} errors) in {summary['elapsed_s']:.1f}s",
        f"throughput      {summary['request_throughput']:.3f} req/s, "
        f"{summary['output_token_throughput']:.1f} output tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s",
        f"tokens          {summary['prompt_tokens']} prompt, {summary['completion_tokens']} "
        f"completion (usage reported by {_fmt(summary['usage_reported_share'], 100, 0)}%)",
        f"goodput         {summary['goodput']:.3f} req/s; SLO attainment "
        f"{_fmt(attainment, 100)}% (TTFT <= {slo['ttft_s'] * 1000:.0f} ms and "
        f"TPOT <= {slo['tpot_s'] * 1000:.0f} ms)",
    ]
    if summary["errors_by_status"]:
        by_status = ", ".join(f"{k}: {v}" for k, v in summary["errors_by_status"].items())
        lines.append(f"errors          {by_status}")
    if summary.get("skipped_while_down"):
        lines.append(f"skipped         {summary['skipped_while_down']} while the target was down")
    energy = summary.get("energy")
    if energy:
        if energy["available"]:
            lines.append(
                f"energy          {energy['joules']:.1f} J; "
                f"{_fmt(energy['joules_per_output_token'], 1, 3)} J/output token, "
                f"{_fmt(energy['joules_per_token'], 1, 3)} J/token "
                f"({', '.join(energy['metrics_read'])})"
            )
        else:
            lines.append(f"energy          skipped: {energy['reason']}")
    return "\n".join(lines)


def sweep_table(sweep: SweepResult) -> str:
    lines = [
        f"{sweep.parameter:>12}{'req/s':>10}{'tok/s':>10}{'goodput':>10}{'SLO %':>8}"
        f"{'TTFT p95':>10}{'TPOT p95':>10}{'errors':>8}"
    ]
    for value, result in sweep.steps:
        s = result.summary
        lines.append(
            f"{value:>12g}{s['request_throughput']:>10.3f}{s['output_token_throughput']:>10.1f}"
            f"{s['goodput']:>10.3f}{_fmt(s['slo_attainment'], 100):>8}"
            f"{_fmt(s['ttft_s']['p95'], 1000, 0):>10}{_fmt(s['tpot_s']['p95'], 1000, 0):>10}"
            f"{s['errors']:>8}"
        )
    reading = sweep.max_rate
    target = reading["target_attainment"] * 100
    if reading["rate"] is None:
        lines.append(f"max rate at {target:.0f}% SLO attainment: none (the lowest point missed)")
    else:
        bound = " (lower bound: every point met it)" if reading["is_lower_bound"] else ""
        lines.append(
            f"max rate at {target:.0f}% SLO attainment: {reading['rate']:.3f} req/s{bound}"
        )
    return "\n".join(lines)


def request_rows(result: RunResult) -> list[dict[str, Any]]:
    if not result.requests:
        return []
    origin = min(r.started for r in result.requests)
    rows = []
    for r in result.requests:
        tpot = None
        if r.ttft_s is not None and r.completion_tokens > 1:
            tpot = (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
        rows.append(
            {
                "tenant": r.tenant,
                "status": r.status,
                "request_id": r.request_id,
                "start_offset_s": r.started - origin,
                "ttft_s": r.ttft_s,
                "tpot_s": tpot,
                "e2e_s": r.e2e_s,
                "itl_mean_s": sum(r.itls) / len(r.itls) if r.itls else None,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "content_chunks": r.content_chunks,
                "usage_reported": r.is_usage_reported,
                "error": r.error,
            }
        )
    return rows


def write_run(out_dir: Path, result: RunResult, *, plots: bool = True, name: str = "run") -> None:
    """`<name>.json` (config and summary), `<name>_requests.csv`, `<name>_latency.png`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {"config": result.config, "summary": result.summary}
    (out_dir / f"{name}.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    rows = request_rows(result)
    if rows:
        with (out_dir / f"{name}_requests.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=REQUEST_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    if plots and rows:
        plot_latencies(out_dir / f"{name}_latency.png", result)


def write_sweep(out_dir: Path, sweep: SweepResult, *, plots: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (value, result) in enumerate(sweep.steps):
        write_run(out_dir, result, plots=plots, name=f"step{index:02d}")
        s = result.summary
        rows.append(
            {
                sweep.parameter: value,
                "request_throughput": s["request_throughput"],
                "output_token_throughput": s["output_token_throughput"],
                "goodput": s["goodput"],
                "slo_attainment": s["slo_attainment"],
                "ttft_p95_s": s["ttft_s"]["p95"],
                "tpot_p95_s": s["tpot_s"]["p95"],
                "e2e_p95_s": s["e2e_s"]["p95"],
                "errors": s["errors"],
            }
        )
    document = {
        "parameter": sweep.parameter,
        "max_rate": sweep.max_rate,
        "steps": [{"value": v, "config": r.config, "summary": r.summary} for v, r in sweep.steps],
    }
    (out_dir / "sweep.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    with (out_dir / "sweep.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if plots:
        plot_sweep(out_dir / "sweep.png", sweep)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latencies(path: Path, result: RunResult) -> None:
    """Empirical CDFs of TTFT, ITL, TPOT and end-to-end latency, in milliseconds."""
    plt = _pyplot()
    ok = [r for r in result.requests if r.is_success]
    series = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "inter-token latency": [gap for r in ok for gap in r.itls],
        "TPOT": [
            (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
            for r in ok
            if r.ttft_s is not None and r.completion_tokens > 1
        ],
        "end-to-end": [r.e2e_s for r in ok],
    }
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for axis, (title, values) in zip(axes.flat, series.items(), strict=True):
        axis.set_title(title)
        axis.set_xlabel("ms")
        axis.set_ylabel("share of samples")
        if values:
            ordered = sorted(v * 1000 for v in values)
            shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
            axis.step(ordered, shares, where="post")
            axis.axhline(0.95, color="grey", linewidth=0.5, linestyle=":")
        axis.grid(alpha=0.3)
    figure.suptitle(f"Latency distributions ({len(ok)} successful requests)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_sweep(path: Path, sweep: SweepResult) -> None:
    """Throughput and goodput against the swept parameter, and SLO attainment with the 90 %
    line and the max rate read from it."""
    plt = _pyplot()
    xs = [value for value, _ in sweep.steps]
    summaries = [result.summary for _, result in sweep.steps]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(xs, [s["request_throughput"] for s in summaries], "o-", label="throughput")
    left.plot(xs, [s["goodput"] for s in summaries], "s-", label="goodput")
    left.set_xlabel(sweep.parameter)
    left.set_ylabel("requests/s")
    left.legend()
    left.grid(alpha=0.3)
    points = sweep.max_rate["points"]
    right.plot([p["rate"] for p in points], [p["slo_attainment"] * 100 for p in points], "o-")
    target = sweep.max_rate["target_attainment"] * 100
    right.axhline(target, color="red", linestyle="--", linewidth=1, label=f"{target:.0f}%")
    if sweep.max_rate["rate"] is not None:
        right.axvline(sweep.max_rate["rate"], color="green", linestyle=":", label="max rate")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("SLO attainment (%)")
    right.set_ylim(0, 105)
    right.legend()
    right.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
