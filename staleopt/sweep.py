"""Resumable sweeps (DomainBed-style): a grid of :class:`RunConfig` s, one directory per run.

A sweep file (TOML) holds a ``[base]`` config and a ``[grid]`` of lists; the
runs are the Cartesian product of the grid over the base, in file order::

    name = "demo"
    [base]
    model = "resnet1d"
    epochs = 5
    [grid]
    method = ["gpipe", "pipemare"]
    stages = [1, 4, "max"]
    seed = [0, 1]

Layout of a sweep directory (each run is named by :meth:`RunConfig.run_id`,
the hash of its resolved config)::

    SWEEP_DIR/runs/<run_id>/config.json    written first
                            claim.<n>      while a process trains the run: its owner and heartbeat
                                           (:mod:`staleopt.lease`)
                            train_fn       the train function ("module:function") that may write the
                                           checkpoint: a launch with another one does not resume it
                            checkpoint.pt  the run's last checkpoint (:mod:`staleopt.checkpoint`)
                            records.csv    per-epoch records, rewritten after every epoch
                            done           written last, by atomic rename: the run is finished (JSON:
                                           status, seconds, rows and SHA-256 of records.csv, the train
                                           function, torch's thread count)
                            error.txt      the traceback, when the train function raised or its worker
                                           process died

The checkpoint is deleted only after ``done`` is written
(:meth:`~staleopt.checkpoint.Checkpoint.complete`), so a kill at any instant
leaves a run finished or resumable. A finished run is verified when read
(:func:`run_state`, :func:`collect`): a ``done`` marker that does not parse, or
a ``records.csv`` that does not match the rows and checksum ``done`` recorded,
makes the run ``"damaged"``; a launch leaves it alone and reports it, and
``collect`` reports it and goes on with the other runs.

Launching a sweep again skips finished runs and resumes the others from their
checkpoints, so killing it (even with ``kill -9``) loses at most the steps
since each in-flight run's last checkpoint. Launches may overlap (a relaunch
while the first still runs, overlapping shards, a retried Ray task): a run is
trained only by the process that holds its claim; the others leave it alone,
and a claim whose owner died (or an unreadable claim file) is taken over by
the next launch. A worker process that dies (``kill -9``, the out-of-memory
killer) fails only its own run: ``error.txt`` says so, its checkpoint is kept
for the next launch, and the launch goes on with the other runs.
``shard=(k, n)`` runs the ``k``-th of ``n`` disjoint, deterministic slices
(1-based), so a cluster scheduler can spread one sweep over machines.
Models and datasets registered by name in the launching process
(:func:`staleopt.register_model`) are registered in every worker process and
Ray task before its run starts (:mod:`staleopt.registry`).

The runner knows nothing about training: it calls
``train_fn(config, progress=...) -> pandas.DataFrame`` (default
``staleopt.train.run``) whose rows are epochs with at least the columns
:data:`RECORD_COLUMNS`. A train function that takes a ``checkpoint`` keyword
gets a :class:`~staleopt.checkpoint.Checkpoint` for ``checkpoint.pt`` and
``records.csv`` in the run's directory (``checkpoint_every`` and
``keep_checkpoints`` are refused for one that does not).
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import itertools
import json
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import pandas as pd

from . import lease, metrics, registry
from .checkpoint import (EXACT_FLOATS, Checkpoint, atomic_write_text, check_every, check_writable, read_done,
                         read_records)
from . import methods
from .config import (_LATER_FIELDS, CORRECTION_FIELDS, RunConfig, field_names, refuse_default_spellings,
                     refuse_ineffective, validate_field)
from .errors import CheckpointError, ClaimLostError, ConfigError, OutputError, RunFileError, SweepConfigError
from .validate import check_int
from .stats import check_level, divergence_count, interval, per_run, status_text, t_interval

__all__ = ["Sweep", "load_sweep", "expand", "few", "load_data", "shard", "parse_shard", "run_sweep", "SweepReport",
           "run_state", "damage", "read_done", "runs", "collect", "summarize", "interval_sizes", "varies",
           "varying_keys", "pooled_keys", "config_key", "t_interval", "RECORD_COLUMNS",
           "DEFAULT_TRAIN_FN", "MAX_THREADS"]

#: Columns every records DataFrame must have (one row per epoch).
RECORD_COLUMNS = ("epoch", "step", "train_loss", "test_acc", "status")
DEFAULT_TRAIN_FN = "staleopt.train:run"
_TOP_KEYS = ("name", "description", "base", "grid")
_EXACT_FLOATS = EXACT_FLOATS
#: Most torch threads per run: more than any machine's cores (and torch cannot start many more).
MAX_THREADS = 1024


@dataclass
class Sweep:
    """A parsed sweep: its base config, grid and the expanded, resolved, de-duplicated runs."""

    name: str
    base: Dict[str, Any]
    grid: Dict[str, List[Any]]
    configs: List[RunConfig]
    description: str = ""


def _where(source, section, key=None, index=None):
    s = f"{source}: [{section}]"
    if key is not None:
        s += f" {key}"
    if index is not None:
        s += f"[{index}]"
    return s


def load_sweep(path: Union[str, os.PathLike]) -> Sweep:
    """Parse and validate a TOML sweep file (or a ``.json`` file with the same structure)."""
    path = Path(path)
    if not path.is_file():
        raise SweepConfigError(f"sweep file {path} " + ("is a folder: give the TOML (or JSON) sweep file; a sweep's "
                                                        "output folder is read by staleopt results"
                                                        if path.is_dir() else "does not exist"))
    try:
        if path.suffix == ".json":
            spec = json.loads(path.read_text())
        else:
            import tomllib
            spec = tomllib.loads(path.read_text())
    except ValueError as e:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        raise SweepConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from e
    return from_spec(spec, source=str(path))


def from_spec(spec: Dict[str, Any], source: str = "sweep", inherited: Sequence[str] = ()) -> Sweep:
    """Validate a sweep mapping ``{name, description, base, grid}`` and expand it. ``inherited``: keys of ``base``
    the runs take from elsewhere (a ledger recipe) rather than the user writing them for these runs: one a run
    ignores is not refused (:func:`expand`)."""
    if not isinstance(spec, dict):
        raise SweepConfigError(f"{source}: a sweep must be a table with keys {', '.join(_TOP_KEYS)}")
    for key in spec:
        if key not in _TOP_KEYS:
            raise SweepConfigError(f"{source}: unknown top-level key {key!r}; allowed keys: {', '.join(_TOP_KEYS)}"
                                   " (config keys go under [base] or [grid])")
    base, grid = spec.get("base", {}), spec.get("grid", {})
    for section, table in (("base", base), ("grid", grid)):
        if not isinstance(table, dict):
            raise SweepConfigError(f"{source}: [{section}] must be a table of config keys")
        for key in table:
            if key not in field_names():
                raise SweepConfigError(f"{_where(source, section, key)}: unknown config key {key!r}; "
                                       f"allowed keys: {', '.join(field_names())}")
    for key, value in base.items():
        try:
            validate_field(key, value)
        except ConfigError as e:
            raise SweepConfigError(f"{_where(source, 'base', key)}: {e}") from None
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepConfigError(f"{_where(source, 'grid', key)}: grid values must be a non-empty list, "
                                   f"got {values!r} (put single values under [base])")
        seen = []
        for i, value in enumerate(values):
            try:
                checked = validate_field(key, value)
            except ConfigError as e:
                raise SweepConfigError(f"{_where(source, 'grid', key, i)}: {e}") from None
            if checked in seen:  # (the same run twice would be one run: the sweep would hold fewer than asked)
                raise SweepConfigError(f"{_where(source, 'grid', key, i)}: {value!r} is already in the grid's {key} "
                                       "list; give each value once")
            seen.append(checked)
    name = spec.get("name", "")
    if not isinstance(name, str) or (name and (name in (".", "..") or any(c in name for c in "/\\\0:"))):
        raise SweepConfigError(f"{source}: name = {name!r} must be a plain folder name (no '/', '\\', ':', "
                               "'.' or '..'): it names the default output folder runs/<name>")
    overlap = sorted(set(base) & set(grid))
    if overlap:
        raise SweepConfigError(f"{source}: {overlap} appear in both [base] and [grid]; keep each key in one")
    try:
        configs = expand(base, grid, inherited)
    except ConfigError as e:
        raise SweepConfigError(f"{source}: {e}") from None
    return Sweep(name, dict(base), dict(grid), configs, str(spec.get("description", "")))


def few(run_ids: Sequence[str], n: int = 3) -> str:
    """The first ``n`` of ``run_ids``, comma-separated, with ``...`` when there are more (for messages)."""
    return ", ".join(run_ids[:n]) + (", ..." if len(run_ids) > n else "")


def expand(base: Dict[str, Any], grid: Dict[str, Sequence[Any]], inherited: Sequence[str] = ()) -> List[RunConfig]:
    """The resolved configs of ``base`` x product(grid) in grid order, duplicates (same run_id) dropped. A key given
    that a run ignores though at its default (``momentum`` with plain ``sgd``) is refused, unless ``inherited``
    (:func:`staleopt.config.refuse_ineffective`).

    A grid that varies a correction's hyperparameter (``decay``) over methods that ignore it (``gpipe``) trains each
    of those once per value, identical runs under different run ids: warned."""
    keys = list(grid)
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        values = dict(zip(keys, combo))
        try:
            out.append(RunConfig.from_dict({**base, **values}).resolve())
            refuse_ineffective(out[-1], [k for k in [*base, *values] if k not in inherited])
        except ConfigError as e:
            raise ConfigError(f"run {values}: {e}") from None
    for k in (k for k in CORRECTION_FIELDS if len(grid.get(k, ())) > 1):
        ignoring = sorted({c.method for c in out if k not in methods.hyperparameters(c.method)})
        if ignoring:
            warnings.warn(f"the grid varies {k} over {list(grid[k])}, which {', '.join(ignoring)} ignore(s): each of "
                          f"their runs trains once per value of {k}, identical runs under other run ids (a line "
                          f"each in the tables); sweep them in a file whose grid does not vary {k}, or pass "
                          "run_sweep a list of RunConfig", stacklevel=2)
    return _distinct(out)


def _recorded(root: Path, skip: set) -> List[Tuple[str, dict]]:
    """``(run id, config)`` of every run folder in ``root`` but ``skip`` whose ``config.json`` reads
    (:func:`read_config`)."""
    out = []
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if path.name not in skip and (path / "config.json").is_file():
            try:
                d = read_config(path)
            except RunFileError:
                continue  # (a damaged run: run_state reports it)
            if {"model", "data"} <= set(d):
                out.append((path.name, d))
    return out


def _distinct(configs: Sequence[RunConfig]) -> List[RunConfig]:
    """``configs`` in order, each run (``run_id``) once; one run written two ways is refused
    (:func:`~staleopt.config.refuse_default_spellings`)."""
    out, seen = [], set()
    for cfg in configs:
        if cfg.run_id() not in seen:
            seen.add(cfg.run_id())
            out.append(cfg)
    refuse_default_spellings(out)
    return out


def _resolved(configs) -> List[RunConfig]:
    """A list of :class:`RunConfig` given to :func:`run_sweep` as a sweep file's are: resolved (``stages="max"``
    is the model's unit count, so it names the same run as the number) and each run once."""
    configs = list(configs)
    wrong = [c for c in configs if not isinstance(c, RunConfig)]
    if wrong:
        raise ConfigError(f"run_sweep takes a Sweep, a sweep file's path or a list of RunConfig, but the list holds "
                          f"a {type(wrong[0]).__name__} ({wrong[0]!r:.80}): build each run with "
                          "RunConfig(**fields) or RunConfig.from_dict(d)")
    return _distinct([c.resolve() if c.stages == "max" else c for c in configs])  # (a file's are resolved)


