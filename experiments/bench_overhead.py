"""Cost of simulating a pipeline with :class:`staleopt.PipelineOptimizer`: time, memory, growth.

    python experiments/bench_overhead.py --out runs/bench            # `make bench`: a few minutes
    python experiments/bench_overhead.py --out /tmp/bench --quick    # smoke run: seconds, measures nothing
    python experiments/bench_overhead.py --out runs/bench-cuda --device cuda   # on a GPU

Everything runs in one process and is reported as ratios. Durations are the
main thread's CPU time (``time.thread_time``; torch runs on that one thread),
so other jobs on a shared machine do not count; the load average before and
after is recorded in ``meta.json``. With ``--device cuda`` the models, batches
and history are on the GPU and a duration is the wall time between two
``torch.cuda.synchronize()`` calls (:func:`_cuda_clock`).

1. **Step time.** A whole training step (``zero_grad``, forward, backward, ``step``)
   with the wrapper against the base optimizer alone, same model, batch and
   initial weights. The variants are interleaved round by round (so drifting
   machine load hits them alike); the ratio is the median over rounds of
   ``t_variant / t_plain`` within a round, with its interquartile range.
   Because on a shared CPU the step-time noise is larger than the
   simulator's own cost, the *engine time* is also timed directly: the wall
   time inside the wrapper's forward pre-hook, forward hook, backward-start
   tensor hook and ``step()``, minus the plain base optimizer's ``step``
   (every hook, the end-of-backward callback included, timed at the one entry
   point all of them go through, :func:`_time_callbacks`). ``engine_ops`` and
   ``engine_copies``: the ops (non-view aten ops: kernel launches on a GPU) and
   weight bytes moved (in units of all weights) that the simulator adds to one
   whole step, counted by a ``TorchDispatchMode`` (:func:`engine_counts`).
   So it includes the slower base step over per-stage param groups (T1).
   ``weights_copy_ms`` is one ``torch._foreach_copy_`` of all weights: the
   memory-copy floor the engine time is compared with.
2. **Stale-weight memory.** Bytes of the tensors the wrapper allocated, found
   by walking every live tensor storage (``gc``) after building the wrapper
   and taking steps, minus the storages alive before, against the minimum
   the delays require::

       M_min = sum_i max(tau_fwd_i, tau_bkwd_i) * |w_i|  +  documented correction buffers

   (T2 keeps one ``|w_i|`` buffer per stage with ``tau_fwd_i > tau_bkwd_i``,
   PipeMare §3.2; weight prediction one ``dW`` buffer per delayed stage,
   PipeOptim §III; stashing and T1 keep none). The engine stores exactly
   ``H_i = max_t max(tau_fwd_i, tau_bkwd_i)`` versions per stage (loads swap
   the parameters with a slot), plus one free slot per stage whose backward
   view T2 rewrites in place; ``engine_reported_bytes`` is its own account
   (``opt.memory_bytes()``), which the measurement must equal. The hand-rolled
   deque is measured per snapshot and scaled to its steady state (full deque,
   ``H + 1`` snapshots of the whole ``state_dict``).
3. **Hand-rolled.** The same delays simulated the way it is usually written
   by hand: every step ``history.append(copy.deepcopy(model.state_dict()))``
   into a ``collections.deque(maxlen=H+1)``, then a per-parameter
   ``p.data.copy_`` of each stage's slice before the forward and before the
   backward, and of the current weights before ``step``. It simulates the
   schedule's delays only (``dataflow``; ``pipedream`` = ``1f1b`` with
   stashing), no T1/T2/prediction, which favours it. Both simulators are
   checked to produce the same weights before they are timed. Below the
   engine, the **floors** (:data:`FLOORS`): ``dataflow``'s data movement in
   minimal memory (:class:`DataMovementFloor`: one weight copy, two pointer
   moves per parameter and step) and ``pipemare``'s moves and arithmetic
   (:class:`PipemareFloor`: two copies, T2's rewrite and accumulator, T1's
   per-stage groups), with none of the engine's bookkeeping, each checked to
   give the wrapper's weights (``floor_weight_diff`` in ``step.csv``);
   ``over_floor`` in ``handrolled.csv`` is ``dataflow``'s engine time over its
   floor, what its planning, checks and pass counting cost.
4. **Growth.** Engine time and memory of staleopt ``dataflow`` and ``pipemare``
   and of the hand-rolled ``dataflow`` simulation as the stage count ``P``
   grows (1 to the model's unit count), as the ResNet-20 width grows (both
   plotted in ``growth.png``), for deeper CIFAR ResNets (ResNet-56 at
   ``P`` = 111, ResNet-110 at ``P`` = 214: ops and copies per step at that ``P``),
   and as the model grows to GPT-2 small's size (a 12-layer GPT of width 128 to
   768, 64-token windows, GPT-2's vocabulary, at ``P`` = 4: :data:`SIZES`, plotted).

5. **Where the time goes.** In the engine-bound setting (ResNet-20, batch 4,
   ``P`` = 39, dataflow delays, one thread) the engine time of ``dataflow``
   (both memory modes) and ``pipemare`` is split into the history's data
   movement (the ``torch.cat``/``_foreach_copy_``/``split_with_sizes_copy``
   calls of :mod:`staleopt.history`, timed), the extra time of the base
   step over per-stage groups (T1), and the rest (hooks, planning,
   bookkeeping, corrections), with the
   number of such calls per step and the movement in units of one copy of
   all weights.
6. **Piece by piece.** ``pipemare``'s whole step in the same setting as a ladder
   of floors, each adding one piece to the one before (:data:`LADDER`): the
   hooks alone, the stale forward views (pointing and two copies: ``dataflow``'s
   floor), pipemare's spare row, T2's backward rewrite, T2's accumulator
   update, T1's per-stage groups (pipemare's floor), then the wrapper; per
   rung the median over interleaved rounds of its step over the plain step
   and what it adds (:func:`budget`, ``budget.csv``).
7. **Goals** of the engine (docs/performance.md), measured in the engine-bound setting (:func:`goals`):
   weight copies per step, ``pipemare``'s whole step against the plain step
   (target <= 1.10), its engine ops at ``P`` = 39 and 214, and the overhead
   ratio against the hand-rolled deque (target >= 5).

8. **Recompute.** ResNet-20 (batch 4, the engine-bound setting, and batch 128)
   at ``P`` = 39 with the ``dataflow-recompute`` segments (PipeMare App. A.3):
   (a) ``pipemare`` without checkpointing; (b) ``pipemare`` with each segment
   through torch's non-reentrant checkpoint (:class:`TorchCheckpoint`: the
   recomputation reads ``u_bkwd``); (c) ``pipemare-recompute`` through
   :func:`staleopt.segments.checkpoint_segments` (``opt.checkpoint``: it reads
   ``u_recomp = w_{t - tau_recomp}`` with T2). Interleaved like table 1; each
   variant's step against the plain step, (a) and (b) per round (``ratio_b``
   of (c): what the recompute view costs over plain checkpointing;
   ``ratio_a`` of (b): what recomputing costs). (c)'s engine time adds the
   recomputation machinery (:class:`SegmentClock`). Memory: ``opt.memory_bytes()``
   and the bytes measured as in table 2, exact.

Outputs in ``--out``: ``step.csv``, ``memory.csv``, ``handrolled.csv``,
``breakdown.csv``, ``budget.csv``, ``goals.csv``, ``recompute.csv``, ``growth.csv``, ``growth.png``,
``meta.json``; the tables are printed.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import staleopt
from staleopt import methods, models, schedules, segments
from staleopt._torch_compat import queue_callback
from staleopt.corrections import DiscrepancyCorrection, WeightPrediction, t1_factor
from staleopt.machine import cpu_name, load_average, source_commit
from staleopt.theory import t2_gamma

__all__ = ["main", "HandRolled", "DataMovementFloor", "PipemareFloor", "FLOORS", "HooksFloor", "LADDER", "budget", "EngineClock", "OpCounter", "engine_counts", "SegmentClock", "TorchCheckpoint", "new_storage_bytes", "minimum_bytes",
           "ModelSpec", "MODELS"]

METHODS = ("pipemare", "pipedream", "pipeoptim")
#: Every duration is this thread's CPU time, not wall time: the machine is shared, and a job waiting
#: for a core would otherwise count other jobs' work (torch runs on this thread with --threads 1;
#: with more threads main() switches to wall time, which counts the worker threads' work).
clock = time.thread_time


def _cuda_clock() -> float:
    """Wall seconds once the GPU has finished the work queued so far (``--device cuda``): a duration between two
    readings covers the kernels launched in it. Each reading is a host-device synchronization: the timers of the
    base step and of the wrapper's hooks add theirs to the steps they time (a pair per hook, so the wrapper's
    whole step more than the plain one's; no GPU run is recorded yet)."""
    torch.cuda.synchronize()
    return time.perf_counter()


