import json
from typing import Any

from rest_framework import serializers

from controlplane.core.serializers import StrictBooleanField, StrictSerializer
from controlplane.registry.models import EvalSuite, ModelVersion
from controlplane.rollouts.models import (
    AnalysisRun,
    Deployment,
    DeploymentRevision,
    Rollout,
    RolloutState,
    ScalingDecision,
    WebhookDelivery,
    WebhookEndpoint,
)
from controlplane.rollouts.stages import DEFAULT_POLICY, DEFAULT_STAGES


class UnplacedVersionSerializer(serializers.Serializer):
    """A version the deployment needs that no spare agent has the memory for."""

    version_id = serializers.IntegerField()
    needed_bytes = serializers.IntegerField()
    largest_offer_bytes = serializers.IntegerField()
    largest_agent = serializers.CharField()
    message = serializers.CharField()


class DeploymentSerializer(serializers.ModelSerializer):
    unplaced_versions = UnplacedVersionSerializer(many=True, read_only=True)

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "stable_version",
            "desired_routing",
            "routing_revision",
            "applied_revision",
            "unplaced_versions",
            "stable_replicas_min",
            "stable_replicas_max",
            "stable_replicas",
            "autoscaling",
            "created_at",
            "updated_at",
        ]


class DeploymentCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    stable_version = serializers.PrimaryKeyRelatedField(queryset=ModelVersion.objects.all())
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class ReplicasSerializer(StrictSerializer):
    """The stable version's replica bounds (checked by the service: invalid_replicas,
    invalid_autoscaling, reason_required)."""

    stable_replicas_min = serializers.JSONField(help_text="1 to 64.")
    stable_replicas_max = serializers.JSONField(help_text="stable_replicas_min to 64.")
    autoscaling = serializers.JSONField(
        required=False,
        default=None,
        help_text="The autoscaling policy (docs/autoscaling.md); omitted: unchanged.",
    )
    reason = serializers.CharField(
        required=False, allow_blank=True, default="", trim_whitespace=False
    )


class ScalingDecisionSerializer(serializers.ModelSerializer):
    """A change of desired replicas: by the autoscaler (actor null) or an operator."""

    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    actor = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = ScalingDecision
        fields = [
            "id",
            "deployment",
            "rollout",
            "role",
            "version",
            "previous_replicas",
            "replicas",
            "reason",
            "figures",
            "actor",
            "created_at",
        ]


class DeploymentRevisionSerializer(serializers.ModelSerializer):
    """One change of the stable version: `version` replaced `previous_version`."""

    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    actor = serializers.CharField(source="actor_name", read_only=True)

    class Meta:
        model = DeploymentRevision
        fields = [
            "id",
            "deployment",
            "version",
            "previous_version",
            "source",
            "rollout",
            "actor",
            "reason",
            "created_at",
        ]


class UndoSerializer(StrictSerializer):
    """The reason is checked by the service (codes reason_required, reason_too_long)."""

    reason = serializers.CharField(
        required=False, allow_blank=True, default="", trim_whitespace=False
    )


class UndoResultSerializer(serializers.Serializer):
    deployment = DeploymentSerializer()
    revision = DeploymentRevisionSerializer()
    switch = serializers.ChoiceField(
        choices=["immediate", "after_load"],
        help_text="immediate: an agent serves the restored version and the routing table"
        " switches at once; after_load: it is loaded first and the demoted version serves"
        " until it is ready.",
    )


class RolloutSerializer(serializers.ModelSerializer):
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    required_suites = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)
    canary_weight = serializers.SerializerMethodField()
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Rollout
        fields = [
            "id",
            "deployment",
            "baseline",
            "candidate",
            "stages",
            "policy",
            "required_suites",
            "state",
            "stage_index",
            "stage_started_at",
            "stage_extensions",
            "canary_weight",
            "paused_from",
            "state_reason",
            "gate_reasons",
            "revision",
            "attempt",
            "canary_replicas_min",
            "canary_replicas_max",
            "canary_replicas",
            "created_by",
            "created_at",
            "updated_at",
            "finished_at",
        ]

    def get_canary_weight(self, rollout: Rollout) -> int:
        return int(rollout.deployment.desired_routing.get("canary_weight") or 0)


