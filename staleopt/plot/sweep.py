"""Figures of a sweep: PipeMare Figure 2 (utilization, memory, accuracy vs stages) and Fig. 7/8 curves.

Both take the records of :func:`staleopt.sweep.collect` (or a sweep
directory) and return a matplotlib ``Figure`` (no pyplot: ``savefig`` renders
with Agg). Lines are one per method (and per any other config key the sweep
varies, seeds pooled); each method keeps its color across panels and figures.

* :func:`plot_accuracy_vs_stages`: three panels against the number of stages
  ``P`` (PipeMare Fig. 2, 3): pipeline utilization, weight + optimizer memory
  relative to GPipe, and test accuracy (by default the best over epochs, as
  PipeMare App. C reports it) as the mean over seeds with a Student-t
  confidence band (:func:`staleopt.stats.t_interval`). Diverged runs stay in
  the mean and are also drawn as ``x`` markers at their own value; a point
  with a diverged run has no band (its interval would span the plot).
  A fourth panel gives the time-to-accuracy view (PipeMare §4, Table 2):
  each method's speedup to a target accuracy over GPipe at the same ``P``
  (:func:`staleopt.speedup.speedup_table`), drawn where every seed reached it.
* :func:`plot_accuracy_vs_epoch`: test accuracy against epochs at one ``P``
  (PipeMare Fig. 7, 8), mean over seeds with its band; a diverged run's last
  epoch is marked ``x``.
* :func:`plot_accuracy_vs_time`: test accuracy against simulated pipeline time
  at one ``P`` (PipeMare Fig. 11, "normalized time"): each epoch at
  ``T(step) = step / utilization`` (:func:`staleopt.speedup.with_pipeline_time`),
  with the target accuracy as a dashed line.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from .. import speedup, stats
from ..errors import ConfigError

__all__ = ["METHOD_ORDER", "per_run", "line_keys", "describe", "plot_accuracy_vs_stages", "plot_accuracy_vs_epoch",
           "plot_accuracy_vs_time", "save"]

#: Legend order of the papers' methods (others follow alphabetically).
METHOD_ORDER = ("gpipe", "pipedream-flush", "pipedream", "pipedream-vs", "pipedream-2bw", "pipemare-stash",
                "1f1b", "dataflow", "pb", "pb-hybrid", "pipeoptim", "spectrain", "xpipe", "pipemare-t1",
                "pipemare", "pipemare-w")
_METRICS = {"best_acc": "best test accuracy", "final_acc": "final test accuracy"}


def _records(source) -> pd.DataFrame:
    if isinstance(source, pd.DataFrame):
        return source
    from ..sweep import collect
    records = collect(source)
    if records.empty:
        raise ConfigError(f"{source} holds no finished runs: run the sweep first (staleopt sweep FILE --out "
                          f"{source})")
    return records


def _at_stages(records: pd.DataFrame, stages: int) -> pd.DataFrame:
    """The records of the runs with ``P = stages``; a :class:`ConfigError` naming the sweep's stage counts if none."""
    available = sorted(int(p) for p in records["stages"].unique())
    if int(stages) not in available:
        raise ConfigError(f"the sweep has no runs with stages={stages}; it has stages {available}")
    return records[records["stages"].astype(int) == int(stages)]


def line_keys(records: pd.DataFrame) -> List[str]:
    """Config keys that tell lines apart: ``method`` and every other varying key but ``stages``, ``seed``."""
    from ..config import field_names
    from ..sweep import varies
    varying = [k for k in field_names() if k in records.columns and k not in ("method", "stages", "seed")
               and varies(records[k])]
    return ["method"] + varying


