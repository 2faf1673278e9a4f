"""Every REST route under /api/v1/: each domain app contributes its own urls module."""

from django.urls import include, path

urlpatterns = [
    path("", include("controlplane.accounts.urls")),
    path("", include("controlplane.audit.urls")),
    path("", include("controlplane.registry.urls")),
    path("", include("controlplane.rollouts.urls")),
    path("", include("controlplane.tenants.urls")),
    path("fleet/", include("controlplane.fleet.urls")),
]
