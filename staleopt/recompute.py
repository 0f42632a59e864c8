"""Activation recomputation with its own weight view (PipeMare App. A.3, App. D.1; docs/design.md §1).

A segment whose activations are recomputed during the backward pass recomputes them with the
recompute view ``u_recomp_i = view_recomp_i(w_{t - tau_recomp_i})``, from the segment input the
forward pass stored; the weight gradients inside the segment use the recomputed activations and
``W^T delta`` still uses ``u_bkwd``. :meth:`staleopt.PipelineOptimizer.checkpoint` runs torch's
non-reentrant ``torch.utils.checkpoint.checkpoint`` with a :class:`RecomputeWindow` as its
recompute context:

* entering the window (the recomputation begins; no backward node runs until it ends) loads the
  recompute views of the segment's stages whose ``tau_recomp`` differs from ``tau_bkwd`` into the
  parameters' storage, and a correction rewrites them (T2: ``- (tau_fwd - tau_recomp) delta``);
* leaving it (also when torch stops the recomputation early) loads the backward views back. The
  recomputation saved *aliases* of the parameters for ``W^T delta`` (``x.detach()``), so those
  products read ``u_bkwd``; the activations it computed keep ``u_recomp``.

The window moves only the versions the history already holds (swaps or copies, no extra copy of
the model). ``tau_recomp == tau_fwd`` gives the forward's activations again (as if nothing were
recomputed); ``tau_recomp == tau_bkwd`` opens no window: torch's checkpoint, reading ``u_bkwd``.
"""
from __future__ import annotations

import contextlib
from typing import Any, FrozenSet, Iterable, Set

import torch

from ._torch_compat import flatten
from .partition import leaf_variable

__all__ = ["RecomputeWindow", "reached_parameters"]


class RecomputeWindow:
    """The recompute context of one ``opt.checkpoint`` call (reusable: a second backward recomputes again).

    ``plan`` and ``step`` are those of the forward pass that made the call; ``views`` the indices of the
    engine's stage views the segment reads whose recompute view differs from the backward view.
    """

    def __init__(self, engine, plan, step: int):
        self.engine, self.plan, self.step = engine, plan, step
        self.views: FrozenSet[int] = frozenset()

    def contexts(self):
        """``context_fn`` of ``torch.utils.checkpoint.checkpoint``: (forward context, recompute context)."""
        return contextlib.nullcontext(), self

    def __enter__(self):
        if self.views:  # (first: a refusal raised here leaves no count behind, which __exit__ would not undo)
            self.engine._enter_recompute(self)
        self.engine._recomputing += 1
        return self

    def __exit__(self, *exc):
        self.engine._recomputing -= 1
        if self.views:
            self.engine._leave_recompute(self)
        return False


def reached_parameters(outputs: Any, inputs: Iterable[Any]) -> Set[int]:
    """``id`` of every leaf tensor the autograd graph of ``outputs`` reaches without entering the graph of
    ``inputs`` (the segment's own parameters, when ``outputs`` came from a function of ``inputs``)."""
    stop = {t.grad_fn for t in flatten(list(inputs)) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    stack = [t.grad_fn for t in flatten(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        seen.add(node)
        leaf = leaf_variable(node)
        if leaf is not None:  # a leaf tensor, or a replica a module read (staleopt.replicas)
            found.add(id(leaf))
            continue
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return found