def load_data(configs: Sequence[RunConfig], download: bool = False) -> None:
    """Load each distinct dataset of ``configs`` once, before any run starts: a missing one is a
    :class:`~staleopt.errors.DataError` here rather than one failed run each. ``download`` fetches a missing
    dataset first (CIFAR, the text corpora)."""
    from . import data
    for key in dict.fromkeys(json.dumps([c.data, c.data_kwargs], sort_keys=True) for c in configs):
        name, kwargs = json.loads(key)
        data.load(name, download=download, **kwargs)


def parse_shard(text: str) -> Tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``1 <= K <= N``."""
    try:
        k, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard must look like K/N (e.g. 2/4), got {text!r}") from None
    if not 1 <= k <= n:
        raise ConfigError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def shard(configs: Sequence[RunConfig], k: int, n: int) -> List[RunConfig]:
    """The ``k``-th of ``n`` slices (1-based): runs sorted by run_id, every ``n``-th from index ``k-1``.

    Depends only on the set of runs, so every machine computes the same
    slices; the ``n`` slices are disjoint and their union is all runs.
    """
    parse_shard(f"{k}/{n}")
    ordered = sorted(configs, key=RunConfig.run_id)
    mine = {c.run_id() for c in ordered[k - 1::n]}
    return [c for c in configs if c.run_id() in mine]


# ---------------------------------------------------------------------------------------------
# running

def damage(run_dir: Union[str, os.PathLike]) -> Optional[str]:
    """Why a finished run's files cannot be trusted (its ``done`` marker or ``records.csv`` is damaged, its
    ``config.json`` unreadable), or ``None`` when they check out or the run is not finished."""
    run_dir = Path(run_dir)
    if not (run_dir / "done").is_file():
        return None
    try:
        read_records(run_dir / "records.csv", read_done(run_dir / "done"))
        read_config(run_dir)
    except RunFileError as e:
        return str(e)
    return None


def read_config(run_dir: Union[str, os.PathLike]) -> Dict[str, Any]:
    """A run's ``config.json`` as a dict; :class:`~staleopt.errors.RunFileError` naming it when damaged.

    A field added after the run was recorded (``config._LATER_FIELDS``) reads as its default, as the run's id
    (:meth:`~staleopt.config.RunConfig.run_id`) already does: runs recorded before and after it in one sweep are
    one configuration in every table, figure and claim."""
    path = Path(run_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunFileError(f"{path} is not a readable run config ({type(e).__name__}: {e}); "
                           "delete the run's folder to run it again") from None
    if not isinstance(config, dict):
        raise RunFileError(f"{path} is not a run config (a JSON object); delete the run's folder to run it again")
    missing = [k for k in field_names() if k not in config and k not in _LATER_FIELDS]
    if missing:
        raise RunFileError(f"{path} is not a run config: it lacks {', '.join(map(repr, missing))}; delete the run's "
                           "folder to run it again")
    for key, default in _LATER_FIELDS.items():
        config.setdefault(key, default)
    return config


def run_state(run_dir: Union[str, os.PathLike], timeout: float = lease.DEFAULT_TIMEOUT) -> str:
    """``"done"``, ``"damaged"`` (finished, but :func:`damage` finds its files damaged), ``"running"`` (a live
    claim), ``"failed"`` (train function raised, or its worker died), ``"incomplete"`` (started, nobody on it)
    or ``"pending"``; ``timeout`` as in :func:`staleopt.lease.holder`."""
    run_dir = Path(run_dir)
    if (run_dir / "done").is_file():
        return "damaged" if damage(run_dir) is not None else "done"
    if lease.holder(run_dir, timeout) is not None:
        return "running"
    if (run_dir / "error.txt").is_file():
        return "failed"
    return "incomplete" if run_dir.is_dir() else "pending"


def train_fn_name(fn: Callable) -> str:
    """``"module:qualname"`` of a train function: what a finished run's ``done`` records as ``train_fn``, and a
    launch compares with the runs it finds done (:func:`run_sweep`). A wrapper that gives another function's results
    (logging, a stall in a test) says so with ``functools.wraps(that_function)``: its runs are that function's."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _resolve_fn(train_fn) -> Callable:
    if callable(train_fn):
        return train_fn
    module, _, name = str(train_fn).partition(":")
    if not module or not name:
        raise ConfigError(f"a train function is given as 'module:function', got {train_fn!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import train function {train_fn!r}: {e}") from e


