from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from django.contrib.auth.models import User

from controlplane.audit.models import AuditEvent
from controlplane.core.events import (
    AUDIT_LIVE_GROUP,
    publish_event_after_commit,
    tenant_live_group,
)

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser
    from django.contrib.auth.models import AnonymousUser

SYSTEM_ACTOR = "system"
# Who made a change: a signed-in user, or None for the system (tasks, ingest, the reconciler).
Actor: TypeAlias = "AbstractBaseUser | AnonymousUser | None"


def acting_user(actor: Actor) -> User | None:
    """The user to record as author of a change: None for the system or an anonymous one."""
    return actor if isinstance(actor, User) and actor.is_authenticated else None


def audit_event_new(
    *,
    actor: Actor,
    action: str,
    object_type: str,
    object_id: str | int,
    object_repr: str = "",
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    reason: str = "",
    tenant_id: int | None = None,
) -> AuditEvent:
    """One audit event, not yet recorded (`audit_events_record` appends several at once)."""
    user = acting_user(actor)
    return AuditEvent(
        actor=user,
        actor_name=user.get_username() if user is not None else SYSTEM_ACTOR,
        action=action,
        object_type=object_type,
        object_id=str(object_id),
        object_repr=object_repr[:200],
        before=before or {},
        after=after or {},
        reason=reason,
        tenant_id=tenant_id,
    )


def audit_events_record(events: Sequence[AuditEvent]) -> list[AuditEvent]:
    """Append audit events made by `audit_event_new`, in one statement. Call it inside the
    transaction of the changes they record."""
    recorded = AuditEvent.objects.bulk_create(events)
    for event in recorded:
        payload = {"id": event.pk, "action": event.action, "object_type": event.object_type}
        publish_event_after_commit(AUDIT_LIVE_GROUP, "audit.event", payload)
        if event.tenant_id is not None:
            publish_event_after_commit(tenant_live_group(event.tenant_id), "audit.event", payload)
    return recorded


def audit_event_record(
    *,
    actor: Actor,
    action: str,
    object_type: str,
    object_id: str | int,
    object_repr: str = "",
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    reason: str = "",
    tenant_id: int | None = None,
) -> AuditEvent:
    """Append one audit event. Call it inside the transaction of the change it records."""
    event = audit_event_new(
        actor=actor,
        action=action,
        object_type=object_type,
        object_id=object_id,
        object_repr=object_repr,
        before=before,
        after=after,
        reason=reason,
        tenant_id=tenant_id,
    )
    return audit_events_record([event])[0]
