"""Event-by-event execution of pipeline schedules: the ground truth for the delays (DESIGN §4).

:func:`simulate` runs a schedule slot by slot. Every forward (``F``) and
backward (``B``) pass takes one slot on one *worker* (a row of the space-time
diagram: a stage, a stage's forward or backward unit, or an accelerator); a
pass may start once the pass it depends on finished in an earlier slot
(``F`` of microbatch ``m`` at stage ``i`` after ``F`` at stage ``i-1``; ``B`` at
stage ``i`` after ``B`` at stage ``i+1``, and at the last stage after its
``F``). Each worker runs its program (the schedule) in order, greedily.

Version semantics (DESIGN §1). Microbatch ``m`` belongs to minibatch
``t = m // N``. A stage's *version* is the number of updates it has applied;
it applies the update of minibatch ``t`` (producing ``w_{t+1}``) at the end of
the slot in which the last backward of minibatch ``t`` at that stage finishes.
A pass reads the version current at the start of its slot, except where the
schedule says otherwise (stashing: the backward reads the version its forward
read; 2BW: a fixed version per minibatch). The delay of a read is ``t - v``:
the optimizer step that consumes the gradient is step ``t``, and it read
``w_v``. Reads before the first update give ``v = 0``, i.e. ``w_{t - tau}``
with ``t - tau < 0`` means ``w_0``.

Diagrams below use ``P = 4``, ``N = 2`` and 2 minibatches unless noted; a cell
is ``F``/``B`` and the global microbatch id, ``.`` is a bubble (idle slot).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, Tuple

from .errors import ScheduleError
from .validate import check_int

__all__ = ["Event", "Timeline", "simulate", "names", "kind_of"]

Item = Tuple[int, str, int]          # (stage, "F" | "B", microbatch)
Op = Tuple[Item, ...]                # one cell: usually one pass, two for pipelined backprop's last stage


@dataclass(frozen=True)
class Event:
    """One pass: ``worker`` ran pass ``kind`` of ``microbatch`` at ``stage`` in ``slot``, reading ``w_version``."""

    slot: int
    worker: int
    stage: int
    kind: str
    microbatch: int
    minibatch: int
    version: int

    @property
    def delay(self) -> int:
        """``t - v`` in optimizer steps (minibatch updates)."""
        return self.minibatch - self.version


# ----------------------------------------------------------------------------- programs

def _gpipe(P: int, N: int, K: int):
    """GPipe: all forwards of a minibatch, then its backwards in reverse order; flush every minibatch.

    Utilization ``N / (N + P - 1)`` (PipeMare App. A.1). ``P = 4, N = 2``::

        slot       0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19
        stage 0   F0  F1   .   .   .   .   .   .  B1  B0  F2  F3   .   .   .   .   .   .  B3  B2
        stage 1    .  F0  F1   .   .   .   .  B1  B0   .   .  F2  F3   .   .   .   .  B3  B2   .
        stage 2    .   .  F0  F1   .   .  B1  B0   .   .   .   .  F2  F3   .   .  B3  B2   .   .
        stage 3    .   .   .  F0  F1  B1  B0   .   .   .   .   .   .  F2  F3  B3  B2   .   .   .
    """
    programs = []
    for i in range(P):
        prog = []
        for t in range(K):
            mbs = range(t * N, (t + 1) * N)
            prog += [((i, "F", m),) for m in mbs] + [((i, "B", m),) for m in reversed(mbs)]
        programs.append(prog)
    return [f"stage {i}" for i in range(P)], programs


def _one_f_one_b_flush(P: int, N: int, K: int):
    """PipeDream-Flush (2BW paper §3.2): 1F1B inside each minibatch, then a flush.

    Stage ``i`` runs ``min(P-1-i, N)`` warm-up forwards, alternates forward and
    backward, and drains; at most ``min(P-i, N)`` microbatches are in flight.
    Same utilization as GPipe, ``N / (N + P - 1)``. ``P = 4, N = 2``::

        slot       0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19
        stage 0   F0  F1   .   .   .   .   .  B0   .  B1  F2  F3   .   .   .   .   .  B2   .  B3
        stage 1    .  F0  F1   .   .   .  B0   .  B1   .   .  F2  F3   .   .   .  B2   .  B3   .
        stage 2    .   .  F0  F1   .  B0   .  B1   .   .   .   .  F2  F3   .  B2   .  B3   .   .
        stage 3    .   .   .  F0  B0  F1  B1   .   .   .   .   .   .  F2  B2  F3  B3   .   .   .
    """
    programs = []
    for i in range(P):
        prog = []
        for t in range(K):
            mbs = list(range(t * N, (t + 1) * N))
            w = min(P - 1 - i, N)
            prog += [((i, "F", m),) for m in mbs[:w]]
            for k in range(N - w):
                prog += [((i, "F", mbs[w + k]),), ((i, "B", mbs[k]),)]
            prog += [((i, "B", m),) for m in mbs[N - w:]]
        programs.append(prog)
    return [f"stage {i}" for i in range(P)], programs


def _one_f_one_b(P: int, N: int, K: int):
    """1F1B without flush (PipeDream §3.2; PipeOptim §II "Vanilla-1F1B").

    Stage ``i`` admits ``P - i`` microbatches, then alternates one backward and
    one forward forever: no bubbles in steady state (utilization 1). The
    forward of microbatch ``j`` of minibatch ``t`` at stage ``i`` reads
    ``w_{t - ceil((P-1-i-j)/N)}``; the backward reads the current weights
    (delay 0), or with stashing the forward's version. ``P = 4, N = 2``, 3 minibatches::

        slot       0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17
        stage 0   F0  F1  F2  F3   .   .   .  B0  F4  B1  F5  B2   .  B3   .  B4   .  B5
        stage 1    .  F0  F1  F2   .   .  B0  F3  B1  F4  B2  F5  B3   .  B4   .  B5   .
        stage 2    .   .  F0  F1   .  B0  F2  B1  F3  B2  F4  B3  F5  B4   .  B5   .   .
        stage 3    .   .   .  F0  B0  F1  B1  F2  B2  F3  B3  F4  B4  F5  B5   .   .   .
    """
    M = N * K
    programs = []
    for i in range(P):
        w = min(P - i, M)
        prog = [((i, "F", m),) for m in range(w)]
        for k in range(M - w):
            prog += [((i, "B", k),), ((i, "F", w + k),)]
        prog += [((i, "B", m),) for m in range(M - w, M)]
        programs.append(prog)
    return [f"stage {i}" for i in range(P)], programs


def _two_bw(P: int, N: int, K: int):
    """PipeDream-2BW (2BW paper §3.1): the 1F1B program with double-buffered weights.

    Every microbatch of minibatch ``t`` reads, at every stage and in both
    passes, the newest version that *all* stages had generated when the
    minibatch's first forward entered stage 0. With ``N >= P`` that is
    ``w_{t-1}`` (the paper's ``max(floor((k-1)/m) - 1, 0)``; ``w_t`` when
    ``P = 1``), and each stage keeps at most 2 versions. The program is
    :func:`_one_f_one_b`'s; ``N >= P`` is required (2BW paper §3.1: ``m >= d``).
    ``P = 2, N = 2``, 3 minibatches, ``@v`` the version read::

        slot         0     1     2     3     4     5     6     7     8     9    10    11    12    13
        stage 0   F0@0  F1@0     .  B0@0  F2@0  B1@0  F3@0  B2@0  F4@1  B3@0  F5@1  B4@1     .  B5@1
        stage 1      .  F0@0  B0@0  F1@0  B1@0  F2@0  B2@0  F3@0  B3@0  F4@1  B4@1  F5@1  B5@1     .
    """
    return _one_f_one_b(P, N, K)


def _dataflow(P: int, N: int, K: int):
    """Dataflow pipeline (PipeMare Fig. 1(c), App. A.1): each stage has a forward and a backward unit.

    Both units run every slot, so ``F`` of microbatch ``m`` at stage ``i`` runs
    in slot ``m + i`` and its ``B`` in slot ``m + 2P - 1 - i``: ``2(P-1-i) + 1``
    slots apart, hence ``tau_fwd = ceil((2(P-1-i) + 1 - j)/N)`` for microbatch
    ``j`` of a minibatch (``j = 0`` gives PipeMare's ``ceil((2(P-i)+1)/N)``,
    1-based ``i``) and ``tau_bkwd = 0``. Utilization 1. ``P = 4, N = 2``::

        slot         0   1   2   3   4   5   6   7   8   9  10
        stage 0 F   F0  F1  F2  F3   .   .   .   .   .   .   .
        stage 0 B    .   .   .   .   .   .   .  B0  B1  B2  B3
        stage 1 F    .  F0  F1  F2  F3   .   .   .   .   .   .
        stage 1 B    .   .   .   .   .   .  B0  B1  B2  B3   .
        stage 2 F    .   .  F0  F1  F2  F3   .   .   .   .   .
        stage 2 B    .   .   .   .   .  B0  B1  B2  B3   .   .
        stage 3 F    .   .   .  F0  F1  F2  F3   .   .   .   .
        stage 3 B    .   .   .   .  B0  B1  B2  B3   .   .   .
    """
    M = N * K
    labels, programs = [], []
    for i in range(P):
        labels += [f"stage {i} F", f"stage {i} B"]
        programs += [[((i, "F", m),) for m in range(M)], [((i, "B", m),) for m in range(M)]]
    return labels, programs


def _pipelined_backprop(P: int, N: int, K: int):
    """Pipelined backpropagation on ``2P - 1`` accelerators (stale-weights paper §3, Fig. 4).

    Accelerator ``a < P-1`` runs the forward of stage ``a``; accelerator
    ``P-1`` runs the last stage's forward and backward in the same cycle
    (cell ``X``); accelerator ``P-1+k`` runs the backward of stage ``P-1-k``.
    The forward and backward of stage ``i`` are ``2(P-1-i)`` cycles apart (the
    paper's "degree of staleness" ``2(K-i+1)``, 1-based ``i``, ``K = P-1``), hence
    ``tau_fwd = ceil((2(P-1-i) - j)/N)`` for microbatch ``j``, ``tau_bkwd = 0``;
    utilization 1. ``P = 3, N = 1``, 4 minibatches::

        slot               0   1   2   3   4   5   6   7
        accel 0 (F0)      F0  F1  F2  F3   .   .   .   .
        accel 1 (F1)       .  F0  F1  F2  F3   .   .   .
        accel 2 (F2+B2)    .   .  X0  X1  X2  X3   .   .
        accel 3 (B1)       .   .   .  B0  B1  B2  B3   .
        accel 4 (B0)       .   .   .   .  B0  B1  B2  B3
    """
    M = N * K
    labels, programs = [], []
    for a in range(P - 1):
        labels.append(f"accel {a} (F{a})")
        programs.append([((a, "F", m),) for m in range(M)])
    labels.append(f"accel {P - 1} (F{P - 1}+B{P - 1})")
    programs.append([((P - 1, "F", m), (P - 1, "B", m)) for m in range(M)])
    for k in range(1, P):
        labels.append(f"accel {P - 1 + k} (B{P - 1 - k})")
        programs.append([((P - 1 - k, "B", m),) for m in range(M)])
    return labels, programs


# name -> (program builder, stashing, version policy)
_KINDS: Dict[str, Tuple[Callable, bool, str]] = {
    "gpipe": (_gpipe, False, "current"),
    "pipedream-flush": (_one_f_one_b_flush, False, "current"),
    "1f1b": (_one_f_one_b, False, "current"),
    "pipedream": (_one_f_one_b, True, "current"),
    "2bw": (_two_bw, True, "2bw"),
    "dataflow": (_dataflow, False, "current"),
    "dataflow-stash": (_dataflow, True, "current"),
    "pb": (_pipelined_backprop, False, "current"),
}
_ALIASES = {"sync": "gpipe", "1f1b-flush": "pipedream-flush", "pipedream-2bw": "2bw",
            "pipemare-stash": "dataflow-stash"}


def names() -> List[str]:
    """Timeline names accepted by :func:`simulate` (method names also work, see :func:`kind_of`)."""
    return sorted(set(_KINDS) | set(_ALIASES))


def kind_of(schedule) -> str:
    """The timeline that executes ``schedule`` (a timeline, schedule or method name, or a Schedule).

    Method names resolve through :func:`staleopt.methods.resolve`: the
    schedule's timeline, with stashing if the method stashes. Corrections that
    only change views or step sizes (T1, T2, prediction) do not change which
    version a pass reads, so e.g. ``pipemare`` runs the ``dataflow`` timeline.
    """
    from .schedules import Schedule
    if isinstance(schedule, str):
        if schedule in _KINDS:
            return schedule
        if schedule in _ALIASES:
            return _ALIASES[schedule]
    if not isinstance(schedule, (str, Schedule)):
        raise ScheduleError(f"schedule must be a name or a Schedule, got {type(schedule).__name__}")
    from . import methods
    from .corrections import Stashing
    sched, corrections = methods.resolve(schedule)
    stash = any(isinstance(c, Stashing) for c in corrections)
    if any(type(c).__name__ == "VerticalSync" for c in corrections):
        raise ScheduleError("no timeline models vertical sync yet; simulate 'pipedream' instead")
    base = {"sync": "gpipe", "1f1b": "1f1b", "2bw": "2bw", "dataflow": "dataflow", "pb": "pb"}.get(sched.name)
    if base is None:
        raise ScheduleError(f"schedule {sched.name!r} has no timeline (its delays are not produced by a "
                            f"fixed pipeline); timelines: {', '.join(names())}")
    if stash:
        base = {"1f1b": "pipedream", "dataflow": "dataflow-stash", "2bw": "2bw"}.get(base, base)
    return base


# ----------------------------------------------------------------------------- execution

def _run(kind: str, P: int, N: int, K: int):
    builder, stash, policy = _KINDS[kind]
    if policy == "2bw" and P > 1 and N < P:
        raise ScheduleError(f"2BW needs at least as many microbatches per minibatch as stages "
                            f"(2BW paper §3.1, m >= d): got N={N} < P={P}; raise microbatches")
    labels, programs = builder(P, N, K)
    done: Dict[Item, int] = {}
    fwd_version: Dict[Tuple[int, int], int] = {}
    mb_version: Dict[int, int] = {}                  # 2BW: the version every pass of minibatch t reads
    version = [0] * P
    backwards_done = [[0] * K for _ in range(P)]
    pos = [0] * len(programs)
    events: List[Event] = []
    updates: List[Tuple[int, int, int]] = []         # (stage, slot, minibatch)
    remaining = sum(len(p) for p in programs)
    slot = 0
    while remaining:
        ran = []
        for w, prog in enumerate(programs):
            if pos[w] == len(prog):
                continue
            op = prog[pos[w]]
            if not all(_ready(item, op, done, slot, P) for item in op):
                continue
            for item in op:
                stage, kind_, m = item
                t = m // N
                if policy == "2bw":
                    if t not in mb_version:          # first pass of minibatch t is its first forward at stage 0
                        mb_version[t] = min(version)
                    v = mb_version[t]
                elif kind_ == "B" and stash:
                    v = fwd_version[(stage, m)]
                else:
                    v = version[stage]
                if kind_ == "F":
                    fwd_version[(stage, m)] = v
                events.append(Event(slot, w, stage, kind_, m, t, v))
                done[item] = slot
                if kind_ == "B":
                    ran.append((stage, t))
            pos[w] += 1
            remaining -= 1
        for stage, t in ran:                          # updates land at the end of the slot
            backwards_done[stage][t] += 1
            if backwards_done[stage][t] == N:
                if version[stage] != t:
                    raise AssertionError(f"{kind}: stage {stage} finished minibatch {t} out of order")
                version[stage] = t + 1
                updates.append((stage, slot, t))
        slot += 1
        if slot > 4 * (remaining + len(events)) + 4 * P + 8:   # a correct program never idles this long
            raise AssertionError(f"{kind}: deadlock at slot {slot}")
    return labels, events, updates, slot


def _ready(item: Item, op: Op, done: Dict[Item, int], slot: int, P: int) -> bool:
    stage, kind, m = item
    if kind == "F":
        dep = (stage - 1, "F", m) if stage > 0 else None
    else:
        dep = (stage + 1, "B", m) if stage < P - 1 else (stage, "F", m)
    if dep is None:
        return True
    if dep in op:                                     # same cell, earlier in the cell (pipelined backprop)
        return op.index(dep) < op.index(item)
    return done.get(dep, slot) < slot


class Timeline:
    """The executed schedule: events, derived delays, utilization, in-flight counts, diagrams.

    Derived quantities that describe the schedule itself (``tau_*``,
    ``steady_state_utilization``) are read from a long internal run, so they
    do not depend on how many minibatches were simulated; the others describe
    this run.
    """

    def __init__(self, kind: str, stages: int, microbatches: int, minibatches: int):
        self.kind, self.stages, self.microbatches, self.minibatches = kind, stages, microbatches, minibatches
        self.workers, self.events, self.updates, self.slots = _run(kind, stages, microbatches, minibatches)

    def __repr__(self):
        return (f"Timeline({self.kind!r}, stages={self.stages}, microbatches={self.microbatches}, "
                f"minibatches={self.minibatches}, slots={self.slots})")

    # -- delays --------------------------------------------------------------------------
    @cached_property
    def _long(self) -> "Timeline":
        P, N = self.stages, self.microbatches
        K = 4 * P + 6
        return self if self.minibatches >= K else Timeline(self.kind, P, N, K)

    def _delays(self, kind: str) -> Tuple[Tuple[int, ...], ...]:
        long = self._long
        t = long.minibatches // 2 + 1                 # past the fill, before the drain, and t > every delay
        out = [[None] * self.microbatches for _ in range(self.stages)]
        for e in long.events:
            if e.minibatch == t and e.kind == kind:
                if e.version == 0:
                    raise AssertionError(f"{self.kind}: minibatch {t} still reads w_0; run longer")
                out[e.stage][e.microbatch - t * self.microbatches] = e.delay
        return tuple(tuple(row) for row in out)

    @cached_property
    def tau_fwd_microbatch(self) -> Tuple[Tuple[int, ...], ...]:
        """``[i][j]``: delay of the forward of microbatch ``j`` of a minibatch at stage ``i`` (steady state)."""
        return self._delays("F")

    @cached_property
    def tau_bkwd_microbatch(self) -> Tuple[Tuple[int, ...], ...]:
        """``[i][j]``: delay of the backward of microbatch ``j`` of a minibatch at stage ``i`` (steady state)."""
        return self._delays("B")

    @property
    def tau_fwd(self) -> List[int]:
        """Per-stage forward delay: the largest over a minibatch's microbatches (its first, ``j = 0``)."""
        return [max(row) for row in self.tau_fwd_microbatch]

    @property
    def tau_bkwd(self) -> List[int]:
        """Per-stage backward delay: the largest over a minibatch's microbatches."""
        return [max(row) for row in self.tau_bkwd_microbatch]

    @property
    def uniform(self) -> bool:
        """True when all microbatches of a minibatch read the same version at every stage and pass.

        Then a per-stage delay describes the schedule exactly, as the
        delay-queue optimizer assumes; otherwise ``tau_*`` are the oldest reads.
        """
        return all(len(set(row)) == 1 for rows in (self.tau_fwd_microbatch, self.tau_bkwd_microbatch)
                   for row in rows)

    # -- utilization ---------------------------------------------------------------------
    @property
    def cells(self) -> Dict[Tuple[int, int], List[Event]]:
        """``(worker, slot) -> events`` of the busy cells."""
        out: Dict[Tuple[int, int], List[Event]] = {}
        for e in self.events:
            out.setdefault((e.worker, e.slot), []).append(e)
        return out

    @property
    def utilization(self) -> float:
        """Busy cells over ``workers x slots`` for this finite run (fill and drain included)."""
        return len(self.cells) / (len(self.workers) * self.slots)

    @cached_property
    def period(self) -> int:
        """Slots between consecutive minibatches in steady state (every pass shifts by it)."""
        long = self._long
        t = long.minibatches // 2
        first = {}
        for e in long.events:
            first[(e.worker, e.stage, e.kind, e.microbatch)] = e.slot
        N = self.microbatches
        shifts = {first[(w, s, k, m + N)] - first[(w, s, k, m)]
                  for (w, s, k, m) in first if t * N <= m < (t + 2) * N}
        if len(shifts) != 1:
            raise AssertionError(f"{self.kind}: not periodic in steady state (shifts {sorted(shifts)})")
        return shifts.pop()

    @property
    def steady_state_utilization(self) -> float:
        """Busy cells per minibatch over ``workers x period``: the fraction of busy worker-slots."""
        long = self._long
        t = long.minibatches // 2
        busy = {(e.worker, e.slot) for e in long.events if e.minibatch == t}
        return len(busy) / (len(self.workers) * self.period)

    # -- memory-related counts -----------------------------------------------------------
    @cached_property
    def peak_in_flight(self) -> List[int]:
        """Per stage, the most microbatches whose forward there finished and whose backward did not.

        Counted at slot ends: the number of activation stashes the stage holds
        (PipeMare App. A.2: ``2(P-1-i) + 1`` for the dataflow pipeline, 0-based ``i``).
        """
        fwd, bwd = {}, {}
        for e in self.events:
            (fwd if e.kind == "F" else bwd)[(e.stage, e.microbatch)] = e.slot
        peak = [0] * self.stages
        for i in range(self.stages):
            changes = {}
            for (s, m), f in fwd.items():
                if s == i and bwd[(s, m)] > f:
                    changes[f] = changes.get(f, 0) + 1
                    changes[bwd[(s, m)]] = changes.get(bwd[(s, m)], 0) - 1
            level = 0
            for slot in sorted(changes):
                level += changes[slot]
                peak[i] = max(peak[i], level)
        return peak

    @cached_property
    def peak_versions(self) -> List[int]:
        """Per stage, the most weight versions held at once: the current one plus older ones still to be read."""
        peak = [1] * self.stages
        upd = {(s, t): slot for s, slot, t in self.updates}
        for i in range(self.stages):
            reads = [(e.slot, e.version) for e in self.events if e.stage == i]
            for slot, _ in reads:
                current = sum(1 for (s, t), u in upd.items() if s == i and u < slot)
                older = {v for sl, v in reads if sl >= slot and v < current}
                peak[i] = max(peak[i], 1 + len(older))
        return peak

    # -- rendering -----------------------------------------------------------------------
    def ascii(self, versions: bool = False) -> str:
        """Space-time diagram: a row per worker, a column per slot; ``.`` is a bubble.

        A cell is the pass (``F``, ``B``, or ``X`` for a forward and backward in
        one cell) and the global microbatch id; with ``versions=True`` also
        ``@v``, the weight version read.
        """
        cells = {}
        for (w, slot), evs in self.cells.items():
            kind = evs[0].kind if len(evs) == 1 else "X"
            cells[(w, slot)] = f"{kind}{evs[0].microbatch}" + (f"@{evs[0].version}" if versions else "")
        width = max([len(c) for c in cells.values()] + [len(str(self.slots - 1)), 1]) + 2
        label = max(len(w) for w in self.workers + ["slot"]) + 1
        lines = ["slot".ljust(label) + "".join(str(s).rjust(width) for s in range(self.slots))]
        for w, name in enumerate(self.workers):
            lines.append(name.ljust(label) + "".join(cells.get((w, s), ".").rjust(width)
                                                     for s in range(self.slots)))
        return "\n".join(line.rstrip() for line in lines)

    def plot(self, ax=None, versions: bool = False):
        """Draw the space-time diagram on ``ax`` (see :func:`staleopt.plot.timeline.plot_timeline`)."""
        from .plot.timeline import plot_timeline
        return plot_timeline(self, ax=ax, versions=versions)

    def summary(self) -> str:
        """Derived delays, utilization and in-flight counts as text."""
        rows = [f"timeline {self.kind}: P={self.stages} N={self.microbatches} minibatches={self.minibatches}",
                f"  tau_fwd  = {self.tau_fwd}", f"  tau_bkwd = {self.tau_bkwd}"]
        if not self.uniform:
            rows.append("  per microbatch j of a minibatch (microbatches read different versions):")
            rows.append(f"    tau_fwd[i][j]  = {[list(r) for r in self.tau_fwd_microbatch]}")
            rows.append(f"    tau_bkwd[i][j] = {[list(r) for r in self.tau_bkwd_microbatch]}")
        rows += [f"  utilization: steady state {self.steady_state_utilization:.4f}, "
                 f"this run {self.utilization:.4f} ({self.slots} slots)",
                 f"  peak in-flight microbatches per stage = {self.peak_in_flight}",
                 f"  peak weight versions per stage = {self.peak_versions}"]
        return "\n".join(rows)


def simulate(schedule, stages: int, microbatches: int = 1, minibatches: int = 3) -> Timeline:
    """Execute ``schedule`` on ``stages`` stages for ``minibatches`` minibatches of ``microbatches`` each.

    ``schedule``: a timeline name (``gpipe``/``sync``, ``pipedream-flush``,
    ``1f1b``, ``pipedream``, ``2bw``/``pipedream-2bw``, ``dataflow``,
    ``pipemare-stash``, ``pb``), any method name (resolved by
    :func:`kind_of`), or a :class:`~staleopt.schedules.Schedule`.

    >>> tl = simulate("1f1b", stages=4, microbatches=1, minibatches=8)
    >>> tl.tau_fwd, tl.tau_bkwd
    ([3, 2, 1, 0], [0, 0, 0, 0])
    """
    kind = kind_of(schedule)
    check_int("stages", stages, minimum=1)
    check_int("microbatches", microbatches, minimum=1)
    check_int("minibatches", minibatches, minimum=1)
    return Timeline(kind, stages, microbatches, minibatches)
