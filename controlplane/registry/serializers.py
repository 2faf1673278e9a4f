from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from contracts.engines import OPTIONS
from controlplane.core.serializers import StrictSerializer
from controlplane.registry.models import (
    Artifact,
    Engine,
    EvalKind,
    EvalSuite,
    Evaluation,
    Model,
    ModelVersion,
    SigningKey,
    Task,
)
from controlplane.registry.serving import DTYPES, LIMITS

# Output.


class ModelSerializer(serializers.ModelSerializer):
    class Meta:
        model = Model
        fields = ["id", "name", "task", "description", "created_at"]


class ManifestFileSerializer(serializers.Serializer):
    path = serializers.CharField()
    sha256 = serializers.CharField()
    size = serializers.IntegerField()


class ArtifactSerializer(serializers.ModelSerializer):
    digest = serializers.SerializerMethodField()
    manifest = serializers.SerializerMethodField()
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Artifact
        fields = ["digest", "format", "size_bytes", "manifest", "created_at", "created_by"]

    def get_digest(self, artifact: Artifact) -> str:
        return f"sha256:{artifact.digest}"

    @extend_schema_field(ManifestFileSerializer(many=True, allow_null=True))
    def get_manifest(self, artifact: Artifact) -> list[dict[str, Any]] | None:
        """A folder's files (its digest is this list's canonical JSON's); null for a file."""
        return artifact.manifest


def _engine_args_help() -> str:
    options = "; ".join(
        f"{engine}: {', '.join(sorted(names))}" for engine, names in OPTIONS.items()
    )
    return f"The engine's options (docs/engines.md), by engine: {options}."


class ServingConfigSerializer(StrictSerializer):
    dtype = serializers.ChoiceField(choices=DTYPES)
    max_model_len = serializers.IntegerField(
        min_value=LIMITS["max_model_len"][0], max_value=LIMITS["max_model_len"][1]
    )
    kv_block_size = serializers.IntegerField(
        min_value=LIMITS["kv_block_size"][0], max_value=LIMITS["kv_block_size"][1]
    )
    max_num_seqs = serializers.IntegerField(
        min_value=LIMITS["max_num_seqs"][0], max_value=LIMITS["max_num_seqs"][1]
    )
    max_num_batched_tokens = serializers.IntegerField(
        min_value=LIMITS["max_num_batched_tokens"][0], max_value=LIMITS["max_num_batched_tokens"][1]
    )

    def to_internal_value(self, data: Any) -> Any:
        # Integers only: a signature covers the JSON, so "2048" and 2048.0 are not 2048.
        if isinstance(data, dict):
            errors = {
                name: ["Must be an integer."]
                for name in LIMITS
                if name in data
                and (isinstance(data[name], bool) or not isinstance(data[name], int))
            }
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


class FootprintSerializer(serializers.Serializer):
    """The memory a version needs (contracts/capacity.py, docs/capacity.md)."""

    weight_bytes = serializers.IntegerField()
    kv_bytes = serializers.IntegerField()
    headroom_bytes = serializers.IntegerField()
    total_bytes = serializers.IntegerField()
    parameters = serializers.IntegerField()
    bytes_per_parameter = serializers.FloatField()
    kv_bytes_per_token = serializers.IntegerField()
    kv_tokens = serializers.IntegerField()
    kv_basis = serializers.CharField()


