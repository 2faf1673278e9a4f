"""A bounded local file spool for requests-stream entries Redis did not take.

When XADD fails, or the requests stream is full (recorder.py), the entry is appended (one
JSON line, fsynced) to `<dir>/active-<pid>.jsonl`. A replayer (every few seconds, and at
start) moves each active file aside under an exclusive `flock` (renaming it to
`batch-...`), then XADDs every line of every batch file it can lock and deletes the file;
a writer that raises (Redis away, the stream still full) leaves the file for next time.
A crash mid-replay leaves the batch file for the next replay: an entry may then be
written twice, which ingest absorbs (it is idempotent on request_id). Files of dead
processes are replayed by any gateway sharing the directory.

Bounded: when the directory holds `max_bytes`, new entries are dropped and counted
(`gateway_spool_dropped_total`) rather than filling the disk.
"""

import fcntl
import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from prometheus_client import Counter

logger = logging.getLogger(__name__)

SPOOLED_TOTAL = Counter("gateway_spool_entries_total", "Request entries written to the spool")
REPLAYED_TOTAL = Counter("gateway_spool_replayed_total", "Spooled entries written to Redis")
DROPPED_TOTAL = Counter("gateway_spool_dropped_total", "Entries dropped because the spool is full")


class Spool:
    def __init__(self, directory: Path, *, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes

    def _active_path(self) -> Path:
        return self.directory / f"active-{os.getpid()}.jsonl"

    def size_bytes(self) -> int:
        if not self.directory.is_dir():
            return 0
        total = 0
        for path in self.directory.iterdir():
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue
        return total

    def pending_count(self) -> int:
        """How many entries wait in the spool (for tests and the readiness view)."""
        if not self.directory.is_dir():
            return 0
        count = 0
        for path in self.directory.glob("*.jsonl"):
            try:
                with open(path, "rb") as handle:
                    count += sum(1 for line in handle if line.strip())
            except FileNotFoundError:
                continue
        return count

    def append(self, fields: Mapping[str, str]) -> bool:
        """Keep one entry; False when the spool is full and the entry was dropped."""
        line = (json.dumps(dict(fields), separators=(",", ":")) + "\n").encode()
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.size_bytes() + len(line) > self.max_bytes:
            DROPPED_TOTAL.inc()
            logger.error("gateway spool full; request entry dropped", extra={"bytes": len(line)})
            return False
        path = self._active_path()
        while True:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # The replayer may have renamed the file while we waited for the lock.
                try:
                    is_current = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    is_current = False
                if not is_current:
                    continue
                os.write(fd, line)
                os.fsync(fd)
                SPOOLED_TOTAL.inc()
                return True
            finally:
                os.close(fd)

    def replay(self, write: Callable[[list[dict[str, str]]], None]) -> int:
        """Hand every spooled entry to `write` (which raises when Redis is down)."""
        if not self.directory.is_dir():
            return 0
        for path in sorted(self.directory.glob("active-*.jsonl")):
            self._rotate(path)
        replayed = 0
        for path in sorted(self.directory.glob("batch-*.jsonl")):
            replayed += self._replay_batch(path, write)
        return replayed

    def _rotate(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return
        try:
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.rename(path, self.directory / f"batch-{uuid.uuid4().hex}.jsonl")
        finally:
            os.close(fd)

    def _replay_batch(self, path: Path, write: Callable[[list[dict[str, str]]], None]) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            if not os.path.exists(path):
                return 0  # another replayer finished it
            with os.fdopen(os.dup(fd), "rb") as handle:
                lines = handle.read().splitlines()
            entries = []
            for line in lines:
                if not line.strip():
                    continue
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:  # a torn last line after a crash
                    logger.warning("skipping unreadable spool line", extra={"file": path.name})
            if entries:
                write(entries)
            os.unlink(path)
            REPLAYED_TOTAL.inc(len(entries))
            return len(entries)
        finally:
            os.close(fd)
