"""The keys agents are handed at enrolment, derived, never stored.

- An agent's stream key authenticates its heartbeats and command results:
  HMAC-SHA256(FLEET_AGENT_KEY, "agent-stream\\n" + name), so ingest derives it from the
  entry's agent name and needs no lookup.
- The command-signing key pair: the private key (seeded by FLEET_COMMAND_SIGNING_KEY)
  signs every command; agents pin its public key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from functools import cache

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from django.conf import settings


def agent_stream_key(agent_name: str) -> str:
    return hmac.new(
        settings.FLEET_AGENT_KEY, b"agent-stream\n" + agent_name.encode(), hashlib.sha256
    ).hexdigest()


@cache
def _command_private_key(key: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(key).digest())


def command_private_key() -> Ed25519PrivateKey:
    return _command_private_key(settings.FLEET_COMMAND_SIGNING_KEY)


def command_public_key_b64() -> str:
    raw = command_private_key().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()
