"""Analytic hardware model: pipeline utilization and memory of each method (DESIGN §5).

Stands in for the dataflow accelerator PipeMare targets: for a model, a
partition into ``P`` stages, a method, ``N`` microbatches per minibatch and an
optimizer it reports

* **pipeline utilization** — the fraction of pipeline workers busy in steady
  state (PipeMare §2 "Pipeline Utilization"; throughput is proportional to it):
  ``N / (N + P - 1)`` for the synchronous schedules (GPipe, PipeDream-Flush;
  PipeMare App. A.1), 1 for the asynchronous ones, and the run-average of the
  two for phased methods (PipeMareW, hybrid);
* **memory in bytes** — weights, gradients, optimizer slots and the extra
  weight copies each method keeps (stashed versions, 2BW's second buffer, the
  predicted weights, T2's buffer; PipeMare Table 1, App. A.1; 2BW paper §3.1;
  PipeOptim Table I), and, given a microbatch size and an example input, the
  activation memory with and without recompute (PipeMare App. A.2–A.3, Table 4).

Units: bytes (``*_bytes``), fractions in [0, 1] (``utilization``), optimizer
steps or epochs (phase lengths; only their ratios matter).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .errors import ConfigError, ScheduleError
from .partition import Partition, partition_model
from .validate import check_int

__all__ = ["OPTIMIZER_SLOTS", "MemoryReport", "pipeline_utilization", "amortized_utilization",
           "hybrid_speedup", "time_to_accuracy", "effective_delays", "in_flight_counts",
           "activation_sizes", "activation_memory", "memory_report"]

#: Weight-sized state buffers per optimizer (SGD: none; SGD momentum: the velocity; Adam, AdamW: m and v).
OPTIMIZER_SLOTS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}


def _resolve(method, stages: Optional[int] = None, microbatches: Optional[int] = None):
    from . import methods
    schedule, corrections = methods.resolve(method)
    name = method if isinstance(method, str) else schedule.name
    if schedule.name == "2bw" and stages is not None and 1 < stages and microbatches < stages:
        raise ScheduleError(f"2BW needs at least as many microbatches per minibatch as stages (2BW paper §3.1, "
                            f"m >= d) to keep 2 weight versions: got N={microbatches} < P={stages}; "
                            "raise microbatches")
    return name, schedule, corrections


def _check_pn(stages, microbatches):
    check_int("stages", stages, minimum=1)
    check_int("microbatches", microbatches, minimum=1)


def _sync_utilization(stages: int, microbatches: int) -> float:
    """GPipe / PipeDream-Flush: ``N / (N + P - 1)`` (PipeMare App. A.1; fill and drain every minibatch)."""
    return microbatches / (microbatches + stages - 1)


def amortized_utilization(phases: Sequence[Tuple[float, float]]) -> float:
    """Run-average utilization of phases ``(length, utilization)``: ``sum n_k / sum (n_k / U_k)``.

    A phase of ``n_k`` steps at utilization ``U_k`` takes ``n_k / U_k`` units of
    fully-utilized time (PipeMare §4 "Warmup Epochs":
    ``Util_PipeMareW = (E_PM + E_Sync) / (E_PM / 1 + E_Sync / Util_Sync)``).
    """
    total = sum(n for n, _ in phases)
    if total <= 0:
        raise ConfigError("phases must have a positive total length")
    return total / sum(n / u for n, u in phases if n > 0)


def hybrid_speedup(total_steps: float, pipelined_steps: float, stages: int) -> float:
    """Speedup of hybrid training over non-pipelined training on ``2K + 1`` accelerators (stale-weights §4).

    ``n / (n_p / (2K + 1) + (n - n_p))`` with ``n`` steps in all, the first
    ``n_p`` pipelined, and ``K = P - 1`` register pairs between ``P`` stages.
    """
    if not 0 <= pipelined_steps <= total_steps:
        raise ConfigError(f"need 0 <= pipelined_steps <= total_steps, got {pipelined_steps} and {total_steps}")
    k = stages - 1
    return total_steps / (pipelined_steps / (2 * k + 1) + (total_steps - pipelined_steps))


def pipeline_utilization(method, stages: int, microbatches: int = 1, total_steps: Optional[float] = None,
                         warmup_steps: Optional[float] = None, pipelined_steps: Optional[float] = None) -> float:
    """Fraction of busy pipeline workers, averaged over the run (PipeMare §2, App. A.1, §4; stale-weights §4).

    * synchronous (``gpipe``, ``pipedream-flush``): ``N / (N + P - 1)``;
    * asynchronous (``1f1b``, ``pipedream``, ``pipedream-2bw``, ``dataflow``,
      ``pipemare``, ``pb``, ...): 1;
    * ``pipemare-w``: ``warmup_steps`` synchronous, the rest asynchronous,
      averaged by :func:`amortized_utilization` over ``total_steps``;
    * ``pb-hybrid``: ``pipelined_steps`` at 1, the rest non-pipelined on the
      ``2P - 1`` accelerators (one busy: ``1 / (2P - 1)``); equals
      :func:`hybrid_speedup` ``/ (2P - 1)``.

    Phase lengths default to the method's correction (``Warmup.steps``,
    ``Hybrid.pipelined_steps``); ``total_steps`` (or epochs, in the same unit)
    is needed for phased methods.
    """
    from .corrections import Hybrid, Warmup
    _check_pn(stages, microbatches)
    name, schedule, corrections = _resolve(method, stages, microbatches)
    if schedule.name == "custom":
        raise ScheduleError("custom delays have no pipeline schedule to price; use a named schedule or method")
    steady = _sync_utilization(stages, microbatches) if schedule.name == "sync" else 1.0
    for c in corrections:
        if isinstance(c, Warmup):
            n_w = c.steps if warmup_steps is None else warmup_steps
            if n_w == 0:
                continue
            if total_steps is None:
                raise ConfigError(f"{name}'s utilization is averaged over its synchronous warmup and the rest of "
                                  f"the run: pass total_steps= (and warmup_steps=, default {c.steps}; on the command line "
                                  "--total-steps and --warmup-steps)")
            if not 0 <= n_w <= total_steps:
                raise ConfigError(f"need 0 <= warmup_steps <= total_steps, got {n_w} and {total_steps}")
            return amortized_utilization([(n_w, _sync_utilization(stages, microbatches)),
                                          (total_steps - n_w, steady)])
        if isinstance(c, Hybrid):
            n_p = c.pipelined_steps if pipelined_steps is None else pipelined_steps
            if total_steps is None:
                raise ConfigError(f"{name}'s utilization is averaged over its pipelined and non-pipelined "
                                  f"phases: pass total_steps= (and pipelined_steps=, default {c.pipelined_steps}; "
                                  "on the command line --total-steps and --pipelined-steps)")
            return hybrid_speedup(total_steps, n_p, stages) / (2 * stages - 1)
    return steady


def time_to_accuracy(steps_to_target: float, method, stages: int, microbatches: int = 1, **phase_args) -> float:
    """Wall-clock time to a target, in minibatch times of a fully utilized pipeline: ``steps / utilization``.

    Throughput is proportional to utilization (PipeMare §2), so a method that
    needs ``steps_to_target`` optimizer steps takes ``steps / Util`` (App. A,
    "time-to-accuracy"). For phased methods ``total_steps`` defaults to ``steps_to_target``.
    """
    if "total_steps" not in phase_args:
        phase_args["total_steps"] = steps_to_target
    return steps_to_target / pipeline_utilization(method, stages, microbatches, **phase_args)


def effective_delays(method, stages: int, microbatches: int = 1) -> Tuple[List[int], List[int]]:
    """Largest per-stage ``(tau_fwd, tau_bkwd)`` of ``method``: the schedule's, then each correction's in order."""
    _check_pn(stages, microbatches)
    _, schedule, corrections = _resolve(method)
    tf, tb = schedule.delays(stages, microbatches)
    for c in corrections:
        tf, tb = c.delays(list(tf), list(tb), None)
    return list(tf), list(tb)


def in_flight_counts(method, stages: int, microbatches: int = 1) -> List[int]:
    """Microbatches whose activations stage ``i`` holds at once, in steady state (closed forms).

    GPipe ``N``; PipeDream-Flush ``min(P - i, N)``; 1F1B, PipeDream, 2BW ``P - i``
    (2BW paper §3.1: at most the pipeline depth); dataflow ``2(P-1-i) + 1``
    (PipeMare App. A.2, 0-based ``i``); pipelined backprop ``2(P-1-i)``
    (stale-weights §3, the degree of staleness). Equal to
    :attr:`staleopt.timeline.Timeline.peak_in_flight` of a long run (tested).
    """
    _check_pn(stages, microbatches)
    P, N = stages, microbatches
    name, schedule, _ = _resolve(method)
    key = "pipedream-flush" if name in ("pipedream-flush", "1f1b-flush") else schedule.name
    per_stage = {
        "sync": lambda i: N,
        "pipedream-flush": lambda i: min(P - i, N),
        "1f1b": lambda i: P - i, "2bw": lambda i: P - i,
        "dataflow": lambda i: 2 * (P - 1 - i) + 1,
        "pb": lambda i: 2 * (P - 1 - i),
    }.get(key)
    if per_stage is None:
        raise ScheduleError(f"schedule {schedule.name!r} has no fixed pipeline, so no activation count; "
                            "use a named pipeline schedule")
    return [per_stage(i) for i in range(P)]


def activation_sizes(model: nn.Module, partition: Partition, example_input, microbatch_size: int):
    """Per stage ``(a_i, in_i)`` in bytes for one microbatch of ``microbatch_size`` samples.

    ``a_i``: the inputs of all of stage ``i``'s parametrized operators (what
    their weight gradients ``delta x^T`` need: PipeMare App. A's "activation per
    microbatch per operator", parameter-free operators fused into them);
    ``in_i``: the input of the stage's first operator (what recompute caches).
    Measured with forward pre-hooks on ``example_input`` (a batch of any size,
    first dimension the batch) and scaled to ``microbatch_size``.
    """
    check_int("microbatch_size", microbatch_size, minimum=1)
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1 or example_input.shape[0] < 1:
        raise ConfigError("example_input must be a tensor batch (first dimension = batch size >= 1), "
                          "e.g. torch.zeros(1, 3, 32, 32)")
    seen: Dict[str, int] = {}
    hooks = []
    names = [u for stage in partition for u in stage.modules]
    for name in names:
        def pre(module, args, name=name):
            seen[name] = seen.get(name, 0) + sum(a.numel() * a.element_size() for a in args
                                                 if isinstance(a, torch.Tensor))
        hooks.append(model.get_submodule(name).register_forward_pre_hook(pre))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(example_input)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    scale = microbatch_size / example_input.shape[0]
    out = []
    for stage in partition:
        a = sum(seen.get(n, 0) for n in stage.modules)
        out.append((round(a * scale), round(seen.get(stage.modules[0], 0) * scale)))
    return out


def activation_memory(sizes: Sequence[Tuple[int, int]], counts: Sequence[int],
                      segment: Optional[int] = None) -> Tuple[int, int, int]:
    """``(without recompute, with recompute, segment S)`` in bytes (PipeMare App. A.2–A.3, Table 4).

    Without recompute stage ``i`` holds ``c_i`` microbatches of ``a_i``:
    ``sum_i c_i a_i`` (App. A.2 eq. 6–7: ``M N L`` for GPipe, ``M P^2`` for
    PipeMare when ``P = L``). PipeMare Recompute (App. A.3) splits the stages
    into segments of ``S``; a segment starting at stage ``s`` caches its input
    for its ``c_s`` in-flight microbatches and holds recomputed activations at
    its ``k``-th stage for ``2(S-1-k) + 1`` microbatches (recompute runs ahead
    of the gradient by ``2(S-1-k)`` slots; at most ``c``)::

        sum_segments [ c_s in_s + sum_k min(2(S-1-k) + 1, c_{s+k}) a_{s+k} ]

    i.e. ``O(2(P - i) + S^2)`` per segment (GPipe: ``N + S^2``). ``segment=None``
    picks the ``S`` minimizing the total (about ``sqrt(P)`` for PipeMare,
    ``sqrt(N)`` for GPipe, giving Table 4's ``M P^{3/2}`` and ``M P N^{1/2}``
    up to a factor 2, which Table 5's ratios ``1/sqrt(P)`` drop).
    """
    P = len(sizes)
    plain = sum(c * a for c, (a, _) in zip(counts, sizes))

    def with_segments(S):
        total = 0
        for s in range(0, P, S):
            seg = range(s, min(s + S, P))
            total += counts[s] * sizes[s][1]
            total += sum(min(2 * (len(seg) - 1 - k) + 1, counts[s + k]) * sizes[s + k][0]
                         for k in range(len(seg)))
        return total

    if segment is None:
        best = min(range(1, P + 1), key=lambda S: (with_segments(S), S))
        return plain, with_segments(best), best
    check_int("recompute segment", segment, minimum=1, maximum=P, why="stages per segment")
    return plain, with_segments(segment), segment


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one method on one model, in bytes (``*_bytes``); ratios are unitless.

    Weight-sized terms (PipeMare Table 1, App. A.1; 2BW paper §3.1; PipeOptim Table I):

    * ``weights_bytes`` ``|W|``: one copy of the weights;
    * ``gradients_bytes`` ``|W|``: the accumulated gradient;
    * ``optimizer_bytes``: ``slots * |W|`` (SGD 0, SGD momentum 1, Adam 2);
    * ``stash_bytes``: weight stashing, ``sum_i |w_i| tau_fwd_i`` (PipeMare App. A.1);
    * ``second_version_bytes``: 2BW's double buffer, ``|W|`` when ``P > 1`` (2BW §3.1);
    * ``prediction_bytes``: the predicted weights, ``|w_i|`` per stage with a version gap
      (PipeOptim Table I: ``[M, 2M]``), plus the rule's own moments when the base
      optimizer lacks them (SpecTrain: 1 slot, XPipe: 2);
    * ``t2_bytes``: T2's ``delta``, ``|w_i|`` per stage with ``tau_fwd_i > tau_bkwd_i`` (PipeMare §3.2);
    * ``weight_optimizer_bytes``: their sum (PipeMare Table 2's "Memory");
      ``ratio_to_gpipe`` divides it by GPipe's (weights + gradients + optimizer).

    Activations (PipeMare App. A.2–A.3), when a microbatch size and example
    input were given, else None: ``activation_bytes`` without recompute,
    ``activation_recompute_bytes`` with PipeMare Recompute in segments of
    ``recompute_segment`` stages. ``total_bytes`` = weights+optimizer + activations
    without recompute (when known).
    """

    method: str
    stages: int
    microbatches: int
    optimizer: str
    stage_weight_bytes: Tuple[int, ...]
    tau_fwd: Tuple[int, ...]
    tau_bkwd: Tuple[int, ...]
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    stash_bytes: int
    second_version_bytes: int
    prediction_bytes: int
    t2_bytes: int
    weight_optimizer_bytes: int
    gpipe_weight_optimizer_bytes: int
    in_flight: Optional[Tuple[int, ...]] = None
    microbatch_size: Optional[int] = None
    activation_bytes: Optional[int] = None
    activation_recompute_bytes: Optional[int] = None
    recompute_segment: Optional[int] = None

    @property
    def ratio_to_gpipe(self) -> float:
        """Weight+optimizer memory relative to GPipe's (PipeMare Table 2's "Memory" column)."""
        return self.weight_optimizer_bytes / self.gpipe_weight_optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_optimizer_bytes + (self.activation_bytes or 0)

    def as_dict(self) -> Dict:
        d = asdict(self)
        d.update(ratio_to_gpipe=self.ratio_to_gpipe, total_bytes=self.total_bytes)
        return d

    def rows(self) -> List[Tuple[str, object]]:
        """``(field, value)`` rows for tables: the scalar fields plus ratio and total."""
        skip = {"stage_weight_bytes", "tau_fwd", "tau_bkwd", "in_flight"}
        out = [(f.name, getattr(self, f.name)) for f in fields(self) if f.name not in skip]
        return out + [("total_bytes", self.total_bytes), ("ratio_to_gpipe", self.ratio_to_gpipe)]


def memory_report(model: nn.Module, method, stages: int, microbatches: int = 1, optimizer: str = "sgd-momentum",
                  partition: Optional[Partition] = None, microbatch_size: Optional[int] = None,
                  example_input: Optional[torch.Tensor] = None, recompute_segment: Optional[int] = None,
                  sizes: Optional[Sequence[Tuple[int, int]]] = None) -> MemoryReport:
    """The :class:`MemoryReport` of ``method`` on ``model`` split into ``stages`` stages.

    ``partition``: a :class:`~staleopt.partition.Partition` (default: equal
    operator counts per stage, as in PipeMare §4.1). ``optimizer``: ``"sgd"``,
    ``"sgd-momentum"`` or ``"adam"``. Activation memory needs both
    ``microbatch_size`` and ``example_input``; ``sizes`` may pass their
    :func:`activation_sizes` when pricing several methods on one partition.
    """
    from .corrections import DiscrepancyCorrection, Stashing, WeightPrediction
    _check_pn(stages, microbatches)
    if optimizer not in OPTIMIZER_SLOTS:
        raise ConfigError(f"optimizer must be one of {sorted(OPTIMIZER_SLOTS)}, got {optimizer!r}")
    if partition is None:
        partition = partition_model(model, stages)
    elif partition.num_stages != stages:
        raise ConfigError(f"partition has {partition.num_stages} stages but stages={stages}: make them agree")
    name, schedule, corrections = _resolve(method, stages, microbatches)
    tf, tb = effective_delays(method, stages, microbatches)
    w = [s.nbytes for s in partition]
    W = sum(w)
    slots = OPTIMIZER_SLOTS[optimizer]
    gpipe = (2 + slots) * W

    stash = sum(wi * t for wi, t in zip(w, tf)) if any(isinstance(c, Stashing) for c in corrections) else 0
    second = W if schedule.name == "2bw" and max(tf) > 0 else 0
    prediction = 0
    for c in corrections:
        if isinstance(c, WeightPrediction):
            gapped = sum(wi for wi, f, b in zip(w, tf, tb) if f > b)
            own = {"sgdm": 0 if optimizer == "sgd-momentum" else 1, "adam": 0 if optimizer == "adam" else 2}
            prediction += gapped * (1 + own.get(c.rule, 0))
    t2 = sum(sum(wi for wi, f, b in zip(w, tf, tb) if f > b)
             for c in corrections if isinstance(c, DiscrepancyCorrection))
    report = dict(method=name, stages=stages, microbatches=microbatches, optimizer=optimizer,
                  stage_weight_bytes=tuple(w), tau_fwd=tuple(tf), tau_bkwd=tuple(tb),
                  weights_bytes=W, gradients_bytes=W, optimizer_bytes=slots * W, stash_bytes=stash,
                  second_version_bytes=second, prediction_bytes=prediction, t2_bytes=t2,
                  weight_optimizer_bytes=gpipe + stash + second + prediction + t2,
                  gpipe_weight_optimizer_bytes=gpipe)
    if (microbatch_size is None) != (example_input is None):
        raise ConfigError("activation memory needs both microbatch_size and example_input (a batch tensor)")
    if microbatch_size is not None:
        counts = in_flight_counts(method, stages, microbatches)
        if sizes is None:
            sizes = activation_sizes(model, partition, example_input, microbatch_size)
        plain, recompute, S = activation_memory(sizes, counts, recompute_segment)
        report.update(in_flight=tuple(counts), microbatch_size=microbatch_size, activation_bytes=plain,
                      activation_recompute_bytes=recompute, recompute_segment=S)
    return MemoryReport(**report)
