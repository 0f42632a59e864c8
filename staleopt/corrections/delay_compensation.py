"""DC-ASGD: delay compensation of stale gradients, Zheng et al., ICML 2017, §3-4."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import history
from ..errors import CorrectionError
from .base import Correction
from .stale_weights import StaleWeights

__all__ = ["DelayCompensation"]


def _check_positive(what: str, value, why: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value) > 0:
        raise CorrectionError(f"{what} must be a positive number ({why}), got {value!r}")
    return float(value)


class DelayCompensation(Correction):
    r"""Compensate the delay with a first-order Taylor step of the gradient (DC-ASGD, Zheng et al. 2017).

    Per stage ``i`` with ``tau_i = tau_fwd_i`` of the step, before the base step::

        g  <-  g + lambda * g * g * (w_t - w_{t - tau_i})                  # §3 (derivation), §4 (algorithm)

    (element-wise). ``g * g`` is the paper's diagonal approximation ``lambda * G`` of the Hessian
    (§3), so ``g + lambda * g * g * (w_t - w_bak)`` approximates the gradient at the current
    weights from the one computed at the backup ``w_bak``. ``mean_square_decay=None`` is DC-ASGD-c
    (constant ``lambda``); a value ``m`` is DC-ASGD-a (§4)::

        MeanSquare_t = m * MeanSquare_{t-1} + (1 - m) * g * g              # MeanSquare_{-1} = 0
        lambda_t     = lambda / sqrt(MeanSquare_t + eps)                   # element-wise, §4

    ``w_bak``, the weights the gradient was computed with, is the stage's *forward* view
    ``w_{t - tau_fwd_i}`` (raw: the history's stored version, never T2's extrapolation): the stage's
    own weights enter its gradient through the forward pass, while its backward view only carries
    the error to earlier stages. With weight stashing (the named methods) the backward reads the same
    version, so the gradient is the true gradient at ``w_bak``, as the paper's workers compute it.
    Stages with ``tau_i = 0`` are left alone. The base optimizer then applies ``g`` (the paper:
    SGD, ``w_{t+1} = w_t - eta * g``); its weight decay is added after the compensation.

    Memory: the stale versions (a real stage keeps ``tau_i`` of them; the simulator's history
    already does, :class:`~staleopt.corrections.stale_weights.StaleWeights`), plus ``MeanSquare``
    (one weight-sized buffer per delayed stage, float32 for float16 or bfloat16 parameters) for DC-ASGD-a.
    """

    name, paper = "DC", "Zheng et al., ICML 2017, §3-4 (DC-ASGD)"
    assumes_minimize = True
    needs_raw_history = True

    rewrites_gradients = True

    def __init__(self, lam: float = 0.04, mean_square_decay: Optional[float] = None, eps: float = 1e-7):
        self.lam = _check_positive("DelayCompensation(lam)", lam,
                                   "the lambda of DC-ASGD §4; the methods use 0.04 (DC-ASGD-c) and 2 (DC-ASGD-a)")
        if mean_square_decay is not None and (isinstance(mean_square_decay, bool) or not isinstance(
                mean_square_decay, (int, float)) or not 0.0 <= float(mean_square_decay) < 1.0):
            raise CorrectionError(f"DelayCompensation(mean_square_decay) must be None (DC-ASGD-c, constant lambda) or "
                                  f"a float in [0, 1) (DC-ASGD-a's m; the paper uses 0.95), got {mean_square_decay!r}")
        self.mean_square_decay = None if mean_square_decay is None else float(mean_square_decay)
        self.dense_gradients = self.mean_square_decay is not None  # (MeanSquare is dense; g * g * (w - s) is not)
        self.eps = _check_positive("DelayCompensation(eps)", eps,
                                   "the paper's epsilon, added to MeanSquare under the square root to avoid 0/0")

    def bind(self, engine):
        super().bind(engine)
        self._stale = StaleWeights(self)
        self._ms: Dict[int, tuple] = {}
        if self.mean_square_decay is not None:
            self._ms = {c.index: c.zeros(statistics=True) for c in self._stale.views}  # (float32 for half params)

    def before_update(self, delays, step):
        """``g += lam g * g * (w_t - w_{t-tau})`` (DC-ASGD-a: ``lam / sqrt(MeanSquare + eps)``, MeanSquare updated
        first, at every delayed view): a fixed number of foreach calls over all stages, block by block."""
        tf = delays[0]
        m = self.mean_square_decay
        grads, ws, ss, mss, delayed = [], [], [], [], []
        held = self.group_of()
        for c in self._stale.views:
            tau = tf[c.stage]
            stale = self._stale.version(c, step, tau)
            mine = self._ms[c.index][1] if m is not None else [None] * len(c.params)
            for p, w, s, ms in zip(c.params, c.data, stale, mine):
                if p.grad is not None and id(p) in held:
                    grads.append(p.grad)
                    ws.append(w)
                    ss.append(s)
                    mss.append(ms)
                    delayed.append(tau > 0)
        for a, b in history.blocks(grads):  # the temporaries are weight-sized: bounded blocks
            g, w, s, ms, on = grads[a:b], ws[a:b], ss[a:b], mss[a:b], delayed[a:b]
            if m is not None:
                torch._foreach_mul_(ms, m)
                torch._foreach_addcmul_(ms, g, g, value=1.0 - m)
            if not all(on):
                g, w, s, ms = ([x for x, keep in zip(xs, on) if keep] for xs in (g, w, s, ms))
            if not g:
                continue
            d = torch._foreach_mul(g, g)
            torch._foreach_mul_(d, torch._foreach_sub(w, s))
            if m is None:
                torch._foreach_mul_(d, self.lam)
            else:
                lam = torch._foreach_add(ms, self.eps)
                torch._foreach_sqrt_(lam)
                torch._foreach_reciprocal_(lam)  # (lam / x is x.reciprocal() * lam)
                torch._foreach_mul_(lam, self.lam)
                torch._foreach_mul_(d, lam)
            torch._foreach_add_(g, d)

    def after_update(self, chunks, delays, step):
        self._stale.refresh(step)

    def state_dict(self):
        return {"stale": self._stale.state_dict(), "mean_square": {i: f for i, (f, _) in self._ms.items()}}

    def load_state_dict(self, state):
        self._stale.load_state_dict(state["stale"])
        for i, flat in state["mean_square"].items():
            self._ms[int(i)][0].copy_(flat)

    def extra_bytes(self):
        return self._stale.nbytes() + sum(f.numel() * f.element_size() for f, _ in self._ms.values())

    def __repr__(self):  # (the signature a checkpoint is checked against; eps at its default left out, as before)
        eps = "" if self.eps == 1e-7 else f", eps={self.eps!r}"
        return f"DelayCompensation(lam={self.lam}, mean_square_decay={self.mean_square_decay}{eps})"
