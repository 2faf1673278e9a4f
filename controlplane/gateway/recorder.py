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

Commands reach Redis in the order they were queued, and one batch is in flight at a
time (what gathers meanwhile goes in the next): a request's token settlement is queued
before the same client's next request can be admitted, so that admission always counts
the real tokens of the requests before it. (Sending admissions ahead of the batch, or
batches over several pooled connections at once, let an admission overtake the
settlement before it and admit a tenant past its limit.)

Every stream entry is signed as it is queued (`contracts.routing.request_fields_sign`, its
`mac` field, keyed by TELEMETRY_RECORD_KEY): ingest refuses entries without a valid one.
The spool keeps entries as signed; its replay signs only lines that have no `mac` (written
by a gateway from before signing), since the spool directory is the gateway's own.

The requests stream has no MAXLEN: only ingest trims it, below what it has acknowledged,
so entries wait in Redis for as long as ingest is away. To keep Redis bounded all the
same, every batch that carries entries ends with an XLEN, and while the last length seen
is `GATEWAY_REQUESTS_STREAM_MAX_LENGTH` or more, the entries of the next batches go to the
spool instead of the stream (its replay waits for the same condition): no extra round
trip and no script, at the price of one batch of overshoot per gateway process, since
the length is one batch old.

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
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings
from django.db import close_old_connections
from redis.exceptions import NoScriptError

from contracts.routing import REQUEST_MAC_FIELD, REQUESTS_STREAM, request_fields_sign
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
HELD_BACK = object()  # the result of an entry kept out of a full stream


class RequestsStreamFull(Exception):
    """The requests stream holds its maximum length; entries wait in the spool."""


def requests_stream_is_full(length: int) -> bool:
    return length >= settings.GATEWAY_REQUESTS_STREAM_MAX_LENGTH