def _trained_by(run_dir: Path) -> Optional[str]:
    """The train function that may have written ``run_dir``'s checkpoint (its ``train_fn`` file); ``None`` when
    the run has no checkpoint, or the file is missing (written before it was recorded) or unreadable."""
    if not (run_dir / "checkpoint.pt").is_file():
        return None
    try:
        return (run_dir / "train_fn").read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _takes_checkpoint(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == "checkpoint" or p.kind is p.VAR_KEYWORD for p in params)


#: Options of one run's execution (:func:`run_sweep`'s arguments of the same names).
_OPTIONS = {"launch": "", "claim_timeout": lease.DEFAULT_TIMEOUT, "checkpoint_every": None,
            "keep_checkpoint": False, "retry_failed": True, "registrations": None}


def _write_error(run_dir: Path, text: str) -> None:
    """Write ``error.txt``; a full or read-only disk leaves the run without one (the launch reports the run
    failed all the same) instead of ending the launch."""
    try:
        atomic_write_text(run_dir / "error.txt", text)
    except OutputError:
        pass


def _execute(train_fn, config: Dict[str, Any], run_dir: str, progress: bool,
             options: Optional[Dict[str, Any]] = None) -> Tuple[str, str, float]:
    """Claim ``run_dir`` and run one config into it; returns ``(run_id, status, seconds)``.

    status: the last record's, ``"failed"`` when the train function raised, or
    ``"claimed"`` when another launch holds the run (or finished it, or failed
    it while ``retry_failed`` is false): this launch left it alone.
    """
    options = {**_OPTIONS, **(options or {})}
    if options["registrations"]:  # models and data registered by name in the launching process
        registry.restore(options["registrations"])
    run_dir = Path(run_dir)
    cfg = RunConfig.from_dict(config)
    claim = lease.acquire(run_dir, options["launch"], options["claim_timeout"])
    if claim is None:
        return cfg.run_id(), "claimed", 0.0
    with claim:
        if (run_dir / "done").is_file() or ((run_dir / "error.txt").is_file() and not options["retry_failed"]):
            return cfg.run_id(), "claimed", 0.0  # another launch finished (or failed) it meanwhile
        t0 = time.perf_counter()
        checkpoint = Checkpoint(run_dir / "checkpoint.pt", every=options["checkpoint_every"],
                                keep=options["keep_checkpoint"], records=run_dir / "records.csv",
                                guard=claim.check, done=run_dir / "done")
        try:
            (run_dir / "error.txt").unlink(missing_ok=True)
            atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
            fn = _resolve_fn(train_fn)
            takes = _takes_checkpoint(fn)
            by = _trained_by(run_dir)
            if takes and by not in (None, train_fn_name(fn)):
                raise CheckpointError(f"{run_dir / 'checkpoint.pt'} was written by the train function {by!r}, not "
                                      f"{train_fn_name(fn)!r}: resuming it would mix their results. Launch with "
                                      f"{by!r}, or delete the checkpoint to train the run from step 0")
            if takes:  # (before it can write a checkpoint)
                atomic_write_text(run_dir / "train_fn", train_fn_name(fn) + "\n")
            records = fn(cfg, progress=progress, **({"checkpoint": checkpoint} if takes else {}))
            missing = [c for c in RECORD_COLUMNS if c not in getattr(records, "columns", ())]
            if missing or len(records) == 0:
                raise TypeError(f"the train function must return a non-empty DataFrame with columns "
                                f"{list(RECORD_COLUMNS)}; missing {missing}")
            status = str(records["status"].iloc[-1])
            done = {"status": status, "seconds": time.perf_counter() - t0,
                    "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "by": str(claim.owner),
                    "train_fn": train_fn_name(fn)}
            if "resumed_at_step" in records.attrs:
                done["resumed_at_step"] = int(records.attrs["resumed_at_step"])
            if "threads" in records.attrs:
                done["threads"] = int(records.attrs["threads"])
            checkpoint.complete(records, done)  # records, then done, then the checkpoint goes
        except ClaimLostError:
            return cfg.run_id(), "claimed", time.perf_counter() - t0
        except Exception:
            if not claim.held():
                return cfg.run_id(), "claimed", time.perf_counter() - t0
            _write_error(run_dir, traceback.format_exc())
            return cfg.run_id(), "failed", time.perf_counter() - t0
    return cfg.run_id(), status, done["seconds"]


