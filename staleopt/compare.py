"""``staleopt.compare``: one's own model and data through the demo's sweep, tables, claims and figures in one call.

    result = staleopt.compare(my_cnn, my_data, methods=["gpipe", "pipedream", "pipemare"],
                              stages=[2, "max"], seeds=[0, 1, 2], out="runs/mine", epochs=5, lr=0.05)
    result.table()          # methods x P: best test accuracy (a language model: perplexity), mean [interval]
                            # over seeds, diverged runs counted
    result.claims           # the demo's claims evaluated on these runs

It is a resumable sweep (:func:`staleopt.sweep.run_sweep`) of ``methods x stages x
seeds`` over one base config (the keyword arguments: any :class:`~staleopt.config.RunConfig`
field), so calling it again after an interruption trains only what is missing. A run's
directory is named by the hash of its config, which holds the model's *name*, not its
code: give a changed model a new name (or another ``out``). :func:`write_report` writes
the same files as ``staleopt demo`` (``records.csv``, ``summary.csv``, ``speedup.csv``,
``claims.csv``, ``report.json`` and the figures), the target accuracy in each file that
depends on it. Everything is in the task's metric (:mod:`staleopt.metrics`: test
accuracy for classification, test perplexity, lower is better, for a language model)
unless ``metric=`` names another.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Union

import pandas as pd

from . import data as datasets
from . import metrics as metrics_module
from . import models
from .errors import ConfigError

__all__ = ["compare", "Comparison", "write_report", "DEFAULT_METHODS"]

#: The methods :func:`compare` runs by default: synchronous, weight stashing, PipeMare (T1 + T2).
DEFAULT_METHODS = ("gpipe", "pipedream", "pipemare")


@dataclass
class Comparison:
    """What :func:`compare` (and ``staleopt demo``) produced: the records, the tables, the claims, the files."""

    out: Path
    records: pd.DataFrame
    summary: pd.DataFrame
    speedup: pd.DataFrame
    claims: pd.DataFrame
    target: Optional[float]
    memory: Optional[pd.DataFrame] = None  # :func:`staleopt.hardware.run_memory`
    figures: List[Path] = field(default_factory=list)
    files: List[Path] = field(default_factory=list)
    report: Any = None  # the sweep's :class:`~staleopt.sweep.SweepReport`
    metric: metrics_module.Metric = metrics_module.ACCURACY  # what the tables, claims and target are in

    def table(self, value: Optional[str] = None) -> pd.DataFrame:
        """Methods x stages of ``value`` (default the metric's best, ``best_acc``, ``best_ppl`` or
        ``best_test_loss``; or its final, ``final_acc``, ...: the columns of :attr:`metric`): mean [interval] over
        seeds, diverged runs counted in each cell (:func:`staleopt.commands.demo.pivot`)."""
        from .commands.demo import pivot
        return pivot(self.summary, value or self.metric.best_column)

    def speedup_table(self) -> pd.DataFrame:
        """Methods x stages of the speedup over GPipe to :attr:`target` (empty without a target)."""
        from .commands.demo import speedup_pivot
        return speedup_pivot(self.speedup) if len(self.speedup) else pd.DataFrame()


def _name(what: str, value, register) -> str:
    """A model or dataset given as a name/spec, or as a factory registered here under its ``__name__``."""
    if isinstance(value, str):
        return value
    if callable(value):
        name = getattr(value, "__name__", "")
        if not name.isidentifier():
            raise ConfigError(f"the {what} factory {value!r} has no usable name ({name!r}); define it with def, or "
                              f"register it yourself (staleopt.register_{what}('name', factory)) and pass the name")
        return register(name, value, replace=True)
    raise ConfigError(f"{what} must be a name, a 'module:function' spec or a factory function, got "
                      f"{type(value).__name__}")


def compare(model: Union[str, Callable], data: Union[str, Callable] = "mnist1d", *,
            methods: Sequence[str] = DEFAULT_METHODS, stages: Sequence[Union[int, str]] = (1, "max"),
            seeds: Sequence[int] = (0, 1, 2), out: Union[str, os.PathLike] = "runs/compare",
            target: Optional[float] = None, claims=None, workers: int = 1, threads: int = 1, bar: bool = True,
            metric=None, **config) -> Comparison:
    """Train ``methods x stages x seeds`` of ``model`` on ``data`` into ``out`` (resumably) and report on them.

    ``model``, ``data``: a built-in or registered name, a ``"module:function"`` /
    ``"file.py:function"`` spec, or a factory (registered under its ``__name__``:
    :func:`staleopt.register_model`, :func:`staleopt.register_data`). ``config``: the
    other :class:`~staleopt.config.RunConfig` fields, shared by every run (``epochs``,
    ``lr``, ``batch_size``, ``model_kwargs``, ...). ``metric``: what runs are judged by
    (:mod:`staleopt.metrics`; default the data's task's: test accuracy, or a language
    model's test perplexity). ``target``: the value of the time to accuracy table and
    claims, in that metric (default: GPipe's mean best accuracy minus 0.01, or its best
    perplexity plus 1%, when ``methods`` has ``gpipe``; none otherwise). ``claims``: default the demo's
    for the metric (:func:`staleopt.claims.default_claims`: ``DEMO_CLAIMS`` in accuracy, ``LM_DEMO_CLAIMS``
    in perplexity); a claim on a method not run is ``"not evaluated"``. ``workers``, ``threads``, ``bar``: as
    :func:`staleopt.sweep.run_sweep`.
    Returns a :class:`Comparison`; the files are written into ``out``. Runs that did not finish (failed, left to
    another launch, damaged files: ``result.report``) are left out of the tables, with a warning that names them.
    """
    from . import sweep
    taken = sorted({"model", "data", "method", "stages", "seed"} & set(config))
    if taken:
        raise ConfigError(f"{taken} are compare's own arguments (methods=, stages=, seeds=, model, data); "
                          "pass them there")
    for key, values in (("methods", methods), ("stages", stages), ("seeds", seeds)):
        if isinstance(values, (str, int)) or not len(values):
            raise ConfigError(f"{key} must be a non-empty list, got {values!r}")
    from .claims import Claim
    if claims is not None and (not isinstance(claims, (list, tuple)) or
                               not all(isinstance(c, Claim) for c in claims)):
        raise ConfigError(f"claims must be a list of staleopt.claims.Claim (e.g. claims.Compare(...)), got "
                          f"{claims!r:.80}: checked before training (it failed after every run)")
    base = {"model": _name("model", model, models.register), "data": _name("data", data, datasets.register),
            **config}
    grid = {"method": list(methods), "stages": list(stages), "seed": list(seeds)}
    spec = sweep.from_spec({"name": Path(out).name, "base": base, "grid": grid}, source="compare()")
    # a metric the runs will not record, a target out of its range: refused before training (they were after it)
    planned = metrics_module.planned(datasets.task(base["data"], **spec.configs[0].data_kwargs), metric)
    if target is not None:
        from .speedup import check_target
        check_target(target, planned)
    out = Path(out)
    check_report_folder(out, [c.run_id() for c in spec.configs])
    report = sweep.run_sweep(spec, out, workers=workers, threads=threads, bar=bar)
    ids = {c.run_id() for c in spec.configs}
    damaged = dict(report.damaged)
    records = sweep.collect(out, damaged=damaged)  # (a damaged run is left out, named below; another's ignored)
    records = records[records["run"].isin(ids)].reset_index(drop=True)
    if records.empty:
        raise ConfigError(f"no run finished; see the error.txt files under {out / 'runs'}")
    unfinished = {what: [i for i in runs if i in ids] for what, runs in
                  (("failed", report.failed), ("left to another launch", report.claimed),
                   ("damaged", list(damaged)))}
    lost = sum(map(len, unfinished.values()))
    if lost:  # (the tables below are over the runs that finished: say so, and which)
        parts = "; ".join(f"{len(v)} {what} ({sweep.few(v)})" for what, v in unfinished.items() if v)
        warnings.warn(f"{lost} of {len(ids)} runs of this comparison did not finish: {parts}. Its tables, claims "
                      f"and figures are over the {records['run'].nunique()} runs that did (a cell then has fewer "
                      f"runs than seeds). A failed run's error is in {out / 'runs'}/<run id>/error.txt; calling "
                      "compare again retries it" + "".join(f". Damaged: {damaged[i]}" for i in unfinished["damaged"]
                                                            [:1]), stacklevel=2)
    metric = metrics_module.of(records, metric)
    if target is None and "gpipe" in set(records["method"]):
        from .speedup import target_or_none
        target = target_or_none(records, metric=metric)
    result = write_report(records, out, target=target, claims=claims, metric=metric)
    result.report = report
    return result


def write_report(records: pd.DataFrame, out: Union[str, os.PathLike], target: Optional[float] = None,
                 claims=None, level: float = 0.95, figures: Union[str, os.PathLike, None] = None,
                 write_records: bool = True, metric=None) -> Comparison:
    """Write a sweep's report into ``out`` and return it: ``records.csv``, ``summary.csv`` (mean and CI over
    seeds per method and P), ``speedup.csv`` (time to ``target``, with a ``target`` column), ``claims.csv``,
    ``memory.csv`` (weights-only and total memory per method and P, :func:`staleopt.hardware.run_memory`);
    the tables, like the figures' lines, also apart per value of a config key that runs of one method and P
    differ in (:func:`staleopt.sweep.varying_keys`: ``lr`` in a sweep over it), where the claims are not
    evaluated;
    ``report.json`` (the target, its ``metric`` when that is not accuracy, and what was written) and the
    figures (the metric against stages; against epochs and, with a target, against pipeline time at the
    largest P; into ``figures``, default ``out``). ``metric``: default the records' task's
    (:func:`staleopt.metrics.of`). ``write_records=False`` leaves ``records.csv`` as it is (a report rebuilt
    from it). A file the previous ``report.json`` in ``out`` listed and this report does not write (the time
    table without a target, the figures of another largest P) is removed, so none contradicts the new tables."""
    from . import claims as claims_module
    from . import hardware, speedup, sweep
    from .plot import sweep as plots
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    before = _listed(out / "report.json")
    metric = metrics_module.of(records, metric)
    by = [*plots.line_keys(records), "stages"]  # a configuration per figure line and P (lr in a sweep over it)
    summary = sweep.summarize(records, by=by, level=level, metric=metric)
    fast = speedup.speedup_table(records, target, keys=by, metric=metric) if target is not None else pd.DataFrame()
    memory = hardware.run_memory(records)  # weights only and in all, per method and P
    verdicts = claims_module.evaluate(records, claims, level=level,
                                      target=target if target is not None else float("nan"), memory=memory,
                                      metric=metric)
    files = [out / "records.csv", out / "summary.csv", out / "claims.csv"]
    if write_records:
        records.to_csv(files[0], index=False)
    summary.to_csv(files[1], index=False)
    verdicts.to_csv(files[2], index=False)
    if target is not None:
        files.append(out / "speedup.csv")
        fast.to_csv(files[-1], index=False)
    largest = int(summary["stages"].max())
    title = plots.describe(records)
    where = Path(figures) if figures is not None else out
    files.append(out / "memory.csv")
    memory.to_csv(files[-1], index=False)
    figures = [Path(plots.save(plots.plot_accuracy_vs_stages(records, metric.best_column, title=title,
                                                             target=math.nan if target is None else target,
                                                             level=level, memory=memory),
                               where / "accuracy_vs_stages.png")),
               Path(plots.save(plots.plot_accuracy_vs_epoch(records, largest,
                                                            title=f"{title}, P = {largest}", metric=metric),
                               where / f"accuracy_vs_epoch_P{largest}.png"))]
    if target is not None:
        figures.append(Path(plots.save(plots.plot_accuracy_vs_time(records, largest, target=target,
                                                                   title=f"{title}, P = {largest}", metric=metric),
                                       where / f"accuracy_vs_time_P{largest}.png")))
    files.append(out / "report.json")
    named = {} if metric is metrics_module.ACCURACY else {"metric": metric.column}  # absent: accuracy
    files[-1].write_text(json.dumps({"target": target, **named, "level": level, "title": title,
                                     "runs": int(records["run"].nunique()),
                                     "files": [p.name for p in files[:-1]],
                                     "figures": [p.name for p in figures]}, indent=2) + "\n")
    # what the last report here wrote and this one does not (the time table and figure without a target, the
    # figures of another largest P) would contradict the new tables: removed
    for folder, names, now in ((out, before[0], files), (where, before[1], figures)):
        for name in set(names) - {p.name for p in now}:
            if name == Path(name).name:  # (a bare file name, as report.json lists them)
                (folder / name).unlink(missing_ok=True)
    return Comparison(out, records, summary, fast, verdicts, target, memory, figures, files, metric=metric)


#: The files :func:`write_report` writes into its folder (besides the figures).
REPORT_FILES = ("records.csv", "summary.csv", "claims.csv", "speedup.csv", "memory.csv", "report.json")


def check_report_folder(out: Union[str, os.PathLike], runs: Sequence[str] = ()) -> None:
    """Refuse an ``out`` whose files a report would overwrite without having written them: report files in a
    folder that is neither an earlier report's (``report.json``) nor a sweep's (``runs/``), or a finished
    ``staleopt train --out OUT/records.csv`` run (its ``records.csv.done``), or a ``records.csv`` holding runs that
    ``OUT/runs`` cannot rebuild (a copied report) and that are not among ``runs``, the ids the report is about to
    train (a damaged run's folder deleted to train it again). Checked before training."""
    out = Path(out)
    if (out / "records.csv.done").is_file():
        raise ConfigError(f"{out} holds a finished staleopt train run (records.csv and records.csv.done), whose "
                          "records a report would overwrite: choose another --out")
    if (out / "report.json").is_file() or (out / "runs").is_dir():
        # (runs about to be trained are not lost where their folders live: a sweep's; a copy has none)
        kept = set(runs) if (out / "runs").is_dir() else set()
        lost = [i for i in _unrebuildable_runs(out) if i not in kept]
        if lost:
            raise ConfigError(f"{out / 'records.csv'} holds {len(lost)} run(s) that {out / 'runs'} does not (run "
                              f"{lost[0]}), whose records the report would overwrite and lose: choose another "
                              "--out, or move records.csv")
        return
    theirs = [f for f in REPORT_FILES if (out / f).exists()]
    if theirs:
        raise ConfigError(f"{out} holds {', '.join(theirs)}, which the report would overwrite, and is no earlier "
                          "report's or sweep's folder: choose another --out, or move those files")


def _unrebuildable_runs(out: Path) -> List[str]:
    """The runs ``out/records.csv`` holds that no finished run folder ``out/runs/<id>`` can rebuild (a copied
    report keeps only the records). A ``records.csv`` that does not read as records is refused: it is no report's."""
    path = out / "records.csv"
    if not path.is_file():
        return []
    try:
        ids = sorted(set(pd.read_csv(path, usecols=["run"], dtype=str)["run"]))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} does not read as a report's records ({e}), and the report would overwrite it: "
                          "choose another --out, or move records.csv") from None
    return [i for i in ids if not (out / "runs" / i / "done").is_file()]


def _listed(path: Path) -> tuple:
    """``(files, figures)`` that the report at ``path`` (``report.json``) lists; nothing if there is none, or if it
    cannot be read (then no file is removed)."""
    try:
        listed = json.loads(path.read_text())
        return tuple([str(n) for n in listed.get(key, []) if isinstance(n, str)] for key in ("files", "figures"))
    except (OSError, ValueError, AttributeError):
        return (), ()
