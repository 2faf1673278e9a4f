from rest_framework import serializers

from controlplane.core.serializers import StrictSerializer
from controlplane.registry.models import Model
from controlplane.tenants.models import ApiKey, ApiKeyScope, PromptLogging, Tenant


class TenantSerializer(serializers.ModelSerializer):
    allowed_models = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)

    class Meta:
        model = Tenant
        fields = [
            "id",
            "slug",
            "name",
            "requests_per_minute",
            "tokens_per_minute",
            "allowed_models",
            "prompt_logging",
            "retention_days",
            "is_active",
            "created_at",
            "updated_at",
        ]


class TenantCreateSerializer(StrictSerializer):
    slug = serializers.SlugField(max_length=50)
    name = serializers.CharField(max_length=200)
    requests_per_minute = serializers.IntegerField(min_value=1, default=600)
    tokens_per_minute = serializers.IntegerField(min_value=1, default=100_000)
    allowed_models = serializers.SlugRelatedField(
        slug_field="name", many=True, queryset=Model.objects.all(), required=False, default=list
    )
    prompt_logging = serializers.ChoiceField(
        choices=PromptLogging.choices, default=PromptLogging.OFF
    )
    retention_days = serializers.IntegerField(min_value=1, max_value=3650, default=30)


class TenantUpdateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=200, required=False)
    requests_per_minute = serializers.IntegerField(min_value=1, required=False)
    tokens_per_minute = serializers.IntegerField(min_value=1, required=False)
    allowed_models = serializers.SlugRelatedField(
        slug_field="name", many=True, queryset=Model.objects.all(), required=False
    )
    prompt_logging = serializers.ChoiceField(choices=PromptLogging.choices, required=False)
    retention_days = serializers.IntegerField(min_value=1, max_value=3650, required=False)
    is_active = serializers.BooleanField(required=False)
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class ApiKeySerializer(serializers.ModelSerializer):
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "tenant",
            "name",
            "prefix",
            "scopes",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "created_at",
            "created_by",
        ]


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The raw key. Shown once, never again.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class ApiKeyCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=ApiKeyScope.choices),
        allow_empty=False,
        required=False,
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class ApiKeyRevokeSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class UsageQuerySerializer(StrictSerializer):
    granularity = serializers.ChoiceField(choices=["hour", "day"], default="hour")
    since = serializers.DateTimeField(required=False, default=None)
    until = serializers.DateTimeField(required=False, default=None)
    model = serializers.IntegerField(required=False, default=None, min_value=1)
    version = serializers.IntegerField(required=False, default=None, min_value=1)
    # Pagination and ordering parameters pass through.
    limit = serializers.IntegerField(required=False, min_value=1)
    offset = serializers.IntegerField(required=False, min_value=0)


class UsageBucketSerializer(serializers.Serializer):
    bucket = serializers.DateTimeField()
    model = serializers.IntegerField(source="version__model_id")
    model_name = serializers.CharField()
    version = serializers.IntegerField(source="version_id")
    version_label = serializers.CharField()
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    errors = serializers.IntegerField()
    energy_joules = serializers.FloatField()
