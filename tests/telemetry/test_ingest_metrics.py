"""`manage.py ingest --metrics-port`: the real ingest process serves its counters, so the
refusals and usage gaps it counts are visible to Prometheus (not only in-process)."""

import httpx
import pytest
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from contracts.routing import REQUESTS_STREAM, request_fields_sign
from contracts.streams import HEARTBEATS_STREAM
from tests.agent.test_agent_processes import free_port_pair, ingest_args, running
from tests.conftest import wait_until
from tests.fleet.support import heartbeat, publish, register

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def samples(port: int) -> dict[tuple[str, tuple], float]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return {}
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_ingest_process_serves_its_counters(redis_client, tmp_path) -> None:
    register("agent-a")
    port = free_port_pair()
    args = [*ingest_args(), "--metrics-port", str(port)]
    with running(args, tmp_path / "ingest.log", REDIS_URL=settings.INGEST_REDIS_URL):
        publish(redis_client, heartbeat(agent="agent-a", seq=1))
        forged = heartbeat(agent="agent-a", seq=2)
        redis_client.xadd(HEARTBEATS_STREAM, forged.to_fields())  # no mac
        # Two request records lost before they were metered: one no gateway signed, one a
        # gateway signed that does not parse.
        redis_client.xadd(REQUESTS_STREAM, {"request_id": "x"})
        redis_client.xadd(
            REQUESTS_STREAM, request_fields_sign({"v": "1"}, settings.TELEMETRY_RECORD_KEY)
        )
        expected = {
            ("fleet_heartbeats_refused_total", (("reason", "missing_mac"),)): 1.0,
            ("ingest_usage_gaps_total", (("reason", "refused"),)): 1.0,
            ("ingest_usage_gaps_total", (("reason", "malformed"),)): 1.0,
            ("ingest_usage_gaps_total", (("reason", "trimmed_unread"),)): 0.0,
        }
        applied = ("ingest_entries_total", (("stream", HEARTBEATS_STREAM),))

        def counted() -> bool:
            now = samples(port)
            return now.get(applied, 0) >= 1 and all(
                now.get(key) == value for key, value in expected.items()
            )

        wait_until(
            counted,
            timeout=30,
            message=lambda: f"{samples(port)}\n{(tmp_path / 'ingest.log').read_text()}",
        )
