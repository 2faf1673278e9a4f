"""What the dashboard's charts are drawn from, over HTTP: the rollout series with its policy's
limits, usage with a value for every bucket of the span and each version's role, and the
fleet sparklines' timed points."""

import html
import itertools
import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from controlplane.core.roles import Role
from controlplane.rollouts import transitions
from controlplane.rollouts.models import Rollout
from controlplane.tenants.models import UsageRecord

pytestmark = pytest.mark.django_db


def test_series_carries_the_policy_limits_with_defaults_and_the_version_labels(
    world, client_for
) -> None:
    rollout = Rollout.objects.get(pk=world.rollout.pk)
    Rollout.objects.filter(pk=rollout.pk).update(policy={"ttft_p95_max_ms": 8640.0})
    data = client_for(Role.VIEWER).get(f"/rollouts/{rollout.pk}/series.json").json()
    assert data["versions"] == {"baseline": "f32", "canary": "bf16"}
    limits = {signal["key"]: signal["limit"] for signal in data["signals"]}
    # The rollout's own limit, and the defaults for those it leaves out (5 % in percent).
    assert limits == {
        "ttft_p95_ms": 8640.0,
        "itl_p95_ms": 500.0,
        "error_rate": 5.0,
        "joules_per_token": None,
    }
    ends = [run.window_end for run in rollout.analysis_runs.order_by("window_end")]
    assert data["times"] == [end.isoformat() for end in ends]


def _floor(moment: datetime, step: timedelta) -> datetime:
    seconds = step.total_seconds()
    return datetime.fromtimestamp(moment.timestamp() // seconds * seconds, UTC)


@pytest.mark.parametrize(
    ("granularity", "step", "buckets"),
    [
        ("minute", timedelta(minutes=1), 121),
        ("hour", timedelta(hours=1), 49),
        ("day", timedelta(days=1), 31),
    ],
)
def test_usage_has_a_value_for_every_bucket_and_each_versions_role(
    world, client_for, granularity, step, buckets
) -> None:
    before = timezone.now()
    response = client_for(Role.VIEWER).get(
        f"/tenants/{world.acme.pk}/", {"granularity": granularity}
    )
    after = timezone.now()
    series = response.context["usage_series"]
    times = [datetime.fromisoformat(text) for text in series["times"]]
    assert (series["granularity"], series["step_s"], len(times)) == (
        granularity,
        step.total_seconds(),
        buckets,
    )
    assert all(later - earlier == step for earlier, later in itertools.pairwise(times))
    assert _floor(before, step) <= times[-1] <= _floor(after, step)

    # Each record counted in the bucket its minute falls in, nothing elsewhere.
    expected: dict[str, list[float]] = {}
    for record in UsageRecord.objects.filter(tenant=world.acme).select_related("version"):
        tokens = expected.setdefault(f"smollm2:{record.version.label}", [0.0] * buckets)
        bucket = _floor(record.minute, step)
        if bucket >= times[0]:
            tokens[times.index(bucket)] += record.prompt_tokens + record.completion_tokens
    assert {item["name"]: item["tokens"] for item in series["series"]} == expected
    assert [(item["name"], item["role"]) for item in series["series"]] == [
        ("smollm2:bf16", "canary"),
        ("smollm2:f32", "baseline"),
    ]


def test_usage_roles_end_with_the_rollout(world, client_for) -> None:
    transitions.rollout_abort(
        actor=world.users[Role.ADMIN], rollout_id=world.rollout.pk, reason="not now"
    )
    response = client_for(Role.VIEWER).get(f"/tenants/{world.acme.pk}/")
    assert [item["role"] for item in response.context["usage_series"]["series"]] == [None, None]


def test_fleet_sparklines_carry_timed_points_a_unit_and_their_window(world, client_for) -> None:
    page = client_for(Role.ON_CALL).get("/fleet/").content.decode()
    sparks = re.findall(r'<div class="spark"[^>]*>', page)
    assert len(sparks) == 8  # two agents, four figures each

    def attribute(tag: str, name: str) -> str:
        match = re.search(rf'{name}="([^"]*)"', tag)
        assert match, (name, tag)
        return html.unescape(match.group(1))

    units = {attribute(tag, "data-spark-key"): attribute(tag, "data-unit") for tag in sparks}
    assert units == {
        "kv_cache_usage_max": "percent",
        "running_max": "requests",
        "waiting_max": "requests",
        "power_watts_max": "watts",
    }
    running = next(tag for tag in sparks if 'data-spark-key="running_max"' in tag)
    assert attribute(running, "data-window-s") == "600.0"
    points = json.loads(attribute(running, "data-points"))
    assert [value for _, value in points] == [index % 5 for index in range(30)]
    assert all(later - earlier == 10 for (earlier, _), (later, _) in itertools.pairwise(points))
    assert timezone.now().timestamp() - 600 < points[0][0]
