"""``staleopt demo``: the headline sweep on MNIST-1D (``--task lm``: a GPT on ``text-markov``), its tables, its claims
(evaluated from the runs) and figures."""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, RunFileError
from ..machine import cpu_name, load_average, source_commit
from ..validate import check_int, output_dir

__all__ = ["register", "run", "DEFAULT_SWEEP", "QUICK_SWEEP", "LM_SWEEP", "complete", "pivot", "speedup_pivot",
           "provenance", "markdown"]

#: The checkout the package lives in (run.json names a sweep file inside it by its relative path).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: The demo's sweep file, in the repository next to the package.
DEFAULT_SWEEP = REPO_ROOT / "experiments" / "demo.toml"
#: ``staleopt demo --quick``'s: the same recipe with 4 of its methods and 1 of its seeds (8 runs instead of 42).
QUICK_SWEEP = DEFAULT_SWEEP.with_name("demo-quick.toml")
#: ``staleopt demo --task lm``'s: the demo's methods on a GPT language model (docs/language-models.md).
LM_SWEEP = DEFAULT_SWEEP.with_name("demo-lm.toml")

EXAMPLES = """\
Runs experiments/demo.toml: gpipe, pipedream, pipemare-stash (PipeMare Fig. 2's
"PipeDream"), 1f1b, dataflow (uncorrected), pipemare-t1 and pipemare on MNIST-1D
at P = 8 and the model's maximum (39), 3 seeds, 20 epochs each, then prints the
accuracy table, the time to accuracy (speedup over GPipe in pipeline time) and
the demo's claims evaluated from the runs, and writes into OUT:

  accuracy_vs_stages.png        utilization, memory (x GPipe), accuracy, speedup to the target vs P (PipeMare Fig. 2)
  accuracy_vs_epoch_P<max>.png  accuracy curves at the largest P (PipeMare Fig. 7/8)
  accuracy_vs_time_P<max>.png   accuracy against pipeline time at the largest P (PipeMare Fig. 11)
  summary.csv, records.csv      per-group summary (mean and interval over seeds) and every record
  speedup.csv, claims.csv       time to accuracy per method and P; each claim, its evidence and verdict
  run.json                      date, CPU, torch version, workers, threads, times

It is a resumable sweep: run it again after an interruption and finished runs
are kept.

examples:
  staleopt demo                          # runs/demo, 2 workers
  staleopt demo --quick                  # a preview: 4 methods, 1 seed (8 runs) -> runs/demo-quick
  staleopt demo --task lm                # the language-model demo: a GPT on text-markov, perplexity -> runs/demo-lm
  staleopt demo --out /tmp/demo --workers 4
  staleopt demo --out /tmp/demo-2t --worker-threads 2   # other float rounding: do the claims still hold?
  staleopt demo --sweep experiments/my_sweep.toml --out runs/mine
  staleopt demo --out docs/demo --figures docs/img --from-records   # the committed run's files, rebuilt
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the MNIST-1D stages sweep and draw accuracy vs stages",
                              description="The main demo: a resumable sweep, its table and figures.\n\n" + EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="sweep directory (default runs/demo, runs/demo-quick with --quick, "
                                                "runs/demo-lm with --task lm)")
    p.add_argument("--task", choices=("classification", "lm"), default="classification",
                   help=f"classification (default: MNIST-1D, accuracy) or lm ({LM_SWEEP.name}: a GPT with tied "
                        "embeddings on text-markov, test perplexity, its own claims)")
    p.add_argument("--quick", action="store_true",
                   help=f"the same story in 8 runs instead of 42: {QUICK_SWEEP.name} (4 of the demo's methods, "
                        "1 seed); a preview, its claims are not the demo's")
    p.add_argument("--sweep", default=None, metavar="FILE", help=f"sweep file (default {DEFAULT_SWEEP.name} "
                                                                  "in the repository's experiments/)")
    p.add_argument("--workers", type=int, default=2, help="parallel runs (default 2)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--target", type=float, default=None,
                   help="accuracy (perplexity with --task lm) of the time-to-target table, figure and claims "
                        "(default 0.80, staleopt.claims.DEMO_TARGET, for the demo's own sweeps; --task lm and "
                        "--sweep FILE: GPipe's best + 1%% in the records' metric)")
    p.add_argument("--no-bar", action="store_true", help="no progress bar")
    p.add_argument("--from-records", action="store_true",
                   help="train nothing: rebuild OUT's tables, claims and figures from OUT/records.csv and the "
                        "target of OUT/run.json (the committed run: --out docs/demo --figures docs/img)")
    p.add_argument("--figures", default=None, metavar="DIR", help="where the figures go (default OUT)")
    p.set_defaults(func=run)


def _cell(mean, lo, hi, diverged, runs, digits=3):
    from ..stats import interval_text
    text = interval_text(mean, lo, hi, digits)
    return text + (f" ({diverged}/{runs} div)" if diverged else "")


def _in_order(methods):
    """The distinct ``methods`` (or row labels ``"pipemare lr=0.05"``) in :data:`staleopt.plot.sweep.METHOD_ORDER`
    (others after, alphabetically)."""
    from ..plot.sweep import METHOD_ORDER

    def rank(label):
        m = label.split(" ")[0]
        return METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), label
    return sorted(dict.fromkeys(methods), key=rank)


def _labels(table):
    """Per row of a summary or speedup table: its method, and each other config key the table is grouped by
    (a key the sweep varies within a method and P: ``"pipemare lr=0.05"``, as the figures' legend says)."""
    from ..config import field_names
    keys = [k for k in table.columns if k in field_names() and k not in ("method", "stages", "seed")]
    return [r["method"] + "".join(f" {k}={r[k]}" for k in keys) for _, r in table.iterrows()]


def pivot(summary, value: Optional[str] = None):
    """Methods x stages table of ``value``: ``mean [lo, hi]`` over seeds (:func:`staleopt.stats.interval`:
    the seeds' range below 4 seeds, else the 95% t-interval, within [0, 1] for an accuracy), diverged runs
    counted in each cell, with the metric's digits.

    ``summary`` is :func:`staleopt.sweep.summarize` grouped by method and stages; ``value`` one of its
    per-run columns (default the best of its metric: ``best_acc``, ``best_ppl``); rows follow
    :data:`staleopt.plot.sweep.METHOD_ORDER`.
    """
    from .. import metrics
    if value is None:
        value = next((m.best_column for m in metrics.METRICS.values() if m.best_column in summary.columns),
                     metrics.ACCURACY.best_column)
    digits = metrics.per_run_column(value)[0].digits
    if value not in summary.columns:  # (final_acc of a language model's runs: was a raw AttributeError)
        have = [c for m in metrics.METRICS.values() for c in (m.best_column, m.final_column) if c in summary.columns]
        raise ConfigError(f"the summary has no {value!r} (its runs record another metric): pass one of "
                          f"{', '.join(have)}")
    labels = _labels(summary)
    return _pivot({(label, int(r.stages)): _cell(getattr(r, value), getattr(r, value + "_lo"),
                                                 getattr(r, value + "_hi"), r.diverged, r.runs, digits)
                   for label, r in zip(labels, summary.itertuples())}, labels)


def _pivot(cells, methods):
    """A methods x ``P=s`` DataFrame of ``cells[(method, stages)]`` (``""`` where a cell is missing)."""
    import pandas as pd
    methods = _in_order(methods)
    stages = sorted({s for _, s in cells})
    table = pd.DataFrame([[cells.get((m, s), "") for s in stages] for m in methods], index=methods,
                         columns=[f"P={s}" for s in stages])
    table.index.name = "method"
    return table


def speedup_pivot(table):
    """Methods x stages table of :func:`staleopt.speedup.speedup_table`'s speedup over GPipe.

    A cell is ``"3.93x"`` when every run reached the target, ``"2.10x (2/3)"``
    when only some did (mean over those), ``"- (0/3)"`` when none did, and
    ``"- (3/3 reached, no gpipe time)"`` when runs reached it but GPipe has no
    time to it at that ``P`` (no GPipe runs, or none of them reached it).
    """
    def cell(r):
        if r.reached == 0:
            return f"- (0/{r.runs})"
        if not math.isfinite(r.speedup):
            return f"- ({r.reached}/{r.runs} reached, no gpipe time)"
        return f"{r.speedup:.2f}x" + ("" if r.reached == r.runs else f" ({r.reached}/{r.runs})")
    labels = _labels(table)
    return _pivot({(label, int(r.stages)): cell(r) for label, r in zip(labels, table.itertuples())}, labels)


def provenance(seconds: float, report, run_dirs, workers: int, threads: int, target, sweep_file: Path) -> dict:
    """Where and how a demo run happened: date, CPU, cores, torch version, commit, sweep file, workers, threads,
    target, times, and the machine's load average at the end (other jobs slow a run down).

    ``seconds``: this launch, wall clock; ``run_seconds``: the sum of every run's own
    training time (from the runs' ``done`` files, whichever launch trained them).
    """
    import torch

    from .. import sweep
    run_seconds = sum(sweep.read_done(Path(d) / "done")["seconds"] for d in run_dirs)
    sweep_file = Path(sweep_file).resolve()
    in_repo = sweep_file.is_relative_to(REPO_ROOT)
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_name(), "cores": os.cpu_count(),
            "torch": torch.__version__.split("+")[0], "commit": source_commit(),
            "sweep": str(sweep_file.relative_to(REPO_ROOT) if in_repo else sweep_file),
            "workers": workers, "worker_threads": threads,
            "target": target, "runs": report.total, "runs_trained_now": len(report.finished),
            "seconds": round(seconds), "run_seconds": round(run_seconds),
            "load_average": load_average()}


