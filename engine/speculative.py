"""Speculative decoding by n-gram prompt lookup (vLLM's `ngram` method).

Where a request's text repeats its prompt or itself (quoting, summaries, code edits), the
tokens that followed the latest earlier occurrence of its last n tokens are a good guess of
what comes next. Those guesses (drafts) go into the next step after the request's last
token, at the next positions of the same block table: one forward pass computes the logits
at the last token and at every draft. The engine keeps the longest run of drafts that
greedy decoding picks itself, and the model's own token after it (`accepted_tokens`), so
the output is plain greedy decoding's and a step yields one to k + 1 tokens.

Drafts cost rows in the step, and whether they pay depends on the machine (what a decode
step of more rows costs) and on the text (how often drafts are right). Both are measured
while serving:
- each request keeps the chance that a draft token is accepted, from decayed counts (the
  i-th draft survives with about p^i);
- the engine keeps the seconds of decode steps by rows, plain and with drafts (`StepCosts`);
- a step carries the drafts that maximise expected tokens per second (`choose_drafts`):
  none at all where rows cost more than drafts are worth (large batches, chat that never
  repeats), so speculation switches itself off where it would be slower.

Only greedy requests without penalties or logprobs draft: their next token depends on the
logits alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence

MIN_NGRAM, MAX_NGRAM = 2, 4
# A request's acceptance estimate: Laplace's prior, counts decayed at every verification
# (it follows about the last ten) and, more slowly, at every step it could draft and did not,
# so a request whose drafts failed probes again once its text may have changed.
VERIFY_DECAY = 0.9
IDLE_DECAY = 0.98
# Before a step of that many rows has been timed: each row adds this share of the nearest
# timed step's seconds (about what a memory-bound decode step pays, pessimistic on CPUs).
PRIOR_ROW_COST = 0.1
COST_SMOOTHING = 0.1  # weight of a new step's seconds in the moving average
MIN_SAMPLES = 5  # steps of a row count before its own average is read


class NgramIndex:
    """Where each n-gram (MIN_NGRAM..MAX_NGRAM tokens) of a sequence last ended, kept up to
    date as tokens are appended: a lookup is a few dict reads, not a scan of the text."""

    __slots__ = ("ends", "indexed")

    def __init__(self) -> None:
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        suffix (MAX_NGRAM down to MIN_NGRAM tokens) seen before; [] if none was."""
        # n-grams that end before the last token: each has a token after it
        stop = len(tokens)
        for end in range(max(self.indexed, MIN_NGRAM), stop):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self.ends[n][tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, stop)
        for n in range(min(MAX_NGRAM, stop), MIN_NGRAM - 1, -1):
            found = self.ends[n].get(tuple(tokens[stop - n :]))
            if found is not None and found < stop:
                return tokens[found : found + limit]
        return []


