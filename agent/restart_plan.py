"""When the agent loads a failed engine's version again."""

from __future__ import annotations

from contracts.commands import LoadPayload


class RestartPlan:
    """When to load a failed engine's version again: at once the first time, then after
    1, 2, 4 ... 60 s while restarts keep failing or engines keep failing within 10
    minutes of their start (a crash loop waits, as Kubernetes' does)."""

    FIRST_DELAY_S = 1.0
    MAX_DELAY_S = 60.0
    STABLE_S = 600.0

    def __init__(self) -> None:
        self.load: LoadPayload | None = None
        self.not_before = 0.0
        self.delay_s = 0.0
        self.started_at: float | None = None

    def schedule(self, load: LoadPayload, now: float) -> None:
        """An engine for `load` failed."""
        if self.started_at is not None and now - self.started_at >= self.STABLE_S:
            self.delay_s = 0.0  # it had served a good while: not a loop
        self.load = load
        self.not_before = now + self.delay_s
        self.delay_s = min(max(self.delay_s * 2, self.FIRST_DELAY_S), self.MAX_DELAY_S)

    def due(self, now: float) -> LoadPayload | None:
        return self.load if self.load is not None and now >= self.not_before else None

    def failed(self, load: LoadPayload, now: float) -> None:
        self.started_at = None
        self.schedule(load, now)

    def succeeded(self, now: float) -> None:
        self.load = None
        self.started_at = now

    def cancel(self) -> None:
        self.load = None
