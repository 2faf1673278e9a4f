"""Folder artifacts over the API: a tar in, a manifest and content-addressed files out, and
every unsafe archive refused with nothing left in the store."""

import hashlib
import json
from pathlib import Path

import pytest
from django.test import override_settings

from contracts.manifest import ManifestFile, manifest_bytes, manifest_parse
from controlplane.audit.models import AuditEvent
from controlplane.registry.models import Artifact
from tests.api.support import (
    assert_error,
    embedding_folder,
    gguf_bytes,
    sha256_hex,
    tar_bytes,
)

pytestmark = pytest.mark.django_db

FOLDER_URL = "/api/v1/artifacts/folders/"


def upload(client, body: bytes, content_type: str = "application/x-tar", **headers):
    return client.generic("POST", FOLDER_URL, body, content_type=content_type, **headers)


def stored_files(root: Path) -> list[Path]:
    """What the store holds, its temporary files left out."""
    return sorted(path for path in (root / "sha256").glob("*/*") if path.is_file())


def expected_manifest(files: dict[str, bytes]) -> bytes:
    return manifest_bytes(
        sorted(
            (ManifestFile(path=p, size=len(d), sha256=sha256_hex(d)) for p, d in files.items()),
            key=lambda file: file.path,
        )
    )


def test_a_folder_is_stored_as_its_manifest_and_its_files(client_for, artifact_root) -> None:
    client = client_for("release_manager")
    files = embedding_folder()
    body = tar_bytes(
        {f"./{path}": data for path, data in files.items()}, folders=(".", "./1_Pooling")
    )
    manifest = expected_manifest(files)
    digest = hashlib.sha256(manifest).hexdigest()

    created = upload(client, body, HTTP_X_ARTIFACT_DIGEST=f"sha256:{digest}")
    assert created.status_code == 201, created.content
    answer = created.json()
    assert answer["digest"] == f"sha256:{digest}"
    assert answer["format"] == "hf-safetensors"
    assert answer["size_bytes"] == sum(len(data) for data in files.values())
    assert answer["manifest"] == json.loads(manifest)["files"]
    event = AuditEvent.objects.get(action="artifact.store")
    assert event.after["files"] == 4

    # The folder's content is its manifest (whose SHA-256 is the digest); each file is
    # served by its own digest, and only as a file of that folder.
    agent = client_for("admin")
    response = agent.get(f"/api/v1/artifacts/{digest}")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == manifest
    assert manifest_parse(manifest)[0].path == "1_Pooling/config.json"
    weights = sha256_hex(files["model.safetensors"])
    part = agent.get(f"/api/v1/artifacts/{digest}/files/{weights}", HTTP_RANGE="bytes=0-7")
    assert part.status_code == 206
    assert b"".join(part.streaming_content) == files["model.safetensors"][:8]
    whole = agent.get(f"/api/v1/artifacts/{digest}/files/{weights}")
    assert b"".join(whole.streaming_content) == files["model.safetensors"]
    assert agent.get(f"/api/v1/artifacts/{weights}").status_code == 404  # not an artifact
    other = sha256_hex(b"not in the folder")
    assert agent.get(f"/api/v1/artifacts/{digest}/files/{other}").status_code == 404
    assert (
        client_for("viewer").get(f"/api/v1/artifacts/{digest}/files/{weights}").status_code == 403
    )

    # The same folder again (other names order, no "./") changes nothing.
    again = upload(client, tar_bytes(dict(reversed(list(files.items())))))
    assert again.status_code == 200
    assert again.json()["digest"] == f"sha256:{digest}"
    assert Artifact.objects.count() == 1
    assert AuditEvent.objects.filter(action="artifact.store").count() == 1


