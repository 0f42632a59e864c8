"""Statistics over a sweep's runs, in one place: the sweep summary, the figures and the demo's claims use them.

Records are the per-epoch rows of :func:`staleopt.sweep.collect` (one row per
``(run, epoch)``, config keys as columns). A run's numbers:

* ``best_acc`` — the largest ``test_acc`` over its epochs (PipeMare App. C
  reports the best test accuracy across epochs); ``final_acc`` — the last
  epoch's; ``diverged`` — its last record has ``status == "diverged"``
  (the run stopped there; it stays in every mean, never dropped). Those are the
  columns of accuracy, the classification metric; every function takes the
  :class:`~staleopt.metrics.Metric` (default: the records' task's,
  :func:`staleopt.metrics.of`), and a lower-is-better metric's best is its
  minimum: ``best_ppl``, ``final_ppl`` of a language model's ``test_ppl``;
* ``excess_loss`` — where the records know the dataset's best achievable loss
  (``best_loss``, nats per token), the run's lowest ``test_loss`` minus it;
* ``steps_to_target`` — the optimizer step count at the end of the first epoch
  whose metric reaches a target (at or above it; at or below it when lower is
  better; NaN when no epoch does), the measured half of PipeMare's
  time-to-accuracy (§4, Table 2; :mod:`staleopt.speedup`).

Across seeds: the mean and an interval that cannot leave the values' range of
definition (:func:`interval`, the one rule every table, figure and claim uses):

* with at least :data:`MIN_SEEDS_FOR_T` values, the Student-t interval
  ``mean ± t_{(1+level)/2, n-1} s / sqrt(n)`` intersected with ``bounds`` ([0, 1]
  for an accuracy: the true mean lies there, so the intersection covers it as often;
  none for a perplexity or a loss, :attr:`staleopt.metrics.Metric.bounds`);
* with fewer, the range ``[min, max]`` of the values: at ``n = 3`` the t factor is
  4.3 (12.7 at ``n = 2``), and an interval of ±1.2 on an accuracy says nothing that
  the three values themselves do not say better.

A diverged run counts with the value it had, in every mean, interval and count, and
so does an infinite one: a language model whose loss overflowed has perplexity
``inf`` (:mod:`staleopt.train` records such a run as diverged), its group's mean is
``inf`` and its interval the range ``[min, inf]``, in the tables, the figures
(:mod:`staleopt.plot.sweep` draws it at the axis' edge) and the claims alike. A
NaN is a missing value, left out of ``n``; :func:`per_run` gives a diverged run
whose metric has no value at all (a NaN loss from its first evaluation) the
metric's worst (:attr:`staleopt.metrics.Metric.worst`).
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional, Sequence, Tuple

import pandas as pd

from . import metrics
from .errors import ConfigError

__all__ = ["HARDWARE_COLUMNS", "MIN_SEEDS_FOR_T", "ACCURACY", "t_interval", "interval", "interval_text", "interval_caption",
           "check_level", "mean_ci_text", "scored", "with_worst", "per_run", "steps_to_target",
           "divergence_count", "status_text"]

#: Per-run hardware columns of :mod:`staleopt.train` records, constant within a run.
HARDWARE_COLUMNS = ("utilization", "memory_ratio_gpipe")


def check_level(level: float) -> float:
    """``level`` if it lies in (0, 1), else a :class:`ConfigError` saying so."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < level < 1.0:
        raise ConfigError(f"level must lie in (0, 1), e.g. 0.95 for 95% intervals; got {level!r}")
    return float(level)


