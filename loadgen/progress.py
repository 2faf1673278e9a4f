"""A progress line on stderr: redrawn in place on a terminal, one line per interval otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        *,
        total: int | None,
        duration_s: float | None,
        label: str = "",
        stream: TextIO | None = None,
        is_enabled: bool = True,
        line_interval_s: float = 10.0,
    ) -> None:
        self.total = total
        self.duration_s = duration_s
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.is_enabled = is_enabled
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.line_interval_s = line_interval_s
        self.started = time.monotonic()
        self._last_line = 0.0

    def _fraction(self, done: int) -> float | None:
        elapsed = time.monotonic() - self.started
        fractions = []
        if self.total:
            fractions.append(done / self.total)
        if self.duration_s:
            fractions.append(elapsed / self.duration_s)
        return min(max(fractions), 1.0) if fractions else None

    def render(self, *, done: int, ok: int, errors: int, in_flight: int) -> str:
        elapsed = time.monotonic() - self.started
        fraction = self._fraction(done)
        rate = done / elapsed if elapsed > 0 else 0.0
        bar = ""
        if fraction is not None:
            filled = int(fraction * 24)
            bar = f"[{'#' * filled}{'.' * (24 - filled)}] {fraction * 100:5.1f}% "
        of_total = f"/{self.total}" if self.total else ""
        prefix = f"{self.label} " if self.label else ""
        return (
            f"{prefix}{bar}{done}{of_total} req  {rate:5.2f} req/s  ok {ok}  err {errors}  "
            f"in flight {in_flight}  {elapsed:6.1f}s"
        )

    def update(self, *, done: int, ok: int, errors: int, in_flight: int) -> None:
        if not self.is_enabled:
            return
        line = self.render(done=done, ok=ok, errors=errors, in_flight=in_flight)
        now = time.monotonic()
        if self.is_tty:
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
        elif now - self._last_line >= self.line_interval_s:
            self._last_line = now
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self, *, done: int, ok: int, errors: int, in_flight: int = 0) -> None:
        if not self.is_enabled:
            return
        line = self.render(done=done, ok=ok, errors=errors, in_flight=in_flight)
        self.stream.write(("\r\x1b[2K" if self.is_tty else "") + line + "\n")
        self.stream.flush()
