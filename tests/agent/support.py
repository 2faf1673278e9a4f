"""The credentials a test agent process starts with (until agents enrol for real)."""

from pathlib import Path

from agent.credentials import AgentCredentials, credentials_save
from controlplane.fleet.command_signing import command_public_key_b64
from controlplane.fleet.stream_keys import agent_stream_key


def agent_credentials_write(
    state_dir: Path, name: str, *, api_token: str, trusted_keys: dict[str, str]
) -> Path:
    """Write `<state_dir>/credentials.json` for agent `name`: the tests' agent token, the
    control plane's stream key of `name` and command key, and the release keys it pins.
    The test Redis has no ACL: its default user takes any password."""
    credentials = AgentCredentials(
        agent=name,
        api_token=api_token,
        redis_username="default",
        redis_password="unused",
        stream_key=agent_stream_key(name),
        command_public_key=command_public_key_b64(),
        trusted_keys=trusted_keys,
    )
    return credentials_save(state_dir, credentials)