def _show(result) -> None:
    """Print a demo's tables and claims (:class:`staleopt.compare.Comparison`)."""
    from ..stats import interval_caption
    import pandas as pd
    from ..config import field_names
    from ..sweep import config_key, interval_sizes
    summary, records, memory = result.summary, result.records, result.memory
    keys = [k for k in summary.columns if k in records.columns and k in field_names() and k not in ("stages", "seed")]
    mem_keys = [k for k in keys if memory is not None and k in memory.columns]
    totals = {} if memory is None or "total_ratio_gpipe" not in memory else \
        {config_key(r[[*mem_keys, "stages"]]): r["total_ratio_gpipe"] for _, r in memory.iterrows()}
    first = {}  # a configuration -> its first run (the hardware columns are a function of the configuration)
    for _, run in records.groupby("run", sort=False).first().iterrows():
        first.setdefault(config_key(run[[*keys, "stages"]]), run)
    rows = []
    for label, (_, r) in zip(_labels(summary), summary.iterrows()):  # one row per summary row: the same configs
        mine = first[config_key(r[[*keys, "stages"]])]
        row = {"method": label, "stages": int(r["stages"]), "utilization": mine.get("utilization", math.nan),
               "memory_ratio_gpipe": mine.get("memory_ratio_gpipe", math.nan)}  # (NaN: records without them)
        if totals:
            row["total_ratio_gpipe"] = totals.get(config_key([*r[mem_keys], r["stages"]]), float("nan"))
        rows.append(row)
    hw = pd.DataFrame(rows).set_index(["method", "stages"])
    largest = int(summary["stages"].max())
    m = result.metric
    caption = interval_caption(interval_sizes(summary, [m.best_column]), bounds=m.bounds)
    print(f"\nbest {m.label} over epochs ({caption}; 'div' = runs that diverged):")
    table = result.table()
    print(table.to_string())
    print(f"\npipeline utilization, weight+optimizer memory and total memory with the activations in flight "
          f"(x GPipe) at P = {largest}:")
    at = hw.xs(largest, level="stages") if largest in hw.index.get_level_values("stages") else hw
    print(at.loc[[m for m in table.index if m in at.index]].to_string(float_format=lambda v: f"{v:.3f}"))
    if result.target is None:
        print(f"\nno time to {m.noun}: no target (pass --target; the warning above says why GPipe's runs set none)")
    else:
        print(f"\ntime to {m.noun} {m.format(result.target)}: speedup over GPipe at the same P (pipeline time = "
              "steps to the target / utilization; (k/n): only k of n seeds reached it):")
        print(result.speedup_table().to_string())
    print("\nclaims (evaluated from these runs):")
    print(result.claims.to_string(index=False, max_colwidth=120))


