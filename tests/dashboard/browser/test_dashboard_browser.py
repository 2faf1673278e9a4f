"""The dashboard in headless Chromium against the real ASGI app: log in as each role, live
updates over the websocket without reload, roll back with a reason, tenant isolation, CSRF.

Each test writes screenshots to test-artifacts/screenshots/."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.core.events import FLEET_LIVE_GROUP, publish_event
from controlplane.core.roles import Role
from controlplane.rollouts import hooks, transitions
from controlplane.rollouts.models import AnalysisRun, Rollout, RolloutState
from tests.dashboard.browser.conftest import off_loop, screenshot, wait_live
from tests.dashboard.conftest import build_world

pytestmark = pytest.mark.slow

NAV = {
    Role.ADMIN: ["overview", "rollouts", "registry", "fleet", "tenants", "audit"],
    Role.RELEASE_MANAGER: ["overview", "rollouts", "registry", "fleet", "tenants", "audit"],
    Role.ON_CALL: ["overview", "rollouts", "registry", "fleet", "tenants", "audit"],
    Role.VIEWER: ["overview", "rollouts", "registry", "fleet", "tenants", "audit"],
    Role.TENANT_MEMBER: ["tenants", "audit"],
}


def _nav(page) -> list[str]:
    return page.eval_on_selector_all("nav a[data-nav]", "links => links.map(a => a.dataset.nav)")


def test_each_role_logs_in_and_sees_its_pages(open_page) -> None:
    world = off_loop(build_world)
    for role, expected_nav in NAV.items():
        page = open_page(world.users[role].username)
        assert page.inner_text("[data-testid=role]") == Role(role).label
        assert _nav(page) == expected_nav
        wait_live(page)
        if role == Role.TENANT_MEMBER:
            assert page.url.endswith(f"/tenants/{world.acme.pk}/")
            continue
        assert page.inner_text("[data-testid=agents-ready]") == "2/2"
        screenshot(page, f"overview-{role}")
        if role == Role.VIEWER:
            page.goto(f"/rollouts/{world.rollout.pk}/")
            assert page.locator(".actions button").count() == 0
    # Every page once, as the admin.
    page = open_page(world.users[Role.ADMIN].username)
    pages = {
        "rollouts": "/rollouts/",
        "rollout-detail": f"/rollouts/{world.rollout.pk}/",
        "registry": "/registry/",
        "registry-compare": f"/registry/compare/?a={world.stable.pk}&b={world.candidate.pk}",
        "version-detail": f"/registry/versions/{world.candidate.pk}/",
        "fleet": "/fleet/",
        "tenants": "/tenants/",
        "tenant-detail-admin": f"/tenants/{world.acme.pk}/",
        "audit": "/audit/?action=rollout.",
    }
    for name, url in pages.items():
        response = page.goto(url)
        assert response.status == 200, url
        if name == "rollout-detail":
            page.wait_for_selector("#rollout-page[data-chart-runs='6']")
        if name == "registry-compare":  # label, digest, signature's base, dtype differ
            assert page.locator("#compare tr.differs").count() >= 3
        screenshot(page, name)


def test_stage_change_and_verdict_arrive_live_without_reload(open_page) -> None:
    world = off_loop(build_world)
    page = open_page(world.users[Role.RELEASE_MANAGER].username)
    page.goto(f"/rollouts/{world.rollout.pk}/")
    wait_live(page)
    page.wait_for_selector("#rollout-page[data-chart-runs='6']")
    page.evaluate("window.__sameDocument = 'yes'")
    assert page.get_attribute("[data-testid=rollout-stage]", "data-stage-index") == "0"

    off_loop(
        transitions.rollout_advance,
        actor=world.users[Role.RELEASE_MANAGER],
        rollout_id=world.rollout.pk,
        reason="stage 1 held its SLOs",
    )
    page.wait_for_selector("[data-testid=rollout-stage][data-stage-index='1']", timeout=3000)
    assert page.inner_text(".stage.current .weight") == "25%"
    assert page.inner_text("[data-testid=state-reason]") == "stage 1 held its SLOs"

    # An analysis verdict: the run appears in the table and the charts gain a point.
    rollout = Rollout.objects.get(pk=world.rollout.pk)
    end = timezone.now()
    run = AnalysisRun.objects.create(
        rollout=rollout,
        stage_index=1,
        attempt=1,
        window_start=end - timedelta(seconds=60),
        window_end=end,
        baseline={"requests": 200, "errors": 0, "error_rate": 0.0, "ttft_p95_ms": 190.0},
        canary={"requests": 80, "errors": 9, "error_rate": 0.1125, "ttft_p95_ms": 640.0},
        tests={},
        verdict="fail",
        reasons=["error rate 0.113 is over the limit 0.05"],
        action="rollback",
    )
    payload = hooks.rollout_event_payload(rollout, "rollout.analysis", analysis_run_id=run.pk)
    off_loop(publish_event, "live.rollouts", "rollout.analysis", payload)
    page.wait_for_selector(f"tr[data-run='{run.pk}'] .verdict-fail", timeout=3000)
    page.wait_for_selector("#rollout-page[data-chart-runs='7']", timeout=3000)
    assert page.evaluate("window.__sameDocument") == "yes"
    screenshot(page, "rollout-live-stage-2")


def test_heartbeat_figures_arrive_live_on_the_fleet_page(open_page) -> None:
    world = off_loop(build_world)
    page = open_page(world.users[Role.ON_CALL].username)
    page.goto("/fleet/")
    wait_live(page)
    page.evaluate("window.__sameDocument = 'yes'")
    cell = "tr[data-agent='agent-2'] [data-figure=running]"
    assert page.inner_text(cell) == "3"
    off_loop(
        publish_event,
        FLEET_LIVE_GROUP,
        "fleet.figures",
        {
            "agents": {
                "agent-2": {"running": 7, "waiting": 4, "kv_cache_usage": 0.9, "power_watts": 301}
            },
            "truncated": False,
        },
    )
    page.wait_for_function(f"document.querySelector(\"{cell}\").textContent === '7'", timeout=3000)
    assert page.inner_text("tr[data-agent='agent-2'] [data-figure=kv_cache_usage]") == "90%"
    assert page.inner_text("tr[data-agent='agent-2'] [data-figure=power_watts]") == "301 W"
    # Each sparkline gained the heartbeat as its newest point.
    running = page.locator("tr[data-agent='agent-2'] div.spark[data-spark-key=running_max]")
    assert running.evaluate("spark => Array.from(spark.uplot.data[1]).slice(-2)") == [4, 7]
    assert page.evaluate("window.__sameDocument") == "yes"
    screenshot(page, "fleet-live")


def test_roll_back_from_the_rollout_page(open_page) -> None:
    world = off_loop(build_world)
    page = open_page(world.users[Role.ON_CALL].username)
    page.goto(f"/rollouts/{world.rollout.pk}/")
    assert page.locator(".actions button[data-action]").evaluate_all(
        "buttons => buttons.map(b => b.dataset.action)"
    ) == ["pause", "rollback"]
    page.click("button[data-action=rollback]")
    dialog = page.locator("#dialog-rollback")
    assert dialog.is_visible()
    # The reason is required: confirming without one leaves the dialog open, nothing sent.
    dialog.locator("button[data-confirm=rollback]").click()
    assert dialog.is_visible()
    dialog.locator("textarea[name=reason]").fill("TTFT p95 doubled on the canary")
    screenshot(page, "rollback-confirm")
    dialog.locator("button[data-confirm=rollback]").click()
    page.wait_for_selector("[data-testid=rollout-state][data-state=rolled_back]")
    assert "is Rolled back" in page.inner_text(".messages")
    history = page.locator("#rollout-history tr[data-audit-action='rollout.rollback']")
    assert "TTFT p95 doubled on the canary" in history.inner_text()
    assert "on-call" in history.inner_text()
    assert page.locator(".actions button[data-action]").count() == 0
    screenshot(page, "rollback-done")

    rollout = Rollout.objects.get(pk=world.rollout.pk)
    assert rollout.state == RolloutState.ROLLED_BACK
    event = AuditEvent.objects.get(action="rollout.rollback")
    assert (event.actor_name, event.reason) == ("on-call", "TTFT p95 doubled on the canary")


def test_tenant_member_sees_usage_and_not_another_tenant(open_page) -> None:
    world = off_loop(build_world)
    page = open_page(world.users[Role.TENANT_MEMBER].username)
    assert page.url.endswith(f"/tenants/{world.acme.pk}/")
    assert page.inner_text("h1").startswith("Acme Corp")
    # Bars for every hour of the last 2 days; one series per version: smollm2:bf16, smollm2:f32.
    page.wait_for_selector("#usage-charts figure[data-measure=tokens][data-points='49']")
    legend = page.locator("#usage-charts figure[data-measure=tokens] .u-legend .u-label")
    assert legend.all_inner_texts()[1:] == ["smollm2:bf16 (canary)", "smollm2:f32 (baseline)"]
    assert page.inner_text("[data-testid=total-requests]") != "0"
    screenshot(page, "tenant-usage")

    page.fill("#create-key input[name=name]", "ci-pipeline")
    page.click("#create-key button[type=submit]")
    raw_key = page.inner_text("[data-testid=raw-key]")
    assert raw_key.startswith("sk-")
    screenshot(page, "tenant-key-created")
    page.goto(f"/tenants/{world.acme.pk}/")
    assert raw_key not in page.content()

    response = page.goto(f"/tenants/{world.globex.pk}/")
    assert response.status == 404
    assert "Globex" not in page.content()
    response = page.goto(f"/rollouts/{world.rollout.pk}/")
    assert response.status == 403


def test_forms_refuse_a_missing_csrf_token_in_the_browser(open_page) -> None:
    world = off_loop(build_world)
    page = open_page(world.users[Role.ADMIN].username)
    page.goto(f"/rollouts/{world.rollout.pk}/")
    with page.expect_response(lambda response: "/rollback/" in response.url) as answer:
        page.evaluate(
            """() => {
                const form = document.querySelector('#dialog-rollback form');
                form.querySelector('input[name=csrfmiddlewaretoken]').remove();
                form.querySelector('textarea[name=reason]').value = 'no token';
                form.submit();
            }"""
        )
    assert answer.value.status == 403
    assert Rollout.objects.get(pk=world.rollout.pk).state == RolloutState.RUNNING
    assert not AuditEvent.objects.filter(action="rollout.rollback").exists()


def test_undo_a_promotion_from_the_deployment_page(open_page) -> None:
    world = off_loop(build_world)
    off_loop(
        transitions.rollout_advance,
        actor=world.users[Role.RELEASE_MANAGER],
        rollout_id=world.rollout.pk,
        reason="bf16 held its SLOs",
        full=True,
    )
    page = open_page(world.users[Role.ON_CALL].username)
    page.goto("/rollouts/")
    page.click("a[href='/deployments/smollm2/']")
    assert page.get_attribute("[data-testid=stable-version]", "data-version-id") == str(
        world.candidate.pk
    )
    assert "bf16 held its SLOs" in page.inner_text("#revisions tr[data-source=promote]")
    # Without a reason: refused next to the form, nothing changed.
    page.click("button[data-action=undo]")
    assert page.inner_text("[data-testid=undo-error]") == "A reason is required."
    assert not AuditEvent.objects.filter(action="deployment.undo").exists()
    page.fill("#undo textarea[name=reason]", "bf16 answers worse since the promotion")
    screenshot(page, "undo-confirm")
    page.click("button[data-action=undo]")
    page.wait_for_selector(f"[data-testid=stable-version][data-version-id='{world.stable.pk}']")
    assert "smollm2 is back on f32: it takes the traffic" in page.inner_text(".messages")
    latest = page.locator("#revisions tbody tr").first
    assert latest.get_attribute("data-source") == "undo"
    assert "on-call" in latest.inner_text()
    assert "bf16 answers worse since the promotion" in latest.inner_text()
    screenshot(page, "undo-done")
    event = AuditEvent.objects.get(action="deployment.undo")
    assert (event.actor_name, event.reason) == ("on-call", "bf16 answers worse since the promotion")
