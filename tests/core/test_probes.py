import pytest
from django.test import Client, override_settings
from prometheus_client.parser import text_string_to_metric_families

from controlplane.gateway.spool import Spool


@pytest.mark.django_db
def test_healthz_answers_ok() -> None:
    response = Client().get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_is_ready_when_database_and_redis_answer(redis_client) -> None:
    response = Client().get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "checks": {"database": "ok", "redis": "ok"}}


@pytest.mark.django_db
def test_readyz_is_503_when_redis_is_unreachable() -> None:
    # A port nothing listens on: the probe must say which dependency failed.
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        response = Client().get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["redis"].startswith("redis unreachable")


def spooled_total() -> float:
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    families = {
        family.name: family for family in text_string_to_metric_families(response.content.decode())
    }
    (sample,) = [s for s in families["gateway_spool_entries"].samples if s.name.endswith("_total")]
    return sample.value


@pytest.mark.django_db
def test_metrics_show_this_process_counters_as_they_move(tmp_path) -> None:
    before = spooled_total()
    assert Spool(tmp_path, max_bytes=1 << 20).append({"request_id": "a" * 32})
    assert spooled_total() == before + 1


@pytest.mark.django_db
def test_home_requires_login() -> None:
    response = Client().get("/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")
