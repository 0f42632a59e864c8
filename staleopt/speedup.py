"""Time to accuracy: measured steps to a target accuracy (or perplexity, loss), priced by the analytic pipeline
utilization.

PipeMare compares methods by the time a pipeline needs to reach a target
accuracy (§4, Table 2: targets 94.0 on CIFAR10, 75.5 on ImageNet; Fig. 11,
"normalized time"), not by accuracy alone. Throughput is proportional to
pipeline utilization (§2), so ``n`` optimizer steps take

    T(n) = n / Util          (minibatch times of a fully utilized pipeline)

with ``Util = N / (N + P - 1)`` for GPipe and 1 for the asynchronous methods
(:func:`staleopt.hardware.time_to_accuracy`; phased methods, PipeMareW and the
hybrid, amortize their phases over the first ``n`` steps). The steps come from
the run (:func:`staleopt.stats.steps_to_target`: the first epoch whose test
accuracy reaches the target), the utilization from the hardware model: the
simulator does not time the pipeline, it prices the steps it ran.

The target is in the records' metric (:mod:`staleopt.metrics`): an accuracy is
reached at or above it, a perplexity or loss (lower is better) at or below it.
Every function takes ``metric=`` (a :class:`~staleopt.metrics.Metric` or record
column; default the records' task's).

* :func:`with_pipeline_time`: each record's ``pipeline_time = T(step)``, the
  x-axis of accuracy against time;
* :func:`time_to_target`: per run, ``steps_to_target`` and ``time_to_target``;
* :func:`speedup_table`: per method and ``P``, the runs that reached the
  target, their mean steps and time, and the speedup
  ``T_baseline / T_method`` against GPipe at the same ``P`` (same target, in its ``target`` column);
* :func:`shared_target`: the one target of a sweep directory (its report's, else GPipe's mean best
  accuracy minus 0.01, or its best perplexity plus 1%), which the demo, ``staleopt results``,
  ``staleopt plot`` and the notebooks share.
"""
from __future__ import annotations

import json
import math
import numbers
import warnings
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import pandas as pd

from . import methods, metrics, stats
from .config import RunConfig, field_names
from .corrections import Hybrid, Warmup
from .errors import ConfigError, RunFileError, StaleoptError
from .hardware import time_to_accuracy
from .train import method_args

__all__ = ["DEFAULT_MARGIN", "pipeline_time", "with_pipeline_time", "default_target", "shared_target",
           "check_target", "time_to_target", "speedup_table"]

#: Default target: the baseline's mean best accuracy minus this (PipeMare Table 2: 94.0 against GPipe's 95.0);
#: for an unbounded metric (perplexity, loss) its mean best times ``1 + DEFAULT_MARGIN``
#: (:meth:`staleopt.metrics.Metric.worse_by`).
DEFAULT_MARGIN = 0.01
#: Int config fields that a CSV round trip may turn into floats (a column with NaN).
_INT_FIELDS = ("stages", "microbatches", "epochs", "batch_size", "seed", "anneal_steps", "warmup_steps",
               "pipelined_steps", "max_steps")
_NEEDED = ("run", "method", "stages", "microbatches", "epoch", "step", "status")


def _check(records: pd.DataFrame, metric: Optional[metrics.Metric] = None) -> None:
    missing = [c for c in (*_NEEDED, *([metric.column] if metric else [])) if c not in records.columns]
    if missing:
        raise ConfigError(f"records lack the columns {missing} that time to accuracy needs; pass the records of "
                          "staleopt.sweep.collect (config keys and per-epoch records)")


#: Config fields that the phase lengths do not depend on and that may name a user's model or data, which
#: this process need not know (:mod:`staleopt.registry`): left at their defaults in :func:`_config`.
_NOT_NEEDED = ("model", "model_kwargs", "data", "data_kwargs")


def _config(row) -> RunConfig:
    """The run's :class:`~staleopt.config.RunConfig` from a record row (JSON cells back to dicts, NaN to None),
    its model and data left at the defaults (:func:`staleopt.train.method_args` does not read them)."""
    values = {}
    for k in field_names():
        if k in _NOT_NEEDED:
            continue
        v = row.get(k)
        if isinstance(v, str) and v[:1] in "[{":
            v = json.loads(v)
        elif isinstance(v, float) and math.isnan(v):
            v = None
        elif hasattr(v, "item"):
            v = v.item()
        if v is not None:
            values[k] = int(v) if k in _INT_FIELDS and isinstance(v, float) else v
    return RunConfig.from_dict(values)


