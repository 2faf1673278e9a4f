"""deploy/k8s is rendered with `kubectl kustomize` and checked offline: every object against
the Kubernetes API schemas (kubernetes-validate), and the product's own invariants."""

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.__main__ import build_parser
from tests.conftest import REPO_ROOT

KUBECTL = shutil.which("kubectl")
OVERLAY_ROOT = REPO_ROOT / "deploy" / "k8s" / "overlays"
OBSERVABILITY = REPO_ROOT / "deploy" / "observability"
pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: the manifests can't be rendered"
)

KUBERNETES_VERSION = "1.32.0"
OVERLAYS = ["cpu-demo", "gpu"]
CONTROL_PLANE = {"web", "gateway", "worker", "beat", "ingest", "migrate"}
PROBELESS = {"worker", "beat", "ingest"}
SECRET_ENVIRONMENT = {
    "SECRET_KEY",
    "DATABASE_URL",
    "REDIS_URL",
    "GATEWAY_REDIS_URL",
    "REDIS_ADMIN_URL",
    "REDIS_CONTROLPLANE_PASSWORD",
    "REDIS_INGEST_PASSWORD",
    "REDIS_GATEWAY_PASSWORD",
    "AGENT_ENROLMENT_TOKEN",
}


@functools.cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    return kustomized(OVERLAY_ROOT / overlay)


