"""Figures of a sweep: PipeMare Figure 2 (utilization, memory, accuracy vs stages) and Fig. 7/8 curves.

Both take the records of :func:`staleopt.sweep.collect` (or a sweep
directory) and return a matplotlib ``Figure`` (no pyplot: ``savefig`` renders
with Agg). Lines are one per method (and per any other config key the sweep
varies, seeds pooled); each method keeps its color across panels and figures.

Every figure draws the records' metric (:mod:`staleopt.metrics`: test accuracy for
classification, test perplexity for a language model, or the one named by ``metric=``):
its axis label, the interval's bounds ([0, 1] and a [0, 1] axis for an accuracy only)
and the direction of "reaching" a target come from it.

* :func:`plot_accuracy_vs_stages`: three panels against the number of stages
  ``P`` (PipeMare Fig. 2, 3): pipeline utilization, weight + optimizer memory
  relative to GPipe, and test accuracy (by default the best over epochs, as
  PipeMare App. C reports it): the mean over seeds with the interval every
  table uses (:func:`staleopt.stats.interval`, within [0, 1]) and each seed as
  a dot. A fourth panel gives the time-to-accuracy view (PipeMare §4, Table 2):
  each method's speedup to a target accuracy over GPipe at the same ``P``
  (:func:`staleopt.speedup.speedup_table`), labelled ``k/n`` where only ``k`` of
  ``n`` seeds reached it.
* :func:`plot_accuracy_vs_epoch`: test accuracy against epochs at one ``P``
  (PipeMare Fig. 7, 8), the mean over seeds and each seed's own curve.
* :func:`plot_accuracy_vs_time`: test accuracy against simulated pipeline time
  at one ``P`` (PipeMare Fig. 11, "normalized time"): each epoch at
  ``T(step) = step / utilization`` (:func:`staleopt.speedup.with_pipeline_time`),
  with the target accuracy as a dashed line.

One rule for divergence, the tables' and claims' (:mod:`staleopt.stats`): a
diverged run is drawn (``x`` at its last record) and counted in every mean; a
curve carries it at its last value after it stopped (:func:`carried`), so a
curve ends at the table's mean final value. An unbounded metric's axis spans
the runs that did not diverge; a value beyond it (a perplexity of ``inf`` or
``1e170``, and a mean it makes infinite) is marked ``^`` at the axis' edge
(:class:`Edge`), so the figure shows what the table's ``inf`` says. Titles are
read off the records' configs (:func:`describe`), never typed in. Fewer than :data:`CATEGORICAL_BELOW`
stage counts are drawn as categories, not joined as a trend.
"""
from __future__ import annotations

import os
import warnings
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from .. import metrics, speedup, stats
from ..sweep import config_key
from ..errors import ConfigError

__all__ = ["METHOD_ORDER", "CATEGORICAL_BELOW", "per_run", "line_keys", "describe", "carried", "Edge",
           "plot_accuracy_vs_stages", "plot_accuracy_vs_epoch", "plot_accuracy_vs_time", "save"]

#: Legend order of the papers' methods (others follow alphabetically).
METHOD_ORDER = ("gpipe", "pipedream-flush", "pipedream", "pipedream-vs", "pipedream-2bw", "pipemare-stash",
                "1f1b", "dataflow", "pb", "pb-hybrid", "pipeoptim", "spectrain", "xpipe", "pipemare-t1",
                "pipemare", "pipemare-w")


def _records(source) -> pd.DataFrame:
    if isinstance(source, pd.DataFrame):
        return source
    from ..sweep import collect
    records = collect(source)
    if records.empty:
        raise ConfigError(f"{source} holds no finished runs: run the sweep first (staleopt sweep FILE --out "
                          f"{source})")
    return records


def _folder(source):
    """The sweep folder ``source`` names (its report's target is the figures' default), else None."""
    return None if isinstance(source, pd.DataFrame) else source


