"""PipeMare T1: learning-rate rescheduling, PipeMare §3.1 eq. (4)."""
from __future__ import annotations

from ..errors import CorrectionError
from ..validate import check_int
from .base import Correction

__all__ = ["LRReschedule", "t1_factor"]


def _power(k: int, anneal_steps: int) -> float:
    """``p_k = 1 - min(k/K, 1)`` (0 where ``K = 0``: no annealing)."""
    return 1.0 - min(k / anneal_steps, 1.0) if anneal_steps > 0 else 0.0


def t1_factor(tau: int, k: int, anneal_steps: int) -> float:
    """``1 / tau^{p_k}`` with ``p_k = 1 - min(k/K, 1)``; 1 where ``tau = 0`` (PipeMare eq. 4)."""
    if tau <= 0:
        return 1.0
    return float(tau) ** (-_power(k, anneal_steps))


class LRReschedule(Correction):
    r"""Per-stage step size ``alpha_{k,i} = alpha_{k,base} / tau_i^{p_k}`` (PipeMare §3.1, eq. 4).

    ``p_k = 1 - min(k/K, 1)`` with ``K = anneal_steps`` and ``tau_i = tau_fwd_i``
    of the step; the factor is 1 where ``tau_i = 0``. ``alpha_{k,base}`` is
    whatever the user's lr scheduler set for this step: the factor multiplies
    it for the duration of the base step only and is never written back into
    ``group["lr"]``, so schedulers and T1 compose. ``k`` counts steps since the
    asynchronous phase began (after a :class:`Warmup`, PipeMare §4 "PipeMareW").
    """

    name, paper = "T1", "PipeMare §3.1, eq. (4)"

    def __init__(self, anneal_steps: int):
        self.anneal_steps = check_int("LRReschedule(anneal_steps)", anneal_steps, 0, error=CorrectionError,
                                      why="the K of PipeMare eq. 4, in optimizer steps")
        self._offset = 0

    def bind(self, engine):
        super().bind(engine)
        self._offset = engine.phase_offset

    def lr_factors(self, delays, step):
        """:meth:`factors` of the step's forward delays, ``k = step`` minus the synchronous steps before the
        asynchronous phase (the engine's ``phase_offset``)."""
        return self.factors(delays[0], max(step - self._offset, 0))

    def factors(self, tau_fwd, k: int):
        """:func:`t1_factor` of every stage, ``k`` steps into the asynchronous phase (its arithmetic, with ``p_k``
        computed once)."""
        p = -_power(k, self.anneal_steps)
        return [float(t) ** p if t > 0 else 1.0 for t in tau_fwd]
