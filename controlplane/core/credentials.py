"""Raw secrets and their stored form, shared by personal tokens and tenant API keys.

Standard library only: DRF loads the authentication classes, which use this, while
it is itself being imported.
"""

import hashlib
import secrets
from dataclasses import dataclass

VISIBLE_CHARACTERS = 8


@dataclass(frozen=True, slots=True)
class IssuedSecret:
    raw: str  # shown once, never stored
    visible_prefix: str  # stored, shown in lists
    hash: str  # stored, looked up


def secret_issue(*, prefix: str, raw: str | None = None) -> IssuedSecret:
    """A new secret behind `prefix`. `raw` is for the demo seed only (reproducible
    credentials)."""
    raw = raw or secret_generate(prefix=prefix)
    return IssuedSecret(
        raw=raw, visible_prefix=secret_visible_prefix(raw, prefix=prefix), hash=secret_hash(raw)
    )


def secret_generate(*, prefix: str) -> str:
    """256 bits of randomness behind a recognisable prefix ("cpt-", "sk-")."""
    return prefix + secrets.token_urlsafe(32)


def secret_hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def secret_visible_prefix(raw: str, *, prefix: str) -> str:
    return raw[: len(prefix) + VISIBLE_CHARACTERS]