class ModelVersionSerializer(serializers.ModelSerializer):
    model = serializers.PrimaryKeyRelatedField(read_only=True)
    model_name = serializers.CharField(source="model.name", read_only=True)
    task = serializers.CharField(source="model.task", read_only=True)
    artifact_digest = serializers.SerializerMethodField()
    format = serializers.CharField(source="artifact.format", read_only=True, allow_null=True)
    size_bytes = serializers.IntegerField(
        source="artifact.size_bytes", read_only=True, allow_null=True
    )
    is_folder = serializers.BooleanField(
        source="artifact.is_folder", read_only=True, allow_null=True
    )
    serving_config = serializers.SerializerMethodField()
    engine_args = serializers.SerializerMethodField()
    footprint = serializers.SerializerMethodField()
    signing_key = serializers.SlugRelatedField(slug_field="key_id", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = ModelVersion
        fields = [
            "id",
            "model",
            "model_name",
            "task",
            "label",
            "artifact_digest",
            "format",
            "size_bytes",
            "is_folder",
            "serving_config",
            "engine",
            "engine_args",
            "footprint",
            "footprint_error",
            "status",
            "source",
            "base_version",
            "notes",
            "signature",
            "signing_key",
            "is_verification_override",
            "verified_at",
            "created_at",
            "updated_at",
            "created_by",
        ]

    def get_artifact_digest(self, version: ModelVersion) -> str | None:
        return f"sha256:{version.artifact_id}" if version.artifact_id else None

    @extend_schema_field(ServingConfigSerializer)
    def get_serving_config(self, version: ModelVersion) -> dict[str, Any]:
        return version.serving_config

    @extend_schema_field(serializers.DictField(help_text=_engine_args_help()))
    def get_engine_args(self, version: ModelVersion) -> dict[str, Any]:
        return version.engine_args

    @extend_schema_field(FootprintSerializer(allow_null=True))
    def get_footprint(self, version: ModelVersion) -> dict[str, Any] | None:
        """The memory it needs, or null (footprint_error says why)."""
        return version.footprint


class SigningKeySerializer(serializers.ModelSerializer):
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = SigningKey
        fields = [
            "id",
            "key_id",
            "public_key",
            "is_trusted",
            "description",
            "created_at",
            "created_by",
        ]


class MetricDefinitionSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    threshold = serializers.FloatField()
    higher_is_better = serializers.BooleanField(default=True)


class EvalSuiteSerializer(serializers.ModelSerializer):
    metrics = serializers.SerializerMethodField()

    class Meta:
        model = EvalSuite
        fields = ["id", "name", "kind", "dataset", "metrics", "description", "created_at"]

    @extend_schema_field(MetricDefinitionSerializer(many=True))
    def get_metrics(self, suite: EvalSuite) -> list[dict[str, Any]]:
        return suite.metrics


class EvaluationSerializer(serializers.ModelSerializer):
    suite_name = serializers.CharField(source="suite.name", read_only=True)
    metrics = serializers.DictField(child=serializers.FloatField())
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Evaluation
        fields = [
            "id",
            "version",
            "suite",
            "suite_name",
            "baseline_version",
            "metrics",
            "passed",
            "notes",
            "created_at",
            "created_by",
        ]


# Input.


class ModelCreateSerializer(StrictSerializer):
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)
    task = serializers.ChoiceField(choices=Task.choices)
    description = serializers.CharField(required=False, allow_blank=True, default="")


class VersionRegisterSerializer(StrictSerializer):
    model = serializers.PrimaryKeyRelatedField(queryset=Model.objects.all())
    label = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)
    artifact_digest = serializers.RegexField(
        r"^(sha256:)?[0-9a-fA-F]{64}$",
        required=False,
        allow_null=True,
        default=None,
        help_text="A stored file or folder; none for the openai engine.",
    )
    serving_config = ServingConfigSerializer()
    engine = serializers.ChoiceField(choices=Engine.choices, default=Engine.BUILTIN)
    engine_args = serializers.DictField(
        child=serializers.JSONField(), required=False, default=dict, help_text=_engine_args_help()
    )
    source = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)
    base_version = serializers.PrimaryKeyRelatedField(
        queryset=ModelVersion.objects.all(), required=False, allow_null=True, default=None
    )
    notes = serializers.CharField(required=False, allow_blank=True, default="")


class VersionVerifySerializer(StrictSerializer):
    key_id = serializers.CharField(max_length=100)
    signature = serializers.CharField(max_length=200)


class ReasonSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class RequiredReasonSerializer(StrictSerializer):
    reason = serializers.CharField()


class SigningKeyCreateSerializer(StrictSerializer):
    key_id = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$", max_length=100)
    public_key = serializers.CharField(max_length=64)
    is_trusted = serializers.BooleanField(default=False)
    description = serializers.CharField(required=False, allow_blank=True, default="")


class SigningKeyTrustSerializer(StrictSerializer):
    is_trusted = serializers.BooleanField()
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class EvalSuiteCreateSerializer(StrictSerializer):
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)
    kind = serializers.ChoiceField(choices=EvalKind.choices)
    dataset = serializers.CharField(max_length=200)
    metrics = MetricDefinitionSerializer(many=True, allow_empty=False)
    description = serializers.CharField(required=False, allow_blank=True, default="")


class EvaluationRecordSerializer(StrictSerializer):
    version = serializers.PrimaryKeyRelatedField(queryset=ModelVersion.objects.all())
    suite = serializers.PrimaryKeyRelatedField(queryset=EvalSuite.objects.all())
    metrics = serializers.DictField(child=serializers.FloatField(), allow_empty=False)
    baseline_version = serializers.PrimaryKeyRelatedField(
        queryset=ModelVersion.objects.all(), required=False, allow_null=True, default=None
    )
    notes = serializers.CharField(required=False, allow_blank=True, default="")
