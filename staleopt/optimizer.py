"""The stale-weight optimizer: a ``torch.optim.Optimizer`` that simulates a pipeline exactly.

Semantics (docs/design.md §1, PipeMare §2). Step ``t`` computes one gradient and
produces ``w_{t+1}``::

    g_t = grad f_t(u_fwd_t, u_bkwd_t)
    (u_fwd_t)_i  = w_{t - tau_fwd_i, i}        # stage i's forward weights
    (u_bkwd_t)_i = w_{t - tau_bkwd_i, i}       # (a correction may change either view)
    w_{t+1} = base_optimizer_step(w_t, g_t)

``grad f(u_fwd, u_bkwd)``: activations come from the forward pass with
``u_fwd``; in the backward pass the products that propagate the error to
earlier layers (``W^T delta``) use ``u_bkwd``, while each weight gradient uses
the stored forward activations (``delta x^T``). ``w_{t-tau}`` with ``t-tau < 0``
is ``w_0``.

Mechanism
---------
The user's loop stays ``zero_grad(); loss = crit(model(x), y); loss.backward(); step()``.

* A forward pre-hook on the model loads each stage's forward view before the forward pass
  runs: it points the parameters at the history's row of that version (``p.data = row``),
  or copies the version into their own storage (through ``p.data`` aliases, so autograd's
  version counters are not bumped).
* A forward hook registers a tensor hook on every output that requires grad;
  the first one to fire — when the backward pass reaches the model output, before
  any layer's backward runs — loads the backward views into the storage the forward read.
  Autograd saved the *parameter tensors* for ``W^T delta``, so the backward
  reads ``u_bkwd``; the weight gradients use the saved activations, computed
  with ``u_fwd``.
* ``step()`` restores ``w_t``, pushes it into the history, runs the base
  optimizer on ``w_t`` and advances the history.
* Evaluation (``model.eval()`` or grad disabled), ``model.state_dict()`` and the
  :meth:`PipelineOptimizer.current_weights` context see ``w_t``.
* Until the first ``step()`` completes, every training forward and ``step()`` take what the
  parameters hold as ``w_0`` (:meth:`History.restart <staleopt.history.History.restart>` when they
  changed since construction: weights loaded after the wrapper was built); a change at rest
  between later steps is part of ``w_t``.
* A tied parameter that a module of a later stage registers (GPT-2's ``lm_head.weight``, the token
  embedding's) is held as a real pipeline holds it: a replica in that stage, read at that stage's
  delays, the uses' gradients summed into one update (:mod:`staleopt.replicas`). A use no replica can
  serve (one module applied in two stages) is refused (:class:`~staleopt.errors.SharedParameterError`)
  unless ``shared_parameters="first-owner"``.

The weights live in a :class:`~staleopt.history.History` (``staleopt/history.py``), which alone
owns the stored versions and moves them: per stage (and per device/dtype within a stage) exactly
the ``H_i = max_t max(tau_fwd_i, tau_bkwd_i)`` past versions the delays need, loaded into the
parameters by swaps (``memory="minimal"``) or copies (``memory="fast"``), each phase batched over
all stages. Corrections work on its :class:`~staleopt.history.StageView` objects. The call order
within a step and the checkpoint format are in ``docs/engine.md``;
:class:`staleopt.reference.ReferencePipelineOptimizer` is the same engine on a history that keeps
every version, tested against this one after every step.

Limits (documented, not checked):

* only ops that save the *parameter tensor itself* for their backward see
  ``u_bkwd``; an op that saves a transformed copy of a weight (weight norm,
  ``W * 2``, parametrizations) uses the forward view in its backward;
* activation checkpointing: :meth:`PipelineOptimizer.checkpoint` recomputes with the recompute view
  ``u_recomp`` (:mod:`staleopt.recompute`); ``torch.utils.checkpoint`` called directly recomputes
  with the backward view (under a schedule with ``tau_bkwd < tau_recomp < tau_fwd`` a step without
  ``opt.checkpoint``, calls that do not match the schedule's segments, and a stage *module*
  recomputed outside it, raise; elsewhere, where the backward view differs from the forward view,
  the first such recomputation warns, :class:`~staleopt.errors.RecomputeNotice`; a segment of raw
  parameter ops under torch's checkpoint is not caught);
* buffers (BatchNorm running statistics) are not delayed;
* a loss term that reads parameters directly (an explicit L2 penalty) sees
  whichever view is loaded when its backward runs; a graph built during a training pass
  (a gradient penalty through ``torch.autograd.grad(..., create_graph=True)``) reads the
  views of the storage that pass read (a row of the history it pointed at, docs/engine.md);
* call ``backward`` before the next training forward of a different step;
  several forward/backward passes per step (gradient accumulation) are fine (``memory="minimal"``:
  at most as many as the most any earlier step ran, else :class:`~staleopt.errors.LoopError`; checked);
* create the optimizer after moving the model to its device (checked).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn.utils.parametrize
import torch.utils.checkpoint
from torch import nn

from ._torch_compat import (current_autograd_node, disable_dynamo, flatten, optimizer_load_state_dict_hooks,
                            optimizer_state_dict_hooks, queue_callback)
from .corrections.base import Correction
from .errors import (CheckpointError, ConfigError, CorrectionError, DetachedError, LoopError, OptimizerMismatchError,
                     RecomputeNotice, SegmentError, SharedParameterError, StageError)
from .history import STRATEGIES, History, SlotHistory, StageView, Targets
from .partition import Dataflow, Partition, dataflow, partition_model, refuse_shared
from .recompute import RecomputeWindow, reached_parameters
from .replicas import EngineHook, Replica, Replicas, plan_replicas, refuse_with_replicas
from .schedules import Schedule
from .stage_lr import StageGroups, refuse_compiled, stepping_optimizers
from .validate import check_int

__all__ = ["PipelineOptimizer"]


class _Callback(EngineHook):
    """Calls a wrapper's method through a weak reference: inert once the wrapper is gone or detached (and
    in a copy or a pickle of the model, :class:`~staleopt.replicas.EngineHook`)."""

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    @disable_dynamo
    def __call__(self, *args):  # (the engine's Python never enters a torch.compile graph)
        method = self._method()
        if method is None or method.__self__._detached is not None:
            return None
        return method(*args)


#: Per-parameter state that torch.optim keeps 0-d in its own scalar dtype whatever the parameter's shape (NAdam's
#: ``mu_product``, ASGD's ``eta`` and ``mu``): a checkpoint's value is put back as saved, not cast.
_SCALAR_STATE = frozenset({"mu_product", "eta", "mu"})

#: id(parameter) -> (weak reference to it, weak reference to the PipelineOptimizer driving it)
_DRIVERS: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


def _hook_parametrized(module: nn.Module) -> bool:
    """Whether ``module`` computes a weight in a forward pre-hook from other parameters: the older
    ``torch.nn.utils.weight_norm`` (``weight_g``, ``weight_v``) and ``torch.nn.utils.spectral_norm``
    (``weight_orig``)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    return any(isinstance(h, (SpectralNorm, WeightNorm)) for h in module._forward_pre_hooks.values())


def _drivers(params: Sequence[torch.Tensor]) -> List["PipelineOptimizer"]:
    """The live wrappers that drive any of ``params``."""
    found = {}
    for p in params:
        entry = _DRIVERS.get(id(p))
        if entry is not None and entry[0]() is p:
            owner = entry[1]()
            if owner is not None and owner._detached is None:
                found[id(owner)] = owner
    return list(found.values())


def _take_over(params: Sequence[torch.Tensor], new: "PipelineOptimizer") -> None:
    """Make ``new`` the only live wrapper of ``params``: detach every earlier wrapper of any of them.

    Two live wrappers on one set of weights would both swap views in and out of the same storage
    (their hooks pile up; Lightning's ``lr_find`` followed by ``fit`` does this), so the newest wins.
    """
    for owner in _drivers(params):
        if owner is not new:
            owner._detach(f"a newer PipelineOptimizer ({id(new):#x}) took over its parameters")
    me = weakref.ref(new)
    for p in params:
        key = id(p)
        _DRIVERS[key] = (weakref.ref(p, lambda ref, key=key: _forget(key, ref)), me)


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _DRIVERS.get(key)
    if entry is not None and entry[0] is ref:
        del _DRIVERS[key]


#: id(module) -> [(weak reference to the module, weak reference to a wrapper that drives one of its parameters)]
_WATCHED: Dict[int, List[Tuple[weakref.ref, weakref.ref]]] = {}
#: the one global parameter-registration hook (registered with the first wrapper, never removed: removing a hook,
#: or a wrapper's collection removing its own, while torch iterates the hooks would mutate the dict it iterates)
_WATCHING: List = []


def _parameter_registered(module, name, param):
    """torch's global parameter-registration hook: tell the live wrappers that drive a parameter of ``module``."""
    entries = _WATCHED.get(id(module))
    if entries:
        for module_ref, owner_ref in list(entries):
            owner = owner_ref()
            if module_ref() is module and owner is not None and owner._detached is None:
                owner._on_parameter_registered(module, name, param)
    return None


def _watch_parameters(owner: "PipelineOptimizer", modules: Sequence[nn.Module]) -> None:
    """Tell ``owner`` when a module of ``modules`` registers a parameter
    (:meth:`PipelineOptimizer._on_parameter_registered`)."""
    if not _WATCHING:
        _WATCHING.append(torch.nn.modules.module.register_module_parameter_registration_hook(_parameter_registered))
    for key in list(_WATCHED):  # (forget the modules and wrappers collected since)
        live = [(m, o) for m, o in _WATCHED[key] if m() is not None and o() is not None]
        if live:
            _WATCHED[key] = live
        else:
            del _WATCHED[key]
    me = weakref.ref(owner)
    for m in modules:
        _WATCHED.setdefault(id(m), []).append((weakref.ref(m), me))