#: Where the models, batches and so the wrapper's history live (``--device``).
DEVICE = torch.device("cpu")
HAND = {"dataflow": ("dataflow", False), "pipedream": ("1f1b", True)}  # hand-rolled name -> (schedule, stashing)


class ModelSpec:
    """A benchmark model: registry name, constructor arguments, batch size and input shape. A ``gpt`` is a
    language model: its batch is ``B`` windows of ``T`` tokens and its loss the next-token cross-entropy."""

    def __init__(self, label: str, name: str, batch: int, kwargs: Optional[dict] = None):
        self.label, self.name, self.batch, self.kwargs = label, name, batch, dict(kwargs or {})
        self.input_shape = tuple(self.kwargs.get("input_shape", models.info(name).input_shape))
        self.lm = name == "gpt"
        self.classes = self.kwargs.get("num_classes", 256 if self.lm else 10)

    def build(self, seed: int = 0) -> nn.Module:
        return models.get(self.name, seed=seed, **self.kwargs).to(DEVICE)

    @property
    def max_stages(self) -> int:
        return models.num_units(self.name, **self.kwargs)

    def batch_of(self, size: Optional[int] = None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        n = size or self.batch
        if self.lm:
            x, y = (torch.randint(0, self.classes, (n, *self.input_shape), generator=g),
                    torch.randint(0, self.classes, (n, *self.input_shape), generator=g))
        else:
            x, y = torch.randn(n, *self.input_shape, generator=g), torch.randint(0, self.classes, (n,), generator=g)
        return x.to(DEVICE), y.to(DEVICE)

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.lm:
            return F.cross_entropy(output.flatten(0, 1), y.flatten())
        return F.cross_entropy(output, y)


MODELS = {
    "resnet20-tiny": ModelSpec("ResNet-20 (CIFAR, batch 4: engine-bound)", "resnet20", 4),
    "resnet20": ModelSpec("ResNet-20 (CIFAR, batch 128)", "resnet20", 128),
    "cnn1d": ModelSpec("MNIST-1D CNN (batch 64)", "cnn1d", 64),
    "transformer": ModelSpec("Transformer, 2 blocks dim 128, 64 tokens (batch 64)", "transformer", 64,
                             {"input_shape": (1, 256), "dim": 128, "heads": 4, "layers": 2, "patch": 4}),
}
#: The model-size axis of the growth section: a 12-layer GPT (windows of 64 tokens, GPT-2's
#: vocabulary) of width 128 to 768, the last GPT-2 small's shape (124M parameters, tied head), at ``P`` = 4.
SIZES = {d: ModelSpec(f"GPT d_model {d}", "gpt", 1, {"num_classes": 50257, "input_shape": (64,), "d_model": d,
                                                    "layers": 12, "heads": max(2, d // 64)}) for d in (128, 256, 512, 768)}
SIZE_STAGES = 4
#: Interleaved rounds of the models timed in steps of a few milliseconds (the engine-bound ResNet-20, whose
#: whole-step ratios are the engine's goals, and the MNIST-1D CNN): their per-round ratios spread by several
#: percent on a shared machine, so their medians take 25 rounds by default (with 5, in runs not kept, the
#: interquartile ranges were too wide to judge goals 10 % wide); a round costs well under a second there.
SHORT_STEP_ROUNDS = 25
#: Rounds of the piece-by-piece ladder (:func:`budget`, 8 variants at the engine-bound ResNet-20): its rungs differ
#: by a few percent of the step (docs/performance.md reads the committed budget.csv files), so it takes more rounds
#: than table 1 (with 25, in the first run with the ladder, at commit 7103a8c, not kept, rungs came out of order).
BUDGET_ROUNDS = 60
QUICK_SIZES = {32: ModelSpec("GPT d_model 32", "gpt", 1, {"num_classes": 512, "input_shape": (16,), "d_model": 32,
                                                         "layers": 2, "heads": 2})}
QUICK = {
    "resnet20-tiny": ModelSpec("ResNet-20 width 4 (batch 2)", "resnet20", 2, {"width": 4, "input_shape": (3, 8, 8)}),
    "resnet20": ModelSpec("ResNet-20 width 4 (batch 4)", "resnet20", 4, {"width": 4, "input_shape": (3, 8, 8)}),
    "cnn1d": ModelSpec("MNIST-1D CNN width 8 (batch 4)", "cnn1d", 4, {"width": 8}),
    "transformer": ModelSpec("Transformer dim 16 (batch 4)", "transformer", 4, {"dim": 16, "layers": 3}),
}


# ---------------------------------------------------------------------------------------------- timing
#: The wrapper timed by each live :class:`EngineClock` (by ``id``), for the timed ``_Callback``.
_CLOCKS: Dict[int, "EngineClock"] = {}


def _time_callbacks() -> None:
    """Time every hook of every wrapper: ``staleopt.optimizer._Callback`` is the one entry point of the
    forward pre-hook, the forward hook, the backward-start tensor hooks, the end-of-backward
    callback and the one global module pre-hook that watches the stage modules while a backward pass
    runs (recomputations outside ``opt.checkpoint``), so its ``__call__`` is wrapped once, at class level."""
    from staleopt import optimizer
    cls = optimizer._Callback
    if getattr(cls, "_bench_timed", False):
        return
    original = cls.__call__

    def timed_call(self, *args):
        method = self._method()
        c = None if method is None else _CLOCKS.get(id(method.__self__))
        if c is None or c._depth:
            return original(self, *args)
        c._depth += 1
        t = clock()
        try:
            return original(self, *args)
        finally:
            c.seconds += clock() - t
            c._depth -= 1

    cls.__call__ = torch._disable_dynamo(timed_call)
    cls._bench_timed = True


class EngineClock:
    """Time spent inside a wrapper's hooks per step (all of them: :func:`_time_callbacks`), and
    ``base_step``, the time of the base optimizer's ``step`` (inside the wrapper's ``step()``,
    which the caller times whole). Without a wrapper (``opt`` None) only ``base_step`` is timed.

    (Until 2026-11-24 probe hooks around the wrapper's own timed the forward pre-hook, the forward
    hook and the backward-start hook, but not the end-of-backward callback, which restores ``w_t``:
    the engine time was under-reported, e.g. pipedream's by about a third.)
    """

    def __init__(self, opt: Optional[staleopt.PipelineOptimizer], base: torch.optim.Optimizer):
        _time_callbacks()
        self.seconds, self.base_step, self._depth = 0.0, 0.0, 0
        self._opt = opt
        if opt is not None:
            _CLOCKS[id(opt)] = self
        orig = base.step

        def timed_step(*args, **kwargs):
            t = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                self.base_step += clock() - t

        base.step = timed_step

    def reset(self) -> None:
        self.seconds, self.base_step = 0.0, 0.0

    def remove(self) -> None:
        if self._opt is not None:
            _CLOCKS.pop(id(self._opt), None)
            self._opt = None


class OpCounter(TorchDispatchMode):
    """Ops dispatched (``ops``: those that are not views, i.e. kernel launches on a GPU) and bytes written
    by the ops that move weights (``copy_``, ``_foreach_copy_``, ``cat``, ``split_with_sizes_copy``)."""

    def __init__(self):
        super().__init__()
        self.ops, self.copy_bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not func.is_view and name not in ("detach", "alias", "lift_fresh"):
            self.ops += 1
        if name in ("copy_", "_foreach_copy_", "cat"):
            first = args[0]
            self.copy_bytes += sum(t.numel() * t.element_size() for t in
                                   (first if isinstance(first, (list, tuple)) else [first]))
        elif name == "split_with_sizes_copy":
            self.copy_bytes += sum(t.numel() * t.element_size() for t in kwargs["out"])
        return func(*args, **kwargs)


def engine_counts(v: "Variant", plain: "Variant") -> Tuple[int, float]:
    """``(ops, copies)`` per step that ``v``'s simulator adds to the plain step: the ops dispatched in one
    whole step minus the plain step's (T1's extra base-step ops included), and the weight bytes moved
    minus the plain step's, in units of all the model's weights. One untimed step of each."""
    out = []
    for u in (v, plain):
        with OpCounter() as counter:
            u.step()
        out.append(counter)
    weights = sum(p.numel() * p.element_size() for p in v.model.parameters() if p.requires_grad)
    return out[0].ops - out[1].ops, (out[0].copy_bytes - out[1].copy_bytes) / weights


class DataMovementFloor:
    """``dataflow``'s data movement in minimal memory with none of the engine's bookkeeping: what a simulator
    of these delays that moves the weights as the engine does (docs/engine.md) cannot go below.

    Per parameter of a stage with ``tau = tau_fwd_i > 0``, ``tau`` rows holding ``w_{t-tau}`` .. ``w_{t-1}``
    (version ``v`` in row ``v mod tau``; ``w_0`` in all at first, the ``t - tau < 0`` rule). The forward points
    the parameter at the row of ``w_{t-tau}`` (``p.data = row``); when the backward begins, ``w_t`` is copied
    over that row (one ``torch._foreach_copy_``: the row now stores ``w_t``, and the backward, whose saved
    weights alias the row, reads ``w_t``, ``tau_bkwd = 0``); at the end of the backward the parameters point at
    their own storage again; the step copies ``w_t`` into that row once more before the base step (the engine's
    push: a change to the weights between backward and step is part of ``w_t``). Two weight copies and two
    pointer moves per parameter and step; no storage checks,
    plans, pass counting or corrections, so it handles exactly one training forward and its backward per step
    (no eval between them, no recomputation, no checkpoints). ``seconds`` sums the time inside its hooks'
    bodies, as :class:`EngineClock` times the wrapper's.
    """

    spare = 0  # rows per parameter beyond tau
    moves = True  # it keeps rows and moves the weights (HooksFloor: neither)

    def __init__(self, model: nn.Module, base: torch.optim.Optimizer, partition, tau_fwd):
        self.model, self.base = model, base
        delayed = [(p, tau_fwd[s.index]) for s in partition for p in s.params if tau_fwd[s.index]]
        self.params, self.taus = [p for p, _ in delayed], [tau for _, tau in delayed]
        self.own = [p.data for p in self.params]
        self.rows = [[p.detach().clone() for _ in range(tau + self.spare)] for p, tau in delayed] if self.moves else []
        self.t, self.seconds = 0, 0.0
        self._pointed: List[torch.Tensor] = []
        model.register_forward_pre_hook(self._forward)
        model.register_forward_hook(self._output)

    def _forward(self, module, args) -> None:
        t0 = clock()
        t = self.t
        self._pointed = [rows[(t - tau) % len(rows)] for rows, tau in zip(self.rows, self.taus)]  # w_(t - tau)
        for p, row in zip(self.params, self._pointed):
            p.data = row
        self.seconds += clock() - t0

    def _output(self, module, args, output) -> None:
        t0 = clock()
        output.register_hook(self._backward)
        self.seconds += clock() - t0

    def _backward(self, grad) -> None:
        t0 = clock()
        torch._foreach_copy_(self._pointed, self.own)  # w_t over the expiring w_(t - tau), read backward
        self._rewrite(self._pointed)
        queue_callback(self._end)
        self.seconds += clock() - t0

    def _rewrite(self, rows: List[torch.Tensor]) -> None:
        """A correction of the backward view, in place (none)."""

    def _end(self) -> None:
        t0 = clock()
        for p, own in zip(self.params, self.own):
            p.data = own
        self.seconds += clock() - t0

    def train_step(self, x, y, loss_fn) -> torch.Tensor:
        self.base.zero_grad()
        loss = loss_fn(self.model(x), y)
        loss.backward()
        self._update()
        self.t += 1
        return loss

    def _update(self) -> None:
        """The step: ``w_t`` into its row (written at the backward's start, but the weights at rest may have
        changed since), then the base step."""
        if self.moves:
            t0 = clock()
            torch._foreach_copy_(self._pointed, self.own)
            self.seconds += clock() - t0
        self.base.step()


class PipemareFloor(DataMovementFloor):
    """``pipemare``'s data movement and arithmetic in minimal memory (T1 + T2, PipeMare §3) with none of the
    engine's bookkeeping: what a simulator of PipeMare that moves the weights as the engine does cannot go
    below.

    As :class:`DataMovementFloor`, with ``tau + 1`` rows per parameter (version ``v`` in row ``v mod
    (tau + 1)``) and T2's accumulator ``delta`` (0 at first): the row of ``w_{t-tau}`` that the backward's
    ``w_t`` is copied over is rewritten by T2, ``u = w_t - tau delta`` (``_foreach_addcmul_`` with the factors
    as 0-d tensors, the engine's arithmetic). ``step`` copies ``w_t`` into the spare row (``t mod (tau + 1)``),
    steps the base optimizer over one parameter group per stage with ``lr`` times T1's factor
    ``1 / tau^(1 - min(t/K, 1))``, and updates ``delta <- lerp(delta, w_(t+1) - w_t, 1 - gamma)``. Two weight
    copies per step, as the engine's. ``seconds`` times its hooks' bodies and its step but the base step (what
    stepping one group per stage adds to the base step is added by :func:`_engine`, as it is in the
    wrapper's time). ``without`` leaves pieces out, for :func:`budget` only (the weights then are not
    pipemare's): ``"t1"`` (one group at the user's ``lr``), ``"t2-rewrite"`` (the backward reads ``w_t``),
    ``"t2-update"`` (``delta`` stays 0; the rewrite's arithmetic still runs).
    """

    spare = 1
    #: the pieces :attr:`without` may leave out (:data:`LADDER`, timing only: the weights then differ from pipemare's)
    PIECES = ("t1", "t2-rewrite", "t2-update")

    def __init__(self, model: nn.Module, base: torch.optim.Optimizer, partition, tau_fwd,
                 anneal_steps: int = methods.ANNEAL_STEPS, decay: float = methods.DECAY, without: Sequence[str] = ()):
        unknown = sorted(set(without) - set(self.PIECES))
        if unknown:
            raise ValueError(f"PipemareFloor(without=...) takes pieces of {self.PIECES}, got {unknown}")
        self.without = frozenset(without)
        super().__init__(model, base, partition, tau_fwd)
        self._t1 = functools.partial(t1_factor, anneal_steps=anneal_steps)
        self.delta = [torch.zeros_like(p) for p in self.params]
        table = torch.arange(0, -(max(tau_fwd) + 1), -1, dtype=self.params[0].dtype,  # (exact in float32/64)
                             device=self.params[0].device)
        self.factors = [table[tau] for tau in self.taus]
        self.weights = [1.0 - t2_gamma(decay, tau, 0) for tau in self.taus]
        (user,) = base.param_groups  # one group per stage, lr set at each step (StageGroups' arithmetic)
        self.lr = user["lr"]
        if "t1" not in self.without:
            base.param_groups = [{**user, "params": list(s.params)} for s in partition]
        self.stage_taus = [tau_fwd[s.index] for s in partition]

    def _rewrite(self, rows: List[torch.Tensor]) -> None:
        if "t2-rewrite" not in self.without:
            torch._foreach_addcmul_(rows, self.delta, self.factors)  # T2: w_t - tau delta

    def _update(self) -> None:
        t0 = clock()
        t = self.t
        stored = [rows[t % len(rows)] for rows in self.rows]  # the spare row: w_t's
        torch._foreach_copy_(stored, self.own)
        if "t1" not in self.without:
            for group, tau in zip(self.base.param_groups, self.stage_taus):
                group["lr"] = self.lr * self._t1(tau, t)
        t1 = clock()
        self.base.step()
        t2 = clock()
        if "t2-update" not in self.without:
            torch._foreach_lerp_(self.delta, torch._foreach_sub(self.own, stored), self.weights)
        self.seconds += (t1 - t0) + (clock() - t2)


#: method -> its floor (the method's moves and arithmetic without the engine's bookkeeping)
FLOORS = {"dataflow": DataMovementFloor, "pipemare": PipemareFloor}


class HooksFloor(DataMovementFloor):
    """:class:`DataMovementFloor`'s hooks (forward pre-hook, forward hook with a tensor hook on the output,
    end-of-backward callback) with no data movement and no rows: the weights train as the plain loop's."""

    moves = False

    def _forward(self, module, args) -> None:
        pass

    def _backward(self, grad) -> None:
        queue_callback(self._end)

    def _end(self) -> None:
        pass


#: ``pipemare``'s whole step (the engine's 1.10 goal) piece by piece, each rung adding one piece to the one
#: before: (label, the floor that times it). The wrapper itself is the last rung (:func:`budget`).
LADDER = (("hooks (no data movement)", HooksFloor),
          ("+ stale forward views: pointing, two copies (dataflow's floor)", DataMovementFloor),
          ("+ pipemare's spare row (push's copy goes there)", functools.partial(PipemareFloor,
                                                                                without=PipemareFloor.PIECES)),
          ("+ T2's backward rewrite", functools.partial(PipemareFloor, without=("t1", "t2-update"))),
          ("+ T2's accumulator update", functools.partial(PipemareFloor, without=("t1",))),
          ("+ T1's per-stage groups (pipemare's floor)", PipemareFloor))


class HandRolled:
    """The stale-weight simulation written by hand: a deque of ``deepcopy(state_dict())`` per step.

    ``tau_fwd``/``tau_bkwd`` per stage; ``w_{t-tau}`` is ``history[-1 - tau]``
    (``history[0] = w_0`` until the deque is full, which is the ``t - tau < 0``
    rule). ``p.data.copy_`` swaps without bumping autograd's version counter, so
    the backward's ``W^T delta`` reads the backward view. ``seconds`` sums the
    time spent in the simulation's own code (snapshot and loads).
    """

    def __init__(self, model: nn.Module, base: torch.optim.Optimizer, partition, tau_fwd, tau_bkwd):
        self.model, self.base = model, base
        name_of = {id(p): n for n, p in model.named_parameters()}
        self.entries = [(name_of[id(p)], p, tau_fwd[s.index], tau_bkwd[s.index]) for s in partition for p in s.params]
        self.stale_backward = any(tau_bkwd)  # else the backward reads w_t
        self.history = collections.deque(maxlen=max(max(tau_fwd), max(tau_bkwd)) + 1)
        self.seconds = 0.0

    @torch.no_grad()
    def _load(self, which: int) -> None:  # 0: w_t, 1: forward views, 2: backward views
        h = self.history
        for name, p, tf, tb in self.entries:
            tau = (0, tf, tb)[which]
            p.data.copy_(h[-1 - min(tau, len(h) - 1)][name])

    def train_step(self, x, y, loss_fn) -> torch.Tensor:
        t0 = clock()
        self.history.append(copy.deepcopy(self.model.state_dict()))
        self._load(1)
        t1 = clock()
        self.base.zero_grad()
        loss = loss_fn(self.model(x), y)
        t2 = clock()
        if self.stale_backward:
            self._load(2)
        else:
            self._load(0)
        t3 = clock()
        loss.backward()
        t4 = clock()
        if self.stale_backward:
            self._load(0)
        t5 = clock()
        self.base.step()
        self.seconds += (t1 - t0) + (t3 - t2) + (t5 - t4)
        return loss


# ---------------------------------------------------------------------------------------------- memory
def _storages() -> Dict[int, torch.UntypedStorage]:
    """``{data_ptr: storage}`` of every tensor storage reachable from a gc-tracked Python object. The storages
    are held, so none of them is freed while the result lives: a tensor allocated meanwhile cannot take the
    address of one that died (a garbage tensor freed by the next ``gc.collect()``), which would hide it from
    :func:`new_storage_bytes`."""
    out = {}
    # type(), not isinstance(): isinstance reads __class__, which fails on dead weak proxies
    # and warns on some lazily deprecated torch objects
    objects = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    for o in objects:
        if o.device.type == "meta":
            continue
        try:
            s = o.untyped_storage()
            ptr = s.data_ptr()
        except RuntimeError:  # tensors without real storage (fake tensors left by torch.compile)
            continue
        if ptr:
            out[ptr] = s
    return out


def new_storage_bytes(before: Dict[int, torch.UntypedStorage]) -> int:
    """Bytes of tensor storages alive now that were not alive in ``before`` (from :func:`_storages`)."""
    gc.collect()
    return sum(s.nbytes() for ptr, s in _storages().items() if ptr not in before)


def documented_buffers(correction, partition, tau_fwd, tau_bkwd, tau_recomp=None) -> int:
    """Bytes of weight-sized buffers ``correction`` documents (see the module docstring).

    T2 with the causal accumulator keeps ``delta_{t-k}`` for ``k`` up to ``max(tau_bkwd_i, tau_recomp_i)``
    (the latter where ``tau_recomp_i < tau_fwd_i``; PipeMare App. B.4, App. D.1): ``1 + that`` rows of
    ``|w_i|`` per corrected stage, one row where both are 0 (every dataflow method without recompute)."""
    tau_recomp = list(tau_bkwd) if tau_recomp is None else tau_recomp
    if isinstance(correction, DiscrepancyCorrection):  # PipeMare §3.2: one delta per corrected stage
        rows = [1 + (max(b, r if r < f else 0) if correction.accumulator == "causal" else 0)
                for f, b, r in zip(tau_fwd, tau_bkwd, tau_recomp)]
        return sum(rows[s.index] * s.nbytes for s in partition if tau_fwd[s.index] > tau_bkwd[s.index])
    if isinstance(correction, WeightPrediction):  # PipeOptim §III: one dW per delayed stage
        if correction.rule != "optimizer":
            raise ValueError("the benchmark counts the buffers of WeightPrediction('optimizer') only")
        return sum(s.nbytes for s in partition if max(tau_fwd[s.index], tau_bkwd[s.index]) > 0)
    return 0


def minimum_bytes(opt: staleopt.PipelineOptimizer) -> int:
    """``M_min = sum_i max(tau_fwd_i, tau_bkwd_i) |w_i|`` plus the corrections' documented buffers, plus the live
    copy a later stage holds of each tied weight it reads (a replica, docs/design.md §1; its stale versions are
    in its stage's ``|w_i|``)."""
    tf, tb = opt.max_delays
    hist = sum(max(tf[s.index], tb[s.index]) * s.nbytes for s in opt.partition)
    return hist + sum(documented_buffers(c, opt.partition, tf, tb, opt.max_recompute_delays) for c in opt.corrections) \
        + sum(r.nbytes for r in opt.replicas)


# ---------------------------------------------------------------------------------------------- variants
class TorchCheckpoint:
    """:func:`~staleopt.segments.checkpoint_segments`' stand-in for the wrapper: the segments of
    ``schedule`` on ``partition``, each through torch's own non-reentrant checkpoint, whose
    recomputation reads whatever the parameters hold then (``u_bkwd``: ``tau_recomp = tau_bkwd``); no tied
    weights held as replicas."""

    replicas = ()

    def __init__(self, partition, schedule):
        self.partition, self.schedule = partition, schedule

    def checkpoint(self, function, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


class SegmentClock:
    """Time of the recomputation machinery around checkpointed segments (the wrapper's part of it).

    * ``calls``: time inside ``runner.checkpoint`` minus the time inside the
      ``torch.utils.checkpoint.checkpoint`` it calls (``opt.checkpoint``'s own work: finding the
      stages a segment reads);
    * ``window``: the wrapper's ``_enter_recompute`` / ``_leave_recompute`` (loading the recompute
      views, T2's rewrite, the backward views back).

    ``active()`` puts the timer around ``torch.utils.checkpoint.checkpoint`` for one step. (The wrapper's
    global module pre-hook, which watches the stage modules while a backward pass runs, is one of its
    hooks: :class:`EngineClock` times it.)
    """

    def __init__(self, runner, opt: Optional[staleopt.PipelineOptimizer]):
        self.seconds = 0.0
        self._inner = 0.0
        self._patched = [runner] + ([opt] if opt is not None else [])
        runner.checkpoint = self._outer(runner.checkpoint)
        if opt is not None:
            opt._enter_recompute, opt._leave_recompute = self._timed(opt._enter_recompute), self._timed(
                opt._leave_recompute)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - t
        return timed

    def _outer(self, fn):
        def outer(*args, **kwargs):
            t, inner = clock(), self._inner
            try:
                return fn(*args, **kwargs)
            finally:  # the inner call (which the inner timer counts) is not added
                self.seconds += clock() - t - (self._inner - inner)
        return outer

    @contextlib.contextmanager
    def active(self):
        original = torch.utils.checkpoint.checkpoint

        def inner(*args, **kwargs):
            t = clock()
            try:
                return original(*args, **kwargs)
            finally:
                self._inner += clock() - t

        torch.utils.checkpoint.checkpoint = inner
        try:
            yield
        finally:
            torch.utils.checkpoint.checkpoint = original

    def remove(self) -> None:
        for obj in self._patched:  # the instance attributes that shadow the methods
            for name in ("checkpoint", "_enter_recompute", "_leave_recompute"):
                obj.__dict__.pop(name, None)


class Variant:
    """One simulator (or none) on its own copy of the model: ``step()`` runs a whole training step.

    ``recompute``: ``None`` (the model's own forward), ``"torch"`` (the layers of
    :func:`staleopt.models.steps` with the ``dataflow-recompute`` segments through torch's
    checkpoint, :class:`TorchCheckpoint`) or ``"opt"`` (through ``opt.checkpoint``:
    :func:`staleopt.segments.checkpoint_segments` with the wrapper itself). ``floor``: for ``kind="floor"``,
    the floor to build instead of ``FLOORS[method]`` (a :data:`LADDER` rung's).
    """

    def __init__(self, name: str, spec: ModelSpec, stages: int, x, y, kind: str, method: Optional[str] = None,
                 memory: str = "minimal", recompute: Optional[str] = None, floor=None):
        self.name, self.kind, self.method = name, kind, method
        self.model = spec.build(seed=0)
        self.model.train()
        self.x, self.y, self.loss = x, y, spec.loss
        self.base = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.opt = self.hand = self.segment_clock = None
        self._step_s = 0.0
        self._train_step()  # the base optimizer's own state exists before the memory baseline
        self.base.zero_grad()
        before = _storages()
        if kind == "staleopt":
            self.opt = staleopt.PipelineOptimizer(self.model, self.base, stages=stages, schedule=method,
                                                  memory=memory)
        self.clock = EngineClock(self.opt, self.base) if kind != "hand" else None  # (floor: times its base step)
        if recompute is not None:
            runner = (TorchCheckpoint(self.opt.partition, schedules.get("dataflow-recompute")) if recompute == "torch"
                      else self.opt)
            self.segment_clock = SegmentClock(runner, self.opt if recompute == "opt" else None)
            self.model.forward = functools.partial(segments.checkpoint_segments, runner, models.steps(self.model))
        if kind == "hand":
            sched, stash = HAND[method]
            part = staleopt.partition_model(self.model, stages)
            tf, tb = schedules.get(sched).delays(stages, 1)
            self.hand = HandRolled(self.model, self.base, part, tf, list(tf) if stash else tb)
        if kind == "floor":  # (dataflow's delays; pipemare's are dataflow's too; ``floor``: a LADDER rung's)
            self.hand = (floor or FLOORS[method])(self.model, self.base, staleopt.partition_model(self.model, stages),
                                                  schedules.get("dataflow").delays(stages, 1)[0])
        self.rounds_s: List[float] = []
        self.engine_s: List[float] = []
        self.base_s: List[float] = []
        self.recompute_s: List[float] = []
        self._train_step()  # lazily built state exists; also the warm-up step
        self.base.zero_grad()
        self.bytes = new_storage_bytes(before)
        if isinstance(self.hand, HandRolled):  # the deque grows to maxlen snapshots: its steady state
            self.bytes = self.bytes // len(self.hand.history) * self.hand.history.maxlen

    def _train_step(self) -> None:
        """``zero_grad; loss = crit(model(x), y); loss.backward(); step`` (the hand-rolled loop does its own)."""
        if self.hand is not None:
            self.hand.train_step(self.x, self.y, self.loss)
            return
        opt = self.opt or self.base
        opt.zero_grad()
        with self.segment_clock.active() if self.segment_clock else contextlib.nullcontext():
            self.loss(self.model(self.x), self.y).backward()
        t = clock()
        opt.step()
        self._step_s += clock() - t

    step = _train_step

    def engine_seconds(self) -> float:
        """Time in the simulator since the last :meth:`reset`: the hand-rolled loop's own code; the
        wrapper's hooks and whole ``step()`` (base step included: per-stage param groups slow it,
        :func:`_engine` subtracts the plain base step); for the plain model, nothing."""
        if self.hand is not None:
            return self.hand.seconds
        if self.opt is None:
            return self.clock.seconds
        return self.clock.seconds + self._step_s

    def reset(self) -> None:
        if self.hand is not None:
            self.hand.seconds = 0.0
        if self.clock is not None:
            self.clock.reset()
        if self.segment_clock is not None:
            self.segment_clock.seconds = 0.0
        self._step_s = 0.0

    def timed_steps(self, n: int) -> float:
        """Mean seconds of ``n`` whole steps; records the engine time per step too."""
        self.reset()
        t0 = clock()
        for _ in range(n):
            self._train_step()
        total = (clock() - t0) / n
        self.rounds_s.append(total)
        self.engine_s.append(self.engine_seconds() / n)
        self.base_s.append(self.clock.base_step / n if self.clock else 0.0)
        self.recompute_s.append(self.segment_clock.seconds / n if self.segment_clock else 0.0)
        return total

    def release(self) -> None:
        if self.segment_clock is not None:
            self.segment_clock.remove()
        if self.clock is not None:
            self.clock.remove()
        if self.opt is not None:
            self.opt.remove_hooks()
        self.model = self.opt = self.hand = self.base = None


def interleaved(variants: Sequence[Variant], rounds: int, steps: int) -> None:
    """``rounds`` rounds; in each every variant times ``steps`` steps, starting at a rotating position."""
    for r in range(rounds):
        for k in range(len(variants)):
            variants[(r + k) % len(variants)].timed_steps(steps)


def weights_copy_seconds(model: nn.Module, repeats: int = 20) -> float:
    """Fastest of ``repeats`` ``torch._foreach_copy_`` of all trainable weights: the memory-copy floor."""
    params = [p.data for p in model.parameters() if p.requires_grad]
    other = [p.clone() for p in params]
    best = math.inf
    for _ in range(repeats):
        t = clock()
        torch._foreach_copy_(params, other)
        best = min(best, clock() - t)
    torch._foreach_copy_(params, other)  # leave the model's weights as they were (other is a copy)
    return best


def _engine(v: "Variant", plain: "Variant") -> Tuple[float, float]:
    """(median, min) over rounds of the simulator's own seconds per step.

    For the wrapper: hooks + ``step()`` minus the plain model's base step. For a floor: its own time plus what
    its base step takes over the plain one (T1's per-stage groups).
    """
    if v.kind == "hand":
        return statistics.median(v.engine_s), min(v.engine_s)
    if v.kind == "floor":
        extra = statistics.median(v.base_s) - statistics.median(plain.base_s)
        return max(statistics.median(v.engine_s) + extra, 0.0), max(min(v.engine_s) + extra, 0.0)
    cost = [statistics.median(plain.base_s) + statistics.median(plain.engine_s),
            min(plain.base_s) + min(plain.engine_s)]
    return max(statistics.median(v.engine_s) - cost[0], 0.0), max(min(v.engine_s) - cost[1], 0.0)


def _quantiles(xs: Sequence[float]) -> Tuple[float, float, float]:
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def _ratio_quantiles(v: "Variant", ref: "Variant") -> Tuple[float, float, float]:
    """(q1, median, q3) over rounds of ``v``'s step over ``ref``'s in the same round."""
    return _quantiles([a / b for a, b in zip(v.rounds_s, ref.rounds_s)])


def check_same_weights(spec: ModelSpec, stages: int, method: str, steps: int, batch: int,
                       against: str = "hand") -> float:
    """Largest |difference| of the weights after ``steps`` steps: staleopt vs the hand-rolled loop (``against``
    "hand", a method of :data:`HAND`) or the method's floor ("floor", a method of :data:`FLOORS`), same delays."""
    sched, stash = HAND.get(method, ("dataflow", False))
    out = []
    for kind in ("staleopt", against):
        model = spec.build(seed=0)
        base = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        if kind == "staleopt":
            opt = staleopt.PipelineOptimizer(model, base, stages=stages, schedule=method)
        else:
            tf, tb = schedules.get(sched).delays(stages, 1)
            part = staleopt.partition_model(model, stages)
            hand = (HandRolled(model, base, part, tf, list(tf) if stash else tb) if kind == "hand"
                    else FLOORS[method](model, base, part, tf))
        for t in range(steps):
            x, y = spec.batch_of(batch, seed=100 + t)
            if kind == "staleopt":
                opt.zero_grad()
                spec.loss(model(x), y).backward()
                opt.step()
            else:
                hand.train_step(x, y, spec.loss)
        out.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        if kind == "staleopt":
            opt.remove_hooks()
    return float((out[0] - out[1]).abs().max())


# ---------------------------------------------------------------------------------------------- sections
def bench_model(key: str, spec: ModelSpec, rounds: int, steps: int, log) -> Tuple[list, list, list]:
    """Step, memory and hand-rolled rows of one model at its maximum stage count."""
    P = spec.max_stages
    x, y = spec.batch_of()
    variants = [Variant("plain", spec, P, x, y, "plain")]
    variants += [Variant(m, spec, P, x, y, "staleopt", m) for m in (*METHODS, "dataflow")]
    variants += [Variant(f"{h} (memory=fast)", spec, P, x, y, "staleopt", h, memory="fast") for h in HAND]
    variants += [Variant(f"hand-rolled {h}", spec, P, x, y, "hand", h) for h in HAND]
    variants += [Variant(f"floor {m}", spec, P, x, y, "floor", m) for m in FLOORS]
    interleaved(variants, rounds, steps)
    plain = variants[0]
    plain_med = statistics.median(plain.rounds_s)
    copy_s = weights_copy_seconds(plain.model)
    step_rows, mem_rows, hand_rows = [], [], []
    by = {v.name: v for v in variants}
    for v in variants[1:]:
        q1, med, q3 = _ratio_quantiles(v, plain)
        engine, engine_min = _engine(v, plain)
        ops, copies = engine_counts(v, plain)
        step_rows.append({"model": key, "stages": P, "variant": v.name, "batch": spec.batch,
                          "plain_ms": 1e3 * plain_med, "step_ms": 1e3 * statistics.median(v.rounds_s),
                          "ratio": med, "ratio_q1": q1, "ratio_q3": q3,
                          "engine_ms": 1e3 * engine, "engine_min_ms": 1e3 * engine_min,
                          "engine_ratio": (plain_med + engine) / plain_med,
                          "engine_ops": ops, "engine_copies": copies,
                          "weights_copy_ms": 1e3 * copy_s, "rounds": rounds, "steps_per_round": steps,
                          "floor_weight_diff": (check_same_weights(spec, P, v.method, steps=4, batch=min(spec.batch, 8),
                                                                   against="floor") if v.kind == "floor" else math.nan)})
        if v.kind == "staleopt":
            minimum = minimum_bytes(v.opt)
            mem_rows.append({"model": key, "stages": P, "method": v.name, "measured_bytes": v.bytes,
                             "engine_reported_bytes": v.opt.memory_bytes(), "minimum_bytes": minimum,
                             "ratio_to_minimum": v.bytes / minimum if minimum else 1.0})
    for h in HAND:
        s, hr = by[h], by[f"hand-rolled {h}"]
        err = check_same_weights(spec, P, h, steps=4, batch=min(spec.batch, 8))
        s_row = next(r for r in step_rows if r["variant"] == h)
        f_row = next(r for r in step_rows if r["variant"] == f"{h} (memory=fast)")
        h_row = next(r for r in step_rows if r["variant"] == hr.name)
        floor = next((r for r in step_rows if r["variant"] == f"floor {h}"), None)
        minimum = minimum_bytes(s.opt)
        hand_rows.append({"model": key, "stages": P, "simulation": h,
                          "staleopt_ratio": s_row["ratio"], "hand_ratio": h_row["ratio"],
                          "speed_ratio": _ratio_quantiles(hr, s)[1],
                          "staleopt_engine_ms": s_row["engine_ms"], "hand_engine_ms": h_row["engine_ms"],
                          "overhead_ratio": h_row["engine_ms"] / max(s_row["engine_ms"], 1e-9),
                          "overhead_ratio_min": h_row["engine_min_ms"] / max(s_row["engine_min_ms"], 1e-9),
                          "fast_engine_ms": f_row["engine_ms"],
                          "overhead_ratio_fast": h_row["engine_ms"] / max(f_row["engine_ms"], 1e-9),
                          "fast_bytes": by[f"{h} (memory=fast)"].bytes,
                          "weights_copy_ms": 1e3 * copy_s,
                          "staleopt_bytes": s.bytes, "hand_bytes": hr.bytes, "minimum_bytes": minimum,
                          "memory_ratio": hr.bytes / max(s.bytes, 1), "max_abs_weight_diff": err,
                          "floor_engine_ms": floor["engine_ms"] if floor else math.nan,
                          "over_floor": s_row["engine_ms"] / max(floor["engine_ms"], 1e-9) if floor else math.nan})
    for v in variants:
        v.release()
    log(f"  {key}: P={P}, plain step {1e3 * plain_med:.1f} ms")
    return step_rows, mem_rows, hand_rows


def bench_growth(spec: ModelSpec, stage_counts: Sequence[int], widths: Sequence[int], batch: int, steps: int,
                 log, deep: Sequence[Tuple[int, int]] = (), sizes: Sequence[ModelSpec] = (),
                 size_stages: int = SIZE_STAGES, size_steps: int = 2) -> List[dict]:
    """Engine time and memory vs P, and vs width at the max P: staleopt ``dataflow`` (the same
    simulation as the hand-rolled loop), staleopt ``pipemare`` (T1 + T2) and hand-rolled ``dataflow``;
    ``deep``: ``(depth, P)`` of deeper CIFAR ResNets (axis ``depth``: ResNet-56 at P = 111, ResNet-110 at 214);
    ``sizes``: models of growing size at ``size_stages`` (axis ``size``, value ``d_model``: up to GPT-2 small,
    :data:`SIZES`), ``size_steps`` steps per round at their own batch."""
    rows = []
    configs = [("stages", P, spec, P, batch, steps) for P in stage_counts]
    for w in widths:
        s = ModelSpec(f"width {w}", spec.name, spec.batch, {**spec.kwargs, "width": w})
        configs.append(("width", w, s, s.max_stages, batch, steps))
    for depth, P in deep:
        configs.append(("depth", depth, ModelSpec(f"ResNet-{depth}", f"resnet{depth}", spec.batch, spec.kwargs), P,
                        batch, steps))
    for s in sizes:
        configs.append(("size", s.kwargs["d_model"], s, min(size_stages, s.max_stages), s.batch, size_steps))
    for axis, value, s, P, batch, steps in configs:
        x, y = s.batch_of(batch)
        vs = [Variant("plain", s, P, x, y, "plain"), Variant("dataflow", s, P, x, y, "staleopt", "dataflow"),
              Variant("pipemare", s, P, x, y, "staleopt", "pipemare"),
              Variant("hand", s, P, x, y, "hand", "dataflow")]
        interleaved(vs, 3, steps)
        row = {"axis": axis, "value": value, "stages": P, "params": sum(p.numel() for p in vs[0].model.parameters()),
               "model": s.label,
               "plain_ms": 1e3 * statistics.median(vs[0].rounds_s),
               "weights_copy_ms": 1e3 * weights_copy_seconds(vs[0].model)}
        for v in vs[1:]:
            med, low = _engine(v, vs[0])
            ops, copies = engine_counts(v, vs[0])
            row.update({f"{v.name}_engine_ms": 1e3 * med, f"{v.name}_engine_min_ms": 1e3 * low,
                        f"{v.name}_bytes": v.bytes, f"{v.name}_ops": ops, f"{v.name}_copies": copies})
            if v.opt is not None:
                row[f"{v.name}_minimum_bytes"] = minimum_bytes(v.opt)
        rows.append(row)
        for v in vs:
            v.release()
        del vs
        gc.collect()  # (the size axis holds GPT-2 small four times over: free it before the next)
        log(f"  growth {axis}={value}: done")
    return rows


def plot_growth(df: pd.DataFrame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = ((0, "stages", "stages P (ResNet-20)", "value"), (1, "width", "ResNet-20 width (max P)", "value"),
               (2, "size", f"parameters, M (12-layer GPT, P = {SIZE_STAGES})", "params_m"))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    df = df.assign(params_m=df.params / 1e6)
    for col, axis, xlabel, x in columns:
        d = df[df.axis == axis].sort_values("value")
        if d.empty:
            continue
        ax = axes[0, col]
        ax.plot(d[x], d.dataflow_engine_ms, "o-", label="staleopt, dataflow")
        ax.plot(d[x], d.pipemare_engine_ms, "^-.", label="staleopt, pipemare (T1+T2)")
        ax.plot(d[x], d.hand_engine_ms, "s--", label="hand-rolled deque, dataflow")
        ax.plot(d[x], d.weights_copy_ms, "k:", label="one copy of all weights (foreach)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("simulator time per step (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax = axes[1, col]
        ax.plot(d[x], d.dataflow_bytes / 2**20, "o-", label="staleopt, dataflow (= its minimum)")
        ax.plot(d[x], d.pipemare_bytes / 2**20, "^-.", label="staleopt, pipemare")
        ax.plot(d[x], d.pipemare_minimum_bytes / 2**20, "k:", label="pipemare minimum (delays + T2 buffer)")
        ax.plot(d[x], d.hand_bytes / 2**20, "s--", label="hand-rolled deque, dataflow")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("stale-weight memory (MiB)")
        ax.legend(fontsize=8)
        if axis in ("width", "size"):
            for a in axes[:, col]:
                a.set_xscale("log", base=2)
    fig.suptitle("Growth of simulator time and memory with stages, width and model size (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


class MoveClock:
    """Wall time of the history's data movement: the tensor ops :mod:`staleopt.history` calls
    (``torch.cat``, ``torch._foreach_copy_``, ``torch.split_with_sizes_copy``), timed by putting a
    timing proxy in place of the ``torch`` name inside that module while it is active."""

    OPS = ("cat", "_foreach_copy_", "split_with_sizes_copy")

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in self.OPS:
            return attr

        def timed(*args, **kwargs):
            t = clock()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += clock() - t
                self.calls += 1
        return timed

    def __enter__(self):
        from staleopt import history
        self._module = history
        history.torch = self
        return self

    def __exit__(self, *exc):
        self._module.torch = torch


def breakdown(spec: ModelSpec, stages: int, rounds: int, steps: int, log) -> List[dict]:
    """Where the engine time goes (engine-bound setting, max P): per variant the engine time per step,
    split into the history's data movement (:class:`MoveClock`) and the rest (hooks, planning,
    bookkeeping, corrections), with the copy floor for scale. ``base_step_extra_ms``: how much longer
    the base optimizer's own step takes inside the wrapper than alone (T1 steps it over one group
    per stage)."""
    x, y = spec.batch_of()
    variants = [Variant("plain", spec, stages, x, y, "plain"),
                Variant("dataflow", spec, stages, x, y, "staleopt", "dataflow"),
                Variant("dataflow (memory=fast)", spec, stages, x, y, "staleopt", "dataflow", memory="fast"),
                Variant("pipemare", spec, stages, x, y, "staleopt", "pipemare")]
    moves: Dict[str, List[float]] = {v.name: [] for v in variants}
    calls: Dict[str, int] = {}
    for r in range(rounds):
        for v in variants:
            with MoveClock() as clock:
                v.timed_steps(steps)
            moves[v.name].append(clock.seconds / steps)
            calls[v.name] = clock.calls // steps
    plain = variants[0]
    copy_s = weights_copy_seconds(plain.model)
    rows = []
    for v in variants[1:]:
        engine, _ = _engine(v, plain)
        move = statistics.median(moves[v.name])
        base_extra = statistics.median(v.base_s) - statistics.median(plain.base_s)
        rows.append({"model": spec.label, "stages": stages, "variant": v.name, "engine_ms": 1e3 * engine,
                     "moves_ms": 1e3 * move, "base_step_extra_ms": 1e3 * base_extra,
                     "other_ms": 1e3 * max(engine - move - max(base_extra, 0.0), 0.0),
                     "move_ops_per_step": calls[v.name], "weights_copy_ms": 1e3 * copy_s,
                     "moves_in_copies": move / copy_s})
    for v in variants:
        v.release()
    log(f"  breakdown: done")
    return rows


def budget(spec: ModelSpec, stages: int, rounds: int, steps: int, log) -> List[dict]:
    """``pipemare``'s whole step against the plain one, piece by piece (:data:`LADDER`, then the wrapper), all
    timed in the same interleaved rounds: per rung the median over rounds of its step over the plain step's
    ([IQR]) and ``adds``, the difference of its median to the rung before's (noisy: each is a difference of two
    medians of the same spread)."""
    x, y = spec.batch_of()
    variants = [Variant("plain", spec, stages, x, y, "plain")]
    variants += [Variant(label, spec, stages, x, y, "floor", floor=floor) for label, floor in LADDER]
    variants.append(Variant("the wrapper: pipemare", spec, stages, x, y, "staleopt", "pipemare"))
    interleaved(variants, rounds, steps)
    plain = variants[0]
    rows, before = [], 1.0
    for v in variants[1:]:
        q1, ratio, q3 = _ratio_quantiles(v, plain)
        rows.append({"model": spec.label, "stages": stages, "rung": v.name, "plain_ms": 1e3 * statistics.median(
            plain.rounds_s), "step_ms": 1e3 * statistics.median(v.rounds_s), "ratio": ratio, "ratio_q1": q1,
            "ratio_q3": q3, "adds": ratio - before})
        before = ratio
    for v in variants:
        v.release()
    log("  budget: done")
    return rows


#: The recompute comparison: (label, method, how the segments are checkpointed; see :class:`Variant`).
RECOMPUTE = (("(a) pipemare", "pipemare", None),
             ("(b) pipemare + torch checkpoint", "pipemare", "torch"),
             ("(c) pipemare-recompute", "pipemare-recompute", "opt"))


def bench_recompute(key: str, spec: ModelSpec, rounds: int, steps: int, log) -> List[dict]:
    """PipeMare Recompute against plain checkpointing and no checkpointing (max P, the
    ``dataflow-recompute`` segments): whole step, engine time, stale-weight memory of each of
    :data:`RECOMPUTE`, with the per-round step ratios to the plain step, to (a) and to (b).

    The engine time of (c) adds the recomputation machinery (:class:`SegmentClock`) minus what the
    same timers cost in (b), which has none of it (``probes_ms``)."""
    P = spec.max_stages
    x, y = spec.batch_of()
    variants = [Variant("plain", spec, P, x, y, "plain")]
    variants += [Variant(label, spec, P, x, y, "staleopt", method, recompute=how) for label, method, how in RECOMPUTE]
    interleaved(variants, rounds, steps)
    plain, a, b, c = variants
    probes = statistics.median(b.recompute_s), min(b.recompute_s)
    segs = schedules.get("dataflow-recompute").segments(P)
    rows = []
    for v, (_, method, how) in zip((a, b, c), RECOMPUTE):
        engine, engine_min = _engine(v, plain)
        machinery = ((max(statistics.median(v.recompute_s) - probes[0], 0.0), max(min(v.recompute_s) - probes[1], 0.0))
                     if v is c else (0.0, 0.0))
        row = {"model": key, "batch": spec.batch, "stages": P,
               "segments": " ".join(f"{first}-{last}" for first, last in segs),
               "variant": v.name, "method": method, "checkpoint": {None: "none", "torch": "torch.utils.checkpoint",
                                                                   "opt": "opt.checkpoint"}[how],
               "plain_ms": 1e3 * statistics.median(plain.rounds_s), "step_ms": 1e3 * statistics.median(v.rounds_s)}
        for ref, name in ((plain, "plain"), (a, "a"), (b, "b")):
            q1, med, q3 = _ratio_quantiles(v, ref)
            row.update({f"ratio_{name}": med, f"ratio_{name}_q1": q1, f"ratio_{name}_q3": q3})
        row.update({"engine_ms": 1e3 * (engine + machinery[0]), "engine_min_ms": 1e3 * (engine_min + machinery[1]),
                    "recompute_engine_ms": 1e3 * machinery[0],
                    "probes_ms": 1e3 * probes[0] if v is b else 0.0,
                    "memory_bytes": v.opt.memory_bytes(), "history_bytes": v.opt.history_bytes(),
                    "measured_bytes": v.bytes, "minimum_bytes": minimum_bytes(v.opt),
                    "rounds": rounds, "steps_per_round": steps})
        rows.append(row)
    for v in variants:
        v.release()
    log(f"  recompute {key}: done")
    return rows


def goals(step: pd.DataFrame, hand: pd.DataFrame, growth: Optional[pd.DataFrame]) -> pd.DataFrame:
    """Issue 23's goals, measured in this run on the engine-bound ResNet-20 (batch 4, ``P`` = 39): weight copies
    per step (dataflow and pipedream: at most 4 in minimal memory, 3 in ``fast``), pipemare's whole step
    within 1.10x the plain step, pipemare's engine ops per step the same at ``P`` = 39 and 214, and the
    engine's overhead at least 5x below the hand-rolled deque's."""
    rows = []

    def add(goal: str, target: float, measured: float, met: bool) -> None:
        rows.append({"goal": goal, "target": target, "measured": measured, "met": bool(met)})

    tiny = step[step.model == "resnet20-tiny"]
    for method in ("dataflow", "pipedream"):
        for variant, most in ((method, 4), (f"{method} (memory=fast)", 3)):
            for r in tiny[tiny.variant == variant].itertuples():
                add(f"weight copies per step <=, {variant}, P={r.stages}", most, r.engine_copies,
                    r.engine_copies <= most + 0.01)
    for r in tiny[tiny.variant == "pipemare"].itertuples():
        add(f"pipemare whole step / plain step <=, P={r.stages}", 1.10, r.ratio, r.ratio <= 1.10)
        add(f"pipemare (plain step + engine time) / plain step <=, P={r.stages}", 1.10, r.engine_ratio,
            r.engine_ratio <= 1.10)
    if growth is not None:
        at39 = growth[(growth.axis == "stages") & (growth.stages == 39)]
        at214 = growth[(growth.axis == "depth") & (growth.stages == 214)]
        if len(at39) and len(at214):
            a, b = int(at39.pipemare_ops.iloc[0]), int(at214.pipemare_ops.iloc[0])
            add("pipemare engine ops per step at P=214 minus at P=39 ==", 0, b - a, a == b)
    for r in hand[(hand.model == "resnet20-tiny") & (hand.simulation == "dataflow")].itertuples():
        add(f"overhead below the hand-rolled deque >=, P={r.stages} (default memory)", 5.0, r.overhead_ratio,
            r.overhead_ratio >= 5.0)
        add(f"overhead below the hand-rolled deque >=, P={r.stages} (memory=fast)", 5.0, r.overhead_ratio_fast,
            r.overhead_ratio_fast >= 5.0)
    return pd.DataFrame(rows, columns=["goal", "target", "measured", "met"])


def _table(df: pd.DataFrame, cols: Sequence[str]) -> str:
    return df[list(cols)].to_string(index=False, float_format=lambda v: f"{v:.3g}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench", help="output directory (CSV, PNG)")
    ap.add_argument("--quick", action="store_true", help="tiny models, few repeats: checks the script runs")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"interleaved timing rounds (default 5, and {SHORT_STEP_ROUNDS} for the models timed in "
                         "steps of a few milliseconds; quick 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a small shared machine the steadiest; the engine's "
                         "time does not depend on it, the compute does)")
    ap.add_argument("--no-growth", action="store_true", help="skip the growth section")
    ap.add_argument("--device", default="cpu",
                    help="where the models and the history live: cpu (default) or cuda[:N]; on a GPU every "
                         "duration is wall time between two torch.cuda.synchronize() calls")
    args = ap.parse_args(argv)
    global clock, DEVICE
    try:
        DEVICE = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e}")
    if DEVICE.type not in ("cpu", "cuda"):
        ap.error(f"--device takes cpu or cuda[:N], got {args.device!r}")
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
        clock = _cuda_clock
    else:
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = QUICK if args.quick else MODELS
    keys = [k for k in args.models.split(",") if k]
    unknown = [k for k in keys if k not in table]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {list(table)}")
    rounds = args.rounds or (2 if args.quick else 5)
    fixed = bool(args.rounds or args.quick)  # (else the short-step models and the ladder take more rounds)
    short_rounds, budget_rounds = (rounds, rounds) if fixed else (SHORT_STEP_ROUNDS, BUDGET_ROUNDS)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.system()}",
            "cpu": cpu_name(), "commit": source_commit(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": rounds,
            "short_step_rounds": short_rounds,
            "budget_rounds": budget_rounds,
            "load_before": load_average(), "quick": args.quick,
            "device": str(DEVICE) if DEVICE.type == "cpu" else f"{DEVICE} ({torch.cuda.get_device_name(DEVICE)})",
            "clock": {time.thread_time: "thread CPU time", time.perf_counter: "wall time"}.get(
                clock, "wall time between CUDA synchronizations")}
    torch.manual_seed(0)
    step_rows, mem_rows, hand_rows = [], [], []
    for key in keys:
        spec = table[key]
        steps = 1 if spec.batch >= 64 and key != "cnn1d" else 5
        # (a short step: more rounds at little cost)
        s, m, h = bench_model(key, spec, short_rounds if steps > 1 else rounds, steps, log=log)
        step_rows += s
        mem_rows += m
        hand_rows += h
    step, mem, hand = pd.DataFrame(step_rows), pd.DataFrame(mem_rows), pd.DataFrame(hand_rows)
    step.to_csv(out / "step.csv", index=False)
    mem.to_csv(out / "memory.csv", index=False)
    hand.to_csv(out / "handrolled.csv", index=False)
    tiny = table["resnet20-tiny"]
    split = pd.DataFrame(breakdown(tiny, tiny.max_stages, rounds, 5, log=log))
    split.to_csv(out / "breakdown.csv", index=False)
    ladder = pd.DataFrame(budget(tiny, tiny.max_stages, budget_rounds, 5, log=log))
    ladder.to_csv(out / "budget.csv", index=False)
    recompute = pd.DataFrame([row for key in ("resnet20-tiny", "resnet20")
                              for row in bench_recompute(key, table[key], rounds, 5 if key == "resnet20-tiny" else 1,
                                                         log=log)])
    recompute.to_csv(out / "recompute.csv", index=False)
    growth = None
    if not args.no_growth:
        spec = table["resnet20"]
        maxP = spec.max_stages
        Ps = sorted({p for p in ((1, maxP) if args.quick else (1, 2, 4, 8, 16, 32, maxP)) if p <= maxP})
        widths = (2,) if args.quick else (8, 16, 32)
        deep = () if args.quick else ((56, 111), (110, 214))  # growth up to 214 stages
        sizes = (QUICK_SIZES if args.quick else SIZES).values()  # and up to GPT-2 small's size
        growth = pd.DataFrame(bench_growth(spec, Ps, widths, batch=min(spec.batch, 8), steps=2 if args.quick else 4,
                                           log=log, deep=deep, sizes=sizes))
        growth.to_csv(out / "growth.csv", index=False)
        plot_growth(growth, out / "growth.png")
    goal = goals(step, hand, growth)
    goal.to_csv(out / "goals.csv", index=False)
    meta["load_after"] = load_average()
    meta["seconds"] = time.perf_counter() - started
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    print(f"staleopt overhead benchmark — {meta['date']}, {meta['machine']}, torch {meta['torch']}, "
          f"{meta['threads']} threads, load {meta['load_before']:.2f}->{meta['load_after']:.2f}, times: {meta['clock']}")
    print("\n1. whole training step vs the base optimizer alone (max P; ratio = median over rounds [IQR]);"
          "\n   engine_ms = the simulator's own time per step, timed directly")
    print(_table(step, ["model", "stages", "variant", "plain_ms", "ratio", "ratio_q1", "ratio_q3", "engine_ms",
                        "engine_min_ms", "engine_ratio", "engine_ops", "engine_copies"]))
    print("\n2. stale-weight memory (bytes of tensors allocated) vs the minimum the delays require")
    print(_table(mem, ["model", "stages", "method", "measured_bytes", "engine_reported_bytes", "minimum_bytes",
                       "ratio_to_minimum"]))
    print("\n3. hand-rolled deque of deepcopy(state_dict()) vs staleopt (same delays, same weights)")
    print(_table(hand, ["model", "stages", "simulation", "speed_ratio", "staleopt_engine_ms", "hand_engine_ms",
                        "overhead_ratio", "overhead_ratio_min", "fast_engine_ms", "overhead_ratio_fast",
                        "weights_copy_ms", "memory_ratio", "max_abs_weight_diff", "floor_engine_ms", "over_floor"]))
    if not args.no_growth:
        print("\n4. growth (engine time per step, memory) with P, width, depth and model size")
        print(_table(growth, ["axis", "value", "stages", "params", "dataflow_engine_ms", "pipemare_engine_ms",
                              "hand_engine_ms", "weights_copy_ms", "dataflow_ops", "pipemare_ops",
                              "dataflow_bytes", "pipemare_bytes", "pipemare_minimum_bytes", "hand_bytes"]))
    print("\n5. where the engine time goes (engine-bound setting): the history's data movement "
          "(cat/foreach copies) vs the rest")
    print(_table(split, ["stages", "variant", "engine_ms", "moves_ms", "base_step_extra_ms", "other_ms",
                         "move_ops_per_step",
                         "weights_copy_ms", "moves_in_copies"]))
    print("\n6. pipemare's whole step piece by piece (engine-bound setting): each rung adds one piece to the "
          "one before;\n   ratio = median over rounds of step / plain step [IQR], adds = its difference to the rung "
          "before")
    print(_table(ladder, ["stages", "rung", "plain_ms", "step_ms", "ratio", "ratio_q1", "ratio_q3", "adds"]))
    print("\n7. goals")
    print(_table(goal, ["goal", "target", "measured", "met"]) if len(goal) else "(none measured in this run)")
    print("\n8. recompute (max P, dataflow-recompute segments): (a) no checkpointing, (b) torch's checkpoint, "
          "(c) opt.checkpoint\n   ratio_x = median over rounds of step / step of x; memory_bytes = opt.memory_bytes()")
    print(_table(recompute, ["model", "batch", "stages", "variant", "step_ms", "ratio_plain", "ratio_a", "ratio_b",
                             "engine_ms", "recompute_engine_ms", "probes_ms", "memory_bytes", "measured_bytes"]))
    print(f"\nwrote {out}/step.csv, memory.csv, handrolled.csv, breakdown.csv, budget.csv, goals.csv, recompute.csv"
          + ("" if args.no_growth else ", growth.csv, growth.png")
          + f" in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
