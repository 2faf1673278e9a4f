"""Reading Redis streams with consumer groups, at least once, for the ingest process.

Each stream has one handler. A batch (up to `batch_size` entries, one XREADGROUP) is
parsed entry by entry, applied by the handler in one call, and acknowledged in one XACK
only after that (so a crash re-delivers it, and handlers are idempotent); an entry that
does not parse is counted as malformed and acknowledged so that it never blocks the
stream; entries left pending by a dead consumer are claimed after `claim_idle_ms`.

An entry that parses but that the database refuses (a poison entry) must not block the
stream either: when applying a batch raises a database error about its values, the batch
is split in halves and each applied on its own (one handler call, so one transaction,
each), down to single entries; the good ones are applied and acknowledged, and an entry
refused on its own is counted, logged and dropped. A failure of the connection or the
server (OperationalError, InterfaceError) or of the SQL itself (ProgrammingError) is not
the entries' fault: nothing is dropped, the batch stays pending and comes back.

A stream whose handler says `is_trimmed_by_ingest` (the requests stream: its entries are
usage) has no MAXLEN: ingest trims it below what every group acknowledged and counts
entries that left it unread (stream_trim.py). Every entry of such a stream that is dropped
(refused, malformed, refused by the database) is a usage gap too
(`ingest_usage_gaps_total{reason}`).

`on_tick(is_caught_up)` runs every `tick_every_s` whether or not entries keep coming
(periodic work such as lost-agent detection must not wait for an idle moment);
`is_caught_up` says whether the last read drained every stream, so that work which
judges freshness can hold off while a backlog is still being applied.
"""

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis
from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    connections,
)
from prometheus_client import Counter, Histogram

from controlplane.core.redis_clients import reply_text
from controlplane.telemetry.stream_trim import USAGE_GAPS_TOTAL, StreamTrimmer

logger = logging.getLogger(__name__)

ENTRIES_TOTAL = Counter("ingest_entries_total", "Stream entries applied by ingest", ["stream"])
MALFORMED_TOTAL = Counter(
    "ingest_malformed_entries_total",
    "Stream entries dropped: not parsed, or refused by the database",
    ["stream"],
)
DROPPED_TOTAL = Counter(
    "ingest_dropped_entries_total",
    "Stream entries dropped, by reason: malformed, integrity_error, data_error, database_error",
    ["stream", "reason"],
)
CLAIMED_TOTAL = Counter(
    "ingest_claimed_entries_total", "Pending entries claimed from dead consumers", ["stream"]
)
BATCH_SECONDS = Histogram("ingest_batch_seconds", "Time to apply one batch of entries", ["stream"])


class MalformedEntry(ValueError):
    """The entry cannot be understood; it is counted and dropped."""


class RefusedEntry(MalformedEntry):
    """The entry is not signed by a writer ingest trusts; it is counted and dropped."""


class StreamHandler(Protocol):
    """A stream's handler. One whose class sets `is_trimmed_by_ingest = True` has its stream
    trimmed by ingest, below what every group acknowledged (its writers use no MAXLEN)."""

    def parse(self, entry_id: str, fields: Mapping[str, str]) -> Any:
        """Validate one entry; raise MalformedEntry when it is unusable."""

    def apply(self, items: Sequence[Any]) -> None:
        """Write a batch of parsed entries. Must be idempotent: entries can be re-delivered."""


