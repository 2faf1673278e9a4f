#!/usr/bin/env bash
# Make sure the dashboard's browser tests can run: Debian's headless Chromium at
# /usr/bin/chromium and Playwright's Python package (used only as a driver for that
# Chromium; `playwright install` is never run, no browser is downloaded from elsewhere).
#
# Idempotent: does nothing when both are present. Needs root (or sudo) for apt-get.
set -euo pipefail

PLAYWRIGHT_VERSION="${PLAYWRIGHT_VERSION:-1.65.2}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"

if [ ! -x /usr/bin/chromium ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        SUDO="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
fi
/usr/bin/chromium --version

if ! "$PYTHON" -c "import playwright" 2>/dev/null; then
    "$PYTHON" -m pip install "playwright==${PLAYWRIGHT_VERSION}"
fi
"$PYTHON" -c "import importlib.metadata as m; print('playwright', m.version('playwright'))"
