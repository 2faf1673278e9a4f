"""What a model-version signature covers, and how it is checked.

A signature is ed25519 over the canonical JSON of {"digest", "serving_config", "engine",
"engine_args"}: keys sorted, no whitespace, UTF-8. A version on the built-in engine without
engine arguments signs {"digest", "serving_config"} alone, the message of versions signed
before versions named their engine, so their signatures stay valid. For a folder artifact
the digest is its manifest's (contracts/manifest.py), so the signature covers every file;
an openai version, which has no artifact, signs an empty digest. The registry checks the
signature when a version is verified; an agent checks it again before it loads anything.
"""

import base64
import binascii
import json
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from contracts.engines import BUILTIN


class SignatureError(ValueError):
    pass


def signed_message(
    *,
    digest: str,
    serving_config: dict[str, Any],
    engine: str = BUILTIN,
    engine_args: dict[str, Any] | None = None,
) -> bytes:
    """The bytes that are signed. `digest` is the lowercase hex SHA-256 of the artifact."""
    payload: dict[str, Any] = {"digest": digest, "serving_config": serving_config}
    if engine != BUILTIN or engine_args:
        payload.update(engine=engine, engine_args=engine_args or {})
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def load_public_key(public_key_b64: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(public_key_b64, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as exc:
        raise SignatureError("public key must be 32 raw ed25519 bytes in base64") from exc


def verify_signature(
    *,
    public_key_b64: str,
    signature_b64: str,
    digest: str,
    serving_config: dict[str, Any],
    engine: str = BUILTIN,
    engine_args: dict[str, Any] | None = None,
) -> None:
    """Raise SignatureError unless the signature is valid for this digest, config and engine."""
    key = load_public_key(public_key_b64)
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SignatureError("signature must be base64") from exc
    try:
        message = signed_message(
            digest=digest, serving_config=serving_config, engine=engine, engine_args=engine_args
        )
        key.verify(signature, message)
    except InvalidSignature as exc:
        raise SignatureError(
            "signature does not match the digest, serving config and engine"
        ) from exc
