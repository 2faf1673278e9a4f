"""An engine's output through the agent's logging, and why an engine failed: real child
processes (small scripts where an engine would be; the real engine runs in
test_agent_processes.py), real pipes, the agent's real logging."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from pathlib import Path

import pytest

from agent.engine_output import engine_record
from agent.engine_process import EngineProcess, EngineSpec, EngineStartError
from agent.engines.builtin import BuiltinAdapter
from contracts.logs import JsonFormatter
from contracts.streams import ENGINE_ERROR_MESSAGE_MAX_LENGTH, EngineFailure
from engine.config import EngineSecrets

FIELDS = {"engine_port": 9100, "engine_pid": 42, "version_id": 7}


def test_a_json_line_keeps_its_time_level_logger_and_fields() -> None:
    line = json.dumps(
        {
            "time": "2026-12-05T08:00:00.250+00:00",
            "level": "ERROR",
            "logger": "engine.server",
            "message": "POST /v1/completions 500",
            "request_id": "gw-1",
            "status": 500,
            "name": "not the logger",  # a LogRecord's own attribute: kept under another name
        }
    )
    record, is_unstructured = engine_record(line, FIELDS)
    assert not is_unstructured
    assert json.loads(JsonFormatter({"agent": "agent-1"}).format(record)) == {
        "time": "2026-12-05T08:00:00.250+00:00",
        "level": "ERROR",
        "logger": "engine.server",
        "message": "POST /v1/completions 500",
        "agent": "agent-1",
        "request_id": "gw-1",
        "status": 500,
        "engine_name": "not the logger",
        **FIELDS,
    }


@pytest.mark.parametrize(
    ("line", "name", "level", "message", "is_unstructured"),
    [
        (
            "2026-12-05 08:00:00,250 INFO engine.llm_engine ready: 3 blocks",
            "engine.llm_engine",
            "INFO",
            "ready: 3 blocks",
            False,
        ),
        # vLLM's own lines, and those of its engine core process: their level is kept
        ("INFO 12-05 08:00:00 [api_server.py:1] Starting", "engine", "INFO", None, False),
        ("(EngineCore pid=7) ERROR 12-05 08:00:00 [core.py:9] x", "engine", "ERROR", None, False),
        ("Traceback (most recent call last):", "engine", "WARNING", None, True),
        ('{"no": "message"}', "engine", "WARNING", None, True),
        ("{not json", "engine", "WARNING", None, True),
        ('{"message": "x", "level": "LOUD"}', "engine", "INFO", "x", False),
    ],
)
def test_other_lines(line, name, level, message, is_unstructured) -> None:
    record, unstructured = engine_record(line, FIELDS)
    assert (record.name, record.levelname, record.getMessage()) == (name, level, message or line)
    assert unstructured is is_unstructured
    assert record.engine_port == 9100  # type: ignore[attr-defined]


def fake_engine(script: str, port: int = 9100) -> EngineProcess:
    spec = EngineSpec(
        model_path=Path("/nonexistent"),
        serving_config={},
        served_model_name="smol",
        host="127.0.0.1",
        port=port,
        threads=1,
        secrets=EngineSecrets.generate(),
        version_id=7,
    )
    # The script ignores the engine's arguments, which come after it.
    return EngineProcess(
        adapter=BuiltinAdapter((sys.executable, "-c", script)),
        spec=spec,
        endpoint=f"http://127.0.0.1:{port}",
    )


def start_failure(engine: EngineProcess, timeout_s: float = 30) -> EngineStartError:
    with pytest.raises(EngineStartError) as raised:
        engine.start()
        engine.wait_ready(timeout_s, lambda: False)
    engine.stop()
    return raised.value


CRASHES = """
import json, sys
print(json.dumps({"time": "2026-12-05T08:00:00.000+00:00", "level": "INFO",
                  "logger": "engine.server", "message": "loading", "request_id": "r-1"}))
