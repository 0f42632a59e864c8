"""What a run is judged by: one :class:`Metric` per task, read from the records, never a hard-coded column.

Every consumer of training records (the sweep summary, time to a target, the claims, the figures, the
reproduction ledger) ranks runs by a test metric of the records (:mod:`staleopt.train`). Which one is the
task's:

===============  =============  ==================  =========================================
task             metric         better              interval bounds
===============  =============  ==================  =========================================
classification   ``test_acc``   higher              [0, 1] (an interval is clipped there)
lm               ``test_ppl``   lower               none (``test_loss`` also available)
regression       ``test_loss``  lower               none
===============  =============  ==================  =========================================

``test_ppl = exp(test_loss)`` with the loss in nats per token (NaN for the other tasks), so the two LM
metrics rank runs alike. A run's *best* value over epochs is the maximum of a higher-is-better metric and
the minimum of a lower-is-better one.

**Gaps.** A difference between a method and a baseline is a *gain*: :meth:`Metric.gain` ``(value,
baseline)`` is ``value - baseline`` when higher is better and ``baseline - value`` when lower is, so a
positive gap always means "better than the baseline", in the metric's own units (accuracy points,
perplexity, nats). Claims, the ledger's rules and their trends all read gains; for accuracy a gain is the
plain difference, as before.

**Which task.** The records carry it by their values (:func:`task_of`): :mod:`staleopt.train` writes
``test_ppl`` NaN for every task but language modelling (whose ``test_acc`` is the next-token accuracy)
and ``test_acc`` NaN for regression. Records with a value of ``test_ppl`` (``inf`` counts: a diverged LM
run) are a language model's, else records with a value of ``test_acc`` are classification, else records
with ``test_loss`` are regression; records older than ``test_ppl`` (or with no value at all) are read as
classification, what they were. A run that diverged with no test loss at all (NaN from its first evaluation)
says nothing of its task (an LM's next-token accuracy is a value, its perplexity NaN in records older than the
``inf`` rule, :mod:`staleopt.stats`): it takes the other runs'. Records that mix tasks (a sweep over a
classification and an LM dataset) have no one metric: name it (``metric=``, ``--metric``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple, Union

import pandas as pd

from .errors import ConfigError

__all__ = ["Metric", "ACCURACY", "PERPLEXITY", "TEST_LOSS", "METRICS", "TASKS", "get", "for_task", "task_of",
           "of", "per_run_column"]


@dataclass(frozen=True)
class Metric:
    """A test metric of the records: its ``column``, how tables and axes name it, and which way is better.

    ``name`` names its per-run columns (:attr:`best_column`, :attr:`final_column`); ``noun``: the metric in
    running text ("time to accuracy 0.850", "time to perplexity 12.00"); ``bounds`` is the range
    an interval of its means is clipped to (``None``: unbounded, never clipped); ``digits``: decimals in
    tables; ``unit``: the word after a threshold in a claim (``"within 0.50 perplexity"``; empty for an
    accuracy, whose thresholds are plain fractions).
    """

    column: str
    name: str
    label: str
    noun: str
    higher_is_better: bool
    bounds: Optional[Tuple[float, float]]
    digits: int
    unit: str = ""
    #: the values the metric can take where it has no :attr:`bounds` (a perplexity >= 1, a loss >= 0): the
    #: intervals of tables and figures stay inside them (:attr:`limits`), nothing else reads them
    domain: Optional[Tuple[float, float]] = None

    @property
    def limits(self) -> Optional[Tuple[float, float]]:
        """What an interval over seeds is clipped to: :attr:`bounds`, else :attr:`domain`."""
        return self.bounds if self.bounds is not None else self.domain

    @property
    def best_column(self) -> str:
        """Per-run column of the best value over epochs: ``best_acc``, ``best_ppl``, ``best_test_loss``."""
        return f"best_{self.name}"

    @property
    def final_column(self) -> str:
        """Per-run column of the last epoch's value: ``final_acc``, ``final_ppl``, ``final_test_loss``."""
        return f"final_{self.name}"

    def best(self, values: Iterable[float]) -> float:
        """The best of ``values`` (max, or min when lower is better), NaNs skipped; NaN when none is left."""
        s = pd.Series(list(values), dtype=float).dropna()
        if s.empty:
            return math.nan
        return float(s.max() if self.higher_is_better else s.min())

    @property
    def worst(self) -> float:
        """The worst value: the lower bound of a bounded higher-is-better metric (accuracy 0), else the
        infinity on the worse side (a perplexity or a loss of ``inf``)."""
        if self.higher_is_better:
            return self.bounds[0] if self.bounds is not None else -math.inf
        return self.bounds[1] if self.bounds is not None else math.inf

    def gain(self, value: float, baseline: float) -> float:
        """How much better ``value`` is than ``baseline``: positive means better (module docstring); 0 where they
        are equal, also both ``inf`` (two diverged runs: neither is better)."""
        if value == baseline:
            return 0.0
        return value - baseline if self.higher_is_better else baseline - value

    def reached(self, values: pd.Series, target: float) -> pd.Series:
        """Which ``values`` are at or beyond ``target`` on the better side (``>=``, or ``<=`` when lower is
        better)."""
        return values >= target if self.higher_is_better else values <= target

    def worse_by(self, value: float, margin: float) -> float:
        """``value`` made worse by ``margin``: ``value - margin`` for a bounded metric (accuracy points),
        ``value * (1 + margin)`` for an unbounded one (a relative margin: 1% of a perplexity or a loss, whose
        scale differs from one dataset to the next)."""
        if self.bounds is not None:
            return value - margin if self.higher_is_better else value + margin
        return value / (1 + margin) if self.higher_is_better else value * (1 + margin)

    def format(self, value: float) -> str:
        """``value`` with the metric's :attr:`digits`."""
        return f"{value:.{self.digits}f}"

    def amount(self, value: float) -> str:
        """A threshold in words: ``"0.02"`` for an accuracy, ``"0.50 perplexity"``."""
        return f"{value:.2f}" + (f" {self.unit}" if self.unit else "")


