"""How every process logs: web, gateway, ingest, workers, agents and engines alike.

`LOG_FORMAT` chooses one JSON object per line (`json`, the default: log shippers need no
parsing rules) or a line for people (`text`); `LOG_LEVEL` the level (INFO by default).
Records go to stderr. Anything passed with `extra=` becomes a field of its own.

`logging_configure` sets up a process; Django's processes get the same through their
settings (LOGGING is `logging_config()`, applied by `logging_apply`). uvicorn's loggers
are handed to the root's handler, so its lines are formatted like everything else.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
# The name `text` had before it was called that; deployments may still set it.
_FORMAT_ALIASES = {"plain": "text"}
# What a LogRecord holds of its own: everything else on it came through `extra=`.
RESERVED_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}
# Extras that repeat the message for terminals (uvicorn's, with colour codes): left out.
_OMITTED_FIELDS = frozenset({"color_message"})
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def log_format_from(environ: Mapping[str, str]) -> str:
    """`json` or `text`, from LOG_FORMAT; a clear ValueError for anything else."""
    raw = environ.get("LOG_FORMAT", "").strip().lower() or "json"
    value = _FORMAT_ALIASES.get(raw, raw)
    if value not in LOG_FORMATS:
        raise ValueError(f"LOG_FORMAT must be json or text, got {raw[:40]!r}")
    return value


def log_level_from(environ: Mapping[str, str], override: str | None = None) -> str:
    """A level name, from `override` (a command-line flag) or LOG_LEVEL; INFO by default."""
    raw = (override or environ.get("LOG_LEVEL", "")).strip().upper() or "INFO"
    if raw not in LOG_LEVELS:
        raise ValueError(f"LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {raw[:40]!r}")
    return raw


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record was given with `extra=`."""
    return {
        key: value
        for key, value in vars(record).items()
        if key not in RESERVED_FIELDS and key not in _OMITTED_FIELDS and not key.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", ...extra fields, "exception"}` on one line;
    `fields` are added to every record (an agent adds its name)."""

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields,
            **record_fields(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`time level logger message key=value ...` (extra fields, then `fields`)."""

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__(TEXT_FORMAT)
        self.fields = dict(fields or {})

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extras = {**record_fields(record), **self.fields}
        return line + "".join(f" {key}={value}" for key, value in extras.items())


FORMATTERS: dict[str, type[logging.Formatter]] = {"json": JsonFormatter, "text": TextFormatter}


def logging_config(
    *,
    environ: Mapping[str, str] | None = None,
    level: str | None = None,
    fields: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `logging.config.dictConfig` of a process (Django's LOGGING is this)."""
    environ = os.environ if environ is None else environ
    formatter = FORMATTERS[log_format_from(environ)]
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"()": formatter, "fields": dict(fields or {})}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "default"}},
        "root": {"handlers": ["console"], "level": log_level_from(environ, level)},
        # uvicorn gives these handlers of its own (plain text) when it starts: its lines go
        # through the root's instead. Their levels stay uvicorn's (--log-level).
        "loggers": {
            name: {"handlers": [], "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }


def logging_configure(
    *,
    environ: Mapping[str, str] | None = None,
    level: str | None = None,
    fields: Mapping[str, Any] | None = None,
) -> None:
    """Configure this process's logging from LOG_FORMAT and LOG_LEVEL (or `level`).
    Raises ValueError naming a bad LOG_FORMAT or LOG_LEVEL."""
    logging_apply(logging_config(environ=environ, level=level, fields=fields))


def logging_apply(config: dict[str, Any]) -> None:
    """Apply a `logging_config` (Django's LOGGING_CONFIG). Warnings and uncaught exceptions
    are logged too, so that a process's output stays one record a line in JSON."""
    logging.config.dictConfig(config)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(
    kind: type[BaseException], value: BaseException, traceback: TracebackType | None
) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("uncaught").critical(
        "uncaught %s", kind.__name__, exc_info=(kind, value, traceback)
    )


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("uncaught").error(
        "uncaught %s in thread %s",
        args.exc_type.__name__,
        name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )
