"""API keys' last-used time: recorded by the gateway, at most one write a minute per key."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone
from openai.types.chat import ChatCompletionMessageParam

from controlplane.gateway.loops import KEY_TOUCH_FLUSH_S
from controlplane.rollouts.routing import routing_table_publish
from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import api_key_touch
from tests.conftest import wait_until
from tests.gateway.conftest import client_for, endpoint_secrets, make_setup, wait_for_model

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi"}]


def last_used(key_id: int):
    return ApiKey.objects.get(pk=key_id).last_used_at


@pytest.mark.slow
def test_the_gateway_records_when_a_key_was_last_used(stores, engines, gateways) -> None:
    setup = make_setup()
    other = make_setup()
    key_id = ApiKey.objects.get(tenant=setup.tenant).pk
    routing_table_publish(
        deployment="smollm2",
        model="smollm2",
        versions=[
            {"version_id": setup.versions[0].pk, "label": "v1", "weight": 100,
             "endpoints": [engines[0]], "endpoint_secrets": endpoint_secrets([engines[0]])},
        ],
    )  # fmt: skip
    before = timezone.now()
    wait_for_model(gateways[0], setup.raw_key, "smollm2")
    client = client_for(gateways[0], setup.raw_key)
    client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
    after = timezone.now()

    wait_until(lambda: last_used(key_id) is not None, timeout=10, message="no last-used time")
    first = last_used(key_id)
    assert before <= first <= after
    assert last_used(ApiKey.objects.get(tenant=other.tenant).pk) is None  # not used: not set

    # More use within the minute: no further write.
    for _ in range(3):
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
    time.sleep(3 * KEY_TOUCH_FLUSH_S)
    assert last_used(key_id) == first


@pytest.mark.django_db
def test_last_used_time_only_moves_forward() -> None:
    setup = make_setup(version_count=1)
    key_id = ApiKey.objects.get(tenant=setup.tenant).pk
    now = timezone.now()

    assert api_key_touch(key_id=key_id, used_at=now) is True
    assert api_key_touch(key_id=key_id, used_at=now - timedelta(seconds=30)) is False
    assert last_used(key_id) == now
    assert api_key_touch(key_id=key_id, used_at=now + timedelta(seconds=61)) is True
    assert last_used(key_id) == now + timedelta(seconds=61)
