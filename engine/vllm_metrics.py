"""vLLM's Prometheus names, types, labels and buckets for what the engine measures.

Dashboards, autoscaling rules and routers written for vLLM read `vllm:*` series labelled
`model_name` and `engine`; the engine records each measurement once (engine/metrics.py) and
it lands under both its own `engine:*` name and the vLLM name defined here. vLLM metrics the
engine has no honest counterpart for are absent (docs/engine.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's v1 PrometheusStatLogger: one engine core, index "0".
LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"

TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's token-count buckets."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass(frozen=True)
class VllmMetric:
    kind: str  # counter, gauge or histogram
    name: str  # without the _total a counter gains on export
    documentation: str
    buckets: tuple[float, ...] = ()


# The engine's own metric name -> its vLLM twin (both record the same measurement).
TWINS: dict[str, VllmMetric] = {
    "engine:num_requests_running": VllmMetric(
        "gauge", "vllm:num_requests_running", "Number of requests in model execution batches."
    ),
    "engine:num_requests_waiting": VllmMetric(
        "gauge", "vllm:num_requests_waiting", "Number of requests waiting to be processed."
    ),
    "engine:kv_cache_usage_perc": VllmMetric(
        "gauge", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
    ),
    "engine:generation_tokens": VllmMetric(
        "counter", "vllm:generation_tokens", "Number of generation tokens processed."
    ),
    "engine:prefix_cache_queries": VllmMetric(
        "counter",
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "engine:prefix_cache_hits": VllmMetric(
        "counter",
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    "engine:num_preemptions": VllmMetric(
        "counter", "vllm:num_preemptions", "Cumulative number of preemption from the engine."
    ),
    "engine:time_to_first_token_seconds": VllmMetric(
        "histogram",
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TIME_TO_FIRST_TOKEN_BUCKETS,
    ),
    "engine:inter_token_latency_seconds": VllmMetric(
        "histogram",
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        INTER_TOKEN_BUCKETS,
    ),
    "engine:e2e_request_latency_seconds": VllmMetric(
        "histogram",
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "engine:spec_decode_num_drafts": VllmMetric(
        "counter", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."
    ),
    "engine:spec_decode_num_draft_tokens": VllmMetric(
        "counter", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
    ),
    "engine:spec_decode_num_accepted_tokens": VllmMetric(
        "counter", "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
    ),
    "engine:request_queue_time_seconds": VllmMetric(
        "histogram",
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
}
REQUEST_SUCCESS = VllmMetric(
    "counter", "vllm:request_success", "Count of successfully processed requests."
)
# Measured only for vLLM's names: the engine has no `engine:*` series for them.
# A request's whole prompt once its prefill is done, prefix cache hits included, as vLLM
# counts it (engine:prompt_tokens counts the prompt tokens computed, so not those hits).
PROMPT_TOKENS = VllmMetric("counter", "vllm:prompt_tokens", "Number of prefill tokens processed.")
ITERATION_TOKENS = VllmMetric(
    "histogram", "vllm:iteration_tokens_total",
    "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS,
)  # fmt: skip
REQUEST_PROMPT_TOKENS = VllmMetric(
    "histogram", "vllm:request_prompt_tokens", "Number of prefill tokens processed."
)
REQUEST_GENERATION_TOKENS = VllmMetric(
    "histogram", "vllm:request_generation_tokens", "Number of generation tokens processed."
)


def register(
    metric: VllmMetric,
    registry: CollectorRegistry,
    model_name: str,
    extra_labels: tuple[str, ...] = (),
    buckets: tuple[float, ...] = (),
) -> Any:
    """The metric in the registry; without extra labels, its one series, exported at zero.

    buckets: a histogram's where vLLM derives them (from max_model_len), else its own.
    """
    labels = [*LABELS, *extra_labels]
    family: Counter | Gauge | Histogram
    if metric.kind == "counter":
        family = Counter(metric.name, metric.documentation, labels, registry=registry)
    elif metric.kind == "gauge":
        family = Gauge(metric.name, metric.documentation, labels, registry=registry)
    else:
        family = Histogram(
            metric.name, metric.documentation, labels, buckets=buckets or metric.buckets,
            registry=registry,
        )  # fmt: skip
    if extra_labels:
        return family
    return family.labels(model_name, ENGINE_INDEX)
