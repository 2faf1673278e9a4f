"""What the gateway writes after a request, kept off the request's path.

`RecordWriter`: each finished request leaves its requests-stream entry and its token
settlement here; one background task writes whatever has gathered in one Redis
pipeline (group commit: one round trip when idle, many entries per round trip under
load). Entries Redis does not take go to the spool, as before.

`KeyUses`: when each API key was last used, written to the database at most once a
minute per key and gateway process, in a worker thread.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

import redis
import redis.asyncio as aioredis
from django.db import close_old_connections

from contracts.routing import REQUESTS_MAXLEN, REQUESTS_STREAM
from controlplane.gateway.ratelimit import settle_into
from controlplane.gateway.spool import Spool

logger = logging.getLogger(__name__)

# (tenant id, window, token delta), the delta not 0; or None
Settlement = tuple[int, int, int] | None


class RecordWriter:
    def __init__(self, client: aioredis.Redis, spool: Spool) -> None:
        self._client = client
        self._spool = spool
        self._pending: list[tuple[dict[str, str] | None, Settlement]] = []
        self._wakeup = asyncio.Event()
        self._is_closing = False

    def put(self, fields: dict[str, str] | None, settlement: Settlement = None) -> None:
        """Queue one stream entry and/or one settlement; returns at once."""
        self._pending.append((fields, settlement))
        self._wakeup.set()

    async def run(self) -> None:
        """Write what gathers until `close()`; then what is left, and return."""
        while not self._is_closing:
            await self._wakeup.wait()
            self._wakeup.clear()
            await self._flush()
        await self._flush()

    def close(self) -> None:
        self._is_closing = True
        self._wakeup.set()

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await self._write(batch)
            except Exception as exc:  # never lose a batch to an unexpected error
                logger.error("request entries not written; spooling", extra={"error": str(exc)})
                await asyncio.to_thread(
                    self._spool_all, [fields for fields, _ in batch if fields is not None]
                )

    async def _write(self, batch: list[tuple[dict[str, str] | None, Settlement]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        entries: list[dict[str, str] | None] = []  # one per pipeline command, None: settle
        for fields, settlement in batch:
            if settlement is not None:
                settle_into(pipe, *settlement)
                entries.append(None)
            if fields is not None:
                pipe.xadd(REQUESTS_STREAM, fields, maxlen=REQUESTS_MAXLEN, approximate=True)
                entries.append(fields)
        if not entries:
            return
        unwritten: list[dict[str, str]]
        try:
            results = await pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as exc:
            logger.warning("requests stream unavailable; spooling", extra={"error": str(exc)})
            unwritten = [fields for fields in entries if fields is not None]
        else:
            unwritten = []
            for fields, result in zip(entries, results, strict=True):
                if not isinstance(result, Exception):
                    continue
                if fields is None:
                    logger.warning("token settle failed", extra={"error": str(result)})
                else:
                    logger.warning("request entry refused; spooling", extra={"error": str(result)})
                    unwritten.append(fields)
        if unwritten:
            await asyncio.to_thread(self._spool_all, unwritten)

    def _spool_all(self, entries: list[dict[str, str]]) -> None:
        for fields in entries:
            self._spool.append(fields)


class KeyUses:
    """Which keys were used since the last write, at most once per `interval_s` per key."""

    def __init__(self, *, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._noted_at: dict[int, float] = {}  # key id -> monotonic time it was last queued
        self._pending: dict[int, float] = {}  # key id -> unix time of use

    def note(self, key_id: int, now_monotonic: float) -> None:
        noted_at = self._noted_at.get(key_id)
        if noted_at is not None and now_monotonic - noted_at < self.interval_s:
            return
        self._noted_at[key_id] = now_monotonic
        self._pending[key_id] = time.time()

    def take(self) -> dict[int, float]:
        pending, self._pending = self._pending, {}
        if len(self._noted_at) > 100_000:  # forget keys not seen for a while
            horizon = time.monotonic() - self.interval_s
            self._noted_at = {k: t for k, t in self._noted_at.items() if t > horizon}
        return pending


def keys_touch(used: dict[int, float], touch: Callable[..., None]) -> None:
    """Write last-used times (in a worker thread): `touch(key_id=..., used_at=...)` each."""
    close_old_connections()
    try:
        for key_id, used_at in sorted(used.items()):
            touch(key_id=key_id, used_at=datetime.fromtimestamp(used_at, tz=UTC))
    finally:
        close_old_connections()
