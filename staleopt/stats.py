"""Statistics over a sweep's runs, in one place: the sweep summary, the figures and the demo's claims use them.

Records are the per-epoch rows of :func:`staleopt.sweep.collect` (one row per
``(run, epoch)``, config keys as columns). A run's numbers:

* ``best_acc`` — the largest ``test_acc`` over its epochs (PipeMare App. C
  reports the best test accuracy across epochs); ``final_acc`` — the last
  epoch's; ``diverged`` — its last record has ``status == "diverged"``
  (the run stopped there; it stays in every mean, never dropped);
* ``steps_to_target`` — the optimizer step count at the end of the first epoch
  whose ``test_acc`` reaches a target (NaN when no epoch does), the measured
  half of PipeMare's time-to-accuracy (§4, Table 2; :mod:`staleopt.speedup`).

Across seeds: the mean and the Student-t interval ``t_{(1+level)/2, n-1} s / sqrt(n)``.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Tuple

import pandas as pd

from .errors import ConfigError

__all__ = ["HARDWARE_COLUMNS", "t_interval", "check_level", "mean_ci_text", "per_run", "steps_to_target",
           "divergence_count", "status_text"]

#: Per-run hardware columns of :mod:`staleopt.train` records, constant within a run.
HARDWARE_COLUMNS = ("utilization", "memory_ratio_gpipe")


def check_level(level: float) -> float:
    """``level`` if it lies in (0, 1), else a :class:`ConfigError` saying so."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < level < 1.0:
        raise ConfigError(f"level must lie in (0, 1), e.g. 0.95 for 95% intervals; got {level!r}")
    return float(level)


def t_interval(values: Iterable[float], level: float = 0.95) -> Tuple[float, float, int]:
    """``(mean, half_width, n)`` of the Student-t confidence interval over the finite ``values``.

    ``half_width = t_{(1+level)/2, n-1} * s / sqrt(n)`` with ``s`` the sample
    standard deviation (ddof 1); NaN when ``n < 2``.
    """
    from scipy import stats
    check_level(level)
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, n
    s = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, float(stats.t.ppf((1 + level) / 2, n - 1)) * s / math.sqrt(n), n


def steps_to_target(run_records: pd.DataFrame, target: float) -> float:
    """Optimizer steps at the end of the first epoch whose ``test_acc >= target``; NaN if none reaches it.

    Evaluation happens once per epoch, so this is the step count of that epoch's
    record (an upper bound on the exact first step at the target, tight to one epoch).
    """
    if not math.isfinite(target):
        raise ConfigError(f"the target accuracy must be a finite number, got {target!r}")
    r = run_records.sort_values("epoch")
    hit = r[r["test_acc"] >= target]
    return float(hit["step"].iloc[0]) if len(hit) else math.nan


def per_run(records: pd.DataFrame, keys: Sequence[str], target: Optional[float] = None) -> pd.DataFrame:
    """One row per run: ``run``, ``keys``, ``seed``, ``best_acc``, ``final_acc``, ``final_loss``,
    ``epochs_run``, ``steps_run``, ``diverged`` (bool), the hardware columns present in the records and,
    given ``target``, ``steps_to_target`` (:func:`steps_to_target`)."""
    missing = [c for c in ("run", "epoch", "test_acc", "status") if c not in records.columns]
    if missing:
        raise ConfigError(f"records lack the columns {missing}; pass the records of staleopt.sweep.collect")
    rows = []
    for run, r in records.sort_values(["run", "epoch"]).groupby("run", sort=False):
        last = r.iloc[-1]
        row = {"run": run, **{k: last[k] for k in keys}}
        if "seed" in r.columns and "seed" not in keys:
            row["seed"] = last["seed"]
        row.update({"best_acc": r["test_acc"].max(), "final_acc": last["test_acc"],
                    "final_loss": last["train_loss"] if "train_loss" in r.columns else math.nan,
                    "epochs_run": len(r), "steps_run": last["step"] if "step" in r.columns else math.nan,
                    "diverged": last["status"] == "diverged"})
        row.update({c: last[c] for c in HARDWARE_COLUMNS if c in r.columns})
        if target is not None:
            row["steps_to_target"] = steps_to_target(r, target)
        rows.append(row)
    return pd.DataFrame(rows)


def divergence_count(diverged: Iterable[bool]) -> Tuple[int, int]:
    """``(diverged runs, runs)`` of a group's ``diverged`` flags."""
    flags = [bool(d) for d in diverged]
    return sum(flags), len(flags)


def status_text(diverged: int, runs: int) -> str:
    """``"ok"``, ``"diverged"`` (all) or ``"k/n diverged"``."""
    return "ok" if diverged == 0 else "diverged" if diverged == runs else f"{diverged}/{runs} diverged"


def mean_ci_text(values: Iterable[float], level: float = 0.95, digits: int = 3) -> str:
    """``"0.947±0.012"`` (mean ± half-width), ``"0.947"`` from one value, ``"-"`` from none."""
    mean, half, n = t_interval(values, level)
    if n == 0:
        return "-"
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f}±{half:.{digits}f}"

