"""REST routes of this app, mounted under /api/v1/fleet/."""

from django.urls import path, re_path

from controlplane.fleet import views

NAME = r"(?P<name>[a-z0-9][a-z0-9_.-]{0,62})"

urlpatterns = [
    path("agents/", views.AgentListView.as_view(), name="fleet-agent-list"),
    path("agents/register/", views.AgentRegisterView.as_view(), name="fleet-agent-register"),
    path("agents/enrol/", views.AgentEnrolView.as_view(), name="fleet-agent-enrol"),
    path("enrolments/", views.EnrolmentCreateView.as_view(), name="fleet-enrolment-create"),
    re_path(rf"^agents/{NAME}/$", views.AgentDetailView.as_view(), name="fleet-agent-detail"),
    re_path(
        rf"^agents/{NAME}/history/$", views.AgentHistoryView.as_view(), name="fleet-agent-history"
    ),
    re_path(
        rf"^agents/{NAME}/commands/$",
        views.AgentCommandListView.as_view(),
        name="fleet-agent-commands",
    ),
    re_path(
        r"^commands/(?P<command_id>[0-9a-f]{32})/$",
        views.CommandDetailView.as_view(),
        name="fleet-command-detail",
    ),
]