def _worker_died(job, why, message: Optional[str] = None) -> Tuple[str, str, float]:
    """The result of a job whose worker process died (killed, out of memory): the run is failed, with an
    ``error.txt`` saying so, and keeps its checkpoint for the next launch. The dead worker's claim is taken over
    for the write (at once on this host; on another, once its heartbeat is older than the claim timeout)."""
    run_dir, options = Path(job[2]), {**_OPTIONS, **job[4]}
    run_id = RunConfig.from_dict(job[1]).run_id()
    claim = lease.acquire(run_dir, options["launch"], options["claim_timeout"])
    if claim is None:  # a live process holds it (another launch took it over)
        return run_id, "claimed", 0.0
    try:
        if (run_dir / "done").is_file():  # it died after finishing the run
            return run_id, read_done(run_dir / "done")["status"], 0.0
        _write_error(run_dir, message or f"The worker process training this run died: {why}.\nA process killed "
                              "from outside (kill -9, the out-of-memory killer: see `dmesg`) stops without a "
                              "traceback. The run's last checkpoint is kept: launch the sweep again to resume it.\n")
    except RunFileError:
        pass
    finally:
        claim.release()
    return run_id, "failed", 0.0


def _exit_reason(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


#: Seconds between a pool worker's checks that the launch that started it is still alive.
PARENT_POLL_SECONDS = 1.0
#: Seconds between the launch's looks at its runs in flight (the progress bar's per-worker line).
POLL_SECONDS = 2.0


def _in_flight(jobs) -> str:
    """``"abc123 pipemare P=39 3/20 ep, ..."``: each run in flight and the epochs its records.csv holds so far."""
    parts = []
    for _, config, run_dir, _, _ in jobs:
        records = Path(run_dir) / "records.csv"
        try:
            epochs = max(0, len(records.read_text().splitlines()) - 1) if records.is_file() else 0
        except OSError:
            epochs = 0
        parts.append(f"{Path(run_dir).name[:6]} {config['method']} P={config['stages']} "
                     f"{epochs}/{config['epochs']} ep")
    return "; ".join(parts)


def _set_threads(threads: Optional[int]) -> None:
    if threads:
        import torch
        torch.set_num_threads(threads)


def _exit_with_parent(parent: int) -> None:
    """End this worker once ``parent`` is gone (it was re-parented): a launch killed by any signal, SIGKILL
    included, leaves no worker training on. The run's claim then goes stale and a relaunch resumes it from
    its checkpoint (docs/long-runs.md)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)


def _worker(conn, threads: Optional[int], parent: int) -> None:
    """A pool worker: run the jobs it receives on ``conn`` until ``None`` (or the launch dies), sending back
    each result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the launch stops the workers
    signal.signal(signal.SIGTERM, _sigterm_as_exit)  # stopped by the launch: exit through Python's clean-up, so
    # the semaphores this process made (tqdm's lock) are released, not reported leaked at shutdown
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="staleopt-parent-watch").start()
    _set_threads(threads)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        except Exception:  # the job does not unpickle here: a function of a __main__ without a file (a notebook)
            conn.send((_UNREADABLE, traceback.format_exc()))
            continue
        if job is None:
            return
        conn.send(_execute(*job))


