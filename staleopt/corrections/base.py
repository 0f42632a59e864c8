"""The correction plug-in interface (DESIGN §3).

A correction changes one or more of: the delays of a step, the backward view,
what is stored in the weight history, the per-stage step size, and state kept
across steps. The engine (:class:`staleopt.PipelineOptimizer`) calls the hooks
below in this order for step ``t``:

1. :meth:`delays` — once, when step ``t`` begins (corrections compose in list order);
2. :meth:`backward_view` — when the backward pass begins, on the stages whose
   backward view it changes (declared by :meth:`modifies_backward`);
3. :meth:`lr_factors` — in ``step()``, per stage, multiplied together and onto
   the lr the user's scheduler set (never written back into ``group["lr"]``);
4. :meth:`transform_stored` — with a copy of ``w_t`` about to enter the history,
   which it may rewrite (weight prediction stores predicted views); then
   :meth:`before_update`, just before the base optimizer step, with ``w_t`` in the
   parameters;
5. :meth:`after_update` — after the base step, with ``w_{t+1}`` in the parameters
   and ``w_t`` in the newest history slot.

Every hook has a no-op default, so a correction implements only what it changes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Correction"]

Delays = Tuple[List[int], List[int]]


class Correction:
    """Base class of all corrections. ``name`` and ``paper`` document it in tables."""

    name: str = "correction"
    paper: str = ""
    #: True if :meth:`backward_view` rewrites views in place (the engine then keeps
    #: one free history slot per affected stage for the raw version).
    rewrites_backward_view: bool = False
    def bind(self, engine) -> None:
        """Called once by the engine after it is built; allocate per-stage state here."""
        self.engine = engine

    def delays(self, tau_fwd: List[int], tau_bkwd: List[int], step: Optional[int]) -> Delays:
        """Delays of ``step`` given the schedule's (and earlier corrections') delays.

        ``step=None`` asks for the largest delays the correction can produce,
        which the engine uses to size the history.
        """
        return tau_fwd, tau_bkwd

    def modifies_backward(self, stage: int, tau_fwd: int, tau_bkwd: int) -> bool:
        """Whether :meth:`backward_view` changes this stage's backward view this step."""
        return False

    def backward_view(self, chunks: Sequence, delays: Delays) -> None:
        """Modify, in place, the loaded backward views of ``chunks`` (those it declared)."""

    def lr_factors(self, delays: Delays, step: int) -> Optional[List[float]]:
        """Per-stage multipliers of the scheduler's lr for this step, or None for all 1."""
        return None

    def transform_stored(self, chunks: Sequence, delays: Delays, step: int) -> None:
        """Rewrite, in place, the version of the current weights that enters the history."""

    def before_update(self, delays: Delays, step: int) -> None:
        """Just before the base optimizer step."""

    def after_update(self, chunks: Sequence, delays: Delays, step: int) -> None:
        """Just after the base optimizer step."""

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state: Dict) -> None:
        pass

    def extra_bytes(self) -> int:
        """Bytes of weight-sized buffers this correction keeps (for memory reports)."""
        return 0

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "engine")
        return f"{type(self).__name__}({args})"
