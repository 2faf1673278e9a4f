"""The dashboard's charts as drawn in headless Chromium: time along x, units on the axes, a
y scale fitted to the data (the SLO drawn when in range, reported off-scale otherwise), the
same colour for a role on every page, usage as bars per bucket, fleet sparklines with a
time span. uPlot draws on a canvas, so the tests read the instance (figure.uplot), the
labels charts.js records on the element, and the legend's DOM.

Screenshots: test-artifacts/screenshots/charts-*.png."""

import itertools
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.core.roles import Role
from controlplane.rollouts.models import AnalysisRun, Rollout
from tests.dashboard.browser.conftest import off_loop, screenshot, wait_live
from tests.dashboard.conftest import World, build_world

pytestmark = pytest.mark.slow

RUNS = 6
CANARY_TTFT_MS = 115.0
BASELINE_TTFT_MS = 391.0
TTFT_LIMIT_MS = 8640.0

# What a chart says about itself: its uPlot scales and axis labels, what charts.js
# recorded, and the legend's rows (label, value, marker colour).
READ_CHART = """figure => {
    const u = figure.uplot;
    const rows = [...figure.querySelectorAll('.u-legend tr.u-series')].slice(1);
    return {
        canvas: figure.querySelectorAll('canvas').length,
        x: {time: u.scales.x.time, min: u.scales.x.min, max: u.scales.x.max,
            label: u.axes[0].label},
        y: {min: u.scales.y.min, max: u.scales.y.max, label: u.axes[1].label},
        xTicks: figure.dataset.xTicks.split('|'),
        yTicks: figure.dataset.yTicks.split('|'),
        limit: figure.dataset.limit,
        note: (figure.querySelector('.chart-note') || {}).textContent || null,
        times: Array.from(u.data[0]),
        legend: rows.map(row => ({
            role: [...row.classList].filter(name => name.startsWith('role-')).join(''),
            label: row.querySelector('.u-label').textContent,
            value: row.querySelector('.u-value').textContent,
            colour: getComputedStyle(row.querySelector('.u-marker')).borderTopColor,
        })),
    };
}"""
ROLE_COLOURS = """() => {
    const probe = document.createElement('span');
    document.body.appendChild(probe);
    const root = getComputedStyle(document.documentElement);
    const colours = {};
    for (const role of ['baseline', 'canary']) {
        probe.style.color = root.getPropertyValue('--' + role);
        colours[role] = getComputedStyle(probe).color;
    }
    probe.remove();
    return colours;
}"""
STRICT_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self' ws: wss:"
)
CLOCK = re.compile(r"^\d\d:\d\d(:\d\d)?( [A-Z][a-z]{2} \d{1,2})?$")


def _world_with_runs() -> tuple[World, list[float]]:
    """The dashboard world; the rollout's runs have TTFT p95 canary 115 ms, baseline 391 ms
    under a limit of 8,640 ms, and inter-token latency near its 500 ms limit."""
    world = build_world(analysis_runs=0)
    rollout = Rollout.objects.get(pk=world.rollout.pk)
    Rollout.objects.filter(pk=rollout.pk).update(
        policy={**rollout.policy, "ttft_p95_max_ms": TTFT_LIMIT_MS}
    )
    now = timezone.now().replace(microsecond=0)
    ends = []
    for index in range(RUNS):
        end = now - timedelta(seconds=60 * (RUNS - index))
        ends.append(end.timestamp())
        AnalysisRun.objects.create(
            rollout=rollout,
            stage_index=0,
            attempt=1,
            window_start=end - timedelta(seconds=60),
            window_end=end,
            baseline={
                "requests": 120,
                "errors": 0,
                "error_rate": 0.0,
                "ttft_p95_ms": BASELINE_TTFT_MS,
                "itl_p95_ms": 380.0,
                "joules_per_token": 0.9,
            },
            canary={
                "requests": 40,
                "errors": 0,
                "error_rate": 0.0,
                "ttft_p95_ms": CANARY_TTFT_MS + index,
                "itl_p95_ms": 400.0 + 5 * index,
                "joules_per_token": 0.7,
            },
            tests={},
            verdict="pass",
            reasons=[],
            action="continue",
        )
    return world, ends


def _with_strict_csp(route) -> None:
    response = route.fetch()
    headers = {**response.headers, "content-security-policy": STRICT_CSP}
    route.fulfill(response=response, headers=headers)


def _read(page, selector: str) -> dict:
    return page.locator(selector).evaluate(READ_CHART)


def _assert_time_ticks(ticks: list[str]) -> None:
    """Clock times (the date on the first and at each new day), each unlike the one before."""
    assert len(ticks) >= 3, ticks
    assert all(before != after for before, after in itertools.pairwise(ticks)), ticks
    assert all(CLOCK.match(tick) for tick in ticks), ticks


