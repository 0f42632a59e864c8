"""Figures: one module per family (theory, timeline/hardware, sweeps); each function takes an optional ``ax``.

Matplotlib's non-interactive Agg backend is used unless a backend was chosen before import.
"""
from .sweep import plot_accuracy_vs_epoch, plot_accuracy_vs_stages, plot_accuracy_vs_time
from .theory import *  # noqa: F401,F403
from .timeline import *  # noqa: F401,F403
from . import theory as _theory, timeline as _timeline

__all__ = ["plot_accuracy_vs_stages", "plot_accuracy_vs_epoch", "plot_accuracy_vs_time"] + list(_theory.__all__) + list(_timeline.__all__)
