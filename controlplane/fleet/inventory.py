"""An agent's inventory as it registers it: free-form description (accelerator, driver,
platform) plus the figures placement reads, which are checked here (docs/capacity.md)."""

from __future__ import annotations

from typing import Any

from controlplane.core.errors import DomainError

MEMORY_FIELDS = ("memory_total_bytes", "memory_available_bytes", "memory_offered_bytes")
MAX_BYTES = 2**60  # far past any device; bounds what a bad agent can claim
MAX_CPU_CORES = 1 << 16


def inventory_validate(inventory: dict[str, Any]) -> dict[str, Any]:
    """The inventory, unchanged, or DomainError("invalid_inventory") naming each bad
    figure. The memory figures come together or not at all (an agent that reports none
    is offered no version whose footprint is known); offered and available are at most
    the total."""
    problems: dict[str, list[str]] = {}

    def whole(name: str, high: int) -> int | None:
        value = inventory.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            problems[name] = [f"Must be an integer between 0 and {high}."]
            return None
        return value

    present = [name for name in MEMORY_FIELDS if name in inventory]
    if present and len(present) != len(MEMORY_FIELDS):
        for name in sorted(set(MEMORY_FIELDS) - set(present)):
            problems[name] = ["Required with the other memory figures."]
    elif present:
        total = whole("memory_total_bytes", MAX_BYTES)
        for name in ("memory_available_bytes", "memory_offered_bytes"):
            value = whole(name, MAX_BYTES)
            if total is not None and value is not None and value > total:
                problems[name] = [f"Must be at most memory_total_bytes ({total})."]
    if "cpu_cores" in inventory:
        cores = whole("cpu_cores", MAX_CPU_CORES)
        if cores == 0:
            problems["cpu_cores"] = ["Must be at least 1."]
    if problems:
        raise DomainError(
            "invalid_inventory",
            "The agent's inventory is not valid: " + "; ".join(sorted(problems)) + ".",
            fields={"inventory": problems},
        )
    return inventory


def memory_offered(inventory: Any) -> int:
    """The bytes an agent offers its engines: 0 when it reported none."""
    value = inventory.get("memory_offered_bytes") if isinstance(inventory, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def memory_total(inventory: Any) -> int:
    """The device's memory as the agent reported it: 0 when it reported none."""
    value = inventory.get("memory_total_bytes") if isinstance(inventory, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def device_key(*, host: str, inventory: Any) -> str:
    """What agents sharing memory have in common: a GPU's UUID, else the host (CPU agents
    on one host share its RAM)."""
    uuid = inventory.get("gpu_uuid") if isinstance(inventory, dict) else None
    if isinstance(uuid, str) and uuid:
        return f"gpu:{uuid}"
    return f"host:{host}"