def describe(source) -> str:
    """A title read off the records' configs, never typed in: ``"resnet1d on mnist1d, 20 epochs, 3 seeds"``
    (a key the runs disagree on lists its values: ``"5-20 epochs"``; a ``max_steps`` cap is said)."""
    records = _records(source)
    runs = records.groupby("run", sort=False).first()

    def values(key):
        return [str(v) for v in dict.fromkeys(runs[key])] if key in runs.columns else []
    parts = [f"{'/'.join(values('model')) or 'model ?'} on {'/'.join(values('data')) or 'data ?'}"]
    if "epochs" in runs.columns:
        lo, hi = int(runs["epochs"].min()), int(runs["epochs"].max())
        parts.append(f"{lo} epoch{'s' if hi > 1 else ''}" if lo == hi else f"{lo}-{hi} epochs")
    if "max_steps" in runs.columns and runs["max_steps"].notna().any():
        parts.append(f"at most {int(runs['max_steps'].max())} steps")
    if "seed" in runs.columns:
        seeds = runs.groupby([k for k in line_keys(records) + ["stages"] if k in runs.columns])["seed"].nunique()
        lo, hi = int(seeds.min()), int(seeds.max())
        parts.append(f"{lo} seed{'s' if hi > 1 else ''}" if lo == hi else f"{lo}-{hi} seeds")
    return ", ".join(parts)


def per_run(source, target: Optional[float] = None) -> pd.DataFrame:
    """One row per run (:func:`staleopt.stats.per_run`): its line keys, ``stages``, ``seed``, ``best_acc``,
    ``final_acc``, ``epochs_run``, ``diverged`` (bool), the hardware columns (constant within a run) and,
    given ``target``, ``steps_to_target``."""
    records = _records(source)
    table = stats.per_run(records, [*line_keys(records), "stages"], target=target)
    table["stages"] = table["stages"].astype(int)
    return table


def _order(labels) -> List:
    def rank(label):
        method = label[0] if isinstance(label, tuple) else label
        return (METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER), str(label))
    return sorted(labels, key=rank)


def _lines(table: pd.DataFrame, keys: Sequence[str], methods: Optional[Sequence[str]]):
    """``[(label, style, rows)]`` in legend order; ``style`` (color, marker, line style) follows that order."""
    from matplotlib import colormaps
    if methods is not None:
        missing = sorted(set(methods) - set(table["method"]))
        if missing:
            raise ConfigError(f"methods {missing} are not in the sweep; it has {sorted(set(table['method']))}")
        table = table[table["method"].isin(methods)]
    groups = dict(list(table.groupby(list(keys), sort=False, dropna=False)))
    groups = {k if isinstance(k, tuple) else (k,): v for k, v in groups.items()}
    cmap = colormaps["tab10"] if len(groups) <= 10 else colormaps["tab20"]
    out = []
    for i, key in enumerate(_order(groups)):
        label = key[0] + "".join(f" {k}={v}" for k, v in zip(keys[1:], key[1:]))
        style = {"color": cmap(i % cmap.N), "marker": "osD^v<>ph"[i % 9], "linestyle": ("-", "--", "-.", ":")[i % 4]}
        out.append((label, style, groups[key]))
    return out


def _band(ax, x, values_by_x, style, label, level, markersize=4, banded=None):
    """Mean line of each ``x``'s values with its Student-t band (none where fewer than 2 values, or where
    ``banded`` is false: a group with a diverged run, whose interval would only say that runs differ)."""
    intervals = [stats.t_interval(v, level) for v in values_by_x]
    mean = np.array([s[0] for s in intervals])
    half = np.array([0.0 if np.isnan(s[1]) or (banded is not None and not banded[i]) else s[1]
                     for i, s in enumerate(intervals)])
    ax.plot(x, mean, ms=markersize, lw=1.5, label=label, **style)
    if np.any(half > 0):
        ax.fill_between(x, mean - half, mean + half, color=style["color"], alpha=0.1, lw=0)


def _legend(ax, diverged: bool):
    """Handles and labels of ``ax``, plus one neutral "diverged run" marker when some run diverged."""
    from matplotlib.lines import Line2D
    handles, labels = ax.get_legend_handles_labels()
    if diverged:
        handles.append(Line2D([], [], color="0.2", marker="x", linestyle="none", markersize=7))
        labels.append("diverged run")
    return handles, labels


