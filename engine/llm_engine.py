"""The engine: loads the model and runs the step loop in its own thread.

Step loop (one iteration per forward pass):
  1. take requests submitted and aborted since the last step (under a lock);
  2. schedule: running sequences first, then admit waiting ones, within the token budget;
  3. one forward pass over every scheduled token, sample for sequences that finished
     their pending tokens;
  4. append tokens, detokenize, check stop conditions, deliver outputs, free finished
     sequences' blocks;
  5. sleep on a condition variable when nothing is waiting or running (no CPU while idle).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, LlamaConfig, validate_faults
from engine.loader import load_checkpoint, resolve_model_path
from engine.metrics import EngineMetrics
from engine.model_runner import ModelRunner, attention_backend_for
from engine.models.layers import Linear, cpu_has_native_bf16
from engine.models.llama import KVCache, LlamaModel, StepLogits
from engine.models.paged_attention import self_check
from engine.sampler import greedy_tokens, sample
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, TokenLogprob
from engine.speculative import StepCosts, accepted_tokens, choose_drafts
from engine.tokenizer import TextTokenizer

logger = logging.getLogger("engine")


class QueueFullError(Exception):
    pass


class EngineFailedError(Exception):
    """The step loop failed in the shared forward pass; the engine serves nothing more."""


@dataclass(slots=True)
class RequestOutput:
    """What a request gained in one step (deltas), delivered to its sink."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


