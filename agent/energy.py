"""Cumulative energy, from the best source the machine offers.

1. NVML: the GPU's total energy counter (nvmlDeviceGetTotalEnergyConsumption, mJ).
2. RAPL: Linux powercap package counters (`intel-rapl:N/energy_uj`, also used by AMD),
   which wrap at `max_energy_range_uj`.
3. An estimate: CPU seconds of the engine process tree x a configured watts per core,
   labelled `estimate` wherever it is shown.

Every meter reports joules since the meter was created, so all sources start at 0.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from contracts.streams import EnergySource

logger = logging.getLogger(__name__)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PACKAGE_ZONE = re.compile(r"^intel-rapl:\d+$")  # top-level zones only: sub-zones are inside them


class EnergyUnavailable(RuntimeError):
    pass


class EnergyMeter(Protocol):
    source: EnergySource

    def joules(self) -> float:
        """Joules consumed since this meter was created (never decreases)."""


class NvmlEnergyMeter:
    source = EnergySource.NVML

    def __init__(self, gpu_index: int) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml: Any = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
            self._start_mj = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception as exc:  # library missing, no device, or counter unsupported
            raise EnergyUnavailable(f"NVML energy counter unavailable: {exc}") from exc

    def joules(self) -> float:
        now_mj = int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        return max(0, now_mj - self._start_mj) / 1000.0


@dataclass
class _RaplZone:
    energy_path: Path
    max_range_uj: int
    last_uj: int


class RaplEnergyMeter:
    source = EnergySource.RAPL

    def __init__(self, root: Path) -> None:
        zones: list[_RaplZone] = []
        candidates = sorted(root.glob("intel-rapl*")) if root.is_dir() else []
        for zone_dir in candidates:
            if not PACKAGE_ZONE.fullmatch(zone_dir.name):
                continue
            try:
                energy = int((zone_dir / "energy_uj").read_text().strip())
                max_range = int((zone_dir / "max_energy_range_uj").read_text().strip())
            except (OSError, ValueError):
                continue  # not readable (often root-only) or not a counter
            zones.append(_RaplZone(zone_dir / "energy_uj", max_range, energy))
        if not zones:
            raise EnergyUnavailable(f"no readable RAPL package counters under {root}")
        self._zones = zones
        self._total_uj = 0

    def joules(self) -> float:
        for zone in self._zones:
            try:
                now = int(zone.energy_path.read_text().strip())
            except (OSError, ValueError):
                continue
            if now >= zone.last_uj:
                delta = now - zone.last_uj
            else:  # the counter wrapped at max_energy_range_uj
                delta = zone.max_range_uj - zone.last_uj + now
            zone.last_uj = now
            self._total_uj += delta
        return self._total_uj / 1e6


def _read_process_table(proc: Path) -> dict[int, tuple[int, int, float]]:
    """pid -> (parent pid, start time in ticks, CPU seconds user+system)."""
    table: dict[int, tuple[int, int, float]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        rest = raw[raw.rfind(")") + 2 :].split()
        if len(rest) < 20:
            continue
        parent, user_ticks, system_ticks, start_ticks = (
            int(rest[1]),
            int(rest[11]),
            int(rest[12]),
            int(rest[19]),
        )
        table[int(entry.name)] = (parent, start_ticks, (user_ticks + system_ticks) / CLOCK_TICKS)
    return table


@dataclass
class CpuTimeEnergyEstimate:
    """Energy estimated from the CPU time of the given process trees."""

    root_pids: Callable[[], Sequence[int]]
    watts_per_core: float
    proc: Path = Path("/proc")
    source: EnergySource = EnergySource.ESTIMATE
    _last_cpu: dict[tuple[int, int], float] = field(default_factory=dict)
    _cpu_seconds: float = 0.0

    def cpu_seconds(self) -> float:
        roots = set(self.root_pids())
        if roots:
            table = _read_process_table(self.proc)
            children: dict[int, list[int]] = {}
            for pid, (parent, _, _) in table.items():
                children.setdefault(parent, []).append(pid)
            seen: dict[tuple[int, int], float] = {}
            stack = [pid for pid in roots if pid in table]
            while stack:
                pid = stack.pop()
                _, start, cpu = table[pid]
                seen[(pid, start)] = cpu
                stack.extend(children.get(pid, []))
            for key, cpu in seen.items():
                self._cpu_seconds += max(0.0, cpu - self._last_cpu.get(key, 0.0))
            # Processes that exited take their last, unsampled increment with them.
            self._last_cpu = seen
        return self._cpu_seconds

    def joules(self) -> float:
        return self.cpu_seconds() * self.watts_per_core


def choose_energy_meter(
    *,
    preference: str,
    gpu_index: int,
    rapl_root: Path,
    watts_per_core: float,
    root_pids: Callable[[], Sequence[int]],
) -> EnergyMeter:
    """The first source that works, in the order NVML, RAPL, estimate (or the one asked for)."""
    order = ["nvml", "rapl", "estimate"] if preference == "auto" else [preference]
    problems = []
    for name in order:
        try:
            if name == "nvml":
                return NvmlEnergyMeter(gpu_index)
            if name == "rapl":
                return RaplEnergyMeter(rapl_root)
            return CpuTimeEnergyEstimate(root_pids=root_pids, watts_per_core=watts_per_core)
        except EnergyUnavailable as exc:
            problems.append(str(exc))
    raise EnergyUnavailable("; ".join(problems))
