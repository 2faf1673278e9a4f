"""No request entry is lost when Redis goes away: the gateway spools and replays them."""

import subprocess

import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from contracts.routing import REQUESTS_STREAM
from controlplane.gateway.spool import Spool
from controlplane.tenants.models import UsageRecord
from tests.conftest import wait_until
from tests.gateway.conftest import (
    client_for,
    free_port,
    ingest_all,
    make_setup,
    route_wholly,
    start_gateway,
    stop_gateway,
    usage_of,
    wait_for_model,
)

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi"}]


def start_redis(port: int, directory) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, decode_responses=True)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_until(answers, timeout=10)
    return process


def log_tail(gateway) -> str:
    return gateway.log.read_text(errors="replace")[-4000:]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=10)


def test_entries_survive_a_redis_outage_through_the_spool(
    transactional_db, engines, tmp_path
) -> None:
    port = free_port()
    own_redis = start_redis(port, tmp_path)
    client = redis.Redis(port=port, decode_responses=True)
    spool_dir = tmp_path / "spool"
    own_url = f"redis://127.0.0.1:{port}/0"
    gateway = start_gateway(
        tmp_path, spool_dir, REDIS_URL=own_url, GATEWAY_REDIS_URL=own_url, LOG_LEVEL="INFO"
    )
    try:
        setup = make_setup()
        route_wholly(setup.versions[0], engines[0], client=client)
        wait_for_model(gateway, setup.raw_key, "smollm2")
        stop(own_redis)
        openai_client = client_for(gateway, setup.raw_key)
        answers = [
            openai_client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2)
            for _ in range(3)
        ]
        spool = Spool(spool_dir, max_bytes=1 << 20)
        wait_until(
            lambda: spool.pending_count() == 3,
            timeout=20,
            message=lambda: f"{spool.pending_count()} spooled:\n{log_tail(gateway)}",
        )

        own_redis = start_redis(port, tmp_path)  # back, empty of our entries
        # The replayer deletes a spool file after Redis took its entries: wait for the
        # file, not the stream (a replay thread descheduled between the two made this
        # test fail when it asserted an empty spool as soon as the stream had them).
        wait_until(
            lambda: spool.pending_count() == 0,
            timeout=30,
            message=lambda: f"{spool.pending_count()} still spooled:\n{log_tail(gateway)}",
        )
        assert client.xlen(REQUESTS_STREAM) == 3
        ingest_all(client)
        rows = UsageRecord.objects.filter(tenant=setup.tenant)
        assert sum(r.requests for r in rows) == 3
        assert sum(r.completion_tokens for r in rows) == sum(
            usage_of(answer).completion_tokens for answer in answers
        )
    finally:
        try:
            stop_gateway(gateway)
        finally:
            if own_redis.poll() is None:
                stop(own_redis)


def test_spool_is_bounded_and_replays_once(tmp_path) -> None:
    spool = Spool(tmp_path, max_bytes=200)  # three 65-byte lines
    entry = {"request_id": "a" * 32, "status": "200"}
    assert spool.append(entry)
    assert spool.append(entry)
    assert spool.append(entry)
    assert not spool.append(entry)  # full: dropped and counted, never fills the disk
    assert spool.pending_count() == 3

    written: list[dict] = []

    def failing(entries):
        raise redis.ConnectionError("down")

    with pytest.raises(redis.ConnectionError):
        spool.replay(failing)
    assert spool.pending_count() == 3  # kept for the next try
    assert spool.replay(written.extend) == 3
    assert written == [entry] * 3
    assert spool.pending_count() == 0
    assert spool.replay(written.extend) == 0
