"""Small formatting helpers and server-drawn SVG sparklines for the dashboard templates."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from django import template
from django.utils.html import format_html, json_script
from django.utils.safestring import SafeString

register = template.Library()

SPARK_WIDTH = 120
MISSING = "\u2013"  # an en dash for a missing figure
SPARK_HEIGHT = 24


def _points(values: list[float | None]) -> str:
    present = [value for value in values if value is not None]
    if not present:
        return ""
    low, high = min(present), max(present)
    span = (high - low) or 1.0
    step = SPARK_WIDTH / max(len(values) - 1, 1)
    coordinates = []
    for position, value in enumerate(values):
        if value is None:
            continue
        x = position * step
        y = SPARK_HEIGHT - 2 - (value - low) / span * (SPARK_HEIGHT - 4)
        coordinates.append(f"{x:.1f},{y:.1f}")
    return " ".join(coordinates)


@register.simple_tag
def sparkline(history: Iterable[dict[str, Any]], key: str, label: str = "") -> SafeString:
    """An inline SVG line of one key over an agent's history; live.js appends to it."""
    values = [bucket.get(key) for bucket in history]
    data = json.dumps([value for value in values if value is not None][-60:])
    return format_html(
        '<svg class="spark" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img"'
        ' aria-label="{label}" data-spark-key="{key}" data-values="{data}">'
        '<polyline fill="none" points="{points}"/></svg>',
        w=SPARK_WIDTH,
        h=SPARK_HEIGHT,
        label=label or key,
        key=key,
        data=data,
        points=_points([value for value in values if value is not None][-60:]),
    )


@register.filter
def number(value: Any, digits: int = 1) -> str:
    if value is None or value == "":
        return MISSING
    try:
        value = float(value)
    except (TypeError, ValueError):
        return str(value)
    if value.is_integer() and abs(value) >= 100:
        return f"{int(value):,}"
    return f"{value:,.{int(digits)}f}"


@register.filter
def percent(value: Any, digits: int = 0) -> str:
    if value is None or value == "":
        return MISSING
    return f"{float(value) * 100:.{int(digits)}f}%"


@register.filter
def short_digest(value: Any) -> str:
    text = str(value or "")
    return text[:12]


@register.filter
def get_item(mapping: Any, key: Any) -> Any:
    if isinstance(mapping, dict):
        return mapping.get(key)
    return None


@register.filter
def json_pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


@register.simple_tag
def chart_data(value: Any, element_id: str) -> SafeString:
    return json_script(value, element_id)


@register.simple_tag(takes_context=True)
def allowed(context: template.Context, check_name: str) -> bool:
    """`{% allowed "can_view_fleet" as may_view_fleet %}`: one access function, for the user."""
    from controlplane.core import access

    if not check_name.startswith(("can_", "is_")):
        raise template.TemplateSyntaxError(f"{check_name!r} is not an access check")
    check = getattr(access, check_name)
    request = context.get("request")
    return bool(request is not None and check(request.user))


@register.simple_tag(takes_context=True)
def role_label(context: template.Context) -> str:
    from controlplane.core import access

    request = context.get("request")
    role = access.role_of(request.user) if request is not None else None
    return role.label if role is not None else "no role"
