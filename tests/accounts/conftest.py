"""Shared API test fixtures."""

from tests.api.support import *  # noqa: F403
