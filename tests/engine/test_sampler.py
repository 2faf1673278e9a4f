"""The batched sampler (engine/sampler.py): each rule on many rows at once, against the
distribution it must draw from."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine import sampler
from engine.sampler import TOP_P_CANDIDATES, sample
from engine.sequence import SamplingParams, Sequence

ROWS = 6000  # draws per distribution: a frequency's standard error is at most 0.0065


def seqs_of(count: int, outputs: list[int] | None = None, **params: Any) -> list[Sequence]:
    seqs = []
    for _ in range(count):
        seq = Sequence(token_ids=[1, 2], params=SamplingParams(max_tokens=50, **params))
        seq.token_ids.extend(outputs or [])
        seqs.append(seq)
    return seqs


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return counts / counts.sum()


def assert_close_to(observed: torch.Tensor, expected: torch.Tensor) -> None:
    # five standard errors of a frequency at ROWS draws, at least 0.005
    bound = (5 * (expected * (1 - expected) / ROWS).sqrt()).clamp(min=0.005)
    assert ((observed - expected).abs() <= bound).all(), (observed, expected)


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -3.0])


def test_temperature_draws_from_the_tempered_softmax():
    tokens, logprobs, failed = sample(LOGITS.repeat(ROWS, 1), seqs_of(ROWS, temperature=0.7))
    assert not failed and logprobs == [None] * ROWS
    assert_close_to(frequencies(tokens, 6), torch.softmax(LOGITS.double() / 0.7, dim=0))


def test_top_k_draws_among_the_k_most_likely_in_proportion():
    tokens, _, _ = sample(LOGITS.repeat(ROWS, 1), seqs_of(ROWS, temperature=1.0, top_k=2))
    expected = torch.zeros(6, dtype=torch.double)
    expected[:2] = torch.softmax(LOGITS[:2].double(), dim=0)
    assert_close_to(frequencies(tokens, 6), expected)


def test_top_p_keeps_the_smallest_set_reaching_it():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    # the mass before token 2 is 0.8 >= 0.7: tokens 0 and 1 alone, in proportion 5:3
    tokens, _, _ = sample(probs.log().repeat(ROWS, 1), seqs_of(ROWS, top_p=0.7))
    assert_close_to(frequencies(tokens, 5), torch.tensor([5 / 8, 3 / 8, 0, 0, 0]).double())


def test_top_p_past_the_candidates_sorts_whole_rows():
    """A flat row whose top_p mass spans more tokens than the candidates the fast path
    looks at: the tokens kept are the most likely ones, however many."""
    vocab = 4 * TOP_P_CANDIDATES
    logits = torch.linspace(1.0, 0.0, vocab)  # token 0 most likely, descending
    probs = torch.softmax(logits.double(), dim=0)
    kept = int((probs.cumsum(0) - probs < 0.9).sum())
    assert kept > TOP_P_CANDIDATES
    tokens, _, _ = sample(logits.repeat(2000, 1), seqs_of(2000, top_p=0.9))
    assert max(tokens) < kept
    assert max(tokens) > TOP_P_CANDIDATES  # the tail past the candidates is drawn too


def test_rows_with_different_rules_in_one_batch():
    """Greedy, tempered, top-k and top-p rows side by side: each row by its own rules."""
    logits = LOGITS.repeat(4 * ROWS, 1)
    seqs = [
        *seqs_of(ROWS, temperature=0.0),
        *seqs_of(ROWS, temperature=1.3),
        *seqs_of(ROWS, temperature=1.0, top_k=3),
        *seqs_of(ROWS, temperature=1.0, top_p=0.5),
    ]
    tokens, _, failed = sample(logits, seqs)
    assert not failed
    assert set(tokens[:ROWS]) == {0}
    assert_close_to(
        frequencies(tokens[ROWS : 2 * ROWS], 6), torch.softmax(LOGITS.double() / 1.3, dim=0)
    )
    top3 = torch.zeros(6, dtype=torch.double)
    top3[:3] = torch.softmax(LOGITS[:3].double(), dim=0)
    assert_close_to(frequencies(tokens[2 * ROWS : 3 * ROWS], 6), top3)
    probs = torch.softmax(LOGITS.double(), dim=0)
    keep = (probs.cumsum(0) - probs < 0.5).double()
    assert_close_to(frequencies(tokens[3 * ROWS :], 6), probs * keep / (probs * keep).sum())


def test_penalties_count_each_rows_own_output():
    """Token 0 leads by 1.0; a row that output it twice with frequency penalty 0.6 loses
    1.2 on it, and greedy picks token 1; a row that never output it keeps token 0."""
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    seqs = [
        *seqs_of(1, outputs=[0, 0], temperature=0.0, frequency_penalty=0.6),
        *seqs_of(1, outputs=[2, 2], temperature=0.0, frequency_penalty=0.6),
    ]
    tokens, _, failed = sample(logits, seqs)
    assert tokens == [1, 0] and not failed
    # presence counts once: 1.5 - (0.4 twice would be 0.8) leaves token 0 ahead
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    tokens, _, _ = sample(logits, seqs_of(1, outputs=[0, 0], temperature=0.0, presence_penalty=0.9))
    assert tokens == [0]
    tokens, _, _ = sample(logits, seqs_of(1, outputs=[0], temperature=0.0, presence_penalty=1.1))
    assert tokens == [1]


def test_penalised_sampling_draws_from_the_penalised_softmax():
    logits = LOGITS.repeat(ROWS, 1)
    tokens, _, _ = sample(logits, seqs_of(ROWS, outputs=[0, 0, 1], frequency_penalty=0.5))
    penalised = LOGITS.double().clone()
    penalised[0] -= 1.0
    penalised[1] -= 0.5
    assert_close_to(frequencies(tokens, 6), torch.softmax(penalised, dim=0))


def test_a_seeded_request_draws_the_same_tokens_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)

    def draws(position: int, neighbours: int) -> list[int]:
        seqs = seqs_of(neighbours, temperature=1.0)
        seeded = seqs_of(1, temperature=0.9, top_p=0.95, seed=1234)[0]
        seqs.insert(position, seeded)
        out = []
        for step in range(5):
            rows = logits[step].repeat(len(seqs), 1)
            tokens, _, _ = sample(rows, seqs)
            out.append(tokens[position])
        return out

    alone = draws(0, 0)
    assert draws(3, 7) == alone
    assert draws(1, 2) == alone
    assert len(set(alone)) > 1  # the seed's generator moves on from step to step


def test_a_row_that_is_not_finite_fails_alone():
    logits = LOGITS.repeat(3, 1)
    logits[1] = float("nan")
    tokens, _, failed = sample(logits, seqs_of(3, temperature=0.8))
    assert list(failed) == [1]
    assert "not finite" in failed[1]
    assert 0 <= tokens[0] < 6 and 0 <= tokens[2] < 6


def test_logprobs_are_the_raw_distributions():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    seqs = [*seqs_of(1, temperature=0.0, logprobs=3), *seqs_of(1, temperature=0.0, logprobs=0)]
    tokens, logprobs, _ = sample(logits, seqs)
    assert tokens == [0, 5]
    first, second = logprobs
    assert first is not None and second is not None
    raw = torch.log_softmax(LOGITS, dim=0)
    assert first.token_id == 0 and math.isclose(first.logprob, float(raw[0]), rel_tol=1e-6)
    assert [token for token, _ in first.top] == [0, 1, 2]
    assert [value for _, value in first.top] == pytest.approx(raw[:3].tolist(), rel=1e-6)
    assert second.top == [] and math.isclose(second.logprob, float(raw[0]), rel_tol=1e-6)


def test_a_draw_that_raises_fails_only_the_request_that_broke_it(monkeypatch):
    real_draw = sampler._draw

    def failing_for_seed_13(logits: torch.Tensor, seqs: list[Sequence]):
        if any(seq.params.seed == 13 for seq in seqs):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_draw(logits, seqs)

    monkeypatch.setattr(sampler, "_draw", failing_for_seed_13)
    seqs = [*seqs_of(2, top_k=2), *seqs_of(1, seed=13), *seqs_of(2, top_k=2)]
    tokens, _, failed = sample(LOGITS.repeat(5, 1), seqs)
    assert list(failed) == [2] and "probability tensor" in failed[2]
    assert all(tokens[row] in (0, 1) for row in (0, 1, 3, 4))
