"""Training phases: synchronous warmup (PipeMareW) and pipelined-then-synchronous hybrid training."""
from __future__ import annotations

from ..errors import CorrectionError
from ..validate import check_int
from .base import Correction

__all__ = ["Warmup", "Hybrid"]


def _check_steps(what, steps):
    return check_int(what, steps, 0, error=CorrectionError, why="a number of optimizer steps")


class Warmup(Correction):
    """Synchronous for the first ``steps`` steps, then the asynchronous schedule (PipeMare §4, "PipeMareW").

    T1's annealing counter ``k`` starts at the switch.
    """

    name, paper = "W", "PipeMare §4 (Warmup Epochs)"

    def __init__(self, steps: int):
        self.steps = _check_steps("Warmup(steps)", steps)

    @property
    def synchronous_steps(self) -> int:
        return self.steps

    def delays(self, tau_fwd, tau_bkwd, step):
        if step is not None and step < self.steps:
            return [0] * len(tau_fwd), [0] * len(tau_bkwd)
        return tau_fwd, tau_bkwd


class Hybrid(Correction):
    """Pipelined (stale) for the first ``pipelined_steps`` steps, then synchronous (stale-weights paper §4)."""

    name, paper = "hybrid", "Stale-weights paper §4 (Hybrid Training)"

    def __init__(self, pipelined_steps: int):
        self.pipelined_steps = _check_steps("Hybrid(pipelined_steps)", pipelined_steps)

    def delays(self, tau_fwd, tau_bkwd, step):
        if step is not None and step >= self.pipelined_steps:
            return [0] * len(tau_fwd), [0] * len(tau_bkwd)
        return tau_fwd, tau_bkwd
