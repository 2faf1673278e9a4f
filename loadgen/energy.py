"""Energy counters scraped from Prometheus text, for joules per token.

By default the agents' counter is read (an agent's `/metrics` on its `--http-port`, one
series per version it spent energy on); `--energy-metric` names others, read in order
(the first one a target exposes wins). Samples of one name with different labels are
summed, and several --metrics-url targets are summed. The default:
"""

from __future__ import annotations

import math

import httpx

ENERGY_METRIC_NAMES = ("agent_energy_joules_total",)
__doc__ = (__doc__ or "") + "\n".join(f"    {name}" for name in ENERGY_METRIC_NAMES) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of the sample values per metric name (labels dropped, NaN skipped)."""
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[name.strip()] = totals.get(name.strip(), 0.0) + value
    return totals


def pick_energy(totals: dict[str, float], names: tuple[str, ...]) -> tuple[str, float] | None:
    for name in names:
        if name in totals:
            return name, totals[name]
    return None


async def scrape_energy(
    client: httpx.AsyncClient, urls: list[str], names: tuple[str, ...] = ENERGY_METRIC_NAMES
) -> dict[str, tuple[str, float]]:
    """url -> (metric name, joules) for every target that exposes an energy counter.

    Targets that cannot be reached or expose none are left out; this never raises.
    """
    found: dict[str, tuple[str, float]] = {}
    for url in urls:
        try:
            response = await client.get(url, timeout=10.0)
            response.raise_for_status()
        except httpx.HTTPError:
            continue
        picked = pick_energy(parse_prometheus(response.text), names)
        if picked is not None:
            found[url] = picked
    return found


def energy_delta(
    before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]
) -> tuple[float, list[str]] | None:
    """Joules spent between two scrapes over the targets present in both, and the names read.

    None when no target exposed a counter both times. A counter that went down (a restart)
    contributes nothing rather than a negative amount.
    """
    common = sorted(set(before) & set(after))
    if not common:
        return None
    joules = sum(max(after[url][1] - before[url][1], 0.0) for url in common)
    return joules, sorted({after[url][0] for url in common})
