"""The Markdown documentation's structure: its pages, code blocks, links and generated tables.

A generated block sits between two marker comments in README.md or a page of
``docs/``::

    <!-- methods-table:begin -->
    | method | schedule | ... |
    <!-- methods-table:end -->

``python -m staleopt.docgen`` rewrites every block whose name is in
:data:`GENERATORS` (``--check``: only report stale ones, exit status 1);
``tests/test_docs.py`` fails when a block differs from what its generator
renders. Blocks with other names (written by other tools) are left alone.

:func:`code_blocks`, :func:`links` and :func:`anchors` read a page the way the
tests need it: ``tests/test_readme.py`` runs the ``python`` blocks (a block
preceded by ``<!-- skip-test: REASON -->`` is not run) and
``tests/test_docs.py`` checks the links against GitHub's heading anchors.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence

from . import cli, methods, models
from .claims import decisive_digits
from .commands import demo

__all__ = ["GENERATORS", "API_MODULES", "markdown_table", "bench_costs", "methods_table", "models_table",
           "hardware_table",
           "demo_claims", "demo_cpus", "demo_checks", "demo_reruns", "demo_quick_time", "bench_resume", "bench_data",
           "ledger_pipemare", "advisor_during_training", "api_reference", "fill",
           "block_names", "doc_files",
           "CodeBlock", "code_blocks", "links", "anchors", "main"]

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(<!-- (?P<name>[a-z0-9-]+):begin -->\n)(?P<body>.*?)(<!-- (?P=name):end -->)", re.S)


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table, one line per row, ending with a newline."""
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def methods_table() -> str:
    """The methods of :mod:`staleopt.methods`: schedule, corrections, paper, description."""
    rows = methods.table()
    return markdown_table(["method", "schedule", "corrections", "paper", "what it is"],
                          ([f"`{r['method']}`", f"`{r['schedule']}`", r["corrections"], r["paper"],
                            r["description"]] for r in rows))


def models_table() -> str:
    """The models of :mod:`staleopt.models` (what ``staleopt models --markdown`` prints)."""
    return markdown_table(["model", "parameters", "units (max stages)", "input", "description"],
                          ([f"`{r['name']}`", f"{r['params']:,}", r["units"], "x".join(map(str, r["input_shape"])),
                            r["description"]] for r in models.table()))


#: The command whose table docs/timelines-hardware.md shows (PipeMare Table 2's CIFAR-10 setting).
HARDWARE_COMMAND = ("hardware --model resnet50-cifar --compare gpipe,pipedream,pipemare-stash,pipemare "
                    "--stages 107 --microbatches 8 --optimizer sgd-momentum --microbatch-size 8")


def hardware_table() -> str:
    """The table ``staleopt HARDWARE_COMMAND`` prints, preceded by the command."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(HARDWARE_COMMAND.split())
    if status:
        raise RuntimeError(f"staleopt {HARDWARE_COMMAND} exited with status {status}")
    table = "".join(line + "\n" for line in out.getvalue().splitlines() if line.startswith("|"))
    return f"`staleopt {HARDWARE_COMMAND}` prints:\n\n{table}"


def demo_claims() -> str:
    """The demo's tables and claims from its committed run (docs/demo/, written by ``staleopt demo``)."""
    return demo.markdown(ROOT / "docs" / "demo")


def demo_cpus(committed: str = "demo", root: Path = ROOT / "docs") -> str:
    """A demo's claims on every CPU it was recorded on: the committed run (``docs/<committed>/``) and each run in
    ``docs/<committed>-other-cpus/``, one column per run (its CPU and date from ``run.json``), the verdict and its
    evidence from its ``claims.csv`` (``staleopt demo``, or ``--from-records`` after a threshold changed)."""
    import pandas as pd
    others = root / f"{committed}-other-cpus"
    runs = [root / committed] + sorted(p for p in others.iterdir() if p.is_dir())
    heads, columns = [], []
    for run in runs:
        info = json.loads((run / "run.json").read_text())
        heads.append(f"{info['cpu']}, {info['date']}")
        columns.append(pd.read_csv(run / "claims.csv").set_index("claim"))
    return _claims_table(heads, columns)


