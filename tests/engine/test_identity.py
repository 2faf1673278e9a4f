"""GET /identity: no credential, the agent's name and a proof under the admin secret, and a
400 with a stable code for a nonce that is not 32 to 128 hex characters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from contracts.engine_identity import identity_proof
from tests.engine.conftest import EngineServer, start_server, stop_server


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("logs") / "identity-server.log"
    started = start_server(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32",
         "--max-model-len", "256", "--num-blocks", "64"],
        log,
        ENGINE_AGENT_NAME="gpu-7",
    )  # fmt: skip
    yield started
    stop_server(started)


def test_identity_answers_the_agent_and_a_proof_without_credentials(server: EngineServer) -> None:
    nonce = "5e" * 32
    response = httpx.get(f"{server.base_url}/identity", params={"nonce": nonce}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json() == {
        "agent": "gpu-7",
        "proof": identity_proof(admin_secret=server.secrets.admin, agent="gpu-7", nonce=nonce),
    }
    # Neither secret shows in the answer.
    assert server.secrets.admin not in response.text
    assert server.secrets.serving not in response.text


@pytest.mark.parametrize(
    "query",
    [
        "",
        "nonce=",
        "nonce=" + "a" * 31,
        "nonce=" + "a" * 129,
        "nonce=" + "z" * 32,
        "nonce=" + "a" * 32 + "&nonce=" + "b" * 32,
        "other=" + "a" * 32,
    ],
)
def test_a_bad_nonce_is_a_400_with_a_stable_code(server: EngineServer, query: str) -> None:
    stats_before = server.stats()
    response = httpx.get(f"{server.base_url}/identity?{query}", timeout=10)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "nonce must be 32 to 128 hex characters",
            "type": "invalid_request_error",
            "param": "nonce",
            "code": "invalid_nonce",
        }
    }
    assert server.stats() == stats_before
