"""What the gateway sends to Redis per request, gathered into one pipeline.

`RedisBatcher` carries a request's admission (the rate-limit script), and, after the
response, its requests-stream entry and token settlement. Whatever has gathered goes to
Redis in one pipeline: one write and one read for many requests, instead of a round
trip per command. On a busy host every socket write to Redis costs the gateway CPU (the
kernel's loopback path runs in the writer's time slice) and wakes Redis on a core the
engine and the relays want, so fewer, larger writes leave more of both for the streams.

When a batch is sent:

- at once (on the next turn of the event loop) when an admission is awaited before the
  request goes on (`is_urgent`: whole responses, and streams of tenants near a limit);
- otherwise `gather_s` (2 ms) after the first command queued: a stream's early
  admission (the agent is already working on the request, and its first token comes
  much later) and the entries and settlements of finished requests wait that long, so
  those of a whole burst (an engine step's tokens relayed to many clients, the next
  requests arriving) ride in one write, sent after the burst rather than inside it;
- at once when `max_batch` commands have gathered, and when closing.

A batch that Redis does not take (connection lost, a command refused) leaves nothing
behind: its admissions fail (the caller admits without a limit check, as when Redis is
away), its stream entries go to the spool, every one of them. An entry is in the
process's memory only for `gather_s` and one round trip; at shutdown everything queued
is written (or spooled) before `run()` returns.

`KeyUses`: when each API key was last used, written to the database at most once a
minute per key and gateway process, in a worker thread.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis
import redis.asyncio as aioredis
from django.db import close_old_connections
from redis.exceptions import NoScriptError

from contracts.routing import REQUESTS_MAXLEN, REQUESTS_STREAM
from controlplane.gateway.ratelimit import (
    ADMIT_SCRIPT,
    SETTLE_SCRIPT,
    Admission,
    admission_command,
    admission_from_reply,
    settle_command,
)
from controlplane.gateway.spool import Spool

logger = logging.getLogger(__name__)

# (tenant id, window, token delta), the delta not 0; or None
Settlement = tuple[int, int, int] | None

GATHER_S = 0.002
MAX_BATCH = 256


class RedisBatcher:
    def __init__(
        self,
        client: aioredis.Redis,
        spool: Spool,
        *,
        gather_s: float = GATHER_S,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._client = client
        self._spool = spool
        self._gather_s = gather_s
        self._max_batch = max_batch
        self._admissions: list[tuple[tuple[Any, ...], asyncio.Future[Admission]]] = []
        self._settlements: list[tuple[Any, ...]] = []
        self._entries: list[dict[str, str]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._is_flush_scheduled = False
        self._writes: set[asyncio.Task[None]] = set()
        self._is_closing = False
        self._closed = asyncio.Event()

    def admit(
        self,
        *,
        tenant_id: int,
        requests_per_minute: int,
        tokens_per_minute: int,
        estimate: int,
        is_urgent: bool,
    ) -> "asyncio.Future[Admission]":
        """Queue one admission; the future gives its `Admission`, or a Redis error."""
        future = asyncio.get_running_loop().create_future()
        command = admission_command(tenant_id, requests_per_minute, tokens_per_minute, estimate)
        self._admissions.append((command, future))
        self._schedule(is_urgent)
        return future

    def put(self, fields: dict[str, str] | None, settlement: Settlement = None) -> None:
        """Queue one stream entry and/or one settlement; returns at once."""
        if fields is not None:
            self._entries.append(fields)
        if settlement is not None:
            self._settlements.append(settle_command(*settlement))
        self._schedule(False)

    async def run(self) -> None:
        """Wait for `close()`; then write what is queued and in flight, and return."""
        await self._closed.wait()
        while self._admissions or self._settlements or self._entries or self._writes:
            self._flush()
            await asyncio.gather(*self._writes, return_exceptions=True)

    def close(self) -> None:
        self._is_closing = True
        self._closed.set()

    def _schedule(self, is_urgent: bool) -> None:
        pending = len(self._admissions) + len(self._settlements) + len(self._entries)
        if is_urgent or self._is_closing or pending >= self._max_batch:
            if not self._is_flush_scheduled:
                self._is_flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)
        elif self._timer is None and not self._is_flush_scheduled:
            self._timer = asyncio.get_running_loop().call_later(self._gather_s, self._flush)

    def _flush(self) -> None:
        self._is_flush_scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not (self._admissions or self._settlements or self._entries):
            return
        batch = self._admissions, self._settlements, self._entries
        self._admissions, self._settlements, self._entries = [], [], []
        task = asyncio.get_running_loop().create_task(self._write(*batch))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(
        self,
        admissions: list[tuple[tuple[Any, ...], "asyncio.Future[Admission]"]],
        settlements: list[tuple[Any, ...]],
        entries: list[dict[str, str]],
    ) -> None:
        unwritten = entries
        try:
            unwritten = await self._send(admissions, settlements, entries)
        except Exception as exc:  # never lose a batch to an unexpected error
            logger.error("request entries not written; spooling", extra={"error": str(exc)})
            for _, future in admissions:
                if not future.done():
                    future.set_exception(redis.RedisError(str(exc)))
        if unwritten:
            await asyncio.to_thread(self._spool_all, unwritten)

    async def _send(
        self,
        admissions: list[tuple[tuple[Any, ...], "asyncio.Future[Admission]"]],
        settlements: list[tuple[Any, ...]],
        entries: list[dict[str, str]],
    ) -> list[dict[str, str]]:
        """Write one batch; the entries Redis did not take (for the spool)."""
        # Admissions first: Redis runs them before the batch's other commands.
        commands = [command for command, _ in admissions] + settlements
        try:
            results = await self._execute(commands, entries)
            rerun = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
            if rerun:  # Redis lost its script cache (a restart): load, and send those again
                await self._client.script_load(ADMIT_SCRIPT)
                await self._client.script_load(SETTLE_SCRIPT)
                again = await self._execute([commands[i] for i in rerun], [])
                for i, result in zip(rerun, again, strict=True):
                    results[i] = result
        except (redis.RedisError, OSError) as exc:
            logger.warning("Redis unavailable; entries spooled", extra={"error": str(exc)})
            for _, future in admissions:
                if not future.done():
                    future.set_exception(redis.ConnectionError(str(exc)))
            return entries
        for (_, future), result in zip(admissions, results, strict=False):
            if future.done():
                continue  # the request was cancelled (its admission still counted)
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(admission_from_reply(result))
        for result in results[len(admissions) : len(commands)]:
            if isinstance(result, Exception):
                logger.warning("token settle failed", extra={"error": str(result)})
        unwritten = []
        for fields, result in zip(entries, results[len(commands) :], strict=True):
            if isinstance(result, Exception):
                logger.warning("request entry refused; spooling", extra={"error": str(result)})
                unwritten.append(fields)
        return unwritten

    async def _execute(
        self, commands: list[tuple[Any, ...]], entries: list[dict[str, str]]
    ) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        for fields in entries:
            pipe.xadd(REQUESTS_STREAM, fields, maxlen=REQUESTS_MAXLEN, approximate=True)  # type: ignore[arg-type]
        return list(await pipe.execute(raise_on_error=False))

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