def _claims_table(heads: Sequence[str], columns) -> str:
    """One row per claim of any run, one column per run (``heads``; ``columns``: each run's ``claims.csv`` indexed
    by claim): ``verdict: evidence``, or "not in this run"."""
    claims = list(dict.fromkeys(c for col in columns for c in col.index))
    rows = [[c] + [f"{col.loc[c, 'verdict']}: {col.loc[c, 'evidence']}" if c in col.index else "not in this run"
                   for col in columns] for c in claims]
    return markdown_table(["claim", *heads], rows)


def demo_checks(committed: str = "demo", root: Path = ROOT / "docs") -> str:
    """A demo's robustness checks: its committed run (``docs/<committed>/``) beside each run in
    ``docs/<committed>-checks/<name>/`` (``staleopt demo --sweep experiments/demo-checks/<name>.toml``), one column
    per run headed by its sweep file's description, threads, CPU and date (``run.json``): each claim's verdict
    and evidence (``claims.csv``), then each method's best test metric at each ``P`` that every run has
    (``summary.csv``)."""
    import pandas as pd

    from . import metrics, sweep
    runs = [root / committed] + sorted(p for p in (root / f"{committed}-checks").iterdir() if p.is_dir())
    heads, claims, tables = [], [], []
    for run in runs:
        info = json.loads((run / "run.json").read_text())
        what = (sweep.load_sweep(ROOT / info["sweep"]).description if "sweep" in info
                else "the committed run, seeds 0-2")
        heads.append(f"{run.name}: {what}; {info['workers']} worker(s) x {info['worker_threads']} thread(s), "
                     f"{info['cpu']}, {info['date']}")
        claims.append(pd.read_csv(run / "claims.csv").set_index("claim"))
        summary = pd.read_csv(run / "summary.csv")
        metric = next(m for m in metrics.METRICS.values() if m.best_column in summary)  # (one task: the demo's)
        tables.append((run.name, demo.pivot(summary)))
    shared = set.intersection(*(set(t.columns) for _, t in tables))  # (the P every run has: the checks' P)
    best = {(name, c): t[c] for name, t in tables for c in t.columns if c in shared}
    methods = list(dict.fromkeys(m for col in best.values() for m in col.index))
    return (_claims_table(heads, claims)
            + f"\nBest test {metric.noun}, mean [min, max] over the seeds (`div`: runs that diverged):\n\n"
            + markdown_table(["method", *(f"{name}, {column}" for name, column in best)],
                             [[f"`{m}`"] + [col.get(m, "") or "-" for col in best.values()] for m in methods]))


#: The files of a demo run that say what it trained to (its records' summary, time to target and claims).
RESULT_FILES = ("summary.csv", "speedup.csv", "claims.csv")


def demo_reruns(root: Path = ROOT / "docs") -> str:
    """Whether the committed demo run (``docs/demo/``) is what the code trains today: one line per retraining from
    scratch in ``docs/demo-reruns/<date>-<commit>/`` (``make demo`` in a fresh clone; its ``run.json`` and
    :data:`RESULT_FILES`), saying where it ran and which of the result files equal the committed run's byte for
    byte."""
    lines = []
    for run in sorted(p for p in (root / "demo-reruns").iterdir() if p.is_dir()):
        info = json.loads((run / "run.json").read_text())
        differ = [f for f in RESULT_FILES if (run / f).read_bytes() != (root / "demo" / f).read_bytes()]
        verdict = (f"different from the committed run's: {', '.join(f'`{f}`' for f in differ)}" if differ else
                   f"{', '.join(f'`{f}`' for f in RESULT_FILES)} byte-identical to the committed run's")
        lines.append(f"* {info['date']}, commit {info['commit']}, {_demo_machine(info)}: {info['runs_trained_now']} of "
                     f"{info['runs']} runs trained from scratch in {info['seconds']} s; {verdict} ([its files]"
                     f"(demo-reruns/{run.name}/)).")
    return "\n".join(lines) + "\n"


def _demo_machine(info: dict) -> str:
    """Where a demo ran, from its ``run.json``: CPU, cores, load average at the end, torch, workers x threads."""
    return (f"{info['cpu']} ({info['cores']} cores, load average {info['load_average']} at the end), torch "
            f"{info['torch']}, {info['workers']} worker(s) x {info['worker_threads']} thread(s)")


