"""The Celery application: broker and schedule come from Django settings (CELERY_*); trace
context travels with each task (core/task_tracing.py)."""

import os

from celery import Celery

from controlplane.core.task_tracing import task_tracing_connect

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
task_tracing_connect()
