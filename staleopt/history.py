"""The weight history: which past versions ``w_v`` each stage keeps, where, and how views are loaded.

A :class:`History` alone owns the stored versions, the storage slots and the moves between the
slots and the parameters. :class:`~staleopt.optimizer.PipelineOptimizer` drives it through these
calls, and corrections read it through the :class:`StageView` protocol:

==========================  ==========================================================================
``load(targets)``           put version ``v_i`` (raw, or to be rewritten in place) into stage view ``i``
                            (forward, backward, and a recomputation's views, :mod:`staleopt.recompute`;
                            :class:`Targets`, relative to the step); the views in ``targets.bind`` may
                            instead point their parameters at the stored row
``restore()``               put ``w_t`` back into the parameters (their own storage)
``end_pass()``              no graph of this step's passes reads a row the parameters pointed at
``push(t)``                 the parameters hold ``w_t`` at rest: store it, forget ``w_{t - H_i}``
``advance(t)``              the base step wrote ``w_t`` into the parameters (their only copy)
``restart()``               before the first step: the parameters' content is ``w_0`` (every stored version)
``expire(views)``           no later load of this step reads ``w_{t - H_i}`` of these views (a strategy may drop it)
``stored(view, v)``         per-parameter tensors of stored version ``v`` (a correction may rewrite them)
``state_dict()`` / ``load_state_dict()``   everything above, for checkpoints
==========================  ==========================================================================

:class:`SlotHistory` keeps exactly the versions the delays need, ``H_i = max_t max(tau_fwd_i,
tau_bkwd_i)`` per stage (docs/design.md §1: ``w_{t-tau}`` with ``t - tau < 0`` is ``w_0``), in one
contiguous buffer of ``S_i`` slots per stage chunk. How a raw version reaches the parameters while
the parameters hold the only copy of another is the memory strategy's choice:

* :class:`SwapMoves` (``memory="minimal"``, the default): ``S_i = H_i``; the parameters trade
  places with the slot (three copies through a temporary buffer of at most
  :data:`SWAP_BLOCK_BYTES` at a time, larger parameters cut into pieces, freed at once), so the
  current weights ``w_t`` never need a slot of their own. Once the engine declared that no later
  load of the step reads ``w_{t - H_i}`` (:meth:`History.expire`), the parameters leave that
  version by one copy back from its row, which the swap left holding ``w_t``: ``w_{t - H_i}`` is
  dropped, ``w_t`` is stored (``push`` still copies the parameters there at ``step()``: design §1)
  and the view moves by plain copies until the step ends;
* :class:`CopyMoves` (``memory="fast"``): ``S_i = H_i + 1``; the parameters' content is saved to
  the slot of the version that just expired and the wanted version copied in (two copies, and
  ``push`` a third).

A stage whose backward view a correction rewrites in place (T2) needs a row for the raw version
it rewrites: it keeps ``H_i + 1`` rows and moves by :class:`CopyMoves` in either mode (the mode
still decides whether a pass may write over an expired version: :attr:`MoveStrategy.keeps_expired`).

Cheaper than any copy: a pass may *point* a view's parameters at the row of its forward version
(``p.data = row``, :meth:`SlotHistory.load`'s ``bind``) instead of copying it in. Autograd's saved
tensors then alias that row, so from the forward to the end of the pass's backward the row stays the
storage the pass reads (its *pass row*): the backward view must be written *into it*, never bound
elsewhere (a weight saved as a view, ``weight.t()`` in ``F.linear``, would keep reading the old
storage). So a view binds where its pass row need not change (backward version = forward version,
raw: weight stashing), where the row's version expires in this pass (``w_{t-H_i}`` read by the
step's last forward only, ``memory="minimal"``: the backward view is written over it; T2's views
too), or, in a view with a spare row (``"fast"``, and T2's in earlier passes), at the spare row with
the version copied in (nothing stored is lost). A dataflow step then moves the weights once in
``"minimal"`` (the backward load of ``w_t`` into ``w_{t-H}``'s row, which is ``push``), a stashing
step once (``push``), a pipemare step twice (``w_t`` into ``w_{t-H}``'s row, rewritten there by T2,
and ``push``). The parameters point at
their own storage again at ``restore()`` (eval, ``state_dict``, the end of a backward pass,
``step()``), and at the pass row again when a backward begins (:meth:`SlotHistory._plan_bound`).
Every move of one phase is batched over all stages: a few
``torch.cat``/``torch._foreach_copy_``/``torch.split_with_sizes_copy`` calls, whatever the number of
tensors. A load is planned once per (state, targets) relative to ``t`` and replayed afterwards (:class:`_Load`).
:class:`staleopt.reference.ReferenceHistory` is the readable version (every version kept, views
copied) that this one is tested against step by step.
"""
from __future__ import annotations

from itertools import chain
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .errors import CheckpointError, CorrectionError, LoopError

__all__ = ["StageView", "make_views", "Targets", "History", "SlotHistory", "MoveStrategy", "SwapMoves", "CopyMoves",
           "STRATEGIES", "SWAP_BLOCK_BYTES", "STATISTICS_DTYPE", "blocks"]

Target = Tuple[int, bool]  # (version, rewritten in place)
#: The dtype of a correction's running statistics (:meth:`StageView.zeros`) for parameters of a low-precision dtype.
STATISTICS_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
#: A swap goes through a temporary buffer of at most this many bytes at a time (larger parameters in pieces).
SWAP_BLOCK_BYTES = 1 << 24


def blocks(tensors: Sequence[torch.Tensor]) -> List[Tuple[int, int]]:
    """Index ranges ``[a, b)`` of ``tensors`` of at most :data:`SWAP_BLOCK_BYTES` together (a larger tensor
    alone): how the corrections bound a foreach call's weight-sized temporaries, whatever the model."""
    out: List[Tuple[int, int]] = []
    a, size = 0, 0
    for b, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if b > a and size + nbytes > SWAP_BLOCK_BYTES:
            out.append((a, b))
            a, size = b, 0
        size += nbytes
    if a < len(tensors):
        out.append((a, len(tensors)))
    return out


def _narrowings(shape: Tuple[int, ...], cap: int, dim: int) -> List[tuple]:
    """Cuts ``((dim, start, length), ...)`` of a tensor of ``shape`` (from dimension ``dim`` on) into
    pieces of at most ``cap`` elements: whole blocks of the first dimension that fit, else one index
    of it at a time, cut further along the next."""
    inner = 1
    for size in shape[dim + 1:]:
        inner *= size
    if inner * shape[dim] <= cap:
        return [()]
    if inner <= cap:
        step = cap // inner
        return [((dim, a, min(step, shape[dim] - a)),) for a in range(0, shape[dim], step)]
    return [((dim, a, 1),) + rest for a in range(shape[dim]) for rest in _narrowings(shape, cap, dim + 1)]


