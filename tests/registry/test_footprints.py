"""A version's footprint is reckoned at registration from its artifact's headers and
shown by the API; versions without one get it from `manage.py version_footprints`."""

import pytest
from django.core.management import call_command

from controlplane.registry import services as registry_services
from controlplane.registry.models import ModelVersion
from tests.agent.test_agent_processes import MODEL_FILE
from tests.api.support import SERVING_CONFIG

pytestmark = pytest.mark.django_db


def test_a_gguf_versions_footprint_is_in_its_detail(artifact_root, chat_model, client_for) -> None:
    artifact, _ = registry_services.artifact_store_file(actor=None, path=MODEL_FILE)
    version = registry_services.version_register(
        actor=None,
        model=chat_model,
        label="bf16",
        artifact_digest=artifact.digest,
        serving_config={**SERVING_CONFIG, "dtype": "bfloat16"},
        engine_args={"num_blocks": 256},
    )
    body = client_for("viewer").get(f"/api/v1/versions/{version.pk}/").json()
    # 134,515,008 parameters x 2; 256 blocks x 16 tokens x 23,040 bytes; 10% of the two
    assert body["footprint"] == {
        "weight_bytes": 269_030_016,
        "kv_bytes": 94_371_840,
        "headroom_bytes": 36_340_186,
        "total_bytes": 399_742_042,
        "parameters": 134_515_008,
        "bytes_per_parameter": 2.0,
        "kv_bytes_per_token": 23_040,
        "kv_tokens": 4096,
        "kv_basis": "engine_args.num_blocks",
    }
    assert body["footprint_error"] == ""


def test_headers_that_do_not_say_leave_it_null_with_the_reason(make_version, client_for) -> None:
    version = make_version("tiny")  # a GGUF header without metadata
    body = client_for("viewer").get(f"/api/v1/versions/{version.pk}/").json()
    assert body["footprint"] is None
    assert body["footprint_error"] == "the GGUF file names no general.architecture"


def test_versions_registered_before_footprints_get_theirs(make_version) -> None:
    version = make_version("old")
    ModelVersion.objects.filter(pk=version.pk).update(footprint=None, footprint_error="")
    call_command("version_footprints")
    version.refresh_from_db()
    assert version.footprint_error == "the GGUF file names no general.architecture"
    assert registry_services.version_footprints_fill() == 0  # each is reckoned once
