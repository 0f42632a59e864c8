"""Training phases: synchronous warmup (PipeMareW) and pipelined-then-synchronous hybrid training.

Both are modelled as the executed pipeline runs them (:mod:`staleopt.timeline`, docs/schedules.md
"Phases"): a synchronous step reads ``w_t``; after PipeMareW's warmup of ``W`` steps the pipeline
refills from its last flush, so step ``t >= W`` reads nothing older than ``w_W``; at the hybrid's
switch the pipeline drains, so every pipelined step keeps its delays.
"""
from __future__ import annotations

from ..errors import CorrectionError
from ..validate import check_int
from .base import Correction

__all__ = ["Warmup", "Hybrid", "refill"]


def _check_steps(what, steps):
    return check_int(what, steps, 0, error=CorrectionError, why="a number of optimizer steps")


def refill(delays, age: int):
    """``min(tau_i, age)`` per stage: the delays of a pipeline that started filling ``age`` steps ago.

    A pass of minibatch ``t`` with delay ``tau`` reads the version its stage held ``tau`` updates
    earlier; a pipeline that was empty at step ``s`` (a flush, or the run's start) has applied
    only ``t - s`` updates since, so it reads ``w_{t - min(tau, t - s)}`` (PipeMare §4; at the
    run's start ``s = 0`` and the engine's ``w_{t - tau} = w_0`` for ``t < tau`` is this clamp).
    """
    return [min(d, age) for d in delays]


class Warmup(Correction):
    """Synchronous for the first ``steps`` steps, then the asynchronous schedule refilling (PipeMare §4, "PipeMareW").

    Step ``t < W`` has delays 0; step ``t >= W`` has ``min(tau_i, t - W)`` (:func:`refill`), forward and
    backward: the pipeline flushed after the warmup's last minibatch, so the first pipelined
    minibatches read the weights of the flush, not versions from inside the warmup. T1's annealing
    counter ``k = t - W`` starts at the switch (``engine.phase_offset``); its ``tau_i`` is the step's
    (refilling) forward delay. T2 keeps ``gamma_i`` of the asynchronous delays and extrapolates
    over the step's gap ``tau_fwd_i - tau_bkwd_i`` (0 at the switch, then growing).
    """

    name, paper = "W", "PipeMare §4 (Warmup Epochs)"
    refills_pipeline = True

    def __init__(self, steps: int):
        self.steps = _check_steps("Warmup(steps)", steps)

    @property
    def synchronous_steps(self) -> int:
        return self.steps

    def delays(self, tau_fwd, tau_bkwd, step):
        if step is None:
            return tau_fwd, tau_bkwd
        age = max(step - self.steps, 0)
        return refill(tau_fwd, age), refill(tau_bkwd, age)


class Hybrid(Correction):
    """Pipelined (stale) for the first ``pipelined_steps`` steps, then synchronous (stale-weights paper §4).

    The pipeline drains at the switch: every pipelined step keeps its delays, every later step
    reads ``w_t``.
    """

    name, paper = "hybrid", "Stale-weights paper §4 (Hybrid Training)"

    def __init__(self, pipelined_steps: int):
        self.pipelined_steps = _check_steps("Hybrid(pipelined_steps)", pipelined_steps)

    def delays(self, tau_fwd, tau_bkwd, step):
        if step is not None and step >= self.pipelined_steps:
            return [0] * len(tau_fwd), [0] * len(tau_bkwd)
        return tau_fwd, tau_bkwd