def demo_quick_time(folder: Path = ROOT / "docs" / "demo-quick") -> str:
    """How long ``staleopt demo --quick`` took, from the ``run.json`` of its committed run (docs/demo-quick/)."""
    info = json.loads((folder / "run.json").read_text())
    return (f"Recorded: `staleopt demo --quick` on {info['date']} at commit {info['commit']}, {_demo_machine(info)}: "
            f"{info['runs']} runs in **{info['seconds']} s** ({info['run_seconds']} s of training summed over the "
            f"runs); [its files](demo-quick/).\n")


def _bench_meta(meta: dict) -> str:
    """Where a small benchmark ran: its command, date, CPU, load average, torch and commit (its ``meta.json``)."""
    return (f"`{meta['command']}` at commit {meta['commit']}, {meta['date']}, {meta['cpu']} ({meta['cpus']} CPUs, "
            f"load average {meta['load_average_1min']}), torch {meta['torch'].split('+')[0]}")


def bench_resume(folder: Path = ROOT / "docs" / "bench-resume") -> str:
    """What a kill -9 cost a sweep, from the committed run of ``experiments/bench_resume.py`` (``resume.csv``,
    ``meta.json``): the step the relaunch resumed from, and its time against an uninterrupted launch's."""
    import pandas as pd
    r = pd.read_csv(folder / "resume.csv").iloc[0]
    meta = json.loads((folder / "meta.json").read_text())
    return (f"Recorded ({_bench_meta(meta)}; [its files](bench-resume/)): the run ({int(r.steps):,} steps, a "
            f"checkpoint every {int(r.checkpoint_every)}) was killed once its checkpoint reached {r.kill_at:.0%} of "
            f"the run; the relaunch resumed from step {int(r.resumed_at_step):,}, trained the remaining "
            f"{int(r.steps_retrained):,} steps, and its records "
            f"{'equal' if bool(r.records_equal) else '**differ from**'} the uninterrupted run's. It took "
            f"{r.relaunch_s:.1f} s against {r.full_s:.1f} s for the uninterrupted launch ({r.relaunch_over_full:.2f}x; "
            f"both include starting Python and torch), or {r.relaunch_train_s:.1f} s against {r.full_train_s:.1f} s "
            f"inside the run ({r.relaunch_train_over_full:.2f}x: the steps left, plus loading the data and the "
            f"checkpoint).\n")


def bench_data(folder: Path = ROOT / "docs" / "bench-data") -> str:
    """The CIFAR input pipelines' throughput, from the committed run of ``experiments/bench_data.py``
    (``data.csv``, ``meta.json``): a table and the speedup, with its range over single rounds."""
    import pandas as pd
    table = pd.read_csv(folder / "data.csv").set_index("pipeline")
    meta = json.loads((folder / "meta.json").read_text())
    what = {"before": "before: per-sample PIL transforms, `DataLoader(num_workers=0)`",
            "after": "after: batched uint8 tensors (`data.batches`)"}
    rows = [[what[name], f"{r.device.upper()}, {r.threads} thread{'s' * (r.threads != 1)}", f"{r.images_per_s:,}",
             f"{r.ms_per_batch:.2f}", f"{r.min_images_per_s:,} to {r.max_images_per_s:,}"]
            for name, r in table.iterrows()]
    batch = int(table["batch_size"].iloc[0])
    rounds = meta["speedup_per_round"]
    return (markdown_table(["pipeline", "device", "images/s (median)", f"ms per batch of {batch}",
                            f"images/s over {int(table['rounds'].iloc[0])} rounds"], rows)
            + f"\nRecorded ({_bench_meta(meta)}; [its files](bench-data/)): **{meta['speedup']:.0f}x** as many "
            f"images per second ({min(rounds):.0f}x to {max(rounds):.0f}x within single rounds).\n")


def demo_lm_claims() -> str:
    """The language-model demo's tables and claims from its committed run (docs/demo-lm/, ``staleopt demo --task lm``)."""
    return demo.markdown(ROOT / "docs" / "demo-lm")


def ledger_pipemare(path: Path = ROOT / "docs" / "reproductions.csv") -> str:
    """The PipeMare rows of the reproduction ledger at every run length, from the rows file that
    ``staleopt reproduce --doc docs/reproductions.md`` writes beside the page (docs/reproductions.csv)."""
    import math

    import pandas as pd

    from .stats import t_interval
    rows = pd.read_csv(path)
    rows = rows[rows["experiment"].str.startswith("pipemare")]
    horizons = sorted(rows["horizon"].unique())
    ids = list(dict.fromkeys(rows["id"]))

    def cell(r) -> str:
        gaps = [float(g) for _, g in json.loads(r["gaps"])]  # (an infinite gap is the string "inf": rows_csv)
        mean, half, n = t_interval(gaps)
        if not n:
            return r["verdict"]
        ci = "" if math.isnan(half) else f" ± {half:.3f}"
        return f"{mean:+.3f}{ci} ({r['verdict']})"

    table = []
    for i in ids:
        mine = rows[rows["id"] == i].set_index("horizon")
        first = mine.iloc[0]
        table.append([f"{first['claim']} (`{i}`)"] + [cell(mine.loc[h]) if h in mine.index else "-" for h in horizons]
                     + [first["trend"] if len(mine) > 1 else "-"])
    steps = rows[rows["id"] == "pipemare-matches-sync"].set_index("horizon")["steps"]
    head = ["claim"] + [f"{h}x" + (f" ({int(steps[h]):,} steps)" if h in steps.index else "") for h in horizons]
    return ("Gap per claim (final test accuracy, the rule's per-seed difference: mean ± 95% interval over 5 seeds, "
            "and the verdict) at each run length, from the ledger's rows file docs/reproductions.csv:\n\n"
            + markdown_table(head + ["trend"], table))


def advisor_during_training(path: Path = ROOT / "docs" / "advisor-during-training") -> str:
    """docs/performance.md's "advisor during training" section from the files that
    ``experiments/advisor_during_training.py`` writes (``meta.json``, ``curvature.csv``, ``losses.csv``): per seed,
    the advisor's bound after each count of synchronous steps and each pipelined run's outcome, and the sentences
    that the outcomes support."""
    import pandas as pd
    meta = json.loads((path / "meta.json").read_text())
    curv, losses = pd.read_csv(path / "curvature.csv"), pd.read_csv(path / "losses.csv")
    seeds, ks, last = sorted(curv["seed"].unique()), sorted(curv["sync_steps"].unique()), curv["stage"].max()
    bound = curv.groupby(["sync_steps", "seed"])[["max_stable_lr", "t1_max_base_lr"]].min()
    runs = list(dict.fromkeys(zip(losses["method"], losses["lr"])))
    ends = losses.groupby(["method", "lr", "seed"]).agg(step=("step", "max"), loss=("loss", "last"),
                                                        peak=("loss", "max"))
    steps = meta["steps"]

    def diverged(method, lr, seed) -> bool:
        e = ends.loc[(method, lr, seed)]
        return not e["loss"] <= 100.0

    def outcome(method, lr, seed) -> str:
        e = ends.loc[(method, lr, seed)]
        return (f"diverged at step {int(e['step'])}" if diverged(method, lr, seed)
                else f"{int(e['step']) + 1} steps, peak loss {e['peak']:.3g}")

    def span(values) -> str:
        return f"{min(values):.3g}–{max(values):.3g}"

    init = ks[0]
    head = (["seed"] + [f"dataflow bound after {k} steps" for k in ks] + ["pipemare-t1 bound at init"]
            + [f"`{m}` at lr {lr:g}" for m, lr in runs])
    table = [[str(s)] + [f"{bound.loc[(k, s), 'max_stable_lr']:.3g}" for k in ks]
             + [f"{bound.loc[(init, s), 't1_max_base_lr']:.3g}"] + [outcome(m, lr, s) for m, lr in runs]
             for s in seeds]
    spread = [[str(k), span(curv[(curv["sync_steps"] == k) & (curv["stage"] == last)]["curvature"]),
               span([bound.loc[(k, s), "max_stable_lr"] for s in seeds]),
               span([bound.loc[(k, s), "t1_max_base_lr"] for s in seeds])] for k in ks]
    said = []
    for m, lr in runs:
        key = "max_stable_lr" if m == "dataflow" else "t1_max_base_lr"
        inside = [s for s in seeds if lr < bound.loc[(init, s), key]]
        lost = [s for s in seeds if diverged(m, lr, s)]
        both = [s for s in inside if s in lost]
        said.append(f"`{m}` at lr {lr:g}: inside the advisor's bound at initialization for {len(inside)} of "
                    f"{len(seeds)} seeds, diverged within {steps} steps in {len(lost)} of {len(seeds)} runs"
                    + (f", {len(both)} of them inside the bound (seed{'s' * (len(both) > 1)} "
                       f"{', '.join(map(str, both))})" if both else "") + ".")
    return (f"{meta['date']}, commit {meta['commit']}, {meta['machine']}, {meta['threads']} torch thread; "
            f"`{meta['command']}` ({meta['seconds']:.0f} s), files in "
            f"[advisor-during-training/](advisor-during-training/). `{meta['model']}` on MNIST-1D, "
            f"{meta['stages']} stages, plain SGD, batch {meta['batch']}, {len(seeds)} seeds (the weights' and the "
            f"shuffling's). The bound is the largest base lr the advisor accepts on every stage (100 power "
            f"iterations on the first {meta['batch']} training samples) after that many synchronous SGD steps at "
            f"lr {meta['lr']:g}; a run's outcome is its first {steps} pipelined steps from initialization "
            "(diverged: a loss above 100 or not finite).\n\n"
            + markdown_table(head, table) + "\n"
            + markdown_table(["synchronous steps", f"stage {last}'s curvature", "dataflow bound",
                              "pipemare-t1 bound"], spread)
            + "\n" + "\n".join(f"* {line}" for line in said) + "\n")


#: Block name -> function returning the block's Markdown.
#: The modules :func:`api_reference` documents, in reading order (the optimizer first, then experiments).
API_MODULES = ("staleopt", "staleopt.optimizer", "staleopt.partition", "staleopt.methods", "staleopt.schedules",
               "staleopt.corrections", "staleopt.segments", "staleopt.config", "staleopt.models", "staleopt.data",
               "staleopt.registry", "staleopt.train", "staleopt.checkpoint", "staleopt.sweep", "staleopt.compare",
               "staleopt.metrics", "staleopt.stats", "staleopt.speedup", "staleopt.claims", "staleopt.hardware",
               "staleopt.timeline", "staleopt.theory", "staleopt.advisor", "staleopt.plot.sweep", "staleopt.errors")


#: The recorded ``make bench`` runs README's cost paragraph is generated from (``docs/bench/COMMIT/run-N``, each
#: a run's ``step.csv``, ``budget.csv``, ``growth.csv``, ``goals.csv`` and ``meta.json``): the same engine on two
#: CPUs (commit dc9a20d changed only docs/language-models.md after 25c5cec; 131c38b only ``step()``'s early return
#: when no parameter has a gradient), the Intel one twice; and the engine at 47a783e (the correctness fixes since
#: 131c38b: Tensor-lr paths, corrections reading the base's groups, memory_bytes counting every buffer) on an AMD
#: EPYC; and the engine at 7a89f82 (since 47a783e: the base-step pre-hook, the first forward's graph read, the
#: replicas read by the model's mode) on an AMD EPYC too, and the same engine again at 02080ce on that machine.
BENCH_RUNS = ("docs/bench/25c5cec/run-1", "docs/bench/dc9a20d/run-1", "docs/bench/131c38b/run-1",
              "docs/bench/47a783e/run-1", "docs/bench/7a89f82/run-1", "docs/bench/02080ce/run-1")


