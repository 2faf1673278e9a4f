"""The model registry: models, versions, their artifacts, signing keys and evaluations.

An artifact is content-addressed: its identity is the SHA-256 of its bytes (a single file),
or of its manifest (a folder: contracts/manifest.py), computed by the server. A version
couples one artifact with a serving configuration, an engine and its arguments; a signature
from a trusted key covers them all (contracts/signing.py). An openai version has no
artifact: its engine arguments name the endpoint it is served from.
"""

from typing import Any

from django.conf import settings
from django.db import models

from contracts import engines


class Task(models.TextChoices):
    CHAT = "chat", "Chat"
    EMBEDDING = "embedding", "Embedding"


class ArtifactFormat(models.TextChoices):
    GGUF = engines.FORMAT_GGUF, "GGUF"
    SAFETENSORS = engines.FORMAT_SAFETENSORS, "safetensors"
    HF_SAFETENSORS = engines.FORMAT_HF_FOLDER, "HF safetensors folder"


class Engine(models.TextChoices):
    BUILTIN = engines.BUILTIN, "built-in"
    VLLM = engines.VLLM, "vLLM"
    SGLANG = engines.SGLANG, "SGLang"
    LLAMA_CPP = engines.LLAMA_CPP, "llama.cpp"
    OPENAI = engines.OPENAI, "OpenAI-compatible endpoint"


class VersionStatus(models.TextChoices):
    REGISTERED = "registered", "Registered"
    VERIFIED = "verified", "Verified"
    EVALUATED = "evaluated", "Evaluated"
    APPROVED = "approved", "Approved"
    DEPRECATED = "deprecated", "Deprecated"
    REVOKED = "revoked", "Revoked"


# Checked and not withdrawn: may become a deployment's stable version or a canary, be
# evaluated, or be deprecated.
DEPLOYABLE_STATUSES = frozenset(
    {VersionStatus.VERIFIED, VersionStatus.EVALUATED, VersionStatus.APPROVED}
)
# What an agent may load: the deployable ones, and deprecated ones still being served.
LOADABLE_STATUSES = DEPLOYABLE_STATUSES | {VersionStatus.DEPRECATED}


class Model(models.Model):
    name = models.CharField(max_length=100, unique=True)
    task = models.CharField(max_length=20, choices=Task.choices)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Artifact(models.Model):
    """A file in the content-addressed store named by the SHA-256 of its bytes, or a folder
    named by the SHA-256 of its manifest (its files are stored by their own digests)."""

    digest = models.CharField(max_length=64, unique=True)  # lowercase hex SHA-256
    format = models.CharField(max_length=20, choices=ArtifactFormat.choices)
    size_bytes = models.PositiveBigIntegerField()  # a folder's: all its files together
    # A folder's files: [{"path", "sha256", "size"}, ...] sorted by path; null for a file.
    manifest = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"sha256:{self.digest}"

    @property
    def is_folder(self) -> bool:
        return self.manifest is not None


class SigningKey(models.Model):
    """An ed25519 public key; only trusted keys can verify a version."""

    key_id = models.CharField(max_length=100, unique=True)
    public_key = models.CharField(max_length=64)  # 32 raw bytes, base64
    is_trusted = models.BooleanField(default=False)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["key_id"]

    def __str__(self) -> str:
        return self.key_id


class ModelVersion(models.Model):
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="versions")
    label = models.CharField(max_length=100)
    # The artifact's digest is this row's `artifact_id` (hex SHA-256); none for openai.
    artifact = models.ForeignKey(
        Artifact,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        to_field="digest",
        db_column="artifact_digest",
        related_name="versions",
    )
    # dtype, max_model_len, kv_block_size, max_num_seqs, max_num_batched_tokens; signed.
    serving_config = models.JSONField()
    # Which engine serves it, and with what arguments (contracts/engines.py); signed.
    engine = models.CharField(max_length=20, choices=Engine.choices, default=Engine.BUILTIN)
    engine_args = models.JSONField(default=dict, blank=True)
    # The memory it needs (contracts.capacity.Footprint.to_dict()), reckoned at registration
    # from the artifact's headers; null, with the reason, when they do not say.
    footprint = models.JSONField(null=True, blank=True)
    footprint_error = models.CharField(max_length=500, blank=True)
    status = models.CharField(
        max_length=20, choices=VersionStatus.choices, default=VersionStatus.REGISTERED
    )
    # Provenance.
    source = models.CharField(max_length=500, blank=True)
    base_version = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="derived_versions"
    )
    notes = models.TextField(blank=True)
    # Verification: a signature from a trusted key, or an explicit admin override.
    signature = models.TextField(blank=True)  # base64 ed25519 over contracts.signing.signed_message
    signing_key = models.ForeignKey(
        SigningKey, null=True, blank=True, on_delete=models.PROTECT, related_name="versions"
    )
    is_verification_override = models.BooleanField(default=False)
    verified_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["model__name", "-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "label"], name="registry_version_unique_label"
            ),
            models.CheckConstraint(
                condition=(
                    models.Q(engine=Engine.OPENAI, artifact__isnull=True)
                    | (~models.Q(engine=Engine.OPENAI) & models.Q(artifact__isnull=False))
                ),
                name="registry_version_artifact_unless_openai",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model.name}:{self.label}"

    @property
    def artifact_digest(self) -> str:
        """The hex digest the signature covers: "" for an openai version."""
        return self.artifact_id or ""

    def snapshot(self) -> dict[str, Any]:
        """The fields an audit event records before and after a change."""
        return {
            "status": self.status,
            "label": self.label,
            "artifact_digest": self.artifact_id,
            "serving_config": self.serving_config,
            "engine": self.engine,
            "engine_args": self.engine_args,
            "signing_key": self.signing_key.key_id if self.signing_key is not None else None,
            "is_verification_override": self.is_verification_override,
        }


class EvalKind(models.TextChoices):
    QUALITY = "quality", "Quality"
    LATENCY = "latency", "Latency"
    ENERGY = "energy", "Energy"


class EvalSuite(models.Model):
    """A named evaluation: a dataset and metrics, each with a threshold.

    metrics: [{"name": "exact_match", "threshold": 0.8, "higher_is_better": true}, ...]
    """

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=20, choices=EvalKind.choices)
    dataset = models.CharField(max_length=200)
    metrics = models.JSONField()
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Evaluation(models.Model):
    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="evaluations")
    suite = models.ForeignKey(EvalSuite, on_delete=models.PROTECT, related_name="evaluations")
    baseline_version = models.ForeignKey(
        ModelVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    metrics = models.JSONField()  # {"exact_match": 0.91, ...}
    passed = models.BooleanField()
    notes = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.suite.name} on {self.version_id}"