def test_rollout_usage_and_fleet_charts_read(open_page) -> None:
    world, ends = off_loop(_world_with_runs)
    page = open_page(world.users[Role.ADMIN].username)

    # Under a strict Content-Security-Policy the charts draw: they need no inline script or
    # style. (Chromium keeps a page that Playwright fulfilled off 127.0.0.1's websocket,
    # so the rest of the test loads the page as served.)
    violations: list[str] = []
    page.on(
        "console",
        lambda message: (
            violations.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )
    page.route(f"**/rollouts/{world.rollout.pk}/", _with_strict_csp)
    page.goto(f"/rollouts/{world.rollout.pk}/")
    page.wait_for_selector("figure[data-signal=itl_p95_ms][data-limit=drawn] canvas")
    assert violations == []
    page.unroute(f"**/rollouts/{world.rollout.pk}/")

    # Rollout: time on x from the first run's window end to the last, y fitted to the data.
    page.goto(f"/rollouts/{world.rollout.pk}/")
    wait_live(page)
    page.wait_for_selector(f"#rollout-page[data-chart-runs='{RUNS}']")
    colours = page.evaluate(ROLE_COLOURS)
    ttft = _read(page, "figure[data-signal=ttft_p95_ms]")
    assert ttft["canvas"] >= 1
    assert ttft["x"] == {"time": True, "min": ends[0], "max": ends[-1], "label": "time (UTC)"}
    assert ttft["times"] == ends
    _assert_time_ticks(ttft["xTicks"])
    assert ttft["y"]["label"] == "ms" and ttft["y"]["min"] == 0
    assert BASELINE_TTFT_MS < ttft["y"]["max"] < 500  # not the 8,640 ms limit
    assert ttft["limit"] == "off-scale"
    assert ttft["note"] == "The SLO limit, 8,640 ms, is above this scale."
    # The legend shows the latest run; one colour per role.
    assert ttft["legend"] == [
        {
            "role": "role-baseline",
            "label": "baseline f32",
            "value": "391 ms",
            "colour": colours["baseline"],
        },
        {
            "role": "role-canary",
            "label": "canary bf16",
            "value": "120 ms",
            "colour": colours["canary"],
        },
    ]
    itl = _read(page, "figure[data-signal=itl_p95_ms]")
    assert itl["limit"] == "drawn" and 500 <= itl["y"]["max"] < 600
    assert itl["note"] == "Dashed: the SLO limit, 500 ms."
    assert _read(page, "figure[data-signal=error_rate]")["y"]["label"] == "%"
    assert _read(page, "figure[data-signal=joules_per_token]")["y"]["label"] == "J/token"

    # Hovering the first run shows its values in every chart's legend (a shared cursor).
    plot = page.locator("figure[data-signal=ttft_p95_ms] .u-over")
    box = plot.bounding_box()
    left = page.locator("figure[data-signal=ttft_p95_ms]").evaluate(
        f"figure => figure.uplot.valToPos({ends[0]}, 'x')"
    )
    page.mouse.move(box["x"] + left + 1, box["y"] + box["height"] / 2)
    page.wait_for_function(
        "() => document.querySelector('figure[data-signal=itl_p95_ms] "
        ".u-legend tr.role-canary .u-value').textContent === '400 ms'"
    )
    assert _read(page, "figure[data-signal=ttft_p95_ms]")["legend"][1]["value"] == "115 ms"
    screenshot(page, "charts-rollout")

    # Usage: stacked bars per hour over 2 days (48 buckets and the current one).
    page.goto(f"/tenants/{world.acme.pk}/")
    page.wait_for_selector("#usage-charts figure[data-measure=tokens][data-points='49']")
    tokens = _read(page, "#usage-charts figure[data-measure=tokens]")
    steps = [later - earlier for earlier, later in itertools.pairwise(tokens["times"])]
    assert steps == [3600] * 48
    assert tokens["x"]["label"] == "time (UTC)" and tokens["y"]["label"] == "tokens per hour"
    _assert_time_ticks(tokens["xTicks"])
    assert tokens["limit"] == "none"
    # The rollout's baseline and canary have the colours they have on the rollout page.
    assert [(row["role"], row["label"], row["colour"]) for row in tokens["legend"]] == [
        ("role-canary", "smollm2:bf16 (canary)", ttft["legend"][1]["colour"]),
        ("role-baseline", "smollm2:f32 (baseline)", ttft["legend"][0]["colour"]),
    ]
    energy = _read(page, "#usage-charts figure[data-measure=energy_joules]")
    assert energy["y"]["label"] == "J per hour"
    assert energy["legend"][0]["value"].endswith(" J")
    screenshot(page, "charts-usage-hour")

    page.goto(f"/tenants/{world.acme.pk}/?granularity=minute")
    page.wait_for_selector("#usage-charts figure[data-measure=requests][data-points='121']")
    requests = _read(page, "#usage-charts figure[data-measure=requests]")
    assert requests["times"][1] - requests["times"][0] == 60
    assert requests["y"]["label"] == "requests per minute"
    _assert_time_ticks(requests["xTicks"])
    screenshot(page, "charts-usage-minute")

    # Fleet: each sparkline spans the last 10 minutes with times and units on its axes.
    page.goto("/fleet/")
    page.wait_for_function("document.querySelectorAll('div.spark canvas').length >= 8")
    sparks = page.eval_on_selector_all(
        "div.spark",
        """sparks => sparks.map(spark => ({
            key: spark.dataset.sparkKey,
            span: spark.uplot.scales.x.max - spark.uplot.scales.x.min,
            points: spark.uplot.data[0].length,
            xTicks: spark.dataset.xTicks.split('|'),
            yTicks: spark.dataset.yTicks.split('|'),
        }))""",
    )
    assert len(sparks) == 8
    for spark in sparks:
        assert round(spark["span"]) == 600 and spark["points"] == 30
        _assert_time_ticks(spark["xTicks"])
        suffix = {"kv_cache_usage_max": "%", "power_watts_max": " W"}.get(spark["key"], " req")
        assert all(tick.endswith(suffix) for tick in spark["yTicks"]), spark
    screenshot(page, "charts-fleet")