Sink = Callable[[RequestOutput], None]


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's malloc_trim), where there is
    such a call. Loading frees the checkpoint's fp32 tensors and the plain copies of the
    matrices (Linear.release_plain), but glibc keeps freed heap pages mapped: without this
    a bf16 SmolLM2 engine kept about 300 MB it no longer used (1.59 GB against 1.28 GB)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return False
    if trim is None:
        return False
    gc.collect()
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def compute_dtype_for(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "float32":
        return torch.float32
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    # CPUs without native bf16 dot products multiply bf16 several times slower than
    # fp32: batched rows use an fp32 copy of the weights (models/layers.py).
    return torch.float32


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.state = "loading"
        self.device = torch.device(config.device) if config.device else pick_device()
        self.attention_backend = ""  # "triton" or "torch", once loaded
        self.metrics = EngineMetrics(config.served_model_name)
        self.fault_latency_ms = config.fault_latency_ms
        self.fault_error_rate = config.fault_error_rate
        self._condition = threading.Condition()
        self._submitted: list[Sequence] = []
        self._aborted: list[str] = []
        self._requests: dict[str, Sequence] = {}
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # steps and their seconds (forward pass and sampling) by the way they ran
        # (ModelRunner.last_path), in stats: where a serving run's time goes
        self.step_counts: dict[str, int] = {}
        self.step_seconds: dict[str, float] = {}
        # seconds of every step by phase, on the step thread (the device's work lands in
        # "forward" where it waits, else in "sample", which reads the logits)
        self.phase_seconds = dict.fromkeys(("schedule", "forward", "sample", "append"), 0.0)
        # speculative decoding (engine/speculative.py): decode steps' seconds by rows, and
        # verifications, draft tokens and accepted drafts
        self.step_costs = StepCosts()
        self.spec_counts = dict.fromkeys(("drafts", "draft_tokens", "accepted_tokens"), 0)

    # ---- loading -------------------------------------------------------------------
    def load(self) -> None:
        config = self.config
        path = resolve_model_path(config.model)
        started = time.monotonic()
        checkpoint = load_checkpoint(path)
        self.model_config: LlamaConfig = checkpoint.config
        self.tokenizer = TextTokenizer(checkpoint.tokenizer_source)
        self.eos_token_ids = frozenset(config.eos_token_ids or self.tokenizer.eos_token_ids)
        model_limit = self.model_config.max_position_embeddings
        if config.max_model_len == 0:
            config.max_model_len = min(4096, model_limit)
        elif config.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's context "
                f"length ({model_limit})"
            )
        self.metrics.set_max_model_len(config.max_model_len)
        self.compute_dtype = compute_dtype_for(config.dtype, self.device)
        cache_dtype = torch.float32 if config.dtype == "float32" else torch.bfloat16
        if self.device.type == "cuda":
            cache_dtype = self.compute_dtype
        shape = self.model_config
        # before the model is built: an explicit triton that cannot run fails at once
        self.attention_backend = attention_backend_for(
            config.attention_backend,
            self.device,
            lambda: self_check(
                self.device,
                cache_dtype,
                shape.num_kv_heads,
                shape.num_heads // shape.num_kv_heads,
                shape.head_dim,
                config.block_size,
            ),
        )
        if not config.num_blocks:
            per_block = KVCache.bytes_per_token(self.model_config, cache_dtype) * config.block_size
            config.num_blocks = max(1, config.kv_cache_memory_mb * 2**20 // per_block)
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        usable = (config.num_blocks - self.block_manager.watermark_blocks) * config.block_size
        if usable < config.max_model_len:
            raise ValueError(
                f"KV cache holds {usable} tokens ({config.num_blocks} blocks of "
                f"{config.block_size}), fewer than max_model_len ({config.max_model_len}); "
                "raise --num-blocks / --kv-cache-memory-mb or lower --max-model-len"
            )
        model = LlamaModel(
            self.model_config, checkpoint.weights, config.dtype, self.device, self.compute_dtype
        )
        graph_blocks = 0 if config.enforce_eager else -(-config.max_model_len // config.block_size)
        self.runner = ModelRunner(
            model,
            self.model_config,
            config.num_blocks,
            config.block_size,
            cache_dtype,
            self.device,
            graph_blocks,
            self.attention_backend,
            config.max_num_batched_tokens,
            config.max_num_seqs,
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        # the matrices in their storage dtype (not the extra copies kernels read)
        self.weight_bytes = sum(m.storage_bytes for m in model.modules() if isinstance(m, Linear))
        del checkpoint
        return_freed_memory()
        logger.info(
            "loaded %s (%s, %s on %s, %s attention) in %.1fs: %d KV blocks of %d tokens",
            path.name, config.dtype, self.compute_dtype, self.device, self.attention_backend,
            time.monotonic() - started, config.num_blocks, config.block_size,
        )  # fmt: skip

    def warm_up(self) -> None:
        """Short generations outside the request path, so the first requests are not slow:
        a prompt of a block and a few tokens, then, while it decodes, a second prompt that
        shares its first block, so that a mixed step with a decode row and a chunk after
        cached context runs too (on CUDA each kernel loads at its first use; an H200 took
        0.69 s for a first step of 512 prompt tokens before this)."""
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        size = self.config.block_size
        words = self.tokenizer.encode("Hello, warm up the kernels. ") or [0]
        prompt = (words * (size // len(words) + 2))[: size + 4]
        # the second prompt (two blocks) fits unless max_model_len is tiny
        both = 2 * size + params.max_tokens <= self.config.max_model_len
        seqs = [Sequence(token_ids=prompt if both else prompt[:4], params=params)]
        self.scheduler.add(seqs[0])
        self._step(record=False)
        if both:
            seqs.append(Sequence(token_ids=prompt[:size] + prompt[-size:], params=params))
            self.scheduler.add(seqs[1])
        while not all(seq.is_finished for seq in seqs):
            self._step(record=False)
        for seq in seqs:
            self.block_manager.free(seq)
        # the prefix cache counters (stats) count requests only, as the metrics do
        self.block_manager.prefix_cache_queries = self.block_manager.prefix_cache_hits = 0
        if self.runner.graphs is not None:
            why_not = self.runner.capture_graphs()
            if why_not is not None:
                logger.warning("%s", why_not)

    def start(self) -> None:
        self.state = "ready"
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- requests (any thread) -----------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, sink: Sink
    ) -> Sequence:
        seq = Sequence(token_ids=list(prompt_token_ids), params=params, request_id=request_id)
        seq.sink = sink
        with self._condition:
            if self.state == "failed":
                raise EngineFailedError(f"the engine failed: {self.error}")
            waiting = len(self._submitted) + len(self.scheduler.waiting)
            if waiting >= self.config.max_queue:
                raise QueueFullError(f"queue is full ({self.config.max_queue} waiting requests)")
            self._requests[request_id] = seq
            self._submitted.append(seq)
            self._condition.notify()
        return seq

    def abort(self, request_id: str) -> None:
        with self._condition:
            if request_id in self._requests:
                self._aborted.append(request_id)
                self._condition.notify()

    def set_faults(self, latency_ms_per_token: float, error_rate: float) -> None:
        validate_faults(latency_ms_per_token, error_rate)
        self.fault_latency_ms = latency_ms_per_token
        self.fault_error_rate = error_rate

    # ---- the step loop (engine thread) ---------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.config.threads:
            # OpenMP keeps the team size per thread; set it where the matmuls run.
            torch.set_num_threads(self.config.threads)
        while True:
            with self._condition:
                while not (self._submitted or self._aborted or self.scheduler.has_work):
                    if self._stopped:
                        return
                    self._condition.wait()  # idle: blocked, no CPU used
                if self._stopped:
                    return
                submitted, self._submitted = self._submitted, []
                aborted, self._aborted = self._aborted, []
            for seq in submitted:
                self.scheduler.add(seq)
            for request_id in aborted:
                aborted_seq = self._requests.get(request_id)
                if aborted_seq is not None and not aborted_seq.is_finished:
                    self._finish(aborted_seq, "abort")
            if self.scheduler.has_work:
                try:
                    self._step()
                except Exception as error:
                    # Requests' own failures end them alone (_step); this is the shared
                    # forward pass (a device error, a bug): its state is unknown, so the
                    # engine stops serving and says so in /health, for the agent.
                    logger.exception("engine step failed; the engine is now failed")
                    with self._condition:
                        self.error = error
                        self.state = "failed"
                        pending, self._submitted = self._submitted, []
                    for seq in [*self.scheduler.running, *self.scheduler.waiting, *pending]:
                        self._finish(seq, "error", message=f"the engine failed: {error}")

    def _step(self, record: bool = True) -> None:
        clock = time.perf_counter
        started = clock()
        queries = self.block_manager.prefix_cache_queries
        hits = self.block_manager.prefix_cache_hits
        self._propose_drafts()
        batch = self.scheduler.schedule()  # admission looks up the prefix cache
        if batch.num_preempted and record:
            self.metrics.labels(self.metrics.preemptions).inc(batch.num_preempted)
        if not batch.seqs:
            return
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        scheduled = clock()
        output, sampling = self.runner.run(batch)
        forwarded = clock()
        decode_only = self.runner.last_decode_only
        tokens, logprobs, failed = self._sample(output, sampling)  # waits for the device
        sampled = clock()
        path = self.runner.last_path
        self.step_counts[path] = self.step_counts.get(path, 0) + 1
        self.step_seconds[path] = self.step_seconds.get(path, 0.0) + sampled - scheduled
        if decode_only and record:
            drafted = batch.num_tokens > len(batch.seqs)
            self.step_costs.record(batch.num_tokens, drafted, sampled - scheduled)
        prompt_tokens = 0
        for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
            count -= len(seq.draft_token_ids)  # drafts count once accepted (below)
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_tokens += min(count, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += count
            self.block_manager.register_computed(seq)
        now = time.monotonic()
        generated = 0
        for index, (seq, new, logprob) in enumerate(zip(sampling, tokens, logprobs, strict=True)):
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            if index in failed:
                logger.warning("request %s failed: %s", seq.request_id, failed[index])
                self._finish(seq, "error", message=failed[index])
                continue
            if drafts:
                self._record_verification(seq, len(drafts), len(new) - 1, record)
            try:
                generated += self._append_tokens(seq, new, logprob, now)
            except Exception as error:  # detokenizing or a stop check: this request alone
                logger.exception("request %s failed after its token", seq.request_id)
                if not seq.is_finished:
                    self._finish(seq, "error", message=f"post-processing failed: {error}")
                continue
            if len(new) > 1 and not seq.is_finished:
                # the accepted drafts' K/V, written in this step, is the cache's now
                seq.num_computed_tokens += len(new) - 1
                self.block_manager.register_computed(seq)
        if record:
            metrics = self.metrics
            metrics.count_tokens(prompt_tokens, generated)
            if self.block_manager.prefix_cache_queries != queries:
                metrics.labels(metrics.prefix_queries).inc(
                    self.block_manager.prefix_cache_queries - queries
                )
            if self.block_manager.prefix_cache_hits != hits:
                metrics.labels(metrics.prefix_hits).inc(self.block_manager.prefix_cache_hits - hits)
            metrics.labels(metrics.running).set(len(self.scheduler.running))
            metrics.labels(metrics.waiting).set(len(self.scheduler.waiting))
            metrics.labels(metrics.kv_usage).set(self.block_manager.usage)
        phases = self.phase_seconds
        phases["schedule"] += scheduled - started
        phases["forward"] += forwarded - scheduled
        phases["sample"] += sampled - forwarded
        phases["append"] += clock() - sampled
        if self.fault_latency_ms > 0 and sampling:
            # Every running request gets one token per step, so this is per token for each.
            time.sleep(self.fault_latency_ms / 1000.0)

    def _propose_drafts(self) -> None:
        """Drafts for the next step where speculation is on, every running request decodes
        and none waits (the step costs measured are decode-only steps'). A request the
        last step's budget left out loses the drafts it had then."""
        running = self.scheduler.running
        for seq in running:
            seq.draft_token_ids.clear()
        if self.config.speculative == "off" or not running or self.scheduler.waiting:
            return
        if any(seq.num_uncomputed_tokens != 1 for seq in running):
            return
        rows = self.runner.max_draft_rows
        choose_drafts(
            running,
            self.step_costs,
            self.config.num_speculative_tokens,
            self.config.max_model_len,
            min(rows, self.config.max_num_batched_tokens),
        )

    def _sample(
        self, output: StepLogits, sampling: list[Sequence]
    ) -> tuple[list[list[int]], list[TokenLogprob | None], dict[int, str]]:
        """Each request's new tokens: one sampled, or, where it drafted, the drafts greedy
        decoding keeps and the token after them (its logits rows follow its first)."""
        if not any(seq.draft_token_ids for seq in sampling):
            tokens, sampled_logprobs, sample_failed = sample(output.logits, sampling, output.greedy)
            return [[token] for token in tokens], sampled_logprobs, sample_failed
        greedy = output.greedy if output.greedy is not None else greedy_tokens(output.logits)
        firsts: list[int] = []
        row = 0
        for seq in sampling:
            firsts.append(row)
            row += 1 + len(seq.draft_token_ids)
        plain = [i for i, seq in enumerate(sampling) if not seq.draft_token_ids]
        new: list[list[int]] = [[] for _ in sampling]
        logprobs: list[TokenLogprob | None] = [None] * len(sampling)
        failed: dict[int, str] = {}
        if plain:
            rows = torch.tensor([firsts[i] for i in plain], device=output.logits.device)
            tokens, plain_logprobs, plain_failed = sample(
                output.logits.index_select(0, rows),
                [sampling[i] for i in plain],
                [greedy[firsts[i]] for i in plain],
            )
            for position, index in enumerate(plain):
                new[index] = [tokens[position]]
                logprobs[index] = plain_logprobs[position]
                if position in plain_failed:
                    failed[index] = plain_failed[position]
        for index, seq in enumerate(sampling):
            drafts = seq.draft_token_ids
            if drafts:
                first = firsts[index]
                new[index] = accepted_tokens(drafts, greedy[first : first + len(drafts) + 1])
        return new, logprobs, failed

    def _record_verification(
        self, seq: Sequence, drafted: int, accepted: int, record: bool
    ) -> None:
        if seq.draft_state is not None:
            seq.draft_state.record(drafted, accepted)
        if not record:
            return
        counts = self.spec_counts
        counts["drafts"] += 1
        counts["draft_tokens"] += drafted
        counts["accepted_tokens"] += accepted
        self.metrics.count_drafts(drafted, accepted)

    def _append_tokens(
        self, seq: Sequence, tokens: list[int], logprob: TokenLogprob | None, now: float
    ) -> int:
        """Append a step's tokens (more than one where drafts were accepted) up to the first
        that ends the request, delivering each; how many were appended."""
        params = seq.params
        for position, token in enumerate(tokens):
            seq.token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            if seq.first_token_time is None:
                seq.first_token_time = now
                if seq.sink is not None:
                    self.metrics.record_first_token(now - seq.arrival_time, seq.num_prompt_tokens)
            elif seq.last_token_time is not None:
                gap = now - seq.last_token_time
                seq.inter_token_latencies.append(gap)
                if seq.sink is not None:
                    self.metrics.labels(self.metrics.itl).observe(gap)
            seq.last_token_time = now
            reason: str | None = None
            is_stop_token = token in params.stop_token_ids or (
                not params.ignore_eos and token in self.eos_token_ids
            )
            if is_stop_token:
                reason = "stop"
            else:
                self._detokenize(seq, token)
                if params.stop and self._truncate_at_stop(seq):
                    reason = "stop"
            if reason is None and (
                seq.num_output_tokens >= params.max_tokens or len(seq) >= self.config.max_model_len
            ):
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
                return position + 1
            # a delta per token, drafts or not: a stream's chunks and the gateway's
            # inter-token gaps keep meaning one token each
            self._deliver(seq)
        return len(tokens)

    def _detokenize(self, seq: Sequence, token: int) -> None:
        # Multi-byte characters split across tokens come out whole, once complete.
        if seq.decoder is None:
            seq.decoder = self.tokenizer.stream_decoder()
        seq.text += seq.decoder(token)

    def _truncate_at_stop(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, seq.sent_text_length - longest)
        found = [
            index for stop in seq.params.stop if (index := seq.text.find(stop, window_start)) >= 0
        ]
        if not found:
            return False
        seq.text = seq.text[: min(found)]
        return True

    def _deliver(self, seq: Sequence, error: str | None = None) -> None:
        if seq.sink is None:
            return
        finished = seq.is_finished
        text_end = len(seq.text)
        if not finished and seq.params.stop:
            # Hold back what could be the start of a stop string.
            text_end = max(
                seq.sent_text_length, text_end - (max(len(s) for s in seq.params.stop) - 1)
            )
        output_ids = seq.output_token_ids
        out = RequestOutput(
            request_id=seq.request_id,
            text=seq.text[seq.sent_text_length : text_end],
            token_ids=output_ids[seq.sent_token_count :],
            logprobs=seq.logprobs[seq.sent_logprob_count :],
            finished=finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens,
            error=error,
        )
        seq.sent_text_length = text_end
        seq.sent_token_count = len(output_ids)
        seq.sent_logprob_count = len(seq.logprobs)
        seq.sink(out)

    def _finish(self, seq: Sequence, reason: str, message: str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        with self._condition:
            self._requests.pop(seq.request_id, None)
        if seq.sink is None:
            return
        now = time.monotonic()
        status = {"abort": "aborted", "error": "error"}.get(reason, "ok")
        self.metrics.record_finished(
            status=status,
            reason=reason,
            ttft_s=None
            if seq.first_token_time is None
            else seq.first_token_time - seq.arrival_time,
            inter_token_latencies=seq.inter_token_latencies,
            e2e_s=now - seq.arrival_time,
            queue_s=None
            if seq.first_scheduled_time is None
            else seq.first_scheduled_time - seq.arrival_time,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
        )
        self._deliver(seq, error=message)

    # ---- introspection -------------------------------------------------------------
    def speculative_stats(self) -> dict[str, Any]:
        counts = self.spec_counts
        drafts, drafted = counts["drafts"], counts["draft_tokens"]
        accepted = counts["accepted_tokens"]
        return {
            "mode": self.config.speculative,
            **counts,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "tokens_per_verification": round(1 + accepted / drafts, 4) if drafts else None,
        }

    def stats(self) -> dict[str, object]:
        metrics = self.metrics
        return {
            "running": len(self.scheduler.running) if self.state != "loading" else 0,
            "waiting": (len(self.scheduler.waiting) + len(self._submitted))
            if self.state != "loading"
            else 0,
            "kv_cache_usage": self.block_manager.usage if self.state != "loading" else 0.0,
            "prompt_tokens_total": metrics.prompt_tokens_total,
            "generation_tokens_total": metrics.generation_tokens_total,
            "requests_finished_total": metrics.requests_finished_total,
            "requests_failed_total": metrics.requests_failed_total,
            "prefix_cache_queries_total": self.block_manager.prefix_cache_queries
            if self.state != "loading"
            else 0,
            "prefix_cache_hits_total": self.block_manager.prefix_cache_hits
            if self.state != "loading"
            else 0,
            "num_preemptions_total": self.scheduler.num_preemptions
            if self.state != "loading"
            else 0,
            "steps": dict(self.step_counts),
            "step_seconds": {path: round(t, 6) for path, t in self.step_seconds.items()},
            "step_phase_seconds": {phase: round(t, 6) for phase, t in self.phase_seconds.items()},
            "speculative": self.speculative_stats(),
            # "triton" (engine/models/paged_attention.py) or "torch"
            "attention_backend": self.attention_backend,
            # CUDA graphs that replay decode steps (0: every step runs op by op)
            "decode_graphs": len(self.runner.graphs.graphs)
            if self.state != "loading" and self.runner.graphs_ready and self.runner.graphs
            else 0,
            # CUDA graphs of whole steps by token count, prefill included (0: none)
            "step_graphs": len(self.runner.step_graphs.graphs)
            if self.state != "loading" and self.runner.step_graphs_ready and self.runner.step_graphs
            else 0,
        }
