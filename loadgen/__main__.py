"""`loadgen`: drive an OpenAI-compatible endpoint and measure it from the client side."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from loadgen.energy import ENERGY_METRIC_NAMES
from loadgen.readiness import wait_until_served
from loadgen.report import summary_table, sweep_table, write_run, write_sweep
from loadgen.runner import LoadConfig, run_load, run_sweep
from loadgen.stats import Slo
from loadgen.trace import TraceError, load_trace


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError("expected positive numbers")
    return values


def _tenant_key(text: str) -> tuple[str, str]:
    name, sep, key = text.partition("=")
    if not sep or not name or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=KEY, got {text!r}")
    return name, key


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loadgen",
        description="Load generator for OpenAI-compatible endpoints (see docs/loadgen.md).",
    )
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        default=os.environ.get("LOADGEN_BASE_URL", "http://127.0.0.1:8000/v1"),
        help="endpoint root, e.g. http://host:8000/v1 (env LOADGEN_BASE_URL)",
    )
    target.add_argument(
        "--api-key", default=None, help="default key (env LOADGEN_API_KEY, then OPENAI_API_KEY)"
    )
    target.add_argument("--model", required=True, help="model name sent in each request")
    target.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    target.add_argument(
        "--tenant-key",
        type=_tenant_key,
        action="append",
        default=[],
        metavar="NAME=KEY",
        help="API key for a tenant (repeatable)",
    )
    target.add_argument(
        "--tenant-keys", type=Path, metavar="FILE", help='JSON file {"tenant": "key", ...}'
    )
    target.add_argument("--timeout", type=float, default=300.0, help="per-request seconds")
    target.add_argument(
        "--wait-ready",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to this long until GET /models lists --model (0: do not wait)",
    )

    workload = parser.add_argument_group("workload (choose one)")
    choice = workload.add_mutually_exclusive_group(required=True)
    choice.add_argument("--trace", help="JSON Lines trace to replay ('sample' for the shipped one)")
    choice.add_argument("--rate", type=float, help="Poisson arrivals per second, per tenant")
    choice.add_argument("--concurrency", type=int, help="requests kept in flight")
    choice.add_argument("--sweep-rates", type=_floats, metavar="R1,R2,...")
    choice.add_argument("--sweep-concurrency", type=_floats, metavar="N1,N2,...")
    workload.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="tenant to send as in synthetic workloads (repeatable; default: "
        "every tenant with a key, else 'default')",
    )
    workload.add_argument("--prompt-tokens", type=int, default=128)
    workload.add_argument("--max-tokens", type=int, default=64)
    workload.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply trace offsets (0.5 replays twice as fast)",
    )
    workload.add_argument("--num-requests", type=int, help="stop after this many (per step)")
    workload.add_argument("--duration", type=float, help="stop after this many seconds (per step)")
    workload.add_argument(
        "--forever", action="store_true", help="run until SIGINT/SIGTERM with constant memory"
    )
    workload.add_argument(
        "--max-concurrency", type=int, default=64, help="bound on requests in flight"
    )
    workload.add_argument("--temperature", type=float)
    workload.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max tokens (vLLM extension)"
    )
    workload.add_argument("--seed", type=int, default=0)

    measure = parser.add_argument_group("measurement")
    measure.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    measure.add_argument("--slo-tpot-ms", type=float, default=200.0)
    measure.add_argument(
        "--goodput-target",
        type=float,
        default=0.9,
        help="SLO attainment for the max-rate reading of a sweep",
    )
    measure.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="Prometheus endpoint scraped for energy (repeatable)",
    )
    measure.add_argument(
        "--energy-metric",
        action="append",
        default=[],
        help="counter name(s) to read (default: " + ", ".join(ENERGY_METRIC_NAMES) + ")",
    )

    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, help="directory for JSON, CSV and PNG results")
    output.add_argument("--no-plots", action="store_true")
    output.add_argument("--no-progress", action="store_true")
    output.add_argument(
        "--report-interval",
        type=float,
        default=10.0,
        help="seconds between forever-mode report lines and snapshots",
    )
    return parser


def _tenant_keys(args: argparse.Namespace) -> dict[str, str]:
    keys: dict[str, str] = {}
    if args.tenant_keys is not None:
        try:
            loaded = json.loads(args.tenant_keys.read_text())
        except (OSError, json.JSONDecodeError) as error:
            message = f"loadgen: cannot read --tenant-keys {args.tenant_keys}: {error}"
            raise SystemExit(message) from None
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
        ):
            raise SystemExit(f"loadgen: {args.tenant_keys} must map tenant names to key strings")
        keys.update(loaded)
    keys.update(dict(args.tenant_key))
    return keys


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    keys = _tenant_keys(args)
    trace = None
    if args.trace is not None:
        try:
            trace = load_trace(args.trace)
        except TraceError as error:
            raise SystemExit(f"loadgen: {error}") from None
        missing = sorted({r.tenant for r in trace} - set(keys))
        if missing and keys and not args.api_key:
            print(
                f"loadgen: no key for tenant(s) {', '.join(missing)}; sending without one",
                file=sys.stderr,
            )
    tenants = args.tenant or sorted(keys) or ["default"]
    rate = args.rate
    concurrency = args.concurrency
    if args.sweep_rates:
        rate = args.sweep_rates[0]
    if args.sweep_concurrency:
        concurrency = int(args.sweep_concurrency[0])
    try:
        return LoadConfig(
            base_url=args.base_url,
            model=args.model,
            api_key=args.api_key
            or os.environ.get("LOADGEN_API_KEY")
            or os.environ.get("OPENAI_API_KEY"),
            tenant_keys=keys,
            endpoint=args.endpoint,
            trace=trace,
            time_scale=args.time_scale,
            rate=rate,
            concurrency=concurrency,
            tenants=tenants,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            num_requests=args.num_requests,
            duration_s=args.duration,
            forever=args.forever,
            max_concurrency=args.max_concurrency,
            slo=Slo(ttft_s=args.slo_ttft_ms / 1000, tpot_s=args.slo_tpot_ms / 1000),
            metrics_urls=args.metrics_url,
            energy_metric_names=tuple(args.energy_metric) or ENERGY_METRIC_NAMES,
            timeout_s=args.timeout,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            report_interval_s=args.report_interval,
            show_progress=not args.no_progress,
        )
    except ValueError as error:
        raise SystemExit(f"loadgen: {error}") from None


async def _main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.wait_ready > 0:
        key = config.api_key or next(iter(config.tenant_keys.values()), None)
        await asyncio.to_thread(
            wait_until_served,
            base_url=config.base_url,
            model=config.model,
            api_key=key,
            timeout_s=args.wait_ready,
        )
    plots = not args.no_plots
    if args.sweep_rates or args.sweep_concurrency:
        if args.forever:
            raise SystemExit("loadgen: a sweep cannot run forever")
        parameter = "rate" if args.sweep_rates else "concurrency"
        values = args.sweep_rates or args.sweep_concurrency
        sweep = await run_sweep(config, parameter, values, goodput_target=args.goodput_target)
        print(sweep_table(sweep))
        if args.out:
            write_sweep(args.out, sweep, plots=plots)
            print(f"results in {args.out}", file=sys.stderr)
        successes = sum(result.summary["successes"] for _, result in sweep.steps)
        return 0 if successes else 2

    on_report = None
    if args.forever and args.out:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)

        def on_report(summary: dict[str, Any]) -> None:
            snapshot = {"config": config.describe(), "summary": summary}
            temporary = out / "summary.json.tmp"
            temporary.write_text(json.dumps(snapshot, indent=2, default=str) + "\n")
            temporary.replace(out / "summary.json")

    result = await run_load(config, on_report=on_report, handle_signals=True)
    print(summary_table(result.summary))
    if args.out:
        write_run(args.out, result, plots=plots)
        print(f"results in {args.out}", file=sys.stderr)
    return 0 if result.summary["successes"] or args.forever else 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
