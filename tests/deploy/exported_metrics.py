"""The metric names our processes export, read from their real registries, and the metric
names a PromQL expression reads: what keeps the dashboards and alert rules of
deploy/observability/ honest (tests/deploy/test_observability.py).

The registries: web's, the standalone gateway's and ingest's default registry (every
control-plane module that defines a metric imported), web's database-derived collectors
(`STATE_REGISTRY`, collected from the database, so the caller needs one), an agent's
(agent/metrics.py) and an engine's (engine/metrics.py, which records vLLM's names too).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

REPO_ROOT = Path(__file__).resolve().parents[2]

# Each family's type -> the suffixes of the series it exposes (the text format's).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
# Series Prometheus makes itself for every target, and the alerts' own.
PROMETHEUS_SERIES = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
        "ALERTS",
        "ALERTS_FOR_STATE",
    }
)


def series_names(families: Iterable[Metric]) -> set[str]:
    """Every series name the families expose, with or without samples yet (a labelled
    metric nobody has counted has no sample, but its name is exported all the same)."""
    names: set[str] = set()
    for family in families:
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def import_metric_modules() -> None:
    """Import every control-plane module that defines metrics, so they register in the
    default registry as they do in the processes that import them."""
    import controlplane

    for module in pkgutil.walk_packages(controlplane.__path__, "controlplane."):
        if ".migrations" in module.name or module.ispkg:
            continue
        path = REPO_ROOT / (module.name.replace(".", "/") + ".py")
        if "prometheus_client" in path.read_text():
            importlib.import_module(module.name)


def control_plane_names() -> set[str]:
    """The default registry of web, the standalone gateway and ingest (Django set up)."""
    import_metric_modules()
    return series_names(REGISTRY.collect())


def database_derived_names() -> set[str]:
    """web's collectors counted from rows at scrape time: needs the database."""
    from controlplane.core.state_metrics import STATE_REGISTRY

    return series_names(STATE_REGISTRY.collect())


def agent_names() -> set[str]:
    from agent.metrics import AgentMetrics
    from contracts.streams import AgentState

    return series_names(AgentMetrics(lambda: AgentState.IDLE).registry.collect())


def engine_names() -> set[str]:
    from engine.metrics import EngineMetrics

    metrics = EngineMetrics("model")
    metrics.set_max_model_len(2048)  # the per-request token histograms exist from then on
    return series_names(metrics.registry.collect())


def exported_names() -> set[str]:
    return (
        control_plane_names()
        | database_derived_names()
        | agent_names()
        | engine_names()
        | PROMETHEUS_SERIES
    )


# ---- PromQL -------------------------------------------------------------------------

_KEYWORDS = frozenset(
    {
        "and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
        "group_right", "bool", "offset", "inf", "nan", "atan2",
    }
)  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_COMMENT = re.compile(r"#[^\n]*")
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_LABEL_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# An identifier that is not part of a number (1e3, 5m) or a longer name.
_IDENTIFIER = re.compile(r"(?<![\w:.])[A-Za-z_:][\w:]*")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<query>.*),)?\s*\w+\s*\)\s*$", re.DOTALL)


def promql_metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions or
    aggregations (followed by `(`), keywords, label names (inside `{}` or a `by (...)`
    list), durations or numbers. Grafana's `$variables` are dropped first."""
    text = _COMMENT.sub(" ", _STRING.sub('""', expression))
    text = _GRAFANA_VARIABLE.sub(" ", text)
    text = _LABEL_MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    names: set[str] = set()
    for match in _IDENTIFIER.finditer(text):
        if re.match(r"\s*\(", text[match.end() :]):
            continue  # a function or an aggregation
        if match.group(0) not in _KEYWORDS:
            names.add(match.group(0))
    return names


def grafana_query_expression(query: str) -> str:
    """A template variable's query as PromQL: `label_values(metric, label)` reads `metric`,
    `label_values(label)` no metric at all."""
    match = _LABEL_VALUES.match(query)
    return (match.group("query") or "") if match else query
