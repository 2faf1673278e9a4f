"""Versions name their engine: each combination of format, engine and task that can load is
registered, each that cannot is refused with its code and nothing recorded; engine
arguments are only the known options, and the signature covers them."""

import json
from typing import Any

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.registry.models import Model, ModelVersion
from tests.api.support import (
    SERVING_CONFIG,
    assert_error,
    embedding_folder,
    gguf_bytes,
    safetensors_bytes,
    sha256_hex,
    tar_bytes,
)

pytestmark = pytest.mark.django_db

LLAMA_CONFIG = json.dumps({"model_type": "llama"}).encode()


@pytest.fixture
def client(client_for):
    return client_for("release_manager")


@pytest.fixture
def artifacts(client, artifact_root) -> dict[str, str]:
    """Digests of a GGUF file, a lone safetensors file, a chat folder and an embedding one."""
    digests = {}
    for name, data in (("gguf", gguf_bytes()), ("safetensors", safetensors_bytes())):
        digest = sha256_hex(data)
        response = client.generic(
            "PUT", f"/api/v1/artifacts/{digest}", data, content_type="application/octet-stream"
        )
        assert response.status_code == 201, response.content
        digests[name] = digest
    folders = {
        "chat-folder": embedding_folder(**{"config.json": LLAMA_CONFIG}),
        "embedding-folder": embedding_folder(),
    }
    for name, files in folders.items():
        response = client.generic(
            "POST", "/api/v1/artifacts/folders/", tar_bytes(files), content_type="application/x-tar"
        )
        assert response.status_code == 201, response.content
        digests[name] = response.json()["digest"].removeprefix("sha256:")
    return digests


@pytest.fixture
def models(db) -> dict[str, Model]:
    return {
        "chat": Model.objects.create(name="chat-model", task="chat"),
        "embedding": Model.objects.create(name="embedding-model", task="embedding"),
    }


def register(client, model: Model, artifact: str | None, **fields: Any):
    body = {
        "model": model.pk,
        "label": fields.pop("label", "v1"),
        "serving_config": fields.pop("serving_config", SERVING_CONFIG),
        **fields,
    }
    if artifact is not None:
        body["artifact_digest"] = f"sha256:{artifact}"
    return client.post("/api/v1/versions/", body, format="json")


OPENAI_ARGS = {"base_url": "https://models.example.com/v1", "upstream_model": "gpt-4o-mini"}


@pytest.mark.parametrize(
    ("task", "artifact", "engine", "engine_args"),
    [
        ("chat", "gguf", "builtin", {}),
        ("chat", "gguf", "builtin", {"prefix_caching": False, "max_queue": 64}),
        ("chat", "gguf", "llama.cpp", {"n_gpu_layers": -1, "cache_type_k": "q8_0"}),
        ("chat", "chat-folder", "builtin", {}),
        ("chat", "chat-folder", "vllm", {"tensor_parallel_size": 2, "gpu_memory_percent": 90}),
        (
            "chat",
            "chat-folder",
            "sglang",
            {"mem_fraction_static_percent": 80, "radix_cache": False},
        ),
        ("embedding", "embedding-folder", "builtin", {}),
        ("embedding", "embedding-folder", "vllm", {}),
        ("chat", None, "openai", OPENAI_ARGS),
        ("embedding", None, "openai", OPENAI_ARGS),
    ],
)
def test_every_combination_that_loads_is_registered(
    client, artifacts, models, task, artifact, engine, engine_args
) -> None:
    digest = artifacts[artifact] if artifact else None
    response = register(client, models[task], digest, engine=engine, engine_args=engine_args)
    assert response.status_code == 201, response.content
    version = response.json()
    assert (version["engine"], version["engine_args"]) == (engine, engine_args)
    assert version["artifact_digest"] == (f"sha256:{digest}" if digest else None)
    assert version["is_folder"] == (None if artifact is None else artifact.endswith("folder"))
    event = AuditEvent.objects.get(action="version.register")
    assert (event.after["engine"], event.after["engine_args"]) == (engine, engine_args)


def vllm(**engine_args: Any) -> dict[str, Any]:
    return {"engine": "vllm", "engine_args": engine_args}


def openai(**engine_args: Any) -> dict[str, Any]:
    return {"engine": "openai", "engine_args": engine_args}


INT8 = {**SERVING_CONFIG, "dtype": "int8"}
BAD_ARGS = "invalid_engine_args"


