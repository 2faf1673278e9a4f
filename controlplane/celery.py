"""The Celery application: broker and schedule come from Django settings (CELERY_*); trace
context travels with each task (core/task_tracing.py)."""

import copy
import logging
import os
from typing import Any

from celery import Celery
from celery.signals import setup_logging

from contracts.logs import logging_apply
from controlplane.core.task_tracing import task_tracing_connect

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
task_tracing_connect()


@setup_logging.connect
def _logging_from_settings(loglevel: int | None = None, **kwargs: Any) -> None:
    """Workers and beat log as every process does (settings.LOGGING, contracts/logs.py),
    not in Celery's own format; at LOG_LEVEL, else at --loglevel."""
    from django.conf import settings

    config = copy.deepcopy(settings.LOGGING)
    if not os.environ.get("LOG_LEVEL") and loglevel is not None:
        config["root"]["level"] = logging.getLevelName(loglevel)
    logging_apply(config)
