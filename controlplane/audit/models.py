"""The append-only audit log: who did what to which object, before and after, and why."""

from typing import Any

from django.conf import settings
from django.db import models


class AuditEventQuerySet(models.QuerySet["AuditEvent"]):
    def update(self, **kwargs: Any) -> int:
        raise TypeError("audit events are append-only")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise TypeError("audit events are append-only")


class AuditEvent(models.Model):
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
    )
    # "system" for automatic decisions (analysis, ingest), else the username at the time.
    actor_name = models.CharField(max_length=150)
    action = models.CharField(max_length=100, db_index=True)  # e.g. "rollout.promote"
    object_type = models.CharField(max_length=50, db_index=True)  # e.g. "rollout"
    object_id = models.CharField(max_length=64, db_index=True)
    object_repr = models.CharField(max_length=200, blank=True)
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)
    reason = models.TextField(blank=True)
    # The tenant the object belongs to, when it does; tenant members see only theirs.
    tenant_id = models.BigIntegerField(null=True, blank=True, db_index=True)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.actor_name} {self.action} {self.object_type}:{self.object_id}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise TypeError("audit events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise TypeError("audit events are append-only")