def _at_stages(records: pd.DataFrame, stages: int) -> pd.DataFrame:
    """The records of the runs with ``P = stages``; a :class:`ConfigError` naming the sweep's stage counts if none."""
    available = sorted(int(p) for p in records["stages"].unique())
    if int(stages) not in available:
        raise ConfigError(f"the sweep has no runs with stages={stages}; it has stages {available}")
    return records[records["stages"].astype(int) == int(stages)]


def line_keys(records: pd.DataFrame) -> List[str]:
    """Config keys that tell lines apart: ``method`` and every other varying key but ``stages``, ``seed``."""
    from ..sweep import varying_keys
    return ["method"] + varying_keys(records)


def describe(source) -> str:
    """A title read off the records' configs, never typed in: ``"resnet1d on mnist1d, 20 epochs, 3 seeds"``
    (a key the runs disagree on lists its values: ``"5-20 epochs"``; a ``max_steps`` cap is said)."""
    records = _records(source)
    runs = records.groupby("run", sort=False).first()

    def values(key):
        return [str(v) for v in dict.fromkeys(runs[key])] if key in runs.columns else []
    model, data = "/".join(values("model")), "/".join(values("data"))
    parts = [f"{model} on {data}" if model and data else model or data]
    if "epochs" in runs.columns:
        lo, hi = int(runs["epochs"].min()), int(runs["epochs"].max())
        parts.append(f"{lo} epoch{'s' if hi > 1 else ''}" if lo == hi else f"{lo}-{hi} epochs")
    if "max_steps" in runs.columns and runs["max_steps"].notna().any():
        parts.append(f"at most {int(runs['max_steps'].max())} steps")
    if "seed" in runs.columns:
        cells = [k for k in line_keys(records) + ["stages"] if k in runs.columns]
        seeds = runs.groupby(cells, dropna=False)["seed"].nunique()  # (a key a method leaves unset is NaN)
        lo, hi = int(seeds.min()), int(seeds.max())
        parts.append(f"{lo} seed{'s' if hi > 1 else ''}" if lo == hi else f"{lo}-{hi} seeds")
    return ", ".join(p for p in parts if p)


def per_run(source, target: Optional[float] = None, metric=None) -> pd.DataFrame:
    """One row per run (:func:`staleopt.stats.per_run`): its line keys, ``stages``, ``seed``, the best and
    final ``metric`` (``best_acc``, ``final_acc``; default the records' task's), ``epochs_run``, ``diverged``
    (bool), the hardware columns (constant within a run) and, given ``target``, ``steps_to_target``."""
    records = _records(source)
    table = stats.per_run(records, [*line_keys(records), "stages"], target=target, metric=metric)
    table["stages"] = table["stages"].astype(int)
    return table


def _order(labels) -> List:
    def rank(label):
        method = label[0] if isinstance(label, tuple) else label
        return (METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER), str(label))
    return sorted(labels, key=rank)


def _lines(table: pd.DataFrame, keys: Sequence[str], methods: Optional[Sequence[str]],
           every: Optional[pd.DataFrame] = None):
    """``[(label, style, rows)]`` in legend order; ``style`` (color, marker, line style) follows a line's place
    among the lines of ``every`` (default ``table``): the records' runs at every P before ``methods`` picks some,
    so a method keeps its look in each figure of one report (the epoch figure draws only the lines at one P)."""
    from matplotlib import colormaps
    if methods is not None:
        missing = sorted(set(methods) - set(table["method"]))
        swept = set((table if every is None else every)["method"])
        if set(missing) - swept:
            raise ConfigError(f"methods {sorted(set(missing) - swept)} are not in the sweep; it has {sorted(swept)}")
        if missing:  # (in the sweep, at other stage counts: the epoch figures draw one P)
            stages = sorted(set(table["stages"])) if "stages" in table.columns else []
            raise ConfigError(f"methods {missing} have no run at P = {', '.join(map(str, stages))}; the runs there "
                              f"are of {sorted(set(table['method']))}: pick another --stages, or leave them out")

    def grouped(t):
        return {k if isinstance(k, tuple) else (k,): v for k, v in t.groupby(list(keys), sort=False, dropna=False)}
    everything = _order(grouped(table if every is None else every))
    place = {config_key(key): i for i, key in enumerate(everything)}  # (a NaN in a key is never equal to itself)
    groups = grouped(table if methods is None else table[table["method"].isin(methods)])
    cmap = colormaps["tab10"] if len(everything) <= 10 else colormaps["tab20"]
    out = []
    for key in _order(groups):
        i = place.get(config_key(key), len(place))
        label = key[0] + "".join(f" {k}={v}" for k, v in zip(keys[1:], key[1:]))
        style = {"color": cmap(i % cmap.N), "marker": "osD^v<>ph"[i % 9], "linestyle": ("-", "--", "-.", ":")[i % 4]}
        out.append((label, style, groups[key]))
    return out


