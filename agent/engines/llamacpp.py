"""llama.cpp: its server `llama-server` (from a llama.cpp build or a package that ships it).

It loads a GGUF file. /health answers 503 while the model loads and 200 once it is ready.
--metrics turns on /metrics (llamacpp:* series). The serving secret is its API key, passed
as LLAMA_API_KEY (never on the command line). It exports no latency histograms: the
inter-token latency is the mean of its generation seconds over its generated tokens, and
it has no time to first token nor finished-request counters. Builds since the unified KV
cache no longer export a KV usage ratio (it reads 0 there). No drain request: the agent
waits until nothing is processing or deferred, then sends SIGTERM.
"""

from __future__ import annotations

from agent.engines.base import (
    DrainMethod,
    EngineAdapter,
    EngineSpec,
    config_flags,
    positive_int,
)
from agent.engines.prometheus import MetricNames
from contracts.engines import engine_flags

API_KEY_VARIABLE = "LLAMA_API_KEY"

LLAMACPP_METRICS = MetricNames(
    running=("llamacpp:requests_processing",),
    waiting=("llamacpp:requests_deferred",),
    kv_cache_usage=("llamacpp:kv_cache_usage_ratio",),
    prompt_tokens=("llamacpp:prompt_tokens",),
    generation_tokens=("llamacpp:tokens_predicted",),
    itl_seconds_counter=("llamacpp:tokens_predicted_seconds",),
    itl_tokens_counter=("llamacpp:tokens_predicted",),
)

SERVING_CONFIG_FLAGS = {
    "max_model_len": "--ctx-size",
    "max_num_seqs": "--parallel",
    "max_num_batched_tokens": "--batch-size",
}
# Keys with nothing to set there: a GGUF file's weight types were fixed when it was made,
# and its KV cache has no block size to choose.
IGNORED_KEYS = ("dtype", "kv_block_size", "block_size")


class LlamaCppAdapter(EngineAdapter):
    name = "llama.cpp"
    metric_names = LLAMACPP_METRICS
    drain_method = DrainMethod.IDLE_THEN_SIGTERM

    def default_command(self) -> tuple[str, ...]:
        return ("llama-server",)

    def arguments(self, spec: EngineSpec) -> list[str]:
        config = {k: v for k, v in spec.serving_config.items() if k not in IGNORED_KEYS}
        if "max_model_len" in config:
            # --ctx-size is shared by the --parallel slots: each gets max_model_len.
            slots = positive_int("max_num_seqs", config.get("max_num_seqs", 1))
            config["max_model_len"] = positive_int("max_model_len", config["max_model_len"]) * slots
        return [
            "--model",
            spec.model(),
            *config_flags(config, SERVING_CONFIG_FLAGS, engine=self.name, dtypes={}),
            "--host",
            spec.host,
            "--port",
            str(spec.port),
            "--alias",
            spec.served_model_name,
            "--threads",
            str(spec.threads),
            "--metrics",
            *engine_flags(self.name, spec.engine_args),
        ]

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        environment = super().environment(spec)
        if spec.secrets is not None:
            environment[API_KEY_VARIABLE] = spec.secrets.serving
        return environment
