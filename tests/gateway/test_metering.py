"""The stream meter's byte scan says exactly what decoding each event would say.

Token chunks are scanned, not decoded (metering.py); a tenant whose completions are kept
has every event decoded. So two meters fed the same events, one capturing and one not,
must forward the same bytes and count the same tokens, usage, errors and end.
"""

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.gateway.metering import StreamMeter, split_events

USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}

# Text a model may write, including what looks like the members the scan looks for.
tricky_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "",
            '"',
            "\\",
            '\\"',
            '", "usage": null}',
            '"usage": {"prompt_tokens": 1}',
            '"content": "x',
            '"text": "y"',
            "error",
            '"error"',
            "\n\n",
            "data: [DONE]",
            '"choices": []',
        ]
    ),
)


@st.composite
def chunks(draw) -> bytes:
    kind = draw(
        st.sampled_from(
            ["chat", "completion", "role", "finish", "usage", "no-choices", "choices-null"]
        )
    )
    text = draw(tricky_text)
    if kind == "chat":
        choice: dict[str, object] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": None,
            "delta": {"content": text},
        }
    elif kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    elif kind == "role":
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    else:
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    choices = [] if kind in ("usage", "no-choices") else [choice]
    usage_member = draw(st.sampled_from(["null", "absent", "object", "first", "nested"]))
    if kind == "usage":
        usage_member = "object"
    payload: dict = {}
    if usage_member == "first":
        payload["usage"] = None
    payload |= {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1}
    payload["model"] = draw(st.sampled_from(["m", "usage", "error"]))
    if kind == "choices-null":
        payload["choices"] = None
    elif kind != "no-choices" or draw(st.booleans()):  # or no `choices` member at all
        payload["choices"] = choices
    if usage_member == "null":
        payload["usage"] = None
    elif usage_member == "object":
        payload["usage"] = USAGE
    if usage_member == "nested" and choices:
        choices[0]["usage"] = None  # not the chunk's usage: never cut
    compact = draw(st.booleans())
    separators = (",", ":") if compact else (", ", ": ")
    data = json.dumps(payload, separators=separators, ensure_ascii=draw(st.booleans()))
    return b"data: " + data.encode() + b"\n\n"


events = st.one_of(
    chunks(),
    st.sampled_from(
        [
            b"data: [DONE]\n\n",
            b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n',
            b": keep-alive\n\n",
            b'data: {"choices": [{"delta": {"content": "a"}}]}\r\n\r\n',
            b'event: message\ndata: {"choices": [{"delta": {"content": "b"}}]}\n\n',
        ]
    ),
)


def meter(*, is_usage_stripped: bool, is_capturing: bool) -> StreamMeter:
    return StreamMeter(started=0.0, is_usage_stripped=is_usage_stripped, is_capturing=is_capturing)


def summary(m: StreamMeter) -> tuple:
    return (m.token_events, m.usage, m.has_error, m.is_done, m.first_token_at, len(m.gaps))


@settings(max_examples=400, deadline=None)
@given(stream=st.lists(events, max_size=8), is_usage_stripped=st.booleans())
def test_scanned_events_are_metered_as_decoded_ones(stream, is_usage_stripped) -> None:
    scanned = meter(is_usage_stripped=is_usage_stripped, is_capturing=False)
    decoded = meter(is_usage_stripped=is_usage_stripped, is_capturing=True)
    for index, event in enumerate(stream):
        assert scanned.feed([event], float(index)) == decoded.feed([event], float(index))
    assert summary(scanned) == summary(decoded)


@settings(max_examples=200, deadline=None)
@given(stream=st.lists(events, max_size=8), cuts=st.lists(st.integers(0, 2000), max_size=6))
def test_events_cut_anywhere_are_forwarded_whole(stream, cuts) -> None:
    whole = meter(is_usage_stripped=True, is_capturing=False)
    expected = whole.feed(stream, 1.0)
    data = b"".join(stream)
    bounds = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})
    pieced = meter(is_usage_stripped=True, is_capturing=False)
    out, rest = [], b""
    for start, end in itertools.pairwise(bounds):
        forwarded, rest = pieced.feed_bytes(rest + data[start:end], 1.0)
        out.append(forwarded)
    assert b"".join(out) == expected
    assert rest == split_events(data)[1]
    assert summary(pieced) == summary(whole)


def test_the_usage_chunk_is_kept_and_dropped_as_asked() -> None:
    token = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": null}\n\n'
    usage = b'data: {"choices": [], "usage": ' + json.dumps(USAGE).encode() + b"}\n\n"
    stripped = meter(is_usage_stripped=True, is_capturing=False)
    assert stripped.feed([token, usage, b"data: [DONE]\n\n"], 1.0) == (
        b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
    )
    assert (stripped.token_events, stripped.usage, stripped.is_done) == (1, USAGE, True)
    kept = meter(is_usage_stripped=False, is_capturing=False)
    assert kept.feed([token, usage], 1.0) == token + usage
    assert (kept.token_events, kept.usage) == (1, USAGE)
