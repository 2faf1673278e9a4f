"""How every process logs (contracts/logs.py): the formats, the settings that choose them,
and real processes of each kind configured by them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from contracts.logs import (
    JsonFormatter,
    TextFormatter,
    log_format_from,
    log_level_from,
    logging_config,
)
from tests.conftest import REPO_ROOT, child_environment


def record(**extra: object) -> logging.LogRecord:
    made = logging.LogRecord("agent", logging.WARNING, __file__, 1, "load %s", ("failed",), None)
    made.created = 1_900_000_000.25
    made.__dict__.update(extra)
    return made


def test_json_is_one_object_with_the_records_fields_and_the_processes() -> None:
    line = JsonFormatter({"agent": "agent-1"}).format(record(version_id=7, color_message="x"))
    assert "\n" not in line
    assert json.loads(line) == {
        "time": "2030-03-17T17:46:40.250+00:00",
        "level": "WARNING",
        "logger": "agent",
        "message": "load failed",
        "agent": "agent-1",
        "version_id": 7,
    }


def test_json_carries_the_traceback_in_one_field() -> None:
    try:
        raise ValueError("bad magic")
    except ValueError:
        failed = record(exc_info=sys.exc_info())
    entry = json.loads(JsonFormatter().format(failed))
    assert entry["exception"].splitlines()[-1] == "ValueError: bad magic"


def test_text_is_a_line_with_its_fields() -> None:
    line = TextFormatter({"agent": "agent-1"}).format(record(version_id=7))
    assert line.endswith(" WARNING agent load failed version_id=7 agent=agent-1")


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, "json"), ({"LOG_FORMAT": "JSON"}, "json"), ({"LOG_FORMAT": "text"}, "text"),
     ({"LOG_FORMAT": "plain"}, "text"), ({"LOG_FORMAT": " "}, "json")],
)  # fmt: skip
def test_log_format(environ, expected) -> None:
    assert log_format_from(environ) == expected


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^LOG_FORMAT must be json or text, got 'xml'$"):
        log_format_from({"LOG_FORMAT": "xml"})
    with pytest.raises(ValueError, match=r"^LOG_LEVEL must be one of CRITICAL, .*, got 'LOUD'$"):
        log_level_from({"LOG_LEVEL": "loud"})
    assert log_level_from({"LOG_LEVEL": "warning"}) == "WARNING"
    assert log_level_from({"LOG_LEVEL": "warning"}, "debug") == "DEBUG"
    assert logging_config(environ={})["root"]["level"] == "INFO"


# Django's processes (web and the gateway under uvicorn, ingest, workers) configure logging
# from settings.LOGGING at django.setup(); uvicorn has given its loggers handlers by then.
DJANGO_PROCESS = """
import logging, logging.config, warnings, django
from uvicorn.config import LOGGING_CONFIG
logging.config.dictConfig(LOGGING_CONFIG)
django.setup()
logging.getLogger("controlplane.test").warning("from %s", "django", extra={"k": 1})
logging.getLogger("uvicorn.error").warning("from uvicorn")
logging.getLogger("uvicorn.access").warning("access line")
warnings.warn("careful")
"""


def run(code: str, **environ: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=child_environment(**environ),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_django_process_uvicorns_loggers_and_warnings_write_json_lines() -> None:
    done = run(DJANGO_PROCESS, LOG_FORMAT="json", LOG_LEVEL="INFO")
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(e["logger"], e["message"]) for e in entries] == [
        ("controlplane.test", "from django"),
        ("uvicorn.error", "from uvicorn"),
        ("uvicorn.access", "access line"),
        ("py.warnings", entries[3]["message"]),
    ]
    assert entries[0]["k"] == 1
    assert "UserWarning: careful" in entries[3]["message"]


def test_a_bad_log_format_stops_a_process_with_its_name() -> None:
    django = run("import django; django.setup()", LOG_FORMAT="xml")
    assert django.returncode == 1
    assert "ValueError: LOG_FORMAT must be json or text, got 'xml'" in django.stderr
    agent = subprocess.run(
        [sys.executable, "-m", "agent", "--name", "a", "--port", "9100"],
        cwd=REPO_ROOT,
        env=child_environment(LOG_FORMAT="xml"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (agent.returncode, agent.stderr) == (
        2,
        "agent: LOG_FORMAT must be json or text, got 'xml'\n",
    )