def _remove_handles(handles: List) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class PipelineOptimizer(torch.optim.Optimizer):
    r"""Wrap ``base_optimizer`` so that training ``model`` simulates a pipeline-parallel run.

    Args:
        model: the module whose forward/backward the training loop calls.
        base_optimizer: any ``torch.optim.Optimizer`` over (a subset of) the model's parameters.
        stages: a stage count ``P``, ``"max"`` (one stage per parametrized operator) or a
            :class:`~staleopt.partition.Partition`.
        schedule: a schedule or method name (``"dataflow"``, ``"1f1b"``, ``"pipemare"``, ...)
            or a :class:`~staleopt.schedules.Schedule`.
        microbatches: ``N``, microbatches per minibatch (enters the delay formulas).
        corrections: extra :class:`~staleopt.corrections.base.Correction` objects, applied
            after a method's own.
        seed: seeds the generator of random schedules (Hogwild).
        partition: ``"ops"`` or ``"params"`` when ``stages`` is a count.
        foreach: batch the history moves with ``torch._foreach_copy_`` (default);
            ``False`` copies tensor by tensor (the same results).
        method_args: hyperparameters of a named method, e.g. ``{"anneal_steps": 500, "decay": 0.2}``
            for ``"pipemare"`` (:mod:`staleopt.methods` lists each method's).
        microbatch_passes: the loop runs one forward/backward per microbatch (``N`` passes between
            ``zero_grad()`` and ``step()``), and pass ``j`` sees the delays of microbatch ``j``,
            ``Schedule.microbatch_delays`` — exactly what the executed pipeline does when the
            microbatches of one minibatch straddle an update (1F1B, dataflow, pb with ``N > 1``).
            Default: every pass sees the minibatch's delays (those of microbatch 0, the largest).
        memory: the :mod:`~staleopt.history` strategy. ``"minimal"`` (default) keeps exactly
            ``max(tau_i)`` versions per stage (T2's stages one more); the step's last pass writes its
            backward view over the expiring ``w_{t - tau_i}`` (2 weight copies per step under dataflow
            delays, ``push`` included, T2 too), other passes swap (:class:`~staleopt.history.SwapMoves`). ``"fast"``
            keeps one more version per delayed stage and drops none within a step (plain copies,
            :class:`~staleopt.history.CopyMoves`; 3 copies per step, T2 too): a step that a
            ``GradScaler`` skipped, or that runs more passes than the earlier ones, runs again, where
            ``"minimal"`` raises :class:`~staleopt.errors.LoopError`. Same results bit for bit.
        shared_parameters: a parameter used by a stage other than its owner's (:attr:`Partition.shared
            <staleopt.partition.Partition.shared>`, and the first training forward's graph).
            ``"replicate"`` (default): a module of another stage that registers it (tied weights such as
            GPT-2's ``lm_head``) reads a replica at its own stage's delays and the gradients of all uses
            are summed (:mod:`staleopt.replicas`); a use no replica can serve (one module applied in two
            stages, a parameter read directly) raises :class:`~staleopt.errors.SharedParameterError`.
            ``"error"`` refuses every shared parameter; ``"first-owner"`` accepts every use with the owner
            stage's view.

    Every argument after ``base_optimizer`` is keyword-only.
    The update rule is the base optimizer's, applied to ``w_t`` with the gradient
    ``grad f_t(u_fwd_t, u_bkwd_t)`` (module docstring).
    """

    def __init__(self, model: nn.Module, base_optimizer: torch.optim.Optimizer, *positional,
                 stages: Union[int, str, Partition] = 1, schedule: Union[str, Schedule] = "dataflow",
                 microbatches: int = 1, corrections: Iterable[Correction] = (), seed: Optional[int] = None,
                 partition: Optional[str] = None, foreach: bool = True, method_args: Optional[dict] = None,
                 microbatch_passes: bool = False, memory: str = "minimal", shared_parameters: str = "replicate"):
        from . import methods  # methods imports the corrections, which import this package

        if positional:
            raise TypeError(f"PipelineOptimizer takes the model and the base optimizer as its only positional "
                            f"arguments, got {len(positional)} more ({positional!r}); name the others, e.g. "
                            "PipelineOptimizer(model, base, stages=4, schedule='dataflow')")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(base_optimizer, torch.optim.Optimizer):
            raise ConfigError(f"base_optimizer must be a torch.optim.Optimizer (e.g. torch.optim.SGD(model."
                              f"parameters(), lr=0.1)), got {type(base_optimizer).__name__}")
        if isinstance(base_optimizer, PipelineOptimizer):
            raise ConfigError("base_optimizer is already a PipelineOptimizer: wrap the plain optimizer once")
        closure = inspect.signature(base_optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ConfigError(f"{type(base_optimizer).__name__}.step needs a closure that re-evaluates the loss "
                              "(line search); a pipeline computes one gradient per step, so use an optimizer "
                              "whose step() works without a closure")
        if memory not in STRATEGIES:
            raise ConfigError(f"memory must be 'minimal' (exactly max(tau) versions per stage) or 'fast' (one more "
                              f"per delayed stage, none dropped within a step: steps a GradScaler skips or with more "
                              f"passes than before run again), got {memory!r}")
        if shared_parameters not in ("replicate", "error", "first-owner"):
            raise ConfigError(f"shared_parameters must be 'replicate' (a replica per stage that uses a tied "
                              f"parameter), 'error' (refuse a parameter used by two stages) or 'first-owner' (every "
                              f"use reads its owner stage's view), got {shared_parameters!r}")
        if isinstance(stages, Partition) and partition is not None:
            raise ConfigError(f"partition={partition!r} chooses how a stage count is split, but stages is already a "
                              "Partition: pass stages=staleopt.partition_model(model, P, strategy) alone")
        microbatches = check_int("microbatches", microbatches, 1, why="microbatches per minibatch")
        if isinstance(corrections, Correction):
            raise CorrectionError(f"corrections takes a list of Correction objects, got one: {corrections!r}; pass "
                                  f"corrections=[{type(corrections).__name__}(...)]")
        try:
            corrections = list(corrections)
        except TypeError:
            raise CorrectionError(f"corrections takes a list of Correction objects (e.g. [staleopt.corrections."
                                  f"Stashing()]), got {type(corrections).__name__} {corrections!r}") from None
        for c in corrections:
            if not isinstance(c, Correction):
                raise CorrectionError(f"corrections must be Correction objects (e.g. staleopt.corrections."
                                      f"Stashing()), got {c!r}")
        self._base = base_optimizer
        self._model = model
        self._initialized = False
        self._detached: Optional[str] = None  # why this wrapper no longer drives the model
        super().__init__([p for g in base_optimizer.param_groups for p in g["params"]], base_optimizer.defaults)

        self._schedule, method_corrections = methods.resolve(schedule, **(method_args or {}))
        self._corrections: List[Correction] = method_corrections + corrections
        user_partition = stages if isinstance(stages, Partition) else \
            partition_model(model, stages, partition or "ops")
        mine = {id(p) for p in model.parameters()}
        foreign = [u.name for s in user_partition for u in s.units if any(id(p) not in mine for p in u.params)]
        if foreign:
            raise StageError(f"the partition's units {foreign[:5]}{' ...' if len(foreign) > 5 else ''} hold "
                             "parameters that are not this model's: it was made for another model object (a copy, or "
                             "the model before it was rebuilt); make it from this one: "
                             "stages=staleopt.partition_model(model, ...)")
        if isinstance(stages, Partition):
            held = {id(p) for s in user_partition for u in s.units for p in u.params}
            names = {id(p): n for n, p in model.named_parameters()}
            missing = [names.get(id(p), "?") for g in base_optimizer.param_groups for p in g["params"]
                       if p.requires_grad and id(p) not in held and id(p) in mine]
            if missing:
                raise StageError(f"the partition holds no stage for the trainable parameters {missing[:5]}"
                                 f"{' ...' if len(missing) > 5 else ''}, which the base optimizer updates: it was "
                                 "made before they were added (or unfrozen), and they would train without delay; "
                                 "make it from the model as it is now: stages=staleopt.partition_model(model, ...)")
        self._shared_parameters = shared_parameters
        replicas = []
        if shared_parameters == "replicate":
            replicas, refused = plan_replicas(model, user_partition)
            refuse_shared(refused, user_partition)
        elif shared_parameters == "error":
            refuse_shared(user_partition.shared, user_partition)
        self._replicas = Replicas(user_partition, replicas)
        if replicas:
            refuse_with_replicas(self._corrections)
        self._partition = self._replicas.partition  # the user's, with a unit per replica
        self._microbatches = microbatches
        self._memory = memory
        self._microbatch_passes = bool(microbatch_passes)
        self._passes, self._pass = 0, 0  # training forwards since zero_grad/step; index of the latest
        # training forwards and backward passes of this step (None: unknown, resumed from an older checkpoint),
        # and as many as a step is expected to run (microbatch_passes: N; else the most any step ran)
        self._counts: Optional[List[int]] = [0, 0]
        self._expected: Optional[Tuple[int, int]] = (microbatches, microbatches) if microbatch_passes else None
        self._foreach = foreach
        self._generator = torch.Generator()
        self._generator.manual_seed(0 if seed is None else int(seed))
        self._step = 0
        self._seen = set()  # which hooks fired during the current step
        self._plans: Optional[List[_PassPlan]] = None  # per pass of this step: delays and what to load
        self._plan_cache: Dict[tuple, tuple] = {}  # delays -> the step-independent part of a plan
        self._check_parameters()
        for previous in _drivers([p for s in self._partition for p in s.params]):
            previous._restore()  # its w_t, not a view it left loaded, is this wrapper's w_0

        P = self._partition.num_stages
        tf, tb = self._schedule.delays(P, microbatches)
        tf, tb, tr = _apply_corrections(self._corrections, tf, tb, self._schedule.recompute_delays(P, microbatches),
                                        None)
        self._max_delays = (tf, tb)
        self._max_recompute = tr
        self._check_declarations(tf, tb, tr)
        self._schedule_delays = None  # per pass, before corrections (deterministic schedules: fixed)
        if not self._schedule.random:
            if self._microbatch_passes:
                tf_ij, tb_ij = self._schedule.microbatch_delays(P, microbatches)
                tr_ij = self._schedule.microbatch_recompute_delays(P, microbatches)
                self._schedule_delays = [([row[j] for row in tf_ij], [row[j] for row in tb_ij],
                                          [row[j] for row in tr_ij]) for j in range(microbatches)]
            else:
                self._schedule_delays = [(*self._schedule.delays(P, microbatches),
                                          self._schedule.recompute_delays(P, microbatches))]
        rewriting = [c for c in self._corrections if c.rewrites_history]
        if rewriting and self._schedule_delays is not None and len(
                {tuple(f - b for f, b in zip(*_apply_corrections(self._corrections, tf_j, tb_j, tr_j, None)[:2]))
                 for tf_j, tb_j, tr_j in self._schedule_delays}) > 1:
            raise CorrectionError(f"{type(rewriting[0]).__name__} stores each version predicted for the version gap "
                                  "of the step (PipeOptim eq. 5: microbatch 0's), but with microbatch_passes=True the "
                                  "later microbatches read newer versions at smaller gaps and would get microbatch "
                                  "0's extrapolation: use microbatch_passes=False (every pass sees the minibatch's "
                                  "delays) with weight prediction")
        rewritten = [any(c.rewrites_backward_view for c in self._corrections) and (f != b or f != r)
                     for f, b, r in zip(tf, tb, tr)]
        self._history: History = self._make_history([max(f, b) for f, b in zip(tf, tb)], rewritten)
        self._views = self._history.views
        self._stored = [v for v in self._views if v.H]  # the views whose versions the history keeps
        self._stored_index = tuple(v.index for v in self._stored)
        self._pending: Optional[dict] = None  # the "staleopt" entry between the two load hooks
        self._ptr_params = [p for v in self._views for p in v.params]
        self._ptrs = [p.data_ptr() for p in self._ptr_params]  # where the parameters' storage was (every one)
        self._device_type = self._views[0].params[0].device.type
        self._autocast = None  # the dtype of an autocast that may cast weights, on at the latest training forward
        self._casts: Dict[Optional[torch.dtype], FrozenSet[int]] = {}  # that autocast (or None) -> stages whose
        # weights the forward's graph reads through casts (found once per autocast dtype: _check_graph_reads)
        self._computed: FrozenSet[int] = frozenset()  # stages whose forward computes a weight (Dataflow.computed)
        self._param_dtypes = frozenset(p.dtype for p in self._ptr_params)  # (autocast copies the others' weights)
        self._stage_of_param = self._partition.stage_index()
        self._check_renormalizing([max(f, b) for f, b in zip(tf, tb)])
        self._warn_parametrized([f != b for f, b in zip(tf, tb)])
        self._per_stage_lr = any(type(c).lr_factors is not Correction.lr_factors for c in self._corrections)
        self._stage_groups = StageGroups(self._stage_of_param)
        if self._per_stage_lr:
            stepping_optimizers(self._base)  # per-stage step sizes must reach the optimizer that steps
        self._lr_factors = [1.0] * self._partition.num_stages
        self._outside = [p for g in self._base.param_groups for p in g["params"] if id(p) not in self._stage_of_param]
        self._warned = set()
        self._traced = False  # the first training forward's graph was checked (stage order, cast weights)
        self._in_forward = False  # a training forward of the model is running (opt.checkpoint acts)
        replica_at = {r.tensor.data_ptr(): r.tensor for r in self._replicas.items}
        self._view_of_param = {id(replica_at.get(d.data_ptr(), p)): v.index  # what graph walks find: a replica
                               for v in self._views for p, d in zip(v.params, v.data)}  # stands for its own view
        self._stage_of_unit = self._partition._unit_stages()
        self._initialized = True
        for c in self._corrections:
            c.bind(self)
        self._minimizing = tuple(type(c).__name__ for c in self._corrections if c.assumes_minimize)
        self._dense = tuple(type(c).__name__ for c in self._corrections if c.dense_gradients)  # (checked at step())
        self._check_maximize()
        _take_over([p for s in self._partition for p in s.params] + self._outside, self)
        self._hooks = [model.register_forward_pre_hook(_Callback(self._on_forward_start)),
                       model.register_forward_hook(_Callback(self._on_forward_end))]
        self._hooks += self._replicas.hooks(_Callback(self._model_training))
        self._stepping = False  # inside step(), around the base step: the only place it may run
        self._hooks.append(base_optimizer.register_step_pre_hook(_Callback(self._on_base_step)))
        # a module's state_dict reads, and its load_state_dict writes, the parameters' own storage with w_t (not
        # a row of the history a training pass points them at): hooks on every module that owns a parameter, so
        # that a submodule's state_dict (ddp.module, a LightningModule's net) reads w_t too
        restoring = _Callback(self._restore_hook)
        owners = [m for m in model.modules() if any(id(p) in self._stage_of_param for p in m.parameters(recurse=False))]
        self._hooks += [m.register_state_dict_pre_hook(restoring) for m in owners]
        self._hooks += [m.register_load_state_dict_pre_hook(restoring) for m in owners]
        self._recomputing = 0  # recompute windows open now
        # the hooks registered anew at every pass: backward start, backward end, recomputation watch
        self._calls_back = (_Callback(self._on_backward_start), _Callback(self._on_backward_end),
                            _Callback(self._on_unit_forward))
        self._ahead = any(b != r != f for f, b, r in zip(tf, tb, tr))  # recomputes ahead of the backward pass
        self._segments = self._schedule.segments(P) if self._ahead else []  # what opt.checkpoint calls must cover
        self._calls: List[set] = []  # per opt.checkpoint call of this training forward: the parameters it read
        self._checkpointed = False  # this training forward called opt.checkpoint
        self._unit_stage = {id(model.get_submodule(u.name)): s.index for s in self._partition for u in s.units
                            if u.name != "<root>"}
        self._watch = None  # while a backward pass runs: the global module pre-hook that spots recomputations
        self._noticed = False  # the RecomputeNotice was given
        self._names: Optional[Dict[int, str]] = None  # id(parameter) -> its name in the model (for messages)
        # a parameter replaced by another Parameter (load_state_dict(assign=True), module.weight = nn.Parameter(...))
        # leaves this wrapper and the base optimizer holding the old one: the model would silently stop training
        driven = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()
                  if p is not None and id(p) in self._stage_of_param]
        self._registered = {(id(m), name): p for m, name, p in driven}
        _watch_parameters(self, list({id(m): m for m, _, _ in driven}.values()))
        weakref.finalize(self, _remove_handles, self._hooks)  # hooks die with their wrapper
        # the history and the corrections' state travel in state_dict()["staleopt"], added and read by
        # torch's own optimizer hooks (so hooks a user registers see it too)
        self.register_state_dict_pre_hook(_Callback(self._before_state_dict))
        self.register_state_dict_post_hook(_Callback(self._add_state))
        self.register_load_state_dict_pre_hook(_Callback(self._take_state))
        self.register_load_state_dict_post_hook(_Callback(self._load_state))

    def _make_history(self, depths: List[int], rewritten: List[bool]) -> History:
        """The weight history: stage ``i`` keeps ``depths[i]`` versions (``rewritten[i]``: T2 rewrites its view)."""
        return SlotHistory(self._partition, depths, rewritten, STRATEGIES[self._memory], foreach=self._foreach)

    def _check_declarations(self, tf: List[int], tb: List[int], tr: List[int]) -> None:
        """Corrections that need what another one changes (Correction's declarations) cannot be combined, nor a
        history of predictions with a schedule that recomputes from it (largest delays ``tf``, ``tb``, ``tr``)."""
        raw = [c for c in self._corrections if c.needs_raw_history]
        rewriting = [c for c in self._corrections if c.rewrites_history]
        if raw and rewriting:
            raise CorrectionError(f"{type(raw[0]).__name__} needs the raw weight history, which "
                                  f"{type(rewriting[0]).__name__} replaces by predicted weights: use one of the two")
        refilling = [c for c in self._corrections if c.refills_pipeline]
        if refilling and rewriting:
            raise CorrectionError(f"{type(rewriting[0]).__name__} stores each version predicted for the version gap "
                                  "of the step that stores it (PipeOptim eq. 5), but after "
                                  f"{type(refilling[0]).__name__}'s synchronous steps the pipeline refills: the "
                                  "version of the switch is read at gaps 0, 1, ..., tau, and every one of those "
                                  "reads would get the prediction for the wrong gap. Use one of the two")
        if rewriting and any(r not in (f, b) for f, b, r in zip(tf, tb, tr)):
            raise CorrectionError(f"{type(rewriting[0]).__name__} stores each version predicted for the forward's "
                                  f"version gap (PipeOptim eq. 5), but schedule {self._schedule!r} recomputes "
                                  f"activations from the stored w_(t - tau_recomp) (tau_recomp = {tr}), which would "
                                  "read the prediction (past w_t) instead: use one of the two "
                                  "(schedule.without_recompute())")

    def _check_renormalizing(self, depths: List[int]) -> None:
        """An ``nn.Embedding(max_norm=...)`` (or ``EmbeddingBag``) renormalizes the rows it looks up in place in its
        forward pass. Under a delay that forward reads a stored ``w_(t-tau)``, so the renormalization would rewrite
        that stored version and never reach ``w_t`` (design §1: the weights change only at rest): refused."""
        stage = self._stage_of_param
        found = [name for name, m in self._model.named_modules()
                 if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
                 and id(m.weight) in stage and depths[stage[id(m.weight)]]]
        if found:
            raise ConfigError(f"the embedding(s) {found[:3]} renormalize their weight in the forward pass "
                              "(max_norm): under delays that would rewrite a stored stale version, never the "
                              "current weights w_t. Build them with max_norm=None and renormalize w_t at rest after "
                              "each opt.step(), e.g. with torch.no_grad(): torch.embedding_renorm_(emb.weight, "
                              "ids, max_norm, 2.0) for the ids of the batch (a constraint at rest is part of w_t)")

    def _warn_parametrized(self, split: List[bool]) -> None:
        """A parametrized weight (``parametrizations.weight_norm``, any ``register_parametrization``, the older
        hook-based ``torch.nn.utils.weight_norm`` and ``spectral_norm``) is computed from its parameters in the
        forward pass; its backward reads the parameters again, by then holding the backward view, while its saved
        results (the norm) and ``W^T delta`` hold the forward view: a mix no pipeline computes where the two views
        differ. Warned."""
        stage = self._stage_of_param
        found = [name for name, m in self._model.named_modules()
                 if (torch.nn.utils.parametrize.is_parametrized(m) or _hook_parametrized(m))
                 and any(split[stage[id(p)]] for p in m.parameters() if id(p) in stage)]
        if found:
            warnings.warn(f"the module(s) {found[:3]} compute their weight from parametrized parameters (weight norm, "
                          "spectral norm, a parametrization) in a stage whose forward and backward read different "
                          "versions: the backward of the parametrization reads the backward view while its saved "
                          "norm and W^T delta read the forward view, a mix no pipeline computes (docs/wrapper.md, "
                          "Limits; a linear parametrization such as 2 * X is exact). Exact with stashing (tau_bkwd = "
                          "tau_fwd: pipedream, pipemare-stash) or with the parametrization folded into a plain "
                          "weight", stacklevel=3)

    # ------------------------------------------------------------------ torch.optim plumbing
    @property
    def param_groups(self):
        return self._base.param_groups if self.__dict__.get("_initialized") else self.__dict__.get("_pg", [])

    @param_groups.setter
    def param_groups(self, value):
        if self.__dict__.get("_initialized"):
            self._base.param_groups = value
        else:
            self.__dict__["_pg"] = value

    @property
    def state(self):
        return self._base.state

    @state.setter
    def state(self, value):
        if self.__dict__.get("_initialized"):
            self._base.state = value

    @property
    def defaults(self):
        return self._base.defaults

    @defaults.setter
    def defaults(self, value):
        pass  # the base optimizer's defaults are the only ones

    def add_param_group(self, param_group: dict) -> None:
        if not self.__dict__.get("_initialized"):
            return  # Optimizer.__init__: the base already holds these groups
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        outside = [p for p in params if id(p) not in self._stage_of_param]
        if outside:
            raise OptimizerMismatchError(
                f"add_param_group got {len(outside)} parameter(s) that are not in the pipeline partition "
                "(not in the model, or frozen when the PipelineOptimizer was built): set requires_grad "
                "before building the PipelineOptimizer, or build a new one")
        self._check_attached()
        self._base.add_param_group({**param_group, "params": params})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base optimizer's ``zero_grad``; under ``microbatch_passes`` the next training forward is
        microbatch 0 again (a step run again after ``GradScaler`` skipped it), except between a forward and its
        backward. (The passes a step runs are counted across ``zero_grad``: a loop that runs two passes per
        step, as SAM does, keeps both versions it reads.)"""
        self._check_attached()
        self._base.zero_grad(set_to_none=set_to_none)
        counts = self._counts
        if counts is None or counts[0] == counts[1]:
            self._passes = 0

    def lr_factor(self, stage: int) -> float:
        """The factor (T1) on the scheduler's lr for ``stage`` in the current step."""
        return self._lr_factors[stage]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=4)

    def __getstate__(self):
        raise LoopError("a PipelineOptimizer is not pickled or deep-copied: save opt.state_dict() and "
                            "model.state_dict(), and load them into a new optimizer")

    def _check_parameters(self) -> None:
        meta = [p for s in self._partition for p in s.params if p.is_meta]
        if meta:
            raise ConfigError(f"{len(meta)} of the model's parameters are on the meta device (shapes only, no "
                              "values): build the PipelineOptimizer after materializing them (model.to_empty("
                              "device=...) and loading the weights), with the base optimizer built after that too")
        in_model = {id(p) for p in self._model.parameters()}
        in_base = [p for g in self._base.param_groups for p in g["params"]]
        foreign = [p for p in in_base if id(p) not in in_model]
        if foreign:
            raise OptimizerMismatchError(
                f"the base optimizer holds {len(foreign)} parameter(s) that are not in the model "
                f"(first shape {tuple(foreign[0].shape)}): build the base optimizer from model.parameters() "
                "of the model you pass to PipelineOptimizer")
        base_ids = {id(p) for p in in_base} | {id(r.tensor) for r in self._replicas.items}
        missing = [p for s in self._partition for p in s.params if id(p) not in base_ids]
        if missing:
            warnings.warn(f"{len(missing)} trainable model parameter(s) are not in the base optimizer and will "
                          "not train (their history still follows the delays); add them to the base optimizer "
                          "if that is not intended", stacklevel=3)

    # ------------------------------------------------------------------ read-only properties
    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        return self._base

    @property
    def partition(self) -> Partition:
        return self._partition

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @property
    def corrections(self) -> Tuple[Correction, ...]:
        return tuple(self._corrections)

    @property
    def microbatches(self) -> int:
        return self._microbatches

    @property
    def step_count(self) -> int:
        """Optimizer steps taken: the current weights are ``w_{step_count}``."""
        return self._step

    @property
    def tau_fwd(self) -> List[int]:
        """Per-stage forward delays of the current step."""
        return list(self._current_delays()[0])

    @property
    def tau_bkwd(self) -> List[int]:
        """Per-stage backward delays of the current step."""
        return list(self._current_delays()[1])

    @property
    def tau_recomp(self) -> List[int]:
        """Per-stage recompute delays of the current step (PipeMare App. D.1; ``tau_bkwd`` unless the
        schedule recomputes ahead of the backward pass): what :meth:`checkpoint` recomputes with."""
        return list(self._plan().recomp)

    @property
    def max_recompute_delays(self) -> List[int]:
        """Largest ``tau_recomp`` any step can have."""
        return list(self._max_recompute)

    @property
    def max_delays(self) -> Tuple[List[int], List[int]]:
        """Largest delays any step can have (sizes the history)."""
        return list(self._max_delays[0]), list(self._max_delays[1])

    @property
    def chunks(self) -> Tuple[StageView, ...]:
        """The :class:`~staleopt.history.StageView` of each (stage, device, dtype): what corrections work on."""
        return self._views

    @property
    def history(self) -> History:
        """The weight history (:mod:`staleopt.history`)."""
        return self._history

    @property
    def phase_offset(self) -> int:
        """Steps before the asynchronous phase begins (declared by corrections: a synchronous warmup)."""
        return sum(c.synchronous_steps for c in self._corrections)

    def history_bytes(self) -> int:
        """Bytes held by the weight history (all stages)."""
        return self._history.nbytes

    def memory_bytes(self) -> int:
        """Bytes held by the history, the replicas of tied parameters, every correction's buffers and the
        schedule's (a random schedule's table to draw delays from)."""
        return (self.history_bytes() + self._replicas.nbytes + sum(c.extra_bytes() for c in self._corrections)
                + self._schedule.extra_bytes())

    @property
    def replicas(self) -> Tuple[Replica, ...]:
        """The replicas of tied parameters (:mod:`staleopt.replicas`): one per later stage that registers one."""
        return tuple(self._replicas.items)

    # ------------------------------------------------------------------ the engine
    def _step_plans(self) -> List["_PassPlan"]:
        """Delays and views of each pass of the current step: ``N`` with ``microbatch_passes``, else one."""
        if self._plans is None:
            P, N = self._partition.num_stages, self._microbatches
            raw = self._schedule_delays
            if raw is None:  # a random schedule draws every step (and recomputes inside the backward pass)
                tf, tb = self._schedule.sample(P, N, self._generator)
                raw = [(tf, tb, tb)]
            plans = []
            for tf, tb, tr in raw:
                tf, tb, tr = _apply_corrections(self._corrections, tf, tb, tr, self._step)
                plans.append(_PassPlan((tf, tb), tr, self._views, self._corrections,
                                       self._plan_cache, self._check_delays))
            self._plans = plans
        return self._plans

    def _check_delays(self, tf: List[int], tb: List[int], tr: List[int]) -> None:
        """Delays of a pass within the largest ones (which sized the history), ``tau_bkwd <= tau_recomp <= tau_fwd``
        (checked once per set of delays, when its plan is first made)."""
        for i in range(self._partition.num_stages):
            if not (0 <= tf[i] <= self._max_delays[0][i] and 0 <= tb[i] <= self._max_delays[1][i]
                    and (tr[i] == tb[i] or tb[i] <= tr[i] <= tf[i])):
                raise CorrectionError(f"step {self._step} asked for delays ({tf[i]}, {tb[i]}, {tr[i]}) at "
                                      f"stage {i}, outside 0..{self._max_delays[0][i]}/"
                                      f"{self._max_delays[1][i]} or not tau_bkwd <= tau_recomp <= "
                                      "tau_fwd; a correction's delays(step=None) must bound its delays")

    def _plan(self) -> "_PassPlan":
        """The plan of the current pass (the step's, unless ``microbatch_passes``)."""
        plans = self._step_plans()
        return plans[min(self._pass, len(plans) - 1)]

    def _current_delays(self) -> Tuple[List[int], List[int]]:
        return self._plan().delays

    @contextlib.contextmanager
    def passes_with_delays(self, tau_fwd: Sequence[int], tau_bkwd: Sequence[int]):
        """Within the block every training pass of the current step reads ``w_{t - tau_fwd_i}`` forward and
        ``w_{t - tau_bkwd_i}`` backward at stage ``i`` instead of the step's delays (the corrections' view
        rewrites apply; their ``delays`` do not); ``step()`` afterwards uses the step's own delays.
        :func:`staleopt.hogwild.eq16_step` builds PipeMare App. E eq. (16) on it."""
        self._check_attached()
        depth = [max(f, b) for f, b in zip(*self._max_delays)]  # the versions the history keeps per stage
        try:
            tau_fwd, tau_bkwd = list(tau_fwd), list(tau_bkwd)
        except TypeError:
            raise ConfigError(f"passes_with_delays takes two lists of delays, one per stage ({len(depth)}), got "
                              f"{tau_fwd!r} and {tau_bkwd!r}") from None
        if len(tau_fwd) != len(depth) or len(tau_bkwd) != len(depth):
            raise ConfigError(f"passes_with_delays needs one delay per stage ({len(depth)}), got {len(tau_fwd)} "
                              f"forward and {len(tau_bkwd)} backward")
        rewriting = [type(c).__name__ for c in self._corrections if c.rewrites_backward_view]
        tf = [check_int(f"tau_fwd[{i}]", d, 0, depth[i], error=ConfigError,
                        why="the history keeps max(max_delays) versions of each stage") for i, d in enumerate(tau_fwd)]
        top, why = (self._max_delays[1], f"{rewriting[0]} rewrites backward views for delays up to max_delays[1]") \
            if rewriting else (depth, "the history keeps max(max_delays) versions of each stage")
        tb = [check_int(f"tau_bkwd[{i}]", d, 0, top[i], error=ConfigError, why=why) for i, d in enumerate(tau_bkwd)]
        own, step = self._step_plans(), self._step
        # a recomputation inside these passes reads the backward view (tau_recomp := tau_bkwd)
        self._plans = [_PassPlan((tf, tb), list(tb), self._views, self._corrections, self._plan_cache,
                                 point=False)]
        try:
            yield
        finally:
            self._restore()
            self._plans = own if self._step == step else None  # a step() inside the block: plan the next afresh

    def _load(self, backward: bool, plan: Optional["_PassPlan"] = None) -> None:
        """Put each stage's forward (or backward) view into the parameters (corrections rewrite the latter).
        A forward lets the history point the parameters at the stored versions (``bind``, docs/engine.md;
        in the step's expected last pass also where the forward's version expires)."""
        plan = plan or self._plan()
        if not backward:
            self._history.load(plan.forward_last if self._last_forward() else plan.forward)
            return
        rewrite = self._history.load(plan.backward)
        if not rewrite:
            return
        if torch.is_grad_enabled():  # (the backward pass runs its hooks with grad off: no context to enter there)
            with torch.no_grad():
                self._rewrite_backward(rewrite, plan)
        else:
            self._rewrite_backward(rewrite, plan)

    @staticmethod
    def _rewrite_backward(rewrite: List[StageView], plan: "_PassPlan") -> None:
        """Each correction that rewrites backward views rewrites those of ``rewrite`` it declared for ``plan``."""
        for k, stages in plan.rewriters:
            mine = [v for v in rewrite if v.index in stages]
            if mine:
                k.backward_view(mine, plan.delays)

    # ------------------------------------------------------------------ activation recomputation
    @disable_dynamo
    def checkpoint(self, function, *args, **kwargs):
        """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)`` whose
        recomputation reads the recompute view (PipeMare App. A.3, App. D.1; docs/design.md §1).

        Call it inside the model's forward where you would call torch's checkpoint. During the
        backward pass the segment's activations are recomputed with ``u_recomp_i = w_{t - tau_recomp_i}``
        (T2: ``- (tau_fwd_i - tau_recomp_i) delta``, :class:`~staleopt.corrections.DiscrepancyCorrection`)
        for each stage the segment reads whose ``tau_recomp`` differs from ``tau_bkwd``; ``W^T delta``
        still reads ``u_bkwd`` (:mod:`staleopt.recompute`). ``tau_recomp == tau_fwd`` equals no
        checkpointing; ``tau_recomp == tau_bkwd`` (every schedule but ``dataflow-recompute`` and custom
        ``tau_recomp``) equals torch's checkpoint. Outside a training forward of the model (eval, no
        grad) it is torch's checkpoint. ``kwargs`` go to torch's (``preserve_rng_state``,
        ``determinism_check``, ``debug``, ``early_stop``); ``use_reentrant`` and ``context_fn`` are the
        engine's.
        """
        self._check_attached()
        if function is self._model:
            raise ConfigError("opt.checkpoint(model, ...) would rerun the wrapped model's forward (and its hooks) "
                              "during the backward pass: call opt.checkpoint on segments inside model.forward")
        for key in ("use_reentrant", "context_fn"):
            if key in kwargs:
                raise ConfigError(f"opt.checkpoint sets {key} itself (non-reentrant, with the recompute view as "
                                  f"its recompute context); call it without {key}=")
        if not (self._in_forward and torch.is_grad_enabled()):
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
        self._seen.add("checkpoint")
        self._checkpointed = True
        plan = self._plan()
        window = RecomputeWindow(self, plan, self._step)
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=window.contexts,
                                                **kwargs)
        if plan.recomputing or self._segments:
            reached = reached_parameters(out, list(args) + list(kwargs.values()))
            if self._segments:
                self._calls.append(reached)
            view_of = self._view_of_param
            window.views = frozenset(view_of[p] for p in reached if p in view_of) & plan.recomputing
        return out

    def _check_segments(self, outputs) -> None:
        """Under a schedule with recompute segments, the ``opt.checkpoint`` calls of a training forward must be
        the segments (``Schedule.segments``): one call per segment, reading every weight of its stages that the
        forward reads, and no other stage's. A call per layer, a call across two segments, a segment left out
        (its activations kept from the forward) or a layer of it run outside its call (embeddings) would
        recompute something else than the schedule says while ``tau_recomp`` reports it."""
        plan = self._plan()
        tf, tr = plan.delays[0], plan.recomp
        segment_of = {i: k for k, (a, b) in enumerate(self._segments) for i in range(a, b + 1)}
        stage_of = self._stage_of_param
        if self._names is None:
            self._names = {id(p): n for n, p in self._model.named_parameters()}
        problems, calls = [], {}
        for n, reached in enumerate(self._calls, start=1):
            stages = sorted({stage_of[p] for p in reached if p in stage_of})
            segments = sorted({segment_of[i] for i in stages})
            if len(segments) > 1:
                problems.append(f"call {n} reads stages {stages}, across the segments "
                                f"{[self._segments[k] for k in segments]}")
            elif segments:
                calls.setdefault(segments[0], []).append(reached)
        used = reached_parameters(outputs, ())  # every leaf this forward read
        for k, (a, b) in enumerate(self._segments):
            mine = calls.get(k, [])
            if len(mine) > 1:
                problems.append(f"segment {(a, b)} is split over {len(mine)} calls")
            elif not mine and any(tr[i] != tf[i] for i in range(a, b + 1)):
                problems.append(f"segment {(a, b)} has no call (its activations would be the forward's)")
            inside = set().union(*mine)
            outside = [self._names.get(id(p), "?") for s in range(a, b + 1) for p in self._partition[s].params
                       if id(p) in used and id(p) not in inside]
            if mine and outside:
                problems.append(f"segment {(a, b)}'s call leaves out {outside}")
        if problems:
            self._restore()
            raise SegmentError(f"schedule {self._schedule!r} recomputes the segments {self._segments} of stages "
                               f"(Schedule.segments; tau_recomp = {tr}), but this training forward's opt.checkpoint "
                               f"calls do not match them: {'; '.join(problems)}. Wrap each segment in exactly one "
                               "opt.checkpoint call, from the first layer of its first stage (embeddings included) "
                               "to the last layer of its last stage (staleopt.segments.checkpoint_segments(opt, "
                               "layers, x) does it; opt.partition shows the stages), or train "
                               "schedule.without_recompute()")

    def _check_checkpointed(self, outputs) -> None:
        """Every training forward of a step that recomputes checks its ``opt.checkpoint`` calls
        (:meth:`_check_segments`). A step whose forwards made none is refused at ``step()``
        (:meth:`_check_recomputed`); one forward without calls beside others with them (gradient accumulation,
        ``microbatch_passes``) kept its activations while ``tau_recomp`` reports the recomputation: refused."""
        if not self._checkpointed and "checkpoint" not in self._seen:
            self._seen.add("uncheckpointed")
            return
        if self._checkpointed:
            self._check_segments(outputs)
        if not self._checkpointed or "uncheckpointed" in self._seen:
            self._restore()
            raise SegmentError(f"schedule {self._schedule!r} recomputes activations (tau_recomp = "
                               f"{self._plan().recomp}), and of this step's training forwards some called "
                               "opt.checkpoint and some did not, so theirs kept the forward activations: wrap the "
                               "recomputed segments in every training forward (staleopt.segments.checkpoint_segments"
                               "(opt, layers, x)), or train schedule.without_recompute()")

    def _watch_recomputation(self) -> None:
        """From the start of a backward pass to its end, a stage module's forward is a recomputation: a global
        module pre-hook (no per-module hooks in the forward pass) watches for it under a recompute schedule, and
        until the :class:`~staleopt.errors.RecomputeNotice` was given where a backward view differs."""
        if self._watch is None and (self._ahead or (not self._noticed and self._backward_views_differ())):
            self._watch = torch.nn.modules.module.register_module_forward_pre_hook(self._calls_back[2])
            self._hooks.append(self._watch)

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            if self._watch in self._hooks:
                self._hooks.remove(self._watch)
            self._watch = None

    def _on_unit_forward(self, module, args):
        """A stage's module running during the backward pass outside :meth:`checkpoint` is a recomputation with
        ``u_bkwd`` (``torch.utils.checkpoint`` called directly): refused under a recompute schedule; elsewhere,
        where the stage's backward view differs from its forward view, noticed once (:class:`RecomputeNotice`)."""
        stage = self._unit_stage.get(id(module))
        if stage is None or self._recomputing or current_autograd_node() is None:
            return
        if not self._ahead:
            plan = self._plan()
            if not self._noticed and stage in self._split_stages(plan):
                self._noticed = True
                warnings.warn(RecomputeNotice(
                    f"torch.utils.checkpoint recomputed {type(module).__name__} (stage {stage}) during the backward "
                    f"pass, with the weights loaded then: the backward view (tau_fwd = {plan.delays[0]}, tau_bkwd = "
                    f"{plan.delays[1]}), not the forward view. The recomputed activations, and the weight gradients "
                    "computed from them, differ from those of the run without checkpointing (tau_recomp = tau_bkwd, "
                    "the behaviour of a pipeline that recomputes in its backward pass; docs/wrapper.md). Train "
                    "without activation checkpointing to keep the forward's activations. (Given once; silence it "
                    "with warnings.filterwarnings('ignore', category=staleopt.errors.RecomputeNotice).)"),
                    stacklevel=2)
            return
        plan = self._plan()
        if plan.recomp[stage] == plan.delays[1][stage]:  # (torch's recomputation reads u_bkwd = u_recomp here)
            return
        raise LoopError(f"{type(module).__name__} (stage {stage}) ran its forward during the backward pass outside "
                        f"opt.checkpoint: torch.utils.checkpoint recomputes with the backward weights (tau_bkwd = "
                        f"{plan.delays[1][stage]} there), but schedule {self._schedule!r} recomputes stage {stage} "
                        f"with tau_recomp = {plan.recomp[stage]} (all stages: {plan.recomp}); call "
                        "opt.checkpoint(segment, x) instead (docs/wrapper.md)")

    def _enter_recompute(self, window: RecomputeWindow) -> None:
        """The recomputation of ``window``'s segment begins: its stages' recompute views into the parameters."""
        if window.step != self._step:
            raise LoopError(f"a segment checkpointed in the forward pass of step {window.step} is recomputed at "
                            f"step {self._step}: call backward() before opt.step()")
        if "backward-pending" not in self._seen:  # the gradient did not come through the model output
            self._on_backward_start(None)
        self._seen.add("recompute")
        plan, inside = window.plan, window.views
        self._fresh_casts()
        rewrite = self._history.load(plan.recompute_in(inside))  # (a history may hand back views it reloaded outside the window)
        if rewrite:
            with torch.no_grad():
                for k, stages in plan.recompute_rewriters:
                    mine = [v for v in rewrite if v.index in stages and v.index in inside]
                    if mine:
                        k.recompute_view(mine, plan.delays, plan.recomp)
                for k, stages in plan.rewriters:
                    mine = [v for v in rewrite if v.index in stages and v.index not in inside]
                    if mine:
                        k.backward_view(mine, plan.delays)

    def _leave_recompute(self, window: RecomputeWindow) -> None:
        """The recomputation ended (or torch stopped it early): the backward views back into the parameters."""
        self._load(backward=True, plan=window.plan)
        self._fresh_casts()

    def _restore(self) -> None:
        """Put ``w_t`` back into the parameters."""
        self._history.restore()

    def _adopt_w0(self) -> None:
        """Before the first step, ``w_0`` is what the parameters hold (docs/design.md §1): weights loaded
        into the model after this optimizer was built (a pretrained checkpoint) replace the copies the
        history took at construction. Called at each training forward and at ``step()`` of step 0."""
        self._restore()
        self._replicas.follow()
        for v in self._stored:
            if not all(torch.equal(d, s) for d, s in zip(v.data, v.stored(-1))):
                self._history.restart()
                return

    def _on_forward_start(self, module, args):
        if (self._in_forward or "backward-pending" in self._seen) and current_autograd_node() is None:
            self._drop_failed_pass()
        if module.training and torch.is_grad_enabled():
            first = "forward" not in self._seen  # the step's first training forward: the weights are at rest
            self._seen.add("forward")
            if self._counts is not None:
                self._counts[0] += 1
                if self._counts[0] == self._counts[1] + 1:  # every earlier graph of the step had its backward
                    self._restore()  # (a retained one may run again until now: the rows it reads stay reserved)
                    self._history.end_pass()
            if self._step == 0:
                self._adopt_w0()
            elif first and self._replicas:  # a change of a tied parameter at rest reaches its replicas
                self._restore()
                self._replicas.follow()
            if self._microbatch_passes:
                if self._passes >= self._microbatches:
                    N = self._microbatches
                    raise LoopError(f"this is training forward {self._passes + 1} since the last zero_grad() or "
                                    f"step(), but microbatch_passes=True with N={N} runs exactly one training "
                                    f"forward per microbatch: split each minibatch into N={N} microbatches "
                                    "(x.chunk(N)), one forward and backward each, then step() (zero_grad() "
                                    "before the first microbatch of a step restarts the count)")
                self._pass, self._passes = self._passes, self._passes + 1
            self._calls, self._checkpointed = [], False
            self._load(backward=False)
            dev = self._device_type  # (autocast makes no copy of a weight already in its dtype)
            self._autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) and \
                any(d != torch.get_autocast_dtype(dev) for d in self._param_dtypes) else None
            self._fresh_casts()
            self._in_forward = True
        else:
            self._in_forward = False
            self._restore()
            self._fresh_casts()

    def _fresh_casts(self) -> None:
        """Inside an autocast region, drop autocast's cache of cast weights: it keys them by the Parameter and
        keeps them to the end of the outermost region, so a forward (or a recomputation) after another in the
        same region would multiply with the casts of the view the parameters held then (w_t for a training
        forward after an eval one; microbatch j - 1's view for microbatch j)."""
        if torch.is_autocast_enabled(self._device_type):
            torch.clear_autocast_cache()

    def _drop_failed_pass(self) -> None:
        """The latest training forward, or the backward pass that began after it, raised before it ended (an
        out-of-memory error, an exception in the model or in a hook): torch ran neither its forward hook nor its
        end-of-backward callback. Found at the next forward or ``step()``: the pass does not count (a loop that
        catches the error and runs the microbatch again runs the same pass, with the same delays; one that skips
        it runs one pass fewer) and the backward's recomputation watch is removed. The next load starts from
        wherever the failed pass left the parameters; ``step()`` restores ``w_t`` (docs/wrapper.md)."""
        backward = "backward-pending" in self._seen
        self._in_forward = False
        self._seen.discard("backward-pending")
        self._unwatch()
        counts = self._counts
        if counts is not None and counts[0] > 0:
            counts[0] -= 1
            if backward and counts[1] > 0:
                counts[1] -= 1
        if self._microbatch_passes and self._passes > 0:
            self._passes -= 1

    def _on_forward_end(self, module, args, output):
        self._in_forward = False
        if module.training and torch.is_grad_enabled():
            leaves = (output,) if isinstance(output, torch.Tensor) else flatten(output)  # (a tensor: no walk)
            outputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if not outputs and not any(isinstance(t, torch.Tensor) for t in leaves):
                self._opaque_output(output)
            flow = None if self._traced else self._trace(outputs)
            if self._ahead and self._plan().needs_checkpoint:
                self._check_checkpointed(outputs)
            if self._autocast not in self._casts:
                flow = flow or dataflow(outputs, self._partition.units)
                self._casts[self._autocast] = frozenset(self._stage_of_unit[u] for u in flow.copied)
            if self._casts[self._autocast] or self._computed:
                self._check_graph_reads(self._casts[self._autocast])
            for t in outputs:  # (leaves would keep their hooks: only outputs with a grad_fn)
                t.register_hook(self._calls_back[0])

    def _opaque_output(self, output) -> None:
        """A training forward whose output holds no tensor the hooks can reach: its backward would read the
        forward views (the backward views are loaded by a hook on the output's tensors), so refuse it."""
        self._restore()
        kind = type(output).__name__
        fix = ("make the forward return a tensor" if output is None else
               f"return its 'logits' field from the forward (self.model(x).logits), or register the class {kind} "
               "with torch.utils._pytree (register_dataclass or register_pytree_node)" if hasattr(output, "logits")
               else f"return the tensor(s) (or a tuple or dict of them), or register the class {kind} with "
                    "torch.utils._pytree (register_dataclass or register_pytree_node)")
        raise LoopError(
            f"the model's training forward returned a {kind} in which torch.utils._pytree finds no tensor (it "
            "looks into tuples, lists, dicts, namedtuples and registered classes), so the PipelineOptimizer "
            "cannot hook the output to load the backward views and the backward would silently read the "
            f"forward's weights: {fix}")

    def _split_stages(self, plan: "_PassPlan") -> Set[int]:
        """The stages whose backward view differs from their forward view in ``plan``'s pass: other delays, or a
        correction (T2) that rewrites the backward view."""
        return {i for i, (f, b) in enumerate(zip(*plan.delays)) if f != b} | \
            {self._views[i].stage for _, views in plan.rewriters for i in views}

    def _check_graph_reads(self, casts: FrozenSet[int]) -> None:
        """Where a stage's backward view differs from its forward view, warn (once each) of the weights the
        forward's graph reads through a cast (``casts``: autocast's, or ``.to(dtype)``) or computes with
        (``self._computed``): the backward multiplies with those tensors, computed from the forward view, so
        the backward view does not reach them (design §1 asks ``W^T delta`` at ``u_bkwd``)."""
        differ = self._split_stages(self._plan())
        if casts & differ:
            self._warn_once("autocast", f"under autocast (or .to(dtype) in the forward) stage(s) "
                            f"{sorted(casts & differ)} multiply with cast copies of their weights, made from the "
                            "forward view, so in the backward pass their backward views (tau_bkwd != tau_fwd, T2) "
                            "are not applied and they train as with weight stashing; "
                            + ("autocast was entered inside model.forward (as accelerate's mixed precision does), "
                               if self._autocast is None else "")
                            + "run without autocast (or keep the weights in the dtype the ops compute in) to "
                            "simulate the backward views")
        if self._computed & differ:
            units = [u.name for u, s in zip(self._partition.units, self._stage_of_unit)
                     if s in self._computed & differ][:3]
            self._warn_once("computed", f"the unit(s) {units} compute a weight from a parameter in the forward pass "
                            "before applying it (W * mask, scale * W, 1 + W, W.clone()): the backward pass "
                            "multiplies with that result, made from the forward view, so their stage's backward "
                            "view (tau_bkwd != tau_fwd, T2) does not reach it, a mix no pipeline computes "
                            "(docs/wrapper.md, Limits). Exact with stashing (pipedream, pipemare-stash), or apply "
                            "the computation to the weights at rest (a mask: multiply the weight by it after each "
                            "opt.step())")

    def _trace(self, outputs) -> Dataflow:
        """Check the first training forward's graph: stages contiguous, weights read without casts or
        computations where the views differ (:meth:`_check_graph_reads`). Returns the graph's :class:`Dataflow`."""
        self._traced = True
        flow = dataflow(outputs, self._partition.units)
        self._computed = frozenset(self._stage_of_unit[u] for u in flow.computed)
        try:
            self._partition.check(flow, self._shared_parameters)
        except SharedParameterError as e:
            self._restore()
            tied = {r.name for r in self._replicas.items}
            if tied & {sp.name for sp in self._partition.shared_in(flow)}:  # read without its replica
                raise SharedParameterError(
                    f"{e}. (The graph reads the tied weight(s) {sorted(tied)} without the replica that "
                    "staleopt.replicas puts in the later stage's module: the forward reads it directly, or a "
                    "torch.compile'd forward traced the whole model into one graph, which hides the replica's read; "
                    "then compile the blocks between the tied modules (torch.compile on each block) instead of the "
                    "whole model, or run its forward eagerly.)") from None
            raise
        except Exception:
            self._restore()
            raise
        read = {self._stage_of_unit[u] for u in flow.first_use} | {r.stage for r in self._replicas.items}
        idle = [s for s in self._partition if s.index not in read]
        if idle and len(idle) == self._partition.num_stages and self._partition.num_stages > 1:
            warnings.warn("the first training forward read none of the model's parameters, so no stage reads a "
                          "stale version and the run trains without the simulated delays: the forward computed "
                          "with other tensors (torch.func.functional_call or vmap(grad(...)) over detached copies, "
                          "per-sample gradients); compute the loss through the module's own parameters (call the "
                          "model itself), then step", stacklevel=2)
        elif idle:
            P = self._partition.num_stages
            warnings.warn(f"the first training forward read no weight of stage(s) "
                          f"{', '.join(f'{s.index} ({s.modules})' for s in idle)}: the simulated pipeline still "
                          f"counts them, so the stages that compute run with the delays of {P} stages "
                          f"(tau_fwd = {self._max_delays[0]}) where {P - len(idle)} compute. If those modules "
                          "never run in training (an unused head or pooler), freeze their parameters "
                          "(requires_grad_(False)) or remove them before building the PipelineOptimizer",
                          stacklevel=2)
        return flow

    def _backward_views_differ(self) -> bool:
        plan = self._plan()
        return plan.delays[0] != plan.delays[1] or bool(plan.rewriters)

    def _on_backward_start(self, grad):
        first = "backward-pending" not in self._seen  # (the pass's first hook: the refusal comes before any mark)
        if first and self._microbatch_passes and self._counts is not None:
            self._refuse_mixed_backward(self._counts[0] - self._counts[1])
        self._seen.add("backward")
        if first:
            self._seen.add("backward-pending")
            self._watch_recomputation()
            queue_callback(self._calls_back[1])
            if self._counts is not None:
                self._counts[1] += 1
            if self._last_pass():
                self._expire(self._plan())
        self._load(backward=True)

    def _refuse_mixed_backward(self, pending: int) -> None:
        """With ``microbatch_passes``, a backward pass loads the backward view of the latest forward's microbatch.
        Where the forwards of several microbatches ran before it (a summed loss, or ``l0.backward();
        l1.backward()`` after both forwards) and their backward views differ (T2 rewrites each with its own
        microbatch's delays), the earlier microbatches' ``W^T delta`` would read the latest's view: refused.
        (A recompute schedule's windows load each pass's own views.)"""
        if pending < 2 or self._ahead:
            return
        plans = self._step_plans()
        reads = {(tuple(p.delays[1]), tuple(p.delays[0]) if any(v for _, v in p.rewriters) else None)
                 for p in (plans[min(k, len(plans) - 1)] for k in range(self._pass - pending + 1, self._pass + 1))}
        if len(reads) > 1:
            raise LoopError(f"the training forwards of {pending} microbatches ran before this backward pass, and "
                            "their backward views differ (microbatch_passes=True: each microbatch's own delays, "
                            "which T2's rewrite reads), while one backward pass loads one: run each microbatch's "
                            "forward and backward before the next forward ((loss_j / N).backward() right after its "
                            "forward), or build the wrapper without microbatch_passes (every pass sees the "
                            "minibatch's delays)")

    def _on_backward_end(self):
        """At the end of every backward pass the parameters hold ``w_t`` again (at rest, docs/design.md §1)."""
        self._seen.discard("backward-pending")
        self._unwatch()
        if torch.is_grad_enabled() and any(self._max_delays[0]):  # (grad mode is on in a create_graph backward)
            self._warn_once("create-graph", "a backward pass with create_graph=True (a gradient penalty, double "
                            "backprop) built a graph that a later backward differentiates after the parameters "
                            "hold w_t again: layers that save a view of their weight (nn.Linear) then read the "
                            "version this pass read, layers that save the parameter itself (convolutions, "
                            "non-contiguous weights) read w_t, so the second-order terms of delayed stages are "
                            "not those of a pipeline (outside the simulated semantics, docs/wrapper.md); warned once")
        if self._last_pass():
            self._expire()
        self._restore()

    def _last_forward(self) -> bool:
        """The training forward now starting is the step's expected last, and no earlier forward of the step
        waits for its backward."""
        counts, expected = self._counts, self._expected
        return (self._step > 0 and counts is not None and expected is not None
                and counts[0] == expected[0] and counts[1] + 1 == expected[1] and counts[0] == counts[1] + 1)

    def _last_pass(self) -> bool:
        """This step has run exactly as many training forwards and backward passes as expected
        (``microbatch_passes``: ``N`` of each; else the most any earlier step ran): no later pass of it is
        expected (one that comes anyway finds the dropped version, or, past the count, the safe path).
        Never at step 0 (its ``w_0`` may still be adopted at ``step()``) nor in a step resumed without its
        counts."""
        counts, expected = self._counts, self._expected
        return self._step > 0 and counts is not None and expected is not None and tuple(counts) == expected

    def _expire(self, plan: Optional["_PassPlan"] = None) -> None:
        """Tell the history that no later load of this step reads ``w_{t - H_i}`` (``memory="minimal"`` then
        drops it as the parameters leave it: one copy instead of a swap, and ``push`` free; docs/engine.md);
        with ``plan``, of the backward pass now starting, except the views its backward or recompute view
        still reads it from. A pass the expectation missed that reads it again raises ``LoopError``."""
        self._history.expire(self._stored_index if plan is None else plan.expiring)

    def _learn_passes(self) -> None:
        """At the end of a step: a plain loop expects the most training passes any step ran (a shorter step,
        such as an epoch's last accumulation, only keeps the safe path), then the next step counts afresh."""
        counts = self._counts
        if not self._microbatch_passes and counts is not None and counts[0] > 0:
            old = self._expected
            self._expected = tuple(counts) if old is None else (max(old[0], counts[0]), max(old[1], counts[1]))
        self._counts = [0, 0]

    def _restore_hook(self, *args):
        """A module's ``state_dict`` (reads) or ``load_state_dict`` (writes) sees the parameters' own storage with
        ``w_t``."""
        self._restore()

    @contextlib.contextmanager
    def current_weights(self):
        """Within the block the parameters hold ``w_t`` (the next forward/backward reloads its view)."""
        self._check_attached()
        self._restore()
        yield self._model

    def _model_training(self) -> bool:
        """Whether a forward with gradients is a training forward: the model's mode decides, as in
        :meth:`_on_forward_start`, whatever the mode of a module inside it (a tied head put in eval mode to
        turn its dropout off still sits in its own stage and reads its replica)."""
        return self._model.training

    def _check_attached(self) -> None:
        if self._detached is not None:
            raise DetachedError(f"this PipelineOptimizer no longer drives its model: {self._detached}. Use the "
                                "optimizer that drives it now (one live PipelineOptimizer per set of weights; "
                                "build a new one to train again)")

    def _detach(self, why: str) -> None:
        """Leave ``w_t`` in the parameters, remove the hooks; every later use raises :class:`DetachedError`."""
        if self._detached is None:
            self._restore()
            _remove_handles(self._hooks)
            self._detached = why

    def _warn_if_unseen(self, delays) -> None:
        """A loop that bypasses the wrapped module's forward would silently train without delays."""
        tf, tb = delays
        if any(tf) and "forward" not in self._seen:
            warnings.warn("PipelineOptimizer.step() saw no training forward pass of the model it wraps since the "
                          "last step, so this step's gradient was computed without the simulated delays; call "
                          "the model you passed to PipelineOptimizer (in train mode, with grad enabled). If you do: "
                          "a torch.compile'd module that ran before the PipelineOptimizer was built keeps a graph "
                          "without its hooks (build the optimizer first, or call torch._dynamo.reset())",
                          stacklevel=3)
        elif tf != tb and "forward" in self._seen and "backward" not in self._seen:
            warnings.warn("PipelineOptimizer.step() saw no gradient reach the model's output since the last "
                          "step, so the backward views were not applied; compute the loss from the output of "
                          "the model you passed to PipelineOptimizer", stacklevel=3)
        self._seen = set()
        if any(p.grad is not None for p in self._outside):
            self._warn_once("outside", "parameters the base optimizer updates but that were frozen when the "
                            "PipelineOptimizer was built now have gradients: they train without delay; build "
                            "the PipelineOptimizer after setting requires_grad")

    def _check_maximize(self) -> None:
        """A correction that reads ``p.grad`` as a minimized objective's gradient (``assumes_minimize``) would
        silently extrapolate or compensate the wrong way in a group with ``maximize=True`` (checked at every step:
        groups may be added or changed)."""
        if self._minimizing and any(g.get("maximize", False) for g in self._base.param_groups):
            raise CorrectionError(f"{', '.join(self._minimizing)} read(s) the gradient as that of a minimized "
                                  "objective, but a parameter group of the base optimizer has maximize=True (torch "
                                  "negates the gradient inside its step, where the correction does not see it): "
                                  "minimize the negated objective instead (loss = -objective, maximize=False)")

    def _check_dense(self) -> None:
        """Sparse gradients where a correction needs dense ones: refused with the fix (checked until a step finds
        none; a model's sparse embeddings give sparse gradients at every step)."""
        sparse = [p for g in self._base.param_groups for p in g["params"] if p.grad is not None and p.grad.is_sparse]
        if sparse:
            raise CorrectionError(f"{', '.join(self._dense)} combine(s) the gradients with dense running state, but "
                                  f"{len(sparse)} parameter(s) have sparse gradients (of shape "
                                  f"{tuple(sparse[0].shape)}: nn.Embedding(sparse=True) or EmbeddingBag(sparse=True)): "
                                  "build the model with sparse=False, or use a method whose corrections take sparse "
                                  "gradients (dataflow, pipedream, pipemare, dc-asgd)")
        self._dense = ()

    def _check_recomputed(self) -> None:
        """A step of a schedule that recomputes ahead of the backward pass (``tau_bkwd < tau_recomp < tau_fwd``
        at some stage) needs ``opt.checkpoint`` (else the segments the schedule recomputes silently kept
        their forward activations, or recomputed with ``u_bkwd`` through torch's own checkpoint)."""
        plans = self._step_plans()
        if "backward" in self._seen and "checkpoint" not in self._seen and any(p.needs_checkpoint for p in plans):
            self._seen = set()
            raise LoopError(f"schedule {self._schedule!r} recomputes activations with tau_recomp = "
                            f"{plans[0].recomp} (tau_bkwd = {plans[0].delays[1]}), but no opt.checkpoint call ran "
                            "in this step's training forward: wrap each recomputed segment of the model's forward "
                            "in opt.checkpoint(segment, x) (not torch.utils.checkpoint, which would recompute "
                            "with u_bkwd; docs/wrapper.md), or train schedule.without_recompute()")

    def _on_parameter_registered(self, module, name, param):
        """A module (re)registers a parameter: one this wrapper drives, replaced by another object, detaches the
        wrapper (its base optimizer and history hold the old one, so the model would silently stop training; a
        wrapper built after the replacement drives the new ones, and the old one's hooks would get in its way)."""
        old = self._registered.get((id(module), name))
        if old is not None and param is not old:
            self._detach(f"its model's parameter {type(module).__name__}.{name} was replaced by another Parameter "
                         "(load_state_dict(assign=True), or module.weight = nn.Parameter(...)), which this optimizer "
                         "and its base optimizer do not hold, so the model would stop training; build the base "
                         "optimizer and a new PipelineOptimizer after replacing parameters, or load weights in place "
                         "(load_state_dict without assign=True)")

    def _check_storage(self) -> None:
        if list(map(torch.Tensor.data_ptr, self._ptr_params)) != self._ptrs:
            raise LoopError("the model's parameters were moved or replaced after the PipelineOptimizer "
                            "was built (e.g. model.to(device), load_state_dict(assign=True), or p.data = "
                            "new_tensor): build the optimizer after the model is on its device, and change "
                            "weights in place (p.data.mul_(mask), or p.mul_(mask) under no_grad)")

    @disable_dynamo
    @torch.no_grad()
    def step(self, closure=None):
        """Apply the base optimizer to ``w_t`` with the simulated gradient; advance the history.

        ``torch.compile(opt.step)`` runs this step eagerly (dynamo skips it, as it skips the hooks):
        the engine's bookkeeping (which version is where, the step count, the plans) is Python state
        that a graph would freeze. To compile the update itself, compile the base optimizer's step.

        Order within the step (``docs/engine.md``): restore ``w_t``; push it into the history;
        corrections' ``lr_factors``, then per correction ``transform_stored`` and
        ``before_update``; the base step (per-stage groups under T1); the history advances to
        ``w_{t+1}``; corrections' ``after_update``.
        """
        self._check_attached()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not any(p.grad is not None for g in self._base.param_groups for p in g["params"]):
            return self._skip_empty_step(loss)
        if self._in_forward or "backward-pending" in self._seen:
            self._drop_failed_pass()
        t = self._step
        if t > 0:
            self._expire()  # no pass of this step follows
        self._restore()
        self._check_storage()
        if t == 0:
            self._adopt_w0()
        elif "forward" not in self._seen:  # (a training forward of this step made the replicas follow)
            self._replicas.follow()
        delays = self._step_plans()[0].delays  # microbatch 0's: the step's nominal delays
        self._check_recomputed()
        self._check_maximize()
        if self._per_stage_lr:
            refuse_compiled([self._base])  # (compiled after the wrapper was built)
        if self._dense:
            self._check_dense()
        self._warn_if_unseen(delays)
        if self._microbatch_passes and 0 < self._passes < self._microbatches:
            self._warn_once("short", f"step() after {self._passes} of N={self._microbatches} microbatch passes "
                            f"(microbatch_passes=True): microbatches {self._passes}..{self._microbatches - 1} of "
                            "this step did not run, so their delays were not simulated; split each minibatch into "
                            "N microbatches, one training forward and backward each (a short last batch of an "
                            "epoch may give fewer: then this is expected; warned once)")
        self._history.push(t)
        stored = self._stored
        factors = [1.0] * self._partition.num_stages
        for k in self._corrections:
            f = k.lr_factors(delays, t)
            if f is not None:
                factors = [a * b for a, b in zip(factors, f)]
        self._lr_factors = factors
        for k in self._corrections:
            k.transform_stored(stored, delays, t)
            k.before_update(delays, t)
        self._stepping = True
        try:
            if self._per_stage_lr:
                self._stage_groups.step(self._base, factors)
            else:
                self._base.step()
        finally:
            self._stepping = False
        self._replicas.follow()  # each copy of a tied weight takes the same update
        self._history.advance(t + 1)
        for k in self._corrections:
            k.after_update(stored, delays, t)
        self._step = t + 1
        self._in_forward = False
        self._plans = None
        self._passes, self._pass = 0, 0
        self._learn_passes()
        return loss

    def _on_base_step(self, optimizer, args, kwargs) -> None:
        """Step pre-hook of the base optimizer: stepped outside :meth:`step` (``base.step()``,
        ``scaler.step(base)``, a trainer given the base optimizer), the history never advances, so every training
        forward takes the parameters for ``w_0`` again and the run trains without delays, silently: refused."""
        if not self._stepping:
            raise LoopError(f"the base optimizer ({type(optimizer).__name__}) was stepped directly, not through the "
                            "PipelineOptimizer that wraps it: its history would not advance and the model would "
                            "train without the simulated delays. Step the PipelineOptimizer (opt.step(), "
                            "scaler.step(opt), or hand it to the trainer); to train without it, call "
                            "opt.remove_hooks() first")

    def _skip_empty_step(self, loss):
        """``step()`` with no gradient on any parameter (a batch a trainer skipped: Lightning calls ``step`` after a
        ``training_step`` that returned None) applies no update, so the pipeline saw no minibatch: like a step that
        ``GradScaler`` skips, it changes nothing (no base step, no history push, no correction's counter; ``w_t``
        back in the parameters), and a training forward it ran without a backward does not count (the next
        forward is the step's first pass again). Advancing would shift every later stale read by one version."""
        if self._in_forward or "backward-pending" in self._seen:
            self._drop_failed_pass()
        self._restore()
        self._seen = set()
        self._passes, self._pass = 0, 0
        if self._counts is not None:
            self._counts = [0, 0]
        self._warn_once("empty-step", f"PipelineOptimizer.step() found no gradient on any parameter and applied "
                        f"nothing: the simulated pipeline did not advance (step_count stays {self._step}), as for "
                        "a step GradScaler skips (a batch the trainer skipped, e.g. a Lightning training_step that "
                        "returned None); warned once")
        return loss

    # ------------------------------------------------------------------ checkpoints
    #: Version of the ``state_dict()["staleopt"]`` layout. 0: ``chunks``/``history`` lists at the top
    #: (before the History rewrite); 1: ``format`` and ``history`` = ``History.state_dict()``.
    FORMAT = 1

    @disable_dynamo
    def state_dict(self) -> dict:
        """The base optimizer's state dict plus ``"staleopt"`` (history, step, corrections), through
        torch's optimizer hooks: the wrapper's pre hooks run first (ours puts ``w_t`` back), then
        ``base_optimizer.state_dict()``, then the post hooks (ours adds the ``"staleopt"`` entry)."""
        self._check_attached()
        pre, post = optimizer_state_dict_hooks(self)
        for hook in list(pre.values()):
            hook(self)
        state = self._base.state_dict()
        for hook in list(post.values()):
            out = hook(self, state)
            state = state if out is None else out
        return state

    @disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this or an earlier format (older entries are upgraded, new keys
        filled from defaults) through torch's load hooks around ``base_optimizer.load_state_dict``."""
        self._check_attached()
        pre, post = optimizer_load_state_dict_hooks(self)
        state = state_dict
        for hook in list(pre.values()):
            out = hook(self, state)
            state = state if out is None else out
        self._base.load_state_dict(state)
        for hook in list(post.values()):
            hook(self)

    def _before_state_dict(self, optimizer) -> None:
        self._restore()
        if self._step == 0:
            self._adopt_w0()

    def _add_state(self, optimizer, state: dict) -> dict:
        """The engine's state; a training forward whose backward has not run is left out of the pass counts (a
        process that loads the checkpoint cannot run that backward: it runs the microbatch again)."""
        counts = self._counts
        if self._history.strategy == "minimal" and self._last_pass() and any(self._max_delays[0]):
            warnings.warn("a checkpoint saved after the step's last backward pass and before opt.step(), in "
                          "memory='minimal' (which dropped each delayed stage's oldest version in that backward): "
                          "a process that loads it can call step() with these gradients, but not run the "
                          "step's passes again (LoopError). Save after opt.step(), or use memory='fast'",
                          UserWarning, stacklevel=3)
        pending = counts[0] - counts[1] if counts is not None else 0
        if pending:
            counts = [counts[1], counts[1]]
        passes = self._passes - pending if self._microbatch_passes else self._passes
        state["staleopt"] = {
            "format": self.FORMAT,
            "step": self._step,
            "delays": None if self._plans is None else [plan.delays for plan in self._plans],
            "recompute": None if self._plans is None else [plan.recomp for plan in self._plans],
            "passes": (passes, min(self._pass, passes)),
            "pass_counts": {"step": counts, "expected": self._expected},
            "history": self._history.state_dict(),
            "generator": self._generator.get_state(),
            "corrections": [k.state_dict() for k in self._corrections],
            "stage_groups": self._stage_groups.state(self._base.param_groups) if self._per_stage_lr else [],
            "signature": self._signature(),
        }
        return state

    def _signature(self) -> dict:
        """What a checkpoint must have been saved with to load here (:meth:`_mismatch`)."""
        return {"stages": self._partition.num_stages, "schedule": repr(self._schedule),
                "microbatches": self._microbatches, "microbatch_passes": self._microbatch_passes,
                "corrections": [k.signature() for k in self._corrections],
                "memory": self._history.strategy, "base": type(self._base).__name__,
                "chunks": [(v.stage, v.numel, 0 if v.ring is None else v.ring.shape[0]) for v in self._views]}

    def _mismatch(self, saved: dict) -> List[str]:
        """How the checkpoint's signature ``saved`` differs from this optimizer's, one phrase per entry. An
        older checkpoint's missing entries (memory, base) are not compared, nor its correction hyperparameters
        where it recorded only their class names."""
        mine, out = self._signature(), []
        for key, value in mine.items():
            if key not in saved:
                continue
            theirs = saved[key]
            if key == "corrections" and not any("(" in c for c in theirs):
                value = [type(k).__name__ for k in self._corrections]
            if key == "chunks":
                theirs, value = [tuple(c) for c in theirs], [tuple(c) for c in value]
            if theirs != value:
                out.append(f"the stage views (stage, weights, rows) {theirs} in the checkpoint, {value} here: "
                           "another model, partition or memory mode" if key == "chunks"
                           else f"{key} {theirs!r} in the checkpoint, {value!r} here")
        return out

    def _take_state(self, optimizer, state_dict: dict) -> dict:
        """Load pre hook: check and keep the ``"staleopt"`` entry (upgraded); hand the rest to the base. The
        parameters hold ``w_t`` first (a load during a training pass: not the view that pass loaded)."""
        self._restore()
        if "staleopt" not in state_dict:
            raise OptimizerMismatchError("this state dict has no 'staleopt' entry: it was saved from a plain "
                                         "optimizer; load it into the base optimizer before wrapping instead")
        mine = _upgrade(state_dict["staleopt"])
        # the random delays' generator is a CPU one; torch.load(map_location="cuda") moved its state with the rest
        mine["generator"] = mine["generator"].to("cpu")
        differ = self._mismatch(mine["signature"])
        if differ:
            raise OptimizerMismatchError("this checkpoint was saved by another pipeline setup: " + "; ".join(differ)
                                         + ". Rebuild the optimizer as it was saved (the same model, base optimizer, "
                                         "stages, schedule, microbatches, memory mode and corrections with their "
                                         "settings)")
        # every refusal before anything loads (the base optimizer's state included): a refused checkpoint
        # leaves the run as it was
        mine["history"] = self._history.check_state_dict(mine["history"])
        for k, s in zip(self._corrections, mine["corrections"]):
            k.check_state_dict(s)
        if self._per_stage_lr:
            self._stage_groups.check_state(self._base.param_groups, mine["stage_groups"])
        # torch's load casts every state tensor but "step" to its parameter's dtype: NAdam's mu_product (and
        # ASGD's eta, mu), 0-d tensors the optimizer keeps in its scalar dtype, would then compute in another
        # precision (float64 parameters) or be rounded (bfloat16) and the resumed run differ from the
        # uninterrupted one; _load_state puts back the saved ones (by position, as torch maps them). A 0-d
        # parameter's own state (Adam's exp_avg, SGD's momentum_buffer) is 0-d too: cast as torch casts it, but
        # for the known scalar keys (_SCALAR_STATE)
        saved = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
        base_state = state_dict.get("state", {})
        mine["scalars"] = {(n, key): v for n, i in enumerate(saved) for key, v in base_state.get(i, {}).items()
                           if key != "step" and isinstance(v, torch.Tensor) and v.dim() == 0
                           and v.is_floating_point()}
        self._pending = mine
        return {k: v for k, v in state_dict.items() if k != "staleopt"}

    def _load_state(self, optimizer) -> None:
        """Load post hook: the base optimizer is loaded; now the history, the step and the corrections."""
        mine, self._pending = self._pending, None
        params = [p for g in self._base.param_groups for p in g["params"]]
        for (n, key), value in mine["scalars"].items():
            state = self._base.state.get(params[n]) if n < len(params) else None
            if state is not None and isinstance(state.get(key), torch.Tensor) and \
                    (params[n].dim() or key in _SCALAR_STATE):
                state[key] = value.to(device=state[key].device, copy=True)
        if self._per_stage_lr:
            self._stage_groups.load_state(self._base.param_groups, mine["stage_groups"])
        self._history.load_state_dict(mine["history"])
        self._step = mine["step"]
        delays, recompute = mine["delays"], mine["recompute"]
        if delays is not None and recompute is None:  # saved before tau_recomp: it was tau_bkwd
            recompute = [b for _, b in delays]
        self._plans = None if delays is None else \
            [_PassPlan((list(f), list(b)), list(r), self._views, self._corrections, self._plan_cache)
             for (f, b), r in zip(delays, recompute)]
        self._passes, self._pass = mine["passes"]
        counts = mine["pass_counts"]  # None (an older checkpoint): this step's passes are unknown
        self._counts = None if counts is None or counts["step"] is None else list(counts["step"])
        # passes of this step that ran before the save saw the forward and the backward (a step() with their
        # gradients is not a loop that bypassed the model)
        self._seen = {"forward", "backward"} if self._counts is not None and self._counts[1] else set()
        if not self._microbatch_passes:
            self._expected = None if counts is None or counts["expected"] is None else tuple(counts["expected"])
        self._generator.set_state(mine["generator"])
        for k, s in zip(self._corrections, mine["corrections"]):
            k.load_state_dict(s)

    def remove_hooks(self) -> None:
        """Detach from the model: its parameters keep ``w_t``; using this optimizer again raises
        :class:`~staleopt.errors.DetachedError` (build a new one to train on)."""
        self._detach("remove_hooks() detached it")

    def __repr__(self) -> str:
        tf, tb = self._max_delays
        return (f"PipelineOptimizer(base={type(self._base).__name__}, stages={self._partition.num_stages}, "
                f"schedule={self._schedule!r}, microbatches={self._microbatches}, "
                f"microbatch_passes={self._microbatch_passes}, "
                f"corrections={self._corrections}, tau_fwd={tf}, tau_bkwd={tb})")