#: Fewer stage counts than this get a categorical axis (evenly spaced, points not joined: two or three
#: stage counts are not a trend); more get a log2 axis with lines.
CATEGORICAL_BELOW = 4


def _summary(values, level, bounds):
    """``(mean, lo, hi)`` of :func:`staleopt.stats.interval` (the rule of every table and claim)."""
    mean, lo, hi, _, _ = stats.interval(list(values), level, bounds)
    return mean, lo, hi


def _legend(ax, diverged: bool, beyond: bool = False):
    """Handles and labels of ``ax``, plus one neutral "diverged run" marker when some run diverged and one
    "beyond the axis" marker when a value was (:class:`Edge`)."""
    from matplotlib.lines import Line2D
    handles, labels = ax.get_legend_handles_labels()
    if diverged:
        handles.append(Line2D([], [], color="0.2", marker="x", linestyle="none", markersize=7))
        labels.append("diverged run")
    if beyond:
        handles.append(Line2D([], [], color="0.2", marker="^", linestyle="none", markersize=6))
        labels.append("beyond the axis (inf or\nfar off: see the table)")
    return handles, labels


def _mark_diverged(ax, x, y, color):
    ax.scatter(x, y, marker="x", s=60, color=color, zorder=5, label="_diverged")


class Edge:
    """The y axis of an unbounded metric (a perplexity, a loss) fitted to the values of the runs that did not
    diverge, and every drawn value beyond it (a diverged run's ``inf`` or ``1e170``, which would squash the
    others or not be drawn at all) marked at the axis' edge, ``^`` above and ``v`` below, in its line's color:
    the table's ``inf`` is in the figure too. A bounded metric (accuracy) keeps its bounds as the axis."""

    def __init__(self, bounds: Optional[Tuple[float, float]]):
        self.bounds, self.kept, self.points = bounds, [], []
        self.beyond = False  # (after finish: whether a value was marked)

    def keep(self, values) -> None:
        """Values the axis must show (the runs that did not diverge)."""
        self.kept += [float(v) for v in values if np.isfinite(v)]

    def drawn(self, xs, ys, color) -> None:
        """Points drawn at ``(xs, ys)``, marked at the edge where beyond the axis."""
        self.points += [(float(x), float(y), color) for x, y in zip(xs, ys) if not np.isnan(y)]

    def finish(self, ax) -> None:
        if self.bounds is not None:
            ax.set_ylim(*self.bounds)
            return
        kept = self.kept or [y for _, y, _ in self.points if np.isfinite(y)]
        if not kept:
            return
        lo, hi = min(kept), max(kept)
        pad = 0.06 * (hi - lo) or 0.06 * abs(hi) or 1.0
        lo, hi = lo - pad, hi + pad
        ax.set_ylim(lo, hi)
        for x, y, color in self.points:
            if y > hi or y < lo:
                ax.scatter([x], [hi if y > hi else lo], marker="^" if y > hi else "v", s=40, color=color,
                           clip_on=False, zorder=6, label="_beyond")
                self.beyond = True


def _positions(stages) -> Tuple[dict, bool]:
    """x position of each stage count, and whether the axis is categorical (:data:`CATEGORICAL_BELOW`)."""
    categorical = len(stages) < CATEGORICAL_BELOW
    return ({p: float(i) for i, p in enumerate(stages)} if categorical else {p: float(p) for p in stages}), categorical


