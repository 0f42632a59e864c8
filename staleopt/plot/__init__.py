"""Figures: one module per family (theory, timeline/hardware, sweeps); each function takes an optional ``ax``.

No function uses pyplot: each draws on the ``ax`` it is given or on a new ``matplotlib.figure.Figure``
(no GUI backend; ``savefig`` renders with Agg; in a notebook ``display(ax.figure)`` shows it).
"""
from .sweep import plot_accuracy_vs_epoch, plot_accuracy_vs_stages, plot_accuracy_vs_time
from .theory import *  # noqa: F401,F403
from .timeline import *  # noqa: F401,F403
from . import theory as _theory, timeline as _timeline

__all__ = ["plot_accuracy_vs_stages", "plot_accuracy_vs_epoch", "plot_accuracy_vs_time"] + list(_theory.__all__) + list(_timeline.__all__)
