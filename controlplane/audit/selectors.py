from typing import Any

from django.db.models import QuerySet

from controlplane.audit.models import AuditEvent
from controlplane.core import access


def audit_event_list(*, user: Any) -> QuerySet[AuditEvent]:
    """The events this user may read: all for staff, their tenant's for a tenant member."""
    events = AuditEvent.objects.all()
    if access.is_staff_reader(user):
        return events
    tenant = access.tenant_for_user(user)
    if tenant is None:
        return events.none()
    return events.filter(tenant_id=tenant.pk)