def _dodge(x: float, j: int, n: int, categorical: bool) -> float:
    """Line ``j`` of ``n``'s x beside the others at one stage count (a fraction of a category, or of an octave)."""
    shift = (j - (n - 1) / 2) * min(0.6 / max(n, 1), 0.15)
    return x + shift if categorical else x * 2 ** (shift / 2)


def _stage_axis(ax, stages, categorical: bool):
    if categorical:
        ax.set_xticks(range(len(stages)))
        ax.set_xlim(-0.5, len(stages) - 0.5)
    else:
        ax.set_xscale("log", base=2)
        ax.set_xticks(stages)
    ax.set_xticklabels([str(s) for s in stages])
    ax.minorticks_off()
    ax.set_xlabel("pipeline stages P")
    ax.grid(alpha=0.3)


def plot_accuracy_vs_stages(source, metric: Optional[str] = None, level: float = 0.95,
                            methods: Optional[Sequence[str]] = None, title: Optional[str] = None,
                            target: Optional[float] = None, figsize: Optional[Tuple[float, float]] = None,
                            memory: Optional[pd.DataFrame] = None):
    """PipeMare Fig. 2 layout: utilization, memory (x GPipe) and ``metric`` against ``P``, one line per method,
    and, when the sweep has GPipe runs, the speedup to ``target`` accuracy over GPipe.

    Memory is two panels when the runs' models can be built here: weights + optimizer
    state + correction buffers (the records' ``memory_ratio_gpipe``), and beside it the
    total with the activations in flight (``memory``: default
    :func:`staleopt.hardware.run_memory` of the records), each relative to GPipe's.

    ``metric``: a per-run value, ``"best_acc"`` (max over epochs) or ``"final_acc"``
    (last epoch), ``"best_ppl"`` / ``"final_ppl"`` (a language model's, the best
    being the lowest), ``"best_test_loss"`` / ``"final_test_loss"``; default the best
    of the records' metric (:func:`staleopt.metrics.of`). It is drawn as the mean over
    seeds with the interval of every table (:func:`staleopt.stats.interval`: the
    seeds' range below 4 seeds, else the ``level`` t-interval, within [0, 1] for an
    accuracy) and each seed's own value as a dot (an ``x`` for a diverged run, which
    stays in the mean); nothing is dropped. ``target``: in that metric, default
    :func:`staleopt.speedup.shared_target` (the one a sweep folder's report was written with, else GPipe's mean
    best accuracy minus 0.01, or its best perplexity plus 1%; NaN: none, no speedup panel); the speedup
    panel draws every method and ``P`` where a seed reached it, labelled ``k/n``
    where only ``k`` of ``n`` did (the mean over those). Fewer than :data:`CATEGORICAL_BELOW` stage counts are
    categories, not joined by lines. ``title``: default read off the records
    (:func:`describe`).
    """
    from matplotlib.figure import Figure
    records = _records(source)
    m, which = metrics.per_run_column(metric) if metric is not None else (metrics.of(records), "best")
    metric = m.best_column if which == "best" else m.final_column
    table, keys = per_run(records, metric=m), line_keys(records)
    stages = sorted(table["stages"].unique())
    pos, categorical = _positions(stages)
    timed = "gpipe" in set(records["method"]) and "microbatches" in records.columns
    if timed and target is None:
        target = speedup.shared_target(_folder(source), records, metric=m)
    timed = timed and target is not None and not np.isnan(target)
    if timed:
        fast = speedup.speedup_table(records, target, keys=[*keys, "stages"], metric=m)
        fast = fast[(fast["reached"] > 0) & fast["speedup"].notna()]
    if memory is None:
        from ..hardware import run_memory
        try:
            memory = run_memory(records)
        except ConfigError:  # records without the config columns: weights only
            memory = None
    hardware = [c for c in ("utilization", "memory_ratio_gpipe") if c not in table or table[c].isna().all()]
    if hardware:  # (a train function returns RECORD_COLUMNS; these two come from staleopt.train's)
        warnings.warn(f"the records have no {' or '.join(hardware)} (their train function did not record them): "
                      "the throughput and memory panels are left out", stacklevel=2)
    total = not hardware and memory is not None and "total_ratio_gpipe" in memory \
        and memory["total_ratio_gpipe"].notna().any()
    panels = 1 + 2 * int(not hardware) + int(timed) + int(total)
    fig = Figure(figsize=figsize or (4.3 * panels, 3.8), layout="constrained")
    axes = list(fig.subplots(1, panels, squeeze=False)[0])
    if total:  # the total memory panel sits beside the weights-only one
        total_ax = axes.pop(2)
        at = [k for k in keys if k in memory.columns]  # a line's config: method and the keys memory rows split
        totals = {config_key(r[[*at, "stages"]]): r["total_ratio_gpipe"] for _, r in memory.iterrows()}
    util_ax, memory_ax = (axes.pop(0), axes.pop(0)) if not hardware else (None, None)
    quality_ax, speed_ax = axes[0], axes[1] if timed else None
    diverged, edge = False, Edge(m.bounds)
    edge.keep(table.loc[~table["diverged"], metric])
    lines = _lines(table, keys, methods)
    for j, (label, style, rows) in enumerate(lines):
        look = {**style, "linestyle": "none"} if categorical else style
        by_p = [(p, rows[rows["stages"] == p]) for p in stages]
        by_p = [(p, r) for p, r in by_p if len(r)]
        xs = [pos[p] for p, _ in by_p]
        if not hardware:
            util_ax.plot(xs, [r["utilization"].mean() for _, r in by_p], ms=4, label=label, **look)
            memory_ax.plot(xs, [r["memory_ratio_gpipe"].mean() for _, r in by_p], ms=4, label=label, **look)
        if total:
            line = rows[at].iloc[0]
            total_ax.plot(xs, [totals.get(config_key([*line, p]), np.nan) for p, _ in by_p], ms=4, label=label,
                          **look)
        dodged = [_dodge(pos[p], j, len(lines), categorical) for p, _ in by_p]
        mean, lo, hi = (np.array(v) for v in zip(*[_summary(r[metric], level, m.limits) for _, r in by_p]))
        with np.errstate(invalid="ignore"):  # an infinite mean (inf - inf) has no bar: Edge marks it
            quality_ax.errorbar(dodged, mean, yerr=[mean - lo, hi - mean], ms=4, lw=1.2, capsize=2, label=label,
                             **look)
        edge.drawn(dodged, mean, style["color"])
        edge.keep([v for (_, r), a, b in zip(by_p, lo, hi) if not r["diverged"].any() for v in (a, b)])
        for x, (_, r) in zip(dodged, by_p):
            ok, bad = r[~r["diverged"]], r[r["diverged"]]
            quality_ax.scatter([x] * len(ok), ok[metric], s=9, color=style["color"], alpha=0.45, lw=0, label="_seed")
            edge.drawn([x] * len(r), r[metric], style["color"])
            if len(bad):
                _mark_diverged(quality_ax, [x] * len(bad), bad[metric], style["color"])
                diverged = True
        if timed:
            mine = fast.merge(rows[keys].drop_duplicates(), on=keys).sort_values("stages")
            sx = [pos[int(p)] for p in mine["stages"]]
            speed_ax.plot(sx, mine["speedup"], ms=4, label=label, **look)
            for x, r in zip(sx, mine.itertuples()):
                if r.reached < r.runs:  # the mean over the seeds that reached it: say how many
                    speed_ax.annotate(f"{r.reached}/{r.runs}", (x, r.speedup), textcoords="offset points",
                                     xytext=(4, 3), fontsize=7, color=style["color"])
    if timed:
        speed_ax.set_yscale("log", base=2)
        speed_ax.set_ylabel(f"speedup to {m.noun} {m.format(target)} (x GPipe)")
        speed_ax.set_title(f"time to {m.noun} (pipeline time; k/n: seeds that reached it)", fontsize=9)
    drawn = [util_ax, memory_ax, total_ax if total else None, quality_ax, speed_ax]
    for ax in [a for a in drawn if a is not None]:
        _stage_axis(ax, stages, categorical)
    if total:
        total_ax.set_ylabel("total memory (x GPipe)")
        total_ax.set_title("memory with activations in flight", fontsize=10)
    # per cell, the values its interval is over (a range below 4): NaN is left out of it, as stats.interval does
    cells = table.groupby([*keys, "stages"], dropna=False)
    seeds = cells[metric].count()
    seeds = seeds[seeds > 0] if (seeds > 0).any() else cells.size()
    if not hardware:
        util_ax.set_ylabel("pipeline utilization")
        util_ax.set_ylim(0, 1.05)
        memory_ax.set_ylabel("weight + optimizer memory (x GPipe)")
        util_ax.set_title("throughput", fontsize=10)
        memory_ax.set_title("memory: weights, optimizer, corrections", fontsize=10)
    quality_ax.set_ylabel(f"{which} {m.label}\n({stats.interval_caption(seeds, level, m.bounds)}; dots: seeds)",
                       fontsize=8)
    edge.finish(quality_ax)
    quality_ax.set_title("model quality", fontsize=10)
    fig.legend(*_legend(quality_ax, diverged, edge.beyond), loc="outside right center", fontsize=8, frameon=False)
    fig.suptitle(title or describe(records), fontsize=11)
    return fig


