"""/v1/embeddings against the sentence-transformers recipe computed with transformers."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from engine.loader import minilm_path
from tests.engine.conftest import start_server, stop_server

TEXTS = [
    "The capital of France is Paris.",
    "A much longer sentence about paged attention, continuous batching and prefix caching "
    "so that the batch needs padding for the short ones.",
    "hi",
]


def reference_embeddings(texts: list[str]) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    folder = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def test_embeddings_match_sentence_transformers_math(tiny_server):
    response = tiny_server.client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    vectors = torch.tensor([item.embedding for item in response.data])
    assert vectors.shape == (3, 384)
    assert [item.index for item in response.data] == [0, 1, 2]
    assert torch.allclose(vectors, reference_embeddings(TEXTS), atol=1e-5)
    assert response.usage.prompt_tokens > 0


def test_embedding_only_server(tmp_path: Path):
    server = start_server(["--model", "minilm"], tmp_path / "minilm.log")
    try:
        models = server.client.models.list()
        assert [m.id for m in models.data] == ["all-MiniLM-L6-v2"]
        single = server.client.embeddings.create(model="all-MiniLM-L6-v2", input="hi")
        expected = reference_embeddings(["hi"])[0]
        assert torch.allclose(torch.tensor(single.data[0].embedding), expected, atol=1e-5)
        chat = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers=server.serving,
        )
        assert chat.status_code == 404
        bad = httpx.post(
            f"{server.base_url}/v1/embeddings", json={"input": [1, 2]}, headers=server.serving
        )
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "input")
    finally:
        stop_server(server)
