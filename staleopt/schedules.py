"""Pipeline schedules: where the weight delays come from (DESIGN §2).

A schedule turns ``(P, N)`` — stages and microbatches per minibatch — into
per-stage delays ``tau_fwd[i]`` and ``tau_bkwd[i]``, counted in optimizer steps.
Stage ``i`` is 0-based, stage 0 next to the input.

==========  ==========================================  ========================  ==========
name        meaning                                     tau_fwd[i]                tau_bkwd[i]
==========  ==========================================  ========================  ==========
sync        flush every minibatch (GPipe, PD-Flush)     0                         0
dataflow    fully asynchronous dataflow accelerator     ceil((2(P-1-i)+1)/N)      0
            (PipeMare §2, App. A.1)
1f1b        one-forward-one-backward, no stashing       ceil((P-1-i)/N)           0
            (PipeOptim §II "Vanilla-1F1B")
pb          pipelined backprop, 2P-1 accelerators       ceil(2(P-1-i)/N)          0
            (stale-weights paper §3)
2bw         PipeDream-2BW double-buffered weights       1 (0 when P = 1; N >= P)  = tau_fwd
            (2BW paper §3.1)
hogwild     per-stage random delays, truncated          random each step,         = tau_fwd
            exponential (PipeMare App. E)               mean = dataflow's
custom      user-given arrays                           given                     given
==========  ==========================================  ========================  ==========

With ``N > 1``, microbatch ``j`` of a minibatch sees ``ceil((D_i - j)/N)`` in
the asynchronous pipelines (``D_i`` = 2(P-1-i)+1, P-1-i, 2(P-1-i)); the table
gives ``j = 0``, the largest (:meth:`Schedule.microbatch_delays`).

For example ``P=4, N=1``::

    schedule   tau_fwd        tau_bkwd
    dataflow   [7, 5, 3, 1]   [0, 0, 0, 0]
    1f1b       [3, 2, 1, 0]   [0, 0, 0, 0]
    pb         [6, 4, 2, 0]   [0, 0, 0, 0]

Weight stashing, vertical sync and the phases (warmup, hybrid) are
corrections, not schedules (``staleopt.corrections``); named methods bundle a
schedule with corrections (``staleopt.methods``). A method name is accepted
wherever a schedule name is: :func:`staleopt.methods.resolve` does the lookup.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import DelayError, ScheduleError
from .validate import check_int

__all__ = ["Schedule", "Sync", "Dataflow", "OneFOneB", "PipelinedBackprop", "TwoBW", "Hogwild",
           "Custom", "get", "names", "register"]

Delays = Tuple[List[int], List[int]]


def _check_pn(stages: int, microbatches: int) -> None:
    check_int("stages", stages, minimum=1)
    check_int("microbatches", microbatches, minimum=1, why="microbatches per minibatch")


class Schedule:
    """Base class. Subclasses implement :meth:`delays`; random schedules also :meth:`sample`."""

    name: str = "schedule"
    description: str = ""
    paper: str = ""
    #: True when delays change from step to step (then :meth:`sample` draws them).
    random: bool = False

    def delays(self, stages: int, microbatches: int = 1) -> Delays:
        """Per-stage ``(tau_fwd, tau_bkwd)``; for random schedules, the largest possible delays."""
        raise NotImplementedError

    def sample(self, stages: int, microbatches: int, generator: torch.Generator) -> Delays:
        """Delays for one step. Deterministic schedules return :meth:`delays`."""
        return self.delays(stages, microbatches)

    def microbatch_delays(self, stages: int, microbatches: int) -> Tuple[List[List[int]], List[List[int]]]:
        """``tau[i][j]``: the delay microbatch ``j`` of a minibatch sees at stage ``i``.

        Default: every microbatch sees the minibatch's delay. Pipelines that run
        the microbatches of one minibatch across an update (1F1B, dataflow, pb)
        override it; :mod:`staleopt.timeline` derives the same tables from events.
        """
        tf, tb = self.delays(stages, microbatches)
        return [[t] * microbatches for t in tf], [[t] * microbatches for t in tb]

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
        _check_pn(stages, microbatches)
        return _depth_delays(self.depths(stages), microbatches), [[0] * microbatches for _ in range(stages)]


class Sync(Schedule):
    name, paper = "sync", "GPipe; PipeDream-2BW §2 (PipeDream-Flush)"
    description = "synchronous: the pipeline is flushed every minibatch, no staleness"

    def delays(self, stages, microbatches=1):
        _check_pn(stages, microbatches)
        return [0] * stages, [0] * stages


class Dataflow(_DepthSchedule):
    name, paper = "dataflow", "PipeMare §2, App. A.1"
    description = "fully asynchronous dataflow pipeline: tau_fwd = ceil((2(P-1-i)+1)/N), tau_bkwd = 0"

    def depths(self, stages):
        return [2 * (stages - 1 - i) + 1 for i in range(stages)]


class OneFOneB(_DepthSchedule):
    name, paper = "1f1b", "PipeOptim §II (Vanilla-1F1B); PipeDream §3.2 without stashing"
    description = "one-forward-one-backward without weight stashing: tau_fwd = ceil((P-1-i)/N), tau_bkwd = 0"

    def depths(self, stages):
        return [stages - 1 - i for i in range(stages)]


class PipelinedBackprop(_DepthSchedule):
    """Pipelined backprop (stale-weights paper §3): ``tau_fwd_i = ceil(2(P-1-i)/N)``.

    The paper pipelines whole minibatches (``N = 1``: ``2(P-1-i)``, DESIGN §2).
    With ``N`` microbatches per minibatch the executed pipeline
    (:mod:`staleopt.timeline`) applies one update per ``N`` microbatches, so the
    delay in minibatch steps is ``ceil(2(P-1-i)/N)``, as for the other schedules.
    """

    name, paper = "pb", "Pipelined training with stale weights of deep CNNs, §3"
    description = "pipelined backpropagation on 2P-1 accelerators: tau_fwd = ceil(2(P-1-i)/N), tau_bkwd = 0"

    def depths(self, stages):
        return [2 * (stages - 1 - i) for i in range(stages)]


class TwoBW(Schedule):
    name, paper = "2bw", "PipeDream-2BW §3.1"
    description = "double-buffered weights: every stage reads the previous version, forward = backward"

    # With one stage there is no pipeline and so no second buffer in use: delay 0.

    def delays(self, stages, microbatches=1):
        _check_pn(stages, microbatches)
        if stages == 1:
            return [0], [0]
        if microbatches < stages:
            raise ScheduleError(f"2BW keeps two weight versions only with at least as many microbatches per "
                                f"minibatch as stages (2BW paper §3.1, m >= d): got N={microbatches} < "
                                f"P={stages}; pass microbatches >= {stages}")
        return [1] * stages, [1] * stages


class Hogwild(Schedule):
    """Per-stage delays drawn each step from a truncated exponential (PipeMare App. E).

    A draw is ``floor(X)`` for ``X`` exponential truncated to ``[0, tau_max + 1)``,
    i.e. a truncated geometric law ``P(tau = k) ∝ r^k``, ``k = 0..tau_max``.
    ``r`` is solved per stage so that the expected delay equals ``means[i]``
    (``0 < means[i] < tau_max``; ``r > 1``, a negative rate, for means above
    ``tau_max / 2``). Defaults: the dataflow delays as means — on average as stale
    as PipeMare's pipeline — and ``tau_max`` twice the largest of them. Forward and
    backward read the same version. Draws come from the optimizer's seeded
    generator, so runs are reproducible.

    PipeMare's eq. (16) takes stage ``i``'s gradient with the whole model at
    ``w_{t - tau_i}``; here, as in a pipeline, each stage runs on its own version
    ``w_{t - tau_j}`` during the same pass.
    """

    name, paper, random = "hogwild", "PipeMare App. E", True
    description = "random per-stage delays, truncated exponential with given means, forward = backward"

    def __init__(self, tau_max: Optional[int] = None, means: Optional[Sequence[float]] = None):
        check_int("hogwild tau_max", tau_max, minimum=0, optional=True, error=ScheduleError)
        if means is not None and any(float(m) <= 0 for m in means):
            raise ScheduleError(f"hogwild means must be > 0, got {list(means)!r}")
        self.tau_max, self.means = tau_max, None if means is None else [float(m) for m in means]
        self._cdf = {}

    def _params(self, stages, microbatches):
        _check_pn(stages, microbatches)
        dataflow = Dataflow().delays(stages, microbatches)[0]
        means = self.means or [float(t) for t in dataflow]
        if len(means) != stages:
            raise ScheduleError(f"hogwild got {len(means)} means for {stages} stages: give one per stage")
        tau_max = self.tau_max if self.tau_max is not None else 2 * max(dataflow)
        if tau_max > 0 and any(m >= tau_max for m in means):
            raise ScheduleError(f"hogwild means {means} must be below tau_max={tau_max}: a delay law on "
                                f"0..tau_max cannot have a larger mean")
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

    def __repr__(self):
        return f"Hogwild(tau_max={self.tau_max}, means={self.means})"


class Custom(Schedule):
    """User-given delays; ``tau_bkwd`` defaults to zeros."""

    name, paper = "custom", "DESIGN §2"
    description = "user-given per-stage delays"

    def __init__(self, tau_fwd: Sequence[int], tau_bkwd: Optional[Sequence[int]] = None):
        self.tau_fwd = self._check("tau_fwd", tau_fwd)
        self.tau_bkwd = self._check("tau_bkwd", [0] * len(self.tau_fwd) if tau_bkwd is None else tau_bkwd)
        if len(self.tau_bkwd) != len(self.tau_fwd):
            raise DelayError(f"tau_fwd has {len(self.tau_fwd)} entries but tau_bkwd has {len(self.tau_bkwd)}: "
                             "give one delay per stage in each")

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

    def delays(self, stages, microbatches=1):
        _check_pn(stages, microbatches)
        if len(self.tau_fwd) != stages:
            raise DelayError(f"custom delays have {len(self.tau_fwd)} entries but the model is split into "
                             f"{stages} stages: give exactly one delay per stage")
        return list(self.tau_fwd), list(self.tau_bkwd)

    def __repr__(self):
        return f"Custom(tau_fwd={self.tau_fwd}, tau_bkwd={self.tau_bkwd})"


_REGISTRY: Dict[str, Callable[..., Schedule]] = {}


def register(name: str, factory: Callable[..., Schedule]) -> None:
    """Add a schedule factory under ``name`` (used by extensions)."""
    _REGISTRY[name] = factory


for _cls in (Sync, Dataflow, OneFOneB, PipelinedBackprop, TwoBW, Hogwild, Custom):
    register(_cls.name, _cls)


def names() -> List[str]:
    return sorted(_REGISTRY)


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
        raise ScheduleError(f"bad arguments for schedule {name!r}: {e}") from None