#: The first field of a worker's answer to a job it could not read (:func:`_worker`).
_UNREADABLE = "staleopt: unreadable job"


def _sigterm_as_exit(signum, frame):
    raise SystemExit(128 + signum)


def _run_pool(jobs: List[tuple], workers: int, context: str, threads: Optional[int], record,
              poll: Optional[Callable[[List[tuple]], None]] = None) -> None:
    """Run ``jobs`` on ``workers`` processes of their own, one job at a time each, calling ``record(result)``
    and, every :data:`POLL_SECONDS` and after each result, ``poll(the jobs in flight)``.

    A worker that dies fails only its job (:func:`_worker_died`) and is replaced while jobs remain; the other
    workers go on. (``concurrent.futures.ProcessPoolExecutor`` cannot do that: one dead worker breaks the pool
    and kills the others.) An exception here (Ctrl-C, or SIGTERM made ``SystemExit``) terminates every worker.
    """
    ctx = multiprocessing.get_context(context)
    todo, busy, idle = list(reversed(jobs)), {}, []  # busy: process -> (connection, job)

    def start():
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(theirs, threads, os.getpid()), daemon=True)
        proc.start()
        theirs.close()
        idle.append((proc, mine))

    for _ in range(min(workers, len(jobs))):
        start()
    try:
        while todo or busy:
            while todo and idle:
                proc, conn = idle.pop()
                job = todo.pop()
                try:
                    conn.send(job)
                    busy[proc] = (conn, job)
                except OSError:  # it died before its first job
                    todo.append(job)
                    conn.close()
                    proc.join()
                    start()
            ready = multiprocessing.connection.wait([c for c, _ in busy.values()] + [p.sentinel for p in busy],
                                                    timeout=POLL_SECONDS if poll else None)
            if poll:
                poll([job for _, job in busy.values()])
            for proc, (conn, job) in list(busy.items()):
                if conn not in ready and proc.sentinel not in ready:
                    continue
                try:
                    result = conn.recv() if conn.poll() else None
                except (EOFError, OSError):
                    result = None
                if result is not None and result[0] == _UNREADABLE:
                    del busy[proc]
                    idle.append((proc, conn))
                    record(_worker_died(job, "unreadable job", message=(
                        "The worker process could not read this run's job (its train function, model or data "
                        "factory does not unpickle in a new process):\n" + result[1] + "\nA function defined in a "
                        "notebook or in `python -c` lives in a __main__ that a worker process cannot import: put it "
                        "in a module file (file.py:function, or import it from a .py file), or launch with "
                        "workers=1, which trains in this process. Launching again fails the same way until then.\n")))
                elif result is not None:
                    del busy[proc]
                    idle.append((proc, conn))
                    record(result)
                elif not proc.is_alive():
                    del busy[proc]
                    conn.close()
                    proc.join()
                    record(_worker_died(job, _exit_reason(proc.exitcode)))
                    if len(todo) > len(idle):
                        start()
        for proc, conn in idle:
            conn.send(None)
            conn.close()
        for proc, _ in idle:
            proc.join()
    except BaseException:
        for proc in [p for p, _ in idle] + list(busy):
            proc.terminate()
        for proc in [p for p, _ in idle] + list(busy):
            proc.join()
        raise


@dataclass
class SweepReport:
    """What one launch did: run ids skipped (already done), finished (with status), failed (the train
    function raised, or its worker process died: killed, or out of memory; ``error.txt`` says which, and a
    relaunch resumes them from their checkpoints), claimed (left to another launch that holds them) and
    damaged (finished, but their files are damaged: :func:`damage` says how; left alone)."""

    total: int
    skipped: List[str] = field(default_factory=list)
    finished: Dict[str, str] = field(default_factory=dict)
    failed: List[str] = field(default_factory=list)
    claimed: List[str] = field(default_factory=list)
    damaged: Dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.damaged