@dataclass
class StreamIngestor:
    client: redis.Redis
    group: str
    consumer: str
    handlers: Mapping[str, StreamHandler]
    batch_size: int = 2000
    block_ms: int = 1000
    claim_idle_ms: int = 30_000
    claim_every_s: float = 5.0
    on_idle: Callable[[], None] | None = None
    on_tick: Callable[[bool], None] | None = None
    tick_every_s: float = 0.5
    trim_every_s: float = 5.0
    is_caught_up: bool = field(default=False, init=False)
    _last_claim: float = field(default=0.0, init=False)
    _last_tick: float = field(default=0.0, init=False)
    _last_trim: float = field(default=0.0, init=False)
    _own_pending_done: set[str] = field(default_factory=set, init=False)
    trimmer: StreamTrimmer = field(init=False)

    def __post_init__(self) -> None:
        self.trimmer = StreamTrimmer(self.client, self.group)

    def ensure_groups(self) -> None:
        for stream in self.handlers:
            try:
                self.client.xgroup_create(
                    stream,
                    self.group,
                    id="0",
                    mkstream=True,
                    # The entries that left before the group existed: Redis 7.0 would leave
                    # the group's entries-read unknown until its first read, and a gap
                    # before that read could not be counted.
                    entries_read=self.trimmer.entries_left(stream),
                )
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _process(self, stream: str, entries: Sequence[tuple[Any, Any]]) -> int:
        """Parse a batch, apply it (one call: the handler coalesces and commits it), then
        acknowledge every entry of it, malformed and refused ones included, in one XACK."""
        handler = self.handlers[stream]
        parsed: list[Any] = []
        parsed_ids: list[str] = []
        ids: list[str] = []
        deleted = 0
        for raw_id, raw_fields in entries:
            if type(raw_id) is str:  # a client that decodes replies (hiredis does it in C)
                entry_id, fields = raw_id, raw_fields
            else:
                entry_id = reply_text(raw_id)
                fields = (
                    None
                    if raw_fields is None
                    else {reply_text(k): reply_text(v) for k, v in raw_fields.items()}
                )
            ids.append(entry_id)
            if fields is None:  # deleted while pending
                deleted += 1
                continue
            try:
                parsed.append(handler.parse(entry_id, fields))
                parsed_ids.append(entry_id)
            except Exception as exc:
                # Malformed, or a parser that cannot cope with it: either way this entry
                # would fail again on every delivery, so it must not hold up the stream.
                is_refused = isinstance(exc, RefusedEntry)
                _count_dropped(stream, handler, "malformed", "refused" if is_refused else None)
                logger.warning(
                    "dropping malformed entry",
                    extra={"stream": stream, "entry_id": entry_id, "reason": str(exc)},
                    exc_info=not isinstance(exc, MalformedEntry),
                )
        if parsed:
            with BATCH_SECONDS.labels(stream).time():
                applied = self._apply(stream, handler, parsed, parsed_ids)
            ENTRIES_TOTAL.labels(stream).inc(applied)
        if deleted and _is_trimmed_by_ingest(handler):
            self.trimmer.record_lost(stream, deleted)  # delivered, then trimmed before applied
        if ids:
            self.client.xack(stream, self.group, *ids)
        return len(ids)

    def _apply(
        self, stream: str, handler: StreamHandler, items: Sequence[Any], ids: Sequence[str]
    ) -> int:
        """Apply items in one handler call; if the database refuses their values, apply
        each half on its own, down to single entries, and drop a single one it refuses.
        Returns how many were applied. Any other failure propagates: nothing is dropped."""
        try:
            handler.apply(items)
        except DatabaseError as exc:
            if not _is_refusal(exc):
                raise
            if len(items) > 1:
                middle = len(items) // 2
                return self._apply(stream, handler, items[:middle], ids[:middle]) + self._apply(
                    stream, handler, items[middle:], ids[middle:]
                )
            reason = _refusal_reason(exc)
            _count_dropped(stream, handler, reason)
            # Not str(exc): its DETAIL can quote the whole row, prompt text included.
            logger.warning(
                "dropping an entry the database refused",
                extra={
                    "stream": stream,
                    "entry_id": ids[0],
                    "reason": reason,
                    "error": _database_error_summary(exc),
                },
            )
            return 0
        return len(items)

    def _claim_stale(self) -> int:
        claimed = 0
        for stream in self.handlers:
            start = "0-0"
            while True:
                result = self.client.xautoclaim(
                    stream,
                    self.group,
                    self.consumer,
                    min_idle_time=self.claim_idle_ms,
                    start_id=start,
                    count=self.batch_size,
                )
                next_start, entries = reply_text(result[0]), result[1]
                # Pending entries no longer in the stream: Redis drops them from the
                # group's pending list and names them here.
                deleted = result[2] if len(result) > 2 else []
                if deleted and _is_trimmed_by_ingest(self.handlers[stream]):
                    self.trimmer.record_lost(stream, len(deleted))
                if entries:
                    CLAIMED_TOTAL.labels(stream).inc(len(entries))
                    claimed += self._process(stream, entries)
                if next_start == "0-0" or not (entries or deleted):
                    break
                start = next_start
        return claimed

    def run_once(self) -> int:
        """Apply one round of entries; returns how many were handled."""
        handled = 0
        now = time.monotonic()
        if now - self._last_claim >= self.claim_every_s:
            self._last_claim = now
            handled += self._claim_stale()
        # Our own pending entries first (after a restart), then new ones.
        streams = {
            stream: ("0" if stream not in self._own_pending_done else ">")
            for stream in self.handlers
        }
        block = None if any(v == "0" for v in streams.values()) else self.block_ms
        response: Any = self.client.xreadgroup(
            self.group,
            self.consumer,
            streams,  # type: ignore[arg-type]
            count=self.batch_size,
            block=block,
        )
        returned = {reply_text(raw_stream): entries for raw_stream, entries in response or []}
        self.is_caught_up = all(
            start == ">" and len(returned.get(stream) or []) < self.batch_size
            for stream, start in streams.items()
        )
        for stream, start in streams.items():
            entries = returned.get(stream) or []
            if start == "0" and not entries:
                self._own_pending_done.add(stream)
            handled += self._process(stream, entries)
        if now - self._last_trim >= self.trim_every_s:
            self._last_trim = now
            self.trim_acknowledged()
        return handled

    def trim_acknowledged(self) -> None:
        """Trim each stream whose handler says ingest trims it (stream_trim.py)."""
        for stream, handler in self.handlers.items():
            if _is_trimmed_by_ingest(handler):
                self.trimmer.trim(stream)

    def tick(self) -> None:
        """Run `on_tick` if it is due."""
        now = time.monotonic()
        if self.on_tick is not None and now - self._last_tick >= self.tick_every_s:
            self._last_tick = now
            self.on_tick(self.is_caught_up)

    def run(self, should_stop: Callable[[], bool]) -> None:
        backoff = 0.5
        groups_ready = False
        while not should_stop():
            try:
                if not groups_ready:
                    self.ensure_groups()
                    groups_ready = True
                    self._own_pending_done.clear()
                if self.run_once() == 0 and self.on_idle is not None:
                    self.on_idle()
                self.tick()
                backoff = 0.5
            except redis.ConnectionError as exc:
                logger.warning("redis unavailable, retrying", extra={"error": str(exc)})
                groups_ready = False
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):  # the stream was deleted or Redis restarted empty
                    groups_ready = False
                    continue
                raise
            except Exception as exc:
                # The database went away (or another failure that is not one entry's
                # fault): the entries stay pending and come back.
                if isinstance(exc, DatabaseError):
                    # Not logger.exception: the error's DETAIL can quote an entry's values.
                    logger.log(
                        logging.WARNING
                        if isinstance(exc, OperationalError | InterfaceError)
                        else logging.ERROR,
                        "ingest batch failed; entries stay pending",
                        extra={"error": _database_error_summary(exc)},
                    )
                    _close_broken_connections()
                else:
                    logger.exception("ingest batch failed; entries stay pending")
                self._own_pending_done.clear()
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)


