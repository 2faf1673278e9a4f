"""Schema fuzzing of the REST API: every operation, arbitrary inputs, three roles, no 5xx.

schemathesis generates requests from the API's own OpenAPI schema (path and query
parameters, bodies, within and outside the schema) and sends each, through the real URL
configuration on PostgreSQL, as an admin, a release manager and a tenant member (real
Bearer tokens). Whatever the input and whoever asks, the answer is never a server error.

`make test` runs a bounded, derandomized set (`FUZZ_EXAMPLES` per operation, 5), the same
every run, so the suite is not flaky; `FUZZ_EXAMPLES=50 FUZZ_RANDOM=1 pytest
tests/api/test_schema_fuzz.py` explores further (a failure prints the request to replay).
"""

import json
import os
from collections.abc import Iterator

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, settings

from controlplane.accounts.services import access_token_create
from controlplane.core.roles import Role
from tests.api.support import make_user

# Folder uploads are tar archives: drawn bytes go as they are (the server refuses non-tars).
schemathesis.serializer.alias("application/x-tar", "application/octet-stream")

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "5"))
ROLES = (Role.ADMIN, Role.RELEASE_MANAGER, Role.TENANT_MEMBER)


def _schema() -> schemathesis.schemas.BaseSchema:
    raw = SchemaGenerator().get_schema(request=None, public=True)
    loaded = schemathesis.openapi.from_dict(json.loads(OpenApiJsonRenderer().render(raw)))
    loaded.app = get_wsgi_application()
    return loaded


schema = _schema()


@pytest.fixture
def wsgi_keeps_the_test_connection() -> Iterator[None]:
    """As Django's test client does: the test's transaction lives on one connection, which
    the handler must not close at each request's start and end."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def role_tokens(tenants, wsgi_keeps_the_test_connection) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for role in ROLES:
        tenant = tenants["acme"] if role == Role.TENANT_MEMBER else None
        user = make_user(f"fuzz-{role}", role, tenant)
        tokens[role] = access_token_create(user=user, name="fuzz").raw_token
    return tokens


@pytest.mark.django_db
@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_input_from_any_role_makes_a_server_error(case, role_tokens) -> None:
    for role, token in role_tokens.items():
        response = case.call(headers={"Authorization": f"Bearer {token}"})
        assert response.status_code < 500, (
            f"{role}: {case.method} {case.formatted_path} query={case.query} "
            f"body={str(case.body)[:300]} -> {response.status_code}: {response.text[:500]}"
        )


@pytest.mark.django_db
def test_json_nested_past_the_recursion_limit_is_a_400(client_for, users) -> None:
    response = client_for("admin").post(
        "/api/v1/tenants/",
        data=b"[" * 100_000 + b"]" * 100_000,
        content_type="application/json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parse_error"
