"""Audit API: read-only. There is no route that updates or deletes an event."""

import django_filters
from rest_framework import serializers, viewsets

from controlplane.audit import selectors
from controlplane.audit.models import AuditEvent
from controlplane.core import access
from controlplane.core.filters import UtcIsoDateTimeFilter
from controlplane.core.permissions import allows


class AuditEventSerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_name")

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "created_at",
            "actor",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "before",
            "after",
            "reason",
            "tenant_id",
        ]


class AuditEventFilter(django_filters.FilterSet):
    actor = django_filters.CharFilter(field_name="actor_name")
    action_prefix = django_filters.CharFilter(field_name="action", lookup_expr="startswith")
    since = UtcIsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    until = UtcIsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = AuditEvent
        fields = ["action", "object_type", "object_id", "tenant_id"]


class AuditEventViewSet(viewsets.ReadOnlyModelViewSet):
    permission_classes = [allows(access.can_view_audit)]
    serializer_class = AuditEventSerializer
    filterset_class = AuditEventFilter
    ordering_fields = ["created_at"]

    def get_queryset(self):
        return selectors.audit_event_list(user=self.request.user)
