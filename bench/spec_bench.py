"""Speculative decoding benchmark: single-stream decode tok/s with n-gram drafts ÷ without,
in one run on one engine (engine/speculative.py).

    python -m bench.spec_bench                  # SmolLM2, both workloads
    python -m bench.spec_bench --quick          # fewer prompts and tokens
    python -m bench --only spec_bench           # as a step of `make bench`

Workloads, each prompt asked greedily in chat form, one request at a time:
- chat: the demo's chat prompts (the text prompts of loadgen/traces/sample.jsonl and the
  evaluation questions), where the answer seldom repeats the prompt;
- quoting: long passages (sections of this repository's docs) with an instruction to quote
  or summarise them, where the answer repeats the prompt.

Each prompt runs twice with speculation off and twice in the engine's default `auto`
(off, auto, auto, off, then reversed for the next prompt), on the same engine (its
weights, cache and step-cost table); each mode's faster run counts. The figure is decode
tokens (after the first) over their seconds, per mode, and auto ÷ off. Greedy output must
be identical in both modes: a difference is reported as a failure. Before measuring, every
prompt runs once in auto, as a serving engine would have: the step costs that auto reads
are measured by serving (the first requests of a fresh engine pay for that).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 180  # the step's time limit in `make bench` (bench/__main__.py)
QUICK_BUDGET_S = 90
TARGET_QUOTING = 1.5
FLOOR_OTHERS = 0.95
QUOTING_INSTRUCTIONS = (
    "Repeat the following passage word for word.",
    "Summarise the passage below. Quote its most important sentences exactly.",
)
QUOTED_DOCS = ("docs/engine.md", "docs/rollouts.md", "docs/gateway.md", "docs/capacity.md")


@dataclass(slots=True)
class Run:
    tokens: int = 0  # decode tokens: after the first
    seconds: float = 0.0
    steps: int = 0


@dataclass(slots=True)
class WorkloadResult:
    name: str
    off: Run = field(default_factory=Run)
    auto: Run = field(default_factory=Run)
    mismatches: list[str] = field(default_factory=list)
    per_prompt: list[float] = field(default_factory=list)  # auto ÷ off, each prompt

    @property
    def ratio(self) -> float:
        return rate(self.auto) / rate(self.off)


def rate(run: Run) -> float:
    return run.tokens / run.seconds if run.seconds else 0.0


def chat_prompts() -> list[str]:
    trace = REPO_ROOT / "loadgen" / "traces" / "sample.jsonl"
    prompts: list[str] = []
    for line in trace.read_text().splitlines():
        text = json.loads(line).get("prompt")
        if text and text not in prompts:
            prompts.append(text)
    questions = REPO_ROOT / "controlplane" / "rollouts" / "datasets" / "questions.json"
    prompts += [q["question"] for q in json.loads(questions.read_text())]
    return prompts


def passages(count: int, words: int = 200) -> list[str]:
    """The first `words` words of docs' prose (headings, tables and code left out)."""
    found: list[str] = []
    for name in QUOTED_DOCS:
        text = (REPO_ROOT / name).read_text()
        kept: list[str] = []
        for paragraph in text.split("\n\n"):
            if paragraph.startswith(("#", "```", "|", "    ", "-")):
                continue
            kept.extend(paragraph.split())
            if len(kept) >= words:
                break
        found.append(" ".join(kept[:words]))
    return [found[i % len(found)] for i in range(count)]


def quoting_prompts(count: int) -> list[str]:
    return [
        f"{QUOTING_INSTRUCTIONS[i % len(QUOTING_INSTRUCTIONS)]}\n\n{passage}"
        for i, passage in enumerate(passages(count))
    ]


def decode(engine: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], Run]:
    """One greedy request alone; the seconds and tokens after its first token."""
    from engine.sequence import SamplingParams, Sequence

    seq = Sequence(
        token_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens, temperature=0)
    )
    engine.scheduler.add(seq)
    while not seq.is_finished and seq.num_output_tokens == 0:
        engine._step()
    run = Run()
    started = time.perf_counter()
    first = seq.num_output_tokens
    while not seq.is_finished:
        engine._step()
        run.steps += 1
    run.seconds = time.perf_counter() - started
    run.tokens = seq.num_output_tokens - first
    return seq.output_token_ids, run


def measure(engine: Any, name: str, prompts: list[list[int]], max_tokens: int) -> WorkloadResult:
    result = WorkloadResult(name)
    for mode_order_index, prompt in enumerate(prompts):
        engine.config.speculative = "auto"
        decode(engine, prompt, max_tokens)  # the serving engine's step costs, see above
        runs: dict[str, Run] = {}
        outputs: dict[str, list[int]] = {}
        # off, auto, auto, off (and the reverse for the next prompt): each mode's faster run
        # counts, so a moment of another process's load on this machine weighs on neither
        order = ("off", "auto") if mode_order_index % 2 == 0 else ("auto", "off")
        for mode in (*order, *reversed(order)):
            engine.config.speculative = mode
            output, measured = decode(engine, prompt, max_tokens)
            if outputs.setdefault(mode, output) != output:
                result.mismatches.append(f"prompt {mode_order_index} ({mode} not repeatable)")
            if mode not in runs or rate(measured) > rate(runs[mode]):
                runs[mode] = measured
        for mode, run in runs.items():
            total = getattr(result, mode)
            total.tokens += run.tokens
            total.seconds += run.seconds
            total.steps += run.steps
        if outputs["off"] != outputs["auto"]:
            result.mismatches.append(f"prompt {mode_order_index}")
        if rate(runs["off"]):
            result.per_prompt.append(rate(runs["auto"]) / rate(runs["off"]))
        print(
            f"  {name} {mode_order_index + 1}/{len(prompts)}: {runs['off'].tokens} tokens, "
            f"off {rate(runs['off']):.1f} tok/s, auto {rate(runs['auto']):.1f} tok/s "
            f"({runs['auto'].steps} steps)",
            flush=True,
        )
    return result