def bench_costs(runs: Sequence[str] = BENCH_RUNS) -> str:
    """README's cost paragraph from recorded ``make bench`` runs (:data:`BENCH_RUNS`; tables 1, 6, 7 and 8 of
    each): ranges over the runs, each run named by its date, CPU and commit, and the engine's goals (table 7)
    that some run did not meet, with that run's value."""
    import pandas as pd

    dirs = [ROOT / r for r in runs]
    metas = [json.loads((p / "meta.json").read_text()) for p in dirs]
    steps = [pd.read_csv(p / "step.csv") for p in dirs]
    budgets = [pd.read_csv(p / "budget.csv") for p in dirs]
    growths = [pd.read_csv(p / "growth.csv") for p in dirs]
    goals = [pd.read_csv(p / "goals.csv") for p in dirs]

    def at(df, variant, column, model="resnet20-tiny"):
        return float(df[(df["model"] == model) & (df["variant"] == variant)][column].iloc[0])

    def span(values, fmt="{:.2f}", unit="x"):
        lo, hi = fmt.format(min(values)), fmt.format(max(values))
        return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"

    def cpu(meta):
        return re.sub(r"\(R\)|\(TM\)| Processor", "", meta.get("cpu", "CPU not recorded")).replace("  ", " ")

    named = "; ".join(f"{m['date']}, {cpu(m)}, commit {Path(r).parent.name}" for m, r in zip(metas, runs))
    def goal(text, target):  # ("pipemare whole step / plain step <=, P=39", 1.1) -> "... <= 1.1 (P=39)"
        what, op, where = re.match(r"(.*) (<=|>=|==), ?(.*)", text).groups()
        return f"{what} {op} {target:g} ({where})"

    missed = [f"{goal(g.goal, g.target)}: {g.measured:.{decisive_digits(g.measured, g.target, 2)}f} on the {cpu(m)} "
              f"(commit {Path(r).parent.name})" for gs, m, r in zip(goals, metas, runs) for g in gs.itertuples()
              if not g.met]
    goal_text = (f"the engine's goals (table 7) held in every run except {'; '.join(missed)}" if missed
                 else "the engine's goals (table 7) held in every run")
    floor_rung = [float(b[b["rung"].str.contains("pipemare's floor", regex=False)]["ratio"].iloc[0]) for b in budgets]
    gpt = [g[g["model"] == "GPT d_model 768"].iloc[0] for g in growths]
    big = max(at(s, v, "engine_ratio", "resnet20") for s in steps for v in ("dataflow", "pipemare"))
    return (
        f"`make bench` ({len(runs)} runs: {named}; {metas[0]['machine'].split(',')[1].strip()}, "
        f"{metas[0]['threads']} thread; records in {', '.join(f'`{r}`' for r in runs)}): on an "
        f"engine-bound ResNet-20 (batch 4, `P = 39`) a step costs {span([at(s, 'dataflow', 'ratio') for s in steps])} "
        f"the plain step for `dataflow` ({span([at(s, 'dataflow', 'engine_ratio') for s in steps])} from its engine "
        f"time, {span([at(s, 'dataflow', 'engine_ms') / at(s, 'floor dataflow', 'engine_ms') for s in steps], '{:.1f}')} "
        f"what its weight moves alone cost), {span([at(s, 'pipemare', 'ratio') for s in steps])} for `pipemare` "
        f"({span([at(s, 'pipemare', 'engine_ratio') for s in steps])} from its engine time; its copies and T1/T2 "
        f"arithmetic alone: {span([at(s, 'floor pipemare', 'ratio') for s in steps] + floor_rung)}); at batch 128 the "
        f"engine is under {math.floor(100 * (big - 1)) + 1} % of the step; at GPT-2 small's size "
        f"({gpt[0]['params'] / 1e6:.0f}M parameters, `P = {int(gpt[0]['stages'])}`) `dataflow` adds "
        f"{span([g['dataflow_engine_ms'] for g in gpt], '{:.0f}', ' ms')} to a "
        f"{span([g['plain_ms'] / 1000 for g in gpt], '{:.2f}', ' s')} step; {goal_text}.\n")


