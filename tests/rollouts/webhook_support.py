"""A real HTTP receiver for webhook tests, and moving a delivery's schedule instead of waiting."""

import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from django.utils import timezone

from controlplane.rollouts.models import WebhookDelivery

SECRET = "s3cret-for-webhook-tests"
LOOPBACK = "127.0.0.1/32"


class Receiver:
    """Records each POST; answers with the queued status codes, then 204. A status of 0
    holds the answer until `release` (for timeouts and concurrent attempts)."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.answers: list[int] = []
        self.arrived = threading.Event()  # a request is being held
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append((dict(self.headers), body))
                answer = receiver.answers.pop(0) if receiver.answers else 204
                if answer == 0:
                    receiver.arrived.set()
                    receiver.release.wait(timeout=60)
                    answer = 204
                self.send_response(answer)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/hook"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def make_due(delivery: WebhookDelivery, *, overdue_s: float = 0) -> None:
    """Move the next attempt into the past (instead of sleeping through the backoff)."""
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        next_attempt_at=timezone.now() - timedelta(seconds=overdue_s)
    )
