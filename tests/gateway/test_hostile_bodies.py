"""Arbitrary values in every documented field: never a 5xx, and nobody else is hurt.

A hostile tenant's chat bodies (hypothesis: each field valid, at a boundary, of the wrong
type, or absent; fields the engine does not implement; unknown fields) go to a real
engine directly and through a real gateway, while an innocent tenant's greedy streams
run beside them, through the gateway and straight to the engine. No answer may be 5xx
(or a stream carrying an error), and every innocent stream must bring its exact text.
"""

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import make_setup, route_wholly, serving_headers, wait_for_model

pytestmark = pytest.mark.slow

INNOCENT = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Count from one to ten."}],
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-5, 2**40), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
# A null token limit means "absent", which is valid and runs to the context's end
# (minutes on a busy CPU): the limits get every junk value but that one.
JUNK_LIMIT = JUNK.filter(lambda value: value is not None)


# Each field's values that the engine must serve...
VALID = {
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2) | st.sampled_from([1e-300, 5e-324, 1e-6]),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(1, 60_000) | st.just(-1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=20)
    | st.lists(st.text(min_size=1, max_size=10), max_size=16),
    "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=32),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "n": st.just(1),
    "logprobs": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=20),
    "return_token_ids": st.booleans(),
}
# ...and values it must refuse with a 4xx, for those and for fields it does not implement.
HOSTILE = {
    "max_tokens": st.integers(-3, 0) | st.integers(2**31, 2**70) | JUNK_LIMIT,
    "max_completion_tokens": st.integers(-3, 0) | JUNK_LIMIT,
    "temperature": st.floats(2.0001, 1e308) | st.floats(-1e308, -1e-300) | JUNK,
    "top_p": st.floats(1.0001, 1e9) | st.just(0) | JUNK,
    "top_k": st.just(0) | st.integers(-(2**70), -2) | JUNK,
    "seed": st.integers(2**63, 2**70) | st.integers(-(2**70), -1) | JUNK,
    "stop": st.lists(st.text(min_size=1, max_size=3), min_size=17, max_size=40)
    | st.text(min_size=257, max_size=400)
    | st.just("")
    | JUNK,
    "stop_token_ids": st.lists(st.integers(0, 49_151), min_size=33, max_size=5000)
    | st.lists(st.integers(49_152, 2**70), min_size=1, max_size=2)
    | st.lists(st.integers(-(2**70), -1), min_size=1, max_size=2)
    | JUNK,
    "presence_penalty": st.floats(2.0001, 1e300) | JUNK,
    "n": st.integers(2, 2**70) | JUNK,
    "logprobs": JUNK,
    "top_logprobs": st.integers(21, 2**70) | st.integers(-5, 20) | JUNK,
    "stream_options": JUNK,
    "user": st.text(min_size=257, max_size=300) | JUNK,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "wizard"]), "content": JUNK}
        ),
        max_size=3,
    )
    | JUNK,
    "logit_bias": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    "tools": st.lists(st.dictionaries(st.text(max_size=3), JUNK), max_size=1),
    "response_format": st.just({"type": "json_object"}),
    "made_up_field": JUNK,
}


@st.composite
def bodies(draw) -> dict:
    """A valid body (any subset of the optional fields), then up to two fields made hostile."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": draw(st.text(max_size=40))}],
        "max_tokens": draw(st.integers(1, 8)),  # never absent: a stream to the context's end
    }
    for name in draw(st.lists(st.sampled_from(sorted(VALID)), unique=True, max_size=8)):
        body[name] = draw(VALID[name])
    for name in draw(st.lists(st.sampled_from(sorted(HOSTILE)), unique=True, max_size=2)):
        body[name] = draw(HOSTILE[name])
    return body


def is_healthy_answer(response: httpx.Response) -> bool:
    """Not 5xx, and a 200 stream ends in [DONE] without an error event."""
    if response.status_code >= 500:
        return False
    if response.status_code == 200 and "event-stream" in response.headers.get("content-type", ""):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        return events[-1:] == ["data: [DONE]"] and not any(
            "error" in json.loads(line[6:]) for line in events[:-1]
        )
    return True


class InnocentStreams:
    """Greedy streams, one after another, through the gateway and to the engine."""

    def __init__(self, targets: list[tuple[str, dict[str, str]]]) -> None:
        self.targets = targets
        self.expected: str | None = None
        self.texts: list[str] = []
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def stream_text(self, url: str, headers: dict[str, str]) -> str:
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=INNOCENT, headers=headers, timeout=60
        ) as response:
            if response.status_code != 200:
                return f"status {response.status_code}: {response.read()[:200]!r}"
            pieces = []
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"error event: {event}"
                    for choice in event.get("choices", []):
                        pieces.append(choice.get("delta", {}).get("content") or "")
            return "".join(pieces)

    def _run(self) -> None:
        while not self._stop.is_set():
            for url, headers in self.targets:
                text = self.stream_text(url, headers)
                self.texts.append(text)
                if text != self.expected:
                    self.problems.append(f"{url}: {text!r}")

    def __enter__(self) -> "InnocentStreams":
        url, headers = self.targets[0]
        self.expected = self.stream_text(url, headers)  # alone, before the hostile bodies
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def test_hostile_chat_bodies_get_no_5xx_and_hurt_no_innocent_stream(
    stores, engines, gateways
) -> None:
    hostile, innocent = make_setup(), make_setup()
    route_wholly(hostile.versions[0], engines[0])
    gateway = gateways[0]
    wait_for_model(gateway, hostile.raw_key, "smollm2")
    wait_for_model(gateway, innocent.raw_key, "smollm2")
    innocent_targets = [
        (f"{gateway.url}", {"Authorization": f"Bearer {innocent.raw_key}"}),
        (engines[0], serving_headers(engines[0])),
    ]
    hostile_targets = [
        (f"{gateway.url}", {"Authorization": f"Bearer {hostile.raw_key}"}),
        (engines[0], serving_headers(engines[0])),
    ]
    bad_answers: list[str] = []
    statuses: list[int] = []

    @settings(
        max_examples=80,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(body=bodies())
    def send(body: dict) -> None:
        for url, headers in hostile_targets:
            response = httpx.post(
                f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60
            )
            statuses.append(response.status_code)
            if not is_healthy_answer(response):
                bad_answers.append(f"{url} {response.status_code} {body!r}: {response.text[:300]}")

    with InnocentStreams(innocent_targets) as streams:
        send()

    assert bad_answers == []
    assert streams.problems == [], f"expected {streams.expected!r}"
    assert len(streams.texts) >= 4
    assert 200 in statuses and 400 in statuses  # both kinds of body were tried


def test_json_nested_past_the_recursion_limit_is_a_400_everywhere(
    stores, engines, gateways
) -> None:
    setup = make_setup()
    route_wholly(setup.versions[0], engines[0])
    wait_for_model(gateways[0], setup.raw_key, "smollm2")
    nested = b"[" * 100_000 + b"]" * 100_000
    for url, headers in (
        (gateways[0].url, {"Authorization": f"Bearer {setup.raw_key}"}),
        (engines[0], serving_headers(engines[0])),
    ):
        response = httpx.post(
            f"{url}/v1/chat/completions",
            content=nested,
            headers={**headers, "content-type": "application/json"},
            timeout=30,
        )
        assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json")
