"""The memory and cores an agent registers are checked: placement reads them."""

import pytest
from rest_framework.test import APIClient

from controlplane.fleet.models import Agent
from tests.api.support import assert_error, audit_count
from tests.fleet.support import REGISTRATION, enrol

pytestmark = pytest.mark.django_db

URL = "/api/v1/fleet/agents/register/"
GIB = 2**30
INVENTORY: dict[str, object] = {"kind": "gpu", "accelerator": "NVIDIA H100"}
MEMORY = {
    "memory_total_bytes": 80 * GIB,
    "memory_available_bytes": 79 * GIB,
    "memory_offered_bytes": 40 * GIB,
    "cpu_cores": 16,
}


def test_the_memory_an_agent_offers_is_registered(redis_client) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {enrol('gpu-7')['api_token']}")
    inventory = {**INVENTORY, **MEMORY}
    response = client.post(URL, {**REGISTRATION, "inventory": inventory}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["inventory"] == inventory
    assert Agent.objects.get(name="gpu-7").inventory["memory_offered_bytes"] == 40 * GIB


@pytest.mark.parametrize(
    ("changes", "fields"),
    [
        ({"memory_offered_bytes": 81 * GIB}, ["memory_offered_bytes"]),
        ({"memory_available_bytes": 81 * GIB}, ["memory_available_bytes"]),
        ({"memory_total_bytes": -1}, ["memory_total_bytes"]),
        ({"memory_total_bytes": "80"}, ["memory_total_bytes"]),
        ({"memory_offered_bytes": True}, ["memory_offered_bytes"]),
        ({"memory_offered_bytes": 1.5}, ["memory_offered_bytes"]),
        ({"memory_total_bytes": 2**61}, ["memory_total_bytes"]),
        ({"cpu_cores": 0}, ["cpu_cores"]),
        ({"cpu_cores": "many"}, ["cpu_cores"]),
    ],
)
def test_bad_memory_figures_are_refused_naming_each(client_for, changes, fields) -> None:
    before = audit_count()
    inventory = {**INVENTORY, **MEMORY, **changes}
    response = client_for("agent").post(
        URL, {**REGISTRATION, "inventory": inventory}, format="json"
    )
    assert_error(response, 400, "invalid_inventory")
    assert list(response.json()["error"]["fields"]["inventory"]) == fields
    assert (Agent.objects.count(), audit_count()) == (0, before)


def test_the_memory_figures_come_together(client_for) -> None:
    inventory = {**INVENTORY, "memory_offered_bytes": GIB}
    response = client_for("agent").post(
        URL, {**REGISTRATION, "inventory": inventory}, format="json"
    )
    assert_error(response, 400, "invalid_inventory")
    assert response.json()["error"]["fields"]["inventory"] == {
        "memory_available_bytes": ["Required with the other memory figures."],
        "memory_total_bytes": ["Required with the other memory figures."],
    }
    assert Agent.objects.count() == 0
