"""The benchmark report: figures with their references, as Markdown and JSON.

A module's `run(out_dir, quick)` returns {"figures": [...], "notes": [...], "plots": [...]}
or {"skipped": "reason"}. Each figure:

    {"name": str, "value": float | None, "unit": str,
     "reference": str, "reference_value": float | None, "ratio": float | None,
     "target": str, "skipped": str (optional, when the figure could not be measured)}

`ratio` defaults to value / reference_value. `target` is read by `target_met`:
"exact" (value == reference_value), "within N%" (|ratio - 1| <= N/100), or
"ratio|value <op> number" with <op> one of <=, >=, <, >, ==; anything else is shown as
written and not judged.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

_OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
}
_COMPARISON = re.compile(r"^\s*(ratio|value)\s*(<=|>=|==|<|>)\s*([-+0-9.eE]+)\s*$")
_WITHIN = re.compile(r"^\s*within\s+([0-9.]+)\s*%\s*$")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)


def normalize_figure(raw: dict[str, Any]) -> dict[str, Any]:
    """A figure with every key present, the ratio filled in and the target judged."""
    value = _number(raw.get("value"))
    reference = _number(raw.get("reference_value"))
    ratio = _number(raw.get("ratio"))
    if ratio is None and value is not None and reference:
        ratio = value / reference
    figure: dict[str, Any] = {
        "name": str(raw.get("name", "?")),
        "value": value,
        "unit": str(raw.get("unit", "")),
        "reference": str(raw.get("reference", "")),
        "reference_value": reference,
        "ratio": ratio,
        "target": str(raw.get("target", "")),
        "skipped": raw.get("skipped"),
    }
    figure["met"] = None if figure["skipped"] else target_met(figure)
    return figure


def target_met(figure: dict[str, Any]) -> bool | None:
    """Whether a figure meets its target; None when it cannot be judged."""
    target = figure["target"].strip()
    value, reference, ratio = figure["value"], figure["reference_value"], figure["ratio"]
    if target.lower() == "exact":
        return None if value is None or reference is None else value == reference
    within = _WITHIN.match(target)
    if within:
        return None if ratio is None else abs(ratio - 1) <= float(within.group(1)) / 100
    comparison = _COMPARISON.match(target)
    if comparison:
        subject = ratio if comparison.group(1) == "ratio" else value
        if subject is None:
            return None
        return _OPERATORS[comparison.group(2)](subject, float(comparison.group(3)))
    return None


def _cell(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.{digits}g}"


def _met(met: bool | None, skipped: Any) -> str:
    if skipped:
        return f"skipped: {skipped}"
    return {True: "yes", False: "**no**", None: "-"}[met]


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Benchmark report {report['timestamp']}",
        "",
        f"Host: {report['host']}. Mode: {'quick' if report['quick'] else 'full'}. "
        f"Total {report['elapsed_s']:.0f} s.",
        "",
        "| step | status | seconds | figures | targets met |",
        "|---|---|---:|---:|---:|",
    ]
    for module in report["modules"]:
        figures = module.get("figures", [])
        judged = [f for f in figures if f["met"] is not None]
        met = sum(1 for f in judged if f["met"])
        lines.append(
            f"| {module['name']} | {module['status']} | {module['elapsed_s']:.0f} | "
            f"{len(figures)} | {met}/{len(judged)} |"
        )
    for module in report["modules"]:
        lines += ["", f"## {module['name']}", ""]
        if module["status"] != "ok":
            lines.append(f"Status: **{module['status']}**" + _reason(module))
        figures = module.get("figures", [])
        if figures:
            lines += [
                "",
                "| figure | value | unit | reference | reference value | ratio | target | met |",
                "|---|---:|---|---|---:|---:|---|---|",
            ]
            for f in figures:
                lines.append(
                    f"| {f['name']} | {_cell(f['value'])} | {f['unit']} | {f['reference']} | "
                    f"{_cell(f['reference_value'])} | {_cell(f['ratio'], 3)} | {f['target']} | "
                    f"{_met(f['met'], f['skipped'])} |"
                )
        for note in module.get("notes", []):
            lines.append(f"\n- {note}")
        for plot in module.get("plots", []):
            lines += ["", f"![{Path(plot).stem}]({plot})"]
        if module.get("log_tail"):
            lines += ["", "```", *module["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def _reason(module: dict[str, Any]) -> str:
    return f": {module['reason']}" if module.get("reason") else ""


def write_report(out_dir: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    markdown = out_dir / "report.md"
    document = out_dir / "report.json"
    markdown.write_text(render_markdown(report))
    document.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return markdown, document
