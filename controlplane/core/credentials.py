"""Raw secrets and their stored form, shared by personal tokens and tenant API keys."""

import hashlib
import secrets

VISIBLE_CHARACTERS = 8


def secret_generate(*, prefix: str) -> str:
    """256 bits of randomness behind a recognisable prefix ("cpt-", "sk-")."""
    return prefix + secrets.token_urlsafe(32)


def secret_hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def secret_visible_prefix(raw: str, *, prefix: str) -> str:
    return raw[: len(prefix) + VISIBLE_CHARACTERS]
