"""The gateway's stop is bounded step by step: a background loop that will not honour
its cancel (as redis-py's pub/sub has swallowed one, or waited on a socket while closing
it) costs the stop its bound, never the process its exit."""

import asyncio
import contextlib
import logging

from django.test import override_settings

from controlplane.gateway.app import Gateway


def test_stop_does_not_wait_for_a_loop_that_ignores_its_cancel(
    redis_client, tmp_path, caplog
) -> None:
    caplog.set_level(logging.ERROR, logger="controlplane.gateway.app")

    async def scenario() -> tuple[bool, bool]:
        gateway = Gateway()
        await gateway.start()

        released = asyncio.Event()

        async def deaf_to_cancels() -> None:
            while not released.is_set():
                with contextlib.suppress(asyncio.CancelledError):  # swallowed, every time
                    await released.wait()

        deaf = asyncio.create_task(deaf_to_cancels())
        gateway._tasks.append(deaf)
        await asyncio.sleep(0)
        await gateway.stop()
        is_deaf_pending = not deaf.done()
        released.set()
        await deaf
        return is_deaf_pending, gateway.is_started

    with override_settings(GATEWAY_SPOOL_DIR=tmp_path / "spool"):
        is_deaf_pending, is_started = asyncio.run(scenario())

    assert is_deaf_pending  # stop went on without it
    assert is_started is False
    assert "gateway stop: loops did not finish within 5 s; going on" in caplog.text
