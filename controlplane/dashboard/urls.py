"""Dashboard pages. Every page needs a session; every write is a POST with a CSRF token."""

from django.contrib.staticfiles.urls import staticfiles_urlpatterns
from django.urls import path

from controlplane.dashboard import tenant_views, views

app_name = "dashboard"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("rollouts/", views.rollout_list, name="rollout-list"),
    path("rollouts/<int:rollout_id>/", views.rollout_detail, name="rollout-detail"),
    path(
        "rollouts/<int:rollout_id>/series.json",
        views.rollout_series,
        name="rollout-series",
    ),
    path(
        "rollouts/<int:rollout_id>/<str:action>/",
        views.rollout_transition,
        name="rollout-transition",
    ),
    path("deployments/<str:name>/", views.deployment_detail, name="deployment-detail"),
    path("deployments/<str:name>/undo/", views.deployment_undo, name="deployment-undo"),
    path("registry/", views.registry, name="registry"),
    path("registry/versions/<int:version_id>/", views.version_detail, name="version-detail"),
    path(
        "registry/versions/<int:version_id>/rollouts/",
        views.version_rollout_create,
        name="version-rollout-create",
    ),
    path("registry/compare/", views.version_compare, name="version-compare"),
    path("fleet/", views.fleet, name="fleet"),
    path("fleet/enrolments/", views.agent_enrolment_create, name="agent-enrolment-create"),
    path("fleet/<str:agent_name>/command/", views.agent_command, name="agent-command"),
    path("tenants/", tenant_views.tenant_list, name="tenant-list"),
    path("tenants/<int:tenant_id>/", tenant_views.tenant_detail, name="tenant-detail"),
    path("tenants/<int:tenant_id>/keys/", tenant_views.api_key_create, name="api-key-create"),
    path(
        "tenants/<int:tenant_id>/keys/<int:key_id>/revoke/",
        tenant_views.api_key_revoke,
        name="api-key-revoke",
    ),
    path("audit/", views.audit_log, name="audit"),
]

# Under DEBUG (the demo, the browser tests) the ASGI app serves static/ itself; otherwise
# `manage.py collectstatic` fills STATIC_ROOT for the web server in front (an empty list).
urlpatterns += staticfiles_urlpatterns()
