"""The engine's log: one JSON object per line (LOG_FORMAT=json), one line per API request
with the caller's request id, which the answer echoes; an id out of bounds is replaced."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.engine.conftest import start_server, stop_server

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


def test_each_request_is_logged_as_json_with_its_request_id(tiny_llama: Path, tmp_path: Path):
    server = start_server(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32",
         "--max-model-len", "256", "--num-blocks", "64"],
        tmp_path / "engine.log",
        LOG_FORMAT="json",
        LOG_LEVEL="INFO",
    )  # fmt: skip
    url = f"{server.base_url}/v1/completions"
    try:
        given = httpx.post(url, json=BODY, headers={**server.serving, "x-request-id": "gw-1.a:b_c"})
        assert (given.status_code, given.headers["x-request-id"]) == (200, "gw-1.a:b_c")
        with httpx.stream(
            "POST",
            url,
            json={**BODY, "stream": True},
            headers={**server.serving, "x-request-id": "gw-stream"},
        ) as streamed:
            assert streamed.headers["x-request-id"] == "gw-stream"
            assert streamed.read().endswith(b"data: [DONE]\n\n")
        refused = httpx.post(url, json=BODY, headers={"x-request-id": "gw-refused"})
        assert (refused.status_code, refused.headers["x-request-id"]) == (401, "gw-refused")
        replaced = {}
        for bad in ("a" * 129, "two words", "a/b", ""):
            response = httpx.post(url, json=BODY, headers={**server.serving, "x-request-id": bad})
            assert response.status_code == 200
            replaced[bad] = response.headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", replaced[bad]), bad
        unnamed = httpx.post(url, json=BODY, headers=server.serving)
        assert re.fullmatch(r"[0-9a-f]{32}", unnamed.headers["x-request-id"])
    finally:
        assert stop_server(server) == 0
    lines = server.log().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all(isinstance(record, dict) for record in records)
    assert {"time", "level", "logger", "message"} <= set(records[0])
    logged = {
        record["request_id"]: record
        for record in records
        if record["logger"] == "engine.server" and record.get("path") == "/v1/completions"
    }
    assert logged.keys() == {
        "gw-1.a:b_c", "gw-stream", "gw-refused", *replaced.values(),
        unnamed.headers["x-request-id"],
    }  # fmt: skip
    first = logged["gw-1.a:b_c"]
    assert (first["level"], first["method"], first["status"]) == ("INFO", "POST", 200)
    assert first["message"] == "POST /v1/completions 200"
    assert first["duration_ms"] > 0
    assert logged["gw-stream"]["status"] == 200
    assert logged["gw-refused"]["status"] == 401
    # uvicorn's own lines come out in the same format.
    assert any(record["logger"].startswith("uvicorn") for record in records)
