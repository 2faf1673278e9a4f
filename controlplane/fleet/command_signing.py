"""The control plane's command key: every command sent to an agent is signed with it.

An Ed25519 key whose seed is the SHA-256 of FLEET_COMMAND_SIGNING_KEY (all of the key's
bytes count, whatever its encoding). Agents hold
its public key (`command_public_key_b64`, in their credentials) and refuse any command
that does not verify for their own name (contracts.commands.command_signature_verify).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from django.conf import settings

from contracts.commands import Command, command_signed_message


def _private_key() -> Ed25519PrivateKey:
    seed = hashlib.sha256(settings.FLEET_COMMAND_SIGNING_KEY).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def command_public_key_b64() -> str:
    """The public key agents verify commands with: 32 raw bytes in base64."""
    raw = _private_key().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def command_sign(command: Command, *, agent_name: str) -> Command:
    """`command` with its signature for `agent_name` (over the payload as it is sent)."""
    signature = _private_key().sign(command_signed_message(command, agent=agent_name))
    return dataclasses.replace(command, signature=base64.b64encode(signature).decode())