print("2026-12-05 08:00:01,000 ERROR engine.loader the weights are not a GGUF file")
print("Traceback (most recent call last):", file=sys.stderr)
print("ValueError: bad magic", file=sys.stderr)
sys.exit(3)
"""


def test_an_engine_that_exits_while_starting_says_why_and_its_lines_are_logged(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="agent.engine")
    failure = start_failure(fake_engine(CRASHES))
    assert failure.error is not None
    assert failure.error.reason is EngineFailure.EXITED
    assert failure.error.message == (
        "exited with code 3 while starting: the weights are not a GGUF file"
        " | Traceback (most recent call last): | ValueError: bad magic"
    )
    assert str(failure) == f"engine {failure.error.message}"
    logged = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert logged == [
        ("engine.server", "INFO", "loading"),
        ("engine.loader", "ERROR", "the weights are not a GGUF file"),
        ("engine", "WARNING", "Traceback (most recent call last):"),
        ("engine", "WARNING", "ValueError: bad magic"),
    ]
    assert caplog.records[0].request_id == "r-1"
    assert {r.version_id for r in caplog.records} == {7}


ROOT_CAUSE = """
import sys
print("(EngineCore pid=7) ERROR 12-05 08:00:00 [core.py:9] ValueError: No common block size")
for n in range(40):
    print(f"  File x.py, line {n}, in f", file=sys.stderr)
print("RuntimeError: Engine core initialization failed. See root cause above.", file=sys.stderr)
sys.exit(1)
"""


def test_a_failed_start_leads_with_its_first_error_the_root_cause() -> None:
    failure = start_failure(fake_engine(ROOT_CAUSE))
    assert failure.error is not None
    message = failure.error.message
    assert message.startswith(
        "exited with code 1 while starting: (EngineCore pid=7) ERROR 12-05 08:00:00 "
        "[core.py:9] ValueError: No common block size ... "
    )
    assert message.endswith("See root cause above.")
    assert len(message) <= ENGINE_ERROR_MESSAGE_MAX_LENGTH


def test_a_killed_engine_and_a_long_tail_stay_within_the_bound() -> None:
    script = (
        "import os, signal, sys\n"
        "for n in range(40): print(f'line {n} ' + 'x' * 200, file=sys.stderr, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    failure = start_failure(fake_engine(script))
    assert failure.error is not None
    assert failure.error.reason is EngineFailure.KILLED
    message = failure.error.message
    assert message.startswith("killed by SIGKILL while starting: ")
    assert len(message) <= ENGINE_ERROR_MESSAGE_MAX_LENGTH
    # The newest lines, whole, as many as fit.
    assert message.endswith(": line 38 " + "x" * 200 + " | line 39 " + "x" * 200)


def test_an_engine_command_that_cannot_run_and_one_never_ready() -> None:
    spec = fake_engine("").spec
    missing = EngineProcess(
        adapter=BuiltinAdapter(("/nonexistent/engine",)), spec=spec, endpoint="http://h:1"
    )
    failure = start_failure(missing)
    assert failure.error is not None
    assert failure.error.reason is EngineFailure.SPAWN_FAILED
    assert failure.error.message.startswith(
        "could not run the builtin engine (/nonexistent/engine): "
    )

    silent = fake_engine("import sys, time\nprint('warming', file=sys.stderr)\ntime.sleep(60)")
    failure = start_failure(silent, timeout_s=1)
    assert failure.error is not None
    assert failure.error.reason is EngineFailure.NOT_READY
    assert failure.error.message == "not ready within 1s: warming"


FAILED_STEP_LOOP = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "failed", "error": "CUDA error: illegal memory access"})
        self.send_response(503)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def test_a_running_engine_whose_step_loop_failed_says_why() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = fake_engine(FAILED_STEP_LOOP, port=port)
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while engine.health() != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        error = engine.failed_error()
    finally:
        engine.stop()
    assert error.reason is EngineFailure.STEP_FAILED
    assert error.message == "step loop failed: CUDA error: illegal memory access"
