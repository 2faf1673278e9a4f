"""Engine adapters: one module per serving engine behind one interface (base.py).

`adapter_for(name)` gives the adapter of a version's engine; the names are the load
command's `engine` values (contracts.engines.ENGINES).
"""

from __future__ import annotations

from agent.engines.base import EngineAdapter, EngineSpec, EngineStartError, Readiness
from agent.engines.builtin import BuiltinAdapter
from agent.engines.llamacpp import LlamaCppAdapter
from agent.engines.openai import OpenAIAdapter
from agent.engines.sglang import SglangAdapter
from agent.engines.vllm import VllmAdapter
from contracts.engines import ENGINES

ADAPTERS: dict[str, type[EngineAdapter]] = {
    adapter.name: adapter
    for adapter in (BuiltinAdapter, VllmAdapter, SglangAdapter, LlamaCppAdapter, OpenAIAdapter)
}
assert set(ADAPTERS) == set(ENGINES), "an engine name without its adapter"


def adapter_for(name: str, command: tuple[str, ...] | None = None) -> EngineAdapter:
    """The adapter for engine `name`, started with `command` instead of its default."""
    try:
        adapter = ADAPTERS[name]
    except KeyError:
        raise EngineStartError(f"engine {name!r} is not one of {sorted(ADAPTERS)}") from None
    return adapter(command)


__all__ = [
    "ADAPTERS",
    "EngineAdapter",
    "EngineSpec",
    "EngineStartError",
    "Readiness",
    "adapter_for",
]
