"""Fleet test fixtures: the API fixtures (users per role, signer, versions)."""

from tests.api.support import *  # noqa: F403