def _apply_corrections(corrections: Sequence[Correction], tf, tb, tr, step: Optional[int]):
    """``(tau_fwd, tau_bkwd, tau_recomp)`` after every correction's ``delays`` in list order; the recompute
    delays go through them as a second backward (as in :attr:`staleopt.methods.Pipeline.recompute_delays`)."""
    tf, tb, tr = list(tf), list(tb), list(tr)
    if tr == tb:
        for c in corrections:
            tf, tb = c.delays(list(tf), list(tb), step)
        return list(tf), list(tb), list(tb)
    tfr = tf
    for c in corrections:
        tf, tb = c.delays(list(tf), list(tb), step)
        tfr, tr = c.delays(list(tfr), list(tr), step)
    return list(tf), list(tb), list(tr)


def _upgrade(mine: dict) -> dict:
    """The ``"staleopt"`` entry of any earlier format in the current one (a copy; missing keys get defaults)."""
    mine = dict(mine)
    version = mine.pop("format", 0)
    if version > PipelineOptimizer.FORMAT:
        raise CheckpointError(f"this checkpoint's optimizer state has format {version}, newer than this staleopt "
                              f"reads ({PipelineOptimizer.FORMAT}): upgrade staleopt")
    if version == 0:  # the ring bookkeeping and buffers were two top-level lists
        mine["history"] = {"slots": mine.pop("chunks"), "rings": mine["history"]}
    for key, default in (("delays", None), ("recompute", None), ("passes", (0, 0)), ("stage_groups", []),
                         ("corrections", []), ("pass_counts", None)):
        mine.setdefault(key, default)
    mine["format"] = PipelineOptimizer.FORMAT
    return mine


