"""The kernel tests again for every older instruction set this CPU can also execute.

The C has four code paths (AMX tiles beside AVX-512 with bf16 dot products; those dot
products alone; AVX-512F; AVX2), and a machine builds only the one of its own CPU. The
older ones are built for `cooperlake`, `skylake-avx512` and `haswell` through
FLEET_ENGINE_KERNEL_ARCH, and the kernel tests run against each in a child pytest."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.models import decode_attention
from tests.conftest import REPO_ROOT, child_environment

CPU = set(decode_attention.cpu_flags().split())
TARGETS = {
    # -march name: the CPU flags its code needs
    "cooperlake": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
    "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "haswell": {"avx2", "fma"},
}


def native_path() -> str:
    """The target whose code path a native build takes on this CPU."""
    if "amx_tile" in CPU and "amx_bf16" in CPU:
        return "native: AMX"
    for arch in TARGETS:  # the newest first
        if TARGETS[arch] <= CPU:
            return arch
    return "none"


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_kernels_built_for_an_older_target(arch: str):
    if not TARGETS[arch] <= CPU:
        pytest.skip(f"this CPU cannot execute {arch} code")
    if native_path() == arch:
        pytest.skip(f"{arch} is this CPU's own path: the plain run covers it")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "tests/engine/test_attention.py",
        ],
        cwd=REPO_ROOT,
        env=child_environment(FLEET_ENGINE_KERNEL_ARCH=arch),
        capture_output=True,
        text=True,
        timeout=240,
    )
    summary = result.stdout.strip().splitlines()[-1:] or [result.stderr[-2000:]]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in summary[0] and "skipped" not in summary[0], summary[0]


def test_target_arch_is_validated(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_ENGINE_KERNEL_ARCH", "haswell; rm -rf /")
    with pytest.raises(ValueError, match="not a GCC -march name"):
        decode_attention.target_arch()
    monkeypatch.setenv("FLEET_ENGINE_KERNEL_ARCH", "")
    assert decode_attention.target_arch() == "native"
