"""Failed authentications, counted per client address, to throttle key guessing.

An address with `limit` failed authentications in the current window (a minute by
default) has its unknown keys refused without a database lookup until the window ends
(429 `too_many_failed_authentications`); keys the gateway already holds grants for are
still served, so a legitimate client behind the same address is not locked out. Per
process, in memory: each gateway replica throttles on its own, which bounds the
database lookups every replica makes, the point of it. The address is the one uvicorn
reports (the peer, or the forwarded address from proxies it was told to trust with
`--forwarded-allow-ips`).
"""

from dataclasses import dataclass

MAX_ADDRESSES = 100_000


@dataclass(slots=True)
class _Window:
    started: float
    failures: int


class AuthFailures:
    def __init__(self, *, limit: int = 20, window_s: float = 60.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self._windows: dict[str, _Window] = {}

    def _window(self, address: str, now: float) -> _Window | None:
        window = self._windows.get(address)
        if window is not None and now - window.started >= self.window_s:
            del self._windows[address]
            return None
        return window

    def retry_after_s(self, address: str, now: float) -> float | None:
        """Seconds until `address` may have unknown keys looked up again; None: now."""
        window = self._window(address, now)
        if window is None or window.failures < self.limit:
            return None
        return window.started + self.window_s - now

    def record(self, address: str, now: float) -> None:
        window = self._window(address, now)
        if window is None:
            if len(self._windows) >= MAX_ADDRESSES:
                self._forget_ended(now)
            self._windows[address] = window = _Window(started=now, failures=0)
        window.failures += 1

    def _forget_ended(self, now: float) -> None:
        self._windows = {
            address: window
            for address, window in self._windows.items()
            if now - window.started < self.window_s
        }
        if len(self._windows) >= MAX_ADDRESSES:  # all of them current: keep the worst half
            ranked = sorted(self._windows.items(), key=lambda item: -item[1].failures)
            self._windows = dict(ranked[: MAX_ADDRESSES // 2])
