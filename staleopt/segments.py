"""Run a model's layers with the schedule's recompute segments checkpointed (PipeMare App. A.3).

A pipeline with PipeMare Recompute groups its stages into segments; a segment's first stage
keeps the segment's input, and the backward pass recomputes every activation inside the segment
from it (:meth:`staleopt.schedules.Schedule.segments`, the layout the timeline and the hardware
model use too). :func:`checkpoint_segments` runs a forward pass written as a sequence of layers
that way: the layers of one segment go through one :meth:`staleopt.PipelineOptimizer.checkpoint`
call, whose recomputation reads ``u_recomp_i = w_{t - tau_recomp_i}``::

    def forward(self, x):                   # inside the model the optimizer wraps
        return checkpoint_segments(self.opt, [self.fc1, nn.ReLU(), self.fc2], x)

Each layer maps one value to the next (a tensor, or a tuple of tensors where a residual branch
crosses a stage boundary). A layer's stages are those of its parameters: an ``nn.Module``'s own,
a :class:`Step`'s declared modules'; any other callable reads none and joins the segment of the
layer before it. Without a recompute schedule (``segments(P) == []``), with ``opt=None``, or with
grad disabled the layers simply run in order: nothing is checkpointed.

A recomputation leaves the layers' buffers (BatchNorm running statistics) as the forward pass
left them: the forward counted the minibatch once, a recomputation does not count it again.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .errors import ConfigError, StageError, StageOrderError
from .recompute import reached_parameters

__all__ = ["Step", "checkpoint_segments", "run_layers"]


class Step:
    """A layer written as a function: ``fn(x)``, which reads the parameters of ``modules`` (and no others)."""

    __slots__ = ("fn", "modules")

    def __init__(self, fn: Callable[[Any], Any], *modules: nn.Module):
        for m in modules:
            if not isinstance(m, nn.Module):
                raise StageError(f"Step(fn, *modules) declares the modules whose parameters fn reads; got "
                                 f"{type(m).__name__}: pass nn.Module objects")
        self.fn, self.modules = fn, modules

    def __call__(self, x):
        return self.fn(x)

    def __repr__(self):
        return f"Step({', '.join(type(m).__name__ for m in self.modules) or 'no parameters'})"


def run_layers(layers: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    """``layers[-1](...layers[1](layers[0](x)))``: the layers in order, nothing checkpointed."""
    for layer in layers:
        x = layer(x)
    return x


def _modules(layer) -> Tuple[nn.Module, ...]:
    if isinstance(layer, nn.Module):
        return (layer,)
    if isinstance(layer, Step):
        return layer.modules
    return ()


class _Segment:
    """The function one ``opt.checkpoint`` call runs: a segment's layers; its later calls (recomputations)
    restore the layers' buffers afterwards."""

    def __init__(self, layers: List[Callable], buffers: List[torch.Tensor]):
        self.layers, self.buffers, self.calls = layers, buffers, 0

    def __call__(self, x):
        self.calls += 1
        if self.calls == 1 or not self.buffers:
            return run_layers(self.layers, x)
        saved = [b.clone() for b in self.buffers]
        try:
            return run_layers(self.layers, x)
        finally:  # also when torch stops the recomputation early
            with torch.no_grad():
                for b, s in zip(self.buffers, saved):
                    b.copy_(s)


def _stages(layer, stage_of: Dict[int, int], replica_stage: Dict[Tuple[int, str], int]) -> List[int]:
    """The stages whose weights ``layer`` reads: each parameter's, or where a module reads a tied parameter
    through its replica (:mod:`staleopt.replicas`, GPT-2's tied head), the replica's stage."""
    found = set()
    for m in _modules(layer):
        for sub in m.modules():
            for key, p in sub._parameters.items():
                stage = replica_stage.get((id(sub), key), stage_of.get(id(p)) if p is not None else None)
                if stage is not None:
                    found.add(stage)
    return sorted(found)


