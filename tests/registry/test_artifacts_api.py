"""Artifact upload (streamed, hashed by the server, checked by header) and download (ranges)."""

import hashlib
import pickle
import struct
import zipfile
from io import BytesIO

import pytest
from django.test import override_settings

from controlplane.registry.models import Artifact
from tests.api.support import (
    assert_error,
    audit_count,
    embedding_folder,
    gguf_bytes,
    safetensors_bytes,
    sha256_hex,
)

pytestmark = pytest.mark.django_db


def put(client, digest: str, data: bytes):
    return client.generic(
        "PUT", f"/api/v1/artifacts/{digest}", data, content_type="application/octet-stream"
    )


def store_files(root) -> list:
    return sorted(path for path in root.rglob("*") if path.is_file()) if root.exists() else []


@pytest.mark.parametrize(
    ("data", "expected_format"),
    [(gguf_bytes(b"x" * 3000), "gguf"), (safetensors_bytes(), "safetensors")],
)
def test_upload_stores_by_content_and_download_returns_it(
    admin_client, artifact_root, data, expected_format
) -> None:
    digest = sha256_hex(data)
    with override_settings(ARTIFACT_CHUNK_BYTES=1000):  # several chunks each way
        response = put(admin_client, digest, data)
    assert response.status_code == 201, response.content
    assert response.json()["digest"] == f"sha256:{digest}"
    assert response.json()["format"] == expected_format
    assert response.json()["size_bytes"] == len(data)
    assert (artifact_root / "sha256" / digest[:2] / digest).read_bytes() == data
    assert not list((artifact_root / "tmp").iterdir())

    again = put(admin_client, digest, data)
    assert again.status_code == 200
    assert Artifact.objects.count() == 1

    download = admin_client.get(f"/api/v1/artifacts/{digest}")
    assert download.status_code == 200
    assert b"".join(download.streaming_content) == data
    assert download["X-Artifact-Digest"] == f"sha256:{digest}"
    assert download["Accept-Ranges"] == "bytes"
    assert download["Content-Length"] == str(len(data))

    listing = admin_client.get("/api/v1/artifacts/", {"digest": f"sha256:{digest}"}).json()
    assert [row["digest"] for row in listing["results"]] == [f"sha256:{digest}"]


def test_range_requests_resume_a_download(admin_client, artifact_root) -> None:
    data = gguf_bytes(bytes(range(256)) * 10)
    digest = sha256_hex(data)
    assert put(admin_client, digest, data).status_code == 201
    url = f"/api/v1/artifacts/{digest}"
    size = len(data)

    partial = admin_client.get(url, HTTP_RANGE="bytes=100-")
    assert partial.status_code == 206
    assert partial["Content-Range"] == f"bytes 100-{size - 1}/{size}"
    assert b"".join(partial.streaming_content) == data[100:]

    middle = admin_client.get(url, HTTP_RANGE="bytes=10-19")
    assert middle.status_code == 206
    assert middle["Content-Length"] == "10"
    assert b"".join(middle.streaming_content) == data[10:20]

    suffix = admin_client.get(url, HTTP_RANGE="bytes=-5")
    assert b"".join(suffix.streaming_content) == data[-5:]

    beyond = admin_client.get(url, HTTP_RANGE=f"bytes={size}-")
    assert_error(beyond, 416, "range_not_satisfiable")
    assert beyond["Content-Range"] == f"bytes */{size}"


def test_unknown_digest_is_404(client_for, artifact_root) -> None:
    assert_error(client_for("agent").get(f"/api/v1/artifacts/{'0' * 64}"), 404, "not_found")


def _assert_refused(response, status_code, code, artifact_root, before) -> dict:
    error = assert_error(response, status_code, code)
    assert Artifact.objects.count() == 0
    assert audit_count() == before
    assert store_files(artifact_root) == []
    return error


def test_digest_mismatch_is_refused(admin_client, artifact_root) -> None:
    before = audit_count()
    data = gguf_bytes()
    response = put(admin_client, sha256_hex(b"something else"), data)
    _assert_refused(response, 400, "digest_mismatch", artifact_root, before)


def test_oversize_upload_is_refused_while_streaming(admin_client, artifact_root) -> None:
    before = audit_count()
    data = gguf_bytes(b"x" * 5000)
    with override_settings(ARTIFACT_MAX_BYTES=4096, ARTIFACT_CHUNK_BYTES=1024):
        response = put(admin_client, sha256_hex(data), data)
    _assert_refused(response, 413, "artifact_too_large", artifact_root, before)


def test_oversize_is_refused_while_streaming_even_without_content_length(artifact_root) -> None:
    from controlplane.core.errors import DomainError
    from controlplane.registry import services

    data = gguf_bytes(b"x" * 5000)
    consumed = []

    def chunks():
        for start in range(0, len(data), 1000):
            consumed.append(start)
            yield data[start : start + 1000]

    with pytest.raises(DomainError) as refused:
        services.artifact_store(
            actor=None, chunks=chunks(), declared_digest=sha256_hex(data), max_bytes=2500
        )
    assert refused.value.code == "artifact_too_large"
    assert len(consumed) == 3  # stopped at the first chunk past the limit
    assert store_files(artifact_root) == []