class StageView:
    """The parameters of one stage that share a device and dtype: the protocol corrections use.

    Attributes (read-only for corrections):

    * ``stage`` — the stage index ``i``;
    * ``params`` — its ``nn.Parameter`` objects, in partition order;
    * ``data`` — aliases of what the forward or backward pass reads now (``p.data``): the parameters'
      own storage, or during a pass the stored row they point at (:meth:`History.load`'s ``bind``); a
      correction that declared ``rewrites_backward_view`` rewrites these in place in
      :meth:`~staleopt.corrections.base.Correction.backward_view`; at ``step()`` the parameters' own;
    * ``numel`` — elements over all of ``params``;
    * ``H`` — versions the delays need, ``max_t max(tau_fwd_i, tau_bkwd_i)``;
    * ``ring`` — the ``(S, numel)`` slot buffer of a :class:`SlotHistory` (``None`` when ``S = 0``
      or in the reference history).

    Methods: :meth:`stored` (a stored version, writable), :meth:`zeros` (a new weight-sized buffer
    for a correction's own state) and :meth:`split` (per-parameter views of a flat buffer).
    """

    def __init__(self, history: "History", index: int, stage: int, params: List[nn.Parameter], depth: int,
                 data: Optional[List[torch.Tensor]] = None):
        self._history, self.index, self.stage, self.params, self.H = history, index, stage, params, depth
        # the tensors whose storage the passes read: the parameters (a replica's entry: its own tensor,
        # staleopt.replicas); data: aliases of that storage, so writes skip autograd's version counter
        self.owners: List[torch.Tensor] = list(params if data is None else data)
        self.data = [d.data for d in self.owners]
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

    def zeros(self, statistics: bool = False) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """A new zero flat buffer of this chunk's size and dtype (a correction's state) and its views.

        ``statistics``: the buffer holds a running statistic of squares or their ratios (a mean square, Adam's
        moments), kept in float32 where the parameters are float16 or bfloat16 (:data:`STATISTICS_DTYPE`): the
        square of a 1e-4 gradient and an ``eps`` of 1e-8 are 0 in float16, so ``x / (sqrt(v) + eps)`` would
        be ``inf`` or ``0/0``, as in a mixed-precision optimizer's float32 state. Arithmetic with it then runs in
        float32 (torch promotes), and what it writes into a parameter-dtype tensor is rounded once."""
        p0 = self.params[0]
        dtype = STATISTICS_DTYPE.get(p0.dtype, p0.dtype) if statistics else p0.dtype
        flat = torch.zeros(self.numel, dtype=dtype, device=p0.device)
        return flat, self.split(flat)

    def __repr__(self) -> str:
        return f"StageView(stage={self.stage}, tensors={len(self.params)}, numel={self.numel}, H={self.H})"


def make_views(history: "History", partition, depths: Sequence[int]) -> List[StageView]:
    """One view per (stage, device, dtype) of ``partition``; ``depths[i]`` is stage ``i``'s ``H_i``. A replica
    (:mod:`staleopt.replicas`) enters its stage's view as its tied parameter (``params``: gradient, optimizer
    state) with its own storage (``data``: the versions of that stage)."""
    master = {id(r.tensor): r.master for r in getattr(partition, "replicas", ())}
    views = []
    for stage in partition:
        by: Dict[tuple, List[torch.Tensor]] = {}
        for p in stage.params:
            by.setdefault((p.device, p.dtype), []).append(p)
        for ts in by.values():
            views.append(StageView(history, len(views), stage.index, [master.get(id(t), t) for t in ts],
                                   depths[stage.index], data=ts))
    return views


class Targets:
    """Where :meth:`History.load` brings the views, relative to the current step ``t``: ``rel[i] = (t - v_i,
    rewritten_i)`` (view ``i`` reads version ``v_i``, rewritten in place by a correction if ``rewritten_i``),
    and for a pass's forward ``bind``, ``{view: kind}`` (the views that may point their parameters at the stored
    version, :meth:`SlotHistory._plan_bound`; ``None`` elsewhere). Relative to ``t``, the same object serves
    every step with the same delays: the engine makes one per set of delays (its pass plans), and a history
    caches what a load does per state and ``Targets`` object (compared by identity, so that a load costs no
    work over every view)."""

    __slots__ = ("rel", "bind")

    def __init__(self, rel: Sequence[Tuple[int, bool]], bind: Optional[Dict[int, int]] = None):
        self.rel: Tuple[Tuple[int, bool], ...] = tuple((int(a), bool(m)) for a, m in rel)
        self.bind = bind

    def versions(self, t: int) -> List[Tuple[int, bool]]:
        """``(version, rewritten)`` per view at step ``t``."""
        return [(t - a, m) for a, m in self.rel]

    def __repr__(self) -> str:
        return f"Targets(rel={list(self.rel)}, bind={self.bind})"