@pytest.mark.parametrize(
    ("task", "artifact", "fields", "code", "field"),
    [
        ("chat", "gguf", {"engine": "vllm"}, "engine_format_mismatch", "engine"),
        ("chat", "gguf", {"engine": "sglang"}, "engine_format_mismatch", "engine"),
        ("chat", "chat-folder", {"engine": "llama.cpp"}, "engine_format_mismatch", "engine"),
        ("chat", "safetensors", {"engine": "builtin"}, "engine_format_mismatch", "engine"),
        ("chat", "safetensors", {"engine": "vllm"}, "engine_format_mismatch", "engine"),
        ("embedding", "gguf", {"engine": "builtin"}, "engine_task_mismatch", "engine"),
        ("embedding", "embedding-folder", {"engine": "sglang"}, "engine_task_mismatch", "engine"),
        ("chat", "embedding-folder", {"engine": "builtin"}, "engine_cannot_load", "engine"),
        ("embedding", "chat-folder", {"engine": "builtin"}, "engine_cannot_load", "engine"),
        ("chat", "gguf", openai(**OPENAI_ARGS), "artifact_not_allowed", "engine"),
        ("chat", None, {"engine": "builtin"}, "artifact_required", "engine"),
        ("chat", "chat-folder", {**vllm(), "serving_config": INT8}, "engine_dtype_mismatch",
         "serving_config"),
        ("chat", "chat-folder", vllm(trust_remote_code=True), BAD_ARGS, "engine_args"),
        ("chat", "chat-folder", vllm(host="0.0.0.0"), BAD_ARGS, "engine_args"),
        ("chat", "chat-folder", vllm(port=9000), BAD_ARGS, "engine_args"),
        ("chat", "chat-folder", vllm(tensor_parallel_size="2"), BAD_ARGS, "engine_args"),
        ("chat", "chat-folder", vllm(tensor_parallel_size=1.5), BAD_ARGS, "engine_args"),
        ("chat", "chat-folder", vllm(gpu_memory_percent=100), BAD_ARGS, "engine_args"),
        ("chat", "chat-folder", vllm(gpu_memory_percent=0.9), BAD_ARGS, "engine_args"),
        ("chat", "chat-folder", vllm(quantization="--load-format=pt"), BAD_ARGS, "engine_args"),
        ("chat", "chat-folder", vllm(enforce_eager="yes"), BAD_ARGS, "engine_args"),
        ("chat", "gguf", {"engine": "builtin", "engine_args": {"tensor_parallel_size": 2}},
         BAD_ARGS, "engine_args"),
        ("chat", None, openai(base_url="https://user:pw@x.example/v1", upstream_model="m"),
         BAD_ARGS, "engine_args"),
        ("chat", None, openai(base_url="file:///etc/passwd", upstream_model="m"), BAD_ARGS,
         "engine_args"),
        ("chat", None, openai(upstream_model="m"), BAD_ARGS, "engine_args"),
    ],
    ids=[
        "gguf-vllm", "gguf-sglang", "folder-llama.cpp", "bare-safetensors-builtin",
        "bare-safetensors-vllm", "gguf-embedding", "sglang-embedding", "bert-as-chat",
        "llama-as-embedding", "openai-with-artifact", "builtin-without-artifact",
        "int8-on-vllm", "remote-code", "host", "port", "string-number", "fractional-int",
        "out-of-range", "fraction", "flag-injection", "string-bool", "other-engines-option",
        "url-credentials", "file-url", "no-endpoint",
    ],
)  # fmt: skip
def test_a_combination_that_cannot_load_is_refused_with_its_reason(
    client, artifacts, models, task, artifact, fields, code, field
) -> None:
    before = (ModelVersion.objects.count(), AuditEvent.objects.count())
    response = register(client, models[task], artifacts[artifact] if artifact else None, **fields)
    error = assert_error(response, 400, code)
    assert field in error["fields"], error
    assert (ModelVersion.objects.count(), AuditEvent.objects.count()) == before


def test_an_unknown_engine_is_a_validation_error(client, artifacts, models) -> None:
    response = register(client, models["chat"], artifacts["gguf"], engine="tensorrt")
    assert response.status_code == 400
    assert "engine" in response.json()["error"]["fields"]
    assert not ModelVersion.objects.exists()


def test_the_signature_must_cover_the_engine_and_its_arguments(
    client, artifacts, models, signer
) -> None:
    args = {"tensor_parallel_size": 2}
    digest = artifacts["chat-folder"]
    created = register(client, models["chat"], digest, engine="vllm", engine_args=args)
    assert created.status_code == 201, created.content
    url = f"/api/v1/versions/{created.json()['id']}/verify/"
    for wrong in (
        signer.sign(digest, SERVING_CONFIG),
        signer.sign(digest, SERVING_CONFIG, engine="vllm", engine_args={"tensor_parallel_size": 4}),
        signer.sign(digest, SERVING_CONFIG, engine="sglang", engine_args=args),
    ):
        body = {"key_id": signer.key_id, "signature": wrong}
        assert_error(client.post(url, body, format="json"), 400, "bad_signature")
    right = signer.sign(digest, SERVING_CONFIG, engine="vllm", engine_args=args)
    verified = client.post(url, {"key_id": signer.key_id, "signature": right}, format="json")
    assert verified.status_code == 200, verified.content
    assert verified.json()["status"] == "verified"


def test_an_openai_version_signs_an_empty_digest(client, models, signer) -> None:
    created = register(client, models["chat"], None, engine="openai", engine_args=OPENAI_ARGS)
    assert created.status_code == 201, created.content
    signature = signer.sign("", SERVING_CONFIG, engine="openai", engine_args=OPENAI_ARGS)
    verified = client.post(
        f"/api/v1/versions/{created.json()['id']}/verify/",
        {"key_id": signer.key_id, "signature": signature},
        format="json",
    )
    assert verified.status_code == 200, verified.content
    assert verified.json()["format"] is None
