"""When an agent loads a failed engine's version again: at once, then backing off."""

from agent.restart_plan import RestartPlan
from contracts.commands import LoadPayload

LOAD = LoadPayload(
    version_id=7,
    model="smol",
    label="f32",
    digest="a" * 64,
    format="gguf",
    size_bytes=1,
    serving_config={"dtype": "float32"},
    signature="",
    key_id="release-key",
    public_key="",
    served_model_name="smol",
)


def test_the_first_failure_restarts_at_once_and_a_loop_backs_off_to_a_minute() -> None:
    plan = RestartPlan()
    plan.schedule(LOAD, now=100.0)
    assert plan.due(100.0) is LOAD
    delays = []
    now = 100.0
    for _ in range(9):  # each restart fails again
        plan.failed(LOAD, now)
        waited = 0.0
        while plan.due(now + waited) is None:
            waited += 0.5
        delays.append(waited)
        now += waited
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_an_engine_that_served_ten_minutes_is_restarted_at_once_again() -> None:
    plan = RestartPlan()
    plan.schedule(LOAD, now=0.0)
    plan.failed(LOAD, 0.0)  # a failed restart: the next waits 1 s
    plan.succeeded(1.0)
    plan.schedule(LOAD, now=30.0)  # failed 29 s after its start: a loop, it waits
    assert plan.due(30.0) is None
    plan.succeeded(32.0)
    plan.schedule(LOAD, now=32.0 + 600.0)  # served ten minutes: at once
    assert plan.due(632.0) is LOAD
    plan.cancel()
    assert plan.due(10_000.0) is None