class StageSerializer(StrictSerializer):
    weight = serializers.IntegerField(min_value=1, max_value=100)
    min_duration_s = serializers.FloatField(min_value=0, required=False, default=60)
    min_requests = serializers.IntegerField(min_value=0, required=False, default=0)
    tenants = serializers.ListField(child=serializers.SlugField(), required=False, default=list)
    shadow = StrictBooleanField(
        required=False,
        default=False,
        help_text="Mirror `weight` percent of requests to the candidate without answering "
        "from it; the stable version answers every request. Not allowed on the last stage.",
    )


class RolloutCreateSerializer(StrictSerializer):
    """A new rollout; the dashboard's "Start a rollout" form validates through it too."""

    deployment = serializers.SlugRelatedField(slug_field="name", queryset=Deployment.objects.all())
    candidate = serializers.PrimaryKeyRelatedField(queryset=ModelVersion.objects.all())
    stages = StageSerializer(
        many=True,
        required=False,
        allow_null=True,
        default=None,
        help_text=f"Omitted or null: the default plan, {json.dumps(list(DEFAULT_STAGES))}.",
    )
    policy = serializers.DictField(
        required=False,
        default=dict,
        help_text="Overrides of the analysis policy; a field left out keeps its default: "
        f"{json.dumps(dict(DEFAULT_POLICY))}.",
    )
    required_suites = serializers.SlugRelatedField(
        slug_field="name", queryset=EvalSuite.objects.all(), many=True, required=False, default=list
    )
    reason = serializers.CharField(required=False, allow_blank=True, default="")
    canary_replicas_min = serializers.JSONField(
        required=False, default=1, help_text="Agents serving the candidate (1 to 64)."
    )
    canary_replicas_max = serializers.JSONField(
        required=False,
        default=1,
        help_text="At most this many when the deployment's autoscaling adds some.",
    )

    def service_arguments(self) -> dict[str, Any]:
        """The validated body as `deployments.rollout_create`'s keyword arguments."""
        data = self.validated_data
        stages = data["stages"]
        return {
            "deployment": data["deployment"],
            "candidate": data["candidate"],
            "stages": [dict(stage) for stage in stages] if stages is not None else None,
            "policy": data["policy"],
            "required_suites": data["required_suites"],
            "reason": data["reason"],
            "canary_replicas_min": data["canary_replicas_min"],
            "canary_replicas_max": data["canary_replicas_max"],
        }


class TransitionSerializer(StrictSerializer):
    """Every manual action names a reason; the expected_* fields make it compare-and-set."""

    reason = serializers.CharField(max_length=2000)
    expected_state = serializers.ChoiceField(choices=RolloutState.choices, required=False)
    expected_stage = serializers.IntegerField(min_value=0, required=False)
    expected_revision = serializers.IntegerField(min_value=0, required=False)


class PromoteSerializer(TransitionSerializer):
    full = serializers.BooleanField(required=False, default=False)


class AnalysisRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = AnalysisRun
        fields = [
            "id",
            "stage_index",
            "attempt",
            "window_start",
            "window_end",
            "baseline",
            "canary",
            "tests",
            "signals",
            "verdict",
            "reasons",
            "action",
            "created_at",
        ]


class WebhookEndpointSerializer(serializers.ModelSerializer):
    class Meta:
        model = WebhookEndpoint
        fields = ["id", "name", "url", "events", "is_active", "created_at"]  # never the secret


class WebhookEndpointCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    url = serializers.URLField(max_length=500)
    secret = serializers.CharField(min_length=16, max_length=200, write_only=True)
    events = serializers.ListField(child=serializers.CharField(max_length=100))


class WebhookDeliverySerializer(serializers.ModelSerializer):
    """`last_error` is a category (models.DeliveryError), never the error's own text."""

    endpoint = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "endpoint",
            "event_id",
            "event",
            "payload",
            "status",
            "attempts",
            "last_status_code",
            "last_error",
            "next_attempt_at",
            "created_at",
            "delivered_at",
        ]
