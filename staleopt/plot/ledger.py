"""The reproduction ledger's horizon figure: each check's gap against ``tau_max / steps`` (docs/reproductions.md).

One panel per check that ran at more than one horizon: the per-seed gaps
(:attr:`staleopt.ledger.verdict.Row.gaps`) as points, their mean with the 95%
Student-t interval, on a log ``tau_max / steps`` axis with the paper's own run
marked (:class:`staleopt.ledger.spec.PaperHorizon`), the line of no gap and,
for "not worse" and "matches", the margin; an infinite gap (a diverged run's
perplexity) is marked at the axis' edge (:class:`staleopt.plot.sweep.Edge`).
The figure is drawn from the same rows as the page's tables, so the two cannot
disagree.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence, Tuple

from .. import metrics
from ..ledger.spec import Check
from ..ledger.verdict import Row, trend
from ..stats import t_interval
from .sweep import Edge, _legend

__all__ = ["gap_label", "horizon_figure"]


def gap_label(check: Check, metric=metrics.ACCURACY) -> str:
    """What the y axis of ``check``'s panel measures, per seed: a gain in ``metric`` (a
    :class:`~staleopt.metrics.Metric` or record column; final test accuracy by default), written as the
    raw difference that equals it (``b - a`` of a perplexity: lower is better), with the metric named
    when it is not accuracy."""
    metric = metrics.get(metric)
    sel = check.selectors
    name = {k: v.get("method", k) for k, v in sel.items()}

    def minus(x, y):
        return f"{name[x]} - {name[y]}" if metric.higher_is_better else f"{name[y]} - {name[x]}"
    if check.rule == "degrades":
        label = f"{minus('reference', 'a')} at the largest P"
    elif check.rule == "gap-grows":
        label = f"growth of {minus('a', 'b')}, smallest to largest P"
    else:
        label = minus("a", "b")
    return label if metric is metrics.ACCURACY else f"{label} ({metric.noun})"


def _panel(ax, check: Check, rows: Sequence[Row]) -> None:
    ran = [r for r in rows if r.gaps and math.isfinite(r.ratio)]
    # the axis of an unbounded metric (a perplexity) is fitted to the seeds where no compared run diverged: a
    # diverged run's gap (inf, or 1e170 from a finite overflowed perplexity) is marked at the edge, as
    # plot.sweep marks the same runs' values; an accuracy's gaps are bounded and all kept
    unbounded = metrics.get(rows[0].metric).bounds is None if rows else False
    edge = Edge(None)
    edge.keep([0.0, check.margin, -check.margin] if check.rule in ("not-worse", "matches") else [0.0])
    for r in ran:
        ys = [g for _, g in r.gaps]
        ax.scatter([r.ratio] * len(ys), ys, s=12, color="0.55", zorder=2,
                   label="one seed" if r is ran[0] else None)
        edge.keep([g for s, g in r.gaps if not (unbounded and s in r.diverged)])
        edge.drawn([r.ratio] * len(ys), ys, "0.55")
        mean, half, _ = t_interval(ys)
        edge.drawn([r.ratio], [mean], "C0")
        if not (unbounded and r.diverged):
            edge.keep([mean - half, mean + half])
        ax.errorbar([r.ratio], [mean], yerr=None if math.isnan(half) else [[half], [half]], fmt="o", color="C0",
                    ms=5, capsize=3, zorder=3, label="mean, 95% interval" if r is ran[0] else None)
        ax.annotate(f"{r.horizon}x", (r.ratio, mean), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.axhline(0.0, color="k", lw=0.8)
    if check.rule in ("not-worse", "matches"):
        ax.axhline(-check.margin, color="C3", lw=0.8, ls="--", label=f"margin -{check.margin:g}")
        if check.rule == "matches":
            ax.axhline(check.margin, color="C3", lw=0.8, ls="--")
    xs = [r.ratio for r in ran]
    if check.paper_horizon is not None:
        p = check.paper_horizon.ratio
        ax.axvline(p, color="C2", lw=1.0, ls=":", label=f"paper: {check.paper_horizon.delay}/"
                                                         f"{check.paper_horizon.steps:,} = {p:.2g}")
        xs.append(p)
    ax.set_xscale("log")
    if xs:
        ax.set_xlim(min(xs) / 2, max(xs) * 2)
    ax.set_xlabel(r"$\tau_{max}$ / steps (log)")
    ax.set_ylabel(gap_label(check, rows[0].metric if rows else metrics.ACCURACY), fontsize=8)
    ax.set_title(f"{check.id}: {trend(rows).label}", fontsize=9)
    edge.finish(ax)
    ax.legend(*_legend(ax, False, edge.beyond), fontsize=6, loc="best")


def horizon_figure(panels: Sequence[Tuple[Check, Sequence[Row]]], path: Optional[Path] = None, title: str = ""):
    """One panel per ``(check, its rows at every horizon)``; saved to ``path`` (PNG) when given. Returns the figure."""
    from matplotlib.figure import Figure
    n = len(panels)
    cols = min(n, 3)
    rows_ = math.ceil(n / cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows_), layout="constrained")
    axes = fig.subplots(rows_, cols, squeeze=False).ravel()
    for ax, (check, rows) in zip(axes, panels):
        _panel(ax, check, rows)
    for ax in axes[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig
