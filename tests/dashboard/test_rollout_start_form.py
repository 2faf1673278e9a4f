"""Starting a rollout from a version's page (Django's test client, real PostgreSQL): who
sees and may post the form, CSRF, refusals shown next to their fields with nothing
created, and a rollout made and audited as `POST /api/v1/rollouts/` makes it."""

import re
from html import unescape

import pytest
from django.test import Client
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.core.roles import Role
from controlplane.registry.models import Artifact, EvalKind, EvalSuite, ModelVersion
from controlplane.rollouts import deployments
from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.rollouts.stages import DEFAULT_POLICY, DEFAULT_STAGES
from tests.dashboard.conftest import SERVING_CONFIG, STAFF_ROLES

FORM = 'class="rollout-start"'


@pytest.fixture
def batch(world):
    """A second deployment of the world's model, with no rollout, stable on f32; acme is
    allowed the model, globex is not; a second suite."""
    world.acme.allowed_models.add(world.stable.model)
    EvalSuite.objects.create(name="latency", kind=EvalKind.QUALITY, dataset="d", metrics=[])
    return deployments.deployment_create(
        actor=None, name="smollm2-batch", stable_version=world.stable
    )


def _url(world) -> str:
    return f"/registry/versions/{world.candidate.pk}/rollouts/"


def _page(world) -> str:
    return f"/registry/versions/{world.candidate.pk}/"


def _plan(**overrides: object) -> dict[str, object]:
    """A valid form: three stages (the first scoped to acme), two suites, one policy field."""
    data: dict[str, object] = {
        "deployment": "smollm2-batch",
        "stages-0-weight": "10",
        "stages-0-min_duration_s": "120",
        "stages-0-min_requests": "40",
        "stages-0-tenants": ["acme"],
        "stages-1-weight": "50",
        "stages-1-min_duration_s": "90.5",
        "stages-1-min_requests": "",
        "stages-4-weight": "100",  # numbers need not follow each other
        "stages-4-min_duration_s": "60",
        "stages-4-min_requests": "100",
        "stages-5-weight": "",  # a blank spare row is no stage
        "stages-5-min_duration_s": "",
        "stages-5-min_requests": "",
        "required_suites": ["capitals", "latency"],
        "policy-ttft_p95_max_ms": "1500",
        "policy-on_inconclusive": "hold",
        "policy-alpha": "",
        "reason": "bf16 halves the memory",
    }
    data.update(overrides)
    return data


def _errors(page: str, name: str) -> list[str]:
    match = re.search(rf'data-error-for="{re.escape(name)}"[^>]*>(.*?)</span></span>', page)
    assert match, f"no errors shown for {name}"
    return [unescape(text) for text in re.findall(r"<span>(.*?)</span>", match[1] + "</span>")]


def _counts() -> tuple[int, int]:
    return Rollout.objects.count(), AuditEvent.objects.count()


@pytest.mark.parametrize("role", STAFF_ROLES)
def test_only_roles_that_steer_rollouts_see_the_form(world, batch, client_for, role) -> None:
    response = client_for(role).get(_page(world))
    assert response.status_code == 200
    may_start = role in {Role.ADMIN, Role.RELEASE_MANAGER}
    assert (FORM in response.content.decode()) is may_start
    assert ("rollout_form.js" in response.content.decode()) is may_start


@pytest.mark.parametrize("role", [Role.ON_CALL, Role.VIEWER, Role.TENANT_MEMBER])
def test_other_roles_cannot_post_it_and_nothing_changes(world, batch, client_for, role) -> None:
    before = _counts()
    response = client_for(role).post(_url(world), _plan())
    assert response.status_code == 403
    assert _counts() == before


def test_anonymous_is_sent_to_login_and_nothing_changes(world, batch) -> None:
    before = _counts()
    response = Client().post(_url(world), _plan())
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    assert _counts() == before


def test_the_form_refuses_a_missing_csrf_token_and_takes_a_valid_one(
    world, batch, client_for
) -> None:
    client = client_for(Role.RELEASE_MANAGER, enforce_csrf_checks=True)
    before = _counts()
    assert client.post(_url(world), _plan()).status_code == 403
    assert _counts() == before
    client.get(_page(world))  # sets the CSRF cookie, as the browser's visit does
    token = client.cookies["csrftoken"].value
    response = client.post(_url(world), {**_plan(), "csrfmiddlewaretoken": token})
    assert response.status_code == 302


def test_the_form_offers_the_models_deployments_the_default_plan_and_allowed_tenants(
    world, batch, client_for
) -> None:
    from controlplane.registry.models import Model

    other = Model.objects.create(name="minilm", task="embedding")
    artifact = Artifact.objects.create(digest="e" * 64, format="gguf", size_bytes=1)
    other_version = ModelVersion.objects.create(
        model=other, label="v1", artifact=artifact, status="verified", serving_config=SERVING_CONFIG
    )
    deployments.deployment_create(actor=None, name="minilm", stable_version=other_version)
    html = client_for(Role.RELEASE_MANAGER).get(_page(world)).content.decode()
    deployments_offered = re.findall(r'<option value="([^"]*)"[^>]*>[^<]*\(stable:', html)
    assert deployments_offered == ["smollm2", "smollm2-batch"]
    assert "a rollout is under way" in html  # smollm2 has one
    for index, stage in enumerate(DEFAULT_STAGES):
        assert f'name="stages-{index}-weight" value="{stage["weight"]}"' in html
        assert f'name="stages-{index}-min_requests" value="{stage["min_requests"]}"' in html
    spare = len(DEFAULT_STAGES)
    assert f'name="stages-{spare}-weight" value=""' in html
    assert re.findall(r'name="stages-0-tenants" value="([^"]*)"', html) == ["acme"]
    for name, default in DEFAULT_POLICY.items():
        if name != "on_inconclusive":
            assert f'name="policy-{name}" value="" placeholder="{default}"' in html
    assert 'value="capitals"' in html and 'value="latency"' in html


def test_a_valid_plan_starts_the_rollout_and_audits_it(world, batch, client_for) -> None:
    manager = world.users[Role.RELEASE_MANAGER]
    response = client_for(Role.RELEASE_MANAGER).post(_url(world), _plan())
    rollout = Rollout.objects.get(deployment=batch)
    assert response.status_code == 302
    assert response["Location"] == f"/rollouts/{rollout.pk}/"
    assert rollout.candidate_id == world.candidate.pk
    assert rollout.baseline_id == world.stable.pk
    assert rollout.state == RolloutState.PENDING
    assert rollout.stages == [
        {"weight": 10, "min_duration_s": 120.0, "min_requests": 40, "tenants": ["acme"]},
        {"weight": 50, "min_duration_s": 90.5, "min_requests": 0, "tenants": []},
        {"weight": 100, "min_duration_s": 60.0, "min_requests": 100, "tenants": []},
    ]
    assert rollout.policy == {
        **DEFAULT_POLICY,
        "ttft_p95_max_ms": 1500.0,
        "on_inconclusive": "hold",
    }
    assert sorted(rollout.required_suites.values_list("name", flat=True)) == [
        "capitals",
        "latency",
    ]
    assert rollout.created_by == manager
    event = AuditEvent.objects.get(action="rollout.create", object_id=str(rollout.pk))
    assert event.actor == manager
    assert event.reason == "bf16 halves the memory"
    assert event.after["stages"] == rollout.stages
    assert event.after["required_suites"] == ["capitals", "latency"]