def run_sweep(sweep: Union[Sweep, str, os.PathLike, Sequence[RunConfig]], out: Union[str, os.PathLike], *,
              workers: int = 1, shard_spec: Optional[Tuple[int, int]] = None, train_fn=None,
              progress: bool = False, threads: Optional[int] = 1, bar: bool = True,
              context: str = "spawn", executor: str = "local", checkpoint_every: Optional[int] = None,
              keep_checkpoints: bool = False, claim_timeout: float = lease.DEFAULT_TIMEOUT) -> SweepReport:
    """Run every unfinished config of ``sweep`` into ``out/runs/<run_id>/``. A list of configs is resolved and
    de-duplicated as a sweep file's (``stages="max"`` is the model's unit count).

    ``workers > 1`` uses a process pool of that size (``context`` ``"spawn"``
    or ``"forkserver"``; each worker sets ``threads`` torch threads);
    ``workers == 1`` runs in this process (with ``threads`` torch threads for
    the duration). ``train_fn`` is a callable (picklable for ``workers > 1``)
    or a ``"module:function"`` string; default :data:`DEFAULT_TRAIN_FN`.
    A train function that raises marks its run failed (``error.txt``) and the
    sweep goes on. ``executor="ray"`` runs the unfinished runs as Ray tasks
    (:mod:`staleopt.ray_executor`: ``$RAY_ADDRESS`` or a local Ray with ``workers``
    CPUs); run directories and resume rules are the same.

    A worker process that dies fails only its run (:func:`_run_pool`).

    Each run saves a checkpoint at its epoch ends (and every ``checkpoint_every``
    steps), resumes from it, and deletes it once ``done`` is written unless ``keep_checkpoints``;
    both options are refused for a train function that takes no ``checkpoint`` keyword. A run whose
    checkpoint another train function wrote, like a run it finished, is refused (``ConfigError``).
    Runs claimed by another live launch are left to it (:attr:`SweepReport.claimed`);
    ``claim_timeout``: seconds without a heartbeat after which a claim is stale
    (:mod:`staleopt.lease`).
    """
    from tqdm.auto import tqdm

    if isinstance(sweep, (str, os.PathLike)):
        sweep = load_sweep(sweep)
    configs = _resolved(sweep.configs if isinstance(sweep, Sweep) else sweep)
    if shard_spec is not None:
        configs = shard(configs, *shard_spec)
    check_int("workers", workers, 1)
    check_int("threads", threads, 1, MAX_THREADS, optional=True, why="torch threads per run")
    if executor not in ("local", "ray"):
        raise ConfigError(f"executor must be 'local' or 'ray', got {executor!r}")
    check_every(checkpoint_every)
    lease.check_timeout(claim_timeout)
    train_fn = DEFAULT_TRAIN_FN if train_fn is None else train_fn
    resolved = _resolve_fn(train_fn)  # fail before starting anything, whatever the executor
    takes = _takes_checkpoint(resolved)
    if (checkpoint_every is not None or keep_checkpoints) and not takes:
        raise ConfigError(f"the train function {train_fn_name(resolved)!r} takes no checkpoint keyword, so "
                          "checkpoint_every and keep_checkpoints (--checkpoint-every, --keep-checkpoints) would do "
                          "nothing: no checkpoint is written, and a killed run starts over from step 0. Give it a "
                          "keyword checkpoint=None and pass it on (staleopt.train.run(config, progress=progress, "
                          "checkpoint=checkpoint)), or leave those options out")
    if workers == 1:
        train_fn = resolved
    root = Path(out).resolve() / "runs"  # absolute: Ray workers may run elsewhere
    check_writable(root)  # a read-only or full disk stops the launch before any training
    report = SweepReport(total=len(configs))
    launch = lease.new_launch_id()
    registrations = None
    if workers > 1 or executor == "ray":  # other processes: send them this process's registered names
        registrations = registry.snapshot({c.model for c in configs}, {c.data for c in configs})
        registry.check_picklable(registrations)
    jobs, pending = [], []
    name, other = train_fn_name(resolved), {}
    for cfg in configs:
        state = run_state(root / cfg.run_id(), claim_timeout)
        if state == "done":
            report.skipped.append(cfg.run_id())
            by = read_done(root / cfg.run_id() / "done").get("train_fn", name)  # (not recorded before 2026-11-28)
            if by != name:
                other.setdefault(by, []).append(cfg.run_id())
        elif state == "damaged":
            report.damaged[cfg.run_id()] = damage(root / cfg.run_id())
        elif state == "running":
            report.claimed.append(cfg.run_id())
        else:
            by = _trained_by(root / cfg.run_id()) if takes else None
            if by not in (None, name):  # its checkpoint is another function's: resuming it would mix them
                other.setdefault(by, []).append(cfg.run_id())
            pending.append(cfg)
            options = {"launch": launch, "claim_timeout": claim_timeout, "checkpoint_every": checkpoint_every,
                       "keep_checkpoint": keep_checkpoints, "retry_failed": state == "failed",
                       "registrations": registrations}
            jobs.append((train_fn, cfg.to_dict(), str(root / cfg.run_id()), progress, options))
    if pending:  # (a run of the folder written the other way would be trained again under another id)
        refuse_default_spellings(pending, _recorded(root, {c.run_id() for c in configs}))
    if other:  # a run's results are its train function's: another one's would be kept as this one's
        by, ids = next(iter(other.items()))
        raise ConfigError(f"{sum(map(len, other.values()))} run(s) in {root} were trained by the train function "
                          f"{by!r} (run {ids[0]}, ...; finished, or checkpointed to be resumed), not by this launch's "
                          f"{name!r}: their results would be kept as this function's. Pass --out to a new directory "
                          "(or delete those runs, or an unfinished run's checkpoint.pt to train it from step 0), or "
                          "launch with the train function that trained them")
    pbar = tqdm(total=len(jobs), desc="sweep", unit="run", disable=not bar or not jobs)

    def record(result):
        run_id, status, _ = result
        if status in ("failed", "claimed"):
            getattr(report, status).append(run_id)
        else:
            report.finished[run_id] = status
        pbar.update(1)
        pbar.set_postfix(failed=len(report.failed),
                         diverged=sum(s == "diverged" for s in report.finished.values()))

    try:
        if executor == "ray":
            from .ray_executor import run_jobs
            for result in run_jobs(_execute, jobs, workers=workers, threads=threads, on_crash=_worker_died):
                record(result)
        elif workers == 1:
            import torch
            old = torch.get_num_threads()
            _set_threads(threads)
            try:
                for job in jobs:
                    record(_execute(*job))
            finally:
                torch.set_num_threads(old)
        elif jobs:
            # SIGTERM becomes SystemExit (in the main thread, where signals are delivered), so the
            # workers are stopped by _run_pool instead of training on after the launch is gone.
            main = threading.current_thread() is threading.main_thread()
            old_handler = signal.signal(signal.SIGTERM, _sigterm_as_exit) if main else None
            try:
                _run_pool(jobs, workers, context, threads, record,
                          poll=(lambda running: pbar.set_postfix_str(_in_flight(running))) if bar else None)
            finally:
                if main:
                    signal.signal(signal.SIGTERM, old_handler)
    finally:
        pbar.close()
    return report


