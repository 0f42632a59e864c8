"""``staleopt reproduce``: the reproduction ledger (experiments/ledger/ -> docs/reproductions.md)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import ConfigError
from ..validate import check_int, output_dir

__all__ = ["register", "run"]

EXAMPLES = """\
Runs one experiment per checkable claim of the five papers (experiments/ledger/*.toml,
recipes in experiments/ledger/recipes.toml) as one resumable sweep into OUT, then
computes each claim's verdict from the runs and, with --doc, writes the ledger page.

examples:
  staleopt reproduce --out runs/reproduce --doc runs/reproduce/page.md  # every check at 1x (make reproduce)
  staleopt reproduce --tier ladder --out runs/reproduce --doc docs/reproductions.md  # every horizon (make reproduce-ladder)
  staleopt reproduce --list                                             # experiments, checks, runs
  staleopt reproduce --claim t2-at-max-p                                # one check: its runs, its row
  staleopt reproduce --claim pipemare-ablation                          # one experiment
  staleopt reproduce --tier ladder --report-only --doc docs/reproductions.md  # the page from the runs so far
  staleopt reproduce --scale paper --out runs/reproduce-paper --dry-run # CIFAR-10 ResNet-20 (GPU) configs

Each check runs at its `horizons` (run lengths in multiples of its recipe's
epochs, experiments/ledger/*.toml): the quick tier (default) at 1x, the ladder
at every horizon, with a verdict per horizon and the trend of the gap. The cost
(runs, steps, estimated minutes) is printed before training starts.

Interrupt it and run it again: finished runs are kept, the others resume from
their checkpoints. Checks whose runs have not finished read "not yet run".
Launches started at once (on other machines sharing OUT, or --shard i/n) split
the runs between them.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("reproduce", help="run the reproduction ledger and write docs/reproductions.md",
                              description="The reproduction ledger: one experiment per checkable claim of the "
                                          "papers, with verdicts computed from the runs.\n\n" + EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--claim", action="append", default=None, metavar="NAME",
                   help="an experiment (file stem) or a check id; repeat for several (default: all)")
    p.add_argument("--tier", choices=["quick", "ladder"], default="quick",
                   help="quick: every check at the recipes' own length (default); ladder: "
                        "also each check's longer horizons (experiments/ledger/*.toml `horizons`)")
    p.add_argument("--scale", choices=["cpu", "paper"], default="cpu",
                   help="cpu: MNIST-1D (default); paper: CIFAR-10 ResNet-20 on a GPU")
    p.add_argument("--out", default=None, help="sweep directory (default runs/reproduce, runs/reproduce-paper)")
    p.add_argument("--doc", default=None, metavar="PATH", help="write the ledger page here (all experiments)")
    p.add_argument("--workers", type=int, default=2, help="parallel runs, one torch thread each (default 2)")
    p.add_argument("--ledger-dir", default=None, metavar="DIR", help="experiment files (default experiments/ledger)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true",
                      help="list the selected experiments, their checks and run counts in --tier; run nothing")
    mode.add_argument("--dry-run", action="store_true", help="list the runs and their state; run nothing")
    mode.add_argument("--report-only", action="store_true",
                      help="train nothing: rows (and --doc) from finished runs")
    p.add_argument("--download", action="store_true",
                   help="download a missing dataset (--scale paper: CIFAR-10) before training; without it a "
                        "missing dataset is refused before any run starts")
    p.add_argument("--no-bar", action="store_true", help="no progress bar")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="train only shard K of N (1-based) of the runs, e.g. 1/2 on one machine and 2/2 on another")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local process pool (default) or Ray tasks ($RAY_ADDRESS or a local Ray)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import sweep
    from ..ledger import run as ledger, spec
    from ..ledger.analytic import analytic_rows
    from ..ledger.report import table

    check_int("--workers", args.workers, 1)
    if args.doc is not None:  # (before training: the page is written after every run)
        _check_doc(Path(args.doc), make=not (args.list or args.dry_run))
    shard = sweep.parse_shard(args.shard) if args.shard else None
    experiments = spec.load_all(args.scale, Path(args.ledger_dir) if args.ledger_dir else spec.LEDGER_DIR)
    selection = ([spec.find(experiments, name) for name in args.claim] if args.claim
                 else [(e, None) for e in experiments])
    configs, _ = ledger.plan(selection, args.tier)
    out = Path(args.out or ("runs/reproduce" if args.scale == "cpu" else "runs/reproduce-paper"))
    if args.list:
        _list(selection, args.tier)
        print(f"{len(configs)} distinct runs at scale {args.scale}, tier {args.tier}")
        return 0
    mine = sweep.shard(configs, *shard) if shard else configs  # (this launch's runs: what it lists and costs)
    if args.dry_run:
        for c in mine:
            state = sweep.run_state(out / "runs" / c.run_id())
            print(f"{c.run_id()}  {state:10s}  {c.method:15s} P={c.stages:<3d} {c.optimizer:12s} "
                  f"{c.model}/{c.data} seed={c.seed}")
        print(f"{len(mine)} runs into {out}" + (f" (shard {args.shard} of {len(configs)})" if shard else ""))
        print(ledger.estimate(mine, out, args.workers))
        return 0
    report = None
    if args.report_only and not any(sweep.run_state(out / "runs" / c.run_id()) == "done" for c in configs):
        raise ConfigError(f"--report-only found no finished run of this selection in {out / 'runs'}: nothing to "
                          "report (and --doc would overwrite the page with empty rows); give the --out the runs "
                          "were trained into, or train them first (without --report-only)")
    if not args.report_only:
        if args.download or args.executor == "local":   # Ray's workers may hold data this machine lacks
            sweep.load_data([c for c in mine if sweep.run_state(out / "runs" / c.run_id()) != "done"],
                            download=args.download)
        print(ledger.estimate(mine, out, args.workers), flush=True)
        report = ledger.train(configs, out, args.workers, bar=not args.no_bar, shard=shard, executor=args.executor)
        print(f"{len(configs)} runs: {len(report.skipped)} already done, {len(report.finished)} trained now, "
              f"{len(report.failed)} failed, {len(report.claimed)} left to another launch")
    print(table(ledger.rows(selection, out, args.tier)))
    if args.doc:
        ledger.write_page(Path(args.doc), experiments, out, analytic_rows(), args.tier)
        print(f"wrote {args.doc}")
    if report is not None:
        for run_id in report.failed:
            print(f"failed: {out / 'runs' / run_id / 'error.txt'}")
        return 0 if report.ok else 1
    return 0


def _list(selection, tier: str) -> None:
    """Print the experiments of ``selection`` (as of ``spec.find``) with their selected checks (all where the whole
    experiment is selected) and the runs of each in ``tier``."""
    from ..ledger.run import plan
    chosen = {}   # experiment name -> its part of the selection
    for e, check in selection:
        chosen.setdefault(e.name, []).append((e, check))
    for part in chosen.values():
        e = part[0][0]
        ids = {c.id for _, c in part if c is not None}
        checks = e.checks if any(c is None for _, c in part) else [c for c in e.checks if c.id in ids]
        print(f"{e.name}: {e.title} ({e.paper}), {len(plan(part, tier)[0])} runs")
        for c in checks:
            print(f"  {c.id:32s} {c.rule:9s} {len(e.configs_for(c, tier)):3d} runs  {c.source}")


def _check_doc(doc: Path, make: bool = True) -> None:
    """``--doc`` as a page to write (with its CSV and figures beside it), or a :class:`ConfigError`: checked before
    any run trains, where a folder or a read-only place failed after every run had. Its folder is made unless not
    ``make`` (``--list``, ``--dry-run``: they write nothing)."""
    if doc.is_dir():
        raise ConfigError(f"--doc {doc} is a folder: give the markdown page to write, e.g. {doc / 'reproductions.md'}")
    if not make:
        existing = next(p for p in (doc.parent, *doc.parent.parents) if p.exists())
        if not existing.is_dir():
            raise ConfigError(f"--doc's folder {str(doc.parent)!r}: {str(existing)!r} is a file, not a folder: give "
                              "a folder to write into")
        return
    output_dir(str(doc.parent), "--doc's folder")
    if not os.access(doc.parent, os.W_OK) or (doc.exists() and not os.access(doc, os.W_OK)):
        raise ConfigError(f"--doc {doc} cannot be written (no write permission): give a writable path")
