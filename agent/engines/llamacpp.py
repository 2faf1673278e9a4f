"""llama.cpp: llama-cpp-python's server (`python -m llama_cpp.server`), in an environment of
its own.

It loads a GGUF file. Its server (0.3.36) takes no middleware and serves neither a health
route nor /metrics, so the agent starts it through a launcher of ours that runs the very
same app (plugins/fleet_llama_cpp_server.py: its flags, its `create_app`, uvicorn) and adds
GET /identity, GET /health and a /metrics of its own counts (fleet_llamacpp:*). The model is
loaded before the server listens: /health answering is ready. It runs one request at a time;
the others wait. The serving secret is its API key, read from API_KEY (its settings read
the environment; never on the command line). Drain: on SIGTERM uvicorn stops listening,
finishes the requests in flight (and those waiting), then exits.

Its environment is built by scripts/ensure_engine_env.sh under the project's cache; that
environment's python is the default when it is there.

`LLAMA_SERVER_METRICS` are the llamacpp:* series of llama.cpp's own `llama-server`, read
when one runs behind an openai version.
"""

from __future__ import annotations

from pathlib import Path

from agent.engines.base import (
    DrainMethod,
    EngineAdapter,
    EngineSpec,
    address_flags,
    config_flags,
    plugin_environment,
    positive_int,
)
from agent.engines.prometheus import MetricNames
from agent.engines.vllm import engines_cache_dir
from contracts.engines import engine_flags

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LAUNCHER_MODULE = "fleet_llama_cpp_server"
API_KEY_VARIABLE = "API_KEY"
ENV_STAMP = ".fleet-engine-env"  # scripts/ensure_engine_env.sh writes it once the build is done

# What the launcher counts (plugins/fleet_llama_cpp_server.py). No latency histograms,
# KV cache use nor preemptions: llama_cpp.server reports none of them.
LLAMA_CPP_PYTHON_METRICS = MetricNames(
    running=("fleet_llamacpp:requests_running",),
    waiting=("fleet_llamacpp:requests_waiting",),
    prompt_tokens=("fleet_llamacpp:prompt_tokens",),
    generation_tokens=("fleet_llamacpp:generation_tokens",),
    requests_ok=("fleet_llamacpp:requests_ok",),
    requests_failed=("fleet_llamacpp:requests_failed",),
)

# llama.cpp's own llama-server with --metrics (an openai version may front one).
LLAMA_SERVER_METRICS = MetricNames(
    running=("llamacpp:requests_processing",),
    waiting=("llamacpp:requests_deferred",),
    kv_cache_usage=("llamacpp:kv_cache_usage_ratio",),
    prompt_tokens=("llamacpp:prompt_tokens",),
    generation_tokens=("llamacpp:tokens_predicted",),
    itl_seconds_counter=("llamacpp:tokens_predicted_seconds",),
    itl_tokens_counter=("llamacpp:tokens_predicted",),
)

SERVING_CONFIG_FLAGS = {
    "max_model_len": "--n_ctx",
    "max_num_batched_tokens": "--n_batch",
}
# Keys with nothing to set there: a GGUF file's weight types were fixed when it was made,
# its KV cache has no block size to choose, and it runs one sequence at a time.
IGNORED_KEYS = ("dtype", "kv_block_size", "block_size", "max_num_seqs")
# engine_args' KV cache types -> llama.cpp's ggml type numbers (its --type_k takes those)
GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}
CACHE_TYPE_FLAGS = {"cache_type_k": "--type_k", "cache_type_v": "--type_v"}


def llama_cpp_env() -> Path:
    return engines_cache_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"


def llama_cpp_python() -> str:
    return str(llama_cpp_env() / "bin" / "python")


def llama_cpp_env_is_built() -> bool:
    """The script's stamp, written last: a half-built environment does not count."""
    return (llama_cpp_env() / ENV_STAMP).exists()


class LlamaCppAdapter(EngineAdapter):
    name = "llama.cpp"
    metric_names = LLAMA_CPP_PYTHON_METRICS
    drain_method = DrainMethod.SIGTERM
    supports_faults = True  # through plugins/fleet_engine_faults.py, in the launcher

    def default_command(self) -> tuple[str, ...]:
        python = llama_cpp_python() if llama_cpp_env_is_built() else "python3"
        return (python, "-m", LAUNCHER_MODULE)

    def arguments(self, spec: EngineSpec) -> list[str]:
        if "max_num_seqs" in spec.serving_config:
            positive_int("max_num_seqs", spec.serving_config["max_num_seqs"])
        config = {k: v for k, v in spec.serving_config.items() if k not in IGNORED_KEYS}
        flagged = {k: v for k, v in spec.engine_args.items() if k not in CACHE_TYPE_FLAGS}
        cache_types: list[str] = []
        for key, flag in CACHE_TYPE_FLAGS.items():
            if key in spec.engine_args:
                cache_types += [flag, str(GGML_TYPES[spec.engine_args[key]])]
        return [
            "--model",
            spec.model(),
            *config_flags(config, SERVING_CONFIG_FLAGS, engine=self.name, dtypes={}),
            *address_flags(spec, name_flag="--model_alias"),
            "--n_threads",
            str(spec.threads),
            "--n_threads_batch",  # else it takes every core for prompts
            str(spec.threads),
            # A waiting request must not cut a streaming one short (its default does).
            "--interrupt_requests",
            "false",
            "--verbose",
            "false",
            *engine_flags(self.name, flagged),
            *cache_types,
        ]

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        return {**super().environment(spec), **plugin_environment(spec, API_KEY_VARIABLE)}
