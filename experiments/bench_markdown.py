"""Markdown tables for docs/performance.md from the CSVs of experiments/bench_overhead.py.

    python experiments/bench_markdown.py runs/bench     # tables 1, 4, 5, 6, 7 and 8 of the run, and its meta

Prints the tables as written in docs/performance.md, so a dated section copies the run's numbers
instead of retyping them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import pandas as pd

from staleopt.claims import decisive_digits

__all__ = ["main", "step_table", "recompute_table", "growth_table", "breakdown_table", "budget_table", "goals_table",
           "meta_line"]

#: Table 1's rows: per model, the variants shown (the CSV has every variant); the same in every dated section.
#: (Runs before commit f92cfe6 have no floor row.)
STEP_ROWS = {"resnet20-tiny": ("pipemare", "pipedream", "pipeoptim", "dataflow", "dataflow (memory=fast)",
                               "hand-rolled dataflow", "floor dataflow", "floor pipemare"),
             "resnet20": ("pipemare", "dataflow", "floor dataflow"), "cnn1d": ("pipemare", "dataflow"),
             "transformer": ("pipemare", "dataflow")}


def _model(key: str, batch: int, stages: int) -> str:
    name = "resnet20" if key.startswith("resnet20") else key
    return f"{name}, batch {batch} ({stages})" if name == "resnet20" else f"{name} ({stages})"


def _variant(name: str) -> str:
    return name.replace(" (memory=fast)", ', `memory="fast"`').replace("floor dataflow", "floor: dataflow's moves only").replace(
        "floor pipemare", "floor: pipemare's moves and arithmetic only")


def _ms(milliseconds: float) -> str:
    return f"{milliseconds:#.3g} ms" if milliseconds < 100 else f"{milliseconds:.0f} ms"


def _ratio(row, name: str) -> str:
    return f"{row[name]:.2f} [{row[name + '_q1']:.2f}, {row[name + '_q3']:.2f}]"


def step_table(step: pd.DataFrame) -> str:
    """Table 1: whole-step ratio, engine time, and the ops and weight copies the engine adds per step
    (copies in units of all the model's weights) of each model's shown variants."""
    lines = ["| model (P) | method | plain step | whole-step ratio, median [IQR] | engine time / step "
             "| ratio from engine time | engine ops / step | weight copies / step |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    counted = "engine_ops" in step.columns  # (runs before 2026-11-24 did not count them)
    for key, variants in STEP_ROWS.items():
        for variant in variants:
            rows = step[(step.model == key) & (step.variant == variant)]
            for _, r in rows.iterrows():
                counts = f"{r.engine_ops:.0f} | {r.engine_copies:.2f}" if counted else "— | —"
                lines.append(f"| {_model(key, r.batch, r.stages)} | {_variant(variant)} | {_ms(r.plain_ms)} | "
                             f"{_ratio(r, 'ratio')} | {_ms(r.engine_ms)} | {r.engine_ratio:.2f} | {counts} |")
    return "\n".join(lines)


def recompute_table(rec: pd.DataFrame) -> str:
    """Table 8: (a), (b), (c) per ResNet-20 setting: step, its ratios, engine time, memory."""
    lines = ["| ResNet-20 (P) | variant | whole step | / plain step | / (a) | / (b) | engine time / step "
             "| of which recompute machinery | stale-weight memory (`opt.memory_bytes()`) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for _, r in rec.iterrows():
        memory = f"{r.memory_bytes:,} B ({r.memory_bytes / 1e6:.2f} MB)"
        if r.measured_bytes != r.memory_bytes:
            memory += f"; measured {r.measured_bytes:,} B"
        lines.append(f"| batch {r.batch} ({r.stages}) | {r.variant} | {_ms(r.step_ms)} | {_ratio(r, 'ratio_plain')} | "
                     f"{_ratio(r, 'ratio_a')} | {_ratio(r, 'ratio_b')} | {_ms(r.engine_ms)} | "
                     f"{_ms(r.recompute_engine_ms) if r.recompute_engine_ms else '—'} | {memory} |")
    return "\n".join(lines)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def growth_table(growth: pd.DataFrame) -> str:
    """Table 4: per axis (stages, width, depth, size) and value, the engine time per step, its ops and weight
    copies, and the stale-weight memory of staleopt ``dataflow`` and ``pipemare`` and of the hand-rolled deque."""
    lines = ["| axis | value | P | parameters | plain step | dataflow engine / step | pipemare engine / step "
             "| hand-rolled / step | one weight copy | ops / step (dataflow, pipemare) | dataflow memory "
             "| pipemare memory | hand-rolled memory |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for _, r in growth.iterrows():
        lines.append(f"| {r.axis} | {r.value} | {r.stages} | {r.params / 1e6:.2f} M | {_ms(r.plain_ms)} | "
                     f"{_ms(r.dataflow_engine_ms)} | {_ms(r.pipemare_engine_ms)} | {_ms(r.hand_engine_ms)} | "
                     f"{_ms(r.weights_copy_ms)} | {r.dataflow_ops:.0f}, {r.pipemare_ops:.0f} | "
                     f"{_mb(r.dataflow_bytes)} | {_mb(r.pipemare_bytes)} | {_mb(r.hand_bytes)} |")
    return "\n".join(lines)


def breakdown_table(split: pd.DataFrame) -> str:
    """Table 5: where the engine time goes: the history's data movement (in units of one hot-cache
    ``_foreach_copy_`` of all weights), T1's base-step extra, and the rest (hooks, plans, corrections)."""
    copy = split["weights_copy_ms"].iloc[0]
    lines = [f"| variant | engine | history data movement | ops / step | in hot copies ({_ms(copy)} each) "
             "| base step extra (T1) | the rest |", "|---|---:|---:|---:|---:|---:|---:|"]
    for _, r in split.iterrows():
        extra = _ms(r.base_step_extra_ms) if r.base_step_extra_ms > 0 else "—"
        lines.append(f"| {_variant(r.variant)} | {_ms(r.engine_ms)} | {_ms(r.moves_ms)} | {r.move_ops_per_step:.0f} | "
                     f"{r.moves_in_copies:.1f} | {extra} | {_ms(r.other_ms)} |")
    return "\n".join(lines)


