"""The control plane: a Django project with one app per domain."""

from .celery import app as celery_app

__all__ = ["celery_app"]
