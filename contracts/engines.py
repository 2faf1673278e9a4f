"""Which engine may serve a version, and the engine arguments a version may carry.

A version names its engine and a mapping of engine arguments. Both are signed with the
version (contracts/signing.py) and become part of a command line on an agent, so only the
options below are accepted, each with its type and bounds: nothing that loads code from
elsewhere (remote code, a speculative model by name), binds another host or port, or reads
files. The registry refuses, at registration, a combination of artifact format, engine and
task that cannot load; an agent turns the arguments into flags with `engine_flags`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

BUILTIN = "builtin"
VLLM = "vllm"
SGLANG = "sglang"
LLAMA_CPP = "llama.cpp"
OPENAI = "openai"
ENGINES = (BUILTIN, VLLM, SGLANG, LLAMA_CPP, OPENAI)

FORMAT_GGUF = "gguf"  # one file
FORMAT_SAFETENSORS = "safetensors"  # one file: a bare tensor file no engine loads alone
FORMAT_HF_FOLDER = "hf-safetensors"  # a folder: safetensors weights, config, tokenizer
FORMATS = (FORMAT_GGUF, FORMAT_SAFETENSORS, FORMAT_HF_FOLDER)
NO_ARTIFACT = ""  # what an openai version has instead of a format

TASK_CHAT = "chat"
TASK_EMBEDDING = "embedding"

# engine -> artifact format -> the tasks it serves from that format.
SERVES: dict[str, dict[str, frozenset[str]]] = {
    BUILTIN: {
        FORMAT_GGUF: frozenset({TASK_CHAT}),
        FORMAT_HF_FOLDER: frozenset({TASK_CHAT, TASK_EMBEDDING}),
    },
    VLLM: {FORMAT_HF_FOLDER: frozenset({TASK_CHAT, TASK_EMBEDDING})},
    SGLANG: {FORMAT_HF_FOLDER: frozenset({TASK_CHAT})},
    LLAMA_CPP: {FORMAT_GGUF: frozenset({TASK_CHAT})},
    OPENAI: {NO_ARTIFACT: frozenset({TASK_CHAT, TASK_EMBEDDING})},
}
# What the built-in engine loads from a folder (config.json's model_type), by task.
BUILTIN_FOLDER_MODEL_TYPES = {
    TASK_CHAT: frozenset({"llama", "mistral", "qwen2"}),
    TASK_EMBEDDING: frozenset({"bert"}),
}
# Only our engine stores weights as int8.
INT8_ENGINES = frozenset({BUILTIN})


class EngineArgumentError(ValueError):
    """`errors`: argument name -> what is wrong with it."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{name}: {problem}" for name, problem in errors.items()))
        self.errors = errors


@dataclass(frozen=True, slots=True)
class Option:
    """One engine argument: its type, bounds or choices, and its flag.

    kind: "int", "percent", "bool", "choice", "url" or "name". Numbers are integers only:
    a signature covers the JSON, and integers have one spelling (a percent is given to the
    engine as a fraction). A bool adds `flag` when true and `flag_false` when false (""
    adds nothing); others add `flag` and the value. Options without a flag are read by the
    agent itself (an openai endpoint's address).
    """

    kind: str
    flag: str = ""
    low: int = 0
    high: int = 0
    choices: tuple[str, ...] = ()
    flag_false: str = ""


QUANTIZATIONS = ("awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes")
OPTIONS: dict[str, dict[str, Option]] = {
    BUILTIN: {
        "num_blocks": Option("int", "--num-blocks", 0, 10_000_000),
        "kv_cache_memory_mb": Option("int", "--kv-cache-memory-mb", 16, 1_048_576),
        "max_queue": Option("int", "--max-queue", 1, 100_000),
        "prefix_caching": Option("bool", "", flag_false="--no-prefix-caching"),
        "enforce_eager": Option("bool", "--enforce-eager"),
        # n-gram speculative decoding (engine/speculative.py; engine.config's modes)
        "speculative": Option("choice", "--speculative", choices=("auto", "off")),
        "num_speculative_tokens": Option("int", "--num-speculative-tokens", 1, 32),
        # engine.config's ATTENTION_BACKENDS
        "attention_backend": Option(
            "choice", "--attention-backend", choices=("auto", "triton", "torch")
        ),
    },
    VLLM: {
        "tensor_parallel_size": Option("int", "--tensor-parallel-size", 1, 64),
        "pipeline_parallel_size": Option("int", "--pipeline-parallel-size", 1, 64),
        "gpu_memory_percent": Option("percent", "--gpu-memory-utilization", 5, 99),
        "quantization": Option("choice", "--quantization", choices=QUANTIZATIONS),
        "kv_cache_dtype": Option(
            "choice", "--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
        ),
        "enforce_eager": Option("bool", "--enforce-eager"),
        "prefix_caching": Option(
            "bool", "--enable-prefix-caching", flag_false="--no-enable-prefix-caching"
        ),
        "chunked_prefill": Option(
            "bool", "--enable-chunked-prefill", flag_false="--no-enable-chunked-prefill"
        ),
        "seed": Option("int", "--seed", 0, 2**31 - 1),
    },
    SGLANG: {
        "tp_size": Option("int", "--tp-size", 1, 64),
        "dp_size": Option("int", "--dp-size", 1, 64),
        "mem_fraction_static_percent": Option("percent", "--mem-fraction-static", 5, 99),
        "quantization": Option("choice", "--quantization", choices=QUANTIZATIONS[:4]),
        "kv_cache_dtype": Option(
            "choice", "--kv-cache-dtype", choices=("auto", "fp8_e4m3", "fp8_e5m2")
        ),
        "chunked_prefill_size": Option("int", "--chunked-prefill-size", -1, 1_048_576),
        "attention_backend": Option(
            "choice", "--attention-backend", choices=("flashinfer", "triton", "torch_native", "fa3")
        ),
        "radix_cache": Option("bool", "", flag_false="--disable-radix-cache"),
        "cuda_graph": Option("bool", "", flag_false="--disable-cuda-graph"),
    },
    LLAMA_CPP: {
        # llama_cpp.server's flags; the KV cache types become ggml type numbers on the agent
        "n_gpu_layers": Option("int", "--n_gpu_layers", -1, 10_000),
        "batch_size": Option("int", "--n_batch", 1, 65_536),
        "ubatch_size": Option("int", "--n_ubatch", 1, 65_536),
        "cache_type_k": Option("choice", choices=("f16", "q8_0", "q4_0")),
        "cache_type_v": Option("choice", choices=("f16", "q8_0", "q4_0")),
    },
    OPENAI: {
        # The already running endpoint the agent supervises, and the model name it serves.
        "base_url": Option("url"),
        "upstream_model": Option("name"),
    },
}
REQUIRED: dict[str, frozenset[str]] = {OPENAI: frozenset({"base_url", "upstream_model"})}
MAX_ARGS = 32
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
MAX_URL_LENGTH = 500


