"""Figures for :mod:`staleopt.timeline` and :mod:`staleopt.hardware`.

* :func:`plot_timeline` — the space-time diagram of an executed schedule
  (stages down, time across, like PipeMare Fig. 1 and the stale-weights paper
  Fig. 4): forward cells blue, backward cells green, a forward and backward in
  one cell (pipelined backprop's last stage) teal, shade alternating by
  minibatch, cells labelled with microbatch ids, bubbles left blank.
* :func:`plot_hardware_sweep` — pipeline utilization and weight+optimizer
  memory against the number of stages, one line per method.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

__all__ = ["plot_timeline", "plot_hardware_sweep"]

_COLORS = {"F": ("#4c72b0", "#8fb0dd"), "B": ("#55a868", "#98d0a6"), "X": ("#2a9d8f", "#7fcdc3")}


def plot_timeline(timeline, ax=None, versions: bool = False, title: Optional[str] = None):
    """Draw ``timeline`` (a :class:`staleopt.timeline.Timeline`) on ``ax`` and return ``ax``.

    A cell's label is the microbatch id, with ``versions=True`` also the weight
    version read (``3@1``: microbatch 3 read ``w_1``). Without ``ax``, on a new
    figure outside pyplot (``ax.figure.savefig(path)`` writes it).
    """
    if ax is None:
        fig = Figure(figsize=(max(4.0, 0.32 * timeline.slots + 1.5), 0.42 * len(timeline.workers) + 1.0))
        ax = fig.subplots()
    for (w, slot), evs in timeline.cells.items():
        kind = evs[0].kind if len(evs) == 1 else "X"
        color = _COLORS[kind][evs[0].minibatch % 2]
        ax.add_patch(Rectangle((slot, w), 1, 1, facecolor=color, edgecolor="white", linewidth=0.8))
        label = f"{evs[0].microbatch}" + (f"@{evs[0].version}" if versions else "")
        ax.text(slot + 0.5, w + 0.5, label, ha="center", va="center",
                color="white" if evs[0].minibatch % 2 == 0 else "#1a1a1a",
                fontsize=7 if versions else 8)
    ax.set_xlim(0, timeline.slots)
    ax.set_ylim(len(timeline.workers), 0)
    ax.set_yticks([w + 0.5 for w in range(len(timeline.workers))])
    ax.set_yticklabels(timeline.workers, fontsize=8)
    step = max(1, timeline.slots // 20)
    ax.set_xticks([s + 0.5 for s in range(0, timeline.slots, step)])
    ax.set_xticklabels([str(s) for s in range(0, timeline.slots, step)], fontsize=7)
    ax.set_xlabel("slot (one forward or backward pass)")
    ax.set_facecolor("#f4f4f4")                      # bubbles: the background shows through
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(length=0)
    handles = [Patch(color=_COLORS["F"][0], label="forward"), Patch(color=_COLORS["B"][0], label="backward")]
    if any(len(evs) > 1 for evs in timeline.cells.values()):
        handles.append(Patch(color=_COLORS["X"][0], label="forward+backward"))
    handles.append(Patch(facecolor="#f4f4f4", edgecolor="#cccccc", label="bubble"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if title is None:
        title = (f"{timeline.kind}: P={timeline.stages}, N={timeline.microbatches}, "
                 f"steady-state utilization {timeline.steady_state_utilization:.0%}")
    ax.set_title(title, fontsize=9)
    return ax


def plot_hardware_sweep(rows: Sequence[Dict], axes=None):
    """Utilization (left) and weight+optimizer memory in MiB (right) against stages, one line per method.

    ``rows``: dicts with keys ``method``, ``stages``, ``utilization`` and
    ``weight_optimizer_bytes`` (as written by ``staleopt hardware --stages ...``).
    Returns the two axes (without ``axes``, on a new figure outside pyplot).
    """
    if axes is None:
        axes = Figure(figsize=(9, 3.4)).subplots(1, 2)
    methods: List[str] = []
    for r in rows:
        if r["method"] not in methods:
            methods.append(r["method"])
    styles = ["-", "--", "-.", ":"]
    for k, method in enumerate(methods):
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["stages"])
        ps = [r["stages"] for r in rs]
        style = dict(marker="os^Dv"[k % 5], linestyle=styles[k % 4], label=method, markersize=5)
        axes[0].plot(ps, [100 * r["utilization"] for r in rs], **style)
        axes[1].plot(ps, [r["weight_optimizer_bytes"] / 2 ** 20 for r in rs], **style)
    axes[0].set_ylabel("pipeline utilization (%)")
    axes[1].set_ylabel("weight + optimizer memory (MiB)")
    for ax in axes:
        ax.set_xlabel("pipeline stages P")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[1].legend(fontsize=8)
    return axes
