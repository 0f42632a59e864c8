"""``staleopt train``: run one configuration from flags (one flag per :class:`RunConfig` field)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import tomllib
from pathlib import Path

from .. import data, lease, methods, train
from ..checkpoint import Checkpoint, check_writable, read_done, read_records
from ..config import (_LATER_FIELDS, CHOICES, CORRECTION_FIELDS, RunConfig, field_names, refuse_ineffective,
                      validate_field)
from ..errors import ConfigError
from ..validate import check_int

__all__ = ["register", "run", "config_from_args", "checkpoint_of"]

EXAMPLES = """\
Every RunConfig field is a flag (underscores become dashes); unset flags keep
the RunConfig defaults. Dict fields take JSON, list fields comma-separated values.

examples:
  staleopt train --model resnet1d --method pipemare --stages 16 --epochs 10
  staleopt train --method pipedream --stages max --lr 0.05 --out runs/pd.csv
  staleopt train --config base.json --method 1f1b --stages 8 --seed 1
  staleopt train --model mlp --model-kwargs '{"depth": 4}' --data synthetic \\
                 --data-kwargs '{"num_samples": 500}' --method pipemare-t1 --stages 5
  staleopt train --data cifar10 --download --model resnet20 --method pipemare --stages max

The records (one row per epoch: train loss, test accuracy, wall time) are
printed as each epoch ends and, with --out, written as CSV (with the method's
analytic utilization and memory) after every epoch. A run whose loss is non-finite or above
--divergence-loss stops with status "diverged".

With --out, the run also saves a checkpoint OUT.ckpt at every epoch end (and
every --checkpoint-every steps): the same command run again after a crash or
kill -9 continues from it, with the records of an uninterrupted run. A
finished run writes the marker OUT.done (its status and the records'
checksum), then deletes the checkpoint unless --keep-checkpoint; the same
command run again then prints the finished records (checked against the
marker) and trains nothing, unless --rerun. An OUT that is neither finished
nor resumable (no OUT.done, no OUT.ckpt) is not overwritten without --rerun.
While it runs, the launch holds the claim OUT.claim.<n> beside OUT: a second
launch on the same --out is refused at start, naming the first.
"""


# (argparse prints an ArgumentTypeError's text after the flag; any other error becomes "invalid _name value")
def _stages(text):
    try:
        return text if text == "max" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of stages or 'max' (the model's unit count), got {text!r}") \
            from None


def _json(text):
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected JSON (e.g. '{{\"depth\": 14}}'), got {text!r}: {e}") from None


def _milestones(text):
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated epochs (e.g. 30,60), got {text!r}") from None


_NONE = "none"  # `--divergence-loss none`: set the field to None (an unset flag is None too)


def _optional_float(text):
    try:
        return _NONE if text.lower() == _NONE else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or '{_NONE}', got {text!r}") from None


_TYPES = {"stages": _stages, "model_kwargs": _json, "data_kwargs": _json, "lr_milestones": _milestones,
          "divergence_loss": _optional_float}


def _help(name, default):
    extra = f"; one of {', '.join(CHOICES[name])}" if name in CHOICES else ""
    return f"RunConfig.{name} (default {default!r}{extra})"


def _decay(text: str):
    """``--decay``: T2's D, a number, or ``invariant`` (PipeMare App. B.4's gamma = 1 - 2/(k+1))."""
    if text == "invariant":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number in (0, 1) or 'invariant', got {text!r}") from None


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train one configuration and print its per-epoch records",
                              description="Train one configuration (model, data, method, stages, optimizer, "
                                          "...) and print its per-epoch records.\n\n" + EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="JSON or TOML file of RunConfig fields; flags override it")
    defaults = RunConfig()
    for f in dataclasses.fields(RunConfig):
        default = getattr(defaults, f.name)
        kind = _TYPES.get(f.name) or (type(default) if isinstance(default, (int, float, str))
                                      and not isinstance(default, bool) else None)
        if f.name in ("anneal_steps", "warmup_steps", "pipelined_steps", "max_steps", "lr_warmup_steps"):
            kind = int
        elif f.name == "decay":
            kind = _decay
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                       help=_help(f.name, default))
    p.add_argument("--out", default=None,
                   help="write the records to this CSV file (after every epoch), checkpoint to OUT.ckpt "
                        "and resume from it")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                   help="with --out: also checkpoint every STEPS optimizer steps (default: epoch ends only)")
    p.add_argument("--keep-checkpoint", action="store_true",
                   help="with --out: keep OUT.ckpt when the run is done (default: delete it)")
    p.add_argument("--rerun", action="store_true",
                   help="with --out: train from step 0 even if OUT is a finished run (OUT.done) or has a "
                        "checkpoint, overwriting OUT")
    p.add_argument("--download", action="store_true", help="download a missing dataset (CIFAR) first")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar over steps with the loss and the ETA (default: on in a terminal)")
    p.set_defaults(func=run)


def config_from_args(args):
    """The :class:`RunConfig` of ``--config`` (if any) updated by every flag that was given."""
    given = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {path} " + ("is a folder: give a JSON or TOML file of RunConfig fields"
                                                     if path.is_dir() else "does not exist"))
        try:
            text = path.read_text()
            given = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (OSError, UnicodeDecodeError, ValueError) as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
            kind = "TOML" if path.suffix == ".toml" else "JSON"
            raise ConfigError(f"--config {path} is not a readable {kind} file ({type(e).__name__}: {e}); "
                              "fix the file (a table of RunConfig fields)") from None
        if not isinstance(given, dict):
            raise ConfigError(f"--config {path} must hold a table of RunConfig fields, got {type(given).__name__}")
    flags = {k: None if v is _NONE else v for k in field_names() if (v := getattr(args, k, None)) is not None}
    kept = _without_ignored_corrections(given, flags) if "method" in flags else given
    config = RunConfig.from_dict({**kept, **flags}).resolve()
    # the keys the user wrote: the flags, and a --config file's unless it lists every field (a run's config.json)
    written = {*flags, *(kept if set(field_names()) - set(given) - set(_LATER_FIELDS) else ())}
    refuse_ineffective(config, written)
    _refuse_ignored_corrections(config, written)
    return config


def _without_ignored_corrections(given: dict, flags: dict) -> dict:
    """``--config``'s table without the correction settings that ``--method`` does not take (a pipemare run's
    ``decay`` under ``--method gpipe``): they would change only the run's id, so they are ignored, with a warning
    naming them. (A flag of such a setting is refused: :func:`_refuse_ignored_corrections`.)"""
    import warnings
    takes = methods.hyperparameters(validate_field("method", flags["method"]))  # (an unknown name: refused first)
    dropped = [k for k in CORRECTION_FIELDS if given.get(k) is not None and k not in flags and k not in takes]
    if dropped:
        warnings.warn(f"--config's {', '.join(f'{k} = {given[k]!r}' for k in dropped)} ignored: method "
                      f"{flags['method']!r} does not take {'it' if len(dropped) == 1 else 'them'}", stacklevel=3)
    return {k: v for k, v in given.items() if k not in dropped}


def _refuse_ignored_corrections(config: RunConfig, written) -> None:
    """A correction setting (``decay``, ``anneal_steps``, ...) the run's method does not take changed nothing but the
    run's id (``--decay 0.5 --method gpipe`` trained GPipe): refused, naming the methods that take it. (A
    ``--config`` file's under another ``--method`` are dropped before: :func:`_without_ignored_corrections`.)"""
    for key in CORRECTION_FIELDS:
        if key in written and getattr(config, key) is not None and key not in methods.hyperparameters(config.method):
            takers = [m for m in methods.names() if key in methods.hyperparameters(m)]
            raise ConfigError(f"{key} is a setting of {', '.join(takers)}; method {config.method!r} does not take "
                              "it, so it would change nothing: leave it out, or pick one of those methods")


