"""The correction plug-in interface (docs/design.md §3).

A correction changes one or more of: the delays of a step, the backward view, what is stored in
the weight history, the per-stage step size, and state kept across steps. It works on the
engine's :class:`~staleopt.history.StageView` objects (``engine.chunks``: per stage and
device/dtype, the live tensors ``data``, ``stored(version)``, ``zeros()``), never on the
history's slots. The engine (:class:`staleopt.PipelineOptimizer`, and the reference engine
:class:`staleopt.reference.ReferencePipelineOptimizer`) calls the hooks in this order:

0. :meth:`bind` — once, when the engine is built (its views exist; allocate state here);
1. :meth:`delays` — once per pass when step ``t`` begins (corrections compose in list order;
   ``step=None`` once at construction for the largest delays, which size the history);
2. :meth:`modifies_backward` — when step ``t``'s plan is made, per stage: does
   :meth:`backward_view` rewrite it this step?
3. :meth:`backward_view` — when the backward pass reaches the model output, after the history
   loaded the raw backward views, on the views it declared;
3b. :meth:`recompute_view` — during the backward pass, when an activation recomputation
   (:meth:`staleopt.PipelineOptimizer.checkpoint`) loads the raw recompute views of the stages it
   recomputes (those whose ``tau_recomp`` differs from ``tau_bkwd``), on the views
   :meth:`modifies_recompute` declared; the backward views come back when it ends;
4. in ``step()``, with ``w_t`` back in the parameters and pushed into the history:
   :meth:`lr_factors` of every correction (multiplied together and onto the lr the user's
   scheduler set, never written back into ``group["lr"]``); then for each correction in list
   order :meth:`transform_stored` (it may rewrite the stored copy of ``w_t``) and
   :meth:`before_update`; then the base optimizer's step;
5. :meth:`after_update` — after the base step, with ``w_{t+1}`` in the parameters and ``w_t``
   still stored (``view.stored(t)``).

Every hook has a no-op default, so a correction implements only what it changes. Instead of
checking each other's types, corrections *declare* what they do and need (class attributes
below); the engine refuses combinations that contradict each other and serves the needs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Correction"]

Delays = Tuple[List[int], List[int]]


class Correction:
    """Base class of all corrections. ``name`` and ``paper`` document it in tables."""

    name: str = "correction"
    paper: str = ""
    #: :meth:`backward_view` rewrites views in place (the history keeps one free slot per affected
    #: stage for the raw version).
    rewrites_backward_view: bool = False
    #: reads stored versions as the raw weights ``w_v`` (T2's ``delta``); cannot be combined with a
    #: correction that ``rewrites_history``.
    needs_raw_history: bool = False
    #: :meth:`transform_stored` replaces the stored copy of ``w_t`` (weight prediction).
    rewrites_history: bool = False
    #: after its synchronous steps the pipeline refills (``tau := min(tau, t - W)``, growing one step at a time), so
    #: one stored version is read at several version gaps ``tau_fwd - tau_bkwd``: cannot be combined with a
    #: correction that ``rewrites_history`` for the one gap of the step that stores the version.
    refills_pipeline: bool = False
    #: makes every backward view the forward view, ``tau_bkwd := tau_fwd`` (weight stashing).
    backward_reads_forward_view: bool = False
    #: the first steps are synchronous; ``engine.phase_offset`` sums these, and corrections that
    #: count steps of the asynchronous phase (T1's annealing) start there.
    synchronous_steps: int = 0
    #: changes the gradients per stage view in place (``p.grad``): a tied parameter's replica
    #: (:mod:`staleopt.replicas`) shares its tied parameter's gradient, which it would change twice.
    rewrites_gradients: bool = False
    #: reads ``p.grad`` as the gradient of a minimized objective where its sign matters (a prediction of the update,
    #: a product of gradients, an added decay term): the engine refuses ``maximize=True`` in any parameter group
    #: (torch's optimizers negate the gradient inside their step, which this correction does not see)
    assumes_minimize: bool = False
    #: combines ``p.grad`` with dense running state in ``torch._foreach_*`` kernels that have no sparse version: the
    #: engine refuses sparse gradients (``nn.Embedding(sparse=True)``) at the first step
    dense_gradients: bool = False

    _seen: Optional[list] = None  # (group, its params list, its length) of the groups group_of was read from

    def bind(self, engine) -> None:
        """Called once by the engine after it is built; allocate per-stage state here."""
        self.engine = engine

    def group_of(self) -> Dict[int, int]:
        """Parameter id -> the index of the base optimizer's group that holds it, read afresh when its groups change
        (``add_param_group``, ``load_state_dict``'s new group dicts, a group's ``params`` replaced or grown). A
        model parameter no group holds is absent: the base does not step it, and its gradient, which the base's
        ``zero_grad`` never clears, adds up over the steps: no correction's input (nor part of a checkpoint)."""
        groups = self.engine.base_optimizer.param_groups
        seen = self._seen
        if seen is None or len(seen) != len(groups) or any(
                s is not g or ps is not g["params"] or n != len(ps) for (s, ps, n), g in zip(seen, groups)):
            self._seen = [(g, g["params"], len(g["params"])) for g in groups]
            self._group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
        return self._group_of

    def delays(self, tau_fwd: List[int], tau_bkwd: List[int], step: Optional[int]) -> Delays:
        """Delays of ``step`` given the schedule's (and earlier corrections') delays.

        ``step=None`` asks for the largest delays the correction can produce,
        which the engine uses to size the history.
        """
        return tau_fwd, tau_bkwd

    def modifies_backward(self, stage: int, tau_fwd: int, tau_bkwd: int) -> bool:
        """Whether :meth:`backward_view` changes this stage's backward view under these delays (a
        function of its arguments only: the engine caches the answer per set of delays)."""
        return False

    def backward_view(self, chunks: Sequence, delays: Delays) -> None:
        """Modify, in place, the loaded backward views (``view.data``) of ``chunks`` (those it declared)."""

    def modifies_recompute(self, stage: int, tau_fwd: int, tau_recomp: int) -> bool:
        """Whether :meth:`recompute_view` changes this stage's recompute view ``w_{t - tau_recomp}``
        (PipeMare App. D.1; a function of its arguments only, cached like :meth:`modifies_backward`)."""
        return False

    def recompute_view(self, chunks: Sequence, delays: Delays, tau_recomp: List[int]) -> None:
        """Modify, in place, the loaded recompute views (``view.data``) of ``chunks`` (those it declared)."""

    def lr_factors(self, delays: Delays, step: int) -> Optional[List[float]]:
        """Per-stage multipliers of the scheduler's lr for this step, or None for all 1."""
        return None

    def transform_stored(self, chunks: Sequence, delays: Delays, step: int) -> None:
        """Rewrite, in place, the stored copy of ``w_step`` (``view.stored(step)`` of the views with a
        history, ``chunks``); declare ``rewrites_history``."""

    def before_update(self, delays: Delays, step: int) -> None:
        """Just before the base optimizer step."""

    def after_update(self, chunks: Sequence, delays: Delays, step: int) -> None:
        """Just after the base optimizer step."""

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state: Dict) -> None:
        pass

    def check_state_dict(self, state: Dict) -> None:
        """Raise :class:`~staleopt.errors.CheckpointError` where :meth:`load_state_dict` cannot load ``state``;
        called before anything of a checkpoint is loaded (the base optimizer's state included), so a refused
        checkpoint leaves the run as it was."""

    def signature(self) -> str:
        """What a checkpoint must have been saved with to load into this correction: the built-in corrections'
        ``repr`` (class and every hyperparameter, no state), a subclass's class name (override it to add the
        settings that change what it computes)."""
        return repr(self) if type(self).__module__.startswith("staleopt.") else type(self).__name__

    def extra_bytes(self) -> int:
        """Bytes of weight-sized buffers this correction keeps (for memory reports)."""
        return 0

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "engine")
        return f"{type(self).__name__}({args})"
