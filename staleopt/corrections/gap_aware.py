"""Gap-aware damping of stale gradients, Barkai, Hakimi and Schuster, ICLR 2020."""
from __future__ import annotations

from typing import Dict

import torch

from ..errors import CorrectionError
from .base import Correction
from .stale_weights import StaleWeights

__all__ = ["GapAware"]


class GapAware(Correction):
    r"""Divide each stale gradient by its *Gap* (Barkai, Hakimi, Schuster, ICLR 2020, "Gap-Aware").

    Per stage ``i`` with ``tau_i = tau_fwd_i`` of the step, per element, before the base step::

        C   = sqrt(v_k / (1 - beta^k)) + eps         # the running RMS step size, bias-corrected
        G   = 1 + |w_t - w_{t - tau_i}| / C          # the Gap: the staleness in units of C
        g  <-  g / G
        v_{k+1} = beta * v_k + (1 - beta) * (w_{t+1} - w_t)^2     # after the base step; v_0 = 0

    The Gap measures staleness by how far the weights moved since the gradient's weights were read,
    in units of the average step a parameter takes, so a parameter that did not move is not
    penalised however old the gradient (the paper's argument against dividing by ``tau``).
    ``k`` counts the steps measured; before the first (``k = 0``) every stored version is
    ``w_0``, the gap is 0 and ``G = 1``. The weights used are the forward view ``w_{t - tau_fwd_i}``
    (raw), as for :class:`~staleopt.corrections.DelayCompensation`. Stages with ``tau_i = 0`` are left
    alone.

    ``C`` differs from the authors' pipeline implementation in one respect: they take the running RMS
    of the update *direction* (the gradient, or SGD's momentum buffer) times the schedule's peak
    learning rate; here it is the running RMS of the applied step ``w_{t+1} - w_t`` itself, which is
    the same while the learning rate stays at its peak, needs no knowledge of the base optimizer, and
    keeps measuring the gap in units of the current average step when a scheduler (or T1) lowers it.
    The base optimizer's weight decay is added after the damping (not damped).

    Memory: one weight-sized buffer ``v`` per delayed stage, plus the stale versions (a real stage
    keeps ``tau_i`` of them; see :class:`~staleopt.corrections.stale_weights.StaleWeights`).
    """

    name, paper = "GA", "Barkai et al., ICLR 2020 (Gap-Aware)"
    needs_raw_history = True

    def __init__(self, beta: float = 0.999, eps: float = 1e-8):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < float(beta) < 1.0:
            raise CorrectionError(f"GapAware(beta) must be a float in (0, 1), the decay of the running mean square "
                                  f"step (the authors use 0.999), got {beta!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not float(eps) > 0:
            raise CorrectionError(f"GapAware(eps) must be a positive number (added to the RMS step C so that a "
                                  f"parameter that never moved gets G = 1), got {eps!r}")
        self.beta, self.eps = float(beta), float(eps)

    def bind(self, engine):
        super().bind(engine)
        self._stale = StaleWeights(self)
        self._v: Dict[int, tuple] = {c.index: c.zeros() for c in self._stale.views}
        self._k = 0

    def gap(self, view, step: int, tau: int):
        """Per-parameter Gaps ``G`` of ``view`` for a gradient ``tau`` steps stale, at ``before_update`` of ``step``."""
        stale = self._stale.version(view, step, tau)
        if self._k == 0:
            return [torch.ones_like(w) for w in view.data]
        correction = 1.0 - self.beta ** self._k
        return [(w - s).abs_().div_(v.div(correction).sqrt_().add_(self.eps)).add_(1.0)
                for w, s, v in zip(view.data, stale, self._v[view.index][1])]

    def before_update(self, delays, step):
        tf = delays[0]
        for c in self._stale.views:
            tau = tf[c.stage]
            if tau == 0:
                continue
            for p, G in zip(c.params, self.gap(c, step, tau)):
                if p.grad is not None:
                    p.grad.div_(G)

    def after_update(self, chunks, delays, step):
        new, old, vs = [], [], []
        for c in self._stale.views:
            new += c.data
            old += c.stored(step)
            vs += self._v[c.index][1]
        if vs:
            d = torch._foreach_sub(new, old)
            torch._foreach_mul_(vs, self.beta)
            torch._foreach_addcmul_(vs, d, d, value=1.0 - self.beta)
        self._k += 1
        self._stale.refresh(step)

    def state_dict(self):
        return {"stale": self._stale.state_dict(), "v": {i: f for i, (f, _) in self._v.items()}, "k": self._k}

    def load_state_dict(self, state):
        self._stale.load_state_dict(state["stale"])
        for i, flat in state["v"].items():
            self._v[int(i)][0].copy_(flat)
        self._k = int(state["k"])

    def extra_bytes(self):
        return self._stale.nbytes() + sum(f.numel() * f.element_size() for f, _ in self._v.values())

    def __repr__(self):
        return f"GapAware(beta={self.beta}, eps={self.eps})"
