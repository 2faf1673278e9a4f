"""Process probes and Prometheus metrics."""

import logging

import redis
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from controlplane.core.redis_clients import redis_client
from controlplane.core.state_metrics import STATE_REGISTRY

logger = logging.getLogger(__name__)


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """The process is up and serving requests."""
    return JsonResponse({"status": "ok"})


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:
        logger.warning("readiness: database unreachable", extra={"error": str(exc)})
        return f"database unreachable: {type(exc).__name__}"
    return None


def _check_redis() -> str | None:
    client = redis_client(timeout_s=1)  # a probe answers fast or says why
    try:
        client.ping()
    except redis.RedisError as exc:
        logger.warning("readiness: redis unreachable", extra={"error": str(exc)})
        return f"redis unreachable: {type(exc).__name__}"
    finally:
        client.close()
    return None


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    """Ready to take traffic: the database and Redis both answer."""
    checks = {"database": _check_database(), "redis": _check_redis()}
    problems = {name: problem for name, problem in checks.items() if problem}
    body = {
        "status": "ready" if not problems else "unavailable",
        "checks": {name: problem or "ok" for name, problem in checks.items()},
    }
    return JsonResponse(body, status=503 if problems else 200)


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """This process's counters, then the decisions read from the database."""
    body = generate_latest(REGISTRY) + generate_latest(STATE_REGISTRY)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