# ---------------------------------------------------------------------------------------------
# collecting

def _flat(config: Dict[str, Any]) -> Dict[str, Any]:
    """Config as table cells: dicts and lists become compact JSON strings."""
    return {k: json.dumps(v, sort_keys=True, separators=(",", ":")) if isinstance(v, (dict, list)) else v
            for k, v in config.items()}


def runs(sweep_dir: Union[str, os.PathLike]) -> pd.DataFrame:
    """One row per run directory: ``run``, ``state`` (see :func:`run_state`) and its config (empty cells for a
    run whose ``config.json`` is damaged, or missing beside a ``done`` marker or records, as :func:`collect`
    reports it: its state is ``"damaged"``; a folder with none of them is being made, and left out)."""
    rows = []
    root = Path(sweep_dir) / "runs"
    for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
        if not (run_dir.is_dir() and (run_dir / "config.json").is_file()):
            if run_dir.is_dir() and any((run_dir / f).is_file() for f in ("done", "records.csv")):
                rows.append({"run": run_dir.name, "state": "damaged"})
            continue
        state = run_state(run_dir)
        try:
            config = _flat(read_config(run_dir))
        except RunFileError:
            config, state = {}, "damaged"
        rows.append({"run": run_dir.name, "state": state, **config})
    return pd.DataFrame(rows, columns=["run", "state", *field_names()] if not rows else None)


def collect(sweep_dir: Union[str, os.PathLike], partial: bool = False,
            damaged: Optional[Dict[str, str]] = None) -> pd.DataFrame:
    """Every finished run's per-epoch records, one row per (run, epoch): ``run``, config, record columns.

    Floats read back exactly (``repr`` written, round-trip parsed). Unfinished
    runs are left out unless ``partial``: then runs in flight or interrupted
    add the epochs recorded so far. :func:`runs` lists every run's state.
    A run whose files are damaged (:func:`damage`; with ``partial``, also a
    run in flight whose records do not parse) raises
    :class:`~staleopt.errors.RunFileError`, or, given a dict ``damaged``, is
    left out and added to it as ``run id -> what is wrong``.
    """
    frames = []
    root = Path(sweep_dir) / "runs"
    for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
        finished = (run_dir / "done").is_file()
        if not finished and not (partial and (run_dir / "records.csv").is_file()):
            continue
        try:
            done = read_done(run_dir / "done") if finished else None
            records = read_records(run_dir / "records.csv", done, RECORD_COLUMNS if finished else ("status",))
            config = _flat(read_config(run_dir))
        except RunFileError as e:
            if damaged is None:
                raise
            damaged[run_dir.name] = str(e)
            continue
        clash = set(config) & set(records.columns) | ({"run"} & set(records.columns))
        if clash:
            raise ConfigError(f"records of run {run_dir.name} have columns {sorted(clash)} that clash with "
                              "config keys; rename them in the train function")
        meta = pd.DataFrame({"run": run_dir.name, **config}, index=records.index)
        frames.append(pd.concat([meta, records], axis=1))
    if not frames:
        return pd.DataFrame(columns=["run", *field_names(), *RECORD_COLUMNS])
    return pd.concat(frames, ignore_index=True)


def varies(column: pd.Series) -> bool:
    """Whether a config column takes more than one value (lists and unset count as values; ``None`` and NaN are
    both unset, 4 and 4.0 one number: :func:`config_key`)."""
    return len({config_key([v]) for v in column}) > 1


def config_key(values) -> tuple:
    """Config values as a dictionary key: ``None`` and NaN alike (a key a run leaves unset), numbers by value (a
    column with a missing value holds 4 as 4.0), dicts by content."""
    def cell(v):
        if isinstance(v, numbers.Real) and not isinstance(v, bool):  # (NumPy's numbers too)
            return "null" if v != v else repr(float(v))  # (NaN: a missing value)
        if v is None:
            return "null"
        return json.dumps(v, sort_keys=True, default=str)
    return tuple(cell(v) for v in values)


