"""`python -m bench` (`make bench`): run every benchmark step and write one report.

Steps are the modules in STEPS, found in this package; each runs in a child process
(`python -m bench --run-module NAME`) with a time limit, so a step that is missing,
raises, hangs or crashes is reported as such and the others still run. Results go to
bench/results/<timestamp>/ (ignored by git): report.md, report.json and one folder per
step with its plots and log.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.report import normalize_figure, write_report

PACKAGE_DIR = Path(__file__).resolve().parent
STEPS = (
    "engine_bench",
    "gateway_bench",
    "ingest_bench",
    "rollback_bench",
    "fidelity_bench",
    "placement_bench",
    "spec_bench",
)
TOTAL_BUDGET_S = 840.0  # `make bench` must finish within 15 minutes on two cores
DEFAULT_BUDGET_S = 240.0
DEFAULT_QUICK_BUDGET_S = 120.0
NOT_CONFORMING = 3  # the child's exit status for a module without run()


def declared_budget(path: Path, quick: bool) -> float:
    """A module's own `BUDGET_S` / `QUICK_BUDGET_S`, read without importing it."""
    name = "QUICK_BUDGET_S" if quick else "BUDGET_S"
    default = DEFAULT_QUICK_BUDGET_S if quick else DEFAULT_BUDGET_S
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return default
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if name in names and isinstance(node.value, ast.Constant):
                value = node.value.value
                if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                    return float(value)
    return default


def run_module_here(module_name: str, out_dir: Path, quick: bool) -> int:
    """The child side: import one step (`bench.<name>` or a dotted path), run it, write
    result.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dotted = module_name if "." in module_name else f"bench.{module_name}"
    try:
        module = importlib.import_module(dotted)
        if not callable(getattr(module, "run", None)):
            print(f"{dotted} has no run(out_dir, quick) -> dict", file=sys.stderr)
            return NOT_CONFORMING
        result = module.run(out_dir=out_dir, quick=quick)
        if not isinstance(result, dict):
            raise TypeError(f"run() returned {type(result).__name__}, expected dict")
    except Exception:
        traceback.print_exc()
        return 1
    (out_dir / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


def _tail(path: Path, lines: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def run_step(
    name: str,
    out_dir: Path,
    quick: bool,
    deadline: float,
    *,
    package: str = "bench",
    package_dir: Path = PACKAGE_DIR,
) -> dict[str, Any]:
    """Run one step in a child process and return its report entry; never raises."""
    path = package_dir / f"{name}.py"
    entry: dict[str, Any] = {"name": name, "elapsed_s": 0.0, "figures": []}
    if not path.exists():
        return entry | {"status": "missing", "reason": f"{path.name} is not there yet"}
    step_dir = out_dir / name
    step_dir.mkdir(parents=True, exist_ok=True)
    timeout = min(declared_budget(path, quick), deadline - time.monotonic())
    if timeout < 5:
        return entry | {"status": "not run", "reason": "the total time budget is spent"}
    module = f"{package}.{name}"
    command = [sys.executable, "-m", "bench", "--run-module", module, "--out", str(step_dir)]
    command += ["--quick"] if quick else []
    log_path = step_dir / "log.txt"
    print(f"bench: {name} (limit {timeout:.0f}s)", file=sys.stderr, flush=True)
    started = time.monotonic()
    with log_path.open("wb") as log:
        child = subprocess.Popen(
            command,
            cwd=PACKAGE_DIR.parent,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(child)
            code = None
    entry["elapsed_s"] = time.monotonic() - started
    if code is None:
        return entry | {
            "status": "timeout",
            "reason": f"stopped after {timeout:.0f}s",
            "log_tail": _tail(log_path),
        }
    result_path = step_dir / "result.json"
    if code == NOT_CONFORMING:
        return entry | {
            "status": "not conforming",
            "reason": f"{path.name} has no run(out_dir, quick) -> dict (docs/loadgen.md)",
        }
    if code != 0 or not result_path.exists():
        return entry | {
            "status": "failed",
            "reason": f"exit status {code}",
            "log_tail": _tail(log_path),
        }
    result = json.loads(result_path.read_text())
    figures = [normalize_figure(f) for f in result.get("figures", [])]
    entry |= {
        "figures": figures,
        "notes": [str(n) for n in result.get("notes", [])],
        "plots": [f"{name}/{p}" for p in result.get("plots", [])],
    }
    if result.get("skipped"):
        return entry | {"status": "skipped", "reason": str(result["skipped"])}
    return entry | {"status": "ok"}


def _stop_group(child: subprocess.Popen[bytes]) -> None:
    # The step's own children (engines, servers) share its session: stop them too.
    for signum, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller runs of every step")
    parser.add_argument("--out", type=Path, help="results folder (default: a timestamped one)")
    parser.add_argument("--only", action="append", choices=STEPS, help="run only these steps")
    parser.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="total seconds")
    parser.add_argument("--run-module", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_module:
        return run_module_here(args.run_module, args.out, args.quick)

    timestamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.out or PACKAGE_DIR / "results" / timestamp
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.budget
    modules = [run_step(name, out_dir, args.quick, deadline) for name in args.only or STEPS]
    report = {
        "timestamp": timestamp,
        "quick": args.quick,
        "host": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "elapsed_s": time.monotonic() - started,
        "modules": modules,
    }
    markdown, _ = write_report(out_dir, report)
    print(markdown.read_text())
    print(f"bench: report in {markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
