from collections import Counter
from pathlib import Path

import pytest

from loadgen.trace import SAMPLE_TRACE, TraceError, load_trace, synthetic_prompt


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = '{"offset_s": 0.5, "prompt_tokens": 12, "max_tokens": 8, "tenant": "acme"}'


def test_shipped_sample_trace_is_varied_and_ordered():
    trace = load_trace("sample")
    assert load_trace(SAMPLE_TRACE) == trace
    assert len(trace) == 159
    assert [r.offset_s for r in trace] == sorted(r.offset_s for r in trace)
    assert Counter(r.tenant for r in trace) == {
        "acme": 68,
        "globex": 42,
        "initech": 37,
        "umbrella": 12,
    }
    lengths = [r.prompt_tokens for r in trace if r.prompt_tokens is not None]
    assert min(lengths) < 50 and max(lengths) > 1000
    assert min(r.max_tokens for r in trace) < 16 and max(r.max_tokens for r in trace) > 300
    assert any(r.prompt is not None for r in trace)
    assert any(r.session is not None for r in trace)


def test_parses_fields_and_defaults(tmp_path):
    path = write(
        tmp_path,
        '{"offset_s": 1, "prompt": "Hi there", "max_tokens": 4}',
        "",
        '{"offset_s": 0.25, "prompt_tokens": 30, "max_tokens": 16, "tenant": "b", "session": "s"}',
    )
    first, second = load_trace(path)
    assert (first.offset_s, first.prompt_tokens, first.tenant, first.session) == (
        0.25,
        30,
        "b",
        "s",
    )
    assert (second.offset_s, second.prompt, second.tenant) == (1.0, "Hi there", "default")
    assert second.prompt_text() == "Hi there"


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt_tokens": 5, "max_tokens": 3}', "offset_s is required"),
        ('{"offset_s": 1, "prompt_tokens": 5}', "max_tokens is required"),
        ('{"offset_s": 1, "max_tokens": 3}', "either prompt or prompt_tokens is required"),
        ('{"offset_s": -1, "prompt_tokens": 5, "max_tokens": 3}', "offset_s must be >= 0"),
        ('{"offset_s": "1", "prompt_tokens": 5, "max_tokens": 3}', "offset_s must be a number"),
        ('{"offset_s": 1, "prompt_tokens": 5.5, "max_tokens": 3}', "prompt_tokens must be a whole"),
        (
            '{"offset_s": 1, "prompt_tokens": true, "max_tokens": 3}',
            "prompt_tokens must be a whole",
        ),
        ('{"offset_s": 1, "prompt_tokens": 5, "max_tokens": 0}', "max_tokens must be >= 1"),
        ('{"offset_s": 1, "prompt_tokens": 5, "max_tokens": 3, "tenant": 7}', "tenant must be a"),
        ('{"offset_s": 1, "prompt_tokens": 5, "max_tokens": 3, "colour": 1}', "unknown field(s)"),
    ],
)
def test_a_bad_line_names_its_line_number(tmp_path, bad_line, message):
    path = write(tmp_path, GOOD, "", bad_line, GOOD)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value).startswith(f"{path}:3: ")
    assert message in str(caught.value)


def test_empty_and_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(TraceError, match="the trace has no requests"):
        load_trace(write(tmp_path, "", "  "))
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl")


def test_synthetic_prompts_have_the_length_and_share_a_session_prefix():
    short = synthetic_prompt(10, "session:s1")
    long = synthetic_prompt(40, "session:s1")
    assert len(short.split()) == 10
    assert len(long.split()) == 40
    assert long.startswith(short)
    assert synthetic_prompt(10, "session:s2") != short
