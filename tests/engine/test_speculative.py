"""N-gram speculative decoding (engine/speculative.py): drafts verified in one step over the
paged cache give exactly greedy decoding's tokens, on every way a step runs, and drafts
are chosen by measured costs and acceptance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams, Sequence
from engine.speculative import (
    DraftState,
    NgramIndex,
    StepCosts,
    accepted_tokens,
    choose_drafts,
)


def test_ngram_lookup_continues_the_latest_earlier_occurrence():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    # [2, 3, 4] occurred twice before; the latest is followed by 6, 7
    assert index.propose(tokens, 3) == [6, 7, 2]
    tokens += [6, 7, 8]
    assert index.propose(tokens, 2) == []  # [6, 7, 8] and [7, 8] never occurred before
    tokens += [1, 2]
    assert index.propose(tokens, 4) == [3, 4, 5, 9]  # [8, 1, 2] never; [1, 2] at the start
    assert NgramIndex().propose([5], 4) == []


def test_accepted_tokens_keep_the_greedy_run_and_the_token_after_it():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted_tokens([4, 5, 6], [1, 5, 6, 7]) == [1]


def test_acceptance_follows_recent_verifications_and_recovers_while_idle():
    state = DraftState()
    assert state.acceptance == 0.5
    for _ in range(10):
        state.record(4, 0)
    low = state.acceptance
    assert low < 0.2
    for _ in range(200):
        state.idle()
    assert low < state.acceptance <= 0.5
    for _ in range(10):
        state.record(4, 4)
    assert state.acceptance > 0.9


def test_step_costs_read_measured_counts_and_the_line_between_them():
    costs = StepCosts()
    assert costs.estimate(3, True) == pytest.approx(1.2)  # nothing measured: unit guess
    for _ in range(5):
        costs.record(1, False, 0.010)
    assert costs.estimate(1, False) == pytest.approx(0.010)
    assert costs.estimate(3, True) == pytest.approx(0.012)  # plain, grown 10 % a row
    for rows, seconds in ((2, 0.011), (6, 0.015)):
        for _ in range(5):
            costs.record(rows, True, seconds)
    assert costs.estimate(4, True) == pytest.approx(0.013)  # between 2 and 6
    assert costs.estimate(8, True) == pytest.approx(0.015 * 1.2)
    costs.record(4, True, 0.100)  # one slow reading does not price 4 rows out
    assert costs.estimate(4, True) == pytest.approx(0.013)
    for _ in range(4):
        costs.record(4, True, 0.013)
    assert costs.estimate(4, True) == pytest.approx((0.100 + 4 * 0.013) / 5)
    for _ in range(5):
        costs.record(4, True, 0.013)
    mean = (0.100 + 9 * 0.013) / 10  # a running mean over the first ten steps
    assert costs.estimate(4, True) == pytest.approx(mean)
    costs.record(4, True, 0.023)  # then a moving average
    assert costs.estimate(4, True) == pytest.approx(mean + 0.1 * (0.023 - mean))


def decoding(tokens: list[int], max_tokens: int = 64, **params: object) -> Sequence:
    """A request whose last token (of `tokens`) is its first output: decoding."""
    seq = Sequence(
        token_ids=list(tokens[:-1]),
        params=SamplingParams(max_tokens=max_tokens, temperature=0, **params),  # type: ignore[arg-type]
    )
    seq.token_ids.append(tokens[-1])
    return seq


def test_drafts_follow_measured_costs():
    quoting = decoding([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    cheap = StepCosts()
    for rows in range(1, 10):
        for _ in range(5):
            cheap.record(rows, rows > 1, 0.010 + 0.0001 * rows)
    assert choose_drafts([quoting], cheap, 8, 1024, 64) > 0
    assert quoting.draft_token_ids == [4, 5, 6, 7, 8, 1, 2, 3][: len(quoting.draft_token_ids)]

    dear = StepCosts()  # each row costs as much as a whole step: no draft can pay
    for rows in range(1, 10):
        for _ in range(5):
            dear.record(rows, rows > 1, 0.010 * rows)
    other = decoding([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    assert choose_drafts([other], dear, 8, 1024, 64) == 0
    assert other.draft_token_ids == []


def test_drafts_respect_limits_and_sampling():
    costs = StepCosts()
    for _ in range(5):
        costs.record(1, False, 0.010)
    near_end = decoding([1, 2, 3, 4, 5, 6, 1, 2, 3], max_tokens=3)
    choose_drafts([near_end], costs, 8, 1024, 64)
    assert len(near_end.draft_token_ids) <= 1  # one output so far, max_tokens 3
    sampled = Sequence(
        token_ids=[1, 2, 3, 4, 1, 2], params=SamplingParams(max_tokens=9, temperature=0.8)
    )
    sampled.token_ids.append(3)
    with_logprobs = decoding([1, 2, 3, 4, 1, 2, 3], logprobs=2)
    assert choose_drafts([sampled, with_logprobs], costs, 8, 1024, 64) == 0


# prompts that repeat (drafts often right), and one that does not
PROMPTS = [
    [(3 * i) % 40 + 5 for i in range(60)],
    [11, 12, 13, 14, 15, 16] * 6 + [11, 12],
    [(7 * i * i + 3) % 300 + 5 for i in range(25)],
]


class CheapRows(StepCosts):
    """Step costs where a row costs 1 % of a step: drafts always pay."""

    def record(self, rows: int, drafted: bool, seconds: float) -> None:
        pass

    def estimate(self, rows: int, drafted: bool) -> float:
        return 1 + 0.01 * rows


def new_engine(
    folder: Path, dtype: str, speculative: str, step_kernel: bool, device: str = "cpu"
) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), dtype=dtype, max_model_len=256, num_blocks=96,
            speculative=speculative, num_speculative_tokens=5, device=device,
        )
    )  # fmt: skip
    engine.load()
    if device == "cuda":
        engine.warm_up()  # captures the decode graphs, where drafts are rows too
    if not step_kernel:
        engine.runner.model.step_kernel = None
        engine.runner.model.step_max_rows = 0
    return engine


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of the prompts, all in flight at once."""
    seqs = []
    for prompt in prompts:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        seqs.append(Sequence(token_ids=list(prompt), params=params))
        engine.scheduler.add(seqs[-1])
    while not all(seq.is_finished for seq in seqs):
        engine._step()
    for seq in seqs:
        engine.block_manager.free(seq)
    return [seq.output_token_ids for seq in seqs]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# float32: every step in PyTorch ops, drafts as chunks after their context; bf16 with the
