"""The real SmolLM2-135M-Instruct GGUF: parity with transformers and the Paris answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

from engine.loader import load_checkpoint, smollm2_path
from engine.tokenizer import TextTokenizer
from tests.engine.conftest import start_server, stop_server

PARIS_QUESTION = "What is the capital of France?"
PARIS: list[ChatCompletionMessageParam] = [{"role": "user", "content": PARIS_QUESTION}]
QUESTIONS = [
    "What is the capital of France?",
    "Count to five.",
    "Name a primary color.",
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
    "Give me a synonym for happy.",
    "What does a CPU do?",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "smollm2.log"
    server = start_server(
        ["--model", "smollm2", "--dtype", "float32", "--served-model-name", "smollm2",
         "--max-model-len", "1024"],
        log,
    )  # fmt: skip
    yield server
    stop_server(server)


def test_chat_answers_paris(smollm2_server):
    response = smollm2_server.client.chat.completions.create(
        model="smollm2", messages=PARIS, temperature=0, max_tokens=32
    )
    assert response.choices[0].message.content == "The capital of France is Paris."
    assert response.choices[0].finish_reason == "stop"


def test_greedy_matches_transformers_on_the_gguf_weights(smollm2_server):
    from concurrent.futures import ThreadPoolExecutor

    from bench.engine_reference import reference_from_checkpoint

    checkpoint = load_checkpoint(smollm2_path())
    tokenizer = TextTokenizer(checkpoint.tokenizer_source)
    model = reference_from_checkpoint(checkpoint, torch.float32, "cpu")

    def serve(question: str) -> dict:
        return smollm2_server.http().post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": question}], "temperature": 0,
                  "max_tokens": 24, "ignore_eos": True, "return_token_ids": True},
        ).json()  # fmt: skip

    # The 8 x 32 parity check runs on the tiny model; here 4 x 24 keeps the slow test short.
    questions = QUESTIONS[:4]
    with ThreadPoolExecutor(len(questions)) as pool:
        results = list(pool.map(serve, questions))
    for question, result in zip(questions, results, strict=True):
        prompt = tokenizer.encode_chat([{"role": "user", "content": question}])
        assert result["choices"][0]["prompt_token_ids"] == prompt
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                do_sample=False, eos_token_id=None,
                pad_token_id=2,
            )  # fmt: skip
        assert result["choices"][0]["token_ids"] == out[0, len(prompt) :].tolist(), question


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_reduced_precision_still_answers_paris(dtype: str, tmp_path: Path):
    server = start_server(
        ["--model", "smollm2", "--dtype", dtype, "--max-model-len", "512"],
        tmp_path / f"{dtype}.log",
    )
    try:
        response = server.client.chat.completions.create(
            model="smollm2", messages=PARIS, temperature=0, max_tokens=32
        )
        content = response.choices[0].message.content
        assert content is not None
        assert "Paris" in content
        assert server.stats()["dtype"] == dtype
    finally:
        stop_server(server)


def test_gguf_metadata_reaches_the_tokenizer():
    checkpoint = load_checkpoint(smollm2_path())
    tokenizer = TextTokenizer(checkpoint.tokenizer_source)
    assert checkpoint.config.rope_theta == 100000.0
    assert checkpoint.config.num_kv_heads == 3
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.encode("12345") == [33, 34, 35, 36, 37]
    rendered = tokenizer.render_chat([{"role": "user", "content": PARIS_QUESTION}])
    assert rendered.endswith("<|im_start|>assistant\n")
    assert json.dumps(rendered).count("<|im_start|>") == 3


def test_stream_decoder_gives_the_text_of_decoding_it_all():
    """Token by token, characters split across tokens (accents, CJK, emoji sequences)
    come out whole once complete, special tokens are skipped, and the pieces add up to
    decoding every token at once."""
    tokenizer = TextTokenizer(load_checkpoint(smollm2_path()).tokenizer_source)
    text = "Crème brûlée 🍮, 日本語のテキスト, a family 👩‍👩‍👧 and a flag 🇫🇷.\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids.insert(3, tokenizer.eos_token_ids[0])
    step = tokenizer.stream_decoder()
    pieces = [step(token) for token in ids]
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces) and "" in pieces  # some tokens end mid-character
    assert tokenizer.stream_decoder()(10**6) == ""  # an id past the vocabulary adds nothing
