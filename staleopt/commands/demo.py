"""``staleopt demo``: the headline sweep on MNIST-1D, its table and the accuracy-vs-stages figure."""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

__all__ = ["register", "run", "DEFAULT_SWEEP", "pivot"]

#: The demo's sweep file, in the repository next to the package.
DEFAULT_SWEEP = Path(__file__).resolve().parents[2] / "experiments" / "demo.toml"

EXAMPLES = """\
Runs experiments/demo.toml: gpipe, pipedream, 1f1b, pipemare-t1 and pipemare
on MNIST-1D over P = 1, 2, 4, 8, 16 and the model's maximum, 2 seeds each, then
prints the results and writes into OUT:

  accuracy_vs_stages.png        utilization, memory (x GPipe), accuracy vs P (PipeMare Fig. 2)
  accuracy_vs_epoch_P<max>.png  accuracy curves at the largest P (PipeMare Fig. 7/8)
  summary.csv, records.csv      per-group summary (mean, 95% CI over seeds) and every record

It is a resumable sweep: run it again after an interruption and finished runs
are kept.

examples:
  staleopt demo                          # runs/demo, 2 workers
  staleopt demo --out /tmp/demo --workers 4
  staleopt demo --sweep experiments/my_sweep.toml --out runs/mine
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the MNIST-1D stages sweep and draw accuracy vs stages",
                              description="The main demo: a resumable sweep, its table and figures.\n\n" + EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="sweep directory (default runs/demo)")
    p.add_argument("--sweep", default=None, metavar="FILE", help=f"sweep file (default {DEFAULT_SWEEP.name} "
                                                                  "in the repository's experiments/)")
    p.add_argument("--workers", type=int, default=2, help="parallel runs (default 2), one torch thread each")
    p.add_argument("--no-bar", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _cell(mean, ci, diverged, runs):
    if isinstance(mean, float) and math.isnan(mean):
        return "-"
    text = f"{mean:.3f}" if math.isnan(ci) else f"{mean:.3f}±{ci:.3f}"
    return text + (f" ({diverged}/{runs} div)" if diverged else "")


def pivot(summary, value: str = "best_acc"):
    """Methods x stages table of ``value`` (mean ± CI over seeds), diverged runs counted in each cell.

    ``summary`` is :func:`staleopt.sweep.summarize` grouped by method and stages; rows follow
    :data:`staleopt.plot.sweep.METHOD_ORDER`.
    """
    import pandas as pd
    from ..plot.sweep import METHOD_ORDER
    cells = {(r.method, int(r.stages)): _cell(getattr(r, value), getattr(r, value + "_ci"), r.diverged, r.runs)
             for r in summary.itertuples()}
    methods = sorted(dict.fromkeys(summary["method"]),
                     key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m))
    stages = sorted({s for _, s in cells})
    table = pd.DataFrame([[cells.get((m, s), "") for s in stages] for m in methods], index=methods,
                         columns=[f"P={s}" for s in stages])
    table.index.name = "method"
    return table


def run(args) -> int:
    from .. import sweep
    from ..errors import ConfigError
    from ..plot import sweep as plots

    path = Path(args.sweep) if args.sweep else DEFAULT_SWEEP
    if not path.is_file():
        raise ConfigError(f"demo sweep file {path} not found: run from a checkout of the repository "
                          "(experiments/demo.toml) or pass --sweep FILE")
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    spec = sweep.load_sweep(path)
    out = Path(args.out)
    t0 = time.perf_counter()
    report = sweep.run_sweep(spec, out, workers=args.workers, threads=1, bar=not args.no_bar)
    elapsed = time.perf_counter() - t0
    ids = {c.run_id() for c in spec.configs}
    records = sweep.collect(out)
    records = records[records["run"].isin(ids)].reset_index(drop=True)  # not runs of an earlier sweep file
    summary = sweep.summarize(records, by=["method", "stages"])
    if summary.empty:
        raise ConfigError(f"no run of {path} finished; see the error.txt files under {out / 'runs'}")
    records.to_csv(out / "records.csv", index=False)
    summary.to_csv(out / "summary.csv", index=False)
    hw = records.groupby(["method", "stages"], sort=False)[["utilization", "memory_ratio_gpipe"]].first()
    largest = int(summary["stages"].max())

    print(f"\n{spec.name or path.stem}: {report.total} runs ({len(report.skipped)} already done, "
          f"{len(report.finished)} run now, {len(report.failed)} failed) in {elapsed:.0f} s "
          f"with {args.workers} worker(s)")
    print("\nbest test accuracy over epochs (mean ± 95% CI over seeds; 'div' = runs that diverged):")
    print(pivot(summary).to_string())
    print(f"\npipeline utilization and weight+optimizer memory (x GPipe) at P = {largest}:")
    at = hw.xs(largest, level="stages") if largest in hw.index.get_level_values("stages") else hw
    print(at.loc[[m for m in pivot(summary).index if m in at.index]].to_string(float_format=lambda v: f"{v:.3f}"))
    figure = plots.save(plots.plot_accuracy_vs_stages(records, title=spec.description or None),
                        out / "accuracy_vs_stages.png")
    curves = plots.save(plots.plot_accuracy_vs_epoch(records, largest), out / f"accuracy_vs_epoch_P{largest}.png")
    print(f"\nwrote {figure}, {curves}, {out / 'summary.csv'}, {out / 'records.csv'}")
    for run_id in report.failed:
        print(f"failed: {out / 'runs' / run_id / 'error.txt'}")
    return 0 if report.ok else 1