def _group(layers: Sequence[Callable], segments: List[Tuple[int, int]], stage_of: Dict[int, int],
           replica_stage: Optional[Dict[Tuple[int, str], int]] = None) -> List[Tuple[int, List[Callable]]]:
    """``(segment index, its layers)`` in order; raises unless the layers follow the segments."""
    segment_of = {i: k for k, (a, b) in enumerate(segments) for i in range(a, b + 1)}
    groups: List[Tuple[int, List[Callable]]] = []
    current, seen = 0, set()
    for n, layer in enumerate(layers):
        stages = _stages(layer, stage_of, replica_stage or {})
        seen.update(stages)
        mine = sorted({segment_of[i] for i in stages})
        if len(mine) > 1:
            raise StageError(f"layer {n} ({layer!r}) holds parameters of stages {stages}, which the schedule's "
                             f"recompute segments {segments} put in different segments: split it into layers "
                             "that each stay inside one segment (e.g. pass its submodules, or one Step per module)")
        if mine and mine[0] < current:
            raise StageOrderError(f"layer {n} ({layer!r}) holds parameters of stage {stages[0]}, but an earlier "
                                  f"layer already ran segment {segments[current]}: pass the layers in the order "
                                  "the forward pass runs them, stage 0 first")
        current = mine[0] if mine else current
        if groups and groups[-1][0] == current:
            groups[-1][1].append(layer)
        else:
            groups.append((current, [layer]))
    missing = sorted(set(segment_of) - seen)
    if missing:
        raise StageError(f"the layers hold no parameter of stages {missing}: pass every stage's layers, in "
                         "forward order (a layer that reads parameters through a function must declare its "
                         "modules: Step(fn, module))")
    return groups


def checkpoint_segments(opt: Optional[Any], layers: Sequence[Callable[[Any], Any]], x: Any, **kwargs) -> Any:
    """Run ``layers`` on ``x``, each recompute segment of ``opt``'s schedule through one ``opt.checkpoint``.

    ``opt`` is the :class:`~staleopt.PipelineOptimizer` that wraps the model whose forward calls this
    (``None``: run the layers in order). ``kwargs`` go to :meth:`~staleopt.PipelineOptimizer.checkpoint`.
    Raises :class:`~staleopt.errors.StageError` when a layer straddles two segments, when the layers miss
    a stage, or when a segment's recomputation reads the weights of a stage outside the segment (a
    function reading parameters it did not declare); :class:`~staleopt.errors.StageOrderError` when the
    layers run the segments out of order; :class:`~staleopt.errors.ConfigError` when the schedule recomputes
    ahead of the backward pass (``tau_bkwd < tau_recomp < tau_fwd``) without defining segments (a custom
    ``tau_recomp``).
    """
    if opt is None or not torch.is_grad_enabled():
        return run_layers(layers, x)
    if not hasattr(opt, "checkpoint") or not hasattr(opt, "partition"):
        raise ConfigError(f"checkpoint_segments needs the staleopt.PipelineOptimizer that wraps the model (or None), "
                          f"got a {type(opt).__name__} (opt.base_optimizer is the optimizer it wraps, not it)")
    partition = opt.partition
    segments = opt.schedule.segments(partition.num_stages)
    if not segments:
        (tf, tb), tr = opt.max_delays, opt.max_recompute_delays
        ahead = [i for i, (f, b, r) in enumerate(zip(tf, tb, tr)) if b != r != f]
        if ahead:
            raise ConfigError(f"schedule {opt.schedule!r} recomputes stages {ahead} ahead of the backward pass "
                              f"(tau_recomp = {tr}) but defines no segments (Schedule.segments), so "
                              "checkpoint_segments cannot tell which stages to recompute together: call "
                              "opt.checkpoint(segment, x) around each recomputed segment yourself, or use "
                              "'dataflow-recompute'")
        return run_layers(layers, x)
    stage_of = {id(p): s.index for s in partition for p in s.params}
    replica_stage = {(id(r.module), r.key): r.stage for r in opt.replicas}
    for k, group in _group(layers, segments, stage_of, replica_stage):
        buffers = list({id(b): b for layer in group for m in _modules(layer) for b in m.buffers()}.values())
        out = opt.checkpoint(_Segment(group, buffers), x, **kwargs)
        a, b = segments[k]
        outside = sorted({stage_of[p] for p in reached_parameters(out, [x]) if p in stage_of} - set(range(a, b + 1)))
        if outside:
            raise StageError(f"the layers of recompute segment {segments[k]} read the weights of stages {outside}, "
                             "outside the segment: a layer written as a plain function reads parameters it does "
                             "not declare; wrap it as Step(fn, *modules) so it joins its stages' segment")
        x = out
    return x
