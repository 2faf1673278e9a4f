"""Who holds which role, and the hashed personal tokens used for API automation."""

from django.conf import settings
from django.db import models

from controlplane.core.roles import Role


class Membership(models.Model):
    """A user's one role; tenant members also name their tenant (and only they do)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership"
    )
    role = models.CharField(max_length=30, choices=Role.choices)
    tenant = models.ForeignKey(
        "tenants.Tenant",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="memberships",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(
                    models.Q(role=Role.TENANT_MEMBER, tenant__isnull=False)
                    | (~models.Q(role=Role.TENANT_MEMBER) & models.Q(tenant__isnull=True))
                ),
                name="accounts_membership_tenant_iff_tenant_member",
            )
        ]

    def __str__(self) -> str:
        return f"{self.user_id}: {self.role}"


class AccessToken(models.Model):
    """A personal API token. Only its SHA-256 is stored; the raw token is shown once."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="access_tokens"
    )
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=20)  # visible: "cpt-" + 8 characters
    token_hash = models.CharField(max_length=64, unique=True)  # hex SHA-256 of the raw token
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user_id})"
