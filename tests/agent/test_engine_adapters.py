"""Each engine's adapter: its command line and environment for a serving configuration, what
it refuses, and its /metrics text read into the heartbeat's figures (vLLM's as it served
here, SGLang's and llama-server's from fixtures: tests/agent/fixtures/ says where each came
from; llama_cpp.server's as its launcher writes it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.commands import CommandFailed
from agent.config import AgentConfig
from agent.engines import ADAPTERS, EngineSpec, EngineStartError, adapter_for
from agent.engines.base import PLUGINS_DIR
from agent.engines.builtin import BuiltinAdapter
from agent.engines.llamacpp import LLAMA_SERVER_METRICS, LlamaCppAdapter
from agent.engines.openai import OpenAIAdapter
from agent.engines.prometheus import Histogram, MetricsTextError, read_snapshot
from agent.engines.sglang import SglangAdapter
from agent.engines.vllm import VLLM_METRICS, VllmAdapter
from agent.runner import Agent
from contracts.commands import LoadPayload, parse_load_payload
from contracts.engines import ENGINES
from engine.config import EngineSecrets
from tests.contracts.test_engine_secrets_contract import LOAD

FIXTURES = Path(__file__).parent / "fixtures"
SECRETS = EngineSecrets(serving="5e" * 32, admin="ad" * 32)
CONFIG = {
    "dtype": "bfloat16",
    "max_model_len": 512,
    "kv_block_size": 16,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,
}


def spec(**changes) -> EngineSpec:
    values = {
        "model_path": Path("/models/smollm2"),
        "serving_config": dict(CONFIG),
        "served_model_name": "smol",
        "host": "127.0.0.1",
        "port": 18000,
        "threads": 2,
        "secrets": SECRETS,
        "agent_name": "agent-1",
        "gpu_index": 1,
        "drain_timeout_s": 30.0,
    }
    return EngineSpec(**{**values, **changes})


def flag(arguments: list[str], name: str) -> str:
    return arguments[arguments.index(name) + 1]


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_every_engine_name_of_the_load_command_has_an_adapter() -> None:
    assert set(ADAPTERS) == set(ENGINES)
    with pytest.raises(EngineStartError, match="engine 'tgi' is not one of"):
        adapter_for("tgi")


def test_builtin_starts_our_engine_with_its_secrets_in_the_environment_only() -> None:
    adapter = adapter_for("builtin", ("python", "-m", "engine", "serve"))
    command = adapter.command(spec(fault_error_rate=0.5))
    assert command[:4] == ["python", "-m", "engine", "serve"]
    assert flag(command, "--model") == "/models/smollm2"
    assert (flag(command, "--dtype"), flag(command, "--block-size")) == ("bfloat16", "16")
    assert flag(command, "--fault-error-rate") == "0.5"
    environment = adapter.environment(spec())
    assert environment["CUDA_VISIBLE_DEVICES"] == "1"
    assert environment["ENGINE_AGENT_NAME"] == "agent-1"
    assert SECRETS.serving in environment.values() and SECRETS.admin in environment.values()
    assert SECRETS.serving not in " ".join(command)


def test_vllm_gets_its_flags_its_api_key_and_a_drain_as_long_as_the_agents() -> None:
    adapter = VllmAdapter(("/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"))
    command = adapter.command(spec())
    assert command[:3] == ["/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--max-model-len") == "512"
    assert flag(command, "--max-num-seqs") == "4"
    assert flag(command, "--max-num-batched-tokens") == "256"
    assert flag(command, "--served-model-name") == "smol"
    assert flag(command, "--shutdown-timeout") == "30"  # SIGTERM drains for this long
    assert flag(command, "--middleware") == "fleet_engine_identity.IdentityMiddleware"
    environment = adapter.environment(spec())
    assert environment["VLLM_API_KEY"] == SECRETS.serving
    # for its GET /identity (the middleware, found on its PYTHONPATH)
    assert environment["ENGINE_ADMIN_SECRET"] == SECRETS.admin
    assert environment["ENGINE_AGENT_NAME"] == "agent-1"
    assert environment["PYTHONPATH"].split(os.pathsep)[0] == str(PLUGINS_DIR)
    assert SECRETS.serving not in " ".join(command) and SECRETS.admin not in " ".join(command)
    with pytest.raises(EngineStartError, match="dtype 'int8': the vllm engine takes"):
        adapter.command(spec(serving_config={**CONFIG, "dtype": "int8"}))


def test_sglang_command_line() -> None:
    command = SglangAdapter().command(spec())
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    assert flag(command, "--model-path") == "/models/smollm2"
    assert flag(command, "--context-length") == "512"
    assert flag(command, "--page-size") == "16"
    assert flag(command, "--max-running-requests") == "4"
    assert flag(command, "--max-prefill-tokens") == "256"
    assert "--enable-metrics" in command
    assert flag(command, "--api-key") == SECRETS.serving  # SGLang reads it nowhere else


def test_llama_cpp_python_command_line() -> None:
    adapter = LlamaCppAdapter(("python3", "-m", "fleet_llama_cpp_server"))
    command = adapter.command(
        spec(model_path=Path("/models/smol.gguf"), engine_args={"cache_type_k": "q8_0"})
    )
    assert command[:3] == ["python3", "-m", "fleet_llama_cpp_server"]
    assert flag(command, "--model") == "/models/smol.gguf"
    assert flag(command, "--n_ctx") == "512"  # one sequence at a time: no slots to share it
    assert flag(command, "--n_batch") == "256"
    assert flag(command, "--model_alias") == "smol"
    assert flag(command, "--n_threads") == "2"
    assert flag(command, "--interrupt_requests") == "false"
    assert flag(command, "--type_k") == "8"  # ggml's number for q8_0
    assert "--dtype" not in command and "--parallel" not in command
    environment = adapter.environment(spec())
    assert environment["API_KEY"] == SECRETS.serving
    assert environment["ENGINE_ADMIN_SECRET"] == SECRETS.admin
    assert environment["PYTHONPATH"].split(os.pathsep)[0] == str(PLUGINS_DIR)
    assert SECRETS.serving not in " ".join(command)


def test_each_engine_gets_its_versions_engine_arguments_as_its_own_flags() -> None:
    vllm = VllmAdapter().command(
        spec(engine="vllm", engine_args={"gpu_memory_percent": 90, "prefix_caching": False})
    )
    assert flag(vllm, "--gpu-memory-utilization") == "0.9"
    assert "--no-enable-prefix-caching" in vllm
    sglang = SglangAdapter().command(
        spec(engine="sglang", engine_args={"tp_size": 2, "radix_cache": False})
    )
    assert flag(sglang, "--tp-size") == "2" and "--disable-radix-cache" in sglang
    llama = LlamaCppAdapter().command(spec(engine="llama.cpp", engine_args={"n_gpu_layers": -1}))
    assert flag(llama, "--n_gpu_layers") == "-1"
    builtin = BuiltinAdapter().command(spec(engine_args={"max_queue": 8}))
    assert flag(builtin, "--max-queue") == "8"


def test_a_key_an_engine_cannot_apply_is_refused() -> None:
    for adapter in (BuiltinAdapter(), VllmAdapter(), SglangAdapter(), LlamaCppAdapter()):
        with pytest.raises(EngineStartError, match="cannot apply: \\['speculative'\\]"):
            adapter.command(spec(serving_config={**CONFIG, "speculative": 4}))
        with pytest.raises(EngineStartError, match="max_num_seqs must be a positive integer"):
            adapter.command(spec(serving_config={**CONFIG, "max_num_seqs": 0}))


def test_an_engine_refuses_a_model_it_cannot_load(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    VllmAdapter().check_model_path(tmp_path)
    with pytest.raises(EngineStartError, match="vllm engine loads a Hugging Face folder"):
        VllmAdapter().check_model_path(gguf)
    with pytest.raises(EngineStartError, match=r"llama\.cpp engine loads a GGUF file"):
        LlamaCppAdapter().check_model_path(tmp_path)
    BuiltinAdapter().check_model_path(gguf)
    BuiltinAdapter().check_model_path(tmp_path)


def test_vllm_metrics_as_it_served_them() -> None:
    snapshot = VllmAdapter().read_metrics(fixture("vllm-0.32.0-cpu.metrics.txt"))
    # 1 chat of 37 prompt tokens, 3 completions of 4: 8 + 8 + 16 + 24 tokens generated
    assert (snapshot.prompt_tokens, snapshot.generation_tokens) == (49, 56)
    assert (snapshot.requests_ok, snapshot.requests_aborted, snapshot.requests_failed) == (4, 0, 0)
    assert (snapshot.running, snapshot.waiting, snapshot.kv_cache_usage) == (0, 0, 0)
    assert snapshot.ttft is not None and snapshot.ttft.count == 4
    assert snapshot.itl is not None and snapshot.itl.count == 56 - 4  # gaps after the first


def test_sglang_metrics_from_its_documented_names() -> None:
    snapshot = SglangAdapter().read_metrics(fixture("sglang.metrics.txt"))
    assert (snapshot.running, snapshot.waiting, snapshot.kv_cache_usage) == (3, 2, 0.25)
    assert (snapshot.prompt_tokens, snapshot.generation_tokens) == (480, 384)
    assert (snapshot.requests_ok, snapshot.requests_aborted) == (12, 1)
    assert snapshot.preemptions == 1
    assert snapshot.ttft is not None and snapshot.ttft.count == 12
    p50 = snapshot.ttft.quantile(0.5)
    assert p50 is not None and 0.1 < p50 <= 0.2  # 4 of 12 under 0.1 s, 10 under 0.2 s
    assert snapshot.itl is not None and snapshot.itl.mean() == pytest.approx(4.65 / 372)


def test_llama_server_metrics_mean_inter_token_latency_from_its_counters() -> None:
    snapshot = read_snapshot(fixture("llamacpp.metrics.txt"), LLAMA_SERVER_METRICS)
    assert (snapshot.running, snapshot.waiting, snapshot.kv_cache_usage) == (2, 1, 0)
    assert (snapshot.prompt_tokens, snapshot.generation_tokens) == (960, 400)
    assert snapshot.ttft is None
    assert snapshot.itl is not None and snapshot.itl.mean() == pytest.approx(10 / 400)
    assert snapshot.itl.quantile(0.95) is None  # no buckets: no percentile


def test_an_openai_endpoint_is_read_with_the_names_of_the_engine_behind_it() -> None:
    adapter = OpenAIAdapter()
    assert adapter.read_metrics(fixture("sglang.metrics.txt")).running == 3
    assert adapter.read_metrics(fixture("llamacpp.metrics.txt")).running == 2
    assert adapter.read_metrics(fixture("vllm-0.32.0-cpu.metrics.txt")).prompt_tokens == 49
    assert adapter.read_metrics("# nothing we know\n").prompt_tokens == 0
    assert adapter.command(spec()) == [] and not adapter.starts_process


def test_metrics_text_that_is_not_prometheus_is_refused() -> None:
    with pytest.raises(MetricsTextError):
        read_snapshot('vllm:num_requests_running{engine="0" 1\n', VLLM_METRICS)


def test_histogram_quantiles_interpolate_within_a_bucket_and_difference_between_scrapes() -> None:
    before = Histogram(buckets=((0.1, 2.0), (0.2, 2.0), (float("inf"), 2.0)), sum=0.1, count=2)
    after = Histogram(buckets=((0.1, 4.0), (0.2, 12.0), (float("inf"), 12.0)), sum=1.5, count=12)
    interval = after.minus(before)
    assert interval.count == 10 and interval.sum == pytest.approx(1.4)
    assert interval.buckets == ((0.1, 2.0), (0.2, 10.0), (float("inf"), 10.0))
    assert interval.quantile(0.5) == pytest.approx(0.1 + 0.1 * (5 - 2) / 8)
    assert interval.quantile(0.1) == pytest.approx(0.05)
    beyond = Histogram(buckets=((0.1, 0.0), (float("inf"), 3.0)), sum=9.0, count=3)
    assert beyond.quantile(0.95) == 0.1  # past the last bound: that bound, as Prometheus says
    reset = Histogram(buckets=((0.1, 1.0), (float("inf"), 1.0)), sum=0.05, count=1)
    assert reset.minus(after) == reset  # a restarted engine counts from zero
    assert Histogram(buckets=(), sum=0, count=0).quantile(0.5) is None


def test_an_openai_endpoint_must_be_one_the_control_plane_routes_to(tmp_path: Path) -> None:
    config = AgentConfig(
        name="agent-1",
        port=18000,
        redis_url="redis://127.0.0.1:1/0",  # never reached: nothing here calls Redis
        control_plane_url="http://127.0.0.1:1",
        token="token",
        state_dir=tmp_path,
    )
    agent = Agent(config)

    def load(base_url: str) -> LoadPayload:
        payload = {
            **LOAD,
            "digest": "",
            "format": "",
            "engine": "openai",
            "engine_args": {"base_url": base_url, "upstream_model": "smol"},
        }
        return parse_load_payload(payload)

    assert agent._external_port(load("http://127.0.0.1:18001/"), [18000, 18001]) == [18001]
    with pytest.raises(CommandFailed, match="is not one of this agent's endpoints"):
        agent._external_port(load("http://127.0.0.1:9000"), [18000, 18001])
