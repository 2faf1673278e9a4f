import socket
from datetime import UTC, datetime

from celery import shared_task


@shared_task(name="core.ping")
def ping(token: str) -> dict[str, str]:
    """Echo a token back with the worker's host: used to prove workers are consuming."""
    return {"token": token, "worker": socket.gethostname(), "at": datetime.now(UTC).isoformat()}