def _is_trimmed_by_ingest(handler: StreamHandler) -> bool:
    return bool(getattr(handler, "is_trimmed_by_ingest", False))


def _count_dropped(
    stream: str, handler: StreamHandler, reason: str, gap_reason: str | None = None
) -> None:
    MALFORMED_TOTAL.labels(stream).inc()
    DROPPED_TOTAL.labels(stream, reason).inc()
    if _is_trimmed_by_ingest(handler):  # its entries are usage: a dropped one is a gap
        USAGE_GAPS_TOTAL.labels(gap_reason or reason).inc()


def _is_refusal(exc: DatabaseError) -> bool:
    """Whether the database refused the values written, rather than failing on its own:
    a lost connection, a deadlock, a timeout, a full disk (OperationalError), a closed
    connection (InterfaceError) or SQL that does not fit the schema, such as a migration
    not yet applied (ProgrammingError) would fail every entry, and must drop none."""
    return not isinstance(exc, OperationalError | InterfaceError | ProgrammingError)


def _refusal_reason(exc: DatabaseError) -> str:
    if isinstance(exc, IntegrityError):
        return "integrity_error"
    if isinstance(exc, DataError):
        return "data_error"
    return "database_error"


def _database_error_summary(exc: DatabaseError) -> str:
    """The error's class, SQLSTATE and primary message, never its DETAIL (PostgreSQL's
    "Failing row contains (...)" quotes the values, prompt text included)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    sqlstate = getattr(cause, "sqlstate", None)
    diag = getattr(cause, "diag", None)
    message = getattr(diag, "message_primary", None) or str(cause).split("\n", 1)[0]
    code = f" [{sqlstate}]" if sqlstate else ""
    return f"{type(exc).__name__}{code}: {message[:200]}"


def _close_broken_connections() -> None:
    """Close database connections a failure left unusable, so the next batch reconnects
    (a long-running process has no request cycle to do it); never inside a transaction."""
    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            try:
                connection.close_if_unusable_or_obsolete()
            except DatabaseError:  # closing a dead connection: the next use reconnects
                logger.warning("closing a broken database connection failed")
