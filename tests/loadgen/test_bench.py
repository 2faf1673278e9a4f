"""The bench runner: steps run in child processes and every outcome lands in the report."""

import importlib
import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench import engine_bench
from bench.__main__ import STEPS, declared_budget, run_step
from bench.engine_bench import measure_vllm, step_breakdown
from bench.engine_client import ServingResult
from bench.engine_vllm import unavailable
from bench.engine_workload import Options, make_workload
from bench.fidelity_bench import compare_ttft_p95_by_version, compare_usage
from bench.report import normalize_figure, render_markdown, target_met, write_report

STEPS_DIR = Path(__file__).parent / "bench_steps"


def judged(target, value, reference):
    return target_met(
        normalize_figure(
            {"name": "x", "value": value, "reference_value": reference, "target": target}
        )
    )


def test_targets_are_judged():
    assert judged("exact", 5, 5) is True
    assert judged("exact", 5, 6) is False
    assert judged("within 5%", 104, 100) is True
    assert judged("within 5%", 94, 100) is False
    assert judged("ratio >= 1.1", 120, 100) is True
    assert judged("value < 10", 12, None) is False
    assert judged("faster than last week", 1, 1) is None
    assert judged("within 5%", None, 100) is None
    figure = normalize_figure({"name": "x", "value": 3, "reference_value": 4, "target": ""})
    assert figure["ratio"] == 0.75


def test_steps_that_work_fail_hang_or_are_missing_are_all_reported(tmp_path):
    deadline = time.monotonic() + 120
    common: dict[str, Any] = {"package": "tests.loadgen.bench_steps", "package_dir": STEPS_DIR}
    good = run_step("good_bench", tmp_path, True, deadline, **common)
    failing = run_step("failing_bench", tmp_path, True, deadline, **common)
    hanging = run_step("hanging_bench", tmp_path, True, deadline, **common)
    no_run = run_step("norun_bench", tmp_path, True, deadline, **common)
    missing = run_step("absent_bench", tmp_path, True, deadline, **common)
    assert good["status"] == "ok"
    assert [f["met"] for f in good["figures"]] == [True, False]
    assert good["figures"][0]["ratio"] == pytest.approx(1.2)
    assert good["notes"] == ["quick=True"]
    assert good["plots"] == ["good_bench/plot.png"]
    assert failing["status"] == "failed"
    assert any("the engine would not start" in line for line in failing["log_tail"])
    assert hanging["status"] == "timeout"
    assert no_run["status"] == "not conforming"
    assert missing["status"] == "missing"

    report = {
        "timestamp": "t",
        "quick": True,
        "host": "h",
        "elapsed_s": 1.0,
        "modules": [good, failing, hanging, no_run, missing],
    }
    markdown, document = write_report(tmp_path, report)
    text = markdown.read_text()
    assert "| speed | 120 | tok/s | baseline | 100 | 1.2 | ratio >= 1.1 | yes |" in text
    assert "| tokens | 5 | tokens | client | 6 | 0.833 | exact | **no** |" in text
    assert "| failing_bench | failed |" in text
    assert "| hanging_bench | timeout |" in text
    assert "![plot](good_bench/plot.png)" in text
    assert json.loads(document.read_text())["modules"][4]["status"] == "missing"


def test_budgets_are_read_without_importing():
    assert declared_budget(STEPS_DIR / "hanging_bench.py", quick=True) == 6
    assert declared_budget(STEPS_DIR / "hanging_bench.py", quick=False) == 240


@pytest.mark.parametrize("step", STEPS)
def test_a_steps_budget_is_the_limit_the_runner_gives_it(step: str):
    """A step's BUDGET_S / QUICK_BUDGET_S must be written in its own module, where the
    runner reads them: an imported one is invisible there, and the step is stopped at the
    default limit while it measures for its own."""
    module = importlib.import_module(f"bench.{step}")
    path = Path(module.__file__ or "")
    for name, quick in (("BUDGET_S", False), ("QUICK_BUDGET_S", True)):
        if hasattr(module, name):
            assert declared_budget(path, quick=quick) == getattr(module, name), name


