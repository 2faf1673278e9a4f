"""The roles a user can hold. Permissions are decided in access.py, never by role checks inline."""

from django.db import models


class Role(models.TextChoices):
    ADMIN = "admin", "Admin"
    RELEASE_MANAGER = "release_manager", "Release manager"
    ON_CALL = "on_call", "On-call"
    TENANT_MEMBER = "tenant_member", "Tenant member"
    VIEWER = "viewer", "Viewer"
    # A service account for worker agents: registers agents, downloads artifacts.
    AGENT = "agent", "Agent (service account)"
