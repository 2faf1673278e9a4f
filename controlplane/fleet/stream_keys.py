"""Each agent's stream key: what its heartbeats and command results are signed with.

HMAC-SHA256 of the agent's name under FLEET_AGENT_KEY, in hex: derived whenever needed
(enrolment hands it to the agent; ingest checks each entry's `mac` with it), never stored.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings

STREAM_KEY_LABEL = b"agent-stream\n"


def agent_stream_key(name: str) -> str:
    """64 hex characters."""
    return hmac.new(
        settings.FLEET_AGENT_KEY, STREAM_KEY_LABEL + name.encode(), hashlib.sha256
    ).hexdigest()
