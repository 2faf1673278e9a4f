"""The one percentile every part reports with, so a p95 means the same number everywhere
(the agent's heartbeat, the canary analysis, evaluations, the load generator, benches)."""

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100) by numpy's default definition ("linear": rank
    q/100 * (n - 1), interpolated between the two nearest values); None for no values.
    Pure Python, so that the agent and the contracts need no numpy."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    if len(values) == 0:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))
