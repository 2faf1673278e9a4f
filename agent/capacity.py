"""The agent's own check that a version fits the memory it offers (the control plane
places by the same figures; this refuses a load that would not fit all the same)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from contracts.capacity import gib
from contracts.commands import CommandRefused, LoadPayload


def load_fit_check(load: LoadPayload, inventory: Mapping[str, Any]) -> None:
    """CommandRefused("insufficient_memory") when the load's footprint is more than this
    agent offers. A load without a footprint (its artifact's headers did not say) passes."""
    offered = int(inventory.get("memory_offered_bytes") or 0)
    if load.footprint_bytes and load.footprint_bytes > offered:
        raise CommandRefused(
            "insufficient_memory",
            f"version {load.version_id} needs {gib(load.footprint_bytes)} "
            f"({load.footprint_bytes} bytes); this agent offers {gib(offered)} ({offered} bytes)",
        )
