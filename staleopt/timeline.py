"""Event-by-event execution of pipeline schedules: the ground truth for the delays (docs/design.md §4).

:func:`simulate` runs a schedule slot by slot. Every forward (``F``),
backward (``B``) and recompute (``R``, PipeMare App. A.3) pass takes one slot on
one *worker* (a row of the space-time diagram: a stage, a stage's forward,
recompute or backward unit, or an accelerator); a pass may start once the
passes it depends on finished in an earlier slot (``F`` of microbatch ``m`` at
stage ``i`` after ``F`` at stage ``i-1``; ``B`` at stage ``i`` after ``B`` at stage
``i+1``, at the last stage after its ``F``, and where the stage recomputes after
its ``R``; ``R`` after ``R`` at stage ``i-1`` inside a segment, after ``F`` at stage
``i-1`` at a segment's first stage). Each worker runs its program in order,
greedily; a program may hold idle cells. Phased methods run phase by phase,
with a flush before every synchronous minibatch. The programs, with
their diagrams, and the version each pass reads are the schedule's
(:meth:`staleopt.schedules.Schedule.program`,
:attr:`staleopt.methods.Pipeline.version_policy`); this module only executes them.

Version semantics (docs/design.md §1). Microbatch ``m`` belongs to minibatch
``t = m // N``. A stage's *version* is the number of updates it has applied;
it applies the update of minibatch ``t`` (producing ``w_{t+1}``) at the end of
the slot in which the last backward of minibatch ``t`` at that stage finishes.
A pass reads the version current at the start of its slot, except where the
schedule says otherwise (stashing: the backward and a recomputation read the
version the forward read; 2BW: a fixed version per minibatch). The delay of a
read is ``t - v``: the optimizer step that consumes the gradient is step ``t``,
and it read ``w_v``. Reads before the first update give ``v = 0``, i.e.
``w_{t - tau}`` with ``t - tau < 0`` means ``w_0``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Tuple

from . import methods
from .schedules import Item, Op
from .validate import check_int

__all__ = ["Event", "Timeline", "simulate"]


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


def _run(pipeline: methods.Pipeline, K: int):
    """Execute ``pipeline``'s program for ``K`` minibatches: ``(worker labels, events, updates, slots)``.

    Phased methods run phase by phase (:meth:`staleopt.methods.Pipeline.phases`):
    a pipelined phase is the schedule's program over its minibatches; a
    synchronous phase runs the same program one minibatch at a time, each
    starting once the previous one has drained (a flush). Versions carry over.
    """
    kind, P, N = pipeline.timeline_name, pipeline.stages, pipeline.microbatches
    policy = pipeline.version_policy
    first_stage = {a: a for a, _ in pipeline.schedule.segments(P)}       # recompute segment starts
    chunks = []                                       # (first minibatch, minibatches) run after a flush
    for start, count, synchronous in pipeline.phases(K):
        chunks += [(start + k, 1) for k in range(count)] if synchronous else [(start, count)]
    done: Dict[Item, int] = {}
    fwd_version: Dict[Tuple[int, int], int] = {}
    mb_version: Dict[int, int] = {}                  # 2BW: the version every pass of minibatch t reads
    version = [0] * P
    backwards_done = [[0] * K for _ in range(P)]
    events: List[Event] = []
    updates: List[Tuple[int, int, int]] = []         # (stage, slot, minibatch)
    labels, slot = None, 0
    for first, count in chunks:
        labels, programs = pipeline.program(count)
        shift = first * N
        programs = [[tuple((i, k, m + shift) for i, k, m in op) for op in prog] for prog in programs]
        recomputed = {i for prog in programs for op in prog for i, k, _ in op if k == "R"}
        pos = [0] * len(programs)
        remaining = sum(len(p) for p in programs)
        begin = slot
        while remaining:
            ran = []
            for w, prog in enumerate(programs):
                if pos[w] == len(prog):
                    continue
                op = prog[pos[w]]
                if not all(_ready(item, op, done, slot, P, recomputed, first_stage) for item in op):
                    continue
                for item in op:
                    stage, kind_, m = item
                    t = m // N
                    if policy == "minibatch":
                        if t not in mb_version:      # first pass of minibatch t is its first forward at stage 0
                            mb_version[t] = min(version)
                        v = mb_version[t]
                    elif kind_ != "F" and policy == "stash":
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
            for stage, t in ran:                      # updates land at the end of the slot
                backwards_done[stage][t] += 1
                if backwards_done[stage][t] == N:
                    if version[stage] != t:
                        raise AssertionError(f"{kind}: stage {stage} finished minibatch {t} out of order")
                    version[stage] = t + 1
                    updates.append((stage, slot, t))
            slot += 1
            if slot - begin > 4 * (remaining + len(events)) + 4 * P + 8:   # a correct program never idles this long
                raise AssertionError(f"{kind}: deadlock at slot {slot}")
    return labels, events, updates, slot


def _ready(item: Item, op: Op, done: Dict[Item, int], slot: int, P: int, recomputed, first_stage) -> bool:
    """Whether ``item``'s inputs were produced: ``F`` after the previous stage's ``F``; ``R`` (recompute,
    PipeMare App. A.3) after the previous stage's ``R`` inside a segment, after the previous stage's ``F`` (the
    cached input) at a segment's first stage; ``B`` after the next stage's ``B`` (the last stage: its ``F``) and,
    where the stage recomputes, after its ``R``."""
    stage, kind, m = item
    if kind == "F":
        deps = [(stage - 1, "F", m)] if stage > 0 else []
    elif kind == "R":
        deps = [] if stage == 0 else [(stage - 1, "F" if stage in first_stage else "R", m)]
    else:
        deps = [(stage + 1, "B", m) if stage < P - 1 else (stage, "F", m)]
        if stage in recomputed:
            deps.append((stage, "R", m))
    for dep in deps:
        if dep in op:                                 # same cell, earlier in the cell (pipelined backprop)
            if op.index(dep) > op.index(item):
                return False
        elif not done.get(dep, slot) < slot:
            return False
    return True


class Timeline:
    """The executed schedule: events, derived delays, utilization, in-flight counts, diagrams.

    Derived quantities that describe the schedule itself (``tau_*``,
    ``steady_state_utilization``) are read from a long internal run, so they
    do not depend on how many minibatches were simulated; the others describe
    this run.
    """

    def __init__(self, pipeline: methods.Pipeline, minibatches: int):
        self.pipeline = pipeline
        self.kind = pipeline.timeline_name
        minibatches = check_int("minibatches", minibatches, minimum=1)
        self.stages, self.microbatches, self.minibatches = pipeline.stages, pipeline.microbatches, minibatches
        self.workers, self.events, self.updates, self.slots = _run(pipeline, minibatches)

    def __repr__(self):
        return (f"Timeline({self.kind!r}, stages={self.stages}, microbatches={self.microbatches}, "
                f"minibatches={self.minibatches}, slots={self.slots})")

    # -- delays --------------------------------------------------------------------------
    @cached_property
    def _long(self) -> "Timeline":
        """A run long enough for a steady state, of the pipelined phase alone for phased methods."""
        K = 4 * self.stages + 6
        steady = self.pipeline.without_phases()
        return self if self.minibatches >= K and steady is self.pipeline else Timeline(steady, K)

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

    @cached_property
    def tau_recomp_microbatch(self) -> Tuple[Tuple[int, ...], ...]:
        """``[i][j]``: delay of the recomputation of microbatch ``j`` at stage ``i`` (steady state); where no
        ``R`` pass runs, the recomputation happens inside the backward pass and reads its version."""
        recomputed = self._delays("R")
        return tuple(tuple(b if r is None else r for r, b in zip(rr, bb))
                     for rr, bb in zip(recomputed, self.tau_bkwd_microbatch))

    @property
    def tau_fwd(self) -> List[int]:
        """Per-stage forward delay: the largest over a minibatch's microbatches (its first, ``j = 0``)."""
        return [max(row) for row in self.tau_fwd_microbatch]

    @property
    def tau_bkwd(self) -> List[int]:
        """Per-stage backward delay: the largest over a minibatch's microbatches."""
        return [max(row) for row in self.tau_bkwd_microbatch]

    @property
    def tau_recomp(self) -> List[int]:
        """Per-stage recompute delay: the largest over a minibatch's microbatches."""
        return [max(row) for row in self.tau_recomp_microbatch]

    @property
    def uniform(self) -> bool:
        """True when all microbatches of a minibatch read the same version at every stage and pass.

        Then a per-stage delay describes the schedule exactly, as the
        delay-queue optimizer assumes; otherwise ``tau_*`` are the oldest reads.
        """
        return all(len(set(row)) == 1 for rows in (self.tau_fwd_microbatch, self.tau_bkwd_microbatch,
                                                   self.tau_recomp_microbatch) for row in rows)

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
    def _peak(self, begin: str, end: str, stages, within: bool = False) -> List[int]:
        """Per stage in ``stages``, the most microbatches whose ``begin`` pass there finished and whose ``end``
        pass did not, counted at slot ends, and with ``within`` plus in each slot the microbatches whose ``begin``
        and ``end`` passes both run in it (held while that slot runs) (0 for the other stages)."""
        slots = {}
        for e in self.events:
            slots[(e.kind, e.stage, e.microbatch)] = e.slot
        peak = [0] * self.stages
        for i in stages:
            changes, inside = {}, {}
            for (k, s, m), f in slots.items():
                if k != begin or s != i:
                    continue
                e = slots[(end, s, m)]
                if e > f:
                    changes[f] = changes.get(f, 0) + 1
                    changes[e] = changes.get(e, 0) - 1
                elif within:
                    inside[f] = inside.get(f, 0) + 1
            level = 0
            for slot in sorted(set(changes) | set(inside)):
                level += changes.get(slot, 0)
                peak[i] = max(peak[i], level + inside.get(slot, 0))
        return peak

    @cached_property
    def _recomputed(self) -> List[bool]:
        stages = {e.stage for e in self.events if e.kind == "R"}
        return [i in stages for i in range(self.stages)]

    @cached_property
    def peak_in_flight(self) -> List[int]:
        """Per stage, the most microbatches whose activations the stage holds: from the end of the pass that
        produced them (the forward, or the recomputation where one runs) to the backward.

        Counted at slot ends: the number of activation stashes the stage holds
        (PipeMare App. A.2: ``2(P-1-i) + 1`` for the dataflow pipeline, 0-based ``i``;
        App. A.3: ``2(b-i) + 1`` recomputed ones with PipeMare Recompute), plus, in a slot that runs a
        microbatch's forward and its backward, that microbatch (the pipelined backprop's last stage: 1).
        """
        plain = self._peak("F", "B", [i for i, r in enumerate(self._recomputed) if not r], within=True)
        recomputed = self._peak("R", "B", [i for i, r in enumerate(self._recomputed) if r], within=True)
        return [a + b for a, b in zip(plain, recomputed)]

    @cached_property
    def peak_cached_inputs(self) -> List[int]:
        """Per stage, the most inputs kept for a later recomputation: from a segment's first forward to its
        first recomputation (PipeMare App. A.3's ``2(P - i)``); 0 at the other stages and without recompute."""
        starts = [a for a, _ in self.pipeline.schedule.segments(self.stages)]
        return self._peak("F", "R", starts)

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

    def summary(self) -> str:
        """Derived delays, utilization and in-flight counts as text."""
        rows = [f"timeline {self.kind}: P={self.stages} N={self.microbatches} minibatches={self.minibatches}",
                f"  tau_fwd  = {self.tau_fwd}", f"  tau_bkwd = {self.tau_bkwd}"]
        if any(self._recomputed):
            rows.append(f"  tau_recomp = {self.tau_recomp}")
        if not self.uniform:
            rows.append("  per microbatch j of a minibatch (microbatches read different versions):")
            rows.append(f"    tau_fwd[i][j]  = {[list(r) for r in self.tau_fwd_microbatch]}")
            rows.append(f"    tau_bkwd[i][j] = {[list(r) for r in self.tau_bkwd_microbatch]}")
            if any(self._recomputed):
                rows.append(f"    tau_recomp[i][j] = {[list(r) for r in self.tau_recomp_microbatch]}")
        rows += [f"  utilization: steady state {self.steady_state_utilization:.4f}, "
                 f"this run {self.utilization:.4f} ({self.slots} slots)",
                 f"  peak in-flight microbatches per stage in this run = {self.peak_in_flight}",
                 *([f"  peak cached inputs per stage in this run = {self.peak_cached_inputs}"]
                   if any(self._recomputed) else []),
                 f"  peak weight versions per stage in this run = {self.peak_versions}",
                 "  (the delays are the steady state's; a run of a few minibatches may not reach its peaks: "
                 "more minibatches, or staleopt hardware, give the steady state's)"]
        return "\n".join(rows)


def simulate(schedule, stages: int, microbatches: int = 1, minibatches: int = 3) -> Timeline:
    """Execute ``schedule`` on ``stages`` stages for ``minibatches`` minibatches of ``microbatches`` each.

    ``schedule``: any name :func:`staleopt.methods.build` accepts whose
    schedule is a pipeline (``sync``, ``1f1b``, ``2bw``, ``dataflow``, ``pb`` and
    the methods built on them: ``gpipe``, ``pipedream-flush``, ``pipedream``,
    ``pipedream-2bw``, ``pipemare``, ...), a :class:`~staleopt.schedules.Schedule`
    or a :class:`~staleopt.methods.Pipeline`. Draw it with
    :func:`staleopt.plot.plot_timeline`.

    >>> tl = simulate("1f1b", stages=4, microbatches=1, minibatches=8)
    >>> tl.tau_fwd, tl.tau_bkwd
    ([3, 2, 1, 0], [0, 0, 0, 0])
    """
    pipeline = methods.build(schedule, stages, microbatches)
    return Timeline(pipeline, minibatches)