class History:
    """The interface :class:`~staleopt.optimizer.PipelineOptimizer` drives (module docstring)."""

    views: Tuple[StageView, ...]
    strategy: str
    _t: int  # the current step: the parameters at rest hold w_t

    def load(self, targets: "Targets") -> Sequence[StageView]:
        """Bring view ``i`` to version ``t - targets.rel[i][0]``, rewritten in place if ``targets.rel[i][1]``;
        return the views to rewrite in place. ``targets.bind`` (a pass's forward): ``{view: kind}`` may point those
        views' parameters at the stored version instead of copying it in (:meth:`SlotHistory._plan_bound` says
        how, per kind; a history that copies ignores it)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put the current weights ``w_t`` back into the parameters (raw)."""
        at_rest = getattr(self, "_at_rest", None)
        if at_rest is None:
            at_rest = self._at_rest = Targets([(0, False)] * len(self.views))
        self.load(at_rest)

    def push(self, t: int) -> None:
        """Store ``w_t`` (in the parameters, at rest) and forget what no later step needs."""
        raise NotImplementedError

    def advance(self, t: int) -> None:
        """The parameters now hold ``w_t``, written by the base step, and no slot holds it."""
        raise NotImplementedError

    def end_pass(self) -> None:
        """No graph of this step's training passes reads a row the parameters pointed at any more (called at
        rest; :meth:`advance` implies it)."""

    def expire(self, views: Sequence[int]) -> None:
        """No later load of this step reads ``w_{t - H_i}`` of the views ``views`` (indices): a strategy may
        drop that version when the parameters leave it (it is the one ``push`` replaces). The declaration lasts
        until :meth:`advance`; a load of the version before it was dropped revokes it, a load after raises
        :class:`~staleopt.errors.LoopError`."""

    def restart(self) -> None:
        """At step 0, at rest: what the parameters hold now is ``w_0``, so every stored version
        (``w_v = w_0`` for ``v < 0``) becomes a copy of it (weights loaded after the engine was built)."""
        raise NotImplementedError

    def stored(self, view: StageView, version: int) -> List[torch.Tensor]:
        """Per-parameter tensors of ``view``'s stored ``version`` (writable)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def check_state_dict(self, state: dict) -> dict:
        """``state`` ready for :meth:`load_state_dict`, or :class:`~staleopt.errors.CheckpointError` where it
        cannot load (here: kept in another memory mode); nothing changes."""
        if state.get("strategy") != self.strategy:
            raise CheckpointError(f"the checkpoint's history was kept with memory={state.get('strategy')!r} but "
                                  f"this optimizer uses memory={self.strategy!r}: build it with the same memory mode")
        return state


class _Moves:
    """The data movements of one round of a phase, collected over all views and run batched.

    Symbolic, so that a round planned once replays at any step (:meth:`SlotHistory.load`): a
    reference ``(i, r)`` names view ``i``'s parameters (``r`` None) or the row of its version
    ``t - r``. ``swaps`` lists ``(i, r)``: the parameters and that row exchange contents (through a
    temporary buffer, block by block, :meth:`SlotHistory._swap`); then ``copies[0]`` and
    ``copies[1]`` run in this order (each a pair of destination and source reference lists). Views
    touch disjoint memory, so batching over views is exact.
    """

    __slots__ = ("swaps", "copies")

    def __init__(self):
        self.swaps: List[Tuple[int, int]] = []
        self.copies: Tuple[Tuple[list, list], ...] = (([], []), ([], []))


#: the fields of a :class:`_State`, in order
_FIELDS = ("loaded", "rewritten", "saved", "expired", "gone", "pass_rel", "held", "writable", "passing", "bound")


class _State:
    """The bookkeeping of a :class:`SlotHistory` relative to ``t``, immutable and interned (one object per
    distinct value, :meth:`SlotHistory._intern`). Per view: ``loaded`` (``t - v`` of the version the parameters
    hold), ``rewritten`` (rewritten in place), ``saved`` (``w_t`` is stored in its row; in a swap view before
    ``push``: ``w_{t-H}`` was dropped), ``expired`` (no later load of the step reads ``w_{t-H}``, :meth:`History.expire`),
    ``gone`` (``w_{t-H}`` was written over in its row); of the pass rows (:meth:`SlotHistory._plan_bound`):
    ``pass_rel`` (``t -`` the version of the row a pending pass's graph reads; ``None``: the parameters' own
    storage), ``held`` (what that row holds: ``(t - version, rewritten)``), ``writable`` (its version expired:
    the backward view is written over it); ``passing`` and ``bound``: the views with a pass row, and those whose
    parameters point at it now (in pointing order). ``rest``: every view's own storage holds ``w_t`` raw.
    ``next`` caches what the history does from this state (a load per :class:`Targets`, ``expire``, ``push``,
    ``end_pass``, ...): a steady step looks each up instead of building keys over every view."""

    __slots__ = _FIELDS + ("rest", "next")

    def __init__(self, values: tuple):
        for name, value in zip(_FIELDS, values):
            setattr(self, name, value)
        self.rest = all(a == 0 and not m for a, m in zip(self.loaded, self.rewritten))
        self.next: dict = {}

    def values(self) -> tuple:
        return tuple(getattr(self, name) for name in _FIELDS)


class _Draft:
    """A :class:`_State` being changed while a load is planned: its fields as lists, ``loaded`` as versions (``t``
    minus the state's), and what the strategies read of the history (``t``, ``H``, ``copy``, ``views``)."""

    def __init__(self, history: "SlotHistory", state: _State):
        t = self.t = history._t
        self.H, self.copy, self.views = history._H, history._copy, history.views
        self.loaded = [t - a for a in state.loaded]
        self.rewritten, self.saved, self.expired, self.gone = (list(x) for x in (state.rewritten, state.saved,
                                                                                 state.expired, state.gone))
        self.pass_rel, self.held, self.writable = list(state.pass_rel), list(state.held), list(state.writable)
        self.passing, self.bound = list(state.passing), list(state.bound)

    def values(self) -> tuple:
        t = self.t
        return (tuple([t - v for v in self.loaded]), tuple(self.rewritten), tuple(self.saved), tuple(self.expired),
                tuple(self.gone), tuple(self.pass_rel), tuple(self.held), tuple(self.writable), tuple(self.passing),
                tuple(self.bound))


class _Refs:
    """The tensors of a list of move references (:class:`_Moves`) at any step, in order: the parameters' own
    storage (``r`` None) and the row ``(t - r) mod M_i`` of view ``i``'s version ``t - r``; a list of parameters
    only is chained once (``fixed``)."""

    __slots__ = ("fixed", "rows")

    def __init__(self, history: "SlotHistory", refs: Sequence[Tuple[int, Optional[int]]]):
        data, slots, M = history._data, history._slot_views, history._M
        self.fixed = list(chain.from_iterable([data[i] for i, _ in refs])) \
            if all(r is None for _, r in refs) else None
        self.rows = tuple((data[i], None, 1) if r is None else (slots[i], r, M[i]) for i, r in refs)

    def at(self, t: int) -> List[torch.Tensor]:
        if self.fixed is not None:
            return self.fixed
        return list(chain.from_iterable([rows if r is None else rows[(t - r) % M] for rows, r, M in self.rows]))


class _Load:
    """What :meth:`SlotHistory.load` does from one state to one :class:`Targets`, planned once
    (:meth:`SlotHistory._plan`) and replayed at any step (references relative to ``t``, as in :class:`_Moves`):
    first the copies into the pass rows (``dst``, ``src``), then the ``rounds`` of :class:`_Moves` of the views in
    their own storage, then the views to point at the row of version ``t - r`` (``point``: ``(i, r)``). ``rewrite``:
    the views to rewrite in place (:class:`StageView`); ``state``: the :class:`_State` it leaves (``dst``/``src``:
    :class:`_Refs`, or ``None``; ``rounds``: ``(swaps, ((dst, src), ...))`` per round). ``owners``: the
    parameters of the views to point (flat); ``ends``/``homes``: the first and last parameter of each and their
    own storage's addresses (checked before pointing); ``bound_ends``/``release``: of every view pointing elsewhere
    once it ran, the first and last parameter, and all parameters with their own storage (flat, for
    :meth:`SlotHistory.restore`)."""

    __slots__ = ("dst", "src", "point", "owners", "ends", "homes", "bound_ends", "release", "rounds", "rewrite",
                 "state")

    def __init__(self, dst, src, point, owners, ends, homes, bound_ends, release, rounds, rewrite, state):
        self.dst, self.src, self.point, self.owners, self.ends, self.homes = dst, src, point, owners, ends, homes
        self.bound_ends, self.release, self.rounds, self.rewrite, self.state = \
            bound_ends, release, rounds, rewrite, state


_data_ptr = torch.Tensor.data_ptr


def _copy(dst: List[torch.Tensor], src: List[torch.Tensor], foreach: bool) -> None:
    if not dst:
        return
    if foreach:
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


class MoveStrategy:
    """How a :class:`SlotHistory` lays out a view's slots and moves versions in and out of the parameters."""

    name: str = ""
    #: a version that expired in the step's expected last pass stays stored until the step ends (the pass
    #: reads a copy of it): a step that runs again (one a GradScaler skipped, or more passes than expected)
    #: still finds it. Otherwise that pass's backward view is written over it (one copy fewer).
    keeps_expired: bool = False

    def rows(self, depth: int, rewritten: bool) -> int:
        """``M``: version ``v`` lives in row ``v mod M``; ``M = H + 1`` makes the view a copy view
        (:class:`CopyMoves`), ``M = H`` a swap view (:class:`SwapMoves`)."""
        raise NotImplementedError

    def plan(self, draft: _Draft, pending: List[int], targets: Sequence[Target],
             moves: _Moves) -> Callable[[], None]:
        """Queue into ``moves`` one round of symbolic moves (:class:`_Moves`) towards ``targets`` for the views
        ``pending``; return the bookkeeping the round leaves (the draft's ``loaded``/``rewritten``/``saved``),
        which :meth:`SlotHistory._plan` applies while it plans. Views not at their target after it get another
        round. The moves may depend on the targets and the bookkeeping relative to ``t`` only: a plan is
        replayed at later steps (:class:`_Load`)."""
        raise NotImplementedError


class CopyMoves(MoveStrategy):
    """``memory="fast"``: ``M = H_i + 1`` rows; when the parameters first leave ``w_t`` they are saved to
    row ``t mod M`` (whose version expired), and every view is a plain copy from its row (a view that a
    correction rewrites in place is rewritten in the parameters; its raw version stays in its row)."""

    name = "fast"
    keeps_expired = True

    def rows(self, depth, rewritten):
        return depth + 1 if depth else 0

    def plan(self, d, pending, targets, moves):
        t, loaded, rewritten, saved = d.t, d.loaded, d.rewritten, d.saved
        c1, c2 = moves.copies
        newly = [i for i in pending if not saved[i] and (targets[i][0] != t or targets[i][1])]
        for i in newly:  # save w_t to its row once
            c1[0].append((i, 0))
            c1[1].append((i, None))
        for i in pending:  # then copy the wanted row in (a raw view to be rewritten is already there)
            v = targets[i][0]
            if loaded[i] != v or rewritten[i]:
                c2[0].append((i, None))
                c2[1].append((i, t - v))

        def commit():
            for i in newly:
                saved[i] = True
            for i in pending:
                loaded[i], rewritten[i] = targets[i]
        return commit


class SwapMoves(MoveStrategy):
    """``memory="minimal"``: ``M = H_i`` rows hold ``w_{t-H_i} .. w_{t-1}``; the parameters hold ``w_t``.

    Loading ``w_v`` swaps the parameters with row ``v mod H`` (which then holds ``w_t`` until the
    parameters are restored by a second swap). When the parameters leave ``w_{t-H}`` of a view whose
    ``w_{t-H}`` expired (:meth:`History.expire`), one copy of that row (``w_t``) back into them
    replaces the swap: ``w_{t-H}`` is dropped and ``w_t`` stored in its row (``saved``, as ``push``
    would), so from then on the view loads by plain copies, like :class:`CopyMoves` with ``M = H``:
    a step of forward swap, copy back, no push moves the weights four times instead of seven (where
    the pass does not point the parameters at the row instead, :meth:`SlotHistory._plan_bound`: once).
    A view that a correction rewrites in place (T2) needs one more row for its raw version anyway, so
    it gets ``M = H + 1`` rows and :class:`CopyMoves`' plain copies (no swap, the same memory).
    """

    name = "minimal"
    _copies = CopyMoves()

    def rows(self, depth, rewritten):
        return depth + 1 if rewritten and depth else depth

    def plan(self, d, pending, targets, moves):
        t, loaded = d.t, d.loaded
        copies = [i for i in pending if d.copy[i]]
        commit_copies = self._copies.plan(d, copies, targets, moves) if copies else None
        done, dropped = [], []
        dst, src = moves.copies[1]
        for i in pending:
            if d.copy[i]:
                continue
            v, m = targets[i]
            if m:
                raise CorrectionError(f"stage {d.views[i].stage}: a correction rewrites a view the history did "
                                      "not reserve a row for (please report this)")
            L = loaded[i]
            if d.saved[i]:  # w_t is stored (w_{t-H} was dropped): a plain copy of the wanted row
                dst.append((i, None))
                src.append((i, t - v))
                done.append((i, v))
            elif L == t - d.H[i] and d.expired[i]:  # drop w_{t-H}: its row holds w_t since the swap
                dst.append((i, None))
                src.append((i, t - L))
                dropped.append(i)
                done.append((i, t))
            else:  # one swap: from w_t to w_v, or from w_L back to w_t (then, if v != t, another round to w_v)
                moves.swaps.append((i, t - (v if L == t else L)))
                done.append((i, v if L == t else t))

        def commit():
            if commit_copies is not None:
                commit_copies()
            for i, version in done:
                loaded[i] = version
            for i in dropped:
                d.saved[i] = True
        return commit


STRATEGIES = {s.name: s for s in (SwapMoves(), CopyMoves())}


class SlotHistory(History):
    """Exactly the versions the delays need, per view one ``(S_i, numel_i)`` buffer (module docstring).

    Version ``v`` lives in row ``v mod M_i`` (``v < 0`` is ``w_0``), so no table of slots is kept:
    per view the history only tracks which version the parameters hold, whether it was rewritten in
    place, whether ``w_t`` was already saved to its row, whether ``w_{t-H}`` expired and the pass rows:
    its :class:`_State`, relative to ``t`` and interned, on which every transition it took is cached.
    ``depths[i]`` is stage ``i``'s ``H_i``; ``rewritten[i]`` says a correction may rewrite stage ``i``'s
    backward view in place.
    """

    #: a history forgets its cached transitions once it made this many (random delays meet ever new ones)
    MAX_PLANS = 1024

    def __init__(self, partition, depths: Sequence[int], rewritten: Sequence[bool], strategy: MoveStrategy,
                 foreach: bool = True):
        self._foreach = foreach
        self._strategy = strategy
        self.strategy = strategy.name
        self.views = tuple(make_views(self, partition, depths))
        self._t = 0
        self._M: List[int] = []  # rows of the modular ring per view
        self._copy: List[bool] = []  # the view moves by plain copies (M = H + 1): no swaps
        self._slot_views: List[List[List[torch.Tensor]]] = []  # [view][row] -> per-parameter tensors
        for v in self.views:
            M = strategy.rows(v.H, rewritten[v.stage])
            views: List[List[torch.Tensor]] = []
            if M:
                p0 = v.params[0]
                v.ring = torch.empty((M, v.numel), dtype=p0.dtype, device=p0.device)
                views = [v.split(v.ring[s]) for s in range(M)]
                with torch.no_grad():
                    for s in range(M):
                        torch._foreach_copy_(views[s], v.data)  # w_v = w_0 for v < 0
            self._M.append(M)
            self._copy.append(bool(M) and M == v.H + 1)
            self._slot_views.append(views)
        self._delayed = [v.index for v in self.views if v.ring is not None]
        self._H = [v.H for v in self.views]
        n = len(self.views)
        self._states: Dict[tuple, _State] = {}  # the interned states (_intern)
        self._plans = 0  # transitions cached on them (_remember)
        self._at_rest_state = self._st = self._intern(((0,) * n, (False,) * n, (False,) * n, (False,) * n,
                                                       (False,) * n, (None,) * n, (None,) * n, (False,) * n, (), ()))
        self._at_rest = Targets([(0, False)] * n)
        self._swap_blocks: Dict[tuple, List[tuple]] = {}  # views swapped together -> their blocks
        self._pieces: List[list] = [[None] * M for M in self._M]  # [view][row] -> its pieces, as _blocks cuts them
        self._data = [v.data for v in self.views]  # aliases of the parameters' own storage
        # push's copy, the same at every step and from every state (:meth:`push`): w_t into row t mod M_i
        self._push_moves = (_Refs(self, [(i, 0) for i in self._delayed]),
                            _Refs(self, [(i, None) for i in self._delayed]))
        # binding (module docstring): a view of contiguous tensors may point its parameters at a row
        self._bindable = [M > 0 and all(d.is_contiguous() for d in v.data) for M, v in zip(self._M, self.views)]
        # the storage checks (load, restore; _moved) compare addresses: per view every parameter (owner) and the
        # addresses of its own storage (not only the first and last: `p.data = p.data * mask`, pruning, gives one
        # parameter new storage, which pointing it elsewhere and back would silently undo)
        self._ends = [tuple(v.owners) for v in self.views]
        self._home_ptrs = [tuple(x.data_ptr() for x in d) for d in self._data]
        # of the state's bound views: their ends, the addresses they were pointed at, and their parameters and own storage
        self._bound_ends: Tuple[torch.Tensor, ...] = ()
        self._bound_ptrs: List[int] = []
        self._release: Tuple[tuple, tuple] = ((), ())

    # ------------------------------------------------------------------ API
    def load(self, targets):
        """A view at rest whose target is a stored raw version and that ``targets.bind`` names points its
        parameters at a row (its pass row, :meth:`_plan_bound`); a view with a pass row loads into that row
        (module docstring). Planned once per (state, ``targets``), then replayed (:class:`_Load`)."""
        run = self._st.next.get(targets)
        if run is None:
            run = self._plan(targets)
        t = self._t
        if run.point and list(map(_data_ptr, run.ends)) != run.homes:
            raise self._moved([i for i, _ in run.point], home=True)
        if run.dst is not None:  # (rows and .data aliases: no autograd, no need for no_grad)
            _copy(run.dst.at(t), run.src.at(t), self._foreach)
        for swaps, copies in run.rounds:  # (of the views in their own storage: none of those it points)
            if swaps:
                M = self._M
                self._swap([(i, (t - r) % M[i]) for i, r in swaps])
            for dst, src in copies:
                _copy(dst.at(t), src.at(t), self._foreach)
        if run.point:  # the parameters (and data) point at the rows (last: a move that raised changed nothing)
            M, slots, views = self._M, self._slot_views, self.views
            rows = [slots[i][(t - r) % M[i]] for i, r in run.point]
            for owner, x in zip(run.owners, chain.from_iterable(rows)):
                owner.data = x
            for (i, _), tensors in zip(run.point, rows):
                views[i].data = tensors
            self._bound_ptrs += map(_data_ptr, run.ends)  # (where they point now)
            self._bound_ends, self._release = run.bound_ends, run.release
        self._st = run.state
        return run.rewrite

    def _plan(self, targets: Targets) -> _Load:
        """What :meth:`load` does from the current state to ``targets``: the pass rows' part (:meth:`_plan_bound`,
        where ``targets.bind`` names views or views have pass rows), then the moves of the views in their own
        storage (:meth:`_plan_load`); cached on the state. (:meth:`restore`'s targets leave the pass rows as they are.)"""
        t, state = self._t, self._st
        draft = _Draft(self, state)
        versions = targets.versions(t)
        if targets is not self._at_rest and (targets.bind or draft.passing):
            dst, src, point, rewrite, versions = self._plan_bound(draft, versions, targets.bind)
        else:
            dst, src, point, rewrite = (), (), (), ()
        rounds, more = self._plan_load(draft, versions)
        views, ends = self.views, self._ends
        run = _Load(_Refs(self, dst) if dst else None, _Refs(self, src) if dst else None, point,
                    tuple(chain.from_iterable([views[i].owners for i, _ in point])),
                    tuple(chain.from_iterable([ends[i] for i, _ in point])),
                    list(chain.from_iterable([self._home_ptrs[i] for i, _ in point])),
                    tuple(chain.from_iterable([ends[i] for i in draft.bound])),
                    (tuple(chain.from_iterable([views[i].owners for i in draft.bound])),
                     tuple(chain.from_iterable([self._data[i] for i in draft.bound]))),
                    tuple((tuple(m.swaps), tuple((_Refs(self, a), _Refs(self, b)) for a, b in m.copies if a))
                          for m in rounds),
                    tuple(views[i] for i in sorted(set(rewrite) | set(more))), self._intern(draft.values()))
        self._remember(state, targets, run)
        return run

    def _intern(self, values: tuple) -> _State:
        """The one :class:`_State` of these field values."""
        state = self._states.get(values)
        if state is None:
            state = self._states[values] = _State(values)
        return state

    def _remember(self, state: _State, key, value) -> None:
        """Cache a transition from ``state``; past :attr:`MAX_PLANS` of them, forget every cached one first."""
        if self._plans >= self.MAX_PLANS:
            keep = (state, self._at_rest_state, getattr(value, "state", value))
            for s in self._states.values():
                s.next.clear()
            self._states = {v: s for v, s in self._states.items() if any(s is k for k in keep)}
            self._plans = 0
        state.next[key] = value
        self._plans += 1

    def _derive(self, key, fields: Callable[[_State], dict]) -> _State:
        """The state that ``fields(state)`` (new values of some fields) makes of the current one, cached under
        ``key``."""
        state = self._st
        got = state.next.get(key)
        if got is None:
            new = fields(state)
            got = self._intern(tuple(new.get(name, value) for name, value in zip(_FIELDS, state.values())))
            self._remember(state, key, got)
        return got

    def _plan_bound(self, d: _Draft, targets: List[Target], bind: Optional[Dict[int, int]]) -> tuple:
        """Plan what :meth:`load` does with the views that have a pass row, and those ``bind`` gives one (rows
        pointed at, backward views written into them), changing the draft ``d`` as that does; returns
        ``(dst, src, point, rewrite, targets)``: the copies, the views to point at the row of version ``t - r``
        (``(i, r)``), the views to rewrite, and the targets left to :meth:`_plan_load` (those views at rest: their
        own storage holds ``w_t``).

        ``bind[i]`` (:class:`~staleopt.optimizer._PassPlan`): 0, the backward reads the forward's raw version
        (the pass row is its row, never written); 1, the forward's ``w_{t-H}`` expires in this pass (a swap
        view's pass row is its row, written over by the backward view: ``w_{t-H}`` is dropped, and so is a
        copy view's unless the strategy :attr:`~MoveStrategy.keeps_expired`); 2, neither. A copy view
        (``M = H + 1``) binds for 2, and for 1 where the strategy keeps expired versions, to its spare row
        ``t mod M`` (``w_{t-H-1}``, expired), the forward's version copied in; the backward view is then
        written over that copy, nothing is lost, and a raw ``w_t`` there is ``push``'s. References are
        relative to ``t`` (:class:`_Moves`)."""
        t, M, H = d.t, self._M, self._H
        pass_rel, held, writable, passing, bound, saved, gone = \
            d.pass_rel, d.held, d.writable, d.passing, d.bound, d.saved, d.gone
        pointing = set(bound)
        run = list(targets)
        dst, src, point, rewrite = [], [], [], []
        for i, kind in (bind or {}).items():
            v, m = targets[i]
            if (pass_rel[i] is not None or not self._bindable[i] or m or v == t or d.loaded[i] != t
                    or d.rewritten[i] or v < t - H[i] or (v == t - H[i] and (gone[i] or (
                    saved[i] and not self._copy[i])))):
                continue  # (copied in instead; a version no longer stored raises there)
            if kind == 0 or (kind == 1 and not self._strategy.keeps_expired):
                pass_rel[i] = t - v
            elif self._copy[i] and not saved[i]:
                pass_rel[i] = 0  # (the row of version t)
                dst.append((i, 0))
                src.append((i, t - v))
            else:
                continue
            held[i], writable[i] = (t - v, False), kind > 0
            passing.append(i)
        for i in passing:
            a, m = t - run[i][0], run[i][1]
            if (a, m) != held[i]:  # the backward (or recompute) view, written over the pass row
                if a == H[i] and (gone[i] or (saved[i] and not self._copy[i])):  # (a swap view: w_t is in its row)
                    raise self._dropped(i)
                if not writable[i]:
                    raise LoopError(f"stage {self.views[i].stage} reads version {t - a} at step {t}, but the graph of "
                                    f"a training forward of this step that read version {t - held[i][0]} still waits "
                                    "for its backward and reads the same storage: run each forward's backward before "
                                    "a forward with other delays (with microbatch_passes=True, microbatch j's "
                                    "backward before microbatch j + 1's forward)")
                dst.append((i, pass_rel[i]))
                src.append((i, None if a == 0 else a))
                held[i] = (a, m)
                pushed = (a, m) == (0, False) and pass_rel[i] % M[i] == 0
                if pass_rel[i] % M[i] == 0:  # the row of w_t: push's copy, or no longer w_t
                    saved[i] = pushed
                if pass_rel[i] == H[i] and not pushed:  # w_(t-H) written over (not by w_t in its own row)
                    gone[i] = True
                if m:
                    rewrite.append(i)
            if i not in pointing:
                point.append((i, pass_rel[i]))
                pointing.add(i)
                bound.append(i)
            run[i] = (t, False)
        return tuple(dst), tuple(src), tuple(point), tuple(rewrite), run

    def _dropped(self, i: int) -> LoopError:
        return LoopError(f"stage {self.views[i].stage} reads w_(t-{self._H[i]}) again at step {self._t}, but "
                         "memory='minimal' dropped that version in the backward pass of what the engine took for the "
                         "step's last training pass (it expects as many passes per step as the most any earlier step "
                         "ran, or microbatch_passes' N): this step runs more forward/backward passes than that (a "
                         "forward for logging or metrics in train mode with grad enabled counts as a pass: run it "
                         "under torch.no_grad() or model.eval()), runs a pass again after its backward raised (an "
                         "out-of-memory error caught and retried), or runs again after a step() that did not happen "
                         "(torch.amp.GradScaler skips step() after an inf or NaN gradient), or resumes a checkpoint "
                         "saved after the step's last backward and before its step() (save after opt.step()). Run "
                         "the same number of passes in every step (fewer is fine), or use memory='fast' (one more "
                         "version per delayed stage; it also trains through skipped steps and retried passes)")

    def _plan_load(self, d: _Draft, targets: List[Target]) -> Tuple[tuple, tuple]:
        """Check ``targets`` (versions) and plan the rounds of moves that bring the views in their own storage to them,
        changing the draft ``d`` as they do; returns the rounds and the views to rewrite (indices)."""
        t, loaded, rewritten = d.t, d.loaded, d.rewritten
        pending = [i for i in self._delayed if (loaded[i], rewritten[i]) != targets[i]]
        for i in pending:
            if not t - self._H[i] <= targets[i][0] <= t:
                raise CorrectionError(f"stage {self.views[i].stage}: weight version {targets[i][0]} is not stored "
                                      f"at step {t}; this is a bug in a correction's delays (please report it)")
            if targets[i][0] != t - self._H[i]:
                continue
            if not (d.saved[i] and not self._copy[i]) and not d.gone[i]:
                d.expired[i] = False  # read again: it did not expire (the engine expected fewer passes)
                continue
            raise self._dropped(i)
        rewrite = tuple(i for i in pending if targets[i][1])
        rounds = []
        while pending:  # at most two rounds: a view between two stale versions passes through w_t
            moves = _Moves()
            self._strategy.plan(d, pending, targets, moves)()
            rounds.append(moves)
            pending = [i for i in pending if (loaded[i], rewritten[i]) != targets[i]]
        return tuple(rounds), rewrite

    def _swap(self, swaps: List[Tuple[int, int]]) -> None:
        """Exchange the parameters of view ``i`` with its row ``r`` for every ``(i, r)`` in ``swaps``.

        Block by block (pieces of the views of one device and dtype, together at most
        :data:`SWAP_BLOCK_BYTES`; a larger parameter is cut into pieces): gather the parameters'
        pieces into a temporary flat buffer (``torch.cat``), copy the rows' pieces into them
        (``torch._foreach_copy_``), then the buffer into the rows (``torch.split_with_sizes_copy``).
        So the extra memory is at most one block, for the duration of one block's moves. The
        lists that do not depend on the rows are built once per set of views.
        """
        key = tuple(i for i, _ in swaps)
        blocks = self._swap_blocks.get(key)
        if blocks is None:
            if len(self._swap_blocks) >= 64:  # random delays (Hogwild) swap ever new sets of views
                self._swap_blocks.clear()
            blocks = self._swap_blocks[key] = self._blocks(key)
        pieces = self._pieces
        got = [pieces[i][r] or self._row_pieces(i, r) for i, r in swaps]
        for params, flat, sizes, where, whole in blocks:
            if whole is not None:  # every view of the block whole (the usual case): no slicing
                shaped = list(chain.from_iterable([got[k][0] for k in whole]))
                rows = list(chain.from_iterable([got[k][1] for k in whole]))
            else:
                shaped, rows = [], []
                for k, a, b in where:
                    shaped += got[k][0][a:b]
                    rows += got[k][1][a:b]
            temp = torch.cat(flat if all(f is not None for f in flat) else
                             [f if f is not None else p.reshape(-1) for p, f in zip(params, flat)])
            _copy(params, shaped, self._foreach)
            if self._foreach:
                torch.split_with_sizes_copy(temp, sizes, out=rows)
            else:
                for row, piece in zip(rows, temp.split(sizes)):
                    row.copy_(piece)

    def _cut(self, i: int) -> List[tuple]:
        """View ``i``'s pieces of at most :data:`SWAP_BLOCK_BYTES`: ``(parameter, start, stop, narrowings)``;
        ``start:stop`` slices a contiguous parameter's flat alias, else ``narrowings`` are
        ``(dim, start, length)`` cuts of a non-contiguous one (none: the whole parameter)."""
        view = self.views[i]
        cap = max(1, SWAP_BLOCK_BYTES // view.params[0].element_size())
        out = []
        for j, d in enumerate(self._data[i]):
            n = d.numel()
            if n <= cap:
                out.append((j, None, None, ()))
            elif d.is_contiguous():
                out += [(j, a, min(a + cap, n), ()) for a in range(0, n, cap)]
            else:
                out += [(j, None, None, cuts) for cuts in _narrowings(tuple(d.shape), cap, 0)]
        return out

    @staticmethod
    def _piece(t: torch.Tensor, start: Optional[int], stop: Optional[int], cuts: tuple) -> torch.Tensor:
        if start is not None:
            return t.view(-1)[start:stop]
        for dim, a, length in cuts:
            t = t.narrow(dim, a, length)
        return t

    def _row_pieces(self, i: int, r: int) -> Tuple[list, list]:
        """Row ``r`` of view ``i`` cut like the parameters: pieces shaped like theirs, and flat."""
        pieces = self._pieces[i][r]
        if pieces is None:
            shaped = [self._piece(self._slot_views[i][r][j], *cut) for j, *cut in self._cut(i)]
            pieces = self._pieces[i][r] = (shaped, [p.view(-1) for p in shaped])
        return pieces

    def _blocks(self, key: Tuple[int, ...]) -> List[tuple]:
        """The swap blocks of the views ``key``: ``(parameter pieces, their flat aliases or None, sizes,
        [(position in key, first piece, end piece)])``, pieces of one device and dtype, at most
        :data:`SWAP_BLOCK_BYTES` together (or one piece)."""
        by: Dict[tuple, List[list]] = {}
        for k, i in enumerate(key):
            view = self.views[i]
            p0 = view.params[0]
            blocks = by.setdefault((p0.device, p0.dtype), [[0, []]])
            for n, (j, *cut) in enumerate(self._cut(i)):
                piece = self._piece(self._data[i][j], *cut)
                size = piece.numel() * p0.element_size()
                if blocks[-1][1] and blocks[-1][0] + size > SWAP_BLOCK_BYTES:
                    blocks.append([0, []])
                blocks[-1][0] += size
                blocks[-1][1].append((k, n, piece))
        out = []
        for blocks in by.values():
            for _, members in blocks:
                params = [p for _, _, p in members]
                where: List[list] = []
                for k, n, _ in members:
                    if where and where[-1][0] == k:
                        where[-1][2] = n + 1
                    else:
                        where.append([k, n, n + 1])
                whole = all(a == 0 and b == len(self._cut(key[k])) for k, a, b in where)
                out.append((params, [p.view(-1) if p.is_contiguous() else None for p in params],
                            [p.numel() for p in params], [tuple(w) for w in where],
                            tuple(k for k, _, _ in where) if whole else None))
        return out

    def restore(self):
        bound = self._st.bound
        if bound:
            if list(map(_data_ptr, self._bound_ends)) != self._bound_ptrs:
                raise self._moved(bound, home=False)
            self._unpoint()
        if not self._st.rest:  # (the views not pointing elsewhere hold w_t in their own storage: rest)
            self.load(self._at_rest)
        # at rest the parameters are w_t's authority: a change made now (SAM's perturbation between two passes) is
        # part of w_t, so a copy view's row copy of w_t (a pass stored it) no longer counts as saved; the next load
        # saves the parameters again (push always copies)
        self._st = self._derive("at-rest", self._unsaved)

    def _unsaved(self, state: _State) -> dict:
        copy = self._copy
        return {"saved": tuple(s and not copy[i] for i, s in enumerate(state.saved))}

    def _moved(self, indices: Sequence[int], home: bool) -> Exception:
        """The error for views ``indices`` one of whose parameters is no longer its own storage (``home``)
        or the row it points at: something moved or replaced them, which pointing them elsewhere would silently
        undo. (Before pointing, :meth:`load` and :meth:`restore` compare those addresses all at once.)"""
        views = self.views
        for i in indices:
            owners, expected = views[i].owners, self._data[i] if home else views[i].data
            if any(o.data_ptr() != e.data_ptr() for o, e in zip(owners, expected)):
                return LoopError(f"the parameters of stage {views[i].stage} were moved or replaced after the "
                                 "PipelineOptimizer was built (e.g. model.to(device), module.half(), "
                                 "load_state_dict(assign=True), or p.data = new_tensor), here during a training "
                                 "step: build the optimizer after the model is on its device and in its dtype, and "
                                 "change weights in place (p.data.mul_(mask), or p.mul_(mask) under no_grad)")
        return CorrectionError("the storage check of the pointed parameters disagrees with their views (a bug: "
                               "please report it)")

    def _unpoint(self) -> None:
        """Every view's parameters (and ``data``) point at their own storage again (no data moves)."""
        bound = self._st.bound
        if bound:
            for owner, x in zip(*self._release):  # the parameters point at their own storage again
                owner.data = x
            views, data = self.views, self._data
            for i in bound:
                views[i].data = data[i]
            self._bound_ptrs, self._bound_ends, self._release = [], (), ((), ())
            self._st = self._derive("unpoint", lambda state: {"bound": ()})

    def end_pass(self):
        state = self._st
        if state.bound:
            raise CorrectionError("end_pass() with the parameters pointing at a row (a bug: please report it)")
        if state.passing:
            n = len(self.views)
            self._st = self._derive("end_pass", lambda state: {"pass_rel": (None,) * n, "held": (None,) * n,
                                                                "writable": (False,) * n, "passing": ()})

    def push(self, t):
        if t != self._t:
            raise CorrectionError(f"the history is at step {self._t}, not {t}: push follows advance")
        # w_t into its row (t mod M), which held w_{t-H} (fast: w_{t-H-1}), for every delayed view: also where a
        # pass already stored w_t there (the copy back of a dropped w_{t-H}, a pass row), as the parameters at
        # rest may have changed since (weight decay or a constraint applied between backward() and step() is part
        # of w_t, design §1), and no cheap test sees a change through .data
        todo = self._delayed
        if not todo:
            return
        rows, params = self._push_moves
        _copy(rows.at(t), params.at(t), self._foreach)
        self._st = self._derive("pushed", lambda state: {"saved": tuple(
            s or i in todo for i, s in enumerate(state.saved))})

    def expire(self, views):
        views = tuple(views)

        def fields(state):
            marked = set(views)
            return {"expired": tuple(e or i in marked for i, e in enumerate(state.expired))}
        self._st = self._derive(("expire", views), fields)

    def advance(self, t):
        self.end_pass()
        self._t, self._st = t, self._at_rest_state

    def restart(self):
        if self._t != 0 or not self._st.rest:
            raise CorrectionError("the history restarts only at step 0 with the parameters at rest (a bug: "
                                  "please report it)")
        with torch.no_grad():
            for i in self._delayed:
                _copy(list(chain.from_iterable(self._slot_views[i][:self._M[i]])),
                      self._data[i] * self._M[i], self._foreach)
        self._st = self._derive("restart", lambda state: {"saved": (False,) * len(self.views)})
        self.end_pass()  # (every row was written)

    def stored(self, view, version):
        i, t, state = view.index, self._t, self._st
        saved = state.saved[i]
        # the ring's M rows hold t - M + 1 .. t once w_t is pushed (minimal: M = H, so pushing w_t
        # overwrote w_{t-H}), else t - H .. t - 1
        oldest = t - self._M[i] + 1 if saved else t - view.H
        if state.gone[i]:  # (its row was written over by a backward view)
            oldest = max(oldest, t - view.H + 1)
        if not oldest <= version <= (t if saved else t - 1):
            raise CorrectionError(f"stage {view.stage}: weight version {version} is not stored at step {t} "
                                  f"(stored: {oldest}..{t if saved else t - 1}; w_t is stored once "
                                  f"step() pushed it, and then replaced w_(t-{self._M[i]}))")
        return self._slot_views[i][version % self._M[i]]

    @property
    def nbytes(self):
        return sum(self.views[i].ring.numel() * self.views[i].ring.element_size() for i in self._delayed)

    def state_dict(self):
        t, state = self._t, self._st
        return {"strategy": self.strategy, "t": t, "loaded": [t - a for a in state.loaded], "rows": list(self._M),
                "rewritten": list(state.rewritten), "saved": list(state.saved), "gone": list(state.gone),
                "rings": [v.ring for v in self.views]}

    def check_state_dict(self, state):
        """``state`` in today's layout (a format-0 one converted), or :class:`CheckpointError` where it cannot load
        (another memory mode; rows that differ, of a history not saved at rest): checked before anything loads."""
        if "slots" in state:  # format 0: a table of slots per view
            state = self._from_slot_tables(state)
        super().check_state_dict(state)
        t, rows = int(state["t"]), self._saved_rows(state)
        for v, old in zip(self.views, rows):
            if v.ring is not None and old != self._M[v.index] and (state["loaded"][v.index] != t
                                                                   or state["rewritten"][v.index]):
                raise CheckpointError("this checkpoint's history was not saved at rest (the parameters did "
                                      "not hold w_t): save it with opt.state_dict(), which restores w_t first")
        return state

    def _saved_rows(self, state) -> List[int]:
        """Rows per view of the saved history (before "rows" was saved, minimal mode kept a rewritten view in
        H rows plus a spare one)."""
        return state.get("rows") or [v.H if self.strategy == "minimal" else M for v, M in zip(self.views, self._M)]

    def load_state_dict(self, state):
        state = self.check_state_dict(state)
        self._unpoint()  # (a pass that was under way is over: its graph reads versions of another history)
        self.end_pass()
        t, saved = int(state["t"]), list(state["saved"])
        with torch.no_grad():
            for v, ring, old in zip(self.views, state["rings"], self._saved_rows(state)):
                if v.ring is None:
                    continue
                M = self._M[v.index]
                if old == M:
                    v.ring.copy_(ring)
                    continue
                for version in range(t - v.H, t + int(saved[v.index])):  # the versions stored at rest
                    v.ring[version % M].copy_(ring[version % old])
        self._t, n = t, len(self.views)
        # (expired: the engine declares it again from its pass counts; no pass rows: end_pass)
        self._st = self._intern((tuple(t - int(v) for v in state["loaded"]), tuple(map(bool, state["rewritten"])),
                                 tuple(map(bool, saved)), (False,) * n,
                                 tuple(map(bool, state.get("gone") or [False] * n)), (None,) * n, (None,) * n,
                                 (False,) * n, (), ()))

    def _from_slot_tables(self, state: dict) -> dict:
        """Format 0 (``where``/``free``/``key``/``unique`` per view, saved at rest) in today's layout."""
        rings, saved, t = [], [], None
        for v, slots, ring in zip(self.views, state["slots"], state["rings"]):
            version, modified = slots["key"]
            if modified or (t is not None and version != t):
                raise CheckpointError("this format-0 checkpoint was not saved at rest (the parameters did not "
                                      "hold w_t): save it with opt.state_dict(), which restores w_t first")
            t = version
            if ring is None:
                rings.append(None)
                saved.append(False)
                continue
            where = {int(k): int(s) for k, s in slots["where"].items()}
            M = self._M[v.index]
            new = torch.empty_like(ring)
            for w, s in where.items():
                if t - v.H <= w < t or (w == t and self._copy[v.index]):
                    new[w % M] = ring[s]
            rings.append(new)
            saved.append(self._copy[v.index] and t in where)
        n = len(self.views)
        return {"strategy": self.strategy, "t": t or 0, "loaded": [t or 0] * n, "rewritten": [False] * n,
                "saved": saved, "rings": rings, "rows": list(self._M)}
