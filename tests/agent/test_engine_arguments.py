"""The engine in the load command and on the engine's command line: a load names its engine
and arguments (the built-in engine and none when it does not), only known options pass, and
the built-in engine's options become flags its own parser takes."""

from pathlib import Path

import pytest

from agent.engine_process import EngineSpec
from agent.engines.builtin import BuiltinAdapter
from contracts.commands import parse_load_payload
from contracts.engines import OPTIONS, engine_flags
from contracts.streams import ContractError
from engine.__main__ import build_parser
from engine.config import (
    ATTENTION_BACKENDS,
    MAX_SPECULATIVE_TOKENS,
    SPECULATIVE_MODES,
    EngineSecrets,
)
from tests.contracts.test_engine_secrets_contract import LOAD, SECRET_A, SECRET_B


def test_a_load_without_an_engine_is_the_builtin_one_without_arguments() -> None:
    load = parse_load_payload(LOAD)
    assert (load.engine, load.engine_args) == ("builtin", {})


def test_a_load_carries_its_engine_and_arguments() -> None:
    payload = {**LOAD, "engine": "vllm", "engine_args": {"tensor_parallel_size": 2}}
    load = parse_load_payload(payload)
    assert (load.engine, load.engine_args) == ("vllm", {"tensor_parallel_size": 2})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine": "tgi"}, "payload.engine: must be one of"),
        ({"engine_args": {"trust_remote_code": True}}, "payload.engine_args: trust_remote_code"),
        ({"engine": "vllm", "engine_args": {"port": 1}}, "payload.engine_args: port"),
        ({"engine": "openai", "engine_args": {"base_url": "http://x", "upstream_model": "m"}},
         "payload.digest: an openai version has no artifact"),
    ],
)  # fmt: skip
def test_a_load_with_an_unknown_engine_or_option_is_refused(change, message) -> None:
    with pytest.raises(ContractError) as refused:
        parse_load_payload({**LOAD, **change})
    assert str(refused.value).startswith(message)


def test_the_builtin_engines_options_are_flags_its_parser_takes(tmp_path: Path) -> None:
    arguments = {
        "num_blocks": 128,
        "kv_cache_memory_mb": 256,
        "max_queue": 64,
        "prefix_caching": False,
        "enforce_eager": True,
        "speculative": "off",
        "num_speculative_tokens": 4,
        "attention_backend": "torch",
    }
    assert set(arguments) == set(OPTIONS["builtin"])
    assert engine_flags("builtin", arguments) == [
        "--attention-backend",
        "torch",
        "--enforce-eager",
        "--kv-cache-memory-mb",
        "256",
        "--max-queue",
        "64",
        "--num-blocks",
        "128",
        "--num-speculative-tokens",
        "4",
        "--no-prefix-caching",
        "--speculative",
        "off",
    ]
    spec = EngineSpec(
        model_path=tmp_path,
        serving_config={"dtype": "float32", "max_model_len": 256},
        served_model_name="m",
        host="127.0.0.1",
        port=8100,
        threads=1,
        secrets=EngineSecrets(serving=SECRET_A, admin=SECRET_B),
        engine="builtin",
        engine_args=arguments,
    )
    parsed = build_parser().parse_args(["serve", *BuiltinAdapter().arguments(spec)])
    assert (parsed.model, parsed.num_blocks, parsed.kv_cache_memory_mb) == (str(tmp_path), 128, 256)
    assert (parsed.max_queue, parsed.no_prefix_caching, parsed.enforce_eager) == (64, True, True)
    assert (parsed.speculative, parsed.num_speculative_tokens) == ("off", 4)
    assert parsed.attention_backend == "torch"
    assert OPTIONS["builtin"]["speculative"].choices == SPECULATIVE_MODES
    assert OPTIONS["builtin"]["attention_backend"].choices == ATTENTION_BACKENDS
    assert OPTIONS["builtin"]["num_speculative_tokens"].high == MAX_SPECULATIVE_TOKENS
    defaults = build_parser().parse_args(["serve", *BuiltinAdapter().arguments(EngineSpec(
        model_path=tmp_path, serving_config={}, served_model_name="m", host="h", port=1,
        threads=1, engine_args={"prefix_caching": True, "enforce_eager": False},
    ))])  # fmt: skip
    assert (defaults.no_prefix_caching, defaults.enforce_eager) == (False, False)


def test_other_engines_options_become_their_flags() -> None:
    vllm = {"gpu_memory_percent": 90, "prefix_caching": False, "tensor_parallel_size": 2}
    assert engine_flags("vllm", vllm) == [
        "--gpu-memory-utilization",
        "0.9",
        "--no-enable-prefix-caching",
        "--tensor-parallel-size",
        "2",
    ]
    sglang = {"mem_fraction_static_percent": 85, "radix_cache": True, "cuda_graph": False}
    assert engine_flags("sglang", sglang) == [
        "--disable-cuda-graph",
        "--mem-fraction-static",
        "0.85",
    ]
    assert engine_flags("llama.cpp", {"n_gpu_layers": -1}) == ["--n_gpu_layers", "-1"]
    assert engine_flags("openai", {"base_url": "http://x", "upstream_model": "m"}) == []
