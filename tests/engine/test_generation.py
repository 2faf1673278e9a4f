"""Generation through the HTTP API of a tiny random Llama, checked against transformers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.engine.conftest import EngineServer

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "Continuous batching mixes",
    "A paged KV cache stores keys and values in fixed-size blocks. Numbers like 12345",
    "Hello",
    "Berlin",
    "How are you today? I am fine, thank you. The lazy dog jumps over the quick brown fox.",
    "blocks",
]


@pytest.fixture(scope="module")
def reference_model(tiny_llama: Path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def complete(server: EngineServer, prompt: str | list[int], **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, **extra}
    response = httpx.post(
        f"{server.base_url}/v1/completions", json=body, headers=server.serving, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_matches_transformers_under_concurrency(tiny_server, reference_model):
    from concurrent.futures import ThreadPoolExecutor

    def run(prompt: str) -> dict:
        return complete(tiny_server, prompt, max_tokens=32, temperature=0, ignore_eos=True)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS))
    for result in results:
        choice = result["choices"][0]
        expected = hf_greedy(reference_model, choice["prompt_token_ids"], 32)
        assert choice["token_ids"] == expected
        assert choice["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == 32


def test_prefix_cache_reuses_blocks_and_keeps_output(tiny_server, reference_model):
    prompt = list(range(3, 3 + 40))  # 40 token ids: two full blocks of 16 are shareable
    first = complete(tiny_server, prompt, max_tokens=8, temperature=0, ignore_eos=True)
    second = complete(tiny_server, prompt, max_tokens=8, temperature=0, ignore_eos=True)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    assert second["choices"][0]["token_ids"] == hf_greedy(reference_model, prompt, 8)
    metrics = httpx.get(f"{tiny_server.base_url}/metrics", headers=tiny_server.serving).text
    hits = [
        line for line in metrics.splitlines() if line.startswith("engine:prefix_cache_hits_total")
    ]
    assert hits and float(hits[0].split()[-1]) >= 32


def test_chat_stream_matches_non_streamed_and_reports_usage(tiny_server):
    client = tiny_server.client
    messages = [{"role": "user", "content": "Hello world! How are you?"}]
    full = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=20
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=20, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_without_usage(tiny_server):
    stream = tiny_server.client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    streamed = "".join(c.choices[0].text for c in chunks)
    full = tiny_server.client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0
    )
    assert streamed == full.choices[0].text


def test_seeded_sampling_is_reproducible(tiny_server):
    def sample(seed: int) -> list[int]:
        result = complete(
            tiny_server, "Hello", max_tokens=24, temperature=1.0, top_p=0.9, top_k=50,
            seed=seed, ignore_eos=True,
        )  # fmt: skip
        return result["choices"][0]["token_ids"]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_string_truncates_and_finishes(tiny_server):
    base = complete(
        tiny_server, "The quick brown fox", max_tokens=24, temperature=0, ignore_eos=True
    )
    text = base["choices"][0]["text"]
    stop = text[5:8]
    assert stop and stop not in text[:5]
    stopped = complete(
        tiny_server, "The quick brown fox", max_tokens=24, temperature=0, ignore_eos=True,
        stop=[stop],
    )  # fmt: skip
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_and_max_tokens(tiny_server):
    base = complete(tiny_server, "Hello", max_tokens=12, temperature=0, ignore_eos=True)
    tokens = base["choices"][0]["token_ids"]
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    stopped = complete(
        tiny_server, "Hello", max_tokens=12, temperature=0, ignore_eos=True,
        stop_token_ids=[stop_id],
    )  # fmt: skip
    assert stopped["choices"][0]["token_ids"] == tokens[: first + 1]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert base["choices"][0]["finish_reason"] == "length"
    assert base["usage"] == {
        "prompt_tokens": len(base["choices"][0]["prompt_token_ids"]),
        "completion_tokens": 12,
        "total_tokens": len(base["choices"][0]["prompt_token_ids"]) + 12,
        "prompt_tokens_details": base["usage"]["prompt_tokens_details"],
    }


def test_logprobs_are_the_models(tiny_server, reference_model, tiny_llama):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    result = complete(
        tiny_server, "Hello", max_tokens=4, temperature=0, ignore_eos=True, logprobs=3
    )
    choice = result["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    with torch.inference_mode():
        logits = reference_model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    start = len(choice["prompt_token_ids"]) - 1
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == 4
    for step, token_id in enumerate(choice["token_ids"]):
        row = expected[start + step]
        assert logprobs["token_logprobs"][step] == pytest.approx(row[token_id].item(), abs=1e-4)
        # OpenAI's completions shape keys alternatives by text, so tokens that decode
        # to the same text (partial UTF-8 bytes) collapse the way a dict does.
        expected_top: dict[str, float] = {}
        for token, value in zip(
            row.topk(3).indices.tolist(), row.topk(3).values.tolist(), strict=True
        ):
            expected_top[tokenizer.decode([token], skip_special_tokens=False)] = value
        assert logprobs["top_logprobs"][step] == pytest.approx(expected_top, abs=1e-4)


def test_chat_logprobs_shape(tiny_server):
    response = tiny_server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = response.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob for item in content)


def test_frequency_and_presence_penalties_follow_openai_formula(tiny_server, reference_model):
    frequency, presence = 1.5, 0.5
    result = complete(
        tiny_server, "Hello", max_tokens=16, temperature=0, ignore_eos=True,
        frequency_penalty=frequency, presence_penalty=presence,
    )  # fmt: skip
    choice = result["choices"][0]
    ids = list(choice["prompt_token_ids"])
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(16):
            logits = reference_model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(
                torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0]
            ).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            token = int(logits.argmax())
            generated.append(token)
            ids.append(token)
    assert choice["token_ids"] == generated
