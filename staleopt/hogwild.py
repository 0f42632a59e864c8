"""PipeMare App. E, eq. (16): Hogwild!-style delays with each stage's gradient taken on the *whole* model.

The ``hogwild`` schedule alone gives the pipeline semantics (docs/design.md §1): in one pass stage
``j`` runs on its own ``w_{t - tau_j}``. PipeMare's eq. (16) is another model,

    w_{i,t+1} = w_{i,t} - alpha [grad f(w_{t - tau_i})]_i,

where stage ``i``'s gradient comes from a forward and backward pass of the whole model at
``w_{t - tau_i}``. :func:`eq16_step` computes that exactly, one pass per distinct delay of the step.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from .errors import ConfigError, LoopError, ScheduleError
from .optimizer import PipelineOptimizer
from .partition import _modules_in_order
from .schedules import Hogwild

__all__ = ["eq16_step"]


def eq16_step(optimizer: PipelineOptimizer, closure: Callable[[], torch.Tensor]) -> Dict[int, torch.Tensor]:
    r"""One optimizer step of PipeMare App. E, eq. (16), on a :class:`~staleopt.PipelineOptimizer` with the
    ``hogwild`` schedule; returns ``{delay: loss}``, the closure's loss of each pass.

    The step's delays ``tau_i`` are the schedule's draw (``optimizer.tau_fwd``, the delays the pipeline
    semantics would use). For each distinct delay ``d`` among them, ``closure()`` runs with every
    stage at ``w_{t-d}``, forward and backward (:meth:`~staleopt.PipelineOptimizer.passes_with_delays`),
    and stage ``i`` keeps the gradient of the pass with ``d = tau_i``; then ``optimizer.step()``
    applies them (T1's factors from the drawn ``tau_i``, as in the pipeline semantics).

    Cost: one forward and backward pass per distinct delay, at most ``min(P, tau_max + 1)`` per
    step, against one for the pipeline semantics.

    ``closure``: as for ``torch.optim`` — it computes the loss of the step's minibatch with the
    model, calls ``backward()`` and returns the loss; it does not call ``step()``. Every pass uses
    that minibatch, ``f_t`` (eq. 16 writes ``f_{t - tau_i}``, the sample drawn when the stale
    gradient was computed; with i.i.d. minibatches both are a fresh sample independent of
    ``w_{t - tau_i}``, and ``f_t`` keeps both semantics on one data stream). Parameters outside
    the pipeline partition get no gradient. Buffers (BatchNorm's running statistics) are handled as
    gradients: every pass starts from the step's buffers, and stage ``i``'s keep what its pass at
    ``d = tau_i`` left (a module's stage: its unit's, else the last unit's before it in module order), so
    each is updated once per step, as in the pipeline. A tied weight is one parameter of its owner's
    stage: its gradient, every use's, comes from the owner's pass (eq. 16 per parameter; the pipeline
    semantics give each use its own stage's version instead).
    """
    if not isinstance(optimizer, PipelineOptimizer):
        raise ConfigError(f"eq16_step drives a staleopt.PipelineOptimizer, got {type(optimizer).__name__}")
    if not isinstance(optimizer.schedule, Hogwild):
        raise ScheduleError(f"eq16_step is PipeMare App. E's Hogwild! model (eq. 16); this optimizer's schedule is "
                            f"{optimizer.schedule!r}, a pipeline whose stages read their own versions within one "
                            "pass: build the optimizer with schedule='hogwild' or 'hogwild-t1'")
    if not callable(closure):
        raise ConfigError(f"eq16_step needs a closure that computes the loss of the step's minibatch, calls "
                          f"backward() and returns the loss (as for torch.optim's step(closure)), got {closure!r}")
    tau, step = optimizer.tau_fwd, optimizer.step_count
    stages = [list(stage.params) for stage in optimizer.partition]
    grads = [[None] * len(ps) for ps in stages]
    buffers = _buffer_stages(optimizer._model, optimizer.partition)
    with torch.no_grad():
        start = [b.clone() for b, _ in buffers]
    kept = list(start)
    losses = {}
    for d in sorted(set(tau)):
        optimizer.zero_grad()
        with torch.no_grad():
            for (b, _), b0 in zip(buffers, start):
                b.copy_(b0)
        with optimizer.passes_with_delays([d] * len(tau), [d] * len(tau)):
            losses[d] = closure()
        with torch.no_grad():
            kept = [b.clone() if tau[i] == d else k for (b, i), k in zip(buffers, kept)]
        if optimizer.step_count != step:
            raise LoopError(f"eq16_step's closure called step() (the optimizer is at step {optimizer.step_count}, "
                            f"not {step}): the closure only computes the loss and its gradient; eq16_step steps")
        if all(p.grad is None for ps in stages for p in ps):
            raise LoopError(f"eq16_step's closure left no gradient in the model's stages for the pass at delay {d}: "
                            "it must call loss.backward() on the model's output")
        for i, ps in enumerate(stages):  # (copies: DDP's gradient_as_bucket_view, or a zero_grad that zeroes
            if tau[i] == d:                # in place, writes the next pass's gradient into the same tensors)
                grads[i] = [None if p.grad is None else p.grad.detach().clone() for p in ps]
    optimizer.zero_grad()
    for ps, gs in zip(stages, grads):
        for p, g in zip(ps, gs):
            p.grad = g
    with torch.no_grad():
        for (b, _), k in zip(buffers, kept):
            b.copy_(k)
    optimizer.step()
    return losses


def _buffer_stages(model: torch.nn.Module, partition) -> List[Tuple[torch.Tensor, int]]:
    """``(buffer, stage)`` for every buffer of ``model``: its module's unit's stage, else that of the last unit
    before it in the partition's module order (stage 0 before the first), as ``foreign_registrations`` places a
    module (:mod:`staleopt.partition`)."""
    stage_of = {u.name: s.index for s in partition for u in s.units}
    out, stage = [], 0
    for name, module in _modules_in_order(model, partition.module_order):
        stage = stage_of.get(name, stage)
        out += [(b, stage) for b in module.buffers(recurse=False)]
    return out