def _phases(run_records: pd.DataFrame, records: Optional[pd.DataFrame] = None) -> Dict[str, float]:
    """PipeMareW's ``warmup_steps`` / the hybrid's ``pipelined_steps`` of a run ({} for other methods).

    The lengths are :func:`staleopt.train.method_args` of the run's config, with the steps per epoch read from
    the records: ``step / epoch`` of the run's first record where it ended a whole epoch, else of another run
    in ``records`` on the same data and batch size (a run that diverged in its first epoch records the step it
    stopped at: read as the epoch's length, its warmup came out 3 steps for 11). Where no run has one, the size
    of its training data, loaded (:func:`_train_size`).
    """
    method = str(run_records["method"].iloc[0])
    corrections = methods.resolve(method)[1] if method in methods.names() else []
    if not any(isinstance(c, (Warmup, Hybrid)) for c in corrections):
        return {}
    first = run_records.sort_values("epoch").iloc[0]
    cfg = _config(first)
    whole = [first] if _whole(first) else _whole_first_epochs(first, records)
    if whole:
        n_train = math.ceil(float(whole[0]["step"]) / float(whole[0]["epoch"])) * cfg.batch_size
    else:
        n_train = _train_size(first, method)
    args = method_args(cfg, n_train)
    return {k: float(args[k]) for k in ("warmup_steps", "pipelined_steps") if k in args}


def _whole_first_epochs(first, records: Optional[pd.DataFrame]) -> list:
    """The first records that ended a whole epoch of the runs in ``records`` on ``first``'s data and batch size."""
    same = ["data", "data_kwargs", "batch_size"]
    if records is None or not set(same) <= set(records.columns):
        return []
    mine = records[(records[same].astype(str) == first[same].astype(str)).all(axis=1)]
    return [r for _, r in mine.sort_values("epoch").groupby("run", sort=False).head(1).iterrows() if _whole(r)]


def _train_size(first, method: str) -> int:
    """The training samples of the data of a run that stopped within its first epoch, loaded (no run of the
    records ended an epoch on it); where it cannot be loaded here, its first record's step as the epoch's length,
    with a warning that the run's phases and pipeline times may be too short."""
    from . import data as datasets
    kwargs = first.get("data_kwargs")
    try:
        return len(datasets.load(str(first["data"]), **(json.loads(kwargs) if isinstance(kwargs, str) else {})).train)
    except StaleoptError as e:
        warnings.warn(f"run {first['run']} ({method}) stopped within its first epoch, no run of the records on its "
                      f"data and batch size finished one, and its data does not load here ({e}): its phase "
                      "lengths, and so its pipeline times, are read off the step it stopped at and may be too "
                      "short", stacklevel=4)
        return math.ceil(float(first["step"]) / float(first["epoch"])) * int(first["batch_size"])


def _capped(record) -> bool:
    """Whether ``record`` (an epoch's row) stopped at its run's ``max_steps`` cap."""
    cap = record.get("max_steps")
    return cap is not None and not (isinstance(cap, float) and math.isnan(cap)) and record["step"] >= float(cap)


def _whole(record) -> bool:
    """Whether ``record`` ended a whole epoch: not a divergence, not a ``max_steps`` cap."""
    return record["status"] == "ok" and not _capped(record)


def pipeline_time(steps: float, method: str, stages: int, microbatches: int,
                  phases: Optional[Dict[str, float]] = None) -> float:
    """``T(steps)``: pipeline time of the first ``steps`` optimizer steps, in fully utilized minibatch times.

    :func:`staleopt.hardware.time_to_accuracy` with the phases cut at ``steps``
    (a warmup longer than ``steps`` covers all of them). NaN ``steps`` give NaN.
    """
    if not math.isfinite(steps):
        return math.nan
    cut = {k: min(v, steps) for k, v in (phases or {}).items()}
    return time_to_accuracy(float(steps), method, int(stages), int(microbatches), **cut)


