"""The HMAC of a flat stream entry: one helper for every stream whose entries are signed.

The message is a label (which stream, which version of the encoding), then each field but
`mac`, sorted by name, as `<byte length>:<name><byte length>:<value>`: length prefixes make
it prefix-free, so no choice of names or values (a value holding a separator, a field split
in two) can give two different entries one message. The label keeps an entry signed for
one stream from verifying on another under the same key.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping

MAC_FIELD = "mac"
MAC_KEY_MIN_BYTES = 32
MAC_PATTERN = re.compile(r"^[0-9a-f]{64}$")


class FieldsMacError(ValueError):
    """An entry's `mac` is missing or does not match its fields."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # missing_mac or bad_mac


def fields_mac(fields: Mapping[str, str], key: bytes, *, label: bytes) -> str:
    """HMAC-SHA256 (hex) of every field but `mac`, in the canonical encoding above."""
    if len(key) < MAC_KEY_MIN_BYTES:
        raise ValueError(f"mac key: must be at least {MAC_KEY_MIN_BYTES} bytes")
    parts = [label]
    for name in sorted(fields):
        if name == MAC_FIELD:
            continue
        value = fields[name]
        if not isinstance(name, str) or not isinstance(value, str):
            raise FieldsMacError("bad_mac", f"{str(name)[:40]}: fields must be strings")
        # surrogatepass: a lone surrogate in a value must not make signing raise
        name_bytes = name.encode("utf-8", "surrogatepass")
        value_bytes = value.encode("utf-8", "surrogatepass")
        parts += [b"%d:" % len(name_bytes), name_bytes, b"%d:" % len(value_bytes), value_bytes]
    return hmac.digest(key, b"".join(parts), "sha256").hex()


def fields_sign(fields: Mapping[str, str], key: bytes, *, label: bytes) -> dict[str, str]:
    """The entry's fields with `mac` set (an existing `mac` is replaced)."""
    signed = {name: value for name, value in fields.items() if name != MAC_FIELD}
    signed[MAC_FIELD] = fields_mac(signed, key, label=label)
    return signed


def fields_verify(fields: Mapping[str, str], key: bytes, *, label: bytes) -> None:
    """Raise FieldsMacError (reason `missing_mac` or `bad_mac`) unless `mac` matches."""
    mac = fields.get(MAC_FIELD)
    if mac is None or mac == "":
        raise FieldsMacError("missing_mac", "mac: missing")
    if not isinstance(mac, str) or not MAC_PATTERN.fullmatch(mac):
        raise FieldsMacError("bad_mac", "mac: not 64 lowercase hex characters")
    if not hmac.compare_digest(fields_mac(fields, key, label=label), mac):
        raise FieldsMacError("bad_mac", "mac: does not match the entry's fields")