def spooled_entries_write(client: redis.Redis, entries: list[dict[str, str]]) -> None:
    """The spool's writer: XADD every entry, or raise while the stream is full (as the
    batcher judges it), which leaves them in the spool for the next replay."""
    length: Any = client.xlen(REQUESTS_STREAM)
    if requests_stream_is_full(length):
        raise RequestsStreamFull(f"{REQUESTS_STREAM} holds {length} entries")
    key = settings.TELEMETRY_RECORD_KEY
    pipe = client.pipeline(transaction=False)
    for fields in entries:
        if REQUEST_MAC_FIELD not in fields:
            fields = request_fields_sign(fields, key)
        pipe.xadd(REQUESTS_STREAM, fields)  # type: ignore[arg-type]
    pipe.execute()


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
        # Commands in the order they were queued: a settlement queued before an admission
        # must reach Redis before it, or the admission reads a count missing that request.
        self._queue: list[Command] = []
        self._timer: asyncio.TimerHandle | None = None
        self._is_due = asyncio.Event()
        self._spooling: set[asyncio.Task[None]] = set()
        self._is_closing = False
        self._stream_length = 0  # XLEN of the requests stream after the last batch of entries
        self._record_key: bytes = settings.TELEMETRY_RECORD_KEY

    def admit(
        self,
        *,
        tenant_id: int,
        requests_per_minute: int,
        tokens_per_minute: int,
        reservation: int,
        is_urgent: bool,
    ) -> "asyncio.Future[Admission]":
        """Queue one admission; the future gives its `Admission`, or a Redis error."""
        future = asyncio.get_running_loop().create_future()
        command = admission_command(tenant_id, requests_per_minute, tokens_per_minute, reservation)
        self._queue.append(Command(arguments=command, admission=future))
        self._schedule(is_urgent)
        return future

    def put(self, fields: dict[str, str] | None, settlement: Settlement = None) -> None:
        """Queue one stream entry (signed here) and/or one settlement; returns at once."""
        if settlement is not None:
            self._queue.append(Command(arguments=settle_command(*settlement)))
        if fields is not None:
            self._queue.append(Command(entry=request_fields_sign(fields, self._record_key)))
        self._schedule(False)

    async def run(self) -> None:
        """Send batches until `close()`, one at a time, then what is still queued; return."""
        while True:
            await self._is_due.wait()
            self._is_due.clear()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._queue:
                batch, self._queue = self._queue, []
                # One batch in flight at a time: Redis sees commands in queue order.
                await self._write(batch)
                if self._is_closing:
                    self._is_due.set()  # once more: what came meanwhile, or the end
            elif self._is_closing:
                break
        await asyncio.gather(*self._spooling, return_exceptions=True)

    def close(self) -> None:
        self._is_closing = True
        self._is_due.set()

    def _schedule(self, is_urgent: bool) -> None:
        if is_urgent or self._is_closing or len(self._queue) >= self._max_batch:
            self._is_due.set()
        elif self._timer is None and not self._is_due.is_set():
            self._timer = asyncio.get_running_loop().call_later(self._gather_s, self._is_due.set)

    async def _write(self, batch: list["Command"]) -> None:
        unwritten = [command.entry for command in batch if command.entry is not None]
        try:
            unwritten = await self._send(batch)
        except Exception as exc:  # never lose a batch to an unexpected error
            logger.error("request entries not written; spooling", extra={"error": str(exc)})
            _fail_admissions(batch, redis.RedisError(str(exc)))
        if unwritten:
            # In a thread, beside the next batches: a slow disk does not hold admissions.
            task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self._spool_all, unwritten)
            )
            self._spooling.add(task)
            task.add_done_callback(self._spooling.discard)

    async def _send(self, batch: list["Command"]) -> list[dict[str, str]]:
        """Write one batch in queue order; the entries Redis did not take (for the spool)."""
        try:
            results = await self._execute(batch)
            rerun = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
            if rerun:  # Redis lost its script cache (a restart): load, and send those again
                await self._client.script_load(ADMIT_SCRIPT)
                await self._client.script_load(SETTLE_SCRIPT)
                again = await self._execute([batch[i] for i in rerun])
                for i, result in zip(rerun, again, strict=True):
                    results[i] = result
        except (redis.RedisError, OSError) as exc:
            logger.warning("Redis unavailable; entries spooled", extra={"error": str(exc)})
            _fail_admissions(batch, redis.ConnectionError(str(exc)))
            return [command.entry for command in batch if command.entry is not None]
        unwritten = []
        for command, result in zip(batch, results, strict=True):
            future = command.admission
            if command.entry is not None:
                if result is HELD_BACK:
                    unwritten.append(command.entry)
                elif isinstance(result, Exception):
                    logger.warning("request entry refused; spooling", extra={"error": str(result)})
                    unwritten.append(command.entry)
            elif future is None:
                if isinstance(result, Exception):
                    logger.warning("token settle failed", extra={"error": str(result)})
            elif future.done():
                continue  # the request was cancelled (its admission still counted)
            elif isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(admission_from_reply(result))
        return unwritten

    async def _execute(self, batch: list["Command"]) -> list[Any]:
        """Send one pipeline; the results in batch order, HELD_BACK for an entry kept out
        of a full stream."""
        is_full = requests_stream_is_full(self._stream_length)
        has_entries = False
        pipe = self._client.pipeline(transaction=False)
        for command in batch:
            if command.entry is None:
                pipe.execute_command(*command.arguments)
                continue
            has_entries = True
            if not is_full:
                pipe.xadd(REQUESTS_STREAM, command.entry)  # type: ignore[arg-type]
        if has_entries:
            pipe.xlen(REQUESTS_STREAM)
        results = list(await pipe.execute(raise_on_error=False))
        if has_entries:
            self._note_stream_length(results.pop())
        sent = iter(results)
        return [
            HELD_BACK if is_full and command.entry is not None else next(sent) for command in batch
        ]

    def _note_stream_length(self, length: Any) -> None:
        if not isinstance(length, int):
            return  # XLEN refused: judge by the last length seen
        was_full = requests_stream_is_full(self._stream_length)
        self._stream_length = length
        if requests_stream_is_full(length) and not was_full:
            logger.warning(
                "requests stream full (is ingest running?); spooling new entries",
                extra={"length": length},
            )
        elif was_full and not requests_stream_is_full(length):
            logger.info("requests stream below its maximum again", extra={"length": length})

    def _spool_all(self, entries: list[dict[str, str]]) -> None:
        for fields in entries:
            self._spool.append(fields)


@dataclass(slots=True)
class Command:
    """One queued Redis command: an admission (with its future), a settlement, or an entry."""

    arguments: tuple[Any, ...] = ()
    admission: "asyncio.Future[Admission] | None" = None
    entry: dict[str, str] | None = None


def _fail_admissions(batch: list[Command], error: Exception) -> None:
    for command in batch:
        if command.admission is not None and not command.admission.done():
            command.admission.set_exception(error)


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


def keys_touch(used: dict[int, float], touch: Callable[..., object]) -> None:
    """Write last-used times (in a worker thread): `touch(key_id=..., used_at=...)` each."""
    close_old_connections()
    try:
        for key_id, used_at in sorted(used.items()):
            touch(key_id=key_id, used_at=datetime.fromtimestamp(used_at, tz=UTC))
    finally:
        close_old_connections()
