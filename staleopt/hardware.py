"""Analytic hardware model: pipeline utilization and memory of each method (docs/design.md §5).

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
  PipeOptim Table I; the buffers of the corrections published since,
  :func:`correction_bytes`), and, given a microbatch size and an example input, the
  activation memory with and without recompute (PipeMare App. A.2–A.3, Table 4).

Each method's facts (delays, steady-state utilization and phases, in-flight
microbatches, extra weight copies) come from its
:class:`~staleopt.methods.Pipeline` (:func:`staleopt.methods.build`; every
function here takes a method or schedule name, a Schedule or a Pipeline);
this module adds the bytes.

Units: bytes (``*_bytes``), fractions in [0, 1] (``utilization``), optimizer
steps or epochs (phase lengths; only their ratios matter).
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import methods
from .corrections import DelayCompensation, GapAware, Hybrid, NesterovLookahead, Warmup
from .errors import ConfigError, ScheduleError
from .methods import amortized_utilization, hybrid_speedup
from .partition import Partition, partition_model
from .replicas import plan_replicas
from .validate import check_int

__all__ = ["OPTIMIZER_SLOTS", "MemoryReport", "pipeline_utilization", "amortized_utilization",
           "hybrid_speedup", "time_to_accuracy", "effective_delays", "in_flight_counts",
           "activation_sizes", "activation_memory", "recompute_activation_memory", "correction_bytes",
           "memory_report", "run_memory"]

#: Weight-sized state buffers per optimizer (SGD: none; SGD momentum: the velocity; Adam, AdamW, NAdamW: m and v).
OPTIMIZER_SLOTS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "nadamw": 2}


def pipeline_utilization(method, stages: int, microbatches: int = 1, total_steps: Optional[float] = None,
                         warmup_steps: Optional[float] = None, pipelined_steps: Optional[float] = None) -> float:
    """Fraction of busy pipeline workers, averaged over the run (PipeMare §2, App. A.1, §4; stale-weights §4).

    * synchronous (``gpipe``, ``pipedream-flush``): ``N / (N + P - 1)``;
    * asynchronous (``1f1b``, ``pipedream``, ``pipedream-2bw``, ``dataflow``,
      ``pipemare``, ``pb``, ...): 1;
    * ``pipemare-w``: ``warmup_steps`` synchronous, the rest asynchronous,
      averaged by :func:`amortized_utilization` over ``total_steps``;
    * ``pb-hybrid``: ``pipelined_steps`` at 1, the rest synchronous on the
      ``2P - 1`` accelerators, ``N / (N + 2P - 2)`` (at ``N = 1`` one busy,
      ``1 / (2P - 1)``, and the average equals :func:`hybrid_speedup` ``/ (2P - 1)``).

    Phase lengths default to the method's correction (``Warmup.steps``,
    ``Hybrid.pipelined_steps``); ``total_steps`` (or epochs, in the same unit)
    is needed for phased methods. See :meth:`staleopt.methods.Pipeline.utilization`.
    """
    return methods.build(method, stages, microbatches).utilization(total_steps, warmup_steps, pipelined_steps)


def time_to_accuracy(steps_to_target: float, method, stages: int, microbatches: int = 1, **phase_args) -> float:
    """Wall-clock time to a target, in minibatch times of a fully utilized pipeline: ``steps / utilization``.

    Throughput is proportional to utilization (PipeMare §2), so a method that
    needs ``steps_to_target`` optimizer steps takes ``steps / Util`` (App. A,
    "time-to-accuracy"). For phased methods ``total_steps`` defaults to ``steps_to_target``, and then a phase
    length left to the method's default is cut at it (a default warmup longer than the run covers all of it, as
    :func:`staleopt.speedup.pipeline_time` cuts them).
    """
    if isinstance(steps_to_target, bool) or not isinstance(steps_to_target, numbers.Real) or \
            not 0 <= steps_to_target < math.inf:
        raise ConfigError(f"steps_to_target must be a finite number of optimizer steps >= 0, got {steps_to_target!r}")
    pipeline = methods.build(method, stages, microbatches)
    unknown = sorted(set(phase_args) - {"total_steps", *methods.PHASE_LENGTHS})
    if unknown:
        raise ConfigError(f"time_to_accuracy got unknown phase argument(s) {unknown}: it takes total_steps and "
                          f"{', '.join(methods.PHASE_LENGTHS)}")
    if steps_to_target == 0:
        return 0.0  # (no steps take no time, whatever the phases)
    if "total_steps" not in phase_args:
        phase_args["total_steps"] = steps_to_target
        for c in pipeline.corrections:
            if isinstance(c, Warmup):
                phase_args.setdefault("warmup_steps", min(c.steps, steps_to_target))
            if isinstance(c, Hybrid):
                phase_args.setdefault("pipelined_steps", min(c.pipelined_steps, steps_to_target))
    return steps_to_target / pipeline.utilization(**phase_args)


def effective_delays(method, stages: int, microbatches: int = 1) -> Tuple[List[int], List[int]]:
    """Largest per-stage ``(tau_fwd, tau_bkwd)`` of ``method``: the schedule's, then each correction's in order."""
    return methods.build(method, stages, microbatches).delays


def in_flight_counts(method, stages: int, microbatches: int = 1) -> List[int]:
    """Microbatches whose activations stage ``i`` holds at once, in steady state (closed forms).

    GPipe ``N``; PipeDream-Flush ``min(P - i, N)``; 1F1B, PipeDream, 2BW ``P - i``
    (2BW paper §3.1: at most the pipeline depth); dataflow ``2(P-1-i) + 1``
    (PipeMare App. A.2, 0-based ``i``); pipelined backprop ``2(P-1-i)``
    (stale-weights §3, the degree of staleness), and 1 at the last stage (its
    forward and backward in one cycle). Equal to
    :attr:`staleopt.timeline.Timeline.peak_in_flight` of a long run (tested).
    """
    return methods.build(method, stages, microbatches).in_flight()


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


def _check_stages(sizes: Sequence[Tuple[int, int]], **counts: Sequence[int]) -> None:
    """:class:`~staleopt.errors.ConfigError` unless ``sizes`` holds one ``(a_i, in_i)`` pair of byte counts per stage
    (at least one) and each list of ``counts`` one count per stage, all ints >= 0 (a shorter list was cut short
    by ``zip``, silently: the bytes of the stages past its end were left out)."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise ConfigError(f"sizes must be a non-empty list of (activation bytes, input bytes) per stage "
                          f"(stage_activation_sizes), got {sizes!r:.80}")
    for i, pair in enumerate(sizes):
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ConfigError(f"sizes[{i}] = {pair!r} must be a pair (activation bytes, input bytes)")
        for value in pair:
            check_int(f"sizes[{i}]", value, 0, why="bytes")
    for name, values in counts.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != len(sizes):
            raise ConfigError(f"{name} must hold one count per stage ({len(sizes)}, as sizes does), got "
                              f"{values!r:.80}")
        for i, value in enumerate(values):
            check_int(f"{name}[{i}]", value, 0, why="microbatches held")


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

    This is a what-if for any schedule: it keeps a segment's input until the
    segment's first backward, an upper bound. A schedule that recomputes
    (``dataflow-recompute``) is priced by :func:`recompute_activation_memory`
    from its executed timing, which frees the input at its recomputation.
    """
    _check_stages(sizes, counts=counts)
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


def recompute_activation_memory(sizes: Sequence[Tuple[int, int]], recomputed: Sequence[int],
                                cached: Sequence[int]) -> int:
    """Bytes held by a pipeline that recomputes (PipeMare App. A.3): ``sum_i r_i a_i + k_i in_i``.

    ``recomputed``: per stage, recomputed activations held (from the
    recomputation to the backward: ``2(b-i) + 1`` for
    :class:`~staleopt.schedules.DataflowRecompute`); ``cached``: per stage,
    inputs kept until the recomputation (``2(P-1-b)`` at a segment's first
    stage). Both are the schedule's counts, equal to the executed timeline's
    peaks (:attr:`~staleopt.timeline.Timeline.peak_in_flight`,
    :attr:`~staleopt.timeline.Timeline.peak_cached_inputs`).
    """
    _check_stages(sizes, recomputed=recomputed, cached=cached)
    return sum(r * a + k * i for r, k, (a, i) in zip(recomputed, cached, sizes))


def correction_bytes(pipeline: "methods.Pipeline", stage_bytes: Sequence[int], optimizer: str) -> int:
    """Bytes of the weight-sized buffers the corrections published since the seeds keep (docs/corrections.md).

    ``stage_bytes``: ``|w_i|`` per stage; ``tau_i = tau_fwd_i`` (the pipeline's largest delays).

    * delay compensation (DC-ASGD, Zheng et al. §4) and Gap-Aware (Barkai et al.) compare ``w_t`` with
      the version ``w_{t - tau_i}`` the gradient was computed with, so a stage keeps its ``tau_i`` latest
      versions: ``sum_i |w_i| tau_i``, once for both, and nothing more with weight stashing (the stash
      holds exactly these); plus one statistic ``|w_i|`` per delayed stage each for DC-ASGD-a
      (``MeanSquare``) and Gap-Aware (the running mean square step ``v``);
    * the Nesterov look-ahead (Ajanthan et al.): its momentum, ``|w_i|`` per stage (it replaces the base
      optimizer's, so use it with ``optimizer="sgd"``; ``optimizer`` is not read otherwise);
    * staleness-aware step sizes (Zhang et al.): nothing.
    """
    w = list(stage_bytes)
    tau = pipeline.delays[0]
    delayed = sum(wi for wi, t in zip(w, tau) if t > 0)
    total, versions = 0, False
    for c in pipeline.corrections:
        if isinstance(c, (DelayCompensation, GapAware)):
            versions = True
            if isinstance(c, GapAware) or c.mean_square_decay is not None:
                total += delayed
        elif isinstance(c, NesterovLookahead):
            total += sum(w)
    if versions and not pipeline.stashes:
        total += sum(wi * t for wi, t in zip(w, tau))
    return total


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
    * ``correction_bytes``: the buffers of the corrections published since the seeds (delay
      compensation, Gap-Aware, the Nesterov look-ahead; :func:`correction_bytes`);
    * ``weight_optimizer_bytes``: their sum (PipeMare Table 2's "Memory");
      ``ratio_to_gpipe`` divides it by GPipe's (weights + gradients + optimizer).

    Activations (PipeMare App. A.2–A.3), when a microbatch size and example
    input were given, else None: ``activation_bytes`` without recompute,
    ``activation_recompute_bytes`` with PipeMare Recompute in segments of
    ``recompute_segment`` stages. ``total_bytes`` = weights+optimizer + the activations the
    method holds (when known): without recompute, except for a schedule that recomputes in
    its own segments (``recomputes``: ``pipemare-recompute``), whose ``activation_bytes`` is
    the what-if without it; that is the memory the method needs, and
    ``total_ratio_to_gpipe`` divides it by GPipe's total at the same stages,
    microbatches and microbatch size (``gpipe_total_bytes``; GPipe holds all ``N``
    microbatches of a minibatch at every stage). The weights-only
    ``ratio_to_gpipe`` leaves the activations out, which can reverse an order:
    PipeMare keeps fewer weight copies than PipeDream but twice its activations in
    flight (``tau_fwd_i + 1`` microbatches at stage ``i`` against ``P - i``).
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
    correction_bytes: int
    weight_optimizer_bytes: int
    gpipe_weight_optimizer_bytes: int
    in_flight: Optional[Tuple[int, ...]] = None
    microbatch_size: Optional[int] = None
    activation_bytes: Optional[int] = None
    activation_recompute_bytes: Optional[int] = None
    recompute_segment: Optional[int] = None
    gpipe_total_bytes: Optional[int] = None
    recomputes: bool = False

    @property
    def total_ratio_to_gpipe(self) -> Optional[float]:
        """Total memory (weights, optimizer state, correction buffers, activations in flight) relative to
        GPipe's; ``None`` without activations."""
        if self.activation_bytes is None or not self.gpipe_total_bytes:
            return None
        return self.total_bytes / self.gpipe_total_bytes

    @property
    def ratio_to_gpipe(self) -> float:
        """Weight+optimizer memory relative to GPipe's (PipeMare Table 2's "Memory" column)."""
        return self.weight_optimizer_bytes / self.gpipe_weight_optimizer_bytes

    @property
    def total_bytes(self) -> int:
        held = self.activation_recompute_bytes if self.recomputes else self.activation_bytes
        return self.weight_optimizer_bytes + (held or 0)

    def as_dict(self) -> Dict:
        d = asdict(self)
        d.update(ratio_to_gpipe=self.ratio_to_gpipe, total_bytes=self.total_bytes,
                 total_ratio_to_gpipe=self.total_ratio_to_gpipe)
        return d

    def rows(self) -> List[Tuple[str, object]]:
        """``(field, value)`` rows for tables: the scalar fields plus ratio and total."""
        skip = {"stage_weight_bytes", "tau_fwd", "tau_bkwd", "in_flight"}
        out = [(f.name, getattr(self, f.name)) for f in fields(self) if f.name not in skip]
        return out + [("total_bytes", self.total_bytes), ("ratio_to_gpipe", self.ratio_to_gpipe),
                      ("total_ratio_to_gpipe", self.total_ratio_to_gpipe)]


def memory_report(model: nn.Module, method, stages: int, microbatches: int = 1, optimizer: str = "sgd-momentum",
                  partition: Optional[Partition] = None, microbatch_size: Optional[int] = None,
                  example_input: Optional[torch.Tensor] = None, recompute_segment: Optional[int] = None,
                  sizes: Optional[Sequence[Tuple[int, int]]] = None) -> MemoryReport:
    """The :class:`MemoryReport` of ``method`` on ``model`` split into ``stages`` stages.

    ``partition``: a :class:`~staleopt.partition.Partition` (default: equal
    operator counts per stage, as in PipeMare §4.1; a tied weight counts in every stage that holds a replica
    of it, :mod:`staleopt.replicas`). ``optimizer``: ``"sgd"``,
    ``"sgd-momentum"`` or ``"adam"``. Activation memory needs both
    ``microbatch_size`` and ``example_input``; ``sizes`` may pass their
    :func:`activation_sizes` when pricing several methods on one partition.
    """
    pipeline = methods.build(method, stages, microbatches)
    if optimizer not in OPTIMIZER_SLOTS:
        raise ConfigError(f"optimizer must be one of {sorted(OPTIMIZER_SLOTS)}, got {optimizer!r}")
    if partition is None:
        partition = partition_model(model, stages)
    elif partition.num_stages != stages:
        raise ConfigError(f"partition has {partition.num_stages} stages but stages={stages}: make them agree")
    tf, tb = pipeline.delays
    w = [s.nbytes for s in partition]
    # a tied weight is held by every stage that uses it; the engine's partition (opt.partition) holds its replicas
    for r in () if partition.replicas else plan_replicas(model, partition, allocate=False)[0]:
        w[r.stage] += r.nbytes
    W = sum(w)
    slots = OPTIMIZER_SLOTS[optimizer]
    gpipe = (2 + slots) * W
    copies = pipeline.weight_copies(w, optimizer)
    since = correction_bytes(pipeline, w, optimizer)
    report = dict(method=pipeline.name, stages=pipeline.stages, microbatches=pipeline.microbatches,
                  optimizer=optimizer, stage_weight_bytes=tuple(w), tau_fwd=tuple(tf), tau_bkwd=tuple(tb),
                  weights_bytes=W, gradients_bytes=W, optimizer_bytes=slots * W, **copies, correction_bytes=since,
                  weight_optimizer_bytes=gpipe + copies["stash_bytes"] + copies["second_version_bytes"]
                  + copies["prediction_bytes"] + copies["t2_bytes"] + since,
                  gpipe_weight_optimizer_bytes=gpipe)
    if (microbatch_size is None) != (example_input is None and sizes is None):
        raise ConfigError("activation memory needs both microbatch_size and example_input (a batch tensor)")
    if microbatch_size is not None:
        counts = pipeline.in_flight()
        if sizes is None:
            sizes = activation_sizes(model, partition, example_input, microbatch_size)
        elif len(sizes) != pipeline.stages:
            raise ConfigError(f"sizes has {len(sizes)} entries, one per stage of another partition: {pipeline.name} "
                              f"runs on {pipeline.stages} stages; pass activation_sizes(model, partition, "
                              "example_input, microbatch_size) of this partition")
        segments = pipeline.schedule.segments(pipeline.stages)
        if segments:
            # the schedule recomputes (PipeMare App. A.3): its own segments, as executed
            if recompute_segment is not None:
                raise ConfigError(f"{pipeline.name} recomputes in its own segments ({segments}); set them on the "
                                  "method (segment=...), not with recompute_segment")
            plain_counts = pipeline.schedule.without_recompute().in_flight(pipeline.stages, pipeline.microbatches)
            plain = activation_memory(sizes, plain_counts, 1)[0]
            recompute = recompute_activation_memory(sizes, counts, pipeline.cached_inputs())
            S = segments[0][1] - segments[0][0] + 1
        else:
            plain, recompute, S = activation_memory(sizes, counts, recompute_segment)
        gpipe_counts = methods.build("gpipe", pipeline.stages, pipeline.microbatches).in_flight()
        report.update(in_flight=tuple(counts), microbatch_size=microbatch_size, activation_bytes=plain,
                      activation_recompute_bytes=recompute, recompute_segment=S, recomputes=bool(segments),
                      gpipe_total_bytes=gpipe + activation_memory(sizes, gpipe_counts, 1)[0])
    return MemoryReport(**report)


def run_memory(records) -> "pandas.DataFrame":
    """Per method and ``P`` of a sweep's records: the weights-only and the total memory of its runs.

    Columns ``method``, ``stages``, the memory-relevant config keys (``microbatches``, ``batch_size``, ...) in
    which runs of one method and ``P`` differ (a row per value: :func:`staleopt.sweep.varying_keys`),
    ``memory_ratio_gpipe`` (weights + optimizer state + correction buffers, x GPipe),
    ``weight_optimizer_bytes``, ``activation_bytes`` (in
    flight at the run's microbatch size ``batch_size / microbatches``, measured on one
    forward pass of the run's model on its data), ``total_bytes`` and
    ``total_ratio_gpipe``. A run whose model or data this process cannot build (a model
    registered in another process: :mod:`staleopt.registry`) has NaN activations, as has a method without a
    fixed pipeline (``hogwild``: no activation count), whose weights are priced all the same.
    """
    import json
    import math

    import pandas as pd

    from . import data as datasets
    from . import models
    from .errors import StaleoptError

    keys = ["method", "stages", "microbatches", "batch_size", "optimizer", "partition", "model", "model_kwargs",
            "data", "data_kwargs"]
    missing = [k for k in keys if k not in records.columns]
    if missing:
        raise ConfigError(f"records lack the config columns {missing} that memory needs; pass the records of "
                          "staleopt.sweep.collect")

    def loads(v):
        return json.loads(v) if isinstance(v, str) else (v if isinstance(v, dict) else {})

    from .sweep import config_key, varying_keys
    if "unit_order" in records.columns:  # (records of runs before unit_order existed: registration order)
        keys.append("unit_order")
    split = [k for k in varying_keys(records) if k in keys]  # (memory keys runs of one method and P differ in)
    runs = records.groupby("run", sort=False)[keys].first()
    seen = pd.Series([config_key(r) for r in runs[["method", "stages", *split]].itertuples(index=False)])
    runs = runs[~seen.duplicated().to_numpy()]
    built, rows = {}, []
    for r in runs.itertuples(index=False):
        P, N, optimizer = int(r.stages), int(r.microbatches), str(r.optimizer)
        config = {"method": r.method, "stages": P, **{k: getattr(r, k) for k in split}}
        execution = getattr(r, "unit_order", "registration") == "execution"
        what = (r.model, json.dumps(loads(r.model_kwargs), sort_keys=True), r.data,
                json.dumps(loads(r.data_kwargs), sort_keys=True), P, r.partition, execution, int(r.batch_size) // N)
        if what not in built:
            try:
                d = datasets.load(r.data, **loads(r.data_kwargs))
                model = models.get(r.model, seed=0, num_classes=d.num_classes, input_shape=d.input_shape,
                                   **loads(r.model_kwargs))
                first = datasets.first_batch(d.train, what[-1]) if execution else None  # (the run's split)
                partition = partition_model(model, P, r.partition, example_input=first)
                example = torch.stack([d.train[i][0] for i in range(2)])
                built[what] = (model, partition, activation_sizes(model, partition, example, what[-1]))
            except (StaleoptError, ImportError, OSError) as e:  # (the figure leaves its total-memory panel out)
                warnings.warn(f"the total memory (activations in flight) of model {r.model!r} on data {r.data!r} is "
                              f"left out: this process cannot build them ({type(e).__name__}: {e}); run from where "
                              "the sweep ran (a file.py:function model is a path) or register them first "
                              "(staleopt.registry)", stacklevel=2)
                built[what] = None
        entry = built[what]
        if entry is None:
            rows.append({**config, "activation_bytes": math.nan, "total_bytes": math.nan,
                         "total_ratio_gpipe": math.nan})
            continue
        model, partition, sizes = entry
        try:
            rep = memory_report(model, r.method, P, N, optimizer=optimizer, partition=partition,
                                microbatch_size=what[-1], sizes=sizes)
            total = {"activation_bytes": rep.activation_bytes, "total_bytes": rep.total_bytes,
                     "total_ratio_gpipe": rep.total_ratio_to_gpipe}
        except ScheduleError:  # no fixed pipeline (hogwild): no activation count, the weights priced alone
            rep = memory_report(model, r.method, P, N, optimizer=optimizer, partition=partition)
            total = {"activation_bytes": math.nan, "total_bytes": math.nan, "total_ratio_gpipe": math.nan}
        rows.append({**config, "memory_ratio_gpipe": rep.ratio_to_gpipe,
                     "weight_optimizer_bytes": rep.weight_optimizer_bytes, **total})
    return pd.DataFrame(rows)
