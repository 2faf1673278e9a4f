"""Fixtures and helpers for the control plane's API tests (imported by each test folder's conftest).

Every test talks HTTP to the real URL configuration on PostgreSQL; users log in with a real
session (force_login) or a real Bearer token.
"""

import base64
import hashlib
import io
import json
import struct
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.contrib.auth import get_user_model
from django.test import override_settings
from rest_framework.test import APIClient

from contracts.signing import signed_message
from controlplane.accounts.models import Membership
from controlplane.audit.models import AuditEvent
from controlplane.core.roles import Role
from controlplane.registry import services as registry_services
from controlplane.registry.models import Model, ModelVersion, SigningKey
from controlplane.tenants.models import Tenant

# Every principal the role matrices cover: the roles, a user without one, and nobody.
ROLES = ["admin", "release_manager", "on_call", "viewer", "tenant_member", "agent", "no_role"]
PRINCIPALS = [*ROLES, "anonymous"]

SERVING_CONFIG = {
    "dtype": "float32",
    "max_model_len": 2048,
    "kv_block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
}


def gguf_bytes(payload: bytes = b"weights") -> bytes:
    """A minimal file with a GGUF v3 header (magic, version, tensor and metadata counts)."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + payload


def safetensors_bytes(payload: bytes = b"\x00" * 8) -> bytes:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, len(payload)]}}
    ).encode()
    return struct.pack("<Q", len(header)) + header + payload


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tar_bytes(
    files: dict[str, bytes],
    *,
    links: dict[str, str] | None = None,
    folders: tuple[str, ...] = (),
    hard_links: dict[str, str] | None = None,
) -> bytes:
    """An uncompressed tar holding `files` (path: bytes) under exactly the names given,
    and symbolic or hard links (path: target) and folders when asked."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in folders:
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            archive.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000.5  # a float: tarfile then writes a pax header
            archive.addfile(info, io.BytesIO(data))
        for kind, entries in ((tarfile.SYMTYPE, links), (tarfile.LNKTYPE, hard_links)):
            for name, target in (entries or {}).items():
                info = tarfile.TarInfo(name)
                info.type = kind
                info.linkname = target
                archive.addfile(info)
    return buffer.getvalue()


def embedding_folder(**overrides: bytes) -> dict[str, bytes]:
    """The files of a tiny sentence-embedding model folder (BERT config)."""
    return {
        "config.json": json.dumps({"model_type": "bert"}).encode(),
        "model.safetensors": safetensors_bytes(),
        "tokenizer.json": b"{}",
        "1_Pooling/config.json": b"{}",
        **overrides,
    }


@dataclass
class Signer:
    key_id: str
    private_key: Ed25519PrivateKey

    @property
    def public_key_b64(self) -> str:
        raw = self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return base64.b64encode(raw).decode()

    def sign(
        self,
        digest: str,
        serving_config: dict[str, Any],
        *,
        engine: str = "builtin",
        engine_args: dict[str, Any] | None = None,
    ) -> str:
        message = signed_message(
            digest=digest, serving_config=serving_config, engine=engine, engine_args=engine_args
        )
        return base64.b64encode(self.private_key.sign(message)).decode()


@pytest.fixture
def artifact_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "artifacts"
    with override_settings(ARTIFACT_ROOT=root):
        yield root


@pytest.fixture
def tenants(db) -> dict[str, Tenant]:
    return {
        slug: Tenant.objects.create(slug=slug, name=slug.title()) for slug in ("acme", "globex")
    }


def make_user(username: str, role: str | None, tenant: Tenant | None = None) -> Any:
    user = get_user_model().objects.create_user(username, password=f"{username}-password-1")
    if role is not None:
        Membership.objects.create(user=user, role=role, tenant=tenant)
    return user


@pytest.fixture
def users(tenants) -> dict[str, Any]:
    """One user per role; the tenant member belongs to acme, `other_member` to globex."""
    made = {
        role: make_user(role, role, tenants["acme"] if role == Role.TENANT_MEMBER else None)
        for role in Role.values
    }
    made["no_role"] = make_user("no_role", None)
    made["other_member"] = make_user("other_member", Role.TENANT_MEMBER, tenants["globex"])
    return made


@pytest.fixture
def client_for(users):
    def build(principal: str) -> APIClient:
        client = APIClient()
        if principal != "anonymous":
            client.force_login(users[principal])
        return client

    return build


@pytest.fixture
def admin_client(client_for) -> APIClient:
    return client_for("admin")


@pytest.fixture
def signer(db) -> Signer:
    signer = Signer("release-key", Ed25519PrivateKey.generate())
    SigningKey.objects.create(
        key_id=signer.key_id, public_key=signer.public_key_b64, is_trusted=True
    )
    return signer


@pytest.fixture
def chat_model(db) -> Model:
    return Model.objects.create(name="smol", task="chat")


@pytest.fixture
def make_version(artifact_root, chat_model):
    """Store a tiny GGUF artifact (unique per label) and register a version of it."""

    def build(label: str = "v1", model: Model | None = None, **config: Any) -> ModelVersion:
        data = gguf_bytes(label.encode())
        registry_services.artifact_store(
            actor=None, chunks=[data], declared_digest=sha256_hex(data)
        )
        return registry_services.version_register(
            actor=None,
            model=model or chat_model,
            label=label,
            artifact_digest=sha256_hex(data),
            serving_config={**SERVING_CONFIG, **config},
        )

    return build


def audit_count() -> int:
    return AuditEvent.objects.count()


def assert_error(response, status_code: int, code: str) -> dict[str, Any]:
    assert response.status_code == status_code, response.content
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "fields"}
    assert body["error"]["code"] == code, body
    return body["error"]
