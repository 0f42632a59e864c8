"""PipeMare T2: discrepancy correction of the backward weights, PipeMare §3.2."""
from __future__ import annotations

import torch

from ..errors import CorrectionError
from ..validate import check_int
from .base import Correction

__all__ = ["DiscrepancyCorrection"]


class DiscrepancyCorrection(Correction):
    r"""Extrapolate the backward weights towards the forward ones (PipeMare §3.2, T2).

    Where ``tau_fwd_i > tau_bkwd_i``::

        (u_bkwd_t)_i  = w_{t - tau_bkwd_i, i} - (tau_fwd_i - tau_bkwd_i) * delta_{t,i}
        delta_{t+1,i} = gamma_i * delta_{t,i} + (1 - gamma_i) * (w_{t+1,i} - w_{t,i})
        gamma_i       = D ** (1 / (tau_fwd_i - tau_bkwd_i))

    ``delta`` starts at 0 and is one weight-sized buffer per corrected stage.
    ``gamma_i`` uses the schedule's asynchronous delays (so ``delta`` keeps
    tracking the weights through a synchronous warmup); the correction is applied
    on the steps whose delays differ.
    """

    name, paper = "T2", "PipeMare §3.2"
    rewrites_backward_view = True
    needs_raw_history = True

    def __init__(self, decay: float):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < float(decay) < 1.0:
            raise CorrectionError(f"DiscrepancyCorrection(decay) must be a float in (0, 1) (the D of PipeMare "
                                  f"§3.2; the paper sweeps 0.01-0.9), got {decay!r}")
        self.decay = float(decay)

    def bind(self, engine):
        super().bind(engine)
        tf, tb = engine.max_delays
        self.gamma = [self.decay ** (1.0 / (f - b)) if f > b else None for f, b in zip(tf, tb)]
        self._delta = {}
        for i, c in enumerate(engine.chunks):
            if self.gamma[c.stage] is not None:
                self._delta[i] = c.zeros()
        # per tensor of the corrected stages: its delta view and its weight 1 - gamma_i
        self._views = [v for flat, views in self._delta.values() for v in views]
        self._weights = [1.0 - self.gamma[engine.chunks[i].stage] for i, (_, views) in self._delta.items()
                         for _ in views]

    def delta(self, stage: int) -> torch.Tensor:
        """The flat velocity estimate of ``stage`` (concatenated over its chunks).

        Raises :class:`~staleopt.errors.CorrectionError` for a stage out of range, or one T2 does not correct
        (``tau_fwd_i = tau_bkwd_i``: no discrepancy, so no ``delta`` is kept).
        """
        stage = check_int("T2 delta(stage): stage", stage, 0, len(self.gamma) - 1, error=CorrectionError)
        if self.gamma[stage] is None:
            tf, tb = self.engine.max_delays
            raise CorrectionError(f"T2 keeps no delta for stage {stage}: its forward and backward delays are equal "
                                  f"(tau_fwd = tau_bkwd = {tf[stage]}), so its backward weights need no correction; "
                                  f"corrected stages: {[i for i, g in enumerate(self.gamma) if g is not None]}")
        return torch.cat([self._delta[i][0] for i, c in enumerate(self.engine.chunks) if c.stage == stage])

    def modifies_backward(self, stage, tau_fwd, tau_bkwd):
        return tau_fwd > tau_bkwd and self.gamma[stage] is not None

    def backward_view(self, chunks, delays):
        tf, tb = delays
        for c in chunks:
            torch._foreach_add_(c.data, self._delta[c.index][1], alpha=-(tf[c.stage] - tb[c.stage]))

    def after_update(self, chunks, delays, step):
        """``delta += (1 - gamma) * ((w_{t+1} - w_t) - delta)``, one foreach call over all corrected stages."""
        if not self._views:
            return
        new, old = [], []
        for i in self._delta:
            c = self.engine.chunks[i]
            new += c.data  # w_{t+1}
            old += c.stored(step)  # w_t
        torch._foreach_lerp_(self._views, torch._foreach_sub(new, old), self._weights)

    def state_dict(self):
        return {"delta": {i: flat for i, (flat, _) in self._delta.items()}}

    def load_state_dict(self, state):
        for i, flat in state["delta"].items():
            self._delta[int(i)][0].copy_(flat)

    def extra_bytes(self):
        return sum(f.numel() * f.element_size() for f, _ in self._delta.values())

    def __repr__(self):
        return f"DiscrepancyCorrection(decay={self.decay})"
