"""Every REST route under /api/v1/: each domain app contributes its own urls module."""

from django.urls import include, path  # noqa: F401

urlpatterns: list = []
