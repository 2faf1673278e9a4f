"""A task goes through the real Redis broker to a real worker process and back."""

import uuid

import pytest

from controlplane.core.tasks import ping
from tests.conftest import PYTHON, start_process, stop_process


@pytest.mark.slow
def test_task_round_trip_through_a_real_worker(tmp_path, redis_client) -> None:
    worker = start_process(
        [
            PYTHON,
            "-m",
            "celery",
            "-A",
            "controlplane",
            "worker",
            "--pool",
            "solo",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        tmp_path / "worker.log",
    )
    try:
        token = uuid.uuid4().hex
        result = ping.delay(token).get(timeout=60)
        assert result["token"] == token
        assert result["worker"]
    finally:
        assert stop_process(worker) == 0, (tmp_path / "worker.log").read_text()
