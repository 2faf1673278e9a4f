"""Wait until the target serves the model, before any load is sent: a stack that is still
starting (no engine routed yet) would otherwise count as errors of the run."""

from __future__ import annotations

import sys
import time

import httpx

PROGRESS_EVERY_S = 10.0


def is_model_listed(base_url: str, model: str, api_key: str | None) -> bool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/models", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return False
    if response.status_code != 200:
        return False
    try:
        listed = {entry.get("id") for entry in response.json().get("data", [])}
    except (ValueError, AttributeError):
        return False
    return model in listed


def wait_until_served(
    *, base_url: str, model: str, api_key: str | None, timeout_s: float, interval_s: float = 1.0
) -> None:
    """Return once `GET /models` lists `model`; SystemExit after `timeout_s`."""
    started = time.monotonic()
    next_progress = started + PROGRESS_EVERY_S
    while not is_model_listed(base_url, model, api_key):
        now = time.monotonic()
        if now - started >= timeout_s:
            raise SystemExit(f"loadgen: {model} not served at {base_url} after {timeout_s:.0f} s")
        if now >= next_progress:
            print(f"loadgen: waiting for {model} at {base_url} ({now - started:.0f} s)",
                  file=sys.stderr)  # fmt: skip
            next_progress = now + PROGRESS_EVERY_S
        time.sleep(interval_s)