def plot_accuracy_vs_epoch(source, stages: int, methods: Optional[Sequence[str]] = None,
                           title: Optional[str] = None, figsize: Tuple[float, float] = (6.5, 4.0), metric=None):
    """Test ``metric`` (default the records' task's: accuracy, perplexity) against epochs at ``P = stages``
    (PipeMare Fig. 7/8): the mean over every seed, each seed's own curve thin beside it.

    A run that diverged stopped: it counts at every later epoch with the value
    of its last record (marked ``x``), so the last point of a line is the mean
    final value of the summary table, over the same runs. The curves draw no
    interval.
    """
    from matplotlib.figure import Figure
    records = _records(source)
    m = metrics.of(records, metric)
    at = stats.with_worst(_at_stages(records, stages), m)  # a diverged run's missing value: the worst, as tabled
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    edge = Edge(m.bounds)
    diverged = _accuracy_curves(ax, at, line_keys(records), methods, "epoch", m.column, edge, records)
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"{m.label} (mean over seeds; thin: each seed)")
    ax.set_title(title or f"{describe(records)}, P = {stages}", fontsize=10)
    ax.grid(alpha=0.3)
    edge.finish(ax)
    ax.legend(*_legend(ax, diverged, edge.beyond), fontsize=8, frameon=False)
    return fig