def _mark_diverged(ax, x, y, color):
    ax.scatter(x, y, marker="x", s=60, color=color, zorder=5, label="_diverged")


def _stage_axis(ax, stages):
    ax.set_xscale("log", base=2)
    ax.set_xticks(stages)
    ax.set_xticklabels([str(s) for s in stages])
    ax.minorticks_off()
    ax.set_xlabel("pipeline stages P")
    ax.grid(alpha=0.3)


def plot_accuracy_vs_stages(source, metric: str = "best_acc", level: float = 0.95,
                            methods: Optional[Sequence[str]] = None, title: Optional[str] = None,
                            target: Optional[float] = None, figsize: Optional[Tuple[float, float]] = None):
    """PipeMare Fig. 2 layout: utilization, memory (x GPipe) and ``metric`` against ``P``, one line per method,
    and, when the sweep has GPipe runs, the speedup to ``target`` accuracy over GPipe.

    ``metric``: ``"best_acc"`` (max over epochs) or ``"final_acc"`` (last
    epoch); the band is the ``level`` Student-t interval over seeds. Each
    diverged run is also an ``x`` at its own value; nothing is dropped.
    ``target``: default :func:`staleopt.speedup.default_target` (GPipe's mean
    best accuracy minus 0.01); a point of the speedup panel is drawn only where
    every seed of the method and of GPipe reached it.
    """
    from matplotlib.figure import Figure
    if metric not in _METRICS:
        raise ConfigError(f"metric must be one of {list(_METRICS)}, got {metric!r}")
    records = _records(source)
    table, keys = per_run(records), line_keys(records)
    stages = sorted(table["stages"].unique())
    timed = "gpipe" in set(records["method"]) and "microbatches" in records.columns
    if timed:
        target = speedup.default_target(records) if target is None else target
        fast = speedup.speedup_table(records, target, keys=[*keys, "stages"])
        fast = fast[(fast["reached"] == fast["runs"]) & fast["speedup"].notna()]
    fig = Figure(figsize=figsize or ((17.0 if timed else 13.0), 3.8), layout="constrained")
    axes = fig.subplots(1, 4 if timed else 3)
    diverged = False
    for label, style, rows in _lines(table, keys, methods):
        by_p = [rows[rows["stages"] == p] for p in stages]
        xs = [p for p, r in zip(stages, by_p) if len(r)]
        by_p = [r for r in by_p if len(r)]
        axes[0].plot(xs, [r["utilization"].mean() for r in by_p], ms=4, label=label, **style)
        axes[1].plot(xs, [r["memory_ratio_gpipe"].mean() for r in by_p], ms=4, label=label, **style)
        _band(axes[2], xs, [r[metric] for r in by_p], style, label, level,
              banded=[not r["diverged"].any() for r in by_p])
        ok = rows[~rows["diverged"]]
        axes[2].scatter(ok["stages"], ok[metric], s=8, color=style["color"], alpha=0.5, lw=0, label="_seed")
        bad = rows[rows["diverged"]]
        if len(bad):
            _mark_diverged(axes[2], bad["stages"], bad[metric], style["color"])
            diverged = True
        if timed:
            mine = fast.merge(rows[keys].drop_duplicates(), on=keys).sort_values("stages")
            axes[3].plot(mine["stages"], mine["speedup"], ms=4, label=label, **style)
    if timed:
        axes[3].set_yscale("log", base=2)
        axes[3].set_ylabel(f"speedup to accuracy {target:.3f} (x GPipe)")
        axes[3].set_title("time to accuracy (pipeline time)", fontsize=10)
    for ax in axes:
        _stage_axis(ax, stages)
    axes[0].set_ylabel("pipeline utilization")
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylabel("weight + optimizer memory (x GPipe)")
    axes[2].set_ylabel(f"{_METRICS[metric]} (mean, {level:.0%} CI; dots: runs)")
    axes[2].set_ylim(0.0, 1.0)  # accuracy; a t-interval over few seeds can reach past [0, 1]
    axes[0].set_title("throughput", fontsize=10)
    axes[1].set_title("memory", fontsize=10)
    axes[2].set_title("model quality", fontsize=10)
    fig.legend(*_legend(axes[2], diverged), loc="outside right center", fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def plot_accuracy_vs_epoch(source, stages: int, level: float = 0.95, methods: Optional[Sequence[str]] = None,
                           title: Optional[str] = None, figsize: Tuple[float, float] = (6.5, 4.0)):
    """Test accuracy against epochs at ``P = stages`` (PipeMare Fig. 7/8), mean over seeds with a band.

    The mean at each epoch is over the runs that reached it; a run that
    diverged is marked ``x`` at its last recorded epoch.
    """
    from matplotlib.figure import Figure
    records = _records(source)
    at = _at_stages(records, stages)
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    diverged = _accuracy_curves(ax, at, line_keys(records), methods, "epoch", level)
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"test accuracy (mean, {level:.0%} CI)")
    ax.set_title(title or f"P = {stages}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(0.0, 1.0)
    ax.legend(*_legend(ax, diverged), fontsize=8, frameon=False)
    return fig


def _accuracy_curves(ax, at: pd.DataFrame, keys: List[str], methods, x: str, level: float) -> bool:
    """One band per line: test accuracy per epoch against the seeds' mean of column ``x`` at that epoch
    (``"epoch"`` or ``"pipeline_time"``); a diverged run's last epoch is marked ``x``. True if any diverged."""
    diverged = False
    runs_table = at.groupby("run", sort=False).first().reset_index()
    for label, style, rows in _lines(runs_table, keys, methods):
        mine = at[at["run"].isin(rows["run"])]
        epochs = sorted(mine["epoch"].unique())
        xs = epochs if x == "epoch" else [mine.loc[mine["epoch"] == e, x].mean() for e in epochs]
        _band(ax, xs, [mine.loc[mine["epoch"] == e, "test_acc"] for e in epochs], style, label, level,
              markersize=3)
        ends = mine.sort_values("epoch").groupby("run").tail(1)
        bad = ends[ends["status"] == "diverged"]
        if len(bad):
            _mark_diverged(ax, bad[x], bad["test_acc"], style["color"])
            diverged = True
    return diverged


def plot_accuracy_vs_time(source, stages: int, target: Optional[float] = None, level: float = 0.95,
                          methods: Optional[Sequence[str]] = None, title: Optional[str] = None,
                          figsize: Tuple[float, float] = (6.5, 4.0)):
    """Test accuracy against simulated pipeline time at ``P = stages`` (PipeMare Fig. 11), mean over seeds.

    Each epoch sits at the seeds' mean ``T(step)`` (fully utilized minibatch
    times, :func:`staleopt.speedup.with_pipeline_time`): GPipe's points are
    ``(N + P - 1) / N`` times further right than an asynchronous method's. The
    dashed line is ``target`` (default: GPipe's mean best accuracy minus 0.01,
    when the sweep has GPipe runs); a diverged run's last epoch is marked ``x``.
    """
    from matplotlib.figure import Figure
    records = _records(source)
    at = speedup.with_pipeline_time(_at_stages(records, stages))
    if target is None and "gpipe" in set(records["method"]):
        target = speedup.default_target(records)
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    diverged = _accuracy_curves(ax, at, line_keys(records), methods, "pipeline_time", level)
    if target is not None:
        ax.axhline(target, color="0.4", lw=1, ls="--", label=f"target {target:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("pipeline time (minibatches of a fully utilized pipeline)")
    ax.set_ylabel(f"test accuracy (mean, {level:.0%} CI)")
    ax.set_title(title or f"time to accuracy, P = {stages}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(0.0, 1.0)
    ax.legend(*_legend(ax, diverged), fontsize=8, frameon=False)
    return fig


def save(fig, path: Union[str, os.PathLike], dpi: int = 150) -> str:
    """Write ``fig`` to ``path`` (format from the suffix), creating folders; returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
