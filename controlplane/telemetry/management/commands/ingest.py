"""`manage.py ingest`: consume the telemetry streams into the database.

Run as many as you like: they share the work through one Redis consumer group.
SIGTERM and SIGINT stop it after the batch in hand. With `--metrics-port` it serves its
counters (entries, refusals, lost agents, lag) at `/metrics` for Prometheus.
"""

import logging
import os
import signal
import socket
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from prometheus_client import start_http_server

from contracts.tracing import TracingConfigError, tracing_configure
from controlplane.core.redis_clients import stream_reader
from controlplane.telemetry.ingest import ingest_ticker, stream_handlers
from controlplane.telemetry.streams import StreamIngestor

logger = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Consume telemetry streams from Redis (consumer group) into the database."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--group", default="ingest", help="consumer group name")
        parser.add_argument(
            "--consumer",
            default=f"{socket.gethostname()}-{os.getpid()}",
            help="this consumer's name within the group (default: host-pid)",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=2000,
            help="entries per read (XREADGROUP COUNT); each batch is one transaction",
        )
        parser.add_argument("--claim-idle-ms", type=int, default=30_000)
        parser.add_argument(
            "--metrics-port", type=int, default=None, help="serve /metrics on this port"
        )
        parser.add_argument("--metrics-bind", default="127.0.0.1", help="address for /metrics")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        if options["claim_idle_ms"] < 100:
            raise CommandError("--claim-idle-ms must be at least 100")
        port = options["metrics_port"]
        if port is not None and not 1 <= port <= 65535:
            raise CommandError("--metrics-port must be within 1..65535")
        try:
            tracing_configure("ingest")  # hard-breach rollbacks are traced decisions
        except TracingConfigError as exc:
            raise CommandError(str(exc)) from exc
        if port is not None:
            try:
                start_http_server(port, addr=options["metrics_bind"])
            except OSError as exc:
                raise CommandError(f"--metrics-port {port}: {exc}") from exc
        stop = threading.Event()

        def request_stop(signum: int, frame: Any) -> None:
            logger.info("ingest stopping", extra={"signal": signum})
            stop.set()

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        handlers = stream_handlers()
        client = stream_reader()
        ingestor = StreamIngestor(
            client=client,
            group=options["group"],
            consumer=options["consumer"],
            handlers=handlers,
            batch_size=options["batch_size"],
            claim_idle_ms=options["claim_idle_ms"],
            block_ms=500,  # the ticker (lost agents) runs at least this often
            on_tick=ingest_ticker(),
        )
        logger.info(
            "ingest started",
            extra={
                "streams": sorted(handlers),
                "group": options["group"],
                "consumer": options["consumer"],
            },
        )
        if not handlers:
            stop.wait()
            return
        ingestor.run(stop.is_set)
        logger.info("ingest stopped")
