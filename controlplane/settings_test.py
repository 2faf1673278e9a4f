"""Test settings: real PostgreSQL and a Redis database of its own."""

import os

os.environ.setdefault("DEBUG", "1")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/controlplane")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/13")
os.environ.setdefault("CHANNELS_PREFIX", "asgi-test")
os.environ.setdefault("CELERY_QUEUE", "controlplane-test")
os.environ.setdefault("DATABASE_CONN_MAX_AGE", "0")
os.environ.setdefault("LOG_FORMAT", "text")
os.environ.setdefault("LOG_LEVEL", "WARNING")

from controlplane.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast test logins
