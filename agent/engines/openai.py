"""An OpenAI-compatible server already running, that the agent neither starts nor stops.

Its address is the version's `engine_args.base_url` (signed with the version; the agent
accepts only one of its own endpoints). The agent supervises it (GET /v1/models with its
API key answers 200: ready) and measures it from its /metrics when it has one, read with
the series of whichever engine it is (vllm:*, sglang:* or llamacpp:*: the first family
present). Routing to it stops when the agent drains; the server itself keeps running. An
openai version has no artifact: the server serves whatever model it was started with.
"""

from __future__ import annotations

from agent.engines.base import DrainMethod, EngineAdapter, EngineSpec
from agent.engines.llamacpp import LLAMA_SERVER_METRICS
from agent.engines.prometheus import MetricNames, MetricsSnapshot, read_snapshot
from agent.engines.sglang import SGLANG_METRICS
from agent.engines.vllm import VLLM_METRICS

# metric name prefix -> the series that engine exports
KNOWN_METRICS: tuple[tuple[str, MetricNames], ...] = (
    ("vllm:", VLLM_METRICS),
    ("sglang:", SGLANG_METRICS),
    ("llamacpp:", LLAMA_SERVER_METRICS),
)


class OpenAIAdapter(EngineAdapter):
    name = "openai"
    metric_names = VLLM_METRICS
    drain_method = DrainMethod.NONE
    health_path = "/v1/models"
    starts_process = False

    def default_command(self) -> tuple[str, ...]:
        return ()

    def arguments(self, spec: EngineSpec) -> list[str]:
        return []

    def read_metrics(self, text: str) -> MetricsSnapshot:
        for prefix, names in KNOWN_METRICS:
            if f"\n{prefix}" in text or text.startswith(prefix):
                return read_snapshot(text, names)
        return MetricsSnapshot()