@pytest.mark.parametrize("quick", [False, True])
def test_the_engine_step_measures_within_its_limit(tmp_path, monkeypatch, quick: bool):
    budgets: list[float] = []

    def measured(options: Options) -> dict[str, Any]:
        budgets.append(options.budget_s)
        return {"figures": []}

    monkeypatch.setattr(engine_bench, "measure", measured)
    monkeypatch.setattr(engine_bench, "plot", lambda report, path: False)
    engine_bench.run(tmp_path, quick)
    limit = declared_budget(Path(engine_bench.__file__), quick=quick)
    assert budgets == [limit - engine_bench.STEP_MARGIN_S]


def test_fidelity_comparisons_join_by_request_id():
    client_ttft = {"a": 0.10, "b": 0.20, "c": 0.30, "d": 0.40}
    rows: list[dict[str, Any]] = [
        {"request_id": "a", "version": "v1", "ttft_s": 0.11},
        {"request_id": "b", "version": "v1", "ttft_s": 0.21},
        {"request_id": "c", "version": "v2", "ttft_s": 0.33},
        {"request_id": "x", "version": "v2", "ttft_s": 9.0},  # not ours: ignored
        {"request_id": "d", "version": "v2", "ttft_s": None},  # no TTFT: ignored
    ]
    v1, v2 = compare_ttft_p95_by_version(client_ttft, rows)
    # v1 p95 over [0.11, 0.21] = 0.11 + 0.95 * 0.10; client over [0.10, 0.20]
    assert v1["value"] == pytest.approx(0.205)
    assert v1["reference_value"] == pytest.approx(0.195)
    assert judged(v1["target"], v1["value"], v1["reference_value"]) is False
    assert (v2["value"], v2["reference_value"]) == (pytest.approx(0.33), pytest.approx(0.30))
    usage_rows = [
        {"request_id": "a", "prompt_tokens": 10, "completion_tokens": 5},
        {"request_id": "b", "prompt_tokens": 12, "completion_tokens": 7},
    ]
    prompt, completion = compare_usage({"a": (10, 5), "b": (12, 6)}, usage_rows)
    assert (prompt["value"], prompt["reference_value"]) == (22, 22)
    assert (completion["value"], completion["reference_value"]) == (12, 11)
    assert [normalize_figure(f)["met"] for f in (prompt, completion)] == [True, False]


def test_render_handles_a_skipped_figure():
    figure = normalize_figure(
        {"name": "gateway TTFT p95", "value": None, "target": "within 5%",
         "skipped": "gateway not available"}
    )  # fmt: skip
    text = render_markdown(
        {"timestamp": "t", "quick": False, "host": "h", "elapsed_s": 0.0,
         "modules": [{"name": "fidelity_bench", "status": "ok", "elapsed_s": 0.0,
                      "figures": [figure]}]}
    )  # fmt: skip
    assert "skipped: gateway not available" in text


def test_each_decode_run_meets_the_faster_read_beside_it():
    from bench.engine_inprocess import DecodeWindow, InProcessResult, KernelCeilings

    windows = [  # 0.2 GB at 100 tok/s is 20 GB/s: ratios 0.8, 0.5, 0.9, 0.4
        DecodeWindow(100.0, 25.0),
        DecodeWindow(100.0, 40.0),
        DecodeWindow(135.0, 30.0),
        DecodeWindow(80.0, 40.0),
    ]
    result = InProcessResult(
        decode_rates=[100.0, 150.0, 120.0],
        bandwidths=[25.0, 30.0, 60.0, 24.0],  # GB/s; one read caught a fast moment
        windows=windows,
        weight_bytes=200_000_000,
        prefill_seconds=0.1,
        # The figures checked here do not read the kernel ceilings.
        ceilings=KernelCeilings(
            layer_params=0, head_params=0, batched_flops=0.0, batched_rows=0, gemv_seconds=0.0
        ),
        config=None,
        model=None,
    )
    # 100 tok/s x 0.2 GB = 20 GB/s against 30; 30 against 60; 24 against 60
    assert result.round_ratios() == pytest.approx([20 / 30, 30 / 60, 24 / 60])
    assert result.decode_rate == 150.0
    # the headline: the window of the median ratio, the lower of the middle two
    assert result.median_window() is windows[1]
    assert windows[1].ratio(result.weight_bytes) == pytest.approx(0.5)
    result.windows = windows[:3]
    assert result.median_window() is windows[0]


