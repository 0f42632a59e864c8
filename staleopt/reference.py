"""The reference engine: every weight version kept, every view copied — the semantics, line by line.

This is what a hand-written simulation does (a list of weight snapshots, ``copy_`` of the wanted
one before each pass), written against the :class:`~staleopt.history.History` interface so that
:class:`ReferencePipelineOptimizer` runs the very same hooks, delays, corrections and base step as
:class:`~staleopt.optimizer.PipelineOptimizer`, with only the weight history swapped for this
one. ``tests/test_engine_reference.py`` runs both side by side for every method and correction and
checks after every step that the weights, the loaded views and the stored versions agree bit for
bit. The reference's memory grows by one model per step: it is for tests and for reading.

Notation (docs/design.md §1, PipeMare §2): ``w_v`` is the weight vector after ``v`` steps; a view of stage
``i`` at step ``t`` reads ``w_{t - tau_i}``, and ``w_v`` with ``v < 0`` is ``w_0``. The three views of the
contract are three calls of :meth:`ReferenceHistory.load`: the forward view ``w_{t - tau_fwd}`` before the
forward pass, the backward view ``w_{t - tau_bkwd}`` (T2 rewrites it) when the backward pass begins, and,
while an ``opt.checkpoint`` segment is recomputed, the recompute view ``w_{t - tau_recomp}`` of its stages
(T2 rewrites it too; PipeMare App. D.1), after which the backward view is loaded again. Every call copies
every view from the store, so the reference hands back every view to rewrite and the engine rewrites each
with the view it is in (``tests/test_engine_recompute.py`` checks it against a hand-derived gradient).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .history import History, StageView, make_views
from .optimizer import PipelineOptimizer

__all__ = ["ReferenceHistory", "ReferencePipelineOptimizer"]


class ReferenceHistory(History):
    """``versions[v]`` for every ``v`` so far, and a copy of the current weights ``w_t``.

    * ``load``: when the parameters are at rest (hold ``w_t``), first save a copy of them; then copy
      ``w_v`` (``w_t`` from the saved copy) into the parameters; a view to be rewritten is handed
      back to the engine, which rewrites the parameters (never the store);
    * ``push(t)``: ``versions[t] = w_t`` (a correction may then rewrite the stored copy);
    * ``advance(t)``: save a copy of the new current weights ``w_t``.
    """

    strategy = "reference"

    def __init__(self, partition, depths: Sequence[int]):
        self.views = tuple(make_views(self, partition, depths))
        self._t = 0
        with torch.no_grad():
            w0 = [[d.clone() for d in v.data] for v in self.views]
            # w_v for v < 0 is w_0: the deepest view reads back H_i steps
            self._versions: List[Dict[int, List[torch.Tensor]]] = [
                {-a: [x.clone() for x in w] for a in range(1, v.H + 1)} for v, w in zip(self.views, w0)]
            self._now = w0
        self._rest = True  # the parameters hold w_t

    def load(self, targets, bind=None):  # (copies every view: the readable reference)
        rewrite = []
        with torch.no_grad():
            if self._rest:
                self._now = [[d.clone() for d in v.data] for v in self.views]
            for v, (version, mod) in zip(self.views, targets.versions(self._t)):
                src = self._now[v.index] if version == self._t else self._versions[v.index][version]
                for d, s in zip(v.data, src):
                    d.copy_(s)
                if mod:
                    rewrite.append(v)
        self._rest = all(a == 0 and not mod for a, mod in targets.rel)
        return rewrite

    def push(self, t):
        with torch.no_grad():
            for v in self.views:
                self._versions[v.index][t] = [d.clone() for d in v.data]

    def advance(self, t):
        self._t, self._rest = t, True

    def restart(self):
        with torch.no_grad():
            for v in self.views:
                for w in self._versions[v.index].values():
                    for x, d in zip(w, v.data):
                        x.copy_(d)

    def stored(self, view: StageView, version: int) -> List[torch.Tensor]:
        return self._versions[view.index][version]

    @property
    def nbytes(self):
        return sum(x.numel() * x.element_size() for vs in self._versions for w in vs.values() for x in w)

    def state_dict(self):
        return {"strategy": self.strategy, "t": self._t, "versions": self._versions}

    def load_state_dict(self, state):
        self.check_state_dict(state)
        self._t, self._rest = state["t"], True  # (the engine saves and loads at rest)
        self._versions = [{int(k): [x.clone() for x in w] for k, w in vs.items()} for vs in state["versions"]]


class ReferencePipelineOptimizer(PipelineOptimizer):
    """:class:`~staleopt.optimizer.PipelineOptimizer` on a :class:`ReferenceHistory` (same arguments;
    ``memory`` is ignored: every version is kept)."""

    def _make_history(self, depths, rewritten):
        return ReferenceHistory(self._partition, depths)
