"""An engine's output (stdout and stderr on one pipe) re-emitted through the agent's own
logging, line by line, and its last lines worth reporting kept for a failure's reason.

A JSON line (the engine logs as the agent does: contracts/logs.py) becomes a record of its
own with the engine's time, level, logger and fields (its request ids among them); a text
line of that format keeps its level and logger, a line led by its level (vLLM's, SGLang's)
keeps its level; anything else (a traceback, a warning printed by a library) is a warning
of logger `engine`. The first exception line is kept apart: a failure's root cause, which a
long traceback pushes out of the last lines. Every record gets `fields` (the
engine's port and pid, the version it serves). Nothing is written to a file.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import deque
from collections.abc import Mapping
from datetime import datetime
from typing import IO, Any

from contracts.logs import RESERVED_FIELDS

logger = logging.getLogger("agent.engine")

MAX_LINE_BYTES = 16 * 1024  # a longer line is re-emitted in pieces
TAIL_LINES = 20
TAIL_LINE_CHARACTERS = 300
LEVELS = logging.getLevelNamesMapping()
# contracts.logs.TEXT_FORMAT: "%(asctime)s %(levelname)s %(name)s %(message)s"
TEXT_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (CRITICAL|ERROR|WARNING|INFO|DEBUG) (\S+) (.*)"
)
# The lines other engines write (vLLM, SGLang): a level first, after the name and pid of the
# helper process that wrote it, if any: "(EngineCore pid=7) INFO 12-05 09:32:42 [x.py:1] ...".
PREFIXED_LINE = re.compile(r"(?:\(\S+ pid=\d+\) )?(CRITICAL|ERROR|WARNING|INFO|DEBUG) (.*)")
# An exception's last line, "ValueError: ...": the root cause of a failure, kept apart.
ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): ")
# The JSON formatter's own keys; the others are the record's fields.
_JSON_KEYS = frozenset({"time", "level", "logger", "message"})


def engine_output_level() -> int:
    """The least level of engine line the agent logs."""
    return logger.getEffectiveLevel()


def engine_record(line: str, fields: Mapping[str, Any]) -> tuple[logging.LogRecord, bool]:
    """The record for one line of engine output, and whether the line was unstructured."""
    values: dict[str, Any] = {"name": "engine", "levelno": logging.WARNING, "msg": line}
    is_structured = False
    if line.startswith("{"):
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            data = None
        if isinstance(data, dict) and isinstance(data.get("message"), str):
            is_structured = True
            values["levelno"] = LEVELS.get(str(data.get("level")).upper(), logging.INFO)
            values["name"] = str(data.get("logger") or "engine")[:100]
            values["msg"] = data["message"]
            created = _timestamp(data.get("time"))
            if created is not None:
                values["created"] = created
                values["msecs"] = (created - int(created)) * 1000
            for key, value in data.items():
                if key not in _JSON_KEYS:
                    # A field a LogRecord holds itself keeps its value under another name.
                    is_own = key in RESERVED_FIELDS or key.startswith("_")
                    values[f"engine_{key}" if is_own else key] = value
    else:
        match = TEXT_LINE.fullmatch(line)
        prefixed = None if match else PREFIXED_LINE.fullmatch(line)
        if match:
            is_structured = True
            level, name, message = match.groups()
            values.update(levelno=LEVELS[level], name=name, msg=message)
        elif prefixed:
            is_structured = True
            values["levelno"] = LEVELS[prefixed.group(1)]
    values["levelname"] = logging.getLevelName(values["levelno"])
    values.update(fields)
    record = logging.makeLogRecord(values)
    record.args = None  # the message is text, not a format
    return record, not is_structured


def _timestamp(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def tail_entry(record: logging.LogRecord) -> str:
    """A line for a failure's reason: the message, with an exception's last line."""
    text = record.getMessage()
    exception = getattr(record, "exception", None)
    if isinstance(exception, str) and exception.strip():
        text = f"{text} ({exception.strip().splitlines()[-1]})"
    return text[:TAIL_LINE_CHARACTERS]


class EngineOutput:
    """Reads an engine's pipe on a thread of its own until the engine closes it."""

    def __init__(self, pipe: IO[bytes], *, fields: Mapping[str, Any], name: str) -> None:
        self._pipe = pipe
        self.fields = dict(fields)
        # Warnings and worse, and unstructured lines: what says why an engine failed.
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.first_error = ""  # the first exception line it wrote (ERROR_LINE)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with self._pipe:
            for raw in iter(lambda: self._pipe.readline(MAX_LINE_BYTES), b""):
                self.emit(raw.decode("utf-8", errors="replace").rstrip("\r\n"))

    def emit(self, line: str) -> None:
        if not line.strip():
            return
        record, is_unstructured = engine_record(line, self.fields)
        if is_unstructured or record.levelno >= logging.WARNING:
            entry = tail_entry(record)
            with self._lock:
                self._tail.append(entry)
                if not self.first_error and ERROR_LINE.search(entry):
                    self.first_error = entry
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)

    def tail(self, characters: int, *, wait_s: float = 0.0) -> str:
        """The last lines worth reporting, newest last, joined by ` | ` within `characters`;
        waits up to `wait_s` for the rest of the output of an engine that has exited."""
        if wait_s > 0:
            self._thread.join(timeout=wait_s)
        with self._lock:
            lines = list(self._tail)
        kept: list[str] = []
        size = 0
        for line in reversed(lines):
            size += len(line) + 3
            if size > characters + 3:
                if not kept:  # the newest line alone is too long: its end
                    kept.append(line[-characters:])
                break
            kept.append(line)
        return " | ".join(reversed(kept))
