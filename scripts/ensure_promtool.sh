#!/usr/bin/env bash
# Make sure promtool is on PATH for the alert-rule and scrape-config checks
# (tests/deploy/test_observability.py): Debian's `prometheus` package provides it.
#
# Idempotent: does nothing when promtool is present. Needs root (or sudo) for apt-get.
set -euo pipefail

if ! command -v promtool >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        SUDO="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends prometheus
fi
promtool --version 2>&1 | head -n 1
