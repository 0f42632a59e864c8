"""``staleopt sweep`` (run a resumable sweep) and ``staleopt results`` (summarize one)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..validate import check_int, output_dir, output_file

__all__ = ["register", "run_sweep_command", "run_results_command"]

SWEEP_EXAMPLES = """\
A sweep file (TOML) holds a [base] config and a [grid] of lists:

    name = "stages"
    [base]
    model = "resnet1d"
    epochs = 5
    [grid]
    method = ["gpipe", "pipedream", "pipemare"]
    stages = [1, 4, 16, "max"]
    seed = [0, 1]

examples:
  staleopt sweep experiments/demo.toml --out runs/demo --workers 2
  staleopt sweep experiments/demo.toml --out runs/demo --dry-run      # list runs and their state
  staleopt sweep experiments/demo.toml --out runs/demo --shard 1/4    # this machine's quarter
  RAY_ADDRESS=head:6379 staleopt sweep experiments/demo.toml --out /shared/demo --executor ray
  staleopt results runs/demo

Each run lives in OUT/runs/<hash of its config>/; a run is finished once its
'done' file exists. Every run checkpoints at its epoch ends (and every
--checkpoint-every steps); launching again skips finished runs and resumes the
others from their checkpoints, so an interrupted sweep (even kill -9) resumes
where it stopped. A worker process that dies (killed, out of memory) fails
only its own run (its error.txt says so) and the launch goes on. Launches may
overlap: each run is claimed by the process that trains it, other launches
leave it alone, and the claim of a process that died is taken over by the
next launch (--dry-run shows the owners).
"""

RESULTS_EXAMPLES = """\
examples:
  staleopt results runs/demo                      # table + runs/demo/results/summary.csv, records.csv
  staleopt results runs/demo --by method,stages   # group by these keys only (others pooled)
  staleopt results runs/demo --level 0.9          # 90% confidence intervals
  staleopt results runs/demo --partial            # also the runs in flight, up to their last epoch
  staleopt results runs/demo --target 0.95        # time to accuracy 0.95: speedup over GPipe per method and P

When the sweep has GPipe runs (or --target is given) it also prints the time to
a target accuracy: the steps each run needed to reach it (first epoch at the
target) divided by the method's pipeline utilization, and the speedup over
GPipe at the same stage count (PipeMare Table 2); written to SWEEP_DIR/results/speedup.csv
with its target. The target is the sweep's own (the one `staleopt demo` or
`staleopt compare` wrote into SWEEP_DIR/report.json), else GPipe's mean best
accuracy minus 0.01. The files go to SWEEP_DIR/results/, so the demo's own
summary.csv and speedup.csv are never overwritten.