def _value_problem(option: Option, value: Any) -> str | None:
    """What is wrong with `value` for `option`, or None."""
    if option.kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if option.kind == "choice":
        return None if value in option.choices else f"must be one of {', '.join(option.choices)}"
    if option.kind == "name":
        is_name = isinstance(value, str) and NAME_PATTERN.match(value)
        return None if is_name else "must be a model name (letters, digits, '._:/-')"
    if option.kind == "url":
        return _url_problem(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return "must be an integer"
    if not option.low <= value <= option.high:
        return f"must be between {option.low} and {option.high}"
    return None


def _url_problem(value: Any) -> str | None:
    if not isinstance(value, str) or len(value) > MAX_URL_LENGTH:
        return f"must be an http(s) URL of at most {MAX_URL_LENGTH} characters"
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return "must be an http(s) URL"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http(s) URL with a host"
    if parts.username is not None or parts.password is not None:
        return "must not carry credentials (the agent holds the endpoint's key)"
    if parts.query or parts.fragment or (port is not None and not 0 < port < 65536):
        return "must have no query or fragment, and a valid port"
    return None


def engine_args_validate(engine: str, engine_args: Any) -> dict[str, Any]:
    """The arguments, unchanged, or EngineArgumentError naming each bad one."""
    if engine not in OPTIONS:
        raise EngineArgumentError({"engine": f"must be one of {', '.join(ENGINES)}"})
    if engine_args is None:
        engine_args = {}
    if not isinstance(engine_args, Mapping):
        raise EngineArgumentError({"engine_args": "must be an object of option: value"})
    if len(engine_args) > MAX_ARGS:
        raise EngineArgumentError({"engine_args": f"at most {MAX_ARGS} options"})
    options = OPTIONS[engine]
    errors = {}
    for name, value in engine_args.items():
        option = options.get(name) if isinstance(name, str) else None
        if option is None:
            known = ", ".join(sorted(options)) or "none"
            errors[str(name)[:100]] = f"not an option of {engine} (known: {known})"
            continue
        problem = _value_problem(option, value)
        if problem:
            errors[name] = problem
    for name in sorted(REQUIRED.get(engine, frozenset()) - set(engine_args)):
        errors[name] = "required"
    if errors:
        raise EngineArgumentError(errors)
    return dict(engine_args)


def engine_flags(engine: str, engine_args: Mapping[str, Any]) -> list[str]:
    """Command-line flags for validated arguments, in a stable order (sorted by name)."""
    options = OPTIONS[engine]
    flags: list[str] = []
    for name, value in sorted(engine_args.items()):
        option = options[name]
        if option.kind == "bool":
            flag = option.flag if value else option.flag_false
            flags += [flag] if flag else []
        elif option.kind == "percent":
            flags += [option.flag, f"{value / 100:g}"]
        elif option.flag:
            flags += [option.flag, str(value)]
    return flags


def combination_problem(*, engine: str, artifact_format: str, task: str) -> tuple[str, str] | None:
    """(code, reason) when `engine` cannot serve `task` from `artifact_format`, else None."""
    formats = SERVES.get(engine)
    if formats is None:
        return "unknown_engine", f"no engine {engine!r}; engines: {', '.join(ENGINES)}"
    if engine == OPENAI and artifact_format != NO_ARTIFACT:
        return "artifact_not_allowed", "an openai version names an endpoint, not an artifact"
    if artifact_format == NO_ARTIFACT and engine != OPENAI:
        return "artifact_required", f"a {engine} version needs an artifact"
    tasks = formats.get(artifact_format)
    if tasks is None:
        accepted = ", ".join(sorted(formats)) or "none"
        return (
            "engine_format_mismatch",
            f"{engine} does not load {artifact_format} artifacts (it loads: {accepted})",
        )
    if task not in tasks:
        return (
            "engine_task_mismatch",
            f"{engine} does not serve {task} models from {artifact_format} "
            f"(it serves: {', '.join(sorted(tasks))})",
        )
    return None
