"""Vertical sync (PipeDream §3.3): every stage uses the weight version stage 0 used for the minibatch."""
from __future__ import annotations

from .base import Correction

__all__ = ["VerticalSync"]


class VerticalSync(Correction):
    """``tau_fwd_i := tau_fwd_0`` and ``tau_bkwd_i := tau_bkwd_0`` for every stage (PipeDream §3.3).

    A minibatch then sees one consistent model version ``w_{t - tau_0}`` across
    all stages; combined with :class:`Stashing` this is ``pipedream-vs``.
    """

    name, paper = "vertical-sync", "PipeDream §3.3 (Vertical Sync)"

    def delays(self, tau_fwd, tau_bkwd, step):
        return [tau_fwd[0]] * len(tau_fwd), [tau_bkwd[0]] * len(tau_bkwd)