def test_the_form_and_the_api_make_the_same_rollout(world, batch, client_for) -> None:
    deployments.deployment_create(actor=None, name="smollm2-api", stable_version=world.stable)
    client_for(Role.RELEASE_MANAGER).post(_url(world), _plan())
    api = APIClient()
    api.force_login(world.users[Role.RELEASE_MANAGER])
    response = api.post(
        "/api/v1/rollouts/",
        {
            "deployment": "smollm2-api",
            "candidate": world.candidate.pk,
            "stages": [
                {"weight": 10, "min_duration_s": 120, "min_requests": 40, "tenants": ["acme"]},
                {"weight": 50, "min_duration_s": 90.5},
                {"weight": 100, "min_duration_s": 60, "min_requests": 100},
            ],
            "policy": {"ttft_p95_max_ms": 1500, "on_inconclusive": "hold"},
            "required_suites": ["capitals", "latency"],
            "reason": "bf16 halves the memory",
        },
        format="json",
    )
    assert response.status_code == 201
    from_form = Rollout.objects.get(deployment=batch)
    from_api = Rollout.objects.get(pk=response.json()["id"])
    assert from_form.stages == from_api.stages
    assert from_form.policy == from_api.policy
    events = [
        AuditEvent.objects.get(action="rollout.create", object_id=str(rollout.pk))
        for rollout in (from_form, from_api)
    ]
    assert events[0].actor == events[1].actor
    assert events[0].reason == events[1].reason
    assert {**events[0].after, "id": None} == {**events[1].after, "id": None}


def test_blank_deployment_and_bad_stage_fields_are_shown_next_to_them(
    world, batch, client_for
) -> None:
    before = _counts()
    data = _plan(deployment="", **{"stages-1-weight": "150", "stages-4-min_requests": "-3"})
    response = client_for(Role.RELEASE_MANAGER).post(_url(world), data)
    assert response.status_code == 400
    assert _counts() == before
    html = response.content.decode()
    assert _errors(html, "deployment") == ["This field is required."]
    # Rows come back in order, numbered from 0; what the user typed is kept.
    assert _errors(html, "stages-1-weight") == ["Ensure this value is less than or equal to 100."]
    assert _errors(html, "stages-2-min_requests") == [
        "Ensure this value is greater than or equal to 0."
    ]
    assert (
        'name="stages-1-weight" value="150" aria-label="Canary weight (%)" aria-invalid="true"'
        in html
    )
    assert 'name="stages-2-min_requests" value="-3"' in html
    assert 'name="stages-1-min_duration_s" value="90.5"' in html
    assert 'name="stages-0-tenants" value="acme" checked' in html
    assert 'name="stages-1-tenants" value="acme">' in html
    assert 'name="policy-ttft_p95_max_ms" value="1500"' in html
    assert re.search(r'<option value="hold" selected>hold</option>', html)
    assert 'value="latency" checked' in html
    assert "bf16 halves the memory</textarea>" in html


def test_the_services_refusals_are_shown_next_to_their_fields(world, batch, client_for) -> None:
    client = client_for(Role.RELEASE_MANAGER)
    before = _counts()
    # The last stage must serve every tenant (the plan's own check, in stages.py).
    response = client.post(_url(world), _plan(**{"stages-4-tenants": ["acme"]}))
    assert response.status_code == 400
    assert _errors(response.content.decode(), "stages") == [
        "The last stage must serve every tenant (no tenant list)."
    ]
    # A tenant that no longer exists (a stale page).
    response = client.post(_url(world), _plan(**{"stages-0-tenants": ["acme", "zeta"]}))
    assert _errors(response.content.decode(), "stages") == ["Unknown tenants in stages: zeta."]
    # An analysis policy field out of its range (analysis.AnalysisPolicy's check).
    response = client.post(_url(world), _plan(**{"policy-error_rate_max": "1.5"}))
    assert response.status_code == 400
    html = response.content.decode()
    assert _errors(html, "policy-error_rate_max") == [
        "error_rate_max must be between 0 and 1, got 1.5"
    ]
    assert '<details class="policy" open>' in html
    # Text where a number belongs goes to the same check.
    response = client.post(_url(world), _plan(**{"policy-min_samples": "many"}))
    assert _errors(response.content.decode(), "policy-min_samples") == [
        "min_samples must be an integer >= 1, got 'many'"
    ]
    # A deployment with a rollout under way.
    response = client.post(_url(world), _plan(deployment="smollm2"))
    assert response.status_code == 400
    assert _errors(response.content.decode(), "deployment") == [
        "Deployment 'smollm2' already has an active rollout."
    ]
    # No stage at all.
    blank_rows: dict[str, object] = {key: "" for key in _plan() if key.startswith("stages-")}
    blank_rows.update({"stages-0-tenants": [], "stages-4-tenants": []})
    response = client.post(_url(world), _plan(**blank_rows))
    assert _errors(response.content.decode(), "stages") == [
        "A stage plan is a non-empty list of stages."
    ]
    # A suite that is not registered (a stale page).
    response = client.post(_url(world), _plan(required_suites=["capitals", "gone"]))
    assert _errors(response.content.decode(), "required_suites") == [
        "Object with name=gone does not exist."
    ]
    assert _counts() == before


