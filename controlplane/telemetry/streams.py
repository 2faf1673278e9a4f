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
usage) has no MAXLEN; ingest trims it, every `trim_every_s`, with `XTRIM MINID` below what
every consumer group on it has been given and acknowledged: below the oldest pending entry
of each group, else just past its last-delivered id, the lowest of these across groups.
After trimming, it checks that nothing left the stream unread by its own group (an entry
trimmed by hand, or by a writer still using MAXLEN): the group has read `entries-read`
entries up to its last-delivered id; once the stream's first entry lies beyond that id, the
entries that have left the stream (`entries-added` - `length`) number more than the group
read by exactly those it never read. They are counted (`ingest_lost_entries_total{stream}`),
logged and recorded in `{<stream>}:lost` (a hash: `total`, `last_count`, `last_at`) for the
dashboard, and the group's counter is set to the entries that left (`XGROUP SETID ...
ENTRIESREAD`; Redis 7.0 goes on adding one per entry read after a gap, so they would
otherwise be counted again), in one script so that two ingesters count a gap once.
Entries trimmed while pending (delivered, not yet applied: a failed batch, a dead
consumer) come back without fields; they are counted and recorded the same way.

`on_tick(is_caught_up)` runs every `tick_every_s` whether or not entries keep coming
(periodic work such as lost-agent detection must not wait for an idle moment);
`is_caught_up` says whether the last read drained every stream, so that work which
judges freshness can hold off while a backlog is still being applied.
"""

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
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
TRIMMED_TOTAL = Counter(
    "ingest_trimmed_entries_total",
    "Acknowledged entries trimmed from streams that only ingest trims",
    ["stream"],
)
LOST_TOTAL = Counter(
    "ingest_lost_entries_total",
    "Entries that left a stream before ingest's group read them (trimmed unread)",
    ["stream"],
)

# KEYS: the stream, its lost-entries hash; ARGV: the group, the time (unix seconds).
# Returns how many entries left the stream unread since the last check, -1 when Redis
# does not know how many the group has read (entries-read is null).
LOST_ENTRIES_SCRIPT = """
local function field(reply, name)
  for index = 1, #reply, 2 do
    if reply[index] == name then return reply[index + 1] end
  end
  return false
end
local function is_at_or_before(a, b)
  local a_ms, a_seq = string.match(a, '^(%d+)-(%d+)$')
  local b_ms, b_seq = string.match(b, '^(%d+)-(%d+)$')
  if #a_ms ~= #b_ms then return #a_ms < #b_ms end
  if a_ms ~= b_ms then return a_ms < b_ms end
  if #a_seq ~= #b_seq then return #a_seq < #b_seq end
  return a_seq <= b_seq
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local group = false
for _, candidate in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  if field(candidate, 'name') == ARGV[1] then group = candidate end
end
if not group then return 0 end
local entries_read = field(group, 'entries-read')
if not entries_read then return -1 end
local last_delivered = field(group, 'last-delivered-id')
local stream = redis.call('XINFO', 'STREAM', KEYS[1])
local first = field(stream, 'first-entry')
if first and is_at_or_before(first[1], last_delivered) then return 0 end
local left = field(stream, 'entries-added') - field(stream, 'length')
local lost = left - entries_read
if lost == 0 then return 0 end
redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], last_delivered, 'ENTRIESREAD', left)
if lost < 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'total', lost)
redis.call('HSET', KEYS[2], 'last_count', lost, 'last_at', ARGV[2])
return lost
"""


class MalformedEntry(ValueError):
    """The entry cannot be understood; it is counted and dropped."""


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
    _lost_entries_script: Any = field(default=None, init=False)
    _is_read_count_unknown: dict[str, bool] = field(default_factory=dict, init=False)

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
                    entries_read=self._entries_left(stream),
                )
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _entries_left(self, stream: str) -> int:
        if not self.client.exists(stream):
            return 0
        info: Any = self.client.xinfo_stream(stream)
        return int(info["entries-added"]) - int(info["length"])

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
                entry_id = _text(raw_id)
                fields = (
                    None
                    if raw_fields is None
                    else {_text(k): _text(v) for k, v in raw_fields.items()}
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
                _count_dropped(stream, "malformed")
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
            self._record_lost(stream, deleted)  # delivered, then trimmed before applied
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
            _count_dropped(stream, reason)
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
                next_start, entries = _text(result[0]), result[1]
                # Pending entries no longer in the stream: Redis drops them from the
                # group's pending list and names them here.
                deleted = result[2] if len(result) > 2 else []
                if deleted and _is_trimmed_by_ingest(self.handlers[stream]):
                    self._record_lost(stream, len(deleted))
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
        returned = {_text(raw_stream): entries for raw_stream, entries in response or []}
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
        """For each stream that ingest trims: trim it below what every group acknowledged,
        then count entries that left it unread (once trimmed, the stream's first entry lies
        beyond what the group read, which is when a gap shows)."""
        for stream, handler in self.handlers.items():
            if not _is_trimmed_by_ingest(handler):
                continue
            try:
                self._trim(stream)
                self._count_lost(stream)
            except redis.ResponseError as exc:  # the stream went away meanwhile
                logger.warning("stream not trimmed", extra={"stream": stream, "error": str(exc)})

    def _count_lost(self, stream: str) -> None:
        if self._lost_entries_script is None:
            self._lost_entries_script = self.client.register_script(LOST_ENTRIES_SCRIPT)
        lost = int(
            self._lost_entries_script(
                keys=[stream, lost_entries_key(stream)], args=[self.group, repr(time.time())]
            )
        )
        is_unknown = lost < 0
        if is_unknown and not self._is_read_count_unknown.get(stream):
            logger.warning(
                "entries lost from the stream cannot be counted: the group's entries-read is"
                " unknown (entries deleted one by one?)",
                extra={"stream": stream, "group": self.group},
            )
        self._is_read_count_unknown[stream] = is_unknown
        if lost > 0:  # the script recorded it
            self._note_lost(stream, lost)

    def _record_lost(self, stream: str, lost: int) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(lost_entries_key(stream), "total", lost)
        pipe.hset(
            lost_entries_key(stream), mapping={"last_count": lost, "last_at": repr(time.time())}
        )
        pipe.execute()
        self._note_lost(stream, lost)

    def _note_lost(self, stream: str, lost: int) -> None:
        LOST_TOTAL.labels(stream).inc(lost)
        logger.error(
            "entries left the stream before ingest applied them",
            extra={"stream": stream, "group": self.group, "lost": lost},
        )

    def _trim(self, stream: str) -> None:
        point: tuple[int, int] | None = None
        groups: Any = self.client.xinfo_groups(stream)
        for group in groups:
            name = _text(group["name"])
            # Entries up to the last-delivered id are acknowledged, except those pending.
            candidate = _next_id(_parse_id(_text(group["last-delivered-id"])))
            summary: Any = self.client.xpending(stream, name)
            if summary["min"] is not None:
                candidate = min(candidate, _parse_id(_text(summary["min"])))
            point = candidate if point is None else min(point, candidate)
        if point is None:
            return  # no group yet: no entry is known to be read
        trimmed: Any = self.client.xtrim(stream, minid=f"{point[0]}-{point[1]}", approximate=False)
        if trimmed:
            TRIMMED_TOTAL.labels(stream).inc(trimmed)

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


@dataclass(frozen=True, slots=True)
class StreamLoss:
    """Entries that left a stream before ingest read them, as ingest recorded it."""

    total: int
    last_count: int
    last_at: datetime


def lost_entries_key(stream: str) -> str:
    # The hash tag puts it on the stream's cluster slot: one script writes both.
    return f"{{{stream}}}:lost"


def stream_loss_get(client: redis.Redis, stream: str) -> StreamLoss | None:
    """What ingest recorded of entries lost from `stream`; None when it never lost any
    (or the record is unreadable, which is logged)."""
    raw: Any = client.hgetall(lost_entries_key(stream))
    if not raw:
        return None
    fields = {_text(name): _text(value) for name, value in raw.items()}
    try:
        total, last_count = int(fields["total"]), int(fields["last_count"])
        last_at = datetime.fromtimestamp(float(fields["last_at"]), tz=UTC)
    except (KeyError, ValueError, OverflowError, OSError):
        logger.warning("unreadable lost-entries record", extra={"stream": stream})
        return None
    return StreamLoss(total=total, last_count=last_count, last_at=last_at)


def _parse_id(entry_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


def _next_id(entry_id: tuple[int, int]) -> tuple[int, int]:
    milliseconds, sequence = entry_id
    if sequence == 2**64 - 1:
        return milliseconds + 1, 0
    return milliseconds, sequence + 1


def _is_trimmed_by_ingest(handler: StreamHandler) -> bool:
    return bool(getattr(handler, "is_trimmed_by_ingest", False))


def _text(value: Any) -> str:
    # Undecodable bytes become U+FFFD: an entry that cannot be decoded must still be
    # parsed (and refused), or it would come back forever.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _count_dropped(stream: str, reason: str) -> None:
    MALFORMED_TOTAL.labels(stream).inc()
    DROPPED_TOTAL.labels(stream, reason).inc()


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