def kustomized(root: Path) -> list[dict[str, Any]]:
    output = subprocess.run(
        [KUBECTL or "kubectl", "kustomize", str(root)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [document for document in yaml.safe_load_all(output) if document]


def workloads(overlay: str) -> dict[str, dict[str, Any]]:
    """The pod templates by component (web, agent, migrate, ...)."""
    templates = {}
    for item in rendered(overlay):
        if item["kind"] in {"Deployment", "StatefulSet", "Job"}:
            template = item["spec"]["template"]
            templates[template["metadata"]["labels"]["app.kubernetes.io/component"]] = template
    return templates


def only_container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return container


def of_kind(overlay: str, kind: str) -> dict[str, dict[str, Any]]:
    return {item["metadata"]["name"]: item for item in rendered(overlay) if item["kind"] == kind}


@pytest.mark.parametrize("overlay", [*OVERLAYS, "observability"])
def test_every_object_is_valid_for_the_kubernetes_api(overlay: str) -> None:
    problems = []
    items = kustomized(OBSERVABILITY) if overlay == "observability" else rendered(overlay)
    for item in items:
        try:
            kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{item['kind']}/{item['metadata']['name']}: {error.message}")
    assert problems == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_process_is_there_with_its_image(overlay: str) -> None:
    templates = workloads(overlay)
    assert set(templates) == CONTROL_PLANE | {"agent"}
    for component, template in templates.items():
        image = "fleet-agent:latest" if component == "agent" else "fleet-controlplane:latest"
        assert only_container(template)["image"] == image


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(overlay: str) -> None:
    for template in workloads(overlay).values():
        resources = only_container(template)["resources"]
        assert set(resources["requests"]) >= {"cpu", "memory"}
        assert set(resources["limits"]) >= {"cpu", "memory"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_long_running_containers_have_probes_or_say_why_not(overlay: str) -> None:
    probeless = set()
    for component, template in workloads(overlay).items():
        if component == "migrate":
            continue  # runs to completion
        container = only_container(template)
        if "livenessProbe" in container or "readinessProbe" in container:
            assert "livenessProbe" in container
            assert "readinessProbe" in container
        else:
            annotations = template["metadata"]["annotations"]
            assert annotations["fleet/probes-omitted"]
            # Nothing sends it traffic: its one port, if any, is for Prometheus.
            ports = container.get("ports", [])
            assert [port["name"] for port in ports] in ([], ["metrics"])
            if ports:
                assert annotations["prometheus.io/port"] == str(ports[0]["containerPort"])
            probeless.add(component)
    assert probeless == PROBELESS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_web_gateway_ingest_and_agents_are_scraped_by_prometheus(overlay: str) -> None:
    templates = workloads(overlay)
    scraped = {
        component
        for component, template in templates.items()
        if template["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"
    }
    assert scraped == {"web", "gateway", "ingest", "agent"}
    ports = {"web": "8000", "gateway": "8001", "ingest": "8002", "agent": "8102"}
    for component, port in ports.items():
        annotations = templates[component]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == port
        assert annotations["prometheus.io/path"] == "/metrics"
        # The scrape configuration keeps the container port named http or metrics: the
        # annotated one, and only one per pod.
        kept = [
            container_port["containerPort"]
            for container_port in only_container(templates[component]).get("ports", [])
            if container_port["name"] in {"http", "metrics"}
        ]
        assert kept == [int(port)], component
    command = only_container(templates["ingest"])["command"]
    assert command[command.index("--metrics-port") + 1] == "8002"
    assert command[command.index("--metrics-bind") + 1] == "0.0.0.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_in_the_monitoring_namespace_may_find_and_reach_the_pods(overlay: str) -> None:
    (role,) = of_kind(overlay, "Role").values()
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    (binding,) = of_kind(overlay, "RoleBinding").values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "prometheus", "namespace": "monitoring"}
    ]
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    policies = of_kind(overlay, "NetworkPolicy")
    ingest_rules = policies["ingest-metrics-ingress"]["spec"]["ingress"]
    assert ingest_rules == [{"from": [monitoring], "ports": [{"protocol": "TCP", "port": 8002}]}]
    agent_rules = policies["agent-ingress"]["spec"]["ingress"]
    assert any(
        monitoring in rule["from"] and rule["ports"] == [{"protocol": "TCP", "port": 8102}]
        for rule in agent_rules
    )


def test_the_prometheus_config_map_carries_the_configuration_and_every_rules_file() -> None:
    config_maps = {
        item["metadata"]["name"]: item
        for item in kustomized(OBSERVABILITY)
        if item["kind"] == "ConfigMap"
    }
    assert {item["metadata"]["namespace"] for item in config_maps.values()} == {"monitoring"}
    assert config_maps["fleet-prometheus"]["data"] == {
        "prometheus.yml": (OBSERVABILITY / "prometheus-kubernetes.yml").read_text()
    }
    rules = config_maps["fleet-prometheus-rules"]["data"]
    assert rules == {
        path.name: path.read_text() for path in (OBSERVABILITY / "rules").glob("*.yml")
    }
    # Prometheus looks for pods in the namespace the overlays put them in.
    config = yaml.safe_load(config_maps["fleet-prometheus"]["data"]["prometheus.yml"])
    (scrape,) = config["scrape_configs"]
    assert scrape["kubernetes_sd_configs"][0]["namespaces"]["names"] == sorted(
        {item["metadata"]["namespace"] for item in rendered("gpu")}
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_value_is_in_the_manifests(overlay: str) -> None:
    assert of_kind(overlay, "Secret") == {}
    for template in workloads(overlay).values():
        for variable in only_container(template).get("env", []):
            if variable["name"] in SECRET_ENVIRONMENT:
                assert set(variable) == {"name", "valueFrom"}
                assert set(variable["valueFrom"]) == {"secretKeyRef"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_process_has_its_roles_redis_user(overlay: str) -> None:
    secret_keys = {
        component: {
            variable["name"]: variable["valueFrom"]["secretKeyRef"]["key"]
            for variable in only_container(template).get("env", [])
            if "REDIS" in variable["name"] and variable["name"].endswith("_URL")
        }
        for component, template in workloads(overlay).items()
    }
    assert secret_keys == {
        "web": {
            "REDIS_URL": "REDIS_CONTROLPLANE_URL",
            "GATEWAY_REDIS_URL": "REDIS_GATEWAY_URL",
            "REDIS_ADMIN_URL": "REDIS_ADMIN_URL",
        },
        "gateway": {"REDIS_URL": "REDIS_GATEWAY_URL", "GATEWAY_REDIS_URL": "REDIS_GATEWAY_URL"},
        "worker": {"REDIS_URL": "REDIS_CONTROLPLANE_URL"},
        "beat": {"REDIS_URL": "REDIS_CONTROLPLANE_URL"},
        "ingest": {"REDIS_URL": "REDIS_INGEST_URL"},
        "migrate": {"REDIS_URL": "REDIS_CONTROLPLANE_URL", "REDIS_ADMIN_URL": "REDIS_ADMIN_URL"},
        "agent": {},
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_migration_job_migrates_and_makes_the_redis_users(overlay: str) -> None:
    container = only_container(workloads(overlay)["migrate"])
    assert container["command"] == [
        "sh",
        "-c",
        "python manage.py migrate --noinput && python manage.py redis_users",
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_beat_runs_once(overlay: str) -> None:
    beat = of_kind(overlay, "Deployment")["beat"]
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_web_and_gateway_scale_on_cpu(overlay: str) -> None:
    autoscalers = of_kind(overlay, "HorizontalPodAutoscaler")
    assert {name: item["spec"]["scaleTargetRef"] for name, item in autoscalers.items()} == {
        name: {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        for name in ["web", "gateway"]
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_select_running_pods(overlay: str) -> None:
    budgets = of_kind(overlay, "PodDisruptionBudget")
    selected = {
        budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        for budget in budgets.values()
    }
    assert selected == {"web", "gateway", "worker", "ingest", "agent"}


def agent_options(overlay: str) -> tuple[Any, list[str]]:
    return build_parser().parse_known_args(only_container(workloads(overlay)["agent"])["args"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_agents_drain_within_their_grace_period(overlay: str) -> None:
    options, _ = agent_options(overlay)
    grace_s = workloads(overlay)["agent"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s > options.drain_timeout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_agent_arguments_parse_with_the_agents_own_parser(overlay: str) -> None:
    options, unknown = agent_options(overlay)
    assert options.name == "$(POD_NAME)"
    assert options.advertise_host == "$(POD_IP)"
    assert options.bind_host == "0.0.0.0"
    assert options.port == 8100
    assert options.state_dir == "/var/lib/agent"
    assert options.enrolment_token_file is None
    assert unknown == []
    assert options.http_port == 8102


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_agents_name_address_and_token_come_from_the_pod(overlay: str) -> None:
    template = workloads(overlay)["agent"]
    container = only_container(template)
    fields = {
        variable["name"]: variable["valueFrom"]["fieldRef"]["fieldPath"]
        for variable in container["env"]
    }
    assert fields == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    assert not any("token" in argument.lower() for argument in container["args"])
    assert 'export AGENT_ENROLMENT_TOKEN; fi; exec python -m agent "$@"' in container["command"][2]
    volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
    assert volumes["enrolment"]["secret"]["secretName"] == "fleet-agent-enrolment"
    statefulset = of_kind(overlay, "StatefulSet")["agent"]
    assert [claim["metadata"]["name"] for claim in statefulset["spec"]["volumeClaimTemplates"]] == [
        "state"
    ]


def test_gpu_agents_take_one_gpu_each_on_gpu_nodes() -> None:
    template = workloads("gpu")["agent"]
    resources = only_container(template)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == "1"
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert template["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert template["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_the_cpu_demo_runs_one_agent_without_a_gpu() -> None:
    assert of_kind("cpu-demo", "StatefulSet")["agent"]["spec"]["replicas"] == 1
    for template in workloads("cpu-demo").values():
        resources = only_container(template)["resources"]
        assert "nvidia.com/gpu" not in resources["requests"]
        assert "nvidia.com/gpu" not in resources["limits"]
        assert "nodeSelector" not in template["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_web_gateway_and_worker_reach_engine_ports(overlay: str) -> None:
    policy = of_kind(overlay, "NetworkPolicy")["agent-ingress"]
    engine_rules = [
        rule
        for rule in policy["spec"]["ingress"]
        if {port["port"] for port in rule["ports"]} & {8100, 8101}
    ]
    assert engine_rules == [
        {
            "from": [
                {
                    "podSelector": {
                        "matchExpressions": [
                            {
                                "key": "app.kubernetes.io/component",
                                "operator": "In",
                                "values": ["web", "gateway", "worker"],
                            }
                        ]
                    }
                }
            ],
            "ports": [{"protocol": "TCP", "port": 8100}, {"protocol": "TCP", "port": 8101}],
        }
    ]
    default_deny = of_kind(overlay, "NetworkPolicy")["default-deny-ingress"]
    assert default_deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_agents_reach_redis_and_the_control_plane_but_not_postgresql(overlay: str) -> None:
    policy = of_kind(overlay, "NetworkPolicy")["agent-egress"]
    ports = {port["port"] for rule in policy["spec"]["egress"] for port in rule["ports"]}
    assert ports == {53, 6379, 8000}