def carried(at: pd.DataFrame, epochs: Optional[Sequence[int]] = None) -> pd.DataFrame:
    """Every run's records on every epoch (``epochs``, default those of ``at``): a run that stopped early
    (diverged) repeats its last record (``test_acc``, ``test_ppl``, ...) at the later epochs (``carried``
    true there; no ``step`` or time). The rule that makes a curve's mean count the runs the tables count."""
    epochs = sorted(at["epoch"].unique()) if epochs is None else sorted(epochs)
    rows = []
    for run, r in at.sort_values("epoch").groupby("run", sort=False):
        last = r.iloc[-1]
        rows.append(r.assign(carried=False))
        later = [e for e in epochs if e > last["epoch"]]
        if later:
            pad = pd.DataFrame([last] * len(later)).assign(epoch=later, carried=True)
            for col in ("step", "pipeline_time"):
                if col in pad.columns:
                    pad[col] = np.nan
            rows.append(pad)
    return pd.concat(rows, ignore_index=True)


def _accuracy_curves(ax, at: pd.DataFrame, keys: List[str], methods, x: str, y: str, edge: Edge,
                     every: pd.DataFrame) -> bool:
    """One line per method: the mean ``y`` (a test metric) of all its runs per epoch (:func:`carried`), at the
    epoch or at the mean ``x`` of the runs that recorded that epoch (``"pipeline_time"``); each run's own
    curve thin; a diverged run's last record marked ``x``; every point told to ``edge``. True if any run
    diverged. ``every``: the records at every P (the lines' styles, :func:`_lines`)."""
    diverged = False
    bad_runs = set(at.loc[at["status"] == "diverged", "run"])
    edge.keep(at.loc[~at["run"].isin(bad_runs), y])
    runs_table = at.groupby("run", sort=False).first().reset_index()
    for label, style, rows in _lines(runs_table, keys, methods, every.groupby("run", sort=False).first()):
        mine = carried(at[at["run"].isin(rows["run"])], at["epoch"].unique())
        epochs = sorted(mine["epoch"].unique())
        if x != "epoch":  # a time axis: only the epochs some run of the line recorded have a time
            epochs = sorted(mine.loc[~mine["carried"], "epoch"].unique())
        xs = epochs if x == "epoch" else [mine.loc[(mine["epoch"] == e) & ~mine["carried"], x].mean()
                                           for e in epochs]
        means = [stats.t_interval(mine.loc[mine["epoch"] == e, y])[0] for e in epochs]
        ax.plot(xs, means, ms=3, lw=1.6, label=label, **style)
        edge.drawn(xs, means, style["color"])
        for _, r in mine[~mine["carried"]].groupby("run", sort=False):
            ax.plot(r[x], r[y], color=style["color"], lw=0.6, alpha=0.35, label="_seed")
        ends = mine[~mine["carried"]].sort_values("epoch").groupby("run").tail(1)
        bad = ends[ends["status"] == "diverged"]
        if len(bad):
            _mark_diverged(ax, bad[x], bad[y], style["color"])
            edge.drawn(bad[x], bad[y], style["color"])
            diverged = True
    return diverged


