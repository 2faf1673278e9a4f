"""Prometheus metrics under the engine's names (`engine:*`) and vLLM's, and /admin/stats.

Each measurement is recorded once and lands in both series: `labels()` hands back the engine
series together with its vLLM twin (engine/vllm_metrics.py defines the vLLM side).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine import vllm_metrics

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


class Series:
    """One measurement recorded into the engine's series and its vLLM twin alike."""

    def __init__(self, *children: Any):
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for child in self.children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self.children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self._twins: dict[Any, Any] = {}
        self._series: dict[Any, Any] = {}  # labels(): each metric's series, once looked up

        def vllm(metric: vllm_metrics.VllmMetric, extra_labels: tuple[str, ...] = ()) -> Any:
            return vllm_metrics.register(metric, self.registry, model_name, extra_labels)

        def twinned(metric: Any, name: str) -> Any:
            if name in vllm_metrics.TWINS:
                self._twins[metric] = vllm(vllm_metrics.TWINS[name])
            return metric

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return twinned(
                Histogram(name, doc, labels, buckets=buckets, registry=self.registry), name
            )

        def counter(name: str, doc: str) -> Counter:
            return twinned(Counter(name, doc, labels, registry=self.registry), name)

        def gauge(name: str, doc: str) -> Gauge:
            return twinned(Gauge(name, doc, labels, registry=self.registry), name)

        self.ttft = histogram(
            "engine:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "engine:inter_token_latency_seconds", "Time between output tokens.", LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "engine:e2e_request_latency_seconds", "Request latency.", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "engine:request_queue_time_seconds", "Time waiting before first scheduled.",
            REQUEST_BUCKETS,
        )  # fmt: skip
        self.running = gauge("engine:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("engine:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("engine:kv_cache_usage_perc", "KV cache usage, 1 is full.")
        self.prompt_tokens = counter("engine:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("engine:generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("engine:prefix_cache_queries", "Prefix cache tokens queried.")
        self.prefix_hits = counter("engine:prefix_cache_hits", "Prefix cache tokens hit.")
        self.preemptions = counter("engine:num_preemptions", "Preemptions by recompute.")
        # speculative decoding: acceptance rate = accepted / draft tokens; tokens per
        # verification = 1 + accepted / drafts
        self.spec_drafts = counter(
            "engine:spec_decode_num_drafts", "Requests' verifications of drafts."
        )
        self.spec_draft_tokens = counter(
            "engine:spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_accepted_tokens = counter(
            "engine:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.success = Counter(
            "engine:request_success",
            "Finished requests by reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.vllm_success = vllm(vllm_metrics.REQUEST_SUCCESS, ("finished_reason",))
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
            self.vllm_success.labels(model_name, vllm_metrics.ENGINE_INDEX, reason)
        self.iteration_tokens = vllm(vllm_metrics.ITERATION_TOKENS)
        self.vllm_prompt_tokens = vllm(vllm_metrics.PROMPT_TOKENS)
        # Their buckets follow max_model_len, known once the model is loaded.
        self.request_prompt_tokens: Any = None
        self.request_generation_tokens: Any = None
        for metric in (
            self.ttft, self.itl, self.e2e, self.queue_time, self.running, self.waiting,
            self.kv_usage, self.prompt_tokens, self.generation_tokens, self.prefix_queries,
            self.prefix_hits, self.preemptions, self.spec_drafts, self.spec_draft_tokens,
            self.spec_accepted_tokens,
        ):  # fmt: skip
            metric.labels(model_name)  # export every series from the start, at zero
        self.failed = counter("engine:request_failure", "Requests that ended in an error.")
        self._lock = threading.Lock()
        self.recent: deque[dict[str, Any]] = deque(maxlen=1024)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished_total = 0
        self.requests_failed_total = 0

    def set_max_model_len(self, max_model_len: int) -> None:
        """Exports the per-request token histograms, bucketed up to max_model_len as vLLM's."""
        buckets = vllm_metrics.one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = vllm_metrics.register(
            vllm_metrics.REQUEST_PROMPT_TOKENS, self.registry, self.model_name, buckets=buckets
        )
        self.request_generation_tokens = vllm_metrics.register(
            vllm_metrics.REQUEST_GENERATION_TOKENS, self.registry, self.model_name,
            buckets=buckets,
        )  # fmt: skip

    def labels(self, metric: Any) -> Any:
        """The engine's series of `metric` and, where vLLM has one, its vLLM twin; looked
        up once (prometheus_client's labels() takes a lock and builds a key per call, and
        the step loop records a few series per token)."""
        series = self._series.get(metric)
        if series is None:
            own = metric.labels(self.model_name)
            twin = self._twins.get(metric)
            series = self._series[metric] = own if twin is None else Series(own, twin)
        return series

    def record_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        """A request's prefill is done: its first token came after ttft_s."""
        self.labels(self.ttft).observe(ttft_s)
        self.vllm_prompt_tokens.inc(prompt_tokens)

    def count_tokens(self, prompt: int, generated: int) -> None:
        """The tokens of one engine step."""
        self.iteration_tokens.observe(prompt + generated)
        with self._lock:
            self.prompt_tokens_total += prompt
            self.generation_tokens_total += generated
        if prompt:
            self.labels(self.prompt_tokens).inc(prompt)
        if generated:
            self.labels(self.generation_tokens).inc(generated)

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """One request's drafts verified in a step, and how many were accepted."""
        self.labels(self.spec_drafts).inc()
        self.labels(self.spec_draft_tokens).inc(drafted)
        if accepted:
            self.labels(self.spec_accepted_tokens).inc(accepted)

    def record_finished(
        self,
        status: str,
        reason: str,
        ttft_s: float | None,
        inter_token_latencies: list[float],
        e2e_s: float,
        queue_s: float | None,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """status: ok, error or aborted (the /admin/stats vocabulary)."""
        self.success.labels(self.model_name, reason).inc()
        self.vllm_success.labels(self.model_name, vllm_metrics.ENGINE_INDEX, reason).inc()
        if self.request_prompt_tokens is not None:
            self.request_prompt_tokens.observe(prompt_tokens)
            self.request_generation_tokens.observe(completion_tokens)
        self.labels(self.e2e).observe(e2e_s)
        if queue_s is not None:
            self.labels(self.queue_time).observe(queue_s)
        itl = sorted(inter_token_latencies)
        entry = {
            "finished_at": time.time(),
            "status": status,
            "ttft_s": ttft_s,
            "itl_mean_s": sum(itl) / len(itl) if itl else None,
            "itl_p95_s": itl[min(len(itl) - 1, int(0.95 * len(itl)))] if itl else None,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
        }
        with self._lock:
            self.recent.append(entry)
            if status == "error":
                self.requests_failed_total += 1
            else:
                self.requests_finished_total += 1
        if status == "error":
            self.labels(self.failed).inc()

    def recent_list(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.recent)
