"""Fleet test fixtures: the API fixtures (users per role, signer, versions), a registered
agent and a signed version."""

import pytest

from controlplane.fleet.models import Agent
from controlplane.registry import services as registry_services
from tests.api.support import *  # noqa: F403
from tests.fleet.support import register


@pytest.fixture
def agent(users) -> Agent:
    return register()


@pytest.fixture
def signed_version(make_version, signer):
    version = make_version("v1")
    return registry_services.version_verify(
        actor=None,
        version=version,
        key_id=signer.key_id,
        signature=signer.sign(version.artifact_id, version.serving_config),
    )
