"""Staleness-aware step sizes ``lr / tau``, Zhang, Gupta, Lian and Liu, IJCAI 2016."""
from __future__ import annotations

from .base import Correction

__all__ = ["StalenessAware"]


class StalenessAware(Correction):
    r"""Divide each stage's step size by its staleness (Zhang, Gupta, Lian, Liu, "Staleness-aware
    Async-SGD for Distributed Deep Learning", IJCAI 2016, the staleness-dependent learning rate)::

        alpha_{t,i} = alpha_t / tau_i   if tau_i > 0,   alpha_t   if tau_i = 0

    with ``tau_i = tau_fwd_i`` of the step: the number of updates between the read of the weights the
    gradient was computed with and its application (the paper's staleness of a gradient).
    ``alpha_t`` is what the user's scheduler set; the factor multiplies it for the base step only,
    as T1's.

    T1 (:class:`~staleopt.corrections.LRReschedule`, PipeMare §3.1 eq. 4) generalises it:
    ``alpha_t / tau_i^{p_k}`` with ``p_k = 1 - min(k/K, 1)`` equals this rule while ``p_k = 1``
    (``k = 0``, or ``K -> infinity``) and anneals the exponent to 0 (no division) over ``K`` steps;
    Zhang et al. keep ``p = 1`` for the whole run. The paper divides by the staleness of each gradient
    at a parameter server (with ``n``-softsync, by the average staleness ``n``); a pipeline stage's
    staleness is fixed by the schedule, so the division is per stage. No extra memory.
    """

    name, paper = "SA", "Zhang et al., IJCAI 2016 (staleness-aware ASGD)"

    def lr_factors(self, delays, step):
        return [1.0 / t if t > 0 else 1.0 for t in delays[0]]

    def __repr__(self):
        return "StalenessAware()"
