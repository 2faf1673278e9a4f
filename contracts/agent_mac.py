"""The MAC an agent puts on what it writes: heartbeats and command results.

Each entry carries `mac`: HMAC-SHA256 under the sending agent's own stream key over every
other field (`agent_fields_sign`, contracts.fields_mac's encoding, labelled by stream);
ingest refuses an entry whose `mac` does not verify under the key of the agent it names
(`agent_fields_verify`).
"""

from __future__ import annotations

from collections.abc import Mapping

from contracts.commands import RESULTS_STREAM
from contracts.fields_mac import fields_sign, fields_verify
from contracts.streams import HEARTBEATS_STREAM


def _stream_label(stream: str) -> bytes:
    if stream not in (HEARTBEATS_STREAM, RESULTS_STREAM):
        raise ValueError(f"{stream!r} entries are not signed by agents")
    return f"{stream}.v1\n".encode()


def agent_fields_sign(stream: str, fields: Mapping[str, str], stream_key: str) -> dict[str, str]:
    """A heartbeat's or result's fields with `mac` set under the agent's stream key (hex)."""
    return fields_sign(fields, stream_key.encode(), label=_stream_label(stream))


def agent_fields_verify(stream: str, fields: Mapping[str, str], stream_key: str) -> None:
    """Raise contracts.fields_mac.FieldsMacError (`missing_mac`, `bad_mac`) unless it matches."""
    fields_verify(fields, stream_key.encode(), label=_stream_label(stream))
