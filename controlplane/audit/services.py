from typing import Any

from controlplane.audit.models import AuditEvent
from controlplane.core.events import (
    AUDIT_LIVE_GROUP,
    publish_event_after_commit,
    tenant_live_group,
)

SYSTEM_ACTOR = "system"


def audit_event_record(
    *,
    actor: Any | None,
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
    is_user = actor is not None and getattr(actor, "is_authenticated", False)
    event = AuditEvent.objects.create(
        actor=actor if is_user else None,
        actor_name=actor.get_username() if is_user and actor is not None else SYSTEM_ACTOR,
        action=action,
        object_type=object_type,
        object_id=str(object_id),
        object_repr=object_repr[:200],
        before=before or {},
        after=after or {},
        reason=reason,
        tenant_id=tenant_id,
    )
    payload = {"id": event.pk, "action": action, "object_type": object_type}
    publish_event_after_commit(AUDIT_LIVE_GROUP, "audit.event", payload)
    if tenant_id is not None:
        publish_event_after_commit(tenant_live_group(tenant_id), "audit.event", payload)
    return event
