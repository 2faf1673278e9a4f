"""How an engine proves which agent it serves for: `GET /identity?nonce=<hex>`.

The control plane sends a fresh nonce to an endpoint before it routes tenants there; the
engine answers its agent's name and an HMAC of that name and the nonce under its admin
secret, which only the engine the control plane started (through the load command the
secret derives from) holds. The route needs no credential and reveals nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets

IDENTITY_PATH = "/identity"
NONCE_PATTERN = re.compile(r"[0-9a-fA-F]{32,128}")
NONCE_BYTES = 32  # 64 hex characters
INVALID_NONCE_CODE = "invalid_nonce"
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
HOST_NAME_PATTERN = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def is_valid_host(host: str) -> bool:
    """A host name or an IP address (v4 or v6)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return HOST_NAME_PATTERN.fullmatch(host) is not None
    return True


def engine_endpoint(host: str, port: int) -> str:
    """The URL of an agent's engine: `http://<host>:<port>`, an IPv6 host in brackets."""
    is_ipv6 = ":" in host
    return f"http://[{host}]:{port}" if is_ipv6 else f"http://{host}:{port}"


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def is_valid_nonce(nonce: str) -> bool:
    """32 to 128 hex characters."""
    return NONCE_PATTERN.fullmatch(nonce) is not None


def identity_proof(*, admin_secret: str, agent: str, nonce: str) -> str:
    """64 hex characters: HMAC-SHA256(admin_secret, "engine-identity\\n" agent "\\n" nonce)."""
    message = f"engine-identity\n{agent}\n{nonce}".encode()
    return hmac.new(admin_secret.encode(), message, hashlib.sha256).hexdigest()


def is_identity_proof_valid(*, admin_secret: str, agent: str, nonce: str, proof: str) -> bool:
    expected = identity_proof(admin_secret=admin_secret, agent=agent, nonce=nonce)
    return hmac.compare_digest(expected.encode(), proof.encode("utf-8", "replace"))