def varying_keys(records: pd.DataFrame) -> List[str]:
    """The config keys besides ``method``, ``stages`` and ``seed`` in which two runs of one method and ``P`` differ
    (``lr`` in a sweep over learning rates): each value is another configuration, which the figures draw as a
    line of its own and the report's tables summarize apart (:func:`staleopt.plot.sweep.line_keys`). A key that
    differs only between methods (T2's ``decay``, set for ``pipemare`` alone; GPipe's microbatches) splits
    nothing: the method tells those runs apart."""
    runs = records.drop_duplicates("run") if "run" in records.columns else records  # (a run's config is constant)
    keys = [k for k in field_names() if k in runs.columns and k not in ("method", "stages", "seed")
            and varies(runs[k])]
    if not keys or not {"method", "stages"} <= set(runs.columns):
        return keys
    groups = runs.groupby(["method", "stages"], sort=False)
    return [k for k in keys if any(varies(g[k]) for _, g in groups)]


def pooled_keys(records: pd.DataFrame, by: Sequence[str]) -> List[str]:
    """The configuration keys that a summary grouped ``by`` pools runs over: ``method``, ``stages`` and the
    :func:`varying_keys`, each where it is not in ``by`` and takes more than one value within some group."""
    runs = records.drop_duplicates("run") if "run" in records.columns else records  # (a run's config is constant)
    return [k for k in ("method", "stages", *varying_keys(records))
            if k not in by and k in runs.columns and runs.groupby(list(by))[k].nunique().max() > 1]


def interval_sizes(summary: pd.DataFrame, columns: Sequence[str]) -> List[int]:
    """The number of values each interval of ``columns`` in a :func:`summarize` table is over (its ``*_n``:
    a NaN value is left out), for :func:`staleopt.stats.interval_caption`; the ``runs`` where no cell has a
    value or the table predates those columns."""
    sizes = [int(n) for c in columns if f"{c}_n" in summary.columns for n in summary[f"{c}_n"] if n > 0]
    return sizes or [int(n) for n in summary["runs"]]


def summarize(records: pd.DataFrame, by: Optional[Sequence[str]] = None, level: float = 0.95,
              metric=None) -> pd.DataFrame:
    """Mean and ``level`` CI over seeds of each group's best and final test ``metric``.

    ``metric``: a :class:`~staleopt.metrics.Metric` or record column, default the
    records' task's (:func:`staleopt.metrics.of`: test accuracy for classification,
    test perplexity for a language model). Per run (:func:`staleopt.stats.per_run`):
    for accuracy ``best_acc = max test_acc``, ``final_acc`` = test_acc of the
    last epoch (for a lower-is-better metric the best is the minimum: ``best_ppl``,
    ``final_ppl``), ``final_loss`` = its train_loss, status = the last record's.
    Groups: ``by``, default every config key except ``seed``; the output keeps
    the ``by`` columns that vary (and ``method``, ``stages``), then ``runs``,
    ``best_acc``, ``best_acc_lo``, ``best_acc_hi``, ``best_acc_ci``, the same
    for ``final_acc``, ``best_acc_interval`` and ``final_acc_interval``
    (:func:`staleopt.stats.interval`'s kind of each column's interval: ``t``, or
    ``range`` below the t-interval's seeds or where a value is infinite),
    ``best_acc_n`` and ``final_acc_n`` (the values each interval is over: the
    runs but those whose value is NaN),
    ``final_loss``, ``excess_loss`` (the mean lowest test loss above the dataset's
    best achievable ``best_loss``; only where the records know it), ``diverged``
    (count) and ``status`` (``ok``, ``diverged`` or ``k/n diverged``). ``*_lo``, ``*_hi``: the interval every table
    and figure shows
    (within the metric's bounds, [0, 1] for an accuracy; the seeds' range below
    :data:`~staleopt.stats.MIN_SEEDS_FOR_T` seeds); ``*_ci``: the Student-t
    half-width, unclipped (NaN for one seed).
    """
    check_level(level)
    unknown = [c for c in (by or []) if c not in field_names()]
    if unknown:
        close = difflib.get_close_matches(unknown[0], field_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"cannot group by {unknown[0]!r}{hint}: not a config key; keys: {', '.join(field_names())}")
    if by and "seed" in by:
        raise ConfigError("cannot group by 'seed': the summary is the mean over seeds; each run's values are "
                          "staleopt.stats.per_run(records) (and every epoch's, records.csv)")
    if records.empty:
        return pd.DataFrame()
    metric = metrics.of(records, metric)
    given = bool(by)
    by = [c for c in (by or field_names()) if c != "seed" and c in records.columns]
    table = per_run(records, by, metric=metric)
    keep = [c for c in by if c in ("method", "stages") or varies(table[c])]
    if not keep and given:  # grouped by keys that do not vary: one group, labelled with their value
        keep = by
    rows = []
    for key, g in table.groupby(keep, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        nd, n = divergence_count(g["diverged"])
        row = {**dict(zip(keep, key)), "runs": n}
        kinds, counts = {}, {}
        for col in (metric.best_column, metric.final_column):
            mean, lo, hi, counts[f"{col}_n"], kinds[f"{col}_interval"] = interval(g[col], level, metric.limits)
            row.update({col: mean, f"{col}_lo": lo, f"{col}_hi": hi, f"{col}_ci": t_interval(g[col], level)[1]})
        row.update({**kinds, **counts, "final_loss": t_interval(g["final_loss"], level)[0]})
        if "excess_loss" in g.columns:
            row["excess_loss"] = t_interval(g["excess_loss"], level)[0]
        rows.append({**row, "diverged": nd, "status": status_text(nd, n)})
    return pd.DataFrame(rows).sort_values(keep, kind="stable", ignore_index=True)