def test_a_version_that_cannot_be_deployed_gets_no_form(world, batch, client_for) -> None:
    ModelVersion.objects.filter(pk=world.candidate.pk).update(status="registered")
    html = client_for(Role.ADMIN).get(_page(world)).content.decode()
    assert FORM not in html
    assert 'data-testid="rollout-not-deployable"' in html
    before = _counts()
    response = client_for(Role.ADMIN).post(_url(world), _plan())
    assert response.status_code == 400
    assert _counts() == before
    assert 'data-testid="rollout-not-deployable"' in response.content.decode()


def test_canary_replicas_go_with_the_plan_and_a_bad_count_is_shown_by_its_field(
    world, batch, client_for
) -> None:
    client = client_for(Role.RELEASE_MANAGER)
    before = _counts()
    refused = client.post(
        _url(world), _plan(canary_replicas_min="3", canary_replicas_max="2")
    ).content.decode()
    assert _errors(refused, "canary_replicas_min") == [
        "canary_replicas_min (3) is more than canary_replicas_max (2)."
    ]
    assert 'name="canary_replicas_min" value="3"' in refused  # what was typed is kept
    assert _counts() == before
    not_a_number = client.post(_url(world), _plan(canary_replicas_max="two")).content.decode()
    assert _errors(not_a_number, "canary_replicas_max") == [
        "canary_replicas_max must be an integer."
    ]

    response = client.post(_url(world), _plan(canary_replicas_min="2", canary_replicas_max="4"))
    assert response.status_code == 302
    rollout = Rollout.objects.get(deployment=batch)
    assert (rollout.canary_replicas_min, rollout.canary_replicas_max) == (2, 4)
    assert rollout.canary_replicas == 2


def test_a_ticked_shadow_box_makes_a_shadow_stage_and_not_on_the_last_stage(
    world, batch, client_for
) -> None:
    client = client_for(Role.RELEASE_MANAGER)
    html = client.get(_page(world)).content.decode()
    assert 'name="stages-0-shadow" value="1"' in html
    assert 'name="stages-0-shadow" value="1" checked' not in html  # the default plan has none
    before = _counts()
    response = client.post(_url(world), _plan(**{"stages-4-shadow": "1"}))
    assert response.status_code == 400
    page = response.content.decode()
    assert _errors(page, "stages-2") == [
        "the last stage cannot be a shadow stage (the plan must end serving the candidate)."
    ]
    assert 'name="stages-2-shadow" value="1" checked' in page  # what the user ticked stays
    assert _counts() == before

    response = client.post(_url(world), _plan(**{"stages-1-shadow": "1"}))
    assert response.status_code == 302
    rollout = Rollout.objects.get(deployment=batch)
    assert [stage.get("shadow", False) for stage in rollout.stages] == [False, True, False]
    plan = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert [unescape(w) for w in re.findall(r'<span class="weight">(.*?)</span>', plan)] == [
        "10%",
        "50% shadow",
        "100%",
    ]