def _values(values: Iterable[float]):
    """The values that count: every number but NaN (a missing value); ``inf`` counts (a diverged run's)."""
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def _mean_std(xs: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; NaN for one value) of finite ``xs``, without overflow where
    the values are near a float's limit (a diverged run's perplexity of 1e170: its square is beyond a float)."""
    n = len(xs)
    mean = sum(xs) / n
    if not math.isfinite(mean):
        mean = sum(x / n for x in xs)
    if n < 2:
        return mean, math.nan
    try:
        s = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    except OverflowError:
        s = math.inf
    if not math.isfinite(s):  # scaled by the largest value: s / c is computed from values of size <= 1
        c = max(abs(x) for x in xs)
        ys = [x / c for x in xs]
        m = sum(ys) / n
        s = c * math.sqrt(sum((y - m) ** 2 for y in ys) / (n - 1))
    return mean, s


def t_interval(values: Iterable[float], level: float = 0.95) -> Tuple[float, float, int]:
    """``(mean, half_width, n)`` of the Student-t confidence interval over the ``values`` but NaN (missing).

    ``half_width = t_{(1+level)/2, n-1} * s / sqrt(n)`` with ``s`` the sample
    standard deviation (ddof 1); NaN when ``n < 2``. An infinite value (a diverged
    run's perplexity) counts: the mean is infinite and the half-width NaN.
    """
    from scipy import stats
    check_level(level)
    xs = _values(values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    if not all(math.isfinite(x) for x in xs):
        return sum(xs) / n, math.nan, n
    mean, s = _mean_std(xs)
    if n < 2:
        return mean, math.nan, n
    return mean, float(stats.t.ppf((1 + level) / 2, n - 1)) * s / math.sqrt(n), n


#: Fewer values than this are summarized by their range, not a Student-t interval (module docstring).
MIN_SEEDS_FOR_T = 4
#: The bounds of an accuracy.
ACCURACY = (0.0, 1.0)


def interval(values: Iterable[float], level: float = 0.95,
             bounds: Optional[Tuple[float, float]] = ACCURACY) -> Tuple[float, float, float, int, str]:
    """``(mean, lo, hi, n, kind)`` of the ``values`` but NaN: ``kind`` ``"t"`` (the ``level`` Student-t interval
    within ``bounds``; ``None``: unbounded) when ``n >= MIN_SEEDS_FOR_T``, else ``"range"`` (``[min, max]``).
    An infinite value makes the mean infinite and the interval the range (``[312.4, inf]``: no t-interval
    holds an infinite mean). ``n = 0`` gives NaNs."""
    xs = _values(values)
    mean, half, n = t_interval(xs, level)
    if n == 0:
        return math.nan, math.nan, math.nan, 0, "range"
    if n < MIN_SEEDS_FOR_T or not math.isfinite(mean):
        return mean, min(xs), max(xs), n, "range"
    lo, hi = mean - half, mean + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return mean, lo, hi, n, "t"


def interval_text(mean: float, lo: float, hi: float, digits: int = 3) -> str:
    """``"0.947 [0.931, 0.960]"``; ``"0.947"`` when ``lo == hi`` or either is NaN; ``"-"`` for a NaN mean;
    ``"inf [312.40, inf]"`` where a value was infinite."""
    if isinstance(mean, float) and math.isnan(mean):
        return "-"
    if math.isnan(lo) or math.isnan(hi) or lo == hi:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def interval_caption(seeds, level: float = 0.95, bounds: Optional[Tuple[float, float]] = ACCURACY,
                     unit: str = "seed") -> str:
    """What :func:`interval` gives for groups of ``seeds`` values (clipped to ``bounds``), in words for a table
    or axis label. ``seeds``: one count, or every cell's (a table whose cells have 3 and 5 runs shows ranges
    and t-intervals: the caption says which). ``unit``: what a value is, ``"run"`` where a cell pools the
    runs of several configurations (not seeds of one)."""
    sizes = sorted({int(n) for n in ([seeds] if isinstance(seeds, numbers.Integral) else seeds)})
    if not sizes:
        raise ConfigError("interval_caption needs at least one cell's number of seeds")

    def over(ns):
        lo, hi = ns[0], ns[-1]
        return f"{lo} {unit}{'s' if hi != 1 else ''}" if lo == hi else f"{lo}-{hi} {unit}s"
    few, many = [n for n in sizes if n < MIN_SEEDS_FOR_T], [n for n in sizes if n >= MIN_SEEDS_FOR_T]
    within = f" within [{bounds[0]:g}, {bounds[1]:g}]" if bounds is not None else ""
    t = f"[{level:.0%} t-interval{within}]"
    if not many:
        return f"mean [min, max] over {over(few)}"
    if not few:
        return f"mean {t} over {over(many)}"
    return f"mean {t} over {over(many)}, [min, max] where a cell has {over(few)}"


def steps_to_target(run_records: pd.DataFrame, target: float, metric=None) -> float:
    """Optimizer steps at the end of the first epoch whose ``metric`` reaches ``target`` (``>=``; ``<=`` when
    lower is better: :meth:`~staleopt.metrics.Metric.reached`); NaN if none reaches it. ``metric``: a
    :class:`~staleopt.metrics.Metric` or record column, default the records' task's.

    Evaluation happens once per epoch, so this is the step count of that epoch's
    record (an upper bound on the exact first step at the target, tight to one epoch).
    """
    metric = metrics.of(run_records, metric)
    if not math.isfinite(target):
        raise ConfigError(f"the target {metric.label} must be a finite number, got {target!r}")
    r = run_records.sort_values("epoch")
    hit = r[metric.reached(r[metric.column], target)]
    return float(hit["step"].iloc[0]) if len(hit) else math.nan


def scored(value: float, diverged: bool, metric) -> float:
    """``value``, or the ``metric``'s worst where a diverged run has no value (a NaN loss: module docstring)."""
    return metric.worst if diverged and math.isnan(value) else value


