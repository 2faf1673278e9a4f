"""The handlers the ingest process runs, one per Redis stream.

Domain apps add theirs here as their streams come to exist (heartbeats, requests).
"""

from controlplane.core.streams import StreamHandler


def stream_handlers() -> dict[str, StreamHandler]:
    return {}
