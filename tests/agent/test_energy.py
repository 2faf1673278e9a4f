"""Energy sources: RAPL counters (a powercap tree on disk, wrap-around included) and the
CPU-time estimate of a real process tree."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.energy import (
    CpuTimeEnergyEstimate,
    EnergyUnavailable,
    RaplEnergyMeter,
    choose_energy_meter,
)
from contracts.streams import EnergySource


def make_zone(root: Path, name: str, energy_uj: int, max_range_uj: int) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_range_uj}\n")
    return zone


def test_rapl_sums_package_zones_and_handles_wrap_around(tmp_path: Path) -> None:
    package0 = make_zone(tmp_path, "intel-rapl:0", 900_000, 1_000_000)
    package1 = make_zone(tmp_path, "intel-rapl:1", 100, 1_000_000)
    make_zone(tmp_path, "intel-rapl:0:0", 5, 1_000_000)  # a sub-zone: inside package 0
    meter = RaplEnergyMeter(tmp_path)
    assert meter.source is EnergySource.RAPL
    assert meter.joules() == 0.0
    (package0 / "energy_uj").write_text("950000\n")  # +50,000 uJ
    (package1 / "energy_uj").write_text("200\n")  # +100 uJ
    assert meter.joules() == pytest.approx(0.0501)
    (package0 / "energy_uj").write_text("50000\n")  # wrapped: +50,000 to the top, +50,000
    assert meter.joules() == pytest.approx(0.1501)


def test_rapl_without_readable_counters_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(EnergyUnavailable, match="no readable RAPL"):
        RaplEnergyMeter(tmp_path / "missing")


def test_estimate_counts_cpu_time_of_the_whole_process_tree() -> None:
    # A parent that sleeps and a child that burns CPU: the child's time counts.
    burner = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\n"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burner!r}])",
        ]
    )
    try:
        meter = CpuTimeEnergyEstimate(root_pids=lambda: [parent.pid], watts_per_core=10.0)
        assert meter.source is EnergySource.ESTIMATE
        readings = []
        while parent.poll() is None:
            readings.append(meter.joules())
            time.sleep(0.1)
    finally:
        parent.wait(timeout=30)
    assert readings == sorted(readings)  # cumulative: never decreases
    assert readings[-1] > 3.0  # most of 1.5 CPU seconds x 10 W, sampled every 0.1 s


def test_auto_falls_back_to_the_estimate_without_nvml_or_rapl(tmp_path: Path) -> None:
    meter = choose_energy_meter(
        preference="auto",
        gpu_index=0,
        rapl_root=tmp_path,
        watts_per_core=15.0,
        root_pids=list,
    )
    assert meter.source is EnergySource.ESTIMATE
    assert meter.joules() == 0.0
    make_zone(tmp_path, "intel-rapl:0", 10, 100)
    rapl = choose_energy_meter(
        preference="auto", gpu_index=0, rapl_root=tmp_path, watts_per_core=15.0, root_pids=list
    )
    assert rapl.source is EnergySource.RAPL