def plot_accuracy_vs_time(source, stages: int, target: Optional[float] = None,
                          methods: Optional[Sequence[str]] = None, title: Optional[str] = None,
                          figsize: Tuple[float, float] = (6.5, 4.0), metric=None):
    """Test ``metric`` (default the records' task's: accuracy, perplexity) against simulated pipeline time at
    ``P = stages`` (PipeMare Fig. 11), mean over seeds.

    Each epoch sits at the seeds' mean ``T(step)`` (fully utilized minibatch
    times, :func:`staleopt.speedup.with_pipeline_time`): GPipe's points are
    ``(N + P - 1) / N`` times further right than an asynchronous method's. The
    dashed line is ``target`` (default :func:`staleopt.speedup.shared_target`: the one a sweep folder's report
    was written with, else GPipe's mean best accuracy minus 0.01, or its best perplexity plus 1%, when the sweep
    has GPipe runs); a diverged run's
    last epoch is marked ``x``. The curves draw no interval.
    """
    from matplotlib.figure import Figure
    records = _records(source)
    m = metrics.of(records, metric)
    at = stats.with_worst(speedup.with_pipeline_time(_at_stages(records, stages)), m)
    if target is None:
        target = speedup.shared_target(_folder(source), records, metric=m)
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    edge = Edge(m.bounds)
    diverged = _accuracy_curves(ax, at, line_keys(records), methods, "pipeline_time", m.column, edge, records)
    if target is not None:
        ax.axhline(target, color="0.4", lw=1, ls="--", label=f"target {m.format(target)}")
        edge.keep([target])
    ax.set_xscale("log")
    ax.set_xlabel("pipeline time (minibatches of a fully utilized pipeline)")
    ax.set_ylabel(f"{m.label} (mean over seeds; thin: each seed)")
    ax.set_title(title or f"{describe(records)}, P = {stages}", fontsize=10)
    ax.grid(alpha=0.3)
    edge.finish(ax)
    ax.legend(*_legend(ax, diverged, edge.beyond), fontsize=8, frameon=False)
    return fig


def save(fig, path: Union[str, os.PathLike], dpi: int = 150) -> str:
    """Write ``fig`` to ``path`` (format from the suffix), creating folders; returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