def with_worst(records: pd.DataFrame, metric=None) -> pd.DataFrame:
    """``records`` with :func:`scored` applied to the ``metric`` column (default the records' task's) of every
    diverged record: what the curves of the figures average, as the tables do."""
    metric = metrics.of(records, metric)
    bad = (records["status"] == "diverged") & records[metric.column].isna()
    if not bad.any():
        return records
    out = records.copy()
    out.loc[bad, metric.column] = metric.worst
    return out


def per_run(records: pd.DataFrame, keys: Sequence[str], target: Optional[float] = None,
            metric=None) -> pd.DataFrame:
    """One row per run: ``run``, ``keys``, ``seed``, the metric's best and final value (``best_acc``,
    ``final_acc`` for accuracy; :attr:`~staleopt.metrics.Metric.best_column`), ``final_loss`` (the last
    training loss), ``epochs_run``, ``steps_run``, ``diverged`` (bool), the hardware columns present in the
    records, ``best_loss`` and ``excess_loss`` (lowest ``test_loss`` minus ``best_loss``) where the records
    know the dataset's best loss and, given ``target``, ``steps_to_target`` (:func:`steps_to_target`).
    ``metric``: a :class:`~staleopt.metrics.Metric` or record column, default the records' task's."""
    metric = metrics.of(records, metric)
    missing = [c for c in ("run", "epoch", metric.column, "status") if c not in records.columns]
    if missing:
        raise ConfigError(f"records lack the columns {missing}; pass the records of staleopt.sweep.collect")
    floor = "best_loss" in records.columns and bool(records["best_loss"].notna().any())
    records = with_worst(records, metric)  # a diverged run's missing value: the worst (module docstring)
    rows = []
    for run, r in records.sort_values(["run", "epoch"]).groupby("run", sort=False):
        last = r.iloc[-1]
        row = {"run": run, **{k: last[k] for k in keys}}
        if "seed" in r.columns and "seed" not in keys:
            row["seed"] = last["seed"]
        diverged = last["status"] == "diverged"
        row.update({metric.best_column: metric.best(r[metric.column]), metric.final_column: last[metric.column],
                    "final_loss": scored(float(last["train_loss"]), diverged, metrics.TEST_LOSS)
                    if "train_loss" in r.columns else math.nan,
                    "epochs_run": len(r), "steps_run": last["step"] if "step" in r.columns else math.nan,
                    "diverged": diverged})
        row.update({c: last[c] for c in HARDWARE_COLUMNS if c in r.columns})
        if floor:
            row.update({"best_loss": last["best_loss"], "excess_loss": scored(
                r["test_loss"].min() - last["best_loss"], diverged, metrics.TEST_LOSS)})
        if target is not None:
            row["steps_to_target"] = steps_to_target(r, target, metric)
        rows.append(row)
    return pd.DataFrame(rows)


def divergence_count(diverged: Iterable[bool]) -> Tuple[int, int]:
    """``(diverged runs, runs)`` of a group's ``diverged`` flags."""
    flags = [bool(d) for d in diverged]
    return sum(flags), len(flags)


def status_text(diverged: int, runs: int) -> str:
    """``"ok"``, ``"diverged"`` (all) or ``"k/n diverged"``."""
    return "ok" if diverged == 0 else "diverged" if diverged == runs else f"{diverged}/{runs} diverged"


def mean_ci_text(values: Iterable[float], level: float = 0.95, digits: int = 3,
                 bounds: Optional[Tuple[float, float]] = ACCURACY) -> str:
    """:func:`interval` as text: ``"0.947 [0.931, 0.960]"``, ``"0.947"`` from one value, ``"-"`` from none."""
    mean, lo, hi, _, _ = interval(list(values), level, bounds)
    return interval_text(mean, lo, hi, digits)

