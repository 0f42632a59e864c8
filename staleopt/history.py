"""The weight history: which past versions ``w_v`` each stage keeps, where, and how views are loaded.

A :class:`History` alone owns the stored versions, the storage slots and the moves between the
slots and the parameters. :class:`~staleopt.optimizer.PipelineOptimizer` drives it through five
calls, and corrections read it through the :class:`StageView` protocol:

==========================  ==========================================================================
``load(targets)``           put version ``v_i`` (raw, or to be rewritten in place) into stage view ``i``
``push(t)``                 the parameters hold ``w_t`` at rest: store it, forget ``w_{t - H_i}``
``advance(t)``              the base step wrote ``w_t`` into the parameters (their only copy)
``stored(view, v)``         per-parameter tensors of stored version ``v`` (a correction may rewrite them)
``state_dict()`` / ``load_state_dict()``   everything above, for checkpoints
==========================  ==========================================================================

:class:`SlotHistory` keeps exactly the versions the delays need, ``H_i = max_t max(tau_fwd_i,
tau_bkwd_i)`` per stage (DESIGN §1: ``w_{t-tau}`` with ``t - tau < 0`` is ``w_0``), in one
contiguous buffer of ``S_i`` slots per stage chunk. How a raw version reaches the parameters while
the parameters hold the only copy of another is the memory strategy's choice:

* :class:`SwapMoves` (``memory="minimal"``, the default): ``S_i = H_i``; the parameters trade
  places with the slot (three copies through a temporary buffer of the moved weights, freed at
  once), so the current weights ``w_t`` never need a slot of their own;
* :class:`CopyMoves` (``memory="fast"``): ``S_i = H_i + 1``; the parameters' content is saved to
  the spare slot and the wanted version copied in (two copies, and ``push`` is then free).

Either way a stage whose backward view a correction rewrites in place (T2) keeps one free slot for
the raw version it rewrites. Every move of one phase is batched over all stages: one
``torch.cat`` and ``torch._foreach_copy_`` calls over flat lists, whatever the number of tensors.
:class:`staleopt.reference.ReferenceHistory` is the readable version (every version kept, views
copied) that this one is tested against step by step.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .errors import CheckpointError, CorrectionError

__all__ = ["StageView", "History", "SlotHistory", "MoveStrategy", "SwapMoves", "CopyMoves", "STRATEGIES"]

Target = Tuple[int, bool]  # (version, rewritten in place)


class StageView:
    """The parameters of one stage that share a device and dtype: the protocol corrections use.

    Attributes (read-only for corrections):

    * ``stage`` — the stage index ``i``;
    * ``params`` — its ``nn.Parameter`` objects, in partition order;
    * ``data`` — aliases of the parameters' storage (``p.data``): what the forward or backward
      pass reads now; a correction that declared ``rewrites_backward_view`` rewrites these in place
      in :meth:`~staleopt.corrections.base.Correction.backward_view`;
    * ``numel`` — elements over all of ``params``;
    * ``H`` — versions the delays need, ``max_t max(tau_fwd_i, tau_bkwd_i)``;
    * ``ring`` — the ``(S, numel)`` slot buffer of a :class:`SlotHistory` (``None`` when ``S = 0``
      or in the reference history).

    Methods: :meth:`stored` (a stored version, writable), :meth:`zeros` (a new weight-sized buffer
    for a correction's own state) and :meth:`split` (per-parameter views of a flat buffer).
    """

    def __init__(self, history: "History", index: int, stage: int, params: List[nn.Parameter], depth: int):
        self._history, self.index, self.stage, self.params, self.H = history, index, stage, params, depth
        self.data = [p.data for p in params]  # aliases: writes skip autograd's version counter
        self.numel = sum(p.numel() for p in params)
        self.ring: Optional[torch.Tensor] = None

    def stored(self, version: int) -> List[torch.Tensor]:
        """Per-parameter tensors of stored ``version`` (``w_t`` once :meth:`History.push` stored it)."""
        return self._history.stored(self, version)

    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Views of a flat buffer of this chunk's size, one per parameter, shaped like it."""
        views, off = [], 0
        for p in self.params:
            views.append(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        return views

    def zeros(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """A new zero flat buffer of this chunk's size and dtype (a correction's state) and its views."""
        p0 = self.params[0]
        flat = torch.zeros(self.numel, dtype=p0.dtype, device=p0.device)
        return flat, self.split(flat)

    def __repr__(self) -> str:
        return f"StageView(stage={self.stage}, tensors={len(self.params)}, numel={self.numel}, H={self.H})"


def make_views(history: "History", partition, depths: Sequence[int]) -> List[StageView]:
    """One view per (stage, device, dtype) of ``partition``; ``depths[i]`` is stage ``i``'s ``H_i``."""
    views = []
    for stage in partition:
        by: Dict[tuple, List[nn.Parameter]] = {}
        for p in stage.params:
            by.setdefault((p.device, p.dtype), []).append(p)
        for ps in by.values():
            views.append(StageView(history, len(views), stage.index, ps, depths[stage.index]))
    return views


class History:
    """The interface :class:`~staleopt.optimizer.PipelineOptimizer` drives (module docstring)."""

    views: Tuple[StageView, ...]
    strategy: str

    def load(self, targets: Sequence[Target]) -> List[StageView]:
        """Bring view ``i`` to ``targets[i] = (version, rewrite)``; return the views to rewrite in place."""
        raise NotImplementedError

    def push(self, t: int) -> None:
        """Store ``w_t`` (in the parameters, at rest) and forget what no later step needs."""
        raise NotImplementedError

    def advance(self, t: int) -> None:
        """The parameters now hold ``w_t``, written by the base step, and no slot holds it."""
        raise NotImplementedError

    def stored(self, view: StageView, version: int) -> List[torch.Tensor]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


class _Slots:
    """A view's slot bookkeeping in a :class:`SlotHistory`.

    ``where`` maps a version ``v`` (``v < 0`` holds ``w_0``) to its slot; ``free`` lists the empty
    slots; the parameters hold ``key = (version, rewritten)``; ``unique`` says no slot holds a copy
    of it (then it may not be overwritten).
    """

    __slots__ = ("where", "free", "key", "unique")

    def __init__(self, depth: int, slots: int):
        self.where: Dict[int, int] = {-a: a - 1 for a in range(1, depth + 1)}  # w_{-a} = w_0
        self.free: List[int] = list(range(depth, slots))
        self.key: Target = (0, False)
        self.unique = True

    def state(self) -> dict:
        return {"where": dict(self.where), "free": list(self.free), "key": self.key, "unique": self.unique}

    def load(self, state: dict) -> None:
        self.where = {int(k): int(v) for k, v in state["where"].items()}
        self.free, self.key, self.unique = list(state["free"]), tuple(state["key"]), bool(state["unique"])


class _Moves:
    """The data movements of one phase, collected over all views and run batched (in this order)."""

    def __init__(self):
        self.swap_params: List[torch.Tensor] = []  # parameters <-> slots
        self.swap_slots: List[torch.Tensor] = []
        self.swap_flat_params: List[List[torch.Tensor]] = []  # per view: its parameters, flattened
        self.swap_rows: List[torch.Tensor] = []
        self.save_dst: List[torch.Tensor] = []  # parameters -> a free slot (before they are overwritten)
        self.save_src: List[torch.Tensor] = []
        self.load_dst: List[torch.Tensor] = []  # a slot -> the parameters
        self.load_src: List[torch.Tensor] = []
        self.keep_dst: List[torch.Tensor] = []  # raw version -> a free slot, before a rewrite in place
        self.keep_src: List[torch.Tensor] = []

    def run(self, foreach: bool) -> None:
        if self.swap_params:
            _swap(self.swap_params, self.swap_slots, self.swap_flat_params, self.swap_rows, foreach)
        _copy(self.save_dst, self.save_src, foreach)
        _copy(self.load_dst, self.load_src, foreach)
        _copy(self.keep_dst, self.keep_src, foreach)


def _copy(dst: List[torch.Tensor], src: List[torch.Tensor], foreach: bool) -> None:
    if not dst:
        return
    if foreach:
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


def _swap(params: List[torch.Tensor], slots: List[torch.Tensor], flat_params: List[List[torch.Tensor]],
          rows: List[torch.Tensor], foreach: bool) -> None:
    """Exchange the contents of the parameters and their slots: gather the parameters into one
    temporary flat buffer per device and dtype, copy the slots into the parameters, then the
    buffer into the slots' rows (``flat_params[k]`` and ``rows[k]``: view ``k``'s)."""
    by: Dict[tuple, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
    for fs, row in zip(flat_params, rows):
        gathered, rs = by.setdefault((row.device, row.dtype), ([], []))
        gathered += fs
        rs.append(row)
    saved = [(torch.cat(fs), rs) for fs, rs in by.values()]
    _copy(params, slots, foreach)
    for flat, rs in saved:
        _copy(rs, list(flat.split([r.numel() for r in rs])), foreach)


class MoveStrategy:
    """How a :class:`SlotHistory` moves a raw version into parameters that hold the only copy of another."""

    name: str = ""

    def slots(self, depth: int, rewritten: bool) -> int:
        """Slots of a view with history ``depth``; ``rewritten``: a correction rewrites its backward view."""
        raise NotImplementedError

    swaps: bool = False


class SwapMoves(MoveStrategy):
    """``memory="minimal"``: exactly ``H_i`` slots; the parameters trade places with the wanted slot."""

    name, swaps = "minimal", True

    def slots(self, depth, rewritten):
        return depth + (1 if rewritten and depth else 0)


class CopyMoves(MoveStrategy):
    """``memory="fast"``: ``H_i + 1`` slots; the parameters' content is saved to the spare one, then overwritten."""

    name, swaps = "fast", False

    def slots(self, depth, rewritten):
        return depth + 1 if depth else 0


STRATEGIES = {s.name: s for s in (SwapMoves(), CopyMoves())}


class SlotHistory(History):
    """Exactly the versions the delays need, per view one ``(S_i, numel_i)`` buffer (module docstring).

    ``depths[i]`` is stage ``i``'s ``H_i``; ``rewritten[i]`` says a correction may rewrite stage
    ``i``'s backward view in place (one more slot for the raw version, :class:`SwapMoves`).
    """

    def __init__(self, partition, depths: Sequence[int], rewritten: Sequence[bool], strategy: MoveStrategy,
                 foreach: bool = True):
        self._strategy, self._foreach = strategy, foreach
        self.strategy = strategy.name
        self.views = tuple(make_views(self, partition, depths))
        self._slots: List[_Slots] = []
        self._slot_views: List[List[List[torch.Tensor]]] = []  # [view][slot] -> per-parameter tensors
        self._rows: List[List[torch.Tensor]] = []  # [view][slot] -> the slot's flat row
        self._flat: List[Optional[List[torch.Tensor]]] = []  # [view] -> 1-d aliases of the parameters
        for v in self.views:
            S = strategy.slots(v.H, rewritten[v.stage])
            views: List[List[torch.Tensor]] = []
            if S:
                p0 = v.params[0]
                v.ring = torch.empty((S, v.numel), dtype=p0.dtype, device=p0.device)
                views = [v.split(v.ring[s]) for s in range(S)]
                with torch.no_grad():
                    for s in range(S):
                        torch._foreach_copy_(views[s], v.data)
            self._slots.append(_Slots(v.H, S))
            self._slot_views.append(views)
            self._rows.append([v.ring[s] for s in range(S)])
            contiguous = all(d.is_contiguous() for d in v.data)  # (else flattened at each swap: a copy)
            self._flat.append([d.view(-1) for d in v.data] if contiguous else None)
        self._delayed = [v for v in self.views if v.ring is not None]
        self.ptrs = [(v.params[0], v.params[0].data_ptr(), v.params[-1], v.params[-1].data_ptr()) for v in self.views]

    # ------------------------------------------------------------------ API
    def load(self, targets):
        moves, plans, rewrite = _Moves(), [], []
        for v, s, (version, mod) in zip(self.views, self._slots, targets):
            if s.key == (version, mod):
                continue
            plans.append((v, s, self._plan(v, s, version, mod, moves)))
            if mod:
                rewrite.append(v)
        with torch.no_grad():
            moves.run(self._foreach)
        for v, s, after in plans:  # bookkeeping only once the data has moved
            for version, slot in after[2]:
                if slot is None:
                    del s.where[version]
                else:
                    if slot in s.free:
                        s.free.remove(slot)
                    s.where[version] = slot
            s.key, s.unique = after[0], after[1]
        return rewrite

    def _plan(self, v: StageView, s: _Slots, version: int, mod: bool, moves: _Moves):
        """Queue the moves that bring view ``v`` to ``(version, mod)``; return its bookkeeping after them."""
        key, unique, changes = s.key, s.unique, []
        if key != (version, False):
            slot = s.where.get(version)
            if slot is None:
                raise CorrectionError(f"stage {v.stage}: weight version {version} is no longer stored; this is a "
                                      "bug in a correction's delays (please report it)")
            if unique and self._strategy.swaps:  # the parameters hold the only copy: trade places
                moves.swap_params += v.data
                moves.swap_slots += self._slot_views[v.index][slot]
                flat = self._flat[v.index]
                moves.swap_flat_params.append(flat if flat is not None else [d.reshape(-1) for d in v.data])
                moves.swap_rows.append(self._rows[v.index][slot])
                changes += [(version, None), (key[0], slot)]
            else:  # save the only copy to a free slot, or overwrite a duplicate / a rewritten view
                if unique:
                    spare = s.free[-1]
                    moves.save_dst += self._slot_views[v.index][spare]
                    moves.save_src += v.data
                    changes.append((key[0], spare))
                    unique = False
                moves.load_dst += v.data
                moves.load_src += self._slot_views[v.index][slot]
            key = (version, False)
        if mod:
            if unique:  # keep the raw version before it is rewritten (after a save, never unique)
                spare = s.free[-1]
                moves.keep_dst += self._slot_views[v.index][spare]
                moves.keep_src += v.data
                changes.append((version, spare))
            unique, key = False, (version, True)
        return key, unique, changes

    def push(self, t):
        dst, src = [], []
        for v in self._delayed:
            s = self._slots[v.index]
            expired = s.where.pop(t - v.H, None)  # w_{t-H} is not needed from step t+1 on
            if expired is not None:
                s.free.append(expired)
            if s.unique:
                slot = s.free.pop()
                dst += self._slot_views[v.index][slot]
                src += v.data
                s.where[t] = slot
        with torch.no_grad():
            _copy(dst, src, self._foreach)

    def advance(self, t):
        for s in self._slots:
            s.key, s.unique = (t, False), True

    def stored(self, view, version):
        return self._slot_views[view.index][self._slots[view.index].where[version]]

    def slots_state(self, view: StageView) -> dict:
        """The bookkeeping of ``view`` (``where``, ``free``, ``key``, ``unique``), for tests and checkpoints."""
        return self._slots[view.index].state()

    @property
    def nbytes(self):
        return sum(v.ring.numel() * v.ring.element_size() for v in self._delayed)

    def state_dict(self):
        return {"strategy": self.strategy, "slots": [s.state() for s in self._slots],
                "rings": [v.ring for v in self.views]}

    def load_state_dict(self, state):
        if state.get("strategy", self.strategy) != self.strategy:
            raise CheckpointError(f"the checkpoint's history was kept with memory={state['strategy']!r} but this "
                                  f"optimizer uses memory={self.strategy!r}: build it with the same memory mode")
        with torch.no_grad():
            for v, s, st, ring in zip(self.views, self._slots, state["slots"], state["rings"]):
                s.load(st)
                if v.ring is not None:
                    v.ring.copy_(ring)

    def storage_moved(self) -> bool:
        """Whether a parameter's storage changed since the history was built (``model.to(...)``)."""
        return any(a.data_ptr() != pa or b.data_ptr() != pb for a, pa, b, pb in self.ptrs)