SAFE = embedding_folder()
WEIGHTS = SAFE["model.safetensors"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (tar_bytes({**SAFE, "../config.json": b"{}"}), 400, "unsafe_path"),
        (tar_bytes({**SAFE, "/etc/x.json": b"{}"}), 400, "unsafe_path"),
        (tar_bytes({**SAFE, "a/../../x.json": b"{}"}), 400, "unsafe_path"),
        (tar_bytes(SAFE, links={"vocab.txt": "/etc/passwd"}), 400, "unsafe_member"),
        (tar_bytes(SAFE, hard_links={"vocab.txt": "config.json"}), 400, "unsafe_member"),
        (tar_bytes({**SAFE, "./config.json": b"{}"}), 400, "duplicate_path"),
        (tar_bytes({**SAFE, "CONFIG.json": b"{}"}), 400, "duplicate_path"),
        (tar_bytes({**SAFE, "modeling_remote.py": b"import os"}), 400, "file_type_not_allowed"),
        (tar_bytes({**SAFE, "pytorch_model.bin": b"\x80\x04"}), 400, "file_type_not_allowed"),
        (tar_bytes({**SAFE, "model.safetensors": b"\x80\x04pickled.."}), 415, "unsafe_format"),
        (tar_bytes({**SAFE, "model.safetensors": gguf_bytes()}), 415, "unknown_format"),
        (tar_bytes({**SAFE, "notes.json": b"PK\x03\x04zipped..."}), 415, "unsafe_format"),
        (tar_bytes({"tokenizer.json": b"{}", "model.safetensors": WEIGHTS}), 400,
         "incomplete_folder"),
        (tar_bytes({"config.json": b"{}", "weights/model.safetensors": WEIGHTS}), 400,
         "incomplete_folder"),
        (tar_bytes({}), 400, "empty_folder"),
        (tar_bytes({"a" * 70_000 + ".json": b"{}"}), 400, "invalid_archive"),
        (b"not a tar archive at all" * 40, 400, "invalid_archive"),
        (b"", 400, "invalid_archive"),
    ],
    ids=[
        "parent", "absolute", "escaping", "symlink", "hardlink", "duplicate", "case-duplicate",
        "code", "pickle-name", "pickle-weights", "gguf-weights", "zip", "no-config",
        "no-top-weights", "empty", "huge-header", "garbage", "nothing",
    ],
)  # fmt: skip
def test_unsafe_or_incomplete_folders_are_refused_and_leave_nothing(
    client_for, artifact_root, body: bytes, status: int, code: str
) -> None:
    assert_error(upload(client_for("release_manager"), body), status, code)
    assert Artifact.objects.count() == 0
    assert stored_files(artifact_root) == []
    assert not AuditEvent.objects.exists()
    assert not any((artifact_root / "tmp").glob("*"))


def test_a_declared_digest_must_be_the_folders(client_for, artifact_root) -> None:
    wrong = sha256_hex(b"another manifest")
    response = upload(
        client_for("release_manager"), tar_bytes(SAFE), HTTP_X_ARTIFACT_DIGEST=f"sha256:{wrong}"
    )
    assert_error(response, 400, "digest_mismatch")
    assert Artifact.objects.count() == 0


def test_only_tar_bodies_within_the_limits_are_taken(client_for, artifact_root) -> None:
    client = client_for("release_manager")
    assert_error(upload(client, tar_bytes(SAFE), "application/gzip"), 415, "unsupported_media_type")
    with override_settings(ARTIFACT_MAX_BYTES=50):
        assert_error(upload(client, tar_bytes(SAFE)), 413, "artifact_too_large")
    many = {f"f{index}.txt": b"x" for index in range(257)}
    assert_error(upload(client, tar_bytes({**SAFE, **many})), 400, "too_many_files")
    assert Artifact.objects.count() == 0
    assert stored_files(artifact_root) == []
    for principal in ("viewer", "on_call", "tenant_member", "agent"):
        assert upload(client_for(principal), tar_bytes(SAFE)).status_code == 403
    assert upload(client_for("anonymous"), tar_bytes(SAFE)).status_code in (401, 403)
