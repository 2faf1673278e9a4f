"""deploy/observability checked offline: promtool checks the alert rules and runs their unit
tests and checks both scrape configurations; the Grafana dashboards are well formed and
provisioned; and every query (dashboard panels, template variables, alert and recording
rules) reads only metrics our processes export (tests/deploy/exported_metrics.py), so a
renamed metric fails here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.deploy import exported_metrics

OBSERVABILITY = REPO_ROOT / "deploy" / "observability"
RULES = sorted((OBSERVABILITY / "rules").glob("*.yml"))
RULE_TESTS = sorted((OBSERVABILITY / "rules" / "tests").glob("*.yml"))
DASHBOARDS = sorted((OBSERVABILITY / "grafana" / "dashboards").glob("*.json"))
PROVISIONING = OBSERVABILITY / "grafana" / "provisioning"
COMPOSE: dict = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed: `make promtool` installs it"
)
# The alerts each incident of docs/runbook.md needs (the list).
REQUIRED_ALERTS = {
    "CanaryRolledBack",
    "AgentLost",
    "EngineFailed",
    "IngestLagging",
    "UsageGap",
    "TTFTBudgetBurnFast",
    "TTFTBudgetBurnSlow",
    "ErrorBudgetBurnFast",
    "ErrorBudgetExhausted",
}
# Grafana's own variables, as a query would see them once substituted.
GRAFANA_SUBSTITUTES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def promtool(*args: str | Path, cwd: Path = OBSERVABILITY) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL or "promtool", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def rule_groups(path: Path) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["groups"]


def rules() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, rule) for path in RULES for group in rule_groups(path) for rule in group["rules"]
    ]


def dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and template variable of one dashboard."""
    board = dashboard(path)
    queries = []
    for panel in panels(board):
        for target in panel.get("targets", []):
            queries.append((f"{path.name}: panel {panel['title']!r}", target["expr"]))
    for variable in board.get("templating", {}).get("list", []):
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            expression = exported_metrics.grafana_query_expression(text)
            if expression:
                queries.append((f"{path.name}: variable {variable['name']!r}", expression))
    return queries


def as_plain_promql(expression: str) -> str:
    """A dashboard query with Grafana's variables replaced by values PromQL accepts."""
    for variable, value in GRAFANA_SUBSTITUTES.items():
        expression = expression.replace(variable, value)
    return re.sub(r"\$\{?\w+\}?", "x", expression)


# ---- alert rules ---------------------------------------------------------------------


@needs_promtool
@pytest.mark.parametrize("path", RULES, ids=lambda path: path.name)
def test_promtool_accepts_the_rules(path: Path) -> None:
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_the_rules_unit_tests_pass() -> None:
    assert {test.name for test in RULE_TESTS} >= {f"{rule.stem}_test.yml" for rule in RULES}
    result = promtool("test", "rules", *RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_TESTS), result.stdout


def test_every_alert_is_tested_firing_and_quiet() -> None:
    alerts = {rule["alert"] for _, rule in rules() if "alert" in rule}
    assert alerts >= REQUIRED_ALERTS
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert alerts - firing == set(), "alerts no test shows firing"
    assert alerts - quiet == set(), "alerts no test shows staying quiet"


def test_every_alert_says_how_bad_and_what_to_do() -> None:
    runbook = (REPO_ROOT / "docs" / "runbook.md").read_text()
    anchors = {_anchor(line[3:]) for line in runbook.splitlines() if line.startswith("## ")}
    for path, rule in rules():
        if "alert" not in rule:
            continue
        assert rule["labels"]["severity"] in {"page", "ticket", "warning", "info"}, rule["alert"]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
        document, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert document == "docs/runbook.md", rule["alert"]
        assert anchor in anchors, f"{path.name}: {rule['alert']} names no runbook section"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# ---- scrape configurations -----------------------------------------------------------


@needs_promtool
def test_promtool_accepts_the_compose_configuration_with_its_rules(tmp_path: Path) -> None:
    result = promtool("check", "config", _with_local_rules("prometheus.yml", tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RULES)} rule files found" in result.stdout, result.stdout


