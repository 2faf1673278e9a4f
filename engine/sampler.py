"""Turn a step's logits into one token per sequence, following each request's parameters.

Every rule runs on the whole batch at once, on the logits' device: greedy rows share one
argmax; the rows that sample share penalties, temperature, top-k, top-p and the draw, a
handful of batched ops whatever their number (a row at a time, 64 sampled rows of a 49k
vocabulary took 25 ms on a CPU; on a GPU each row paid kernel launches and a host sync).
The values come back to the host in one copy per kind.

The draw inverts each row's cumulative distribution at one uniform number (what
torch.multinomial does for a single sample), batched: one random number a row, not one a
token as the exponential race needs (on a CPU, exponentials for 8 rows of a 49k
vocabulary took longer than the rest of sampling). A request with a seed draws its
number from its own generator, so its tokens do not depend on the batch it runs in.
"""

from __future__ import annotations

import functools

import torch

from engine.models import decode_attention
from engine.sequence import Sequence, TokenLogprob

TOP_P_CANDIDATES = 256


@functools.cache
def _argmax_kernel() -> decode_attention.ArgmaxKernel | None:
    return decode_attention.load_argmax()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum: the C kernel on CPU fp32 logits, else max's indices (the
    same first maximum as argmax, about 2.5x faster on CPU)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        kernel = _argmax_kernel()
        if kernel is not None:
            return kernel(logits)
    return logits.max(dim=-1).indices.tolist()


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI semantics, each row by its request's output so far: minus frequency *
    count, minus presence where the count is positive. logits: [rows, vocab], a copy."""
    counts = torch.zeros_like(logits)
    rows = [row for row, seq in enumerate(seqs) for _ in seq.output_token_ids]
    if rows:
        tokens = [token for seq in seqs for token in seq.output_token_ids]
        index = (
            torch.tensor(rows, device=logits.device),
            torch.tensor(tokens, device=logits.device),
        )
        counts.index_put_(
            index, torch.ones(len(rows), dtype=logits.dtype, device=logits.device), accumulate=True
        )
    frequency = _column([seq.params.frequency_penalty for seq in seqs], logits)
    presence = _column([seq.params.presence_penalty for seq in seqs], logits)
    return logits - frequency * counts - presence * (counts > 0)


def _cut_top_k(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Logits below each row's k-th largest to -inf (ties with it stay); rows without a
    cut keep everything."""
    vocab = logits.shape[1]
    ks = [seq.params.top_k if 0 < seq.params.top_k < vocab else vocab for seq in seqs]
    widest = max(ks)
    if widest == vocab and min(ks) == vocab:
        return logits
    top = torch.topk(logits, widest, dim=-1).values  # [rows, widest], descending
    kth = top.gather(1, torch.tensor(ks, device=logits.device)[:, None].clamp(max=widest) - 1)
    kth = torch.where(_column([float(k < vocab) for k in ks], logits) > 0, kth, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _cut_top_p(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Probabilities outside each row's smallest set whose mass reaches top_p to 0 (the most
    likely token always stays); rows with top_p 1 keep everything."""
    top_p = [seq.params.top_p for seq in seqs]
    if min(top_p) >= 1.0:
        return probs
    limit = _column([p if p < 1.0 else float("inf") for p in top_p], probs)
    # Where each row's TOP_P_CANDIDATES most likely tokens already hold top_p, every other
    # token is cut, and sorting those few is enough (a full sort of a 49k vocabulary cost
    # a CPU more than the rest of sampling); else the whole rows are sorted.
    sorted_probs, order = probs.topk(min(TOP_P_CANDIDATES, probs.shape[1]), dim=-1)
    if not bool((sorted_probs.sum(dim=-1, keepdim=True) >= limit).all()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
    # a token goes where the mass before it already reaches top_p; top_p 1 never cuts
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= limit
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))


def _uniforms(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """U ~ [0, 1) per row, [rows, 1]: a seeded request's from its own generator, the rest
    from the global one, made on the host (where generators live) in one tensor."""
    values = torch.rand(len(seqs))
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            values[row] = torch.rand(1, generator=seq.generator)[0]
    return values.to(device)[:, None]


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens drawn for rows that sample, and whether each row's probabilities were finite
    (a row that is not gets no token: its request fails alone)."""
    temperature = _column([seq.params.temperature for seq in seqs], logits)
    logits = _cut_top_k(logits / temperature, seqs)
    probs = torch.softmax(logits, dim=-1)
    finite = torch.isfinite(probs).all(dim=-1)
    probs = _cut_top_p(torch.nan_to_num(probs, nan=0.0), seqs)
    # inverse CDF: the first token whose running mass passes U times the row's mass
    cdf = probs.cumsum(dim=-1)
    targets = _uniforms(seqs, probs.device) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets, right=True)[:, 0]
    return tokens.clamp(max=probs.shape[1] - 1), finite