def budget_table(ladder: pd.DataFrame) -> str:
    """Table 6: ``pipemare``'s whole step piece by piece, each rung's ratio to the plain step and what it adds."""
    lines = ["| rung (each adds one piece to the one before) | whole step | / plain step, median [IQR] "
             "| adds |", "|---|---:|---:|---:|"]
    for _, r in ladder.iterrows():
        lines.append(f"| {r.rung} | {_ms(r.step_ms)} | {r.ratio:.3f} [{r.ratio_q1:.3f}, {r.ratio_q3:.3f}] | "
                     f"{r.adds:+.3f} |")
    return "\n".join(lines)


def goals_table(goals: pd.DataFrame) -> str:
    """Table 7: each goal, its target and the measured value."""
    lines = ["| goal | target | measured | met |", "|---|---:|---:|---|"]
    for _, r in goals.iterrows():
        shown = f"{r.measured:.3g}"
        if shown == f"{r.target:.3g}" and r.measured != r.target:  # (1.1005 against 1.1: as many digits as differ)
            shown = f"{r.measured:.{decisive_digits(r.measured, r.target, 2)}f}"
        lines.append(f"| {r.goal} | {r.target:g} | {shown} | {'yes' if r.met else '**no**'} |")
    return "\n".join(lines)


def meta_line(meta: dict) -> str:
    """Date, machine, torch, threads, load before/after, clock and run time of the run."""
    cpu = f" ({meta['cpu']})" if meta.get("cpu") else ""  # (runs before 2026-11-25 did not record it)
    commit = f"commit {meta['commit']}; " if meta.get("commit") else ""  # (nor, before 2026-11-27, the commit)
    return (f"{meta['date']}; {commit}{meta['machine']}{cpu}; torch {meta['torch']}, {meta['threads']} thread(s); "
            f"load average {meta['load_before']:.1f} before, {meta['load_after']:.1f} after; "
            f"{meta['rounds']} rounds{_short_rounds(meta)}; {meta['clock']}; {meta['seconds']:.0f} s")


def _short_rounds(meta: dict) -> str:
    """The short-step models' and the ladder's rounds where they differ (``bench_overhead.SHORT_STEP_ROUNDS``,
    ``BUDGET_ROUNDS``; runs before them: none)."""
    parts = [f"{n} for {what}" for n, what in ((meta.get("short_step_rounds", meta["rounds"]), "the short-step models"),
                                                (meta.get("budget_rounds", meta["rounds"]), "the ladder"))
             if n != meta["rounds"]]
    return f" ({', '.join(parts)})" if parts else ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the --out directory of a bench_overhead.py run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    parts: List[str] = [meta_line(json.loads((out / "meta.json").read_text())), step_table(pd.read_csv(out / "step.csv"))]
    if (out / "growth.csv").exists():
        parts.append(growth_table(pd.read_csv(out / "growth.csv")))
    if (out / "breakdown.csv").exists():  # (not copied into the runs committed before 2026-11-29)
        parts.append(breakdown_table(pd.read_csv(out / "breakdown.csv")))
    if (out / "budget.csv").exists():  # (runs before commit 7103a8c have none)
        parts.append(budget_table(pd.read_csv(out / "budget.csv")))
    parts += [goals_table(pd.read_csv(out / "goals.csv")), recompute_table(pd.read_csv(out / "recompute.csv"))]
    print("\n\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
