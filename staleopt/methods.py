"""Named methods: the papers' recipes, each a schedule plus corrections (DESIGN §2).

A method name is accepted wherever a schedule name is; :func:`resolve` turns
either into ``(Schedule, [Correction, ...])``. Schedule names resolve to the
schedule with no corrections, and schedule and method names never disagree
(``1f1b`` is both).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple, Union

from . import schedules
from .corrections import (Correction, DiscrepancyCorrection, Hybrid, LRReschedule, Stashing, VerticalSync,
                          Warmup, WeightPrediction)
from .errors import ScheduleError
from .schedules import Schedule

__all__ = ["Method", "get", "names", "resolve", "register", "table"]


@dataclass
class Method:
    """A schedule and a list of corrections built by ``factory(**overrides)``."""

    name: str
    schedule: str
    description: str
    paper: str
    factory: Callable[..., List[Correction]] = field(default=lambda: [], repr=False)
    defaults: Dict = field(default_factory=dict)

    def build(self, **overrides) -> Tuple[Schedule, List[Correction]]:
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            allowed = ", ".join(sorted(self.defaults)) or "none"
            raise ScheduleError(f"method {self.name!r} has no hyperparameter(s) {sorted(unknown)}; "
                                f"it accepts: {allowed}")
        return schedules.get(self.schedule), self.factory(**{**self.defaults, **overrides})

    @property
    def corrections(self) -> List[Correction]:
        return self.factory(**self.defaults)


_METHODS: Dict[str, Method] = {}


def register(method: Method) -> None:
    _METHODS[method.name] = method


def names() -> List[str]:
    return sorted(_METHODS)


def get(name: str) -> Method:
    if name not in _METHODS:
        raise ScheduleError(f"unknown method {name!r}; valid methods: {', '.join(names())}")
    return _METHODS[name]


def resolve(spec: Union[str, Schedule, Method], **overrides) -> Tuple[Schedule, List[Correction]]:
    """``(schedule, corrections)`` for a method name, schedule name, Method or Schedule."""
    if isinstance(spec, Schedule):
        if overrides:
            raise ScheduleError("hyperparameter overrides apply to method names, not Schedule objects")
        return spec, []
    if isinstance(spec, Method):
        return spec.build(**overrides)
    if not isinstance(spec, str):
        raise ScheduleError(f"schedule must be a name or a Schedule, got {type(spec).__name__}")
    if spec in _METHODS:
        return _METHODS[spec].build(**overrides)
    if spec in schedules.names():
        if overrides:
            return schedules.get(spec, **overrides), []
        return schedules.get(spec), []
    raise ScheduleError(f"unknown schedule or method {spec!r}; methods: {', '.join(names())}; "
                        f"schedules: {', '.join(schedules.names())}")


def table() -> List[Dict[str, str]]:
    """One row per method: name, schedule, corrections, paper, description."""
    return [{"method": m.name, "schedule": m.schedule,
             "corrections": " + ".join(type(c).__name__ for c in m.corrections) or "-",
             "paper": m.paper, "description": m.description} for m in (_METHODS[n] for n in names())]


# Paper defaults. PipeMare: K is a quarter of the first lr phase (§3.1) and D is swept over
# {0.01, ..., 0.9} with 0.1 in both grids (Table 8); step counts are in optimizer steps and
# staleopt.train rescales them to the run's length when they are not given.
ANNEAL_STEPS, DECAY, WARMUP_STEPS, PIPELINED_STEPS = 1000, 0.1, 1000, 1000

for _m in [
    Method("gpipe", "sync", "synchronous, flush every minibatch", "GPipe; PipeMare Table 1"),
    Method("pipedream-flush", "sync", "1F1B with a flush every minibatch (synchronous)", "PipeDream-2BW §2"),
    Method("1f1b", "1f1b", "1F1B without stashing: stale forward, current backward", "PipeOptim §II"),
    Method("pipedream", "1f1b", "1F1B with weight stashing", "PipeDream §3.3", lambda: [Stashing()]),
    Method("pipedream-vs", "1f1b", "PipeDream with vertical sync: one version per minibatch across stages",
           "PipeDream §3.3", lambda: [Stashing(), VerticalSync()]),
    Method("pipedream-2bw", "2bw", "double-buffered weights, delay 1 forward and backward", "PipeDream-2BW §3.1"),
    Method("pb", "pb", "pipelined backpropagation with stale weights", "Stale-weights paper §3"),
    Method("pb-hybrid", "pb", "pipelined backpropagation first, then synchronous", "Stale-weights paper §4",
           lambda pipelined_steps: [Hybrid(pipelined_steps)], {"pipelined_steps": PIPELINED_STEPS}),
    Method("pipemare-stash", "dataflow", "dataflow delays with weight stashing (PipeMare's PipeDream baseline)",
           "PipeMare §4, Table 1", lambda: [Stashing()]),
    Method("pipemare-t1", "dataflow", "PipeMare with learning-rate rescheduling only", "PipeMare §3.1",
           lambda anneal_steps: [LRReschedule(anneal_steps)], {"anneal_steps": ANNEAL_STEPS}),
    Method("pipemare", "dataflow", "PipeMare: T1 learning-rate rescheduling + T2 discrepancy correction",
           "PipeMare §3", lambda anneal_steps, decay: [LRReschedule(anneal_steps), DiscrepancyCorrection(decay)],
           {"anneal_steps": ANNEAL_STEPS, "decay": DECAY}),
    Method("hogwild-t1", "hogwild", "Hogwild!-style random per-stage delays with T1 learning-rate rescheduling",
           "PipeMare App. E", lambda anneal_steps: [LRReschedule(anneal_steps)], {"anneal_steps": ANNEAL_STEPS}),
    Method("pipemare-w", "dataflow", "PipeMareW: synchronous warmup, then PipeMare (T1 + T2)", "PipeMare §4",
           lambda warmup_steps, anneal_steps, decay: [Warmup(warmup_steps), LRReschedule(anneal_steps),
                                                      DiscrepancyCorrection(decay)],
           {"warmup_steps": WARMUP_STEPS, "anneal_steps": ANNEAL_STEPS, "decay": DECAY}),
    Method("pipeoptim", "1f1b", "1F1B with optimizer-dependent weight prediction", "PipeOptim §III",
           lambda: [WeightPrediction("optimizer")]),
    Method("spectrain", "1f1b", "1F1B with SGD-momentum weight prediction (SpecTrain)", "PipeOptim §III-B2 eq. 6",
           lambda: [WeightPrediction("sgdm")]),
    Method("xpipe", "1f1b", "1F1B with Adam-based weight prediction (XPipe)", "PipeOptim §III-B2 eq. 6",
           lambda: [WeightPrediction("adam")]),
]:
    register(_m)
