"""The request id an engine logs and echoes for each HTTP request."""

from __future__ import annotations

import re
import uuid

# The caller's request id (the gateway's), echoed and logged; any other value is replaced by
# one of the engine's own, so that a log line cannot be forged or swollen through it.
REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_from(header: str | None) -> str:
    """The caller's request id if it is 1-128 characters of A-Z a-z 0-9 . _ : -, else a new one."""
    if header is not None and REQUEST_ID_PATTERN.fullmatch(header):
        return header
    return uuid.uuid4().hex
