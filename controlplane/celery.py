"""The Celery application: broker and schedule come from Django settings (CELERY_*)."""

import logging.config
import os
from typing import Any

from celery import Celery
from celery.signals import setup_logging

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@setup_logging.connect
def _logging_from_settings(**kwargs: Any) -> None:
    """Workers and beat log as every process does (settings.LOGGING, contracts/logs.py),
    not in Celery's own format; LOG_LEVEL sets the level, not --loglevel."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
