"""Named methods: the papers' recipes, each a schedule plus corrections (docs/design.md §2).

A method name is accepted wherever a schedule name is; :func:`build` turns
either, for ``P`` stages and ``N`` microbatches, into a :class:`Pipeline`: the
object that answers what the method does there (its effective delays, step
size factors, utilization, activation and weight copies) once, for the
timeline, the hardware model, the advisor and the training loop.
:func:`resolve` gives the bare ``(Schedule, [Correction, ...])``. Schedule
names resolve to the schedule with no corrections, and schedule and method
names never disagree (``1f1b`` is both).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import schedules
from .corrections import (Correction, DelayCompensation, DiscrepancyCorrection, GapAware, Hybrid, LRReschedule,
                          NesterovLookahead, RequireNAdam, StalenessAware, Stashing, VerticalSync, Warmup,
                          WeightPrediction)
from .errors import ConfigError, ScheduleError
from .schedules import Delays, Program, Schedule, Sync
from .validate import check_int

__all__ = ["Method", "Pipeline", "StepDelays", "build", "get", "names", "resolve", "register", "table", "check_retired",
           "hyperparameters", "amortized_utilization", "hybrid_speedup", "PHASE_LENGTHS"]


@dataclass
class Method:
    """A schedule (registered name and arguments) and a list of corrections built by ``factory(**overrides)``.

    ``aliases``: other names that resolve to this method (e.g. a timeline's name for it);
    ``schedule_params``: the hyperparameters (in ``defaults``) that go to the schedule, not to ``factory``.
    """

    name: str
    schedule: str
    description: str
    paper: str
    factory: Callable[..., List[Correction]] = field(default=lambda: [], repr=False)
    defaults: Dict = field(default_factory=dict)
    schedule_args: Dict = field(default_factory=dict)
    aliases: Tuple[str, ...] = ()
    schedule_params: Tuple[str, ...] = ()

    def build(self, **overrides) -> Tuple[Schedule, List[Correction]]:
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            allowed = ", ".join(sorted(self.defaults)) or "none"
            raise ScheduleError(f"method {self.name!r} has no hyperparameter(s) {sorted(unknown)}; "
                                f"it accepts: {allowed}")
        values = {**self.defaults, **overrides}
        own = {k: values.pop(k) for k in self.schedule_params}
        return schedules.get(self.schedule, **self.schedule_args, **own), self.factory(**values)

    @property
    def corrections(self) -> List[Correction]:
        return self.build()[1]


_METHODS: Dict[str, Method] = {}
_ALIASES: Dict[str, str] = {}       # alias -> method name, filled from Method.aliases by register()
#: Names no longer accepted, with what to use instead (a config or script that names one fails with this).
_RETIRED = {"async-nag": "'async-nag' was renamed: it was PipeMare's stashed dataflow pipeline with Nesterov SGD "
                         "momentum, now 'pipemare-stash-nesterov' (same rule and hyperparameters); the authors' "
                         "method (NAdam, weight stashing, 1F1B) is 'asyncpp'"}


def check_retired(name) -> None:
    """Raise :class:`~staleopt.errors.ScheduleError` naming the replacement if ``name`` is a retired method name."""
    if isinstance(name, str) and name in _RETIRED:
        raise ScheduleError(f"method {_RETIRED[name]}")


def register(method: Method) -> None:
    _METHODS[method.name] = method
    for alias in method.aliases:
        _ALIASES[alias] = method.name


def names() -> List[str]:
    return sorted(_METHODS)


def get(name: str) -> Method:
    check_retired(name)
    if name in _ALIASES:
        return _METHODS[_ALIASES[name]]
    if name not in _METHODS:
        raise ScheduleError(f"unknown method {name!r}; valid methods: {', '.join(names())}")
    return _METHODS[name]


def hyperparameters(name: str) -> Dict:
    """The hyperparameters ``name`` takes, with their defaults; ``{}`` for schedule names."""
    return dict(get(name).defaults) if name in _METHODS or name in _ALIASES else {}


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
    check_retired(spec)
    if spec in _METHODS or spec in _ALIASES:
        return get(spec).build(**overrides)
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


def amortized_utilization(phases: Sequence[Tuple[float, float]]) -> float:
    """Run-average utilization of phases ``(length, utilization)``: ``sum n_k / sum (n_k / U_k)``.

    A phase of ``n_k`` steps at utilization ``U_k`` takes ``n_k / U_k`` units of
    fully-utilized time (PipeMare §4 "Warmup Epochs":
    ``Util_PipeMareW = (E_PM + E_Sync) / (E_PM / 1 + E_Sync / Util_Sync)``).
    """
    phases = list(phases)
    wrong = [(n, u) for n, u in phases if not (0 <= n < math.inf and 0 < u <= 1)]  # (NaN fails both)
    if wrong:
        raise ConfigError(f"phases are (length, utilization) with a finite length >= 0 and a utilization in "
                          f"(0, 1], got {wrong[0]!r}")
    total = sum(n for n, _ in phases)
    if total <= 0:
        raise ConfigError("phases must have a positive total length")
    return total / sum(n / u for n, u in phases if n > 0)


def _check_steps(**lengths) -> None:
    """Each given (not None) length is a number of steps: a real number, not a bool (``True`` was taken as 1, a
    string failed inside a comparison)."""
    for name, value in lengths.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ConfigError(f"{name} must be a number of optimizer steps (or epochs, in the same unit), got "
                              f"{value!r}")


def _check_phases(total_steps: float, phase_steps: float, name: str) -> None:
    """``0 <= phase_steps <= total_steps``, ``total_steps`` positive and finite (else a ConfigError naming both)."""
    _check_steps(total_steps=total_steps, **{name: phase_steps})
    if not (0 < total_steps < math.inf and 0 <= phase_steps <= total_steps):
        raise ConfigError(f"need 0 <= {name} <= total_steps with total_steps positive and finite, got {phase_steps} "
                          f"and {total_steps}")


def hybrid_speedup(total_steps: float, pipelined_steps: float, stages: int) -> float:
    """Speedup of hybrid training over non-pipelined training on ``2K + 1`` accelerators (stale-weights §4).

    ``n / (n_p / (2K + 1) + (n - n_p))`` with ``n`` steps in all, the first
    ``n_p`` pipelined, and ``K = P - 1`` register pairs between ``P`` stages.
    """
    _check_phases(total_steps, pipelined_steps, "pipelined_steps")
    k = check_int("stages", stages, minimum=1) - 1
    return total_steps / (pipelined_steps / (2 * k + 1) + (total_steps - pipelined_steps))


class StepDelays(NamedTuple):
    """The delays of one step: forward, backward and recompute (PipeMare App. D.1), per stage or per
    stage and microbatch."""

    fwd: list
    bkwd: list
    recomp: list


#: :meth:`Pipeline.utilization`'s phase-length arguments: the correction that has the phase, and what it is.
PHASE_LENGTHS = {"warmup_steps": (Warmup, "synchronous warmup (pipemare-w)"),
                 "pipelined_steps": (Hybrid, "hybrid phase (pb-hybrid)")}


class Pipeline:
    """A method on ``stages`` stages with ``microbatches`` per minibatch: its schedule, its corrections, and
    everything that follows from them (built by :func:`build`, which checks the schedule's rules).

    Units: delays in optimizer steps, utilization a fraction in [0, 1], memory in bytes.
    """

    def __init__(self, name: str, schedule: Schedule, corrections: Sequence[Correction], stages: int,
                 microbatches: int = 1):
        schedule.check(stages, microbatches)
        self.name, self.schedule, self.corrections = name, schedule, list(corrections)
        self.stages, self.microbatches = int(stages), int(microbatches)     # NumPy ints pass check() too

    def __repr__(self) -> str:
        return (f"Pipeline({self.name!r}, schedule={self.schedule!r}, corrections={self.corrections}, "
                f"stages={self.stages}, microbatches={self.microbatches})")

    # -- delays and step sizes -----------------------------------------------------------
    @cached_property
    def _delays(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        tf, tb = self.schedule.delays(self.stages, self.microbatches)
        for c in self.corrections:
            tf, tb = c.delays(list(tf), list(tb), None)
        return tuple(tf), tuple(tb)

    @property
    def delays(self) -> Delays:
        """Largest per-stage ``(tau_fwd, tau_bkwd)``: the schedule's, then each correction's in order
        (the asynchronous phase of phased methods)."""
        return list(self._delays[0]), list(self._delays[1])

    def lr_factors(self, step: int) -> List[float]:
        """Per-stage multipliers of the scheduler's lr at training step ``step`` (T1's ``1/tau_i^{p_k}``, PipeMare
        eq. 4), as the training engine computes them: from the step's delays (the schedule's, then each
        correction's at ``step``: 0 through a :class:`~staleopt.corrections.Warmup`, refilling after it), T1's
        ``k`` counted from the end of the synchronous steps (PipeMare §4: ``k = t - W``). A random schedule's
        are its largest delays."""
        check_int("step", step, minimum=0)
        tf, tb = self.schedule.delays(self.stages, self.microbatches)
        for c in self.corrections:
            tf, tb = c.delays(list(tf), list(tb), step)
        return self._factors(list(tf), list(tb), step, max(step - self._synchronous_steps, 0))

    def asynchronous_lr_factors(self, k: int) -> List[float]:
        """The multipliers ``k`` steps into the asynchronous phase at its steady delays (:attr:`delays`: the
        pipeline full), what the stability advisor analyses; equal to :meth:`lr_factors` for a method without
        a warmup once every stage's delay is reached."""
        check_int("k", k, minimum=0)
        tf, tb = self.delays
        return self._factors(tf, tb, k + self._synchronous_steps, k)

    @property
    def _synchronous_steps(self) -> int:
        return sum(c.synchronous_steps for c in self.corrections)

    def _factors(self, tf: List[int], tb: List[int], step: int, k: int) -> List[float]:
        """Product of every correction's factors for delays ``(tf, tb)`` at ``step``; T1's at its counter ``k``
        (an unbound :class:`~staleopt.corrections.LRReschedule` knows no phase offset)."""
        factors = [1.0] * self.stages
        for c in self.corrections:
            f = c.factors(tf, k) if isinstance(c, LRReschedule) else c.lr_factors((list(tf), list(tb)), step)
            if f is not None:
                factors = [a * float(b) for a, b in zip(factors, f)]
        return factors

    @property
    def recompute_delays(self) -> List[int]:
        """Largest per-stage ``tau_recomp`` (PipeMare App. D.1): the schedule's
        (:meth:`Schedule.recompute_delays`, ``tau_bkwd`` unless the schedule
        recomputes ahead of the backward), then each correction's, applied as to
        the backward's (stashing: the forward's version; vertical sync: stage 0's)."""
        return list(self._recompute[0])

    @cached_property
    def _recompute(self) -> Tuple[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]:
        """The recompute delays after the corrections: per stage, and per stage and microbatch."""
        P, N = self.stages, self.microbatches
        tf, tr = self.schedule.delays(P, N)[0], self.schedule.recompute_delays(P, N)
        mf, mr = self.schedule.microbatch_delays(P, N)[0], self.schedule.microbatch_recompute_delays(P, N)
        for c in self.corrections:
            tf, tr = c.delays(list(tf), list(tr), None)
            mf, mr = c.delays(list(mf), list(mr), None)
        return tuple(tr), tuple(tuple(row) for row in mr)

    # -- phases and the delays of each step ----------------------------------------------
    def synchronous(self, step: int) -> bool:
        """Whether step ``step`` runs synchronously (a flush every minibatch): inside a
        :class:`~staleopt.corrections.Warmup` (PipeMare §4), after a :class:`~staleopt.corrections.Hybrid`
        switch (stale-weights §4)."""
        return any(isinstance(c, Warmup) and step < c.steps or isinstance(c, Hybrid) and step >= c.pipelined_steps
                   for c in self.corrections)

    def phases(self, steps: int) -> List[Tuple[int, int, bool]]:
        """``(first step, steps, synchronous)`` of each phase of the first ``steps`` steps, in order."""
        check_int("steps", steps, minimum=0)
        edges = {0, steps}
        for c in self.corrections:
            if isinstance(c, (Warmup, Hybrid)):
                edges.add(min(c.steps if isinstance(c, Warmup) else c.pipelined_steps, steps))
        edges = sorted(edges)
        return [(a, b - a, self.synchronous(a)) for a, b in zip(edges, edges[1:])]

    def without_phases(self) -> "Pipeline":
        """This pipeline without its phase corrections (its pipelined phase alone); itself when it has none."""
        kept = [c for c in self.corrections if not isinstance(c, (Warmup, Hybrid))]
        if len(kept) == len(self.corrections):
            return self
        return Pipeline(self.name, self.schedule, kept, self.stages, self.microbatches)

    def refilled_at(self, step: int) -> int:
        """The step at which the pipeline last started filling from empty: the end of the last warmup at or
        before ``step`` (PipeMareW's switch-over, PipeMare §4), else 0 (the run's start)."""
        return max([c.steps for c in self.corrections if isinstance(c, Warmup) and c.steps <= step], default=0)

    def microbatch_delays_at(self, step: int) -> StepDelays:
        """``[i][j]``: the delays of microbatch ``j`` of minibatch ``step`` at stage ``i``, forward, backward and
        recompute, as the executed timeline has them (:mod:`staleopt.timeline`).

        Microbatch ``j``'s delays are the schedule's, then each correction's ``delays(..., step)``, exactly
        what the engine computes for pass ``j`` (``microbatch_passes``): a
        :class:`~staleopt.corrections.Warmup` reads ``w_t`` during the warmup and refills after it
        (``min(tau, t - W)``, PipeMare §4), a :class:`~staleopt.corrections.Hybrid` reads ``w_t`` after its
        switch (the pipeline drained, stale-weights §4). Last, the run's start clamps to
        ``min(tau, t)``: the engine's ``w_{t - tau} = w_0`` for ``t < tau``, said as the version read.
        """
        check_int("step", step, minimum=0)
        P, N = self.stages, self.microbatches
        mf, mb = self.schedule.microbatch_delays(P, N)
        mr = self.schedule.microbatch_recompute_delays(P, N)
        rows = [[[0] * N for _ in range(P)] for _ in range(3)]
        for j in range(N):
            fwd, bkwd, rf, recomp = ([row[j] for row in m] for m in (mf, mb, mf, mr))
            for c in self.corrections:
                fwd, bkwd = c.delays(list(fwd), list(bkwd), step)
                rf, recomp = c.delays(list(rf), list(recomp), step)
            for out, column in zip(rows, (fwd, bkwd, recomp)):
                for i in range(P):
                    out[i][j] = min(column[i], step)
        return StepDelays(*rows)

    def delays_at(self, step: int) -> StepDelays:
        """Per-stage delays of step ``step`` (the largest over its microbatches, :meth:`microbatch_delays_at`)."""
        return StepDelays(*([max(row) for row in rows] for rows in self.microbatch_delays_at(step)))

    def cached_inputs(self) -> List[int]:
        """Per stage, inputs kept for a later recomputation in steady state (:meth:`Schedule.cached_inputs`)."""
        return self.schedule.cached_inputs(self.stages, self.microbatches)

    @property
    def stashes(self) -> bool:
        """Whether a backward reads the version its forward read (weight stashing, PipeDream §3.3)."""
        return any(isinstance(c, Stashing) for c in self.corrections)

    # -- the executed timeline -----------------------------------------------------------
    @property
    def version_policy(self) -> str:
        """How a pass of the timeline picks its version: the schedule's ``"minibatch"`` (2BW),
        else ``"stash"`` with weight stashing, else ``"current"`` (:class:`staleopt.schedules.Schedule`).

        Corrections that only change views or step sizes (T1, T2, prediction,
        the phases' asynchronous part) change no read.
        """
        if any(isinstance(c, VerticalSync) for c in self.corrections):
            raise ScheduleError("no timeline models vertical sync yet; simulate 'pipedream' instead")
        if self.schedule.version_policy == "minibatch":
            return "minibatch"
        return "stash" if self.stashes else "current"

    @property
    def timeline_name(self) -> str:
        """The executed pipeline's name (``pipemare`` runs ``dataflow``, ``pipedream`` is ``1f1b`` with stashing)."""
        return self.schedule.timeline_name(self.stashes)

    def program(self, minibatches: int) -> Program:
        """The schedule's program for ``minibatches`` minibatches (see :attr:`version_policy`)."""
        self.version_policy                          # raises for reads no timeline models
        return self.schedule.program(self.stages, self.microbatches, minibatches)

    # -- the hardware model --------------------------------------------------------------
    def utilization(self, total_steps: Optional[float] = None, warmup_steps: Optional[float] = None,
                    pipelined_steps: Optional[float] = None) -> float:
        """Fraction of busy pipeline workers, averaged over the run (PipeMare §2, App. A.1, §4; stale-weights §4).

        The schedule's steady state (:meth:`Schedule.utilization`); with
        :class:`~staleopt.corrections.Warmup`, ``warmup_steps`` synchronous
        (``N / (N + P - 1)``) and the rest at the steady state, averaged by
        :func:`amortized_utilization` over ``total_steps``; with
        :class:`~staleopt.corrections.Hybrid`, ``pipelined_steps`` at the steady
        state and the rest synchronous on the ``2P - 1`` accelerators, ``N / (N + 2P - 2)``
        (its microbatches pipelined as the timeline runs them; at ``N = 1`` one busy, ``1 / (2P - 1)``,
        and the average is :func:`hybrid_speedup` ``/ (2P - 1)``, stale-weights §4). Phase lengths default to
        the correction's; ``total_steps`` (or epochs, in the same unit; positive and finite) is needed for
        phased methods. A phase length a method without that phase cannot honour (``warmup_steps > 0``
        without a warmup, ``pipelined_steps < total_steps`` without a hybrid phase) is a ConfigError.
        """
        P, N = self.stages, self.microbatches
        steady = self.schedule.utilization(P, N)
        _check_steps(total_steps=total_steps, warmup_steps=warmup_steps, pipelined_steps=pipelined_steps)
        if total_steps is not None and not 0 < total_steps < math.inf:  # (also where no phase needs it)
            raise ConfigError(f"total_steps must be positive and finite, got {total_steps!r}")
        # a phase length a method without that phase cannot honour is refused (0 warmup steps, or every step
        # pipelined, is what it does anyway: the steady state of every method, as the tests ask for it)
        no_warmup, all_pipelined = warmup_steps in (None, 0), pipelined_steps is None or (
            total_steps is not None and pipelined_steps >= total_steps)
        for neutral, key, given in ((no_warmup, "warmup_steps", warmup_steps),
                                    (all_pipelined, "pipelined_steps", pipelined_steps)):
            if not neutral and key not in self.phase_lengths:
                what = PHASE_LENGTHS[key][1]
                raise ConfigError(f"{key} = {given!r} would change nothing: {self.name} has no {what.split(' (')[0]}; "
                                  f"only a method with a {what} takes it: leave it out for {self.name}")
        for c in self.corrections:
            if isinstance(c, Warmup):
                n_w = c.steps if warmup_steps is None else warmup_steps
                if n_w == 0:
                    continue
                if total_steps is None:
                    raise ConfigError(f"{self.name}'s utilization is averaged over its synchronous warmup and the "
                                      f"rest of the run: pass total_steps= (and warmup_steps=, default {c.steps}; on "
                                      "the command line --total-steps and --warmup-steps)")
                if warmup_steps is None and n_w > total_steps:
                    raise ConfigError(f"{self.name}'s default warmup of {n_w} steps is longer than total_steps = "
                                      f"{total_steps:g}: pass warmup_steps <= total_steps (--warmup-steps)")
                _check_phases(total_steps, n_w, "warmup_steps")
                return amortized_utilization([(n_w, Sync().utilization(P, N)), (total_steps - n_w, steady)])
            if isinstance(c, Hybrid):
                n_p = c.pipelined_steps if pipelined_steps is None else pipelined_steps
                if total_steps is None:
                    raise ConfigError(f"{self.name}'s utilization is averaged over its pipelined and non-pipelined "
                                      f"phases: pass total_steps= (and pipelined_steps=, default {c.pipelined_steps}; "
                                      "on the command line --total-steps and --pipelined-steps)")
                if pipelined_steps is None and n_p > total_steps:
                    raise ConfigError(f"{self.name}'s default of {n_p} pipelined steps is more than total_steps = "
                                      f"{total_steps:g}: pass pipelined_steps <= total_steps (--pipelined-steps)")
                _check_phases(total_steps, n_p, "pipelined_steps")
                return amortized_utilization([(n_p, steady), (total_steps - n_p, N / (N + 2 * P - 2))])
        return steady

    @property
    def phase_lengths(self) -> Tuple[str, ...]:
        """The phase-length arguments of :meth:`utilization` this method takes (:data:`PHASE_LENGTHS`)."""
        return tuple(k for k, (kind, _) in PHASE_LENGTHS.items() if any(isinstance(c, kind) for c in self.corrections))

    def in_flight(self) -> List[int]:
        """Microbatches whose activations stage ``i`` holds at once, in steady state (:meth:`Schedule.in_flight`)."""
        return self.schedule.in_flight(self.stages, self.microbatches)

    def _stashed(self) -> List[int]:
        """Per stage, the versions stashing stores: ``tau_fwd_i`` (PipeMare App. A.1) where the schedule's own
        backward reads another version than its forward, or where the method's reads are not the schedule's (vertical
        sync moves the last 1F1B stage's two reads of ``w_t`` to ``w_(t - tau_0)``); none where the schedule's own
        reads already agree with the method's (2BW's double buffer: stashing changes no read there)."""
        if not self.stashes:
            return [0] * self.stages
        own_f, own_b = self.schedule.delays(self.stages, self.microbatches)
        return [t if f != b or t != f else 0 for t, f, b in zip(self.delays[0], own_f, own_b)]

    def extra_versions(self) -> List[int]:
        """Per stage, weight versions stored besides the current one: the schedule's (2BW's second buffer)
        plus, with stashing, ``tau_fwd_i`` where it changes a read (PipeMare App. A.1; :meth:`_stashed`)."""
        own = self.schedule.extra_versions(self.stages, self.microbatches)
        return [a + b for a, b in zip(own, self._stashed())]

    def weight_copies(self, stage_bytes: Sequence[int], optimizer: str) -> Dict[str, int]:
        """Bytes of the weight-sized copies the method keeps besides weights, gradients and optimizer state.

        ``stage_bytes``: ``|w_i|`` per stage; ``optimizer``: the base optimizer's
        name (``sgd``, ``sgd-momentum``, ``adam``, ``adamw``). Returns
        ``stash_bytes`` ``sum_i |w_i| tau_fwd_i`` with stashing where it changes a read (PipeMare App. A.1),
        ``second_version_bytes`` the schedule's stored versions (2BW §3.1),
        ``prediction_bytes`` ``|w_i|`` per stage with a version gap, plus the
        rule's own moments when the base optimizer lacks them (PipeOptim Table I;
        SpecTrain 1 slot, XPipe 2), and ``t2_bytes`` T2's accumulators, ``M_i |w_i|`` per
        stage with ``tau_fwd_i > tau_bkwd_i`` (PipeMare §3.2): ``M_i = 1 + max(tau_bkwd_i, tau_recomp_i)``
        (``tau_recomp_i`` where it is below ``tau_fwd_i``) for the causal accumulator, which reads
        ``delta_{t - tau}`` (App. B.4, D.1), 1 for ``accumulator="current"``; 1 for every dataflow method.
        """
        w = list(stage_bytes)
        tf, tb = self.delays
        stash = sum(wi * t for wi, t in zip(w, self._stashed()))
        second = sum(wi * v for wi, v in zip(w, self.schedule.extra_versions(self.stages, self.microbatches)))
        gapped = sum(wi for wi, f, b in zip(w, tf, tb) if f > b)
        prediction = 0
        for c in self.corrections:
            if isinstance(c, WeightPrediction):
                own = {"sgdm": 0 if optimizer == "sgd-momentum" else 1,  # (AdamW's moments are Adam's)
                       "adam": 0 if optimizer in ("adam", "adamw") else 2}
                prediction += gapped * (1 + own.get(c.rule, 0))
        t2 = 0
        for c in self.corrections:  # T2's ring of accumulators: M_i rows per corrected stage (docs/engine.md)
            if isinstance(c, DiscrepancyCorrection):
                tr = self.recompute_delays
                t2 += sum(wi * (1 if c.accumulator == "current" else 1 + max(b, r if r < f else 0))
                          for wi, f, b, r in zip(w, tf, tb, tr) if f > b)
        return {"stash_bytes": stash, "second_version_bytes": second, "prediction_bytes": prediction,
                "t2_bytes": t2}


def build(spec: Union[str, Schedule, Method, Pipeline], stages: int, microbatches: int = 1,
          **overrides) -> Pipeline:
    """The :class:`Pipeline` of a method or schedule name (or object) on ``stages`` stages.

    ``overrides``: the method's hyperparameters (``anneal_steps=500``). A
    :class:`Pipeline` is returned as it is when its stages and microbatches match.
    Raises :class:`~staleopt.errors.ScheduleError` for unknown names and broken
    schedule rules (2BW's ``N >= P``), :class:`~staleopt.errors.ConfigError` for bad counts.

    >>> p = build("pipemare", stages=4, microbatches=1)
    >>> p.delays, p.utilization(), p.in_flight()
    (([7, 5, 3, 1], [0, 0, 0, 0]), 1.0, [7, 5, 3, 1])
    """
    if isinstance(spec, Pipeline):
        if overrides or (spec.stages, spec.microbatches) != (stages, microbatches):
            raise ScheduleError(f"{spec!r} was built for stages={spec.stages}, microbatches={spec.microbatches}; "
                                f"build it again for stages={stages}, microbatches={microbatches}"
                                + (" with these overrides" if overrides else ""))
        return spec
    schedule, corrections = resolve(spec, **overrides)
    name = spec if isinstance(spec, str) else spec.name
    return Pipeline(name, schedule, corrections, stages, microbatches)


# Paper defaults. PipeMare: K is a quarter of the first lr phase (§3.1) and D is swept over
# {0.01, ..., 0.9} with 0.1 in both grids (Table 8); step counts are in optimizer steps and
# staleopt.train rescales them to the run's length when they are not given.
ANNEAL_STEPS, DECAY, WARMUP_STEPS, PIPELINED_STEPS = 1000, 0.1, 1000, 1000
#: T2's accumulator convention (staleopt.theory.ACCUMULATORS): the causal one, as a pipeline runs it.
ACCUMULATOR = "causal"

for _m in [
    Method("gpipe", "sync", "synchronous, flush every minibatch", "GPipe; PipeMare Table 1"),
    Method("pipedream-flush", "sync", "1F1B with a flush every minibatch (synchronous)", "PipeDream-2BW §2",
           schedule_args={"order": "1f1b"}, aliases=("1f1b-flush",)),
    Method("1f1b", "1f1b", "1F1B without stashing: stale forward, current backward", "PipeOptim §II"),
    Method("pipedream", "1f1b", "1F1B with weight stashing", "PipeDream §3.3", lambda: [Stashing()]),
    Method("pipedream-vs", "1f1b", "PipeDream with vertical sync: one version per minibatch across stages",
           "PipeDream §3.3", lambda: [Stashing(), VerticalSync()]),
    Method("pipedream-2bw", "2bw", "double-buffered weights, delay 1 forward and backward", "PipeDream-2BW §3.1"),
    Method("pb", "pb", "pipelined backpropagation with stale weights", "Stale-weights paper §3"),
    Method("pb-hybrid", "pb", "pipelined backpropagation first, then synchronous", "Stale-weights paper §4",
           lambda pipelined_steps: [Hybrid(pipelined_steps)], {"pipelined_steps": PIPELINED_STEPS}),
    Method("pipemare-stash", "dataflow", "dataflow delays with weight stashing (PipeMare's PipeDream baseline)",
           "PipeMare §4, Table 1", lambda: [Stashing()], aliases=("dataflow-stash",)),
    Method("pipemare-t1", "dataflow", "PipeMare with learning-rate rescheduling only", "PipeMare §3.1",
           lambda anneal_steps: [LRReschedule(anneal_steps)], {"anneal_steps": ANNEAL_STEPS}),
    Method("pipemare", "dataflow", "PipeMare: T1 learning-rate rescheduling + T2 discrepancy correction",
           "PipeMare §3", lambda anneal_steps, decay, accumulator: [LRReschedule(anneal_steps),
                                                                     DiscrepancyCorrection(decay, accumulator)],
           {"anneal_steps": ANNEAL_STEPS, "decay": DECAY, "accumulator": ACCUMULATOR}),
    Method("hogwild-t1", "hogwild", "Hogwild!-style random per-stage delays with T1 learning-rate rescheduling",
           "PipeMare App. E", lambda anneal_steps: [LRReschedule(anneal_steps)], {"anneal_steps": ANNEAL_STEPS}),
    Method("pipemare-w", "dataflow", "PipeMareW: synchronous warmup, then PipeMare (T1 + T2)", "PipeMare §4",
           lambda warmup_steps, anneal_steps, decay, accumulator: [Warmup(warmup_steps), LRReschedule(anneal_steps),
                                                                   DiscrepancyCorrection(decay, accumulator)],
           {"warmup_steps": WARMUP_STEPS, "anneal_steps": ANNEAL_STEPS, "decay": DECAY, "accumulator": ACCUMULATOR}),
    Method("pipemare-recompute", "dataflow-recompute",
           "PipeMare with PipeMare Recompute in segments: recomputation reads tau_fwd > tau_recomp > tau_bkwd",
           "PipeMare App. A.3, App. D", lambda anneal_steps, decay, accumulator: [
               LRReschedule(anneal_steps), DiscrepancyCorrection(decay, accumulator)],
           {"segment": None, "anneal_steps": ANNEAL_STEPS, "decay": DECAY, "accumulator": ACCUMULATOR},
           schedule_params=("segment",)),
    Method("pipeoptim", "1f1b", "1F1B with optimizer-dependent weight prediction", "PipeOptim §III",
           lambda: [WeightPrediction("optimizer")]),
    Method("spectrain", "1f1b", "1F1B with SGD-momentum weight prediction (SpecTrain)", "PipeOptim §III-B2 eq. 6",
           lambda: [WeightPrediction("sgdm")]),
    Method("xpipe", "1f1b", "1F1B with Adam-based weight prediction (XPipe)", "PipeOptim §III-B2 eq. 6",
           lambda: [WeightPrediction("adam")]),
    # The corrections published since the seeds (docs/corrections.md): AsyncPP as its authors run it (1F1B), the
    # others on PipeMare's dataflow pipeline. The papers' workers compute each gradient at one stale version
    # (weight stashing) and, for DC-ASGD and Gap-Aware, must keep that version anyway to compare it with w_t.
    Method("asyncpp", "1f1b", "1F1B + weight stashing over torch.optim.NAdam (beta1 0.99, momentum_decay 0.004, "
           "decoupled weight decay): the authors' recipe, Nesterov's look-ahead in NAdam's update",
           "Ajanthan et al., ICML 2025", lambda: [Stashing(), RequireNAdam()]),
    Method("pipemare-stash-nesterov", "dataflow", "pipemare-stash with the Nesterov SGD momentum held by a "
           "correction (base optimizer: plain SGD); at max_momentum=None and no weight decay the same as "
           "SGD(momentum, nesterov=True)",
           "Ajanthan et al., ICML 2025 (SGD form)",
           lambda lookahead_momentum, max_momentum: [Stashing(), NesterovLookahead(lookahead_momentum,
                                                                                   max_momentum)],
           {"lookahead_momentum": 0.9, "max_momentum": None}),
    Method("dc-asgd", "dataflow", "dataflow + weight stashing with delay compensation, constant lambda (DC-ASGD-c)",
           "Zheng et al., ICML 2017 §3-4", lambda lam: [Stashing(), DelayCompensation(lam)], {"lam": 0.04}),
    Method("dc-asgd-a", "dataflow", "dataflow + weight stashing with delay compensation, lambda / sqrt(MeanSquare) "
           "(DC-ASGD-a)", "Zheng et al., ICML 2017 §4",
           lambda lam, mean_square_decay: [Stashing(), DelayCompensation(lam, mean_square_decay)],
           {"lam": 2.0, "mean_square_decay": 0.95}),
    Method("gap-aware", "dataflow", "dataflow + weight stashing with each gradient divided by its Gap",
           "Barkai et al., ICLR 2020", lambda beta: [Stashing(), GapAware(beta)], {"beta": 0.999}),
    Method("staleness-aware", "dataflow", "dataflow with per-stage step sizes lr / tau (T1 without annealing)",
           "Zhang et al., IJCAI 2016", lambda: [StalenessAware()]),
]:
    register(_m)
