"""Run one pytest selection N times, each in a fresh process, and count each test's failures.

    python scripts/flake_hunt.py --runs 10 -- -k "gateway or usage"
    make flake-hunt RUNS=30 SELECTION='-k "gateway or usage"'

Every run is a new `pytest` process (fresh engines, gateways and Django state), so a
test that passes only because an earlier run warmed something up is not hidden. Runs do
not stop at the first failure and nothing is rerun: a flaky test shows as a failure
count below the run count. The summary lists every test that failed at least once, with
its count and the first line of its last failure; `--report` writes the whole tally as
JSON. Exit status: 0 when every run passed, 1 when any test failed or errored, 2 when a
run collected nothing or pytest itself could not run.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class TestTally:
    runs: int = 0
    failures: int = 0
    skips: int = 0
    slowest_s: float = 0.0  # its longest run: a test near a timeout shows here first
    last_message: str = ""
    failed_in: list[int] = field(default_factory=list)


def parse_junit(path: Path) -> dict[str, tuple[str, str, float]]:
    """test id -> (outcome, first line of any failure, seconds) from pytest's JUnit XML."""
    outcomes: dict[str, tuple[str, str, float]] = {}
    root = ElementTree.parse(path).getroot()  # noqa: S314 - our own pytest's output
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                lines = (child.get("message") or child.text or "").strip().splitlines()
                message = lines[0][:200] if lines else child.tag
                break
            if child.tag == "skipped":
                outcome = "skipped"
        seconds = float(case.get("time") or 0)
        # A test that failed in its call and errored in teardown appears twice: keep the worst.
        if outcomes.get(test_id, ("passed", "", 0.0))[0] != "failed":
            outcomes[test_id] = (outcome, message, seconds)
    return outcomes


def run_once(pytest_args: list[str], junit: Path, log: Path) -> int:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",  # no --lf/--ff state carried from one run to the next
        "-q",
        f"--junitxml={junit}",
        *pytest_args,
    ]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT)
        try:
            return process.wait()
        except KeyboardInterrupt:
            # pytest tears its fixtures down on SIGINT: engines and gateways are stopped.
            process.send_signal(signal.SIGINT)
            process.wait(timeout=120)
            raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a pytest selection N times in fresh processes; count failures per test.",
        epilog="Arguments after -- go to pytest, e.g. -- -k 'gateway or usage' tests/gateway",
    )
    parser.add_argument("--runs", type=int, default=10, help="how many runs (default 10)")
    parser.add_argument("--report", type=Path, help="write the tally as JSON to this file")
    parser.add_argument(
        "--logs", type=Path, help="keep each run's pytest output here (default: a temp folder)"
    )
    parser.add_argument("pytest_args", nargs="*", help="the selection, passed to pytest")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    logs = args.logs or Path(tempfile.mkdtemp(prefix="flake-hunt-"))
    logs.mkdir(parents=True, exist_ok=True)
    tallies: dict[str, TestTally] = {}
    failed_runs = 0
    selection = " ".join(args.pytest_args) or "(the whole suite)"
    print(f"flake hunt: {args.runs} runs of {selection}; logs in {logs}", flush=True)
    started = time.monotonic()
    for run in range(1, args.runs + 1):
        junit = logs / f"run-{run}.xml"
        log = logs / f"run-{run}.log"
        run_started = time.monotonic()
        status = run_once(args.pytest_args, junit, log)
        seconds = time.monotonic() - run_started
        if not junit.exists():
            print(f"run {run}: pytest wrote no report (exit {status}); see {log}", flush=True)
            return 2
        outcomes = parse_junit(junit)
        if not outcomes:
            print(f"run {run}: no tests collected (exit {status}); see {log}", flush=True)
            return 2
        failed = sorted(test for test, (outcome, *_) in outcomes.items() if outcome == "failed")
        for test, (outcome, message, test_seconds) in outcomes.items():
            tally = tallies.setdefault(test, TestTally())
            tally.runs += 1
            tally.slowest_s = max(tally.slowest_s, test_seconds)
            if outcome == "failed":
                tally.failures += 1
                tally.last_message = message
                tally.failed_in.append(run)
            elif outcome == "skipped":
                tally.skips += 1
        failed_runs += bool(failed) or status != 0
        passed = sum(1 for outcome, *_ in outcomes.values() if outcome == "passed")
        line = f"run {run}/{args.runs}: {passed} passed, {len(failed)} failed in {seconds:.0f} s"
        if failed:
            line += ": " + ", ".join(failed)
        elif status != 0:
            line += f" (pytest exit {status}; see {log})"
        print(line, flush=True)

    flaky = {test: tally for test, tally in tallies.items() if tally.failures}
    minutes = (time.monotonic() - started) / 60
    print(
        f"\n{args.runs} runs in {minutes:.1f} min: {len(tallies)} tests, "
        f"{args.runs - failed_runs} runs clean, {len(flaky)} tests failed at least once"
    )
    for test, tally in sorted(flaky.items(), key=lambda item: -item[1].failures):
        print(f"  {tally.failures}/{tally.runs}  {test}  (runs {tally.failed_in})")
        print(f"        last: {tally.last_message}")
    slowest = sorted(tallies.items(), key=lambda item: -item[1].slowest_s)[:5]
    print(
        "slowest (their longest run): " + ", ".join(f"{t} {v.slowest_s:.1f} s" for t, v in slowest)
    )
    if args.report:
        args.report.write_text(
            json.dumps(
                {
                    "selection": args.pytest_args,
                    "runs": args.runs,
                    "clean_runs": args.runs - failed_runs,
                    "tests": {test: tally.__dict__ for test, tally in sorted(tallies.items())},
                },
                indent=2,
            )
            + "\n"
        )
    return 1 if failed_runs else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