The metric is the task's (staleopt.metrics): test accuracy for classification;
for a language model test perplexity (best_ppl, final_ppl: lower is better, the
target is reached at or below it, by default GPipe's best plus 1%), with
excess_loss, the lowest test loss above the dataset's best achievable loss,
where the data knows it. --metric test_loss summarizes the loss instead.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", help="run a grid of training configs, resumably",
        description="Run every unfinished run of a sweep file.\n\n" + SWEEP_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_file", metavar="SWEEP_FILE", help="TOML (or JSON) file with [base] and [grid]")
    p.add_argument("--out", default=None,
                   help="sweep directory (default: runs/<name in the file, else the file's stem>)")
    p.add_argument("--workers", type=int, default=1, help="parallel runs, one process each (default 1)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per run (default 1, at most 1024)")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local: this machine (--workers processes); ray: Ray tasks on $RAY_ADDRESS, or on a "
                        "local Ray with --workers CPUs (pip install 'staleopt[ray]')")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="run only the K-th of N disjoint slices of the sweep (1 <= K <= N)")
    p.add_argument("--progress", action="store_true", help="show each run's own progress (steps, ETA)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                   help="checkpoint each run every STEPS optimizer steps too (default: at epoch ends only)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's checkpoint.pt when it is done (default: delete it)")
    p.add_argument("--claim-timeout", type=float, default=None, metavar="SECONDS",
                   help="this launch's claims are stale once their heartbeat is older than this (default 600; "
                        "recorded in each claim, which other launches honour); a claim of a dead process on this "
                        "host is taken over at once")
    p.add_argument("--no-bar", action="store_true", help="no progress bar over runs")
    p.add_argument("--dry-run", action="store_true",
                   help="list the runs, their state and who runs them; run nothing")
    p.add_argument("--download", action="store_true",
                   help="download missing datasets (CIFAR) before starting the runs")
    p.add_argument("--train-fn", default=None, metavar="MODULE:FUNCTION",
                   help="train function called as f(config, progress=...) -> DataFrame "
                        "(default staleopt.train:run)")
    p.set_defaults(func=run_sweep_command)

    r = subparsers.add_parser(
        "results", help="summarize a sweep: mean +- CI over seeds, best and final accuracy",
        description="Collect every finished run of a sweep directory into one table: mean and "
                    "Student-t confidence interval over seeds of the best and final test accuracy, "
                    "and the status (diverged runs are counted, not dropped).\n\n" + RESULTS_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("sweep_dir", metavar="SWEEP_DIR")
    r.add_argument("--by", default=None, help="comma-separated config keys to group by (default: all but seed)")
    r.add_argument("--level", type=float, default=0.95, help="confidence level (default 0.95)")
    r.add_argument("--csv", default=None, help="summary CSV path (default SWEEP_DIR/results/summary.csv)")
    r.add_argument("--records", default=None, help="all records CSV path (default SWEEP_DIR/results/records.csv)")
    r.add_argument("--target", type=float, default=None,
                   help="target accuracy (perplexity, loss: --metric) of the time-to-accuracy table (default: the "
                        "sweep's own, from SWEEP_DIR/report.json; else GPipe's mean best accuracy minus 0.01, or "
                        "its best perplexity plus 1%%)")
    r.add_argument("--metric", choices=("test_acc", "test_ppl", "test_loss"), default=None,
                   help="the test metric summarized (default the sweep's task's: test_acc for classification, "
                        "test_ppl for a language model, test_loss for regression)")
    r.add_argument("--partial", action="store_true",
                   help="include runs in flight or interrupted, up to their last recorded epoch")
    r.set_defaults(func=run_results_command)


def _describe(run_dir: Path, state: str, epochs: int, timeout: float) -> str:
    """What --dry-run says about a run beyond its state: its owner (if it has one), and how far it got."""
    from .. import lease
    parts = []
    held = lease.holder(run_dir, timeout) if state == "running" else None
    if held is not None:  # (the owner may have let go since the state was read)
        parts.append(f"claimed by {held[0]}, heartbeat {held[1]:.0f} s ago")
    from .. import sweep
    from ..errors import RunFileError
    records = run_dir / "records.csv"
    if state == "damaged":
        parts.append(str(sweep.damage(run_dir)))
    elif state in ("running", "incomplete", "failed") and records.is_file():
        try:
            done = f"{len(sweep.read_records(records, columns=('status',)))}/{epochs} epochs recorded"
        except RunFileError as e:
            done = str(e)
        parts.append(done + (", checkpoint" if (run_dir / "checkpoint.pt").is_file() else ""))
    return "; ".join(parts)


def run_sweep_command(args) -> int:
    from .. import lease, sweep

    spec = sweep.load_sweep(args.sweep_file)
    out = Path(args.out) if args.out else Path("runs") / (spec.name or Path(args.sweep_file).stem)
    shard_spec = sweep.parse_shard(args.shard) if args.shard else None
    configs = sweep.shard(spec.configs, *shard_spec) if shard_spec else spec.configs
    check_int("--workers", args.workers, 1)
    check_int("--worker-threads", args.worker_threads, 1, sweep.MAX_THREADS, why="torch threads per run")
    check_int("--checkpoint-every", args.checkpoint_every, 1, optional=True, why="optimizer steps between checkpoints")
    timeout = lease.DEFAULT_TIMEOUT if args.claim_timeout is None else args.claim_timeout
    try:
        lease.check_timeout(timeout)
    except ConfigError as e:
        raise ConfigError(f"--claim-timeout: {e}") from None
    for folder in (out, out / "runs"):  # (the launch's own checks, before a dry run lists what it would do)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--out {str(out)!r}: {folder} is a file, not a folder: give a folder to write into")
    if args.train_fn is not None:
        sweep._resolve_fn(args.train_fn)
    if args.dry_run:
        for cfg in configs:
            run_dir = out / "runs" / cfg.run_id()
            state = sweep.run_state(run_dir, timeout)
            varying = json.dumps({k: getattr(cfg, k) for k in spec.grid})
            print(f"{cfg.run_id()} {state:10s} {varying} {_describe(run_dir, state, cfg.epochs, timeout)}".rstrip())
        print(f"{len(configs)} runs in {out}")
        return 0
    if args.download:
        sweep.load_data(configs, download=True)
    report = sweep.run_sweep(configs, out, workers=args.workers, train_fn=args.train_fn,
                             progress=args.progress, threads=args.worker_threads, bar=not args.no_bar,
                             executor=args.executor, checkpoint_every=args.checkpoint_every,
                             keep_checkpoints=args.keep_checkpoints, claim_timeout=timeout)
    diverged = sum(s == "diverged" for s in report.finished.values())
    print(f"{out}: {report.total} runs; {len(report.skipped)} already done, {len(report.finished)} finished "
          f"now ({diverged} diverged), {len(report.claimed)} left to other launches, {len(report.failed)} failed"
          + (f", {len(report.damaged)} damaged" if report.damaged else ""))
    for run_id in report.failed:
        print(f"  failed: {out / 'runs' / run_id / 'error.txt'} (launch again to retry it, from its checkpoint)",
              file=sys.stderr)
    for run_id, why in report.damaged.items():
        print(f"  damaged, left alone: {why}", file=sys.stderr)
    return 0 if report.ok else 1




def failed_runs_note(sweep_dir: Path, what: str) -> Optional[str]:
    """The line ``results`` and ``plot`` print (to stderr, then exit 1) when runs of the sweep failed: their
    tables and figures are over the runs that finished."""
    from .. import sweep
    listed = sweep.runs(sweep_dir)
    failed = sorted(listed.loc[listed["state"] == "failed", "run"]) if len(listed) else []
    if not failed:
        return None
    return (f"{len(failed)} run(s) failed ({sweep.few(failed)}; "
            f"{sweep_dir / 'runs'}/<run>/error.txt says why, and launching the sweep again retries them): {what} "
            "over the runs that finished, so a configuration with fewer runs than the others lacks them")


def _check_outputs(sweep_dir: Path, outputs: dict) -> None:
    """Refuse ``results`` outputs (flag -> path) that overwrite one another (``--csv X --records X`` kept only the
    summary) or a file of a run (``--records RUN/records.csv`` left the run damaged): before anything is written."""
    runs = (sweep_dir / "runs").resolve()
    seen = {}
    for flag, path in outputs.items():
        where = Path(path).resolve()
        if where == runs or runs in where.parents:
            raise ConfigError(f"{flag} {path} is inside {sweep_dir / 'runs'}, whose files are the runs' own (a run "
                              "rewritten is damaged): write elsewhere")
        if where in seen:
            raise ConfigError(f"{flag} and {seen[where]} both write {path}, so one table would be lost: give each "
                              "its own file")
        seen[where] = flag


def _thread_counts(sweep_dir: Path) -> dict:
    """Torch thread count -> number of finished runs trained under it (their ``done`` markers' ``threads``)."""
    from ..checkpoint import read_done
    from ..errors import RunFileError
    counts = {}
    for done in sorted((sweep_dir / "runs").glob("*/done")):
        try:
            threads = read_done(done).get("threads")
        except RunFileError:
            continue  # (a damaged marker: reported as such)
        if isinstance(threads, int) and not isinstance(threads, bool):
            counts[threads] = counts.get(threads, 0) + 1
    return counts


def run_results_command(args) -> int:
    from .. import speedup, sweep
    from .. import metrics
    from ..stats import interval_caption, interval_text
    from ..sweep import interval_sizes

    sweep_dir = Path(args.sweep_dir)
    if not (sweep_dir / "runs").is_dir():
        raise ConfigError(f"{sweep_dir} is not a sweep directory (no runs/ inside); "
                          "pass the --out directory of `staleopt sweep`")
    for flag, path in (("--records", args.records), ("--csv", args.csv)):  # (before any file is written)
        if path:
            output_file(str(path), flag)
    mine = sweep_dir / "results"  # (not the demo's files)
    _check_outputs(sweep_dir, {"--records" if args.records else "the records (default)": args.records or
                               mine / "records.csv", "--csv" if args.csv else "the summary (default)":
                               args.csv or mine / "summary.csv", "the time table": mine / "speedup.csv"})
    output_dir(str(mine), f"{sweep_dir}'s results folder")
    damaged = {}
    records = sweep.collect(sweep_dir, partial=args.partial, damaged=damaged)
    states = sweep.runs(sweep_dir)["state"].value_counts().to_dict()
    for why in damaged.values():  # one bad run is reported; the others are summarized
        print(f"skipped a damaged run: {why}", file=sys.stderr)
    by = args.by.split(",") if args.by else None
    metric = metrics.of(records, args.metric)
    if args.target is not None:
        speedup.check_target(args.target, metric)
    summary = sweep.summarize(records, by=by, level=args.level, metric=metric)
    target = args.target if args.target is not None else speedup.shared_target(sweep_dir, records, metric)
    fast = None
    if target is not None and not summary.empty:  # (before anything is written: a bad target changes no file)
        # the figures' configurations (method, the keys that split lines, P: a key set per method such as GPipe's
        # microbatches splits nothing, docs/experiments.md), or the --by groups
        # (always the figures' configurations: a time table over --by groups pooled GPipe's times over P and matched
        # no stage count)
        keys = ["method", *sweep.varying_keys(records), "stages"]
        fast = speedup.speedup_table(records, target, keys=keys, metric=metric)
    records.to_csv(args.records or mine / "records.csv", index=False)
    summary.to_csv(args.csv or mine / "summary.csv", index=False)
    if fast is None:  # an earlier call's time table would not match this summary
        (mine / "speedup.csv").unlink(missing_ok=True)
    else:
        fast.to_csv(mine / "speedup.csv", index=False)
    if summary.empty:
        print(f"{sweep_dir}: no {'recorded' if args.partial else 'finished'} runs yet ({states})")
        return 1 if damaged else 0
    shown = summary.copy()
    values = (metric.best_column, metric.final_column)
    for col in values:
        shown[col] = [interval_text(m, lo, hi, 4) for m, lo, hi in
                      zip(summary[col], summary[f"{col}_lo"], summary[f"{col}_hi"])]
    shown = shown.drop(columns=[f"{c}_{s}" for c in values for s in ("lo", "hi", "ci", "interval", "n")] + ["diverged"])
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    pooled = [] if by is None else sweep.pooled_keys(records, by)
    caption = interval_caption(interval_sizes(summary, values), args.level, metric.bounds,
                               unit="run" if pooled else "seed")
    if pooled:
        caption += f"; a row pools its runs over every value of {', '.join(pooled)}"
    if any(math.isinf(v) for c in values for v in summary[c]):  # (stats.interval: no t-interval holds an infinite mean)
        caption += "; a mean of inf shows the range [min, inf]"
    what = "accuracies" if metric is metrics.ACCURACY else \
        f"{metric.label}, {'higher' if metric.higher_is_better else 'lower'} is better"
    print(f"({what}: {caption}" + ("; rows with fewer runs: see the runs column" if summary["runs"].nunique() > 1
                                   else "") + ")")
    if "excess_loss" in summary.columns:
        print("(excess_loss: the lowest test loss above the dataset's best achievable loss, nats per token)")
    print(f"\n{sum(states.values())} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    threads = _thread_counts(sweep_dir)
    if len(threads) > 1:  # (torch's float results depend on the thread count)
        print("runs trained under different torch thread counts (" + ", ".join(
            f"{n} under {t}" for t, n in sorted(threads.items())) + "; 'threads' in each run's done): torch's "
            "float results depend on the thread count, so they may differ from one another in the last digits")
    failed = failed_runs_note(sweep_dir, "the summary is")
    if failed:
        print(failed, file=sys.stderr)
    if args.partial and set(states) - {"done"}:
        print("--partial: runs not done count with their last recorded epoch as the final one")
    written = [args.csv or mine / "summary.csv", args.records or mine / "records.csv"]
    if fast is not None:
        written.append(mine / "speedup.csv")
        print(f"\ntime to {metric.noun} {target:.4g} (pipeline time = steps to the target / utilization; speedup over "
              "gpipe at the same configuration; mean over the runs that reached it):")
        print(fast.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {', '.join(map(str, written))}")
    return 1 if damaged or failed else 0