def with_pipeline_time(records: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``records`` with ``pipeline_time``: ``T(step)`` of each record (:func:`pipeline_time`)."""
    _check(records)
    out = records.copy()
    out["pipeline_time"] = math.nan
    for _, r in records.groupby("run", sort=False):
        first = r.iloc[0]
        phases = _phases(r, records)
        out.loc[r.index, "pipeline_time"] = [
            pipeline_time(float(s), first["method"], first["stages"], first["microbatches"], phases)
            for s in r["step"]]
    return out


def default_target(records: pd.DataFrame, baseline: str = "gpipe", margin: float = DEFAULT_MARGIN,
                   metric=None) -> float:
    """``baseline``'s mean best test ``metric`` over its runs made worse by ``margin``
    (:meth:`~staleopt.metrics.Metric.worse_by`: an accuracy minus ``margin``, a perplexity or loss times
    ``1 + margin``; PipeMare Table 2's targets sit about a point below synchronous training).

    The mean is over the baseline's runs that did not diverge (a target is what the baseline reaches when it
    trains; a diverged run's best can be ``inf`` or ``1e170``), else, where every one diverged, over those with
    a finite best (what they reached before). A :class:`~staleopt.errors.ConfigError` when no run has one."""
    metric = metrics.of(records, metric)
    _check(records, metric)
    base = records[records["method"] == baseline]
    if base.empty:
        raise ConfigError(f"no {baseline!r} runs to set the target from; pass a target {metric.label} "
                          f"(--target) or a baseline the sweep has: {sorted(set(records['method']))}")
    by_run = base.groupby("run")
    bests = by_run[metric.column].agg(metric.best)
    trained = by_run["status"].agg(lambda s: not (s == "diverged").any())
    finite = bests[trained & np.isfinite(bests)]
    if finite.empty:
        finite = bests[np.isfinite(bests)]
    if finite.empty:
        raise ConfigError(f"no {baseline!r} run has a finite best {metric.label} ({len(bests)} runs: "
                          f"{', '.join(map(str, bests))}) to set the target from; pass a target {metric.label} "
                          "(--target)")
    return metric.worse_by(float(finite.mean()), margin)


def target_or_none(records: pd.DataFrame, baseline: str = "gpipe", metric=None) -> Optional[float]:
    """:func:`default_target`, or ``None`` with a warning that says why where the baseline's runs set none
    (none has a finite best): a report is then written without its time-to-target table and figure, never
    lost."""
    try:
        return default_target(records, baseline, metric=metric)
    except ConfigError as e:
        warnings.warn(f"{e}; the report has no time-to-target table or figure", stacklevel=2)
        return None


def shared_target(sweep_dir=None, records: Optional[pd.DataFrame] = None, metric=None) -> Optional[float]:
    """The one target of a sweep directory, for every command, figure and notebook that reads it:
    the one its report was written with (``report.json`` of ``staleopt demo`` / :func:`staleopt.compare`,
    else a demo's ``run.json``) when that report's metric is ``metric`` (default the records' task's; a
    report without a ``metric`` is accuracy's), else :func:`default_target` of ``records`` when they have
    GPipe runs, else ``None``."""
    wanted = metrics.of(records, metric) if records is not None or metric is not None else None
    if sweep_dir is not None:
        for name in ("report.json", "run.json"):
            path = Path(sweep_dir) / name
            if path.is_file():
                try:
                    report = json.loads(path.read_text())
                except (OSError, ValueError) as e:
                    report = e
                if not isinstance(report, dict):
                    raise RunFileError(f"{path} is not a report's JSON object ({report}): restore it, delete it "
                                       "(the records' default target is used then), or pass a target (--target)")
                target = report.get("target")
                same = wanted is None or report.get("metric", metrics.ACCURACY.column) == wanted.column
                if target is not None and same:
                    return float(target)
    if records is not None and len(records) and "gpipe" in set(records["method"]):
        return target_or_none(records, metric=metric)
    return None


def check_target(target: float, metric) -> None:
    """:class:`~staleopt.errors.ConfigError` for a target ``metric`` cannot take: outside an accuracy's [0, 1] (a
    percentage, 85 for 0.85, would make no run reach it; -1 every run at its first epoch), below 1 for a
    perplexity, negative for a loss, or not a finite number. ``metric`` None (not known before a user's dataset
    loads): only the last."""
    if isinstance(target, bool) or not isinstance(target, numbers.Real) or not math.isfinite(target):
        raise ConfigError(f"a target is a finite number in the runs' metric, got {target!r}: pass a value a run can "
                          "reach (--target)")
    if metric is None:
        return
    low, high = metric.bounds if metric.bounds is not None else (1.0 if metric is metrics.PERPLEXITY else 0.0,
                                                                 math.inf)
    if not (low <= target <= high and math.isfinite(target)):
        percent = metric.bounds == (0.0, 1.0) and 1 < target <= 100
        hint = f" (a fraction: {target / 100:g} for {target:g}%?)" if percent else ""
        raise ConfigError(f"a target {metric.label} lies in [{low:g}, {high:g}], got {target!r}{hint}: pass a value "
                          f"a run can reach (--target)")


def time_to_target(records: pd.DataFrame, target: float, keys: Sequence[str] = ("method", "stages"),
                   metric=None) -> pd.DataFrame:
    """Per run: ``keys``, ``seed``, the metric's best (``best_acc``), ``diverged``, ``steps_to_target`` and
    ``time_to_target`` (``T(steps_to_target)``; NaN where the run never reached ``target``)."""
    metric = metrics.of(records, metric)
    _check(records, metric)
    if target is None:  # (the other non-numbers: check_target)
        raise ConfigError(f"time to a target needs the target {metric.label} as a number, got None: pass "
                          "one, or speedup.default_target(records) (the GPipe runs' mean best made worse by 1%), "
                          "or shared_target(sweep_dir, records) (the one a report was written with); None means "
                          "the records set none (no GPipe run with a finite best): no time table then")
    check_target(target, metric)
    keys = list(dict.fromkeys([*keys, "method", "stages", "microbatches"]))
    table = stats.per_run(records, keys, target=target, metric=metric)
    times = []
    for row in table.itertuples():
        r = records[records["run"] == row.run]
        times.append(pipeline_time(row.steps_to_target, row.method, row.stages, row.microbatches,
                                   _phases(r, records)))
    table["time_to_target"] = times
    return table


def speedup_table(records: pd.DataFrame, target: float, baseline: str = "gpipe",
                  keys: Optional[Sequence[str]] = None, metric=None) -> pd.DataFrame:
    """Per group of ``keys``: ``runs``, ``reached`` (runs that reached ``target``), the mean
    ``steps_to_target`` and ``time_to_target`` over those, and ``speedup`` =
    baseline's mean time / this group's at the same ``P`` (NaN where either never reached it). ``keys``: default
    ``method``, every key in which the runs' configurations differ (:func:`staleopt.sweep.varying_keys`: ``lr``
    in a sweep over learning rates) and ``stages``, the rows of ``staleopt results`` and the figures (with
    ``("method", "stages")`` alone two learning rates' runs were pooled into one mean).

    A group where only some runs reached the target has its mean over those and
    ``reached < runs``: read the speedup with that count.
    """
    if keys is None:
        from .sweep import varying_keys
        keys = ["method", *varying_keys(records), "stages"]
    table = time_to_target(records, target, keys, metric)
    rows = []
    for key, g in table.groupby(list(keys), sort=False, dropna=False):  # (a key None for some runs: kept)
        key = key if isinstance(key, tuple) else (key,)
        hit = g[g["steps_to_target"].notna()]
        rows.append({**dict(zip(keys, key)), "runs": len(g), "reached": len(hit),
                     "diverged": int(g["diverged"].sum()),
                     "steps_to_target": hit["steps_to_target"].mean() if len(hit) else math.nan,
                     "time_to_target": hit["time_to_target"].mean() if len(hit) else math.nan})
    out = pd.DataFrame(rows)
    from .sweep import config_key
    same = [k for k in keys if k != "method"]  # the baseline is matched on every key but the method...
    bases = [(config_key(b[same]), b["time_to_target"]) for _, b in out[out["method"] == baseline].iterrows()]

    def base_time(r) -> float:  # ...that it sets: GPipe's unset decay (T2's, pipemare's alone) matches any decay
        mine = config_key(r[same])
        fits = [(sum(a == b for a, b in zip(key, mine)), t) for key, t in bases
                if all(a == b or a == "null" for a, b in zip(key, mine))]
        return max(fits, key=lambda f: f[0])[1] if fits else math.nan
    out["speedup"] = [base_time(r) / r["time_to_target"] if r["time_to_target"] > 0 else math.nan
                      for _, r in out.iterrows()]
    out["target"] = target  # every file that depends on the target says which
    out.attrs["target"] = target
    return out
