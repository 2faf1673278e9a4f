"""Tenants, their API keys and their metered usage."""

from typing import Any

from django.conf import settings
from django.db import models


class PromptLogging(models.TextChoices):
    OFF = "off", "Off"
    # Prompts and completions are kept for `retention_days`.
    FULL = "full", "Full"


class ApiKeyScope(models.TextChoices):
    CHAT = "chat", "Chat completions"
    EMBEDDINGS = "embeddings", "Embeddings"


def default_scopes() -> list[str]:
    return [ApiKeyScope.CHAT.value, ApiKeyScope.EMBEDDINGS.value]


class Tenant(models.Model):
    slug = models.SlugField(max_length=50, unique=True)
    name = models.CharField(max_length=200)
    requests_per_minute = models.PositiveIntegerField(default=600)
    tokens_per_minute = models.PositiveIntegerField(default=100_000)
    # The tenant may call only these models through the gateway.
    allowed_models = models.ManyToManyField("registry.Model", blank=True, related_name="tenants")
    prompt_logging = models.CharField(
        max_length=20, choices=PromptLogging.choices, default=PromptLogging.OFF
    )
    retention_days = models.PositiveIntegerField(default=30)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "prompt_logging": self.prompt_logging,
            "retention_days": self.retention_days,
            "is_active": self.is_active,
        }


class ApiKey(models.Model):
    """A tenant's key for the gateway. Only its SHA-256 is stored; the raw key is shown once."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=20, db_index=True)  # visible: "sk-" + 8 characters
    key_hash = models.CharField(max_length=64, unique=True)  # hex SHA-256 of the raw key
    scopes = models.JSONField(default=default_scopes)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant_id})"

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "prefix": self.prefix,
            "scopes": self.scopes,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
        }


class UsageRecord(models.Model):
    """Usage of one tenant on one version in one minute; the gateway upserts it."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="usage_records")
    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="usage_records"
    )
    minute = models.DateTimeField()  # truncated to the minute, UTC
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveBigIntegerField(default=0)
    energy_joules = models.FloatField(default=0.0)

    class Meta:
        ordering = ["-minute", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "version", "minute"], name="tenants_usage_unique_minute"
            )
        ]
        indexes = [models.Index(fields=["tenant", "minute"])]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.version_id}@{self.minute.isoformat()}"