def test_the_serving_runs_steps_are_told_by_the_way_they_ran():
    before = {"steps": {"mixed": 2, "decode": 1}, "step_seconds": {"mixed": 0.5, "decode": 0.1}}
    after = {
        "steps": {"mixed": 12, "decode": 1, "graph": 40},
        "step_seconds": {"mixed": 2.5, "decode": 0.1, "graph": 0.2},
    }
    assert step_breakdown(before, after) == (
        "graph 40 in 0.2s (5.0 ms each), mixed 10 in 2.0s (200.0 ms each)"
    )
    assert step_breakdown({}, {}) == "none recorded"


def test_the_ingest_profile_names_functions_that_exist():
    """A phase whose function moved would read 0 % instead of failing."""
    import ast

    from bench.ingest_bench import PHASES, REPO_ROOT

    for label, suffix, function in PHASES:
        if not suffix.startswith(("telemetry/", "fleet/", "core/")):
            continue  # a library's file
        path = REPO_ROOT / "controlplane" / suffix
        names = {
            node.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        assert function in names, f"{label.strip()}: no {function} in {path}"


def test_the_vllm_reference_says_why_it_is_skipped(tmp_path, monkeypatch):
    # an empty cache: the engines' environments are not built there
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    reason = unavailable(Options())
    assert reason is not None and "ensure_engine_env.sh vllm" in reason
    assert str(tmp_path) in reason
    assert unavailable(Options(dtype="int8")) is not None


def test_a_skipped_vllm_reference_is_printed_and_noted(capsys):
    workload = make_workload(2, (4, 8), (2, 4))
    notes: list[str] = []
    served = ServingResult(1.0, 6, 2)
    assert measure_vllm(Options(no_vllm="--no-vllm given"), workload, served, notes) == (
        None,
        "--no-vllm given",
    )
    assert notes == ["vLLM reference skipped: --no-vllm given"]
    assert "vLLM reference: skipped: --no-vllm given" in capsys.readouterr().out
    # nothing served by the engine: nothing for vLLM to serve either
    _, reason = measure_vllm(Options(), workload, ServingResult(1.0, 0, 0), [])
    assert reason is not None


def test_the_placement_bench_counts_each_replica_loaded_or_explained():
    from bench.placement_bench import Fleet, PassResult, misrouted, unaccounted_replicas
    from controlplane.rollouts.reconciler import ReconcileReport

    fleet = Fleet(deployment_ids=[1, 2], replicas={1: {10: 2, 11: 1}, 2: {20: 3}}, rollouts=1)
    first = PassResult(
        seconds=1.0,
        queries=10,
        cpu_seconds=0.5,
        reports=[
            ReconcileReport(
                deployment="a",
                revision=1,
                loads=[("agent-1", 10), ("agent-2", 10)],
                unplaced=["version 11 needs 8.00 GiB; largest spare agent agent-3 offers 4 GiB"],
            ),
            ReconcileReport(deployment="b", revision=1, loads=[("agent-4", 20)]),
        ],
    )
    assert first.loads == 3
    assert unaccounted_replicas(fleet, first) == ["b: version 20 1 of 3"]
    steady = PassResult(
        seconds=0.1,
        queries=5,
        cpu_seconds=0.05,
        reports=[
            ReconcileReport(deployment="a", revision=1, endpoints={10: ["x", "y"], 11: ["z"]}),
            ReconcileReport(deployment="b", revision=1, endpoints={20: ["u"]}),
        ],
    )
    assert misrouted(fleet, steady) == ["b: routed {20: 1}, asked {20: 3}"]
    from bench.__main__ import PACKAGE_DIR, STEPS

    assert "placement_bench" in STEPS
    assert declared_budget(PACKAGE_DIR / "placement_bench.py", quick=True) == 90