def checkpoint_of(out: Path, every=None, keep: bool = False):
    """The :class:`~staleopt.checkpoint.Checkpoint` of ``staleopt train --out OUT``: ``OUT.ckpt``, completed by
    the marker ``OUT.done``."""
    return Checkpoint(out.with_name(out.name + ".ckpt"), every=every, keep=keep, records=out,
                      done=out.with_name(out.name + ".done"))


def _claim(out: Path) -> lease.Lease:
    """The claim ``OUT.claim.<n>`` of ``staleopt train --out OUT`` (:mod:`staleopt.lease`);
    :class:`~staleopt.errors.ConfigError` naming the launch that holds it."""
    prefix = out.name + ".claim."
    claim = lease.acquire(out.parent, lease.new_launch_id(), prefix=prefix)
    if claim is None:
        held = lease.holder(out.parent, prefix=prefix)
        who = f"{held[0]}, heartbeat {held[1]:.0f} s ago" if held else "another launch"
        raise ConfigError(f"{out} is being written by {who} (its claim {prefix}<n> is beside it): two launches "
                          "would overwrite each other's run. Wait for it to end, or choose another --out (a "
                          f"launch that died on another host lets go {lease.DEFAULT_TIMEOUT:g} s after its last "
                          "heartbeat)")
    return claim


def _finished(config: RunConfig, checkpoint: Checkpoint):
    """The records of the finished run at ``--out`` (verified against its marker), or ``None`` when unfinished."""
    out = checkpoint.records
    if not checkpoint.done.is_file():
        if out.exists() and not checkpoint.path.is_file():
            raise ConfigError(f"{out} exists but is neither a finished run (no {checkpoint.done.name}) nor a "
                              f"resumable one (no {checkpoint.path.name}): pass --rerun to overwrite it, or "
                              "choose another --out")
        return None
    fix = f"pass --rerun to train the run again (it replaces {out.name} and {checkpoint.done.name})"
    done = read_done(checkpoint.done, fix)  # (not "delete the run's folder": OUT's folder is the user's)
    records = read_records(out, done, fix=fix)
    if done.get("run_id") != config.run_id():
        raise ConfigError(f"{out} holds the finished run {done.get('run_id')}, not run {config.run_id()}: the "
                          "configuration changed. Pass --rerun to overwrite it, or choose another --out")
    return records