class _PassPlan:
    """What one pass loads: ``forward`` (``forward_last`` in the step's expected last pass), ``backward`` and
    ``recompute`` are the history's :class:`~staleopt.history.Targets` (relative to the step, so one object per
    set of delays serves every step); ``rewriters`` (``recompute_rewriters``) pairs each correction that rewrites
    backward (recompute) views this pass with the indices of those views (declared by ``modifies_backward``,
    ``modifies_recompute``); ``recomputing``: the views whose recompute view is not their backward view
    (``tau_recomp != tau_bkwd``; elsewhere the recompute target *is* the backward one); ``needs_checkpoint``:
    some stage has ``tau_bkwd < tau_recomp < tau_fwd`` (``tau_recomp = tau_fwd`` recomputes the forward's
    activations: no checkpoint needed). ``expiring``: the stored views whose ``w_{t-H}`` neither this pass's
    backward nor its recompute view reads (:meth:`PipelineOptimizer._expire`). The forward targets' ``bind``
    (:meth:`~staleopt.history.SlotHistory._plan_bound`): the views a forward may bind in any pass, in the step's
    expected last one, or (``point=False``: the passes of :meth:`PipelineOptimizer.passes_with_delays`) none.
    Everything is computed once per set of delays (``cache``, a :class:`_Relative`); ``check`` (the engine's
    bounds on its delays) runs once per set."""

    __slots__ = ("delays", "recomp", "forward", "forward_last", "backward", "rewriters", "recompute",
                 "recompute_rewriters", "recomputing", "needs_checkpoint", "expiring", "_rel")

    def __init__(self, delays: Tuple[List[int], List[int]], recomp: List[int], views: Sequence[StageView],
                 corrections: Sequence[Correction], cache: Dict[tuple, "_Relative"],
                 check: Optional[Callable] = None, point: bool = True):
        tf, tb = self.delays = delays
        self.recomp = tr = recomp
        key = (tuple(tf), tuple(tb), tuple(tr))
        rel = cache.get(key)
        if check is not None and (rel is None or not rel.checked):  # the engine's own delays: checked once
            check(tf, tb, tr)
            if rel is not None:
                rel = cache[key] = rel._replace(checked=True)
        if rel is None:
            if len(cache) >= 256:  # random schedules (Hogwild) draw new delays every step
                cache.clear()
            by_view = [[k for k in corrections if k.modifies_backward(v.stage, tf[v.stage], tb[v.stage])]
                       for v in views]
            rewriters = [(k, {v.index for v, ks in zip(views, by_view) if k in ks}) for k in corrections]
            backward = [(tb[v.stage], bool(ks)) for v, ks in zip(views, by_view)]
            recomputing = frozenset(v.index for v in views if tr[v.stage] != tb[v.stage])
            by_view_r = [[k for k in corrections if k.modifies_recompute(v.stage, tf[v.stage], tr[v.stage])]
                         if v.index in recomputing else [] for v in views]
            recompute_rewriters = [(k, {v.index for v, ks in zip(views, by_view_r) if k in ks}) for k in corrections]
            recompute = [(tr[v.stage], bool(ks)) if v.index in recomputing else b
                         for v, ks, b in zip(views, by_view_r, backward)]
            # the stored views whose w_(t-H) neither the backward nor the recompute view reads
            expiring = tuple(v.index for v in views if v.H and v.H not in (backward[v.index][0], recompute[v.index][0]))
            # views a forward may bind (SlotHistory.load; no view that recomputes with another version): 0, the
            # backward reads the same raw version; 1, in the step's last pass the forward's w_(t-H) expires; 2, other
            delayed = [v for v in views if tf[v.stage] and v.index not in recomputing]
            bind_any = {v.index: 0 if backward[v.index] == (tf[v.stage], False) else 2 for v in delayed}
            expires = set(expiring)
            bind_last = {**bind_any, **{v.index: 1 for v in delayed
                                        if bind_any[v.index] and tf[v.stage] == v.H and v.index in expires}}
            forward = [(tf[v.stage], False) for v in views]
            rel = cache[key] = _Relative(
                Targets(forward), Targets(forward, bind_any), Targets(forward, bind_last), Targets(backward),
                [(k, idx) for k, idx in rewriters if idx], Targets(recompute),
                [(k, idx) for k, idx in recompute_rewriters if idx], recomputing,
                any(b != r != f for f, b, r in zip(tf, tb, tr)), expiring, check is not None, {})
        self.forward, self.forward_last = (rel.forward_any, rel.forward_last) if point else (rel.forward,) * 2
        self.backward = rel.backward
        self.rewriters = rel.rewriters
        self.recompute = rel.recompute
        self.recompute_rewriters = rel.recompute_rewriters
        self.recomputing = rel.recomputing
        self.needs_checkpoint = rel.needs_checkpoint
        self.expiring = rel.expiring
        self._rel = rel

    def recompute_in(self, inside: FrozenSet[int]) -> Targets:
        """The targets of a recomputation of the views ``inside``: their recompute views, the backward views
        elsewhere (one object per set of views)."""
        got = self._rel.mixed.get(inside)
        if got is None:
            got = self._rel.mixed[inside] = Targets([r if i in inside else b for i, (r, b) in
                                                     enumerate(zip(self.recompute.rel, self.backward.rel))])
        return got


class _Relative(NamedTuple):
    """What a :class:`_PassPlan` holds for one set of delays (``forward``: without binding; ``forward_any``,
    ``forward_last``: with the views a forward may bind; ``mixed``: :meth:`_PassPlan.recompute_in`'s targets),
    and ``checked``: the engine's bounds were checked on these delays."""

    forward: Targets
    forward_any: Targets
    forward_last: Targets
    backward: Targets
    rewriters: list
    recompute: Targets
    recompute_rewriters: list
    recomputing: frozenset
    needs_checkpoint: bool
    expiring: Tuple[int, ...]
    checked: bool
    mixed: Dict[FrozenSet[int], Targets]