@needs_promtool
def test_promtool_accepts_the_kubernetes_configuration(tmp_path: Path) -> None:
    # Debian's promtool is built without Kubernetes discovery: its `kubernetes_sd_configs`
    # become empty static ones for promtool, and their shape is checked here instead.
    config = yaml.safe_load((OBSERVABILITY / "prometheus-kubernetes.yml").read_text())
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [
            {"role": "pod", "namespaces": {"names": ["fleet"]}}
        ]
        job["static_configs"] = []
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = promtool("check", "config", _with_local_rules(path, tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


def _with_local_rules(config_path: str | Path, tmp_path: Path) -> Path:
    """The configuration with its rules read from the repository, as they are mounted."""
    config = yaml.safe_load((OBSERVABILITY / config_path).read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    config["rule_files"] = [str(OBSERVABILITY / "rules" / "*.yml")]
    path = tmp_path / "checked.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_compose_targets_are_the_services_metrics_ports() -> None:
    """Each static target is a service listening on that port, with the option it serves
    /metrics by; every process of ours that serves /metrics is scraped."""
    config = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: [
            target for static in job["static_configs"] for target in static["targets"]
        ]
        for job in config["scrape_configs"]
    }
    assert targets == {
        "web": ["web:8000"],
        "gateway": ["gateway:8001"],
        "ingest": ["ingest:8002"],
        "agent": ["agent1:8102", "agent2:8102", "agent-gpu:8102"],
    }
    listening_option = {"web": "--port", "gateway": "--port", "ingest": "--metrics-port"}
    for job, job_targets in targets.items():
        for target in job_targets:
            service, _, port = target.partition(":")
            command = COMPOSE["services"][service]["command"]
            option = listening_option.get(job, "--http-port")
            assert command[command.index(option) + 1] == port, target
    scraped = {
        target.partition(":")[0] for job_targets in targets.values() for target in job_targets
    }
    serving = {
        name
        for name, service in COMPOSE["services"].items()
        if {"--http-port", "--metrics-port"} & set(service.get("command", []))
        or "uvicorn" in service.get("command", [])
    }
    assert serving == scraped


def test_prometheus_and_grafana_run_in_their_own_profile_with_pinned_images() -> None:
    services = COMPOSE["services"]
    for name in ("prometheus", "grafana"):
        service = services[name]
        assert service["profiles"] == ["observability"]
        image, _, tag = service["image"].partition(":")
        assert image in {"prom/prometheus", "grafana/grafana"}
        assert tag and tag != "latest", service["image"]
        for volume in service["volumes"]:
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (REPO_ROOT / source).exists(), volume
        assert all(port.startswith("127.0.0.1:") for port in service["ports"])
    assert not any(
        "observability" in service.get("profiles", [])
        for name, service in services.items()
        if name not in {"prometheus", "grafana"}
    )


# ---- Grafana -------------------------------------------------------------------------


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboards() -> None:
    (datasource,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "fleet.yml").read_text())[
        "providers"
    ]
    mounts = dict(volume.rsplit(":", 2)[:2] for volume in COMPOSE["services"]["grafana"]["volumes"])
    assert mounts["./deploy/observability/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/observability/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_the_dashboards_are_there_and_well_formed() -> None:
    boards = {path.stem: dashboard(path) for path in DASHBOARDS}
    assert set(boards) == {"fleet", "rollout", "tenant-usage", "engine"}
    assert len({board["uid"] for board in boards.values()}) == len(boards)
    (datasource,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    for name, board in boards.items():
        assert board["title"] and board["panels"], name
        ids = [panel["id"] for panel in panels(board)]
        assert len(ids) == len(set(ids)), f"{name}: panel ids repeat"
        for panel in panels(board):
            if panel["type"] == "row":
                continue
            where = f"{name}: {panel['title']!r}"
            assert panel["datasource"] == {"type": "prometheus", "uid": datasource["uid"]}, where
            assert panel["targets"], where
            assert all(target["expr"].strip() for target in panel["targets"]), where
            assert panel["fieldConfig"]["defaults"]["unit"], f"{where} has no unit"
            if panel["type"] == "timeseries":
                assert panel["fieldConfig"]["defaults"]["custom"]["axisLabel"], where
            position = panel["gridPos"]
            assert position["x"] + position["w"] <= 24, where


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query, as a recording rule, with Grafana's variables filled in."""
    queries = [query for path in DASHBOARDS for query in dashboard_queries(path)]
    group = {
        "name": "dashboards",
        "rules": [
            {"record": f"dashboard_query_{index}", "expr": as_plain_promql(expression)}
            for index, (_, expression) in enumerate(queries)
        ],
    }
    path = tmp_path / "dashboards.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- metric names --------------------------------------------------------------------


@pytest.mark.django_db
def test_every_query_names_only_metrics_the_code_exports() -> None:
    exported = exported_metrics.exported_names()
    recorded = {rule["record"] for _, rule in rules() if "record" in rule}
    queries = [
        (f"{path.name}: {rule.get('alert') or rule.get('record')}", rule["expr"])
        for path, rule in rules()
    ]
    queries += [query for path in DASHBOARDS for query in dashboard_queries(path)]
    unknown: dict[str, list[str]] = {}
    for where, expression in queries:
        names = exported_metrics.promql_metric_names(expression)
        assert names, f"{where} reads no metric: {expression}"
        for name in sorted(names - exported - recorded):
            places = unknown.setdefault(name, [])
            if where not in places:
                places.append(where)
    assert not unknown, "metrics no registry exports:\n" + "\n".join(
        f"  {name}: {', '.join(places)}" for name, places in sorted(unknown.items())
    )


def test_metric_names_are_read_from_promql_not_its_labels_or_functions() -> None:
    expression = (
        'histogram_quantile(0.95, sum by (version, le) (rate(a_bucket{model=~"$model", le="2.0"}'
        "[$__rate_interval]))) / ignoring(instance) group_left b offset 5m > bool 1e3 "
        'or absent(up{job="ingest"} == 1) unless on() c:ratio_rate5m # d'
    )
    assert exported_metrics.promql_metric_names(expression) == {
        "a_bucket",
        "b",
        "up",
        "c:ratio_rate5m",
    }
    assert exported_metrics.grafana_query_expression("label_values(agent_state, instance)") == (
        "agent_state"
    )
    assert exported_metrics.grafana_query_expression("label_values(instance)") == ""