@dataclass(slots=True)
class DraftState:
    """A request's n-gram index and its acceptance counts."""

    index: NgramIndex = field(default_factory=NgramIndex)
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def acceptance(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * VERIFY_DECAY + accepted
        self.rejected = self.rejected * VERIFY_DECAY + (1 if accepted < drafted else 0)

    def idle(self) -> None:
        self.accepted *= IDLE_DECAY
        self.rejected *= IDLE_DECAY


class StepCosts:
    """Decode steps' seconds by rows, plain and with drafts: a running mean over a row
    count's first steps, then a moving average. A count with fewer than MIN_SAMPLES steps
    is read off the line through its neighbours with enough: one slow first reading (a
    step that met another process) would otherwise price a row count out for good, since
    a count the policy avoids is never measured again."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, bool], float] = {}
        self.counts: dict[tuple[int, bool], int] = {}
        # _points by kind until the next record: a step's choice reads many estimates
        self._points_cache: dict[bool, list[tuple[int, float]]] = {}

    def record(self, rows: int, drafted: bool, seconds: float) -> None:
        self._points_cache.clear()
        key = (rows, drafted)
        count = self.counts.get(key, 0) + 1
        self.counts[key] = count
        old = self.seconds.get(key, seconds)
        self.seconds[key] = old + max(1 / count, COST_SMOOTHING) * (seconds - old)

    def _points(self, drafted: bool) -> list[tuple[int, float]]:
        points = self._points_cache.get(drafted)
        if points is None:
            points = self._points_cache[drafted] = sorted(
                (rows, value)
                for (rows, kind), value in self.seconds.items()
                if kind is drafted and self.counts[(rows, kind)] >= MIN_SAMPLES
            )
        return points

    def estimate(self, rows: int, drafted: bool) -> float:
        """Seconds of a step of `rows` rows: measured; else between the nearest row counts
        measured (with drafts if any was, else plain); else grown from the nearest below by
        PRIOR_ROW_COST a row; else a unit guess."""
        for kind in (drafted, False) if drafted else (False,):
            points = self._points(kind)
            for index, (measured, value) in enumerate(points):
                if measured == rows:
                    return value
                if measured > rows and index > 0:
                    (low, low_value), (high, high_value) = points[index - 1], points[index]
                    return low_value + (high_value - low_value) * (rows - low) / (high - low)
                if measured > rows:
                    break
            below = [(r, v) for r, v in points if r < rows]
            if below:
                nearest, base = below[-1]
                return base * (1 + PRIOR_ROW_COST * (rows - nearest))
        return 1 + PRIOR_ROW_COST * (rows - 1)


def eligible(seq: Sequence) -> bool:
    params = seq.params
    return params.is_greedy and not params.has_penalties and params.logprobs is None


def draft_limit(seq: Sequence, max_draft: int, max_model_len: int) -> int:
    """Drafts this request can use: each accepted one and the token after it must fit
    max_tokens and the context."""
    left_tokens = seq.params.max_tokens - seq.num_output_tokens - 1
    left_context = max_model_len - len(seq) - 1
    return max(0, min(max_draft, left_tokens, left_context))


def choose_drafts(
    seqs: list[Sequence], costs: StepCosts, max_draft: int, max_model_len: int, max_rows: int
) -> int:
    """Set `draft_token_ids` on the running decode requests for the next step: the drafts
    that maximise expected tokens per second, by each request's acceptance and the step
    costs measured. Returns how many drafts were set."""
    rows = len(seqs)
    plain = costs.estimate(rows, False)
    # even a draft sure to be accepted must beat the cost of its row
    if rows >= max_rows or costs.estimate(rows + 1, True) - plain >= plain / rows:
        return 0
    candidates: list[tuple[float, int, Sequence, list[int]]] = []
    for order, seq in enumerate(seqs):
        if not eligible(seq):
            continue
        limit = draft_limit(seq, max_draft, max_model_len)
        if limit <= 0:
            continue
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = DraftState()
        proposal = state.index.propose(seq.token_ids, limit)
        if not proposal:
            continue
        p = state.acceptance
        # the i-th draft's chance to be kept: p^i; each request's drafts in order
        candidates.extend((p ** (i + 1), order, seq, proposal) for i in range(len(proposal)))
    if not candidates:
        return 0
    candidates.sort(key=lambda c: -c[0])  # stable within a request: p^i falls with i
    best_count, best_rate, expected = 0, rows / plain, float(rows)
    for count, (value, *_rest) in enumerate(candidates[: max_rows - rows], start=1):
        expected += value
        rate = expected / costs.estimate(rows + count, True)
        if rate > best_rate:
            best_count, best_rate = count, rate
    taken: dict[int, int] = {}
    for _value, order, _seq, _proposal in candidates[:best_count]:
        taken[order] = taken.get(order, 0) + 1
    proposals = {order: (seq, proposal) for _value, order, seq, proposal in candidates}
    for order, (seq, proposal) in proposals.items():
        if order in taken:
            seq.draft_token_ids = proposal[: taken[order]]
        elif seq.draft_state is not None:
            seq.draft_state.idle()
    return best_count


def accepted_tokens(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens greedy decoding gives: drafts while each is the model's own pick at the
    position before it, then the model's pick after the last kept draft.
    targets: the greedy token at the last token and at each draft (len(drafts) + 1)."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return [*drafts[:kept], targets[kept]]