def _torch_like_zip() -> bytes:
    buffer = BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"weight": [1.0, 2.0]}))
    return buffer.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps({"weight": [1.0, 2.0]}, protocol=2),
        pickle.dumps({"weight": [1.0, 2.0]}, protocol=5),
        _torch_like_zip(),
    ],
    ids=["pickle-2", "pickle-5", "torch-zip"],
)
def test_pickle_based_formats_are_refused_with_the_reason(
    admin_client, artifact_root, data
) -> None:
    before = audit_count()
    response = put(admin_client, sha256_hex(data), data)
    error = _assert_refused(response, 415, "unsafe_format", artifact_root, before)
    assert "pickle" in error["message"]
    assert "run arbitrary code" in error["message"]


@pytest.mark.parametrize(
    "data",
    [
        b"just some text, named model.gguf by its owner",
        struct.pack("<Q", 10_000) + b"{not json",
        b"GGUF" + struct.pack("<I", 99) + b"future",
    ],
    ids=["text", "broken-safetensors", "unknown-gguf-version"],
)
def test_files_that_are_not_gguf_or_safetensors_are_refused(
    admin_client, artifact_root, data
) -> None:
    before = audit_count()
    response = put(admin_client, sha256_hex(data), data)
    _assert_refused(response, 415, "unknown_format", artifact_root, before)


def test_upload_records_an_audit_event(client_for, users, artifact_root) -> None:
    data = safetensors_bytes()
    response = put(client_for("release_manager"), sha256_hex(data), data)
    assert response.status_code == 201
    listing = client_for("admin").get("/api/v1/audit-events/", {"action": "artifact.store"})
    [event] = listing.json()["results"]
    assert event["actor"] == "release_manager"
    assert event["object_id"] == hashlib.sha256(data).hexdigest()
    assert event["after"] == {"format": "safetensors", "size_bytes": len(data)}


def test_agent_downloads_with_a_bearer_token(client_for, artifact_root) -> None:
    from rest_framework.test import APIClient

    data = gguf_bytes()
    digest = sha256_hex(data)
    assert put(client_for("admin"), digest, data).status_code == 201
    token = client_for("agent").post("/api/v1/tokens/", {"name": "agent-1"}, format="json")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {token.json()['token']}")
    response = agent.get(f"/api/v1/artifacts/{digest}", HTTP_ACCEPT="application/octet-stream")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == data
    # ... and nothing else.
    assert agent.get("/api/v1/versions/").status_code == 403
    assert agent.generic("PUT", f"/api/v1/artifacts/{digest}", data).status_code == 403


def test_register_artifact_command_checks_what_it_stores(artifact_root, tmp_path) -> None:
    from django.core.management import CommandError, call_command

    good = tmp_path / "model.safetensors"
    good.write_bytes(safetensors_bytes())
    digest = sha256_hex(good.read_bytes())
    call_command("register_artifact", str(good), "--digest", f"sha256:{digest}")
    assert Artifact.objects.get().digest == digest

    with pytest.raises(CommandError, match="digest_mismatch"):
        other = tmp_path / "other.gguf"
        other.write_bytes(gguf_bytes(b"other"))
        call_command("register_artifact", str(other), "--digest", f"sha256:{digest[::-1]}")
    pickled = tmp_path / "model.safetensors.bin"
    pickled.write_bytes(pickle.dumps([1, 2, 3], protocol=4))
    with pytest.raises(CommandError, match="unsafe_format"):
        call_command("register_artifact", str(pickled))
    assert Artifact.objects.count() == 1

    folder = tmp_path / "minilm"
    for name, content in embedding_folder().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    with pytest.raises(CommandError, match="digest_mismatch"):
        call_command("register_artifact", str(folder), "--digest", f"sha256:{digest}")
    assert Artifact.objects.count() == 1
    (folder / "run.py").write_text("import os")
    with pytest.raises(CommandError, match="file_type_not_allowed"):
        call_command("register_artifact", str(folder))
    (folder / "run.py").unlink()
    call_command("register_artifact", str(folder))
    stored = Artifact.objects.get(format="hf-safetensors")
    assert [file["path"] for file in stored.manifest or []] == sorted(embedding_folder())
    call_command("register_artifact", str(folder), "--digest", f"sha256:{stored.digest}")
    assert Artifact.objects.count() == 2


def test_head_gives_the_headers_without_the_body(client_for, artifact_root) -> None:
    data = gguf_bytes(b"head")
    digest = sha256_hex(data)
    assert put(client_for("admin"), digest, data).status_code == 201
    response = client_for("agent").head(f"/api/v1/artifacts/{digest}")
    assert response.status_code == 200
    assert response["X-Artifact-Digest"] == f"sha256:{digest}"
    assert response["Content-Length"] == str(len(data))