def complete(records, sweep_file=DEFAULT_SWEEP):
    """``records`` with the config columns a slimmed ``records.csv`` left out (the committed one keeps those that
    vary) filled in from ``sweep_file``'s ``[base]``, then :class:`~staleopt.config.RunConfig`'s defaults."""
    from .. import sweep
    from ..config import RunConfig
    fixed = sweep._flat({**RunConfig().to_dict(), **sweep.load_sweep(sweep_file).base})
    return records.assign(**{k: v for k, v in fixed.items() if k not in records.columns})


def _from_records(args) -> int:
    """``--from-records``: the report of OUT/records.csv, trained by an earlier demo."""
    from ..checkpoint import read_records
    from ..compare import write_report
    from ..speedup import shared_target
    out = Path(args.out)
    if not (out / "records.csv").is_file():
        raise ConfigError(f"--from-records reads {out / 'records.csv'}, which does not exist: run the demo first")
    fix = "copy the demo's output again, or run the demo without --from-records (it trains what is not done)"
    info = {}
    if (out / "run.json").is_file():
        try:
            info = json.loads((out / "run.json").read_text())
        except (OSError, ValueError) as e:
            raise RunFileError(f"{out / 'run.json'} is not readable JSON ({e}): {fix}") from None
        if not isinstance(info, dict):
            raise RunFileError(f"{out / 'run.json'} holds a {type(info).__name__}, not a demo's run record: {fix}")
    raw = read_records(out / "records.csv", columns=("run", "method", "stages", "seed", "epoch", "status"), fix=fix)
    claims_ = _claims(args, raw, out / "records.csv")  # (first: another task's sweep file made none of its runs)
    _check_sweep_file(raw, out / "records.csv", _sweep_file(args))
    records = complete(raw, _sweep_file(args))
    _check_whole(records, out / "records.csv")
    # the target the folder's report was written with (report.json: a demo's or a comparison's; else run.json)
    recorded = shared_target(out)
    target = args.target if args.target is not None else recorded if recorded is not None else \
        _default_target(args, records)
    result = write_report(records, out, target=target, figures=args.figures, write_records=False, claims=claims_)
    if info and info.get("target") != target:  # the target the rebuilt tables use (markdown() reads it)
        info["target"] = target
        (out / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    _show(result)
    print(f"\nwrote {', '.join(map(str, result.figures + result.files[1:]))}")
    return 0


def _check_sweep_file(records, where: Path, sweep_file: Path) -> None:
    """The sweep file fills the config columns ``records`` leaves out (:func:`complete`), so it must be the one that
    trained them: one that made none of their runs is refused (its model, data and epochs would stand in the
    tables and memory.csv). Runs of it missing from the records (runs that failed, or a cut at a run's end) are
    warned about. Records that hold every config column take nothing from the file: they are not checked (the
    file may have been edited since)."""
    import warnings

    from .. import sweep
    if set(complete(records.iloc[:0], sweep_file).columns) <= set(records.columns):
        return
    expected = {c.run_id() for c in sweep.load_sweep(sweep_file).configs}
    missing = expected - set(records["run"])
    if missing == expected:
        raise ConfigError(f"{where} holds none of the runs of {sweep_file}, which would fill its config columns "
                          "(model, data, epochs) and memory.csv: pass the --sweep FILE (or --task, --quick) that "
                          "trained them")
    if missing:
        warnings.warn(f"{where} holds {len(expected) - len(missing)} of the {len(expected)} runs of "
                      f"{sweep_file.name} ({len(missing)} missing: failed, or the file was cut at a run's end); "
                      "the tables count the runs it holds", stacklevel=2)


def _check_whole(records, where: Path) -> None:
    """A records file holds finished runs only (a demo records a run once it is done): a run that stops before
    its last epoch without diverging or reaching ``max_steps`` means the file was cut (a partial copy), and its
    tables would count a short run as a finished one: refused."""
    import pandas as pd

    from ..speedup import _capped
    last = records.sort_values(["run", "epoch"], kind="stable").groupby("run").tail(1)
    capped = pd.Series([_capped(r) for _, r in last.iterrows()], index=last.index, dtype=bool)
    short = last[(last["status"] != "diverged") & (last["epoch"] < last["epochs"]) & ~capped]
    if len(short):
        raise ConfigError(f"{where} is not whole: {len(short)} run(s) stop before their last epoch without "
                          f"diverging (run {short['run'].iloc[0]} at epoch {int(short['epoch'].iloc[0])} of "
                          f"{int(short['epochs'].iloc[0])}), as a partial copy does: copy the file again, or "
                          "rebuild it from the demo's run folder (staleopt demo without --from-records resumes "
                          "and trains nothing that finished)")


def _sweep_file(args) -> Path:
    if args.sweep is not None:
        return Path(args.sweep)
    return LM_SWEEP if args.task == "lm" else QUICK_SWEEP if args.quick else DEFAULT_SWEEP


def _claims(args, records, where):
    """The LM demo's claims for ``--task lm``, else the records' default ones (:func:`staleopt.claims.default_claims`);
    a ``--task`` other than the records' (``where``) is refused: the LM claims' perplexity thresholds judged on
    accuracies read "does not hold" and "holds" where nothing was measured."""
    from .. import claims, metrics
    lm = metrics.task_of(records) == "lm"
    if lm != (args.task == "lm"):
        kind = {True: "language model", False: "classifier"}
        raise ConfigError(f"{where} holds a {kind[lm]}'s runs, but --task {args.task} judges them by the claims of "
                          f"a {kind[not lm]}: pass --task {'lm' if lm else 'classification'} (finished runs are kept)")
    return claims.LM_DEMO_CLAIMS if lm else None


def _default_target(args, records):
    """The demo's accuracy target (:data:`staleopt.claims.DEMO_TARGET`) for the demo's own sweep files (it is set
    for them); for a language model and for a sweep of the user's (``--sweep FILE``, any task and metric): GPipe's
    mean best plus 1% in the records' metric (:func:`staleopt.speedup.default_target`, as ``compare`` takes it)."""
    from .. import claims
    from ..speedup import target_or_none
    own = {DEFAULT_SWEEP.resolve(), QUICK_SWEEP.resolve()}
    if args.task != "lm" and _sweep_file(args).resolve() in own:
        return claims.DEMO_TARGET
    return target_or_none(records)


def run(args) -> int:
    from .. import sweep
    from ..compare import check_report_folder, write_report

    if args.quick and args.sweep:
        raise ConfigError("--quick runs its own sweep file; pass --quick or --sweep FILE, not both")
    if args.quick and args.task == "lm":
        raise ConfigError("--quick previews the classification demo; --task lm runs the language-model demo "
                          "(experiments/demo-lm.toml, 48 runs; docs/language-models.md gives its recorded times): "
                          "pass one of the two")
    if args.out is None:
        args.out = "runs/demo-lm" if args.task == "lm" else "runs/demo-quick" if args.quick else "runs/demo"
    if args.figures:  # (before any work: training, or rebuilding the tables)
        output_dir(args.figures, "--figures")
    if args.from_records:
        return _from_records(args)
    path = _sweep_file(args)
    if not path.is_file():
        raise ConfigError(f"demo sweep file {path} not found: run from a checkout of the repository "
                          "(experiments/demo.toml) or pass --sweep FILE")
    check_int("--workers", args.workers, 1)
    check_int("--worker-threads", args.worker_threads, 1)
    spec = sweep.load_sweep(path)
    if args.target is not None:  # (before training: the metric is known from the data, unless it is a user's)
        from .. import data, metrics
        from ..speedup import check_target
        first = spec.configs[0]
        check_target(args.target, metrics.planned(data.task(first.data, **first.data_kwargs)))
    out = Path(args.out)
    check_report_folder(out, [c.run_id() for c in spec.configs])
    t0 = time.perf_counter()
    report = sweep.run_sweep(spec, out, workers=args.workers, threads=args.worker_threads, bar=not args.no_bar)
    elapsed = time.perf_counter() - t0
    ids = {c.run_id() for c in spec.configs}
    records = sweep.collect(out)
    records = records[records["run"].isin(ids)].reset_index(drop=True)  # not runs of an earlier sweep file
    summary = sweep.summarize(records, by=["method", "stages"])
    if summary.empty:
        raise ConfigError(f"no run of {path} finished; see the error.txt files under {out / 'runs'}")
    target = args.target if args.target is not None else _default_target(args, records)  # the preview's too
    result = write_report(records, out, target=target, figures=args.figures,
                          claims=_claims(args, records, f"sweep {path}"))
    print(f"\n{spec.name or path.stem}: {report.total} runs ({len(report.skipped)} already done, "
          f"{len(report.finished)} run now, {len(report.failed)} failed) in {elapsed:.0f} s "
          f"with {args.workers} worker(s) x {args.worker_threads} thread(s)")
    _show(result)
    info = provenance(elapsed, report, [out / 'runs' / r for r in sorted(set(records['run']))], args.workers,
                      args.worker_threads, target, path)
    (out / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"\nwrote {', '.join(map(str, result.figures + result.files + [out / 'run.json']))}")
    for run_id in report.failed:
        print(f"failed: {out / 'runs' / run_id / 'error.txt'}")
    return 0 if report.ok else 1


def markdown(directory) -> str:
    """The README's demo block from a demo's output files (``summary.csv``, ``speedup.csv``, ``claims.csv``,
    ``run.json``; the committed copies are in docs/demo/ and docs/demo-lm/): the table of the best test metric
    (accuracy, or perplexity for a language model), time to its target, claims."""
    import pandas as pd
    from .. import claims, metrics
    from ..stats import interval_caption
    from ..sweep import interval_sizes
    directory = Path(directory)
    summary = pd.read_csv(directory / "summary.csv")
    info = json.loads((directory / "run.json").read_text())
    verdicts = pd.read_csv(directory / "claims.csv")
    m = next((x for x in metrics.METRICS.values() if x.best_column in summary.columns), metrics.ACCURACY)
    seeds = interval_sizes(summary, [m.best_column])
    took = (f"{info['seconds'] / 60:.1f} minutes" if info["runs_trained_now"] == info["runs"] else
            f"{info['runs']} runs trained over several launches")
    lines = [f"Best test {m.noun} over epochs ({'higher' if m.higher_is_better else 'lower'} is better), "
             f"{interval_caption(seeds, bounds=m.bounds)} (`div`: runs that diverged); "
             f"`staleopt demo{' --task lm' if m is not metrics.ACCURACY else ''}` on {info['date']}, "
             f"{info['cores']} cores ({info['cpu']}), torch {info['torch']}, "
             f"{info['workers']} workers x {info['worker_threads']} thread, {took}. The last digits "
             "depend on the CPU (float rounding); docs/demo.md says how long the demo takes and which claims "
             "were checked on seeds and a thread count the demo does not use.", ""]
    table = pivot(summary)
    lines.append("| method | " + " | ".join(table.columns) + " |")
    lines.append("| --- |" + " --- |" * len(table.columns))
    lines += [f"| {m_} | " + " | ".join(row) + " |" for m_, row in zip(table.index, table.values.tolist())]
    if info.get("target") is None:
        lines += ["", f"No time to {m.noun}: the run had no target (GPipe's runs set none; pass `--target`)."]
    else:
        sp = speedup_pivot(pd.read_csv(directory / "speedup.csv"))
        lines += ["", f"Time to {m.noun} {m.format(info['target'])}: speedup over GPipe at the same `P` in "
                  "simulated pipeline time, steps to the target / pipeline utilization (`(k/n)`: only k of n "
                  "seeds reached it):", "", "| method | " + " | ".join(sp.columns) + " |",
                  "| --- |" + " --- |" * len(sp.columns)]
        lines += [f"| {m_} | " + " | ".join(row) + " |" for m_, row in zip(sp.index, sp.values.tolist())]
    lines += ["", "Claims, evaluated from the run (`staleopt demo` prints them and writes `claims.csv`):", "",
              claims.format_table(verdicts), ""]
    return "\n".join(lines)
