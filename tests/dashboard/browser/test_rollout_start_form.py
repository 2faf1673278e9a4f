"""Starting a rollout from a version's page in headless Chromium: a release manager edits
the default plan (the page's script adds and removes rows), sees a refusal next to its
field with what they typed kept, fixes it and lands on the new rollout's page.

Screenshots: rollout-start-refused.png, rollout-started.png."""

import re

import pytest

from controlplane.core.roles import Role
from controlplane.rollouts import deployments
from controlplane.rollouts.models import Rollout
from controlplane.rollouts.stages import DEFAULT_STAGES
from tests.dashboard.browser.conftest import off_loop, screenshot
from tests.dashboard.conftest import build_world

pytestmark = pytest.mark.slow


def _batch_deployment(world) -> None:
    world.acme.allowed_models.add(world.stable.model)
    deployments.deployment_create(actor=None, name="smollm2-batch", stable_version=world.stable)


def test_a_release_manager_fixes_a_refused_plan_and_starts_the_rollout(open_page) -> None:
    world = off_loop(build_world)
    off_loop(_batch_deployment, world)
    page = open_page(world.users[Role.RELEASE_MANAGER].username)
    page.goto(f"/registry/versions/{world.candidate.pk}/")
    form = page.locator("form.rollout-start")
    rows = form.locator("tr[data-stage-row]")
    # The script took the blank spare rows away and offers its buttons instead.
    assert rows.count() == len(DEFAULT_STAGES)
    assert form.locator("[data-add-stage]").is_visible()

    form.locator("select[name=deployment]").select_option("smollm2-batch")
    rows.nth(0).locator("input[name$='-weight']").fill("150")
    rows.nth(2).locator("[data-remove-stage]").click()  # the 50 % stage
    rows.nth(2).locator("[data-remove-stage]").click()  # the 100 % stage
    form.locator("[data-add-stage]").click()  # a 100 % stage of its own
    added = rows.nth(2)
    added.locator("input[name$='-weight']").fill("100")
    added.locator("input[name$='-min_requests']").fill("20")
    form.locator("textarea[name=reason]").fill("bf16 halves the memory")
    with page.expect_navigation():
        form.locator("button[type=submit]").click()

    error = page.locator("[data-error-for='stages-0-weight']")
    assert error.inner_text() == "Ensure this value is less than or equal to 100."
    assert page.input_value("input[name='stages-0-weight']") == "150"
    assert page.input_value("textarea[name=reason]") == "bf16 halves the memory"
    assert rows.count() == 3  # the plan as the user left it
    assert not Rollout.objects.filter(deployment__name="smollm2-batch").exists()
    screenshot(page, "rollout-start-refused")

    page.fill("input[name='stages-0-weight']", "10")
    page.check("input[name='stages-0-tenants'][value=acme]")
    page.click("form.rollout-start button[type=submit]")
    page.wait_for_url(re.compile(r"/rollouts/\d+/$"))

    rollout = Rollout.objects.get(deployment__name="smollm2-batch")
    assert page.url.endswith(f"/rollouts/{rollout.pk}/")
    assert rollout.candidate_id == world.candidate.pk
    assert rollout.state_reason == "bf16 halves the memory"
    assert [
        (stage["weight"], stage["min_requests"], stage["tenants"]) for stage in rollout.stages
    ] == [
        (10, 50, ["acme"]),
        (25, 100, []),
        (100, 20, []),
    ]
    assert "started" in page.inner_text(".messages")
    screenshot(page, "rollout-started")
