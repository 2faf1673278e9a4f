"""The agent's options, refused on construction with the option named."""

import re
from pathlib import Path

import pytest

from agent.config import AgentConfig


def config(**changes: object) -> AgentConfig:
    options: dict = {
        "name": "agent-a",
        "port": 8100,
        "redis_url": "redis://127.0.0.1:6379/0",
        "control_plane_url": "http://127.0.0.1:8000",
        "token": "token",
        "state_dir": Path("/tmp/agent-a"),
    }
    return AgentConfig(**{**options, **changes})


def test_the_http_endpoint_is_off_unless_a_port_is_given() -> None:
    assert config().http_port is None
    assert config(http_port=9100, http_bind_host="0.0.0.0").http_port == 9100


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"http_port": 0}, "--http-port must be within 1..65535, got 0"),
        ({"http_port": 65536}, "--http-port must be within 1..65535, got 65536"),
        ({"http_port": 8100}, "--http-port 8100 is one of the engine ports"),
        ({"http_port": 8101}, "--http-port 8101 is one of the engine ports"),
        ({"gpu_index": -1}, "--gpu-index must be 0 or more, got -1"),
    ],
)
def test_bad_options_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        config(**changes)