def _first_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    text = doc.strip().split("\n\n")[0].replace("\n", " ")
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")  # reST roles and literals as Markdown code


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def api_reference() -> str:
    """Every public class and function of :data:`API_MODULES` (their ``__all__``) with its signature and the
    first paragraph of its docstring; other public names (constants, submodules) listed by name."""
    import importlib
    lines = []
    for name in API_MODULES:
        module = importlib.import_module(name)
        lines += [f"### `{name}`", "", _first_line(module), ""]
        others = []
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj) and hasattr(obj, "__wrapped__"):
                kind = "class" if inspect.isclass(obj) else "def"
                if inspect.isclass(obj) and issubclass(obj, BaseException):
                    lines.append(f"* `class {attr}` — {_first_line(obj)}")
                else:
                    lines.append(f"* `{kind} {attr}{_signature(obj)}` — {_first_line(obj)}")
            else:
                others.append(f"`{attr}`")
        if others:
            lines.append(f"* also: {', '.join(others)}")
        lines.append("")
    return "\n".join(lines)


GENERATORS: Dict[str, Callable[[], str]] = {"bench-costs": bench_costs, "methods-table": methods_table,
                                            "models-table": models_table,
                                            "hardware-table": hardware_table, "demo-claims": demo_claims,
                                            "demo-cpus": demo_cpus, "demo-checks": demo_checks,
                                            "demo-lm-checks": functools.partial(demo_checks, "demo-lm"),
                                            "demo-quick-time": demo_quick_time, "demo-reruns": demo_reruns,
                                            "bench-resume": bench_resume, "bench-data": bench_data,
                                            "demo-lm-cpus": functools.partial(demo_cpus, "demo-lm"),
                                            "demo-lm-claims": demo_lm_claims,
                                            "ledger-pipemare": ledger_pipemare, "api-reference": api_reference,
                                            "advisor-during-training": advisor_during_training}


def fill(text: str, rendered: Dict[str, str]) -> str:
    """``text`` with every block named in ``rendered`` replaced by its rendering."""
    def replace(m: re.Match) -> str:
        body = rendered.get(m.group("name"), m.group("body"))
        return m.group(1) + body + m.group(4)
    return _BLOCK.sub(replace, text)


def block_names(text: str) -> List[str]:
    """The names of the generated blocks in ``text``, in order."""
    return [m.group("name") for m in _BLOCK.finditer(text)]


def doc_files(root: Path = ROOT) -> List[Path]:
    """README.md and every page of docs/."""
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


class CodeBlock(NamedTuple):
    """A fenced code block: its language (the fence's info string), text, first line and skip reason."""

    lang: str
    code: str
    line: int
    skip: Optional[str]


_FENCE = re.compile(r"^(\s*)```(.*)$")
_SKIP = re.compile(r"^<!-- skip-test:(.*)-->\s*$")


def code_blocks(text: str) -> List[CodeBlock]:
    """Every fenced block of ``text``; ``skip`` is the reason of a ``<!-- skip-test: ... -->`` line just before it."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2).strip(), i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = "\n".join(line[len(indent):] for line in lines[start + 1:i]) + "\n"
        skip = _SKIP.match(lines[start - 1]) if start > 0 else None
        blocks.append(CodeBlock(lang, body, start + 1, skip.group(1).strip() if skip else None))
        i += 1
    return blocks


def _outside_fences(text: str) -> List[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def links(text: str) -> List[str]:
    """The targets of the Markdown links and images in ``text`` (outside code blocks and code spans)."""
    prose = "\n".join(re.sub(r"`[^`]*`", "", line) for line in _outside_fences(text))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose)


def anchors(text: str) -> List[str]:
    """GitHub's anchors for the headings of ``text``: lower case, punctuation dropped, spaces to dashes,
    ``-N`` on repeats."""
    seen: Dict[str, int] = {}
    out = []
    for line in _outside_fences(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.append(slug if n == 0 else f"{slug}-{n}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m staleopt.docgen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks and exit 1; change nothing")
    args = parser.parse_args(argv)
    files = {path: path.read_text() for path in doc_files()}
    needed = {name for text in files.values() for name in block_names(text)} & set(GENERATORS)
    rendered = {name: GENERATORS[name]() for name in sorted(needed)}
    stale = [path for path, text in files.items() if fill(text, rendered) != text]
    for path in stale:
        print(f"{'stale' if args.check else 'updated'}: {path.relative_to(ROOT)}")
        if not args.check:
            path.write_text(fill(path.read_text(), rendered))
    return 1 if args.check and stale else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
