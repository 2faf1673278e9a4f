"""Small formatting helpers and the fleet sparklines' markup for the dashboard templates."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from django import template
from django.utils.html import format_html, json_script
from django.utils.safestring import SafeString

from contracts import capacity

register = template.Library()

MISSING = "\u2013"  # an en dash for a missing figure
SPARK_UNITS = frozenset({"percent", "watts", "requests"})


@register.simple_tag
def sparkline(
    history: Iterable[dict[str, Any]], key: str, label: str, unit: str, window_s: float
) -> SafeString:
    """A fleet sparkline of one key over an agent's history (charts.js draws it, with a time
    axis over the last `window_s` seconds and a unit on its value axis; fleet.js appends
    live figures)."""
    if unit not in SPARK_UNITS:
        raise template.TemplateSyntaxError(
            f"sparkline unit {unit!r} is not one of {sorted(SPARK_UNITS)}"
        )
    points = [
        [round(bucket["bucket_start"].timestamp(), 3), bucket[key]]
        for bucket in history
        if bucket.get(key) is not None
    ]
    return format_html(
        '<div class="spark" role="img" aria-label="{label}, last {minutes} min"'
        ' data-spark-key="{key}" data-label="{label}" data-unit="{unit}"'
        ' data-window-s="{window}" data-points="{points}"></div>',
        label=label,
        minutes=round(window_s / 60),
        key=key,
        unit=unit,
        window=window_s,
        points=json.dumps(points),
    )


@register.filter
def gib(value: Any) -> str:
    """Bytes as the capacity model words them (1.31 GiB)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return MISSING
    return capacity.gib(value)


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
