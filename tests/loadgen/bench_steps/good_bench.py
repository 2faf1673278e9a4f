from pathlib import Path

QUICK_BUDGET_S = 30


def run(out_dir: Path, quick: bool) -> dict:
    (out_dir / "plot.png").write_bytes(b"png")
    return {
        "figures": [
            {"name": "speed", "value": 120.0, "unit": "tok/s", "reference": "baseline",
             "reference_value": 100.0, "target": "ratio >= 1.1"},
            {"name": "tokens", "value": 5, "unit": "tokens", "reference": "client",
             "reference_value": 6, "target": "exact"},
        ],
        "notes": [f"quick={quick}"],
        "plots": ["plot.png"],
    }  # fmt: skip