#: Test accuracy (classification): higher is better, a fraction in [0, 1].
ACCURACY = Metric("test_acc", "acc", "test accuracy", "accuracy", True, (0.0, 1.0), 3)
#: Test perplexity ``exp(test_loss)`` (language models): lower is better, unbounded above.
PERPLEXITY = Metric("test_ppl", "ppl", "test perplexity", "perplexity", False, None, 2, "perplexity",
                    (1.0, math.inf))
#: Test loss (regression's metric; the LM's loss in nats per token): lower is better.
TEST_LOSS = Metric("test_loss", "test_loss", "test loss", "test loss", False, None, 3, "nats", (0.0, math.inf))
#: Every metric by its record column.
METRICS: Dict[str, Metric] = {m.column: m for m in (ACCURACY, PERPLEXITY, TEST_LOSS)}
#: The primary metric of each task (:attr:`staleopt.data.Data.task`).
TASKS: Dict[str, Metric] = {"classification": ACCURACY, "lm": PERPLEXITY, "regression": TEST_LOSS}


#: The metrics each task's runs record (:func:`staleopt.train.evaluate`; the others are NaN).
TASK_METRICS: Dict[str, Tuple[str, ...]] = {"classification": ("test_acc", "test_loss"),
                                            "lm": ("test_ppl", "test_acc", "test_loss"), "regression": ("test_loss",)}


def planned(task: Optional[str], metric: Union[Metric, str, None] = None) -> Optional[Metric]:
    """The metric runs of ``task`` will be judged by, known before they train: ``metric`` (:func:`get`), refused
    when ``task``'s runs do not record it, else the task's primary one; None when both are unknown (a user's
    dataset, whose task is known once loaded)."""
    if metric is not None:
        m = get(metric)
        if task is not None and m.column not in TASK_METRICS[task]:
            raise ConfigError(f"a {task} run records no {m.label} ({m.column!r}): pass one of "
                              f"{', '.join(TASK_METRICS[task])} (metric=, --metric)")
        return m
    return for_task(task) if task is not None else None


def get(metric: Union[Metric, str]) -> Metric:
    """A :class:`Metric` from itself or its record column (``"test_acc"``, ``"test_ppl"``, ``"test_loss"``)."""
    if isinstance(metric, Metric):
        return metric
    if metric not in METRICS:
        raise ConfigError(f"unknown metric {metric!r}; metrics (record columns): {', '.join(METRICS)}")
    return METRICS[metric]


def for_task(task: str) -> Metric:
    """The primary metric of ``task`` (:data:`TASKS`)."""
    if task not in TASKS:
        raise ConfigError(f"no metric for task {task!r}; tasks: {', '.join(TASKS)}")
    return TASKS[task]


def _has_values(records: pd.DataFrame, column: str) -> bool:
    return column in records.columns and bool(pd.to_numeric(records[column], errors="coerce").notna().any())


def task_of(records: pd.DataFrame, empty: str = "classification") -> str:
    """The task of ``records`` by their values (module docstring); :class:`ConfigError` when they mix tasks.
    ``empty``: the task of records with no value at all (a run that diverged at its first evaluation)."""
    runs = records.groupby("run", sort=False) if "run" in records.columns and len(records) else [(None, records)]
    found = []
    for _, r in runs:
        if "status" in r.columns and len(r) and r["status"].iloc[-1] == "diverged" \
                and not _has_values(r, "test_loss") and not _has_values(r, "test_ppl"):
            continue  # (module docstring: a run that diverged without a loss takes the other runs' task)
        task = ("lm" if _has_values(r, "test_ppl") else "classification" if _has_values(r, "test_acc")
                else "regression" if _has_values(r, "test_loss") else None)
        if task is not None and task not in found:
            found.append(task)
    if len(found) > 1:
        raise ConfigError(f"the records mix tasks ({', '.join(found)}), which no one metric ranks; name the metric "
                          f"(metric=, --metric: one of {', '.join(METRICS)}) or split the records by dataset")
    return found[0] if found else empty


def of(records: Optional[pd.DataFrame] = None, metric: Union[Metric, str, None] = None) -> Metric:
    """``metric`` (:func:`get`) when given, else the primary metric of the records' task (:func:`task_of`)."""
    if metric is not None:
        m = get(metric)
        if records is not None and len(records) and not _has_values(records, m.column):
            have = [c for c in METRICS if _has_values(records, c)]
            if have:  # (records with no value at all: runs that diverged at once, any metric is as good)
                raise ConfigError(f"the records have no {m.label} ({m.column!r}): the metric of another task; "
                                  f"these records have {', '.join(have)} (metric=, --metric)")
        return m
    return for_task(task_of(records)) if records is not None else ACCURACY


def per_run_column(column: str) -> Tuple[Metric, str]:
    """``(metric, "best" | "final")`` of a per-run column name such as ``best_acc`` or ``final_ppl``."""
    for m in METRICS.values():
        for which in ("best", "final"):
            if column == f"{which}_{m.name}":
                return m, which
    names = [f"{w}_{m.name}" for m in METRICS.values() for w in ("best", "final")]
    raise ConfigError(f"unknown per-run value {column!r}; one of {', '.join(names)}")