def _header(config: RunConfig, how: str) -> str:
    return (f"{config.method} P={config.stages} N={config.microbatches} on {config.model}/{config.data}, "
            f"seed {config.seed} (run id {config.run_id()}{how}):")


#: The columns ``staleopt train`` prints per epoch, with their widths.
_SHOWN = (("epoch", 5), ("step", 7), ("train_loss", 11), ("test_loss", 10), ("test_acc", 9), ("lr_base", 9),
          ("wall_time", 9), ("status", 8))


#: The columns a language model's records add (after ``test_loss``), shown when the first record has them:
#: ``test_ppl`` where it is not NaN (a language model's, ``inf`` included), ``best_loss`` where the data knows it.
_SHOWN_LM = (("test_ppl", 9, lambda v: not math.isnan(v)), ("best_loss", 9, math.isfinite))


def _printer():
    """A function that prints one record per call as a row of a table (the header first), flushed at once."""
    shown = []

    def show(record):
        if not shown:
            extra = [(n, w) for n, w, has in _SHOWN_LM if isinstance(record.get(n), float) and has(record[n])]
            at = [n for n, _ in _SHOWN].index("test_loss") + 1
            shown.extend([*_SHOWN[:at], *extra, *_SHOWN[at:]])
            print(" ".join(name.rjust(w) for name, w in shown), flush=True)
        cells = []
        for name, w in shown:
            v = record.get(name)
            cells.append((f"{v:.4g}" if isinstance(v, float) else str(v)).rjust(w))
        print(" ".join(cells), flush=True)
    return show


def run(args) -> int:
    config = config_from_args(args)
    if args.out and Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a folder, but it names the records file (a CSV; OUT.ckpt and "
                          f"OUT.done go beside it): pass a file in it, e.g. --out {Path(args.out) / 'records.csv'}")
    if not args.out and (args.checkpoint_every is not None or args.keep_checkpoint or args.rerun):
        raise ConfigError("--checkpoint-every, --keep-checkpoint and --rerun need --out (the checkpoint is "
                          "OUT.ckpt)")
    check_int("--checkpoint-every", args.checkpoint_every, 1, optional=True, why="optimizer steps between checkpoints")
    checkpoint = checkpoint_of(Path(args.out), args.checkpoint_every, args.keep_checkpoint) if args.out else None
    if checkpoint is None:
        return _run(args, config, None)
    check_writable(checkpoint.path.parent)  # before training: a read-only folder fails now, not at epoch 1
    with _claim(Path(args.out)) as claim:  # held (and checked before every write) until the run is done
        checkpoint.guard = claim.check
        return _run(args, config, checkpoint)


def _run(args, config: RunConfig, checkpoint) -> int:
    """Train (or, finished, print) the run of ``staleopt train``; ``checkpoint``: ``--out``'s, or ``None``."""
    if checkpoint is not None:
        if args.rerun:  # the finished run's marker goes when the rerun first writes (a rerun that fails at once
            checkpoint.path.unlink(missing_ok=True)  # leaves the finished run as it was)
            check = checkpoint.guard
            checkpoint.guard = lambda: (check(), checkpoint.done.unlink(missing_ok=True))
        else:
            finished = _finished(config, checkpoint)
            if finished is not None:
                print(_header(config, f", finished earlier: {checkpoint.done}; --rerun trains it again"))
                show = _printer()  # (the table the run printed as it trained)
                for record in finished.to_dict("records"):
                    show(record)
                return 0
    if args.download:
        data.load(config.data, download=True, **config.data_kwargs)
    print(_header(config, ""), flush=True)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    t0 = time.perf_counter()
    records = train.run(config, progress=progress, checkpoint=checkpoint, on_epoch=_printer())
    resumed = records.attrs.get("resumed_at_step", 0)
    if checkpoint is not None:  # the records, then OUT.done, then the checkpoint goes
        checkpoint.complete(records, {"run_id": config.run_id(), "status": str(records["status"].iloc[-1]),
                                      "seconds": time.perf_counter() - t0, "resumed_at_step": int(resumed),
                                      "threads": int(records.attrs["threads"]),
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    if resumed:
        print(f"(resumed from its checkpoint at step {resumed}: the epochs before it were printed by the "
              "launch that ran them; all are in the records file)")
    if args.out:
        print(f"wrote {args.out}")  # after every epoch, by the checkpoint
    return 0
