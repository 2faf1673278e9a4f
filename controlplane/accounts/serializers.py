from django.contrib.auth import get_user_model
from rest_framework import serializers

from controlplane.accounts.models import AccessToken
from controlplane.core.access import role_of, tenant_for_user
from controlplane.core.roles import Role
from controlplane.core.serializers import StrictSerializer
from controlplane.tenants.models import Tenant


class UserSerializer(serializers.ModelSerializer):
    role = serializers.SerializerMethodField()
    tenant = serializers.SerializerMethodField()

    class Meta:
        model = get_user_model()
        fields = ["id", "username", "email", "role", "tenant", "is_active"]

    def get_role(self, user) -> str | None:
        role = role_of(user)
        return role.value if role else None

    def get_tenant(self, user) -> int | None:
        tenant = tenant_for_user(user)
        return tenant.pk if tenant else None


class UserCreateSerializer(StrictSerializer):
    username = serializers.RegexField(r"^[\w.@+-]+$", max_length=150)
    password = serializers.CharField(
        required=False, allow_null=True, default=None, write_only=True, min_length=12
    )
    email = serializers.EmailField(required=False, allow_blank=True, default="")
    role = serializers.ChoiceField(choices=Role.choices)
    tenant = serializers.PrimaryKeyRelatedField(
        queryset=Tenant.objects.all(), required=False, allow_null=True, default=None
    )


class MembershipSetSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=Role.choices)
    tenant = serializers.PrimaryKeyRelatedField(
        queryset=Tenant.objects.all(), required=False, allow_null=True, default=None
    )
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class AccessTokenSerializer(serializers.ModelSerializer):
    user = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = AccessToken
        fields = [
            "id",
            "user",
            "name",
            "prefix",
            "created_at",
            "last_used_at",
            "expires_at",
            "revoked_at",
        ]


class AccessTokenCreatedSerializer(AccessTokenSerializer):
    token = serializers.CharField(
        read_only=True, help_text="The raw token. Shown once, never again."
    )

    class Meta(AccessTokenSerializer.Meta):
        fields = [*AccessTokenSerializer.Meta.fields, "token"]


class AccessTokenCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class EmptySerializer(StrictSerializer):
    pass