def _draw_each(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | str]:
    """Each row's token, or why it has none. Should the batch's draw raise, each row draws
    alone, so that only the request whose rules broke it fails."""
    try:
        drawn, finite = _draw(logits, seqs)
    except Exception as error:
        if len(seqs) == 1:
            return [str(error)]
        return [
            outcome
            for row, seq in enumerate(seqs)
            for outcome in _draw_each(logits[row : row + 1], [seq])
        ]
    return [
        token if ok else "the logits are not finite"
        for token, ok in zip(drawn.tolist(), finite.tolist(), strict=True)
    ]


def _logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int], rows: list[int]
) -> list[TokenLogprob]:
    """The chosen token's logprob and the top alternatives, from the raw logits (before
    penalties and temperature), for these rows; one copy to the host."""
    index = torch.tensor(rows, device=logits.device)
    raw = torch.log_softmax(logits.index_select(0, index), dim=-1)
    counts = [seqs[row].params.logprobs or 0 for row in rows]
    chosen = raw.gather(1, torch.tensor([tokens[row] for row in rows], device=raw.device)[:, None])
    top_values, top_ids = torch.topk(raw, max(counts), dim=-1)
    chosen_list = chosen[:, 0].tolist()
    values, ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(
            token_id=tokens[row],
            logprob=chosen_list[i],
            top=list(zip(ids[i][:count], values[i][:count], strict=True)),
        )
        for i, (row, count) in enumerate(zip(rows, counts, strict=True))
    ]


def sample(
    logits: torch.Tensor, seqs: list[Sequence], greedy: list[int] | None = None
) -> tuple[list[int], list[TokenLogprob | None], dict[int, str]]:
    """logits: [len(seqs), vocab] fp32; greedy: each row's first maximum where the step
    already found it (the list is reused). Returns token ids, (when asked) their logprobs,
    and the rows whose sampling failed, with why: those requests end alone, with an
    error, and the rest of the batch goes on."""
    special = [
        row for row, seq in enumerate(seqs) if seq.params.has_penalties or not seq.params.is_greedy
    ]
    if greedy is not None:
        tokens = greedy
    elif len(special) == len(seqs):
        tokens = [0] * len(seqs)  # every row is replaced below
    else:
        tokens = greedy_tokens(logits)
    failed: dict[int, str] = {}
    if special:
        rows = logits.index_select(0, torch.tensor(special, device=logits.device))
        special_seqs = [seqs[row] for row in special]
        if any(seq.params.has_penalties for seq in special_seqs):
            rows = apply_penalties(rows, special_seqs)
        greedy_rows = [i for i, seq in enumerate(special_seqs) if seq.params.is_greedy]
        if greedy_rows:  # greedy with penalties: the penalised maximum
            index = torch.tensor(greedy_rows, device=rows.device)
            maxima = rows.index_select(0, index).argmax(dim=-1).tolist()
            for i, token in zip(greedy_rows, maxima, strict=True):
                tokens[special[i]] = token
        drawing = [i for i, seq in enumerate(special_seqs) if not seq.params.is_greedy]
        if drawing:
            if len(drawing) < len(special):
                rows = rows.index_select(0, torch.tensor(drawing, device=rows.device))
            outcomes = _draw_each(rows, [special_seqs[i] for i in drawing])
            for i, outcome in zip(drawing, outcomes, strict=True):
                if isinstance(outcome, int):
                    tokens[special[i]] = outcome
                else:
                    failed[special[i]] = f"sampling failed: {outcome}"
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    wanting = [
        row for row, seq in enumerate(seqs) if seq.params.logprobs is not None and row not in failed
    ]
    if wanting:
        for row, logprob in zip(wanting, _logprobs(logits, seqs, tokens, wanting), strict=True):
            logprobs[row] = logprob
    return tokens, logprobs, failed
