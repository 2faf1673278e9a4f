"""Trimming a stream whose entries must not be lost, and counting any that were.

A stream whose handler says `is_trimmed_by_ingest` (the requests stream: its entries are
usage) has no MAXLEN; ingest trims it, every `trim_every_s`, with `XTRIM MINID` below what
every consumer group on it has been given and acknowledged: below the oldest pending entry
of each group, else just past its last-delivered id, the lowest of these across groups.
After trimming, it checks that nothing left the stream unread by its own group (an entry
trimmed by hand, or by a writer still using MAXLEN): the group has read `entries-read`
entries up to its last-delivered id; once the stream's first entry lies beyond that id, the
entries that have left the stream (`entries-added` - `length`) number more than the group
read by exactly those it never read. They are counted as usage gaps
(`ingest_usage_gaps_total{reason="trimmed_unread"}`: the only stream ingest trims is the
requests stream, whose entries are usage), logged and recorded in `{<stream>}:lost` (a
hash: `total`, `last_count`, `last_at`) for the dashboard, and the group's counter is set
to the entries that left (`XGROUP SETID ... ENTRIESREAD`; Redis 7.0 goes on adding one per
entry read after a gap, so they would otherwise be counted again), in one script so that
two ingesters count a gap once.
Entries trimmed while pending (delivered, not yet applied: a failed batch, a dead
consumer) come back without fields; they are recorded the same way and counted with
`reason="trimmed_pending"`. Each trim also reports how many entries its group has yet to be
given (`ingest_stream_lag_entries{stream}`, from XINFO GROUPS).
"""

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
from prometheus_client import Counter, Gauge

from controlplane.core.redis_clients import reply_text

logger = logging.getLogger(__name__)

TRIMMED_TOTAL = Counter(
    "ingest_trimmed_entries_total",
    "Acknowledged entries trimmed from streams that only ingest trims",
    ["stream"],
)
# Every request record that left the requests stream without becoming usage, by reason:
# trimmed_unread and trimmed_pending here; refused, malformed and the database's refusals
# (integrity_error, data_error, database_error) where streams.py drops an entry.
USAGE_GAPS_TOTAL = Counter(
    "ingest_usage_gaps_total",
    "Request records lost before they were metered, by reason",
    ["reason"],
)
USAGE_GAP_REASONS = (
    "trimmed_unread",
    "trimmed_pending",
    "refused",
    "malformed",
    "integrity_error",
    "data_error",
    "database_error",
)
for _reason in USAGE_GAP_REASONS:
    USAGE_GAPS_TOTAL.labels(_reason)  # every series from the start, at zero
STREAM_LAG = Gauge(
    "ingest_stream_lag_entries",
    "Entries in the stream not yet delivered to ingest's group (at the last trim)",
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


@dataclass
class StreamTrimmer:
    """Trims streams below what every consumer group acknowledged, for one group's
    ingest process, and counts what left them unread by that group."""

    client: redis.Redis
    group: str
    _lost_entries_script: Any = field(default=None, init=False)
    _is_read_count_unknown: dict[str, bool] = field(default_factory=dict, init=False)

    def trim(self, stream: str) -> None:
        """Trim the stream below what every group acknowledged, then count entries that
        left it unread (once trimmed, its first entry lies beyond what the group read,
        which is when a gap shows)."""
        try:
            self._trim(stream)
            self._count_lost(stream)
        except redis.ResponseError as exc:  # the stream went away meanwhile
            logger.warning("stream not trimmed", extra={"stream": stream, "error": str(exc)})

    def entries_left(self, stream: str) -> int:
        """How many entries have left the stream so far (a new group's entries-read)."""
        if not self.client.exists(stream):
            return 0
        info: Any = self.client.xinfo_stream(stream)
        return int(info["entries-added"]) - int(info["length"])

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
            self._note_lost(stream, lost, "trimmed_unread")

    def record_lost(self, stream: str, lost: int) -> None:
        """Entries delivered to this group, then trimmed before they were applied."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(lost_entries_key(stream), "total", lost)
        pipe.hset(
            lost_entries_key(stream), mapping={"last_count": lost, "last_at": repr(time.time())}
        )
        pipe.execute()
        self._note_lost(stream, lost, "trimmed_pending")

    def _note_lost(self, stream: str, lost: int, reason: str) -> None:
        USAGE_GAPS_TOTAL.labels(reason).inc(lost)
        logger.error(
            "entries left the stream before ingest applied them",
            extra={"stream": stream, "group": self.group, "lost": lost, "reason": reason},
        )

    def _trim(self, stream: str) -> None:
        point: tuple[int, int] | None = None
        groups: Any = self.client.xinfo_groups(stream)
        for group in groups:
            name = reply_text(group["name"])
            if name == self.group and group.get("lag") is not None:  # null: Redis cannot tell
                STREAM_LAG.labels(stream).set(int(group["lag"]))
            # Entries up to the last-delivered id are acknowledged, except those pending.
            candidate = _next_id(_parse_id(reply_text(group["last-delivered-id"])))
            summary: Any = self.client.xpending(stream, name)
            if summary["min"] is not None:
                candidate = min(candidate, _parse_id(reply_text(summary["min"])))
            point = candidate if point is None else min(point, candidate)
        if point is None:
            return  # no group yet: no entry is known to be read
        trimmed: Any = self.client.xtrim(stream, minid=f"{point[0]}-{point[1]}", approximate=False)
        if trimmed:
            TRIMMED_TOTAL.labels(stream).inc(trimmed)


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
    fields = {reply_text(name): reply_text(value) for name, value in raw.items()}
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
