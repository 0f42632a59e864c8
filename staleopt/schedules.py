"""Pipeline schedules: where the weight delays come from (docs/design.md §2).

A schedule turns ``(P, N)`` — stages and microbatches per minibatch — into
per-stage delays ``tau_fwd[i]`` and ``tau_bkwd[i]``, counted in optimizer steps.
Stage ``i`` is 0-based, stage 0 next to the input.

==========  ==========================================  ========================  ==========
name        meaning                                     tau_fwd[i]                tau_bkwd[i]
==========  ==========================================  ========================  ==========
sync        flush every minibatch (GPipe, PD-Flush)     0                         0
dataflow    fully asynchronous dataflow accelerator     ceil((2(P-1-i)+1)/N)      0
            (PipeMare §2, App. A.1)
dataflow-   dataflow with PipeMare Recompute in         ceil((2(P-1-i)+1)/N)      0
recompute   segments (App. A.3): tau_recomp =
            ceil((2(b_i-i)+1)/N)
1f1b        one-forward-one-backward, no stashing       ceil((P-1-i)/N)           0
            (PipeOptim §II "Vanilla-1F1B")
pb          pipelined backprop, 2P-1 accelerators       ceil(2(P-1-i)/N)          0
            (stale-weights paper §3)
2bw         PipeDream-2BW double-buffered weights       1 (0 when P = 1; N >= P)  = tau_fwd
            (2BW paper §3.1)
hogwild     per-stage random delays, truncated          random each step,         = tau_fwd
            exponential (PipeMare App. E)               mean = dataflow's
custom      user-given arrays (and tau_recomp)          given                     given
==========  ==========================================  ========================  ==========

Every schedule also has a recompute delay ``tau_recomp[i]``, the version an
activation recomputation reads (PipeMare App. D.1): ``tau_bkwd`` (a
recomputation inside the backward pass) unless the schedule recomputes ahead
of the backward (``dataflow-recompute``; :meth:`Schedule.recompute_delays`).

With ``N > 1``, microbatch ``j`` of a minibatch sees ``ceil((D_i - j)/N)`` in
the asynchronous pipelines (``D_i`` = 2(P-1-i)+1, P-1-i, 2(P-1-i)); the table
gives ``j = 0``, the largest (:meth:`Schedule.microbatch_delays`).

For example ``P=4, N=1``::

    schedule   tau_fwd        tau_bkwd
    dataflow   [7, 5, 3, 1]   [0, 0, 0, 0]
    1f1b       [3, 2, 1, 0]   [0, 0, 0, 0]
    pb         [6, 4, 2, 0]   [0, 0, 0, 0]

A schedule object owns every fact about its pipeline, so the other modules
ask it instead of keeping tables of their own: the delays above
(:meth:`Schedule.delays`, :meth:`Schedule.microbatch_delays`), its rules
(:meth:`Schedule.check`, e.g. 2BW's ``N >= P``), the program that
:mod:`staleopt.timeline` executes and the version a pass reads there
(:meth:`Schedule.program`, :attr:`Schedule.version_policy`), and what
:mod:`staleopt.hardware` prices: the steady-state utilization, the
microbatches in flight per stage and the weight versions it stores besides
the current one (:meth:`Schedule.utilization`, :meth:`Schedule.in_flight`,
:meth:`Schedule.extra_versions`). ``sync`` flushes in one of two orders, GPipe's
(all forwards, then all backwards) or PipeDream-Flush's (1F1B inside the
minibatch): same delays and utilization, fewer microbatches in flight.

Weight stashing, vertical sync and the phases (warmup, hybrid) are
corrections, not schedules (``staleopt.corrections``); named methods bundle a
schedule with corrections (``staleopt.methods``). A method name is accepted
wherever a schedule name is: :func:`staleopt.methods.build` does the lookup.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .errors import DelayError, ScheduleError
from .validate import check_int

__all__ = ["Schedule", "Sync", "Dataflow", "DataflowRecompute", "OneFOneB", "PipelinedBackprop", "TwoBW",
           "Hogwild", "Custom", "get", "names", "register", "Delays", "Item", "Op", "Program"]

Delays = Tuple[List[int], List[int]]
Item = Tuple[int, str, int]          # (stage, "F" | "R" | "B", microbatch); R: a recomputation (App. A.3)
Op = Tuple[Item, ...]                # one cell: usually one pass, two for pipelined backprop's last stage,
                                     # none for a cell a worker deliberately idles (recompute runs just in time)
#: Row labels and each row's cells in order; a row is a worker: a stage, a stage's forward or backward
#: unit, or an accelerator.
Program = Tuple[List[str], List[List[Op]]]


class Schedule:
    """Base class. Subclasses implement :meth:`delays`; random schedules also :meth:`sample`;
    pipelines that a timeline executes also :meth:`program` and :meth:`in_flight`."""

    name: str = "schedule"
    description: str = ""
    paper: str = ""
    #: True when delays change from step to step (then :meth:`sample` draws them).
    random: bool = False
    #: Which version a pass reads in the executed timeline: ``"current"``, the stage's newest at the
    #: start of the slot (or, with stashing, the backward reads its forward's); ``"minibatch"``, one
    #: version for every pass of a minibatch, fixed when its first forward enters stage 0 (2BW).
    version_policy: str = "current"

    def check(self, stages: int, microbatches: int = 1) -> None:
        """Raise a typed error unless the schedule runs ``stages`` stages with ``microbatches`` per minibatch."""
        check_int("stages", stages, minimum=1)
        check_int("microbatches", microbatches, minimum=1, why="microbatches per minibatch")

    def delays(self, stages: int, microbatches: int = 1) -> Delays:
        """Per-stage ``(tau_fwd, tau_bkwd)``; for random schedules, the largest possible delays."""
        raise NotImplementedError

    def sample(self, stages: int, microbatches: int, generator: torch.Generator) -> Delays:
        """Delays for one step. Deterministic schedules return :meth:`delays`."""
        return self.delays(stages, microbatches)

    def extra_bytes(self) -> int:
        """Bytes of the tensors the schedule keeps to draw delays (a random schedule's table); in the wrapper's
        ``memory_bytes()``."""
        return 0

    def microbatch_delays(self, stages: int, microbatches: int) -> Tuple[List[List[int]], List[List[int]]]:
        """``tau[i][j]``: the delay microbatch ``j`` of a minibatch sees at stage ``i``.

        Default: every microbatch sees the minibatch's delay. Pipelines that run
        the microbatches of one minibatch across an update (1F1B, dataflow, pb)
        override it; :mod:`staleopt.timeline` derives the same tables from events.
        """
        tf, tb = self.delays(stages, microbatches)
        return [[t] * microbatches for t in tf], [[t] * microbatches for t in tb]

    def recompute_delays(self, stages: int, microbatches: int = 1) -> List[int]:
        """Per-stage ``tau_recomp``: the version an activation recomputation of stage ``i`` reads during the
        backward pass (PipeMare App. D.1, ``tau_fwd >= tau_recomp >= tau_bkwd``).

        Default ``tau_bkwd``: a recomputation run inside the backward pass (torch's
        own checkpoint) reads what the backward reads. :class:`DataflowRecompute`
        runs it ahead of the backward, on older weights.
        """
        return list(self.delays(stages, microbatches)[1])

    def microbatch_recompute_delays(self, stages: int, microbatches: int) -> List[List[int]]:
        """``tau_recomp[i][j]`` for microbatch ``j`` of a minibatch (default: the backward's)."""
        return self.microbatch_delays(stages, microbatches)[1]

    def segments(self, stages: int) -> List[Tuple[int, int]]:
        """``(first, last)`` stage of each recompute segment (PipeMare App. A.3); ``[]`` without recompute."""
        return []

    def cached_inputs(self, stages: int, microbatches: int = 1) -> List[int]:
        """Per stage, microbatch inputs kept for a later recomputation in steady state (0 without recompute)."""
        self.check(stages, microbatches)
        return [0] * stages

    def without_recompute(self) -> "Schedule":
        """The same pipeline keeping every activation from its forward (itself when it does not recompute)."""
        return self

    def utilization(self, stages: int, microbatches: int = 1) -> float:
        """Steady-state fraction of busy pipeline workers (PipeMare §2): 1 for the asynchronous pipelines."""
        self.check(stages, microbatches)
        return 1.0

    def in_flight(self, stages: int, microbatches: int = 1) -> List[int]:
        """Per stage, the microbatches whose activations it holds at once in steady state."""
        raise ScheduleError(f"schedule {self.name!r} has no fixed pipeline, so no activation count; "
                            f"use a pipeline schedule ({', '.join(pipelines())}) or a method built on one")

    def extra_versions(self, stages: int, microbatches: int = 1) -> List[int]:
        """Per stage, the weight versions the schedule itself stores besides the current one (stashing adds its own)."""
        self.check(stages, microbatches)
        return [0] * stages

    def program(self, stages: int, microbatches: int, minibatches: int) -> Program:
        """What each worker runs, in order, for ``minibatches`` minibatches (:func:`staleopt.timeline.simulate`)."""
        raise ScheduleError(f"schedule {self.name!r} has no timeline (its delays are not produced by a fixed "
                            f"pipeline); pipeline schedules: {', '.join(pipelines())}")

    def timeline_name(self, stash: bool = False) -> str:
        """The name of the executed pipeline, with or without weight stashing (``1f1b`` and ``pipedream``)."""
        return f"{self.name}-stash" if stash else self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _depth_delays(depths: Sequence[int], microbatches: int) -> List[List[int]]:
    """``tau[i][j] = max(0, ceil((D_i - j)/N))``: microbatch ``j`` of a minibatch is read ``D_i - j``
    microbatch slots before the minibatch's update, and updates come every ``N`` microbatches."""
    return [[max(0, math.ceil((d - j) / microbatches)) for j in range(microbatches)] for d in depths]


class _DepthSchedule(Schedule):
    """A schedule whose stage ``i`` reads its weights ``D_i`` microbatch slots before they update."""

    def depths(self, stages: int) -> List[int]:
        raise NotImplementedError

    def delays(self, stages, microbatches=1):
        tf, tb = self.microbatch_delays(stages, microbatches)
        return [row[0] for row in tf], [row[0] for row in tb]

    def microbatch_delays(self, stages, microbatches):
        self.check(stages, microbatches)
        return _depth_delays(self.depths(stages), microbatches), [[0] * microbatches for _ in range(stages)]


# ----------------------------------------------------------------------------- programs
# Each program's docstring draws it for a few minibatches; a cell is ``F``/``B`` and the
# global microbatch id, ``.`` a bubble (tests/test_timeline.py renders and compares them).

def _gpipe(P: int, N: int, K: int) -> Program:
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


def _one_f_one_b_flush(P: int, N: int, K: int) -> Program:
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


def _one_f_one_b(P: int, N: int, K: int) -> Program:
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


def _two_bw(P: int, N: int, K: int) -> Program:
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


def _dataflow(P: int, N: int, K: int) -> Program:
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


def _pipelined_backprop(P: int, N: int, K: int) -> Program:
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


def _dataflow_recompute(P: int, N: int, K: int, segments: Sequence[Tuple[int, int]]) -> Program:
    """Dataflow pipeline with PipeMare Recompute (App. A.3): a forward, recompute and backward unit per stage.

    Forward and backward run as in :func:`_dataflow` (``F`` of microbatch ``m``
    at stage ``i`` in slot ``m + i``, ``B`` in slot ``m + 2P - 1 - i``). The
    stages form segments ``[a, b]``; the first stage of a segment keeps its
    input, and the recompute unit of stage ``i`` recomputes microbatch ``m`` in
    slot ``m + i + 2(P-1-b)``: "in advance so that the recomputed activation of
    the last stage in a segment arrives right at the time when the corresponding
    backpropagation needs" it (App. A.3; ``R`` at ``b`` runs beside ``B`` at
    ``b + 1``). Stage ``i`` therefore holds a recomputed activation ``2(b-i) + 1``
    slots and its segment's first stage an input ``2(P-1-b)`` slots (App. A.3:
    ``2(S-j)`` and ``2(P-i)``), and the three passes of microbatch ``j`` of a
    minibatch read ``tau_fwd = ceil((2(P-1-i)+1-j)/N) > tau_recomp =
    ceil((2(b-i)+1-j)/N) > tau_bkwd = 0`` (App. D.1). In the segment holding the
    last stage the recompute falls in the forward's own slot (``b = P - 1``:
    ``tau_recomp = tau_fwd``, the forward's activations). An idle cell (``.``)
    before a unit's first recompute is part of its program. ``P = 4``, segments
    ``[0, 1], [2, 3]``, ``N = 1``, 4 minibatches::

        slot         0   1   2   3   4   5   6   7   8   9  10
        stage 0 F   F0  F1  F2  F3   .   .   .   .   .   .   .
        stage 0 R    .   .   .   .  R0  R1  R2  R3   .   .   .
        stage 0 B    .   .   .   .   .   .   .  B0  B1  B2  B3
        stage 1 F    .  F0  F1  F2  F3   .   .   .   .   .   .
        stage 1 R    .   .   .   .   .  R0  R1  R2  R3   .   .
        stage 1 B    .   .   .   .   .   .  B0  B1  B2  B3   .
        stage 2 F    .   .  F0  F1  F2  F3   .   .   .   .   .
        stage 2 R    .   .  R0  R1  R2  R3   .   .   .   .   .
        stage 2 B    .   .   .   .   .  B0  B1  B2  B3   .   .
        stage 3 F    .   .   .  F0  F1  F2  F3   .   .   .   .
        stage 3 R    .   .   .  R0  R1  R2  R3   .   .   .   .
        stage 3 B    .   .   .   .  B0  B1  B2  B3   .   .   .
    """
    M = N * K
    last = {i: b for a, b in segments for i in range(a, b + 1)}
    labels, programs = [], []
    for i in range(P):
        labels += [f"stage {i} F", f"stage {i} R", f"stage {i} B"]
        idle = i + 2 * (P - 1 - last[i])
        programs += [[((i, "F", m),) for m in range(M)],
                     [()] * idle + [((i, "R", m),) for m in range(M)],
                     [((i, "B", m),) for m in range(M)]]
    return labels, programs


# ----------------------------------------------------------------------------- schedules

class Sync(Schedule):
    """Flush every minibatch: no staleness; ``order`` is how the passes of a minibatch run.

    ``"gpipe"``: all forwards, then all backwards (GPipe), ``N`` microbatches in
    flight per stage; ``"1f1b"``: one-forward-one-backward inside the minibatch
    (PipeDream-Flush, 2BW paper §2), ``min(P - i, N)`` in flight. Both idle
    ``P - 1`` of ``N + P - 1`` slots per minibatch: utilization ``N / (N + P - 1)``
    (PipeMare App. A.1).
    """

    name, paper = "sync", "GPipe; PipeDream-2BW §2 (PipeDream-Flush)"
    description = "synchronous: the pipeline is flushed every minibatch, no staleness"
    _ORDERS = {"gpipe": ("gpipe", _gpipe), "1f1b": ("pipedream-flush", _one_f_one_b_flush)}

    def __init__(self, order: str = "gpipe"):
        if order not in self._ORDERS:
            raise ScheduleError(f"sync order must be one of {', '.join(map(repr, self._ORDERS))} (GPipe or "
                                f"PipeDream-Flush), got {order!r}")
        self.order = order

    def delays(self, stages, microbatches=1):
        self.check(stages, microbatches)
        return [0] * stages, [0] * stages

    def utilization(self, stages, microbatches=1):
        self.check(stages, microbatches)
        return microbatches / (microbatches + stages - 1)

    def in_flight(self, stages, microbatches=1):
        self.check(stages, microbatches)
        if self.order == "gpipe":
            return [microbatches] * stages
        return [min(stages - i, microbatches) for i in range(stages)]

    def program(self, stages, microbatches, minibatches):
        self.check(stages, microbatches)
        return self._ORDERS[self.order][1](stages, microbatches, minibatches)

    def timeline_name(self, stash=False):
        return self._ORDERS[self.order][0]          # every delay is 0: stashing changes no read

    def __repr__(self):
        # The order is left out: both orders give every pass delay 0, so an optimizer steps the same under
        # either, and the repr (a checkpoint's signature records it) stays what it always was.
        return "Sync()"


class Dataflow(_DepthSchedule):
    name, paper = "dataflow", "PipeMare §2, App. A.1"
    description = "fully asynchronous dataflow pipeline: tau_fwd = ceil((2(P-1-i)+1)/N), tau_bkwd = 0"

    def depths(self, stages):
        return [2 * (stages - 1 - i) + 1 for i in range(stages)]

    def in_flight(self, stages, microbatches=1):
        """``2(P-1-i) + 1`` (PipeMare App. A.2, 0-based ``i``)."""
        self.check(stages, microbatches)
        return [2 * (stages - 1 - i) + 1 for i in range(stages)]

    def program(self, stages, microbatches, minibatches):
        self.check(stages, microbatches)
        return _dataflow(stages, microbatches, minibatches)


class DataflowRecompute(Dataflow):
    """The dataflow pipeline with PipeMare Recompute in segments of ``segment`` stages (PipeMare App. A.3, D.1).

    Segments ``[0, S-1], [S, 2S-1], ...`` (the last may be shorter); ``segment=None``
    takes ``S = round(sqrt(P))``, App. A.3's memory minimum ``O(M P^{3/2})``. The
    first stage of a segment keeps its input; the recompute of stage ``i`` runs
    just in time for its backward (:func:`_dataflow_recompute`), so it reads
    weights newer than the forward's and older than the backward's::

        tau_recomp_i = ceil((2(b_i - i) + 1 - j)/N),   b_i the last stage of i's segment

    between ``tau_fwd_i = ceil((2(P-1-i) + 1 - j)/N)`` and ``tau_bkwd_i = 0``
    (App. D.1: ``tau_fwd > tau_recomp > tau_bkwd``; equal to ``tau_fwd`` in the
    segment holding the last stage, which keeps its forward activations). Stage
    ``i`` holds ``2(b_i - i) + 1`` recomputed activations and a segment's first
    stage ``a`` ``2(P-1-b)`` inputs (App. A.3: ``O(2(P-i) + S^2)`` per segment).
    Utilization 1 on its ``3P`` units; the recompute units are App. A.3's
    "approximately 25% of the total compute", which utilization does not price.
    """

    name, paper = "dataflow-recompute", "PipeMare App. A.3, App. D.1"
    description = ("dataflow pipeline with PipeMare Recompute in segments: tau_fwd > tau_recomp > tau_bkwd = 0, "
                   "tau_recomp = ceil((2(b-i)+1)/N)")

    def __init__(self, segment: Optional[int] = None):
        self.segment = check_int("recompute segment", segment, minimum=1, optional=True, error=ScheduleError,
                                 why="stages per segment")

    def _size(self, stages):
        return max(1, round(math.sqrt(stages))) if self.segment is None else self.segment

    def check(self, stages, microbatches=1):
        super().check(stages, microbatches)
        if self._size(stages) > stages:
            raise ScheduleError(f"a recompute segment of {self.segment} stages does not fit in {stages} stages: "
                                f"pass segment <= {stages} (or None for round(sqrt(P)))")

    def segments(self, stages):
        self.check(stages)
        S = self._size(stages)
        return [(a, min(a + S, stages) - 1) for a in range(0, stages, S)]

    def recompute_depths(self, stages):
        """``2(b_i - i) + 1``: slots between stage ``i``'s recomputation and its backward."""
        return [2 * (b - i) + 1 for a, b in self.segments(stages) for i in range(a, b + 1)]

    def recompute_delays(self, stages, microbatches=1):
        return [row[0] for row in self.microbatch_recompute_delays(stages, microbatches)]

    def microbatch_recompute_delays(self, stages, microbatches):
        self.check(stages, microbatches)
        return _depth_delays(self.recompute_depths(stages), microbatches)

    def in_flight(self, stages, microbatches=1):
        """Recomputed activations held per stage: ``2(b_i - i) + 1`` (App. A.3's ``S^2`` term per segment)."""
        return self.recompute_depths(stages)

    def cached_inputs(self, stages, microbatches=1):
        """``2(P-1-b)`` at a segment's first stage ``a`` (App. A.3's ``2(P - i)``), 0 elsewhere."""
        out = [0] * stages
        for a, b in self.segments(stages):
            out[a] = 2 * (stages - 1 - b)
        return out

    def without_recompute(self):
        return Dataflow()

    def program(self, stages, microbatches, minibatches):
        self.check(stages, microbatches)
        return _dataflow_recompute(stages, microbatches, minibatches, self.segments(stages))

    def __repr__(self):
        return f"DataflowRecompute(segment={self.segment})"


class OneFOneB(_DepthSchedule):
    name, paper = "1f1b", "PipeOptim §II (Vanilla-1F1B); PipeDream §3.2 without stashing"
    description = "one-forward-one-backward without weight stashing: tau_fwd = ceil((P-1-i)/N), tau_bkwd = 0"

    def depths(self, stages):
        return [stages - 1 - i for i in range(stages)]

    def in_flight(self, stages, microbatches=1):
        """``P - i``: stage ``i`` admits ``P - i`` microbatches before its first backward."""
        self.check(stages, microbatches)
        return [stages - i for i in range(stages)]

    def program(self, stages, microbatches, minibatches):
        self.check(stages, microbatches)
        return _one_f_one_b(stages, microbatches, minibatches)

    def timeline_name(self, stash=False):
        return "pipedream" if stash else "1f1b"


class PipelinedBackprop(_DepthSchedule):
    """Pipelined backprop (stale-weights paper §3): ``tau_fwd_i = ceil(2(P-1-i)/N)``.

    The paper pipelines whole minibatches (``N = 1``: ``2(P-1-i)``, docs/design.md §2).
    With ``N`` microbatches per minibatch the executed pipeline
    (:mod:`staleopt.timeline`) applies one update per ``N`` microbatches, so the
    delay in minibatch steps is ``ceil(2(P-1-i)/N)``, as for the other schedules.
    """

    name, paper = "pb", "Pipelined training with stale weights of deep CNNs, §3"
    description = "pipelined backpropagation on 2P-1 accelerators: tau_fwd = ceil(2(P-1-i)/N), tau_bkwd = 0"

    def depths(self, stages):
        return [2 * (stages - 1 - i) for i in range(stages)]

    def in_flight(self, stages, microbatches=1):
        """``2(P-1-i)``, the paper's degree of staleness (stale-weights §3: stage ``i`` stores its activations for
        that many cycles), and 1 at the last stage, whose forward and backward run in one cycle: it still holds
        that microbatch's activations while it runs (with ``P = 1``, plain training's one; §6.6 prices the
        pipelined copies on top of it). Counted at slot ends, as PipeMare App. A.2 counts the dataflow
        pipeline's ``2(P-1-i) + 1``, plus a microbatch whose forward and backward share the slot
        (:attr:`~staleopt.timeline.Timeline.peak_in_flight`)."""
        self.check(stages, microbatches)
        return [max(2 * (stages - 1 - i), 1) for i in range(stages)]

    def program(self, stages, microbatches, minibatches):
        self.check(stages, microbatches)
        return _pipelined_backprop(stages, microbatches, minibatches)


class TwoBW(Schedule):
    """PipeDream-2BW (2BW paper §3.1): every pass of minibatch ``t`` reads ``w_{t-1}``; needs ``N >= P``.

    The 1F1B program with double-buffered weights: ``P - i`` microbatches in
    flight at stage ``i`` (at most the pipeline depth) and one stored version
    besides the current one. With one stage there is no pipeline and so no
    second buffer in use: delay 0.
    """

    name, paper = "2bw", "PipeDream-2BW §3.1"
    description = "double-buffered weights: every stage reads the previous version, forward = backward"
    version_policy = "minibatch"

    def check(self, stages, microbatches=1):
        super().check(stages, microbatches)
        if stages > 1 and microbatches < stages:
            raise ScheduleError(f"2BW keeps two weight versions only with at least as many microbatches per "
                                f"minibatch as stages (2BW paper §3.1, m >= d): got N={microbatches} < "
                                f"P={stages}; pass microbatches >= {stages}")

    def delays(self, stages, microbatches=1):
        self.check(stages, microbatches)
        if stages == 1:
            return [0], [0]
        return [1] * stages, [1] * stages

    def in_flight(self, stages, microbatches=1):
        self.check(stages, microbatches)
        return [stages - i for i in range(stages)]

    def extra_versions(self, stages, microbatches=1):
        self.check(stages, microbatches)
        return [1 if stages > 1 else 0] * stages

    def program(self, stages, microbatches, minibatches):
        self.check(stages, microbatches)
        return _two_bw(stages, microbatches, minibatches)

    def timeline_name(self, stash=False):
        return "2bw"                                # both passes read the minibatch's version already


class Hogwild(Schedule):
    """Per-stage delays drawn each step from a truncated exponential (PipeMare App. E).

    A draw is ``floor(X)`` for ``X`` exponential truncated to ``[0, tau_max + 1)``,
    i.e. a truncated geometric law ``P(tau = k) ∝ r^k``, ``k = 0..tau_max``.
    ``r`` is solved per stage so that the expected delay equals ``means[i]``
    (``0 < means[i] < tau_max``; ``r > 1``, a negative rate, for means above
    ``tau_max / 2``). Defaults: the dataflow delays as means — on average as stale
    as PipeMare's pipeline — and ``tau_max`` twice the largest of them. Forward and
    backward read the same version. Draws come from the optimizer's seeded
    generator, so runs are reproducible. No fixed pipeline produces these
    delays: fully utilized, but without a timeline or activation count.

    PipeMare's eq. (16) takes stage ``i``'s gradient with the whole model at
    ``w_{t - tau_i}``; here, as in a pipeline, each stage runs on its own version
    ``w_{t - tau_j}`` during the same pass; :func:`staleopt.hogwild.eq16_step` offers eq. (16).
    """

    name, paper, random = "hogwild", "PipeMare App. E", True
    description = "random per-stage delays, truncated exponential with given means, forward = backward"

    def __init__(self, tau_max: Optional[int] = None, means: Optional[Sequence[float]] = None):
        check_int("hogwild tau_max", tau_max, minimum=0, optional=True, error=ScheduleError)
        if means is not None:
            given = list(means) if isinstance(means, Iterable) and not isinstance(means, (str, bytes)) else None
            if given is None or not all(isinstance(m, numbers.Real) and not isinstance(m, bool) and 0 < m < math.inf
                                        for m in given):  # (NaN too)
                raise ScheduleError(f"hogwild means must be a list of finite numbers > 0, one per stage, got "
                                    f"{means!r:.80}")
            means = given
        self.tau_max, self.means = tau_max, None if means is None else [float(m) for m in means]
        self._cdf = {}

    def check(self, stages, microbatches=1):
        self._params(stages, microbatches)

    def _params(self, stages, microbatches):
        dataflow = Dataflow().delays(stages, microbatches)[0]
        means = self.means if self.means is not None else [float(t) for t in dataflow]  # ([]: refused below)
        if len(means) != stages:
            raise ScheduleError(f"hogwild got {len(means)} means for {stages} stages: give one per stage")
        tau_max = self.tau_max if self.tau_max is not None else 2 * max(dataflow)
        if any(m >= tau_max for m in means):  # (tau_max = 0: every delay 0, which no mean > 0 describes)
            raise ScheduleError(f"hogwild means {means} must be below tau_max={tau_max}: a delay law on "
                                f"0..tau_max cannot have a larger mean (for no delays use schedule 'sync')")
        return means, tau_max

    @staticmethod
    def law(mean: float, tau_max: int) -> torch.Tensor:
        """Probabilities of ``0..tau_max`` under ``P(k) ∝ r^k`` with expectation ``mean`` (float64)."""
        k = torch.arange(tau_max + 1, dtype=torch.float64)
        lo, hi = -60.0, 60.0  # log r
        for _ in range(200):
            mid = (lo + hi) / 2
            w = torch.softmax(mid * k, 0)
            lo, hi = (mid, hi) if float((w * k).sum()) < mean else (lo, mid)
        return torch.softmax((lo + hi) / 2 * k, 0)

    def delays(self, stages, microbatches=1):
        _, tau_max = self._params(stages, microbatches)
        return [tau_max] * stages, [tau_max] * stages

    def sample(self, stages, microbatches, generator):
        means, tau_max = self._params(stages, microbatches)
        if tau_max == 0:
            return [0] * stages, [0] * stages
        key = (tuple(means), tau_max)
        if key not in self._cdf:
            self._cdf[key] = torch.stack([self.law(m, tau_max).cumsum(0) for m in means])
        u = torch.rand(stages, 1, generator=generator, dtype=torch.float64)
        tau = (self._cdf[key] < u).sum(1).clamp(max=tau_max).tolist()
        return tau, list(tau)

    def extra_bytes(self) -> int:
        """The per-stage CDFs :meth:`sample` keeps (float64, ``P x (tau_max + 1)``, made at the first draw)."""
        return sum(t.numel() * t.element_size() for t in self._cdf.values())

    def __repr__(self):
        return f"Hogwild(tau_max={self.tau_max}, means={self.means})"


class Custom(Schedule):
    """User-given delays; ``tau_bkwd`` defaults to zeros, ``tau_recomp`` to ``tau_bkwd`` (a recomputation inside
    the backward pass). No pipeline: nothing to execute or price."""

    name, paper = "custom", "docs/design.md §2"
    description = "user-given per-stage delays"

    def __init__(self, tau_fwd: Sequence[int], tau_bkwd: Optional[Sequence[int]] = None,
                 tau_recomp: Optional[Sequence[int]] = None):
        self.tau_fwd = self._check("tau_fwd", tau_fwd)
        self.tau_bkwd = self._check("tau_bkwd", [0] * len(self.tau_fwd) if tau_bkwd is None else tau_bkwd)
        if len(self.tau_bkwd) != len(self.tau_fwd):
            raise DelayError(f"tau_fwd has {len(self.tau_fwd)} entries but tau_bkwd has {len(self.tau_bkwd)}: "
                             "give one delay per stage in each")
        self.tau_recomp = None if tau_recomp is None else self._check("tau_recomp", tau_recomp)
        if self.tau_recomp is not None:
            if len(self.tau_recomp) != len(self.tau_fwd):
                raise DelayError(f"tau_fwd has {len(self.tau_fwd)} entries but tau_recomp has "
                                 f"{len(self.tau_recomp)}: give one delay per stage in each")
            bad = [i for i, (f, r, b) in enumerate(zip(self.tau_fwd, self.tau_recomp, self.tau_bkwd))
                   if not min(f, b) <= r <= max(f, b)]
            if bad:
                raise DelayError(f"tau_recomp must lie between tau_bkwd and tau_fwd at every stage (a recomputation "
                                 f"runs after the forward and before the backward, PipeMare App. D.1): stages {bad} "
                                 f"have tau_fwd={[self.tau_fwd[i] for i in bad]}, "
                                 f"tau_recomp={[self.tau_recomp[i] for i in bad]}, "
                                 f"tau_bkwd={[self.tau_bkwd[i] for i in bad]}")

    @staticmethod
    def _check(what, values):
        try:
            values = list(values)
        except TypeError:
            raise DelayError(f"{what} must be a list of ints (one delay per stage), got {values!r}") from None
        out = []
        for v in values:
            if isinstance(v, bool) or not (isinstance(v, int) or (hasattr(v, "is_integer") and v.is_integer())):
                raise DelayError(f"{what} entries must be integers (delays count optimizer steps), got {v!r}")
            if v < 0:
                raise DelayError(f"{what} entries must be >= 0 (a delay counts steps into the past), got {v}")
            out.append(int(v))
        return out

    def check(self, stages, microbatches=1):
        super().check(stages, microbatches)
        if len(self.tau_fwd) != stages:
            raise DelayError(f"custom delays have {len(self.tau_fwd)} entries but the model is split into "
                             f"{stages} stages: give exactly one delay per stage")

    def delays(self, stages, microbatches=1):
        self.check(stages, microbatches)
        return list(self.tau_fwd), list(self.tau_bkwd)

    def recompute_delays(self, stages, microbatches=1):
        self.check(stages, microbatches)
        return list(self.tau_bkwd if self.tau_recomp is None else self.tau_recomp)

    def without_recompute(self):
        """The same delays keeping every activation (no ``tau_recomp``): what the errors that name it advise."""
        return self if self.tau_recomp is None else Custom(self.tau_fwd, self.tau_bkwd)

    def utilization(self, stages, microbatches=1):
        raise ScheduleError("custom delays have no pipeline schedule to price; use a named schedule or method")

    def __repr__(self):
        # tau_recomp appears only when given, so the repr of a two-delay schedule (in checkpoint signatures)
        # stays what it was
        recomp = "" if self.tau_recomp is None else f", tau_recomp={self.tau_recomp}"
        return f"Custom(tau_fwd={self.tau_fwd}, tau_bkwd={self.tau_bkwd}{recomp})"


_REGISTRY: Dict[str, Callable[..., Schedule]] = {}


def register(name: str, factory: Callable[..., Schedule]) -> None:
    """Add a schedule factory under ``name`` (used by extensions)."""
    _REGISTRY[name] = factory


for _cls in (Sync, Dataflow, DataflowRecompute, OneFOneB, PipelinedBackprop, TwoBW, Hogwild, Custom):
    register(_cls.name, _cls)


def names() -> List[str]:
    return sorted(_REGISTRY)


def pipelines() -> List[str]:
    """The registered schedules that a timeline executes (classes overriding :meth:`Schedule.program`)."""
    return [n for n in names() if isinstance(_REGISTRY[n], type) and _REGISTRY[n].program is not Schedule.program]


def get(name: str, **kwargs) -> Schedule:
    """Build the schedule registered under ``name``; e.g. ``get("custom", tau_fwd=[2, 0])``."""
    if isinstance(name, Schedule):
        return name
    if name not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; valid schedules: {', '.join(names())} "
                            "(method names such as 'pipemare' are resolved by staleopt.methods)")
    try:
        return _REGISTRY[name](**kwargs)
    except TypeError as e:
        extra = (" ('custom' takes its delays: schedules.get('custom', tau_fwd=[...], tau_bkwd=[...]) in Python; it "
                 "has no pipeline, so no timeline or hardware model)" if name == "custom" else "")
        raise ScheduleError(f"bad arguments for schedule {name!r}: {e}{extra}") from None
