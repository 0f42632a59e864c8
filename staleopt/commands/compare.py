"""``staleopt compare``: one's own model and data through the demo's sweep, tables, claims and figures
(:func:`staleopt.compare` from the command line)."""
from __future__ import annotations

import argparse
import json

from ..errors import ConfigError
from ..validate import check_int

__all__ = ["register", "run"]

EXAMPLES = """\
examples:
  staleopt compare --model my_models.py:my_cnn --data my_models.py:my_data --out runs/mine
  staleopt compare --model my_models.py:my_cnn --data mnist1d --methods gpipe,pipedream,pipemare \\
                   --stages 2,max --seeds 0,1,2 --set epochs=5 --set lr=0.05 --workers 2
  staleopt compare --model mlp --data synthetic --set 'data_kwargs={"num_samples": 500}' --set epochs=3

--model and --data take a built-in name or a 'module:function' / 'path/to/file.py:function'
spec (docs/tutorial.md says what the functions return). The runs are a resumable sweep in
OUT/runs/; run the same command again after an interruption and only the missing runs train.
OUT receives records.csv, summary.csv, speedup.csv (with its target), claims.csv, report.json
and the figures, as `staleopt demo` writes them.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("compare", help="compare methods and stage counts on your own model and data",
                              description="Train methods x stages x seeds of a model on a dataset (a resumable "
                                          "sweep) and write the demo's tables, claims and figures.\n\n" + EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model name or 'module:function' / 'file.py:function' spec")
    p.add_argument("--data", default="mnist1d", help="dataset name or spec (default mnist1d)")
    p.add_argument("--methods", default="gpipe,pipedream,pipemare", help="comma-separated methods "
                                                                          "(default gpipe,pipedream,pipemare)")
    p.add_argument("--stages", default="1,max", help="comma-separated stage counts, 'max' = the model's units "
                                                     "(default 1,max)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another RunConfig field for every run; VALUE is JSON (a bare word is a string); repeat")
    p.add_argument("--out", default="runs/compare", help="sweep directory (default runs/compare)")
    p.add_argument("--target", type=float, default=None,
                   help="accuracy (or perplexity, loss: --metric) of the time-to-accuracy table and claims "
                        "(default: GPipe's mean best accuracy minus 0.01, or its best perplexity plus 1%%)")
    p.add_argument("--metric", choices=("test_acc", "test_ppl", "test_loss"), default=None,
                   help="what runs are judged by (default the data's task's: test_acc for classification, "
                        "test_ppl for a language model, test_loss for regression)")
    p.add_argument("--workers", type=int, default=1, help="parallel runs (default 1)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--no-bar", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


#: compare()'s own arguments, which --set (RunConfig fields) does not take, with the flag that sets each.
_OWN = {"model": "--model", "data": "--data", "method": "--methods", "methods": "--methods", "stages": "--stages",
        "seed": "--seeds", "seeds": "--seeds", "target": "--target", "metric": "--metric", "workers": "--workers",
        "threads": "--worker-threads", "bar": "--no-bar", "out": "--out", "claims": None}


def _settings(items):
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set takes KEY=VALUE (e.g. epochs=5), got {item!r}")
        if key.strip() in _OWN:  # (passed twice to compare(): a TypeError; claims= trained every run, then failed)
            flag = _OWN[key.strip()]
            raise ConfigError(f"--set {item}: {key.strip()} is the comparison's own, not a setting shared by its "
                              "runs: " + (f"pass {flag}" if flag else "the command evaluates the default claims; "
                                          "pass your own to staleopt.compare(claims=)"))
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def _stage(text):
    return text if text == "max" else int(text)


def run(args) -> int:
    from ..compare import compare
    check_int("--workers", args.workers, 1)
    check_int("--worker-threads", args.worker_threads, 1, why="torch threads per run")
    try:
        stages = [_stage(s) for s in args.stages.split(",") if s.strip()]
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--stages takes ints or 'max' and --seeds ints, comma-separated; got "
                          f"{args.stages!r} and {args.seeds!r}") from None
    result = compare(args.model, args.data, methods=[m for m in args.methods.split(",") if m.strip()],
                     stages=stages, seeds=seeds, out=args.out, target=args.target, workers=args.workers,
                     threads=args.worker_threads, bar=not args.no_bar, metric=args.metric, **_settings(args.set))
    from ..stats import interval_caption
    from ..sweep import interval_sizes
    m = result.metric
    seeds = interval_sizes(result.summary, [m.best_column])
    print(f"best {m.label} over epochs ({interval_caption(seeds, bounds=m.bounds)}; 'div' = runs that diverged):")
    print(result.table().to_string())
    if result.target is not None:
        aim = f"\ntime to {m.noun} {m.format(result.target)}"
        if "gpipe" in set(result.records["method"]):
            print(f"{aim}: speedup over GPipe at the same P (pipeline time):")
        else:  # (the target still times every run: speedup.csv and the figure against pipeline time)
            print(f"{aim}: no gpipe runs, so no speedup over GPipe (add gpipe to --methods for one); each run's "
                  "pipeline time to it is in speedup.csv, and the figure against pipeline time draws it:")
        print(result.speedup_table().to_string())
    print("\nclaims (evaluated from these runs):")
    print(result.claims.to_string(index=False, max_colwidth=120))
    print(f"\nwrote {', '.join(map(str, result.files + result.figures))}")
    return 0 if result.report.ok else 1
