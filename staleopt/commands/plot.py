"""``staleopt plot``: accuracy, utilization, memory and time to accuracy against stages (PipeMare Fig. 2), or
accuracy against epochs or pipeline time at one stage count."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register", "run"]

#: The per-run values ``--metric`` takes: the best and final value of every metric.
_VALUES = ("best_acc", "final_acc", "best_ppl", "final_ppl", "best_test_loss", "final_test_loss")

EXAMPLES = """\
examples:
  staleopt plot runs/demo                  # runs/demo/plots/accuracy_vs_stages.png
  staleopt plot runs/demo --out fig.pdf --metric final_acc --methods gpipe,pipemare
  staleopt plot runs/demo --curves --stages 16 --out runs/demo/curves_P16.png
  staleopt plot runs/demo --time --stages 39 --target 0.95   # accuracy against pipeline time

Default figure (PipeMare Figure 2 layout): three panels against the number of
stages, one line per method: pipeline utilization, weight + optimizer memory
relative to GPipe, and test accuracy (best over epochs, mean over seeds with
a confidence band), and, when the sweep has GPipe runs, each method's speedup
to a target accuracy over GPipe in pipeline time (steps to the target divided
by the pipeline utilization; PipeMare Table 2). Diverged runs are drawn as x,
never dropped.
--curves draws test accuracy against epochs at one stage count (Fig. 7/8);
--time draws it against simulated pipeline time (Fig. 11).
A language model's sweep draws test perplexity instead (lower is better; the
target is GPipe's best perplexity plus 1%), and --metric picks another value
(e.g. best_test_loss), in every figure.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="plot a sweep: accuracy/utilization/memory vs stages, or curves",
                              description="Plot the finished runs of a sweep directory.\n\n" + EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir", metavar="SWEEP_DIR", help="the --out directory of `staleopt sweep`")
    p.add_argument("--out", default=None,
                   help="image path, format from the suffix (default SWEEP_DIR/plots/accuracy_vs_stages.png, "
                        "SWEEP_DIR/plots/accuracy_vs_epoch_P<stages>.png with --curves, "
                        "SWEEP_DIR/plots/accuracy_vs_time_P<stages>.png with --time: never the demo's own "
                        "figures)")
    p.add_argument("--curves", action="store_true", help="test accuracy against epochs at --stages")
    p.add_argument("--time", action="store_true", help="test accuracy against pipeline time at --stages")
    p.add_argument("--target", type=float, default=None,
                   help="target accuracy of the time-to-accuracy panel and line (default: the sweep's own, "
                        "from SWEEP_DIR/report.json; else GPipe's mean best accuracy minus 0.01)")
    p.add_argument("--stages", type=int, default=None, help="stage count P of the --curves or --time plot")
    p.add_argument("--metric", choices=_VALUES, default=None,
                   help="value shown against stages, and its metric in the curves (default: the best over epochs "
                        "of the sweep's metric, best_acc for classification, best_ppl for a language model)")
    p.add_argument("--methods", default=None, help="comma-separated methods to draw (default: all in the sweep)")
    p.add_argument("--level", type=float, default=None,
                   help="confidence level of the default figure's bands (default 0.95); --curves and --time draw "
                        "no interval")
    p.add_argument("--title", default=None, help="figure title (default: read off the runs' configs)")
    p.add_argument("--dpi", type=int, default=150)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import ConfigError
    from ..plot import sweep as plots

    sweep_dir = Path(args.sweep_dir)
    if not (sweep_dir / "runs").is_dir():
        raise ConfigError(f"{sweep_dir} is not a sweep directory (no runs/ inside); pass the --out directory "
                          "of `staleopt sweep` or `staleopt demo`")
    from .. import speedup
    from ..sweep import collect
    from ..validate import MAX_DPI, check_int, output_dir, output_image
    check_int("--dpi", args.dpi, 1, MAX_DPI, why="dots per inch of the PNG")
    if args.out:  # (before any drawing: a path matplotlib cannot write would lose the figure)
        output_image(args.out)
    else:
        output_dir(str(sweep_dir / "plots"), f"{sweep_dir}'s plots folder")
    if args.curves and args.target is not None:
        raise ConfigError("--target is the target of the default figure's speedup panel and of --time; --curves "
                          "draws the metric against epochs, which has none: leave --target out")
    if (args.curves or args.time) and args.level is not None:
        raise ConfigError(f"--level is the confidence level of the default figure's bands; --"
                          f"{'curves' if args.curves else 'time'} draws means and each seed's curve, no interval: "
                          "leave --level out")
    methods = args.methods.split(",") if args.methods else None
    records = collect(sweep_dir)
    if records.empty:
        raise ConfigError(f"{sweep_dir} holds no finished runs: run the sweep first")
    from ..metrics import per_run_column
    metric = per_run_column(args.metric)[0] if args.metric else None
    if args.target is not None:  # (also where no panel would use it: the records lack GPipe)
        from ..metrics import of
        speedup.check_target(args.target, of(records, metric))
    target = args.target if args.target is not None else speedup.shared_target(sweep_dir, records, metric)
    title = args.title or plots.describe(records)
    mine = sweep_dir / "plots"
    if args.curves and args.time:
        raise ConfigError("--curves and --time are two different figures; pass one of them")
    if args.curves or args.time:
        if args.stages is None:
            raise ConfigError(f"--{'curves' if args.curves else 'time'} needs --stages P (one of the sweep's "
                              "stage counts)")
        if args.curves:
            fig = plots.plot_accuracy_vs_epoch(records, args.stages, methods=methods,
                                               title=f"{title}, P = {args.stages}", metric=metric)
            out = args.out or mine / f"accuracy_vs_epoch_P{args.stages}.png"
        else:
            fig = plots.plot_accuracy_vs_time(records, args.stages, target=target,
                                              methods=methods, title=f"{title}, P = {args.stages}", metric=metric)
            out = args.out or mine / f"accuracy_vs_time_P{args.stages}.png"
    else:
        if args.stages is not None:
            raise ConfigError("--stages selects the stage count of --curves or --time; the default figure shows "
                              "all stages")
        bands = {} if args.level is None else {"level": args.level}  # (else the figure's own default)
        fig = plots.plot_accuracy_vs_stages(records, metric=args.metric, methods=methods, title=title,
                                            target=target, **bands)
        out = args.out or mine / "accuracy_vs_stages.png"
    print(f"wrote {plots.save(fig, out, dpi=args.dpi)}")
    from .sweep import failed_runs_note
    failed = failed_runs_note(sweep_dir, "the figure is")
    if failed:
        print(failed, file=sys.stderr)
        return 1
    return 0