def measure_all(out_dir: Path, quick: bool, model: str = "smollm2") -> dict[str, Any]:
    import torch

    from engine.__main__ import default_dtype
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    torch.set_grad_enabled(False)
    engine = LLMEngine(EngineConfig(model=model, dtype=default_dtype(), max_model_len=2048))
    engine.load()
    engine.warm_up()
    tokenizer = engine.tokenizer

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode_chat([{"role": "user", "content": text}]))

    chats = chat_prompts()[: 4 if quick else None]
    quotes = quoting_prompts(2 if quick else 6)
    max_tokens = 64 if quick else 160
    print(
        f"spec bench: {model} ({engine.config.dtype}, {engine.device}), {len(chats)} chat "
        f"and {len(quotes)} quoting prompts, up to {max_tokens} tokens"
    )
    results = [
        measure(engine, "chat", [encode(p) for p in chats], max_tokens),
        measure(engine, "quoting", [encode(p) for p in quotes], max_tokens),
    ]
    stats = engine.speculative_stats()
    report: dict[str, Any] = {
        "model": model,
        "dtype": engine.config.dtype,
        "device": str(engine.device),
        "max_tokens": max_tokens,
        "workloads": {
            r.name: {
                "prompts": len(r.per_prompt),
                "decode_tokens": r.off.tokens,
                "off_tok_s": round(rate(r.off), 2),
                "auto_tok_s": round(rate(r.auto), 2),
                "ratio": round(r.ratio, 3),
                "worst_prompt_ratio": round(min(r.per_prompt), 3) if r.per_prompt else None,
                "tokens_per_step_auto": round(r.auto.tokens / r.auto.steps, 3)
                if r.auto.steps
                else None,
                "outputs_identical": not r.mismatches,
                "mismatches": r.mismatches,
            }
            for r in results
        },
        "speculative": stats,
        "targets": {"quoting_ratio": TARGET_QUOTING, "others_floor": FLOOR_OTHERS},
    }
    chat, quoting = results
    print(f"chat:    auto ÷ off = {chat.ratio:.2f} (floor {FLOOR_OTHERS}), "
          f"{rate(chat.off):.1f} -> {rate(chat.auto):.1f} tok/s")  # fmt: skip
    print(f"quoting: auto ÷ off = {quoting.ratio:.2f} (target {TARGET_QUOTING}), "
          f"{rate(quoting.off):.1f} -> {rate(quoting.auto):.1f} tok/s")  # fmt: skip
    print(f"drafts accepted {stats['acceptance_rate']}, tokens per verification "
          f"{stats['tokens_per_verification']}")  # fmt: skip
    for r in results:
        if r.mismatches:
            print(f"FAIL {r.name}: greedy output differs with drafts ({', '.join(r.mismatches)})")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def figures_of(report: dict[str, Any]) -> dict[str, Any]:
    """The report's figures and notes (docs/loadgen.md, the step interface)."""
    figures = []
    for name, target in (
        ("chat", f"ratio >= {FLOOR_OTHERS}"),
        ("quoting", f"ratio >= {TARGET_QUOTING}"),
    ):
        workload = report["workloads"][name]
        figures.append(
            {
                "name": f"single-stream decode with n-gram drafts, {name} prompts",
                "value": workload["auto_tok_s"],
                "unit": "tok/s",
                "reference": "the same engine with speculation off, same prompts",
                "reference_value": workload["off_tok_s"],
                "target": target,
            }
        )
        figures.append(
            {
                "name": f"greedy output identical with drafts, {name} prompts",
                "value": 1 if workload["outputs_identical"] else 0,
                "unit": "",
                "reference": "speculation off",
                "reference_value": 1,
                "target": "exact",
            }
        )
    stats = report["speculative"]
    notes = [
        f"{report['model']} ({report['dtype']}, {report['device']}), up to "
        f"{report['max_tokens']} tokens per prompt; draft tokens accepted "
        f"{stats['acceptance_rate']}, tokens per verification {stats['tokens_per_verification']}"
    ]
    return {"figures": figures, "notes": notes, "report": report}


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    """The bench step (docs/loadgen.md)."""
    return figures_of(measure_all(out_dir, quick))


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.spec_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    parser.add_argument("--model", default="smollm2", help="smollm2, a .gguf file or a HF folder")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results")
    args = parser.parse_args()
    report = measure_all(args.out, args.quick, args.model)
    failed = any(not w["outputs_identical"] for w in report["workloads"].values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
