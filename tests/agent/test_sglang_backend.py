"""A real agent serves SmolLM2 through SGLang, where there is a GPU and SGLang to run.

SGLang runs on CUDA only. The test needs both: a CUDA device (torch sees one) and a python
with SGLang installed, named by SGLANG_PYTHON (SGLang pins its own torch: it lives in an
environment of its own, as vLLM's does). Elsewhere it is skipped with the reason.

The agent loads the GGUF written out as a folder (engine/hf_export.py) as an sglang
version, starts `python -m sglang.launch_server` with the serving configuration's flags,
reports ready, its heartbeats carry SGLang's figures, and a drain waits until SGLang has
nothing running, then stops it. SGLang answers no GET /identity, so the control plane does
not route tenants to it yet (docs/engines.md, "Not yet"): the chat goes to it directly.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from django.conf import settings
from django.test import override_settings

from controlplane.fleet.engine_secrets import engine_secrets_payload
from controlplane.registry import services as registry_services
from tests.agent.test_agent_processes import (
    SERVING_CONFIG,
    Fleet,
    agent_args,
    find_agent,
    free_port_pair,
    logs,
    running,
)
from tests.agent.test_vllm_backend import export_folder, final_result, heartbeats
from tests.conftest import wait_until

SGLANG_PYTHON = os.environ.get("SGLANG_PYTHON", "")


def missing() -> str:
    """Why the test cannot run here; "" when it can."""
    if not torch.cuda.is_available():
        return "SGLang runs on CUDA only and this machine has no CUDA device"
    if not SGLANG_PYTHON or not shutil.which(SGLANG_PYTHON):
        return "SGLANG_PYTHON does not name a python with SGLang installed"
    return ""


pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(bool(missing()), reason=missing() or "runs"),
]
SGLANG_READY_S = 600.0
SGLANG_CONFIG = {**SERVING_CONFIG, "dtype": "bfloat16"}


def test_an_agent_serves_through_sglang_and_heartbeats_carry_its_figures(
    live_server, redis_client: Any, tmp_path: Path
) -> None:
    with override_settings(ARTIFACT_ROOT=tmp_path / "store"):
        fleet = Fleet(tmp_path)
        artifact, _ = registry_services.artifact_store_folder(
            actor=None, path=export_folder(tmp_path)
        )
        version = registry_services.version_verify(
            actor=None,
            version=registry_services.version_register(
                actor=None, model=fleet.model, label="bf16-sglang",
                artifact_digest=artifact.digest, serving_config=SGLANG_CONFIG, engine="sglang",
            ),
            key_id=fleet.signer.key_id,
            signature=fleet.signer.sign(artifact.digest, SGLANG_CONFIG, engine="sglang"),
        )  # fmt: skip
        port = free_port_pair()
        name = "agent-sglang"
        agent_log = tmp_path / "agent.log"
        args = [
            *agent_args(name, port, settings.REDIS_URL, live_server.url, fleet),
            "--engine-ready-timeout",
            str(SGLANG_READY_S),
            "--engine-command-for",
            f"sglang={SGLANG_PYTHON} -m sglang.launch_server",
        ]
        with running(args, agent_log) as agent:
            wait_until(lambda: find_agent(name) is not None, timeout=60, message=logs(agent_log))
            load = fleet.command(name, kind="load", version_id=version.pk)["command_id"]
            wait_until(
                lambda: final_result(redis_client, load) is not None,
                timeout=SGLANG_READY_S + 120,
                interval=1.0,
                message=lambda: logs(agent_log),
            )
            result = final_result(redis_client, load)
            assert result.status.value == "succeeded", logs(agent_log)
            endpoint = f"http://127.0.0.1:{port}"
            secrets = engine_secrets_payload(agent_name=name, command_id=load)
            serving = {"Authorization": f"Bearer {secrets['serving_secret']}"}
            question = {
                "model": "smol",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12,
                "temperature": 0,
            }
            url = f"{endpoint}/v1/chat/completions"
            assert httpx.post(url, json=question, timeout=30).status_code == 401
            answer = httpx.post(url, json=question, headers=serving, timeout=120)
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]

            def served() -> list[Any]:
                return [
                    b
                    for b in heartbeats(redis_client, name)
                    if b.generated_tokens_total >= usage["completion_tokens"]
                ]

            wait_until(served, timeout=30, message=lambda: logs(agent_log))
            beat = served()[-1]
            assert beat.state.value == "ready" and beat.version_id == version.pk
            assert beat.prompt_tokens_total == usage["prompt_tokens"]
            assert beat.generated_tokens_total == usage["completion_tokens"]

            drain = fleet.command(name, kind="drain")["command_id"]
            wait_until(
                lambda: final_result(redis_client, drain) is not None,
                timeout=120,
                message=lambda: logs(agent_log),
            )
            assert final_result(redis_client, drain).detail == "drained"
            assert agent.poll() is None
