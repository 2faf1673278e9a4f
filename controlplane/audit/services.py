from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NotRequired, TypeAlias, TypedDict, Unpack

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


class AuditEventFields(TypedDict):
    """What an audit event records (`audit_event_new`, `audit_event_record`)."""

    actor: Actor
    action: str
    object_type: str
    object_id: str | int
    object_repr: NotRequired[str]
    before: NotRequired[dict[str, Any] | None]
    after: NotRequired[dict[str, Any] | None]
    reason: NotRequired[str]
    tenant_id: NotRequired[int | None]


def audit_event_new(**fields: Unpack[AuditEventFields]) -> AuditEvent:
    """One audit event, not yet recorded (`audit_events_record` appends several at once)."""
    user = acting_user(fields["actor"])
    return AuditEvent(
        actor=user,
        actor_name=user.get_username() if user is not None else SYSTEM_ACTOR,
        action=fields["action"],
        object_type=fields["object_type"],
        object_id=str(fields["object_id"]),
        object_repr=fields.get("object_repr", "")[:200],
        before=fields.get("before") or {},
        after=fields.get("after") or {},
        reason=fields.get("reason", ""),
        tenant_id=fields.get("tenant_id"),
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


def audit_event_record(**fields: Unpack[AuditEventFields]) -> AuditEvent:
    """Append one audit event. Call it inside the transaction of the change it records."""
    return audit_events_record([audit_event_new(**fields)])[0]
