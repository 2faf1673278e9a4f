"""One request's failure is its own; only a broken forward pass fails the engine.

The engine runs in process (tiny random Llama, its real step loop and HTTP app); faults
are injected where a request's own sampling or the shared forward pass would break.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import sampler
from engine.config import EngineConfig
from engine.server import EngineApp
from tests.engine.conftest import bearer, new_secrets

SECRETS = new_secrets()
SERVING = bearer(SECRETS.serving)

INNOCENT = {
    "model": "tiny",
    "prompt": [5, 6, 7, 8],
    "max_tokens": 12,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture
def app(tiny_llama: Path) -> Iterator[EngineApp]:
    engine_app = EngineApp(
        EngineConfig(
            model=str(tiny_llama),
            served_model_name="tiny",
            dtype="float32",
            max_model_len=256,
            num_blocks=128,
            device="cpu",
            threads=1,
        ),
        secrets=SECRETS,
    )
    engine_app.start_loading()
    engine_app.wait_loaded(120)
    assert engine_app.status == "ready", engine_app.failure
    yield engine_app
    engine_app.shutdown()


async def _post_all(app: EngineApp, bodies: list[dict]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://engine", timeout=60, headers=SERVING
    ) as c:
        return list(
            await asyncio.gather(*(c.post("/v1/completions", json=body) for body in bodies))
        )


def post_all(app: EngineApp, bodies: list[dict]) -> list[httpx.Response]:
    return asyncio.run(_post_all(app, bodies))


def get(app: EngineApp, path: str) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            is_admin = path.startswith("/admin/")
            return await client.get(path, headers=bearer(SECRETS.admin) if is_admin else SERVING)

    return asyncio.run(call())


def test_a_tiny_temperature_is_greedy_and_harms_no_one(app) -> None:
    # 1e-300 would make every logit infinite; below 1e-5 a request is greedy instead.
    alone = post_all(app, [INNOCENT])[0].json()["choices"][0]["text"]
    answers = post_all(app, [INNOCENT, {**INNOCENT, "temperature": 1e-300}, INNOCENT])
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    assert [answer.json()["choices"][0]["text"] for answer in answers] == [alone] * 3


def test_one_requests_sampling_failure_ends_that_request_alone(app, monkeypatch) -> None:
    alone = post_all(app, [INNOCENT])[0].json()["choices"][0]["text"]
    real_draw = sampler._draw

    def failing_for_seed_13(logits, seqs):
        if any(seq.params.seed == 13 for seq in seqs):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_draw(logits, seqs)

    monkeypatch.setattr(sampler, "_draw", failing_for_seed_13)
    doomed = {**INNOCENT, "temperature": 0.8, "seed": 13}
    answers = post_all(app, [INNOCENT, doomed, INNOCENT])

    assert [answer.status_code for answer in answers] == [200, 500, 200]
    assert answers[1].json()["error"]["code"] == "engine_error"
    assert "sampling failed" in answers[1].json()["error"]["message"]
    assert [answers[0].json()["choices"][0]["text"], answers[2].json()["choices"][0]["text"]] == [
        alone,
        alone,
    ]
    assert (get(app, "/health").status_code, app.status) == (200, "ready")


def test_a_forward_pass_failure_marks_the_engine_failed(app, monkeypatch) -> None:
    def broken(batch):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(app.engine.runner, "run", broken)
    (failed,) = post_all(app, [INNOCENT])
    assert failed.status_code == 500
    assert "the engine failed: CUDA error" in failed.json()["error"]["message"]

    health = get(app, "/health")
    assert health.status_code == 503
    assert health.json() == {
        "status": "failed",
        "error": "CUDA error: device-side assert triggered",
    }
    assert get(app, "/admin/stats").json()["state"] == "failed"
    (refused,) = post_all(app, [INNOCENT])
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_failed"
