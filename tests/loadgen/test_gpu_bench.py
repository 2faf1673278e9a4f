"""The GPU benchmark's smoke mode: the whole path on a CPU, and the files it writes."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SHAPE_FIGURES = [
    "tiny: serving throughput (8 requests, 4 in flight, HTTP)",
    "tiny: serving throughput, absolute (8 requests, 4 in flight, HTTP)",
    "tiny: single-stream decode (decode steps)",
    "tiny: TTFT p50, 4 simultaneous 16-token prompts (HTTP)",
    "tiny: serving in-process, unprofiled steps",
]


def test_smoke_run_writes_figures_summary_and_profile(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "bench.gpu_bench", "--smoke", "--out", str(out)]
    command += ["--models-dir", str(tmp_path / "models")]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    figures = json.loads((out / "figures.json").read_text())
    assert figures["smoke"] is True
    assert len(figures["commit"]) == 40
    assert {"date", "device", "torch", "transformers", "dirty"} <= figures.keys()
    names = [f["name"] for f in figures["figures"]]
    assert names == SHAPE_FIGURES
    serving = figures["figures"][0]
    assert serving["value"] > 0 and serving["reference_value"] > 0
    assert serving["ratio"] == serving["value"] / serving["reference_value"]
    tiny = figures["shapes"]["tiny"]
    # ignore_eos: every request runs to its limit, over HTTP and in HF alike
    useful = tiny["workload"]["useful_tokens"]
    assert tiny["serving"]["tokens"] == useful
    assert tiny["serving"]["submitted"] == 8
    # graphs are CUDA's: the served engine on CPU captures none, and says so
    assert tiny["serving"]["graphs"] == {"decode": 0, "step": 0, "attention": "torch"}
    assert {size: row["tokens"] for size, row in tiny["reference"].items()} == {
        "2": useful, "8": useful,
    }  # fmt: skip
    assert tiny["profile"]["useful_tokens"] == useful
    assert tiny["ttft"]["prompts"] == 4
    assert tiny["decode"]["ratio"] > 0
    # both attention backends on the same engine's steps (Triton through its interpreter)
    decode, mixed = tiny["attention"]
    assert decode["rows"] == 6 and decode["paths"] == ["decode"] and decode["chunk"] == 0
    assert mixed["rows"] == 6 and mixed["paths"] == ["mixed"] and mixed["chunk"] == 12
    for compared in (decode, mixed):
        assert compared["triton_ms"] > 0 and compared["torch_ms"] > 0
        assert "step_graphs_ms" not in compared  # CUDA only
    # every CUDA-only piece says why it did not run
    assert any(s.startswith("device bandwidth skipped: no CUDA device") for s in figures["skipped"])
    assert any("profiler CUDA activity skipped" in s for s in figures["skipped"])

    profile = json.loads((out / "profile.json").read_text())["tiny"]
    assert profile["profiled_steps"] == 3
    assert set(profile["ops"]["groups"]) == {
        "linear", "attention", "copies", "sampling", "cuda_runtime", "host_python", "other",
    }  # fmt: skip
    assert set(profile["phases"]["phases"]) == {
        "schedule", "prepare", "forward_launch", "forward_wait", "sample", "append",
    }  # fmt: skip
    assert profile["ops"]["groups"]["linear"]["host_ms_per_step"] > 0
    trace = json.loads(gzip.decompress((out / "profile_trace_tiny.json.gz").read_bytes()))
    assert trace["traceEvents"]

    summary = (out / "summary.txt").read_text()
    assert "RATIO serving engine/best HF" in summary
    assert "attention, steps of 6 decode rows (context" in summary
    assert "attention, steps of 6 decode rows beside a 12-token prompt" in summary
    assert "== figures (targets are printed, never asserted)" in summary
    assert "step phases over" in (out / "profile.txt").read_text()
