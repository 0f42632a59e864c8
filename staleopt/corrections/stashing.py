"""Weight stashing (PipeDream §3.3): the backward pass uses the forward pass's weight version."""
from __future__ import annotations

from .base import Correction

__all__ = ["Stashing"]


class Stashing(Correction):
    """``tau_bkwd_i := tau_fwd_i`` and ``view_bkwd := view_fwd`` (PipeDream §3.3, "Weight Stashing").

    With every delay equal in the forward and backward pass, the gradient is the
    true gradient at the stale weights: ``w_{t+1} = w_t - lr * grad f(w_{t - tau})``
    per stage. Memory: the stashed versions, ``sum_i |w_i| * tau_fwd_i``.
    """

    name, paper = "stashing", "PipeDream §3.3"
    backward_reads_forward_view = True

    def delays(self, tau_fwd, tau_bkwd, step):
        return tau_fwd, list(tau_fwd)
