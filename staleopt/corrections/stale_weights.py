"""The weights a stage's gradient was computed with, read at update time: ``w_{t - tau_fwd_i}``.

Shared by the corrections that compare the stale weights with the current ones (delay
compensation, gap-aware damping).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .base import Correction

__all__ = ["StaleWeights"]


class StaleWeights:
    """``w_{t - tau}`` of every delayed view, for ``0 <= tau <= H_i``, readable in ``before_update``.

    At ``before_update`` of step ``t`` the history has already stored ``w_t``; in ``memory="minimal"``
    the row of ``w_{t - H_i}``, the version a stage with ``tau_i = H_i`` (every delayed dataflow stage)
    computed its gradient with, was written over in the step's last pass (with ``w_t``, or T2's
    backward view). So this keeps that one version itself: :meth:`refresh`,
    called in ``after_update`` of step ``t``, copies ``w_{t + 1 - H_i}`` (still stored then) into one
    weight-sized buffer per delayed view, and :meth:`version` serves ``tau = H_i`` from it and every
    smaller ``tau`` from the history. A stage of a real pipeline holds exactly ``tau_i`` past
    versions for this (the hardware model counts them); the buffer only compensates for the order of
    the simulator's ring.
    """

    def __init__(self, correction: Correction):
        engine = correction.engine
        self.views = [c for c in engine.chunks if c.H]  # stages that can be stale
        self._oldest: Dict[int, tuple] = {}
        for c in self.views:  # (first read at step H_i, after refresh filled it at step H_i - 1)
            self._oldest[c.index] = c.zeros()

    def version(self, view, step: int, tau: int) -> List[torch.Tensor]:
        """Per-parameter tensors of ``w_{step - tau}`` of ``view`` (``0 <= tau <= view.H``), in ``before_update``."""
        if step < tau:  # w_(step - tau) is w_0, which the history stores as version 0 until step H_i
            return view.stored(0)
        if tau == view.H:
            return self._oldest[view.index][1]
        return view.stored(step - tau)

    def refresh(self, step: int) -> None:
        """In ``after_update`` of ``step``: keep ``w_{step + 1 - H_i}``, the oldest version step ``step + 1`` reads."""
        dst, src = [], []
        for c in self.views:
            dst += self._oldest[c.index][1]
            src += c.stored(step + 1 - c.H)
        if dst:
            torch._foreach_copy_(dst, src)

    def state_dict(self) -> Dict[int, torch.Tensor]:
        return {i: flat for i, (flat, _) in self._oldest.items()}

    def load_state_dict(self, state: Dict[int, torch.Tensor]) -> None:
        for i, flat in state.items():
            self._oldest[int(i)][0].copy_(flat)

    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f, _ in self._oldest.values())