# step kernel (drafts as rows of their own) and without it (the kernel's attention table);
# on CUDA, rows of CUDA graphs
@pytest.mark.parametrize(
    "model, dtype, step_kernel, device",
    [("tiny_llama", "float32", True, "cpu"), ("tiny_llama_dim32", "bfloat16", True, "cpu"),
     ("tiny_llama_dim32", "bfloat16", False, "cpu"),
     pytest.param("tiny_llama", "bfloat16", False, "cuda", marks=CUDA),
     pytest.param("tiny_llama", "float32", False, "cuda", marks=CUDA)],
)  # fmt: skip
def test_verified_drafts_give_greedy_decodings_tokens(
    model: str, dtype: str, step_kernel: bool, device: str, request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
):  # fmt: skip
    """Drafts from greedy decoding's own output, often one of them wrong: the output is the
    same, drafts are accepted up to the wrong one."""
    folder = request.getfixturevalue(model)
    plain = new_engine(folder, dtype, "off", step_kernel, device)
    expected = generate(plain, PROMPTS, 40)
    alone = generate(plain, PROMPTS[2:], 24)[0]
    assert plain.speculative_stats()["drafts"] == 0
    texts = {tuple(p): p + out for p, out in zip(PROMPTS, expected, strict=True)}

    def oracle(self: NgramIndex, tokens: list[int], limit: int) -> list[int]:
        full = next(t for p, t in texts.items() if tokens[: len(p)] == list(p))
        drafts = full[len(tokens) : len(tokens) + limit]
        # the first or the second wrong: a step kernel of 4 rows (no avx512_bf16) gives
        # three requests one draft between them
        wrong = {0: 0, 1: 1}.get(len(tokens) % 3)
        if wrong is not None and wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 500
        return drafts

    monkeypatch.setattr(NgramIndex, "propose", oracle)
    engine = new_engine(folder, dtype, "auto", step_kernel, device)
    engine.step_costs = CheapRows()
    assert generate(engine, PROMPTS, 40) == expected
    stats = engine.speculative_stats()
    assert stats["drafts"] > 0 and 0 < stats["accepted_tokens"] < stats["draft_tokens"], stats
    texts[tuple(PROMPTS[2])] = PROMPTS[2] + alone
    assert generate(engine, PROMPTS[2:], 24)[0] == alone


def test_ngram_drafts_in_the_engine_keep_greedy_output(tiny_llama: Path):
    """The n-gram proposer itself, on a model whose greedy output repeats."""
    plain = generate(new_engine(tiny_llama, "float32", "off", True), PROMPTS[:2], 40)
    engine = new_engine(tiny_llama, "float32", "auto", True)
    engine.step_costs = CheapRows()
    assert generate(engine, PROMPTS[:2], 40) == plain
    stats = engine.speculative_stats()
    assert stats["accepted_tokens"] > 0, stats
    assert sum(engine.step_counts.values()) < 2 * 40


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 0.25)])
def test_drafts_in_a_padded_decode_step_give_the_chunks_logits(
    tiny_llama: Path, dtype: str, tolerance: float
):
    """CUDA graphs replay decode_padded: there a request's drafts are rows of their own.
    Run op by op here (no capture on CPU), it gives the logits of the same drafts run as
    chunks after their context (bf16: the tolerance of tests/engine/test_cuda_graphs.py)."""
    engine = new_engine(tiny_llama, dtype, "off", False)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.cache, 16, max_blocks=8)
    seqs = []
    for prompt, drafts in zip(PROMPTS, ([7, 8, 9], [], [13, 14, 15, 16, 17]), strict=True):
        seq = Sequence(token_ids=list(prompt), params=SamplingParams(temperature=0))
        engine.scheduler.add(seq)
        seqs.append((seq, drafts))
    while any(seq.num_output_tokens == 0 for seq, _ in seqs):
        engine._step()  # prefill: every request decodes from here
    for seq, drafts in seqs:
        seq.draft_token_ids = list(drafts)
    batch = engine.scheduler.schedule()
    assert runner.decode_only(batch) and batch.num_tokens == 3 + 8
    chunks, order = runner._run_layers(batch)
    padded = graphs.run(order)
    assert padded.shape == chunks.logits.shape == (11, engine.model_config.vocab_size)
    assert (padded - chunks.logits).abs().max() < tolerance
