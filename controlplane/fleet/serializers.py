"""Fleet API shapes: agents with their latest figures, history buckets, commands, registration."""

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from contracts.streams import AGENT_NAME_PATTERN, EnergySource, EngineFailure
from controlplane.core.serializers import StrictSerializer
from controlplane.fleet.models import Agent, AgentCommand, CommandKind


class LoadedVersionSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    model = serializers.CharField(source="model.name")
    label = serializers.CharField()


class EngineErrorSerializer(serializers.Serializer):
    reason = serializers.ChoiceField(
        choices=[(reason.value, reason.name) for reason in EngineFailure]
    )
    message = serializers.CharField()


class AgentSerializer(serializers.ModelSerializer):
    loaded_version = LoadedVersionSerializer(allow_null=True)
    engine_error = serializers.SerializerMethodField()

    class Meta:
        model = Agent
        fields = [
            "name",
            "host",
            "endpoint",
            "endpoints",
            "ports",
            "state",
            "detail",
            "engine_error",
            "accelerator",
            "inventory",
            "energy_source",
            "loaded_version",
            "loaded_digest",
            "figures",
            "last_seen",
            "registered_at",
        ]
        read_only_fields = fields

    @extend_schema_field(EngineErrorSerializer(allow_null=True))
    def get_engine_error(self, agent: Agent) -> dict[str, str] | None:
        """Its engine's last failure (until an engine next serves there), or null."""
        if not agent.engine_error:
            return None
        return {"reason": agent.engine_error, "message": agent.engine_error_message}


class AgentCommandSerializer(serializers.ModelSerializer):
    agent = serializers.CharField(source="agent.name")
    issued_by = serializers.CharField(source="issued_by.username", allow_null=True, default=None)

    class Meta:
        model = AgentCommand
        fields = [
            "command_id",
            "agent",
            "kind",
            "version",
            "payload",
            "status",
            "detail",
            "reason",
            "issued_by",
            "created_at",
            "accepted_at",
            "finished_at",
        ]
        read_only_fields = fields

    def to_representation(self, instance: AgentCommand) -> dict[str, Any]:
        data = super().to_representation(instance)
        # The load payload carries the public key and signature: useful, not secret; the
        # serving config is in the version. Keep the answer short.
        data["payload"] = {
            key: value
            for key, value in (instance.payload or {}).items()
            if key not in {"signature", "public_key"}
        }
        return data


class CommandRequestSerializer(StrictSerializer):
    kind = serializers.ChoiceField(choices=CommandKind.choices)
    version_id = serializers.IntegerField(required=False, min_value=1)
    served_model_name = serializers.CharField(required=False, allow_blank=True, max_length=100)
    latency_ms_per_token = serializers.FloatField(required=False, min_value=0, max_value=60_000)
    error_rate = serializers.FloatField(required=False, min_value=0, max_value=1)
    reason = serializers.CharField(required=False, allow_blank=True, default="")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["kind"] == CommandKind.LOAD and "version_id" not in attrs:
            raise serializers.ValidationError({"version_id": ["A load names a version."]})
        return attrs


class RegistrationSerializer(StrictSerializer):
    name = serializers.RegexField(AGENT_NAME_PATTERN)
    host = serializers.CharField(max_length=255)
    endpoint = serializers.CharField(max_length=255, allow_blank=True)
    advertise_host = serializers.CharField(max_length=253)  # checked by agent_register
    ports = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=65535), min_length=2, max_length=2
    )
    inventory = serializers.DictField()
    energy_source = serializers.ChoiceField(choices=[source.value for source in EnergySource])
    # Reported for the record; the heartbeats that follow carry the live values.
    state = serializers.CharField(required=False, max_length=20)
    loaded_version_id = serializers.IntegerField(required=False, allow_null=True)
    heartbeat_interval_s = serializers.FloatField(required=False, min_value=0.05)


class HistoryQuerySerializer(serializers.Serializer):
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)


class HistoryBucketSerializer(serializers.Serializer):
    bucket_start = serializers.DateTimeField()
    state = serializers.CharField()
    version_id = serializers.IntegerField(allow_null=True)
    energy_source = serializers.CharField()
    energy_joules = serializers.FloatField()
    generated_tokens = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    tokens_per_second = serializers.FloatField()
    joules_per_token = serializers.FloatField(allow_null=True)
    average_power_watts = serializers.FloatField()
    requests_ok = serializers.IntegerField()
    requests_failed = serializers.IntegerField()
    error_rate = serializers.FloatField(allow_null=True)
    running_max = serializers.IntegerField()
    waiting_max = serializers.IntegerField()
    kv_cache_usage_max = serializers.FloatField()
    power_watts_max = serializers.FloatField()
    ttft_p95_max_s = serializers.FloatField(allow_null=True)
    itl_p95_max_s = serializers.FloatField(allow_null=True)


class EnrolmentCreateSerializer(StrictSerializer):
    agent_name = serializers.RegexField(AGENT_NAME_PATTERN)
    ttl_s = serializers.FloatField(required=False, min_value=60, max_value=30 * 24 * 3600)


class EnrolmentCreatedSerializer(serializers.Serializer):
    agent_name = serializers.CharField()
    token = serializers.CharField()
    expires_at = serializers.DateTimeField()


class EnrolSerializer(StrictSerializer):
    token = serializers.CharField(max_length=200)


class EnrolledSerializer(serializers.Serializer):
    agent = serializers.CharField()
    api_token = serializers.CharField()
    redis_username = serializers.CharField()
    redis_password = serializers.CharField()
    stream_key = serializers.CharField()
    command_public_key = serializers.CharField()
    trusted_keys = serializers.DictField(child=serializers.CharField())
