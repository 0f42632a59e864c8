"""Nesterov look-ahead for asynchronous pipelines, Ajanthan et al., ICML 2025."""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from ..errors import CorrectionError
from .base import Correction

__all__ = ["NesterovLookahead"]


def _check_momentum(what: str, value, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) < 1.0:
        raise CorrectionError(f"NesterovLookahead({what}) must be a float in [{low:g}, 1), got {value!r}")
    return float(value)


class NesterovLookahead(Correction):
    r"""Nesterov's accelerated gradient with the look-ahead in the update, for stale gradients
    (Ajanthan, Ramasinghe, Zuo, Avraham, Long, "Nesterov Method for Asynchronous Pipeline Parallel
    Optimization", ICML 2025).

    With ``g_t`` the stage's (stale) gradient, per stage ``i``::

        gamma_i = momentum + tau_i * (max_momentum - momentum) / (tau_max + 1)   # max_momentum=None: momentum
        m_{t+1} = gamma_i * m_t + g_t                                            # m_0 = 0
        g_t    <-  g_t + gamma_i * m_{t+1}                                        # the look-ahead step

    and the base optimizer, plain SGD, applies ``w_{t+1} = w_t - eta * (g_t + gamma_i m_{t+1})``:
    NAG in the form that moves the look-ahead from the gradient's point into the update
    (Sutskever et al. 2013; Dozat's NAdam), since an asynchronous pipeline cannot evaluate the
    gradient at ``w_t + gamma d_t``: it evaluates it at stale weights, and the look-ahead term
    pushes the weights further along the momentum to meet the delay. ``tau_i`` is the stage's
    asynchronous forward delay and ``tau_max`` the largest over stages (``engine.max_delays``).

    Where the equations come from: the paper's reference implementation (PluralisResearch/AsyncPP),
    which trains with ``torch.optim.NAdam`` (Dozat's look-ahead-in-the-update with Adam's second
    moment and momentum-decay schedule), ``beta1 = momentum = 0.99``, weight stashing, and optionally
    (``--adaptive_momentum``) ``gamma_i = momentum + (num_versions_i - 1)(0.99 - momentum) / P`` with
    ``num_versions_i - 1`` the stage's delay in its 1F1B pipeline, ``P - 1 - i``: the rule above with
    ``max_momentum = 0.99``, since ``tau_max + 1 = P`` there (``tau_max + 1`` generalises ``P`` to
    schedules with other delays while keeping ``gamma_i < max_momentum``). What differs: this is the
    SGD form of the look-ahead (no second moment, no momentum-decay schedule), so it composes with a
    plain SGD base optimizer; the base's weight decay is added to the look-ahead direction
    (decoupled from the momentum, as the reference's NAdamW).

    Use it with ``torch.optim.SGD(params, lr)`` (no momentum): the correction holds the momentum.
    With another base optimizer the look-ahead direction feeds that optimizer's own rule (a warning
    says so). Memory: one weight-sized momentum buffer per stage (the same as SGD with momentum).
    """

    name, paper = "NAG", "Ajanthan et al., ICML 2025 (Nesterov for asynchronous PP)"

    def __init__(self, momentum: float = 0.9, max_momentum: Optional[float] = None):
        self.momentum = _check_momentum("momentum", momentum, 0.0)
        self.max_momentum = None if max_momentum is None else _check_momentum("max_momentum", max_momentum,
                                                                              self.momentum)

    def bind(self, engine):
        super().bind(engine)
        base = engine.base_optimizer
        if not (type(base) is torch.optim.SGD and all(g.get("momentum", 0) == 0 for g in base.param_groups)):
            warnings.warn(f"NesterovLookahead holds the momentum and rewrites the gradient into the Nesterov "
                          f"direction; the base optimizer {type(base).__name__} applies its own rule on top of it "
                          "(momentum twice, or Adam's moments of the look-ahead). For the paper's update use "
                          "torch.optim.SGD(params, lr) without momentum", stacklevel=4)
        self.gammas = self.stage_momenta(engine.max_delays[0])
        self._m = {c.index: c.zeros() for c in engine.chunks}

    def stage_momenta(self, tau: List[int]) -> List[float]:
        """``gamma_i`` of every stage for asynchronous forward delays ``tau``."""
        if self.max_momentum is None:
            return [self.momentum] * len(tau)
        span = (self.max_momentum - self.momentum) / (max(tau) + 1)
        return [self.momentum + t * span for t in tau]

    def before_update(self, delays, step):
        for c in self.engine.chunks:
            gamma = self.gammas[c.stage]
            for p, m in zip(c.params, self._m[c.index][1]):
                if p.grad is not None:
                    m.mul_(gamma).add_(p.grad)
                    p.grad.add_(m, alpha=gamma)

    def momentum_buffer(self, stage: int) -> torch.Tensor:
        """The flat momentum ``m`` of ``stage`` (concatenated over its views)."""
        if not 0 <= stage < len(self.gammas):
            raise CorrectionError(f"NesterovLookahead.momentum_buffer(stage): stage must be in 0..{len(self.gammas) - 1}"
                                  f", got {stage!r}")
        return torch.cat([self._m[c.index][0] for c in self.engine.chunks if c.stage == stage])

    def state_dict(self):
        return {"m": {i: flat for i, (flat, _) in self._m.items()}}

    def load_state_dict(self, state):
        for i, flat in state["m"].items():
            self._m[int(i)][0].copy_(flat)

    def extra_bytes(self):
        return sum(f.numel() * f.element_size() for f, _ in self._m.values())

    def __repr__(self):
        return f"NesterovLookahead(momentum={self.momentum}, max_momentum={self.max_momentum})"
