"""Request records as a gateway writes them, for the tests of ingest."""

import time
import uuid
from typing import Any

from contracts.routing import RequestRecord


def request_record(
    *, tenant_id: int, version_id: int, finished_at: float | None = None, **changes: Any
) -> RequestRecord:
    """A successful, non-streamed chat request of 10 + 5 tokens (any field can be changed)."""
    finished_at = time.time() if finished_at is None else finished_at
    values: dict[str, Any] = {
        "request_id": uuid.uuid4().hex,
        "tenant_id": tenant_id,
        "api_key_id": 1,
        "deployment": "smollm2",
        "version_id": version_id,
        "agent": "http://10.0.0.1:8101",
        "endpoint_kind": "chat",
        "status": 200,
        "is_stream": False,
        "started_at": finished_at - 0.5,
        "finished_at": finished_at,
        "e2e_s": 0.5,
        "ttft_s": None,
        "itl_mean_s": None,
        "itl_p95_s": None,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "usage_source": "engine",
    }
    return RequestRecord(**{**values, **changes})
