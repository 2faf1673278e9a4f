"""What accelerator this agent drives: the GPU via NVML where present, else the CPU; and
the memory it offers its engines (the control plane places versions by it: docs/capacity.md).

memory_total_bytes and memory_available_bytes are the device's (NVML's total and free, or
/proc/meminfo's MemTotal and MemAvailable) when the agent starts; memory_offered_bytes is
the total, capped by --memory-limit-bytes.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meminfo() -> dict[str, int]:
    """/proc/meminfo's MemTotal and MemAvailable in bytes (those it has)."""
    found = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                found[name] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return found


def _cpu_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_inventory(gpu_index: int) -> dict[str, Any] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {
            "kind": "gpu",
            "accelerator": _text(pynvml.nvmlDeviceGetName(handle)),
            "gpu_index": gpu_index,
            "gpu_uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
            "memory_bytes": int(memory.total),
            "memory_total_bytes": int(memory.total),
            "memory_available_bytes": int(memory.free),
            "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
            "gpu_count": int(pynvml.nvmlDeviceGetCount()),
        }
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def cpu_inventory() -> dict[str, Any]:
    memory = _meminfo()
    total = memory.get("MemTotal", 0)
    return {
        "kind": "cpu",
        "accelerator": _cpu_model(),
        "memory_bytes": total or None,
        "memory_total_bytes": total,
        "memory_available_bytes": memory.get("MemAvailable", total),
        "driver": None,
    }


def accelerator_inventory(gpu_index: int, memory_limit_bytes: int | None = None) -> dict[str, Any]:
    inventory = gpu_inventory(gpu_index) or cpu_inventory()
    inventory["cpu_model"] = _cpu_model()
    inventory["cpu_cores"] = _cpu_cores()
    inventory["platform"] = platform.platform()
    total = inventory["memory_total_bytes"]
    inventory["memory_offered_bytes"] = (
        total if memory_limit_bytes is None else min(total, memory_limit_bytes)
    )
    return inventory
