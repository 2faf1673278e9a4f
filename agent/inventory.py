"""What accelerator this agent drives: the GPU via NVML where present, else the CPU."""

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


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


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
            "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
            "gpu_count": int(pynvml.nvmlDeviceGetCount()),
        }
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def cpu_inventory() -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "kind": "cpu",
        "accelerator": _cpu_model(),
        "cpu_cores": cores,
        "memory_bytes": _memory_bytes(),
        "driver": None,
    }


def accelerator_inventory(gpu_index: int) -> dict[str, Any]:
    inventory = gpu_inventory(gpu_index) or cpu_inventory()
    inventory["cpu_model"] = _cpu_model()
    inventory["platform"] = platform.platform()
    return inventory
