"""The stale-weight optimizer: a ``torch.optim.Optimizer`` that simulates a pipeline exactly.

Semantics (DESIGN §1, PipeMare §2). Step ``t`` computes one gradient and
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

* A forward pre-hook on the model copies each stage's forward view into the
  parameters' own storage (through ``p.data`` aliases, so autograd's version
  counters are not bumped) before the forward pass runs.
* A forward hook registers a tensor hook on every output that requires grad;
  the first one to fire — when the backward pass reaches the model output, before
  any layer's backward runs — copies the backward views into the same storage.
  Autograd saved the *parameter tensors* for ``W^T delta``, so the backward
  reads ``u_bkwd``; the weight gradients use the saved activations, computed
  with ``u_fwd``.
* ``step()`` restores ``w_t``, pushes it into the history, runs the base
  optimizer on ``w_t`` and advances the history.
* Evaluation (``model.eval()`` or grad disabled), ``model.state_dict()`` and the
  :meth:`PipelineOptimizer.current_weights` context see ``w_t``.

History: per stage (and per device/dtype within a stage) one contiguous buffer
of ``H_i = max_t max(tau_fwd_i, tau_bkwd_i)`` versions — exactly the past
versions the delays need, ``sum_i H_i |w_i|`` in all; stages with no delay keep
nothing. Loading a view *swaps* the parameters' contents with the slot holding
the wanted version (an exact XOR swap on integer views, no temporary), so
``w_t`` itself never needs a slot of its own; ``step()`` copies ``w_t`` into the
slot of the version that just expired. A correction that rewrites the backward
view in place (T2) gets one free slot per affected stage to keep the raw version.
Plain copies of one phase go to a single ``torch._foreach_copy_`` call.

Limits (documented, not checked):

* only ops that save the *parameter tensor itself* for their backward see
  ``u_bkwd``; an op that saves a transformed copy of a weight (weight norm,
  ``W * 2``, parametrizations) uses the forward view in its backward;
* activation checkpointing inside the model recomputes with the backward view;
* buffers (BatchNorm running statistics) are not delayed;
* a loss term that reads parameters directly (an explicit L2 penalty) sees
  whichever view is loaded when its backward runs;
* call ``backward`` before the next training forward of a different step;
  several forward/backward passes per step (gradient accumulation) are fine;
* create the optimizer after moving the model to its device (checked).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._torch_compat import flatten, queue_callback
from .corrections.base import Correction
from .errors import ConfigError, CorrectionError, DetachedError, LoopError, OptimizerMismatchError
from .partition import Partition, dataflow, partition_model
from .schedules import Schedule

__all__ = ["PipelineOptimizer"]


def _copy(dst: List[torch.Tensor], src: List[torch.Tensor], foreach: bool) -> None:
    if not dst:
        return
    if foreach:
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor (complex numbers as pairs of floats first)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


class _Callback:
    """Calls a wrapper's method through a weak reference: inert once the wrapper is gone or detached.

    A copy or a pickle of the model (``copy.deepcopy``, ``AveragedModel``,
    ``torch.save(model)``) gets a no-op in its place: the copy is not the
    model the optimizer drives.
    """

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args):
        method = self._method()
        if method is None or method.__self__._detached is not None:
            return None
        return method(*args)

    def __deepcopy__(self, memo):
        return _NoHook()

    def __reduce__(self):
        return _NoHook, ()


class _NoHook:
    def __call__(self, *args):
        return None


#: id(parameter) -> (weak reference to it, weak reference to the PipelineOptimizer driving it)
_DRIVERS: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


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


def _remove_handles(handles: List) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class _Split:
    """One base-optimizer group of a stage: ``group`` is stepped, ``own`` are the keys the optimizer wrote."""

    __slots__ = ("user", "stage", "group", "own", "shown")

    def __init__(self, user: dict, stage: int, params: list, shown: dict):
        self.user, self.stage, self.own, self.shown = user, stage, set(), shown
        self.group = {**user, "params": params}


class _StageGroups:
    """Per-stage step sizes (T1) that leave the base optimizer's group state intact.

    With per-stage factors the base optimizer steps over one group per (user group, stage): the
    user's group with ``lr`` times the stage's factor. These groups persist from step to step. A
    key the optimizer itself writes into a group during its step (schedule-free's ``k`` and
    ``weight_sum``, Adan's ``step``) becomes that group's *own* and stays as the optimizer left it,
    exactly as if the user had built one group per stage and scaled each ``lr`` by hand; every
    other key follows the user's group at each step (schedulers write ``lr``, ``momentum``, ...),
    and an own key follows it only when the user writes a new value. The user's group shows the
    own keys of its first stage (the wrapper's ``state_dict`` keeps every stage's). While no group
    has own keys and every factor is 1, the base optimizer steps over the user's groups directly.
    ``lr`` is never an own key: the wrapper sets it at every step.
    """

    def __init__(self, stage_of: Dict[int, int]):
        self._stage_of = stage_of
        self._users: List[dict] = []
        self._splits: List[_Split] = []
        self._own = False

    def _sync(self, groups: List[dict]) -> List[_Split]:
        """Splits of ``groups``, reusing those of user groups seen before (same dict object)."""
        if len(groups) == len(self._users) and all(a is b for a, b in zip(groups, self._users)):
            return self._splits
        before: Dict[int, List[_Split]] = {}
        for sp in self._splits:
            before.setdefault(id(sp.user), []).append(sp)
        splits = []
        for group in groups:
            kept = before.get(id(group))
            if kept and kept[0].user is group and self._same(kept, group):
                splits += kept
                continue
            shown: dict = {}
            splits += [_Split(group, s, ps, shown) for s, ps in self._by_stage(group)]
        self._users, self._splits = list(groups), splits
        self._own = any(sp.own for sp in splits)
        return splits

    def _by_stage(self, group: dict) -> List[Tuple[int, list]]:
        by: Dict[int, list] = {}
        for p in group["params"]:
            by.setdefault(self._stage_of.get(id(p), -1), []).append(p)
        return sorted(by.items())

    def _same(self, splits: List[_Split], group: dict) -> bool:
        """Whether ``splits`` still partition ``group``'s parameters (a group's list may be edited in place)."""
        now = [(s, [id(p) for p in ps]) for s, ps in self._by_stage(group)]
        return now == [(sp.stage, [id(p) for p in sp.group["params"]]) for sp in splits]

    def step(self, base: torch.optim.Optimizer, factors: List[float]) -> None:
        """One base-optimizer step with ``lr`` times ``factors[stage]`` in every stage's groups."""
        groups = base.param_groups
        splits = self._sync(groups)
        if not self._own and all(f == 1.0 for f in factors):
            base.step()
            return
        given = []
        for sp in splits:
            g = sp.group
            for k, v in sp.user.items():
                if k != "params" and (k not in sp.own or v is not sp.shown.get(k)):
                    g[k] = v
            g["lr"] = sp.user["lr"] * (factors[sp.stage] if sp.stage >= 0 else 1.0)
            given.append(dict(g))
        base.param_groups = [sp.group for sp in splits]
        try:
            base.step()
        finally:
            base.param_groups = groups
        shown = set()
        for sp, before in zip(splits, given):
            for k, v in sp.group.items():
                if k != "lr" and (k not in before or before[k] is not v):
                    sp.own.add(k)
                    self._own = True
            if sp.own and id(sp.shown) not in shown:  # the first stage of a user group shows its own keys
                shown.add(id(sp.shown))
                for k in sp.own:
                    sp.user[k] = sp.shown[k] = sp.group[k]

    def state(self, groups: List[dict]) -> List[dict]:
        """Every stage group's own keys (empty dicts while the optimizer writes no group state)."""
        return [{k: sp.group[k] for k in sorted(sp.own)} for sp in self._sync(groups)]

    def load_state(self, groups: List[dict], state: List[dict]) -> None:
        splits = self._sync(groups)
        if len(state) != len(splits):
            raise OptimizerMismatchError(f"the checkpoint has {len(state)} per-stage parameter groups but this "
                                         f"optimizer has {len(splits)}: rebuild it with the same parameter groups")
        for sp, own in zip(splits, state):
            sp.own = set(own)
            sp.group.update(own)
            for k in own:
                sp.shown[k] = sp.user.get(k)
        self._own = any(sp.own for sp in splits)


def _swap(a: List[torch.Tensor], b: List[torch.Tensor]) -> None:
    """Exchange the contents of two tensor lists in place without a temporary (XOR on integer views)."""
    for x, y in zip(a, b):
        x.bitwise_xor_(y)
        y.bitwise_xor_(x)
        x.bitwise_xor_(y)


class _Chunk:
    """The parameters of one stage that share a device and dtype, and their history.

    ``ring`` holds ``S`` flat versions. ``where`` maps a version number ``v``
    (the weights after ``v`` steps; ``v < 0`` holds ``w_0``) to its slot. The
    parameters hold ``key = (version, modified)``; ``unique`` says no slot
    holds a copy of it. Loads *swap* the parameters with the slot that holds the
    wanted version, so no version is ever overwritten: ``S = H`` slots suffice,
    ``H = max_t max(tau_fwd, tau_bkwd)``. A stage whose backward view a correction
    rewrites in place (T2) gets one free slot to keep the raw version it rewrites.
    """

    def __init__(self, stage: int, params: List[nn.Parameter], history: int, spare: bool):
        self.stage, self.params, self.H = stage, params, history
        self.data = [p.data for p in params]  # aliases: writes skip autograd's version counter
        self.ptrs = [p.data_ptr() for p in params]
        self.numel = sum(p.numel() for p in params)
        self.S = history + (1 if spare and history else 0)
        self.ring = None
        self.views: List[List[torch.Tensor]] = []
        if self.S:
            p0 = params[0]
            self.ring = torch.empty((self.S, self.numel), dtype=p0.dtype, device=p0.device)
            self.views = [self.split(self.ring[s]) for s in range(self.S)]
            with torch.no_grad():
                for s in range(self.S):
                    torch._foreach_copy_(self.views[s], self.data)
            self.idata = [_as_int(d) for d in self.data]
            self.iviews = [[_as_int(v) for v in views] for views in self.views]
        self.where: Dict[int, int] = {-a: a - 1 for a in range(1, history + 1)}  # w_{-a} = w_0
        self.free: List[int] = list(range(history, self.S))
        self.key = (0, False)
        self.unique = True

    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Views of a flat buffer of this chunk's size, one per parameter, shaped like it."""
        views, off = [], 0
        for p in self.params:
            views.append(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        return views

    def zeros(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """A new zero flat buffer of this chunk's size and dtype (a correction's state) and its views."""
        flat = torch.zeros(self.numel, dtype=self.params[0].dtype, device=self.params[0].device)
        return flat, self.split(flat)

    def stored(self, version: int) -> List[torch.Tensor]:
        """Views of the slot holding ``version`` (e.g. ``w_t`` once it entered the history)."""
        return self.views[self.where[version]]

    @property
    def nbytes(self) -> int:
        return 0 if self.ring is None else self.ring.numel() * self.ring.element_size()

    def state(self) -> dict:
        return {"where": dict(self.where), "free": list(self.free), "key": self.key, "unique": self.unique}

    def load_state(self, state: dict) -> None:
        self.where = {int(k): int(v) for k, v in state["where"].items()}
        self.free, self.key, self.unique = list(state["free"]), tuple(state["key"]), bool(state["unique"])


class PipelineOptimizer(torch.optim.Optimizer):
    r"""Wrap ``base_optimizer`` so that training ``model`` simulates a pipeline-parallel run.

    Args:
        model: the module whose forward/backward the training loop calls.
        base_optimizer: any ``torch.optim.Optimizer`` over (a subset of) the model's parameters.
        stages: a stage count ``P`` or a :class:`~staleopt.partition.Partition`.
        schedule: a schedule or method name (``"dataflow"``, ``"1f1b"``, ``"pipemare"``, ...)
            or a :class:`~staleopt.schedules.Schedule`.
        microbatches: ``N``, microbatches per minibatch (enters the delay formulas).
        corrections: extra :class:`~staleopt.corrections.base.Correction` objects, applied
            after a method's own.
        seed: seeds the generator of random schedules (Hogwild).
        partition: ``"ops"`` or ``"params"`` when ``stages`` is a count.
        foreach: batch the history copies with ``torch._foreach_copy_`` (default);
            ``False`` runs the reference per-tensor loop.
        method_args: hyperparameters of a named method, e.g. ``{"anneal_steps": 500, "decay": 0.2}``
            for ``"pipemare"`` (:mod:`staleopt.methods` lists each method's).
        microbatch_passes: the loop runs one forward/backward per microbatch (``N`` passes between
            ``zero_grad()`` and ``step()``), and pass ``j`` sees the delays of microbatch ``j``,
            ``Schedule.microbatch_delays`` — exactly what the executed pipeline does when the
            microbatches of one minibatch straddle an update (1F1B, dataflow, pb with ``N > 1``).
            Default: every pass sees the minibatch's delays (those of microbatch 0, the largest).
        memory: ``"minimal"`` (default) keeps exactly ``max(tau_i)`` versions per stage and moves
            views by in-place swaps; ``"fast"`` keeps one more version per delayed stage and moves
            views by plain copies, each phase one ``torch._foreach_copy_`` over all stages —
            fewer kernels per step for ``(H_i + 1) / H_i`` the history memory. Same results.

    The update rule is the base optimizer's, applied to ``w_t`` with the gradient
    ``grad f_t(u_fwd_t, u_bkwd_t)`` (module docstring).
    """

    def __init__(self, model: nn.Module, base_optimizer: torch.optim.Optimizer,
                 stages: Union[int, Partition] = 1, schedule: Union[str, Schedule] = "dataflow",
                 microbatches: int = 1, corrections: Iterable[Correction] = (), seed: Optional[int] = None,
                 partition: str = "ops", foreach: bool = True, method_args: Optional[dict] = None,
                 microbatch_passes: bool = False, memory: str = "minimal"):
        from . import methods  # methods imports the corrections, which import this package

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
        if memory not in ("minimal", "fast"):
            raise ConfigError(f"memory must be 'minimal' (exactly max(tau) versions per stage) or 'fast' (one more "
                              f"per delayed stage, fewer kernels per step), got {memory!r}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigError(f"microbatches must be an int >= 1 (microbatches per minibatch), got {microbatches!r}")
        corrections = list(corrections)
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
        self._partition = stages if isinstance(stages, Partition) else partition_model(model, stages, partition)
        self._microbatches = microbatches
        self._fast = memory == "fast"
        self._microbatch_passes = bool(microbatch_passes)
        self._passes, self._pass = 0, 0  # training forwards since zero_grad/step; index of the latest
        self._foreach = foreach
        self._generator = torch.Generator()
        self._generator.manual_seed(0 if seed is None else int(seed))
        self._step = 0
        self._seen = set()  # which hooks fired during the current step
        self._delays: Optional[List[Tuple[List[int], List[int]]]] = None  # per pass of this step
        self._check_parameters()
        for previous in _drivers([p for s in self._partition for p in s.params]):
            previous._restore()  # its w_t, not a view it left loaded, is this wrapper's w_0

        P = self._partition.num_stages
        tf, tb = self._schedule.delays(P, microbatches)
        for c in self._corrections:
            tf, tb = c.delays(list(tf), list(tb), None)
        self._max_delays = (list(tf), list(tb))
        rewrites = any(c.rewrites_backward_view for c in self._corrections)
        self._chunks: List[_Chunk] = []
        for stage in self._partition:
            groups: Dict[tuple, List[nn.Parameter]] = {}
            for p in stage.params:
                groups.setdefault((p.device, p.dtype), []).append(p)
            for ps in groups.values():
                i = stage.index
                spare = self._fast or (rewrites and tf[i] != tb[i])
                self._chunks.append(_Chunk(i, ps, max(tf[i], tb[i]), spare=spare))

        self._device_type = self._chunks[0].params[0].device.type
        self._autocast_outside = False  # autocast was on when the latest training forward began
        self._stage_of_param = {id(p): s.index for s in self._partition for p in s.params}
        self._per_stage_lr = any(type(c).lr_factors is not Correction.lr_factors for c in self._corrections)
        self._stage_groups = _StageGroups(self._stage_of_param)
        self._lr_factors = [1.0] * self._partition.num_stages
        self._outside = [p for g in self._base.param_groups for p in g["params"] if id(p) not in self._stage_of_param]
        self._warned = set()
        self._traced = False  # the first training forward's graph was checked (stage order, cast weights)
        self._copies_weights = False  # that graph reads cast copies of the weights (autocast inside forward)
        self._initialized = True
        for c in self._corrections:
            c.bind(self)
        _take_over([p for s in self._partition for p in s.params] + self._outside, self)
        self._hooks = [model.register_forward_pre_hook(_Callback(self._on_forward_start)),
                       model.register_forward_hook(_Callback(self._on_forward_end)),
                       model.register_state_dict_pre_hook(_Callback(self._on_state_dict))]
        weakref.finalize(self, _remove_handles, self._hooks)  # hooks die with their wrapper

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
        self._check_attached()
        self._base.zero_grad(set_to_none=set_to_none)
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
        in_model = {id(p) for p in self._model.parameters()}
        in_base = [p for g in self._base.param_groups for p in g["params"]]
        foreign = [p for p in in_base if id(p) not in in_model]
        if foreign:
            raise OptimizerMismatchError(
                f"the base optimizer holds {len(foreign)} parameter(s) that are not in the model "
                f"(first shape {tuple(foreign[0].shape)}): build the base optimizer from model.parameters() "
                "of the model you pass to PipelineOptimizer")
        base_ids = {id(p) for p in in_base}
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
    def max_delays(self) -> Tuple[List[int], List[int]]:
        """Largest delays any step can have (sizes the history)."""
        return list(self._max_delays[0]), list(self._max_delays[1])

    @property
    def chunks(self) -> Sequence[_Chunk]:
        """Per-stage storage units (for corrections and memory reports)."""
        return tuple(self._chunks)

    def history_bytes(self) -> int:
        """Bytes held by the weight history (all stages)."""
        return sum(c.nbytes for c in self._chunks)

    def memory_bytes(self) -> int:
        """Bytes held by the history plus every correction's buffers."""
        return self.history_bytes() + sum(c.extra_bytes() for c in self._corrections)

    # ------------------------------------------------------------------ the engine
    def _step_delays(self) -> List[Tuple[List[int], List[int]]]:
        """Delays of each pass of the current step: ``N`` with ``microbatch_passes``, else one."""
        if self._delays is None:
            P, N = self._partition.num_stages, self._microbatches
            if self._microbatch_passes and not self._schedule.random:
                tf_ij, tb_ij = self._schedule.microbatch_delays(P, N)
                raw = [([row[j] for row in tf_ij], [row[j] for row in tb_ij]) for j in range(N)]
            else:
                raw = [self._schedule.sample(P, N, self._generator)]
            self._delays = []
            for tf, tb in raw:
                for c in self._corrections:
                    tf, tb = c.delays(list(tf), list(tb), self._step)
                for i in range(P):
                    if not (0 <= tf[i] <= self._max_delays[0][i] and 0 <= tb[i] <= self._max_delays[1][i]):
                        raise CorrectionError(f"step {self._step} asked for delays ({tf[i]}, {tb[i]}) at stage {i}, "
                                            f"outside 0..{self._max_delays[0][i]}/{self._max_delays[1][i]}; a "
                                            "correction's delays(step=None) must bound its delays")
                self._delays.append((list(tf), list(tb)))
        return self._delays

    def _current_delays(self) -> Tuple[List[int], List[int]]:
        """Delays of the current pass (the step's, unless ``microbatch_passes``)."""
        passes = self._step_delays()
        return passes[min(self._pass, len(passes) - 1)]

    def _load(self, backward: bool) -> None:
        """Put each stage's forward (or backward) view into the parameters."""
        tf, tb = delays = self._current_delays()
        targets, rewriters = [], {}  # chunk -> the corrections that rewrite its backward view
        for c in self._chunks:
            age = tb[c.stage] if backward else tf[c.stage]
            ks = [k for k in self._corrections if k.modifies_backward(c.stage, tf[c.stage], tb[c.stage])] \
                if backward else []
            if ks:
                rewriters[id(c)] = ks
            targets.append((self._step - age, bool(ks)))
        modified = self._apply(targets)
        with torch.no_grad():
            for k in self._corrections:
                mine = [c for c in modified if k in rewriters[id(c)]]
                if mine:
                    k.backward_view(mine, delays)

    def _apply(self, targets) -> List[_Chunk]:
        """Bring chunk ``i`` to ``targets[i] = (version, modified)``; returns the chunks to modify.

        Raw versions move by swapping with their slot (nothing is overwritten), or in
        ``memory="fast"`` mode by saving the parameters' content to a free slot and
        copying; a parameter content that also lives in a slot is simply overwritten;
        before a view is rewritten in place its raw version is copied to a free slot.
        """
        swap_a, swap_b, save_dst, save_src, dst, src, keep_dst, keep_src = [], [], [], [], [], [], [], []
        modified, plans = [], []
        for c, (version, mod) in zip(self._chunks, targets):
            if c.key == (version, mod):
                continue
            key, unique, moved, saved, kept = c.key, c.unique, None, None, None
            if key != (version, False):
                if version not in c.where:
                    raise CorrectionError(f"stage {c.stage}: weight version {version} is no longer stored; "
                                        "this is a bug in a correction's delays (please report it)")
                slot = c.where[version]
                if unique and not self._fast:  # the parameters hold the only copy of a raw version: trade places
                    swap_a += c.idata
                    swap_b += c.iviews[slot]
                    moved = (version, key[0], slot)
                else:  # save the only copy to a free slot (fast mode), or overwrite a duplicate / rewritten view
                    if unique:
                        saved = (key[0], c.free[-1])
                        save_dst += c.views[saved[1]]
                        save_src += c.data
                        unique = False
                    dst += c.data
                    src += c.views[slot]
                key = (version, False)
            if mod:
                if unique:
                    kept = (version, c.free[-1])  # (after a save the parameters are never unique)
                    keep_dst += c.views[kept[1]]
                    keep_src += c.data
                unique, key = False, (version, True)
                modified.append(c)
            plans.append((c, key, unique, moved, saved, kept))
        with torch.no_grad():
            _swap(swap_a, swap_b)
            _copy(save_dst, save_src, self._foreach)
            _copy(dst, src, self._foreach)
            _copy(keep_dst, keep_src, self._foreach)
        for c, key, unique, moved, saved, kept in plans:  # bookkeeping only once the data has moved
            if moved is not None:
                del c.where[moved[0]]
                c.where[moved[1]] = moved[2]
            for entry in (saved, kept):
                if entry is not None:
                    c.free.remove(entry[1])
                    c.where[entry[0]] = entry[1]
            c.key, c.unique = key, unique
        return modified

    def _restore(self) -> None:
        """Put ``w_t`` back into the parameters."""
        self._apply([(self._step, False)] * len(self._chunks))

    def _on_forward_start(self, module, args):
        if module.training and torch.is_grad_enabled():
            self._seen |= {"forward"}
            if self._microbatch_passes:
                if self._passes >= self._microbatches:
                    raise LoopError(f"microbatch_passes=True expects at most N={self._microbatches} training "
                                        "forward passes between zero_grad() and step(); call zero_grad() "
                                        "before the first microbatch of each step")
                self._pass, self._passes = self._passes, self._passes + 1
            self._load(backward=False)
            self._autocast_outside = torch.is_autocast_enabled(self._device_type)
        else:
            self._restore()

    def _on_forward_end(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            outputs = [t for t in flatten(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if not self._traced:
                self._trace(outputs)
            if (self._autocast_outside or self._copies_weights) and self._backward_views_differ():
                self._warn_once("autocast", "under autocast the backward pass multiplies with the cast copies of "
                                "the forward weights, so the backward views (tau_bkwd != tau_fwd, T2) are not "
                                "applied and the step behaves as with weight stashing; "
                                + ("autocast was entered inside model.forward (as accelerate's mixed precision "
                                   "does), " if self._copies_weights and not self._autocast_outside else "")
                                + "run without autocast to simulate the backward views")
            for t in outputs:  # (leaves would keep their hooks: only outputs with a grad_fn)
                t.register_hook(_Callback(self._on_backward_start))

    def _trace(self, outputs) -> None:
        """Check the first training forward's graph: stages contiguous, weights read without casts."""
        self._traced = True
        flow = dataflow(outputs, self._partition.units)
        self._copies_weights = bool(flow.copied)
        try:
            self._partition.check(flow)
        except Exception:
            self._restore()
            raise

    def _backward_views_differ(self) -> bool:
        tf, tb = self._current_delays()
        return tf != tb or any(k.modifies_backward(i, f, b) for k in self._corrections
                               for i, (f, b) in enumerate(zip(tf, tb)))

    def _on_backward_start(self, grad):
        self._seen |= {"backward"}
        if "backward-pending" not in self._seen:
            self._seen |= {"backward-pending"}
            queue_callback(_Callback(self._on_backward_end))
        self._load(backward=True)

    def _on_backward_end(self):
        """At the end of every backward pass the parameters hold ``w_t`` again (at rest, DESIGN §1)."""
        self._seen.discard("backward-pending")
        self._restore()

    def _on_state_dict(self, *args):
        self._restore()

    @contextlib.contextmanager
    def current_weights(self):
        """Within the block the parameters hold ``w_t`` (the next forward/backward reloads its view)."""
        self._check_attached()
        self._restore()
        yield self._model

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
                          "the model you passed to PipelineOptimizer (in train mode, with grad enabled)",
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

    def _check_storage(self) -> None:
        for c in self._chunks:
            if c.params[0].data_ptr() != c.ptrs[0] or c.params[-1].data_ptr() != c.ptrs[-1]:
                raise LoopError("the model's parameters were moved or replaced after the PipelineOptimizer "
                                    "was built (e.g. model.to(device) or load_state_dict(assign=True)): build "
                                    "the optimizer after the model is on its device")

    @torch.no_grad()
    def step(self, closure=None):
        """Apply the base optimizer to ``w_t`` with the simulated gradient; advance the history."""
        self._check_attached()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_storage()
        self._restore()
        delays = self._step_delays()[0]  # microbatch 0's: the step's nominal delays
        self._warn_if_unseen(delays)
        t = self._step
        stored = [c for c in self._chunks if c.S]
        dst, src = [], []
        for c in stored:
            if t - c.H in c.where:  # w_{t-H} is not needed from step t+1 on
                c.free.append(c.where.pop(t - c.H))
            if c.unique:
                slot = c.free.pop()
                dst += c.views[slot]
                src += c.data
                c.where[t] = slot
        _copy(dst, src, self._foreach)
        factors = [1.0] * self._partition.num_stages
        for k in self._corrections:
            f = k.lr_factors(delays, self._step)
            if f is not None:
                factors = [a * b for a, b in zip(factors, f)]
        self._lr_factors = factors
        for k in self._corrections:
            k.transform_stored(stored, delays, self._step)
            k.before_update(delays, self._step)
        if self._per_stage_lr:
            self._stage_groups.step(self._base, factors)
        else:
            self._base.step()
        for c in self._chunks:
            c.key, c.unique = (t + 1, False), True
        for k in self._corrections:
            k.after_update(stored, delays, self._step)
        self._step += 1
        self._delays = None
        self._passes, self._pass = 0, 0
        return loss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        self._check_attached()
        self._restore()
        state = self._base.state_dict()
        state["staleopt"] = {
            "step": self._step,
            "delays": self._delays,
            "passes": (self._passes, self._pass),
            "chunks": [c.state() for c in self._chunks],
            "history": [c.ring for c in self._chunks],
            "generator": self._generator.get_state(),
            "corrections": [k.state_dict() for k in self._corrections],
            "stage_groups": self._stage_groups.state(self._base.param_groups) if self._per_stage_lr else [],
            "signature": self._signature(),
        }
        return state

    def _signature(self) -> dict:
        return {"stages": self._partition.num_stages, "schedule": repr(self._schedule),
                "microbatches": self._microbatches, "microbatch_passes": self._microbatch_passes,
                "corrections": [type(k).__name__ for k in self._corrections],
                "chunks": [(c.stage, c.numel, c.S) for c in self._chunks]}

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_attached()
        if "staleopt" not in state_dict:
            raise OptimizerMismatchError("this state dict has no 'staleopt' entry: it was saved from a plain "
                                         "optimizer; load it into the base optimizer before wrapping instead")
        mine = state_dict["staleopt"]
        if mine["signature"] != self._signature():
            raise OptimizerMismatchError(f"checkpoint was saved with {mine['signature']} but this optimizer is "
                                         f"{self._signature()}: rebuild it with the same model, stages, schedule "
                                         "and corrections")
        self._base.load_state_dict({k: v for k, v in state_dict.items() if k != "staleopt"})
        if self._per_stage_lr:
            self._stage_groups.load_state(self._base.param_groups, mine.get("stage_groups") or
                                          [{} for _ in self._stage_groups.state(self._base.param_groups)])
        with torch.no_grad():
            for c, cstate, ring in zip(self._chunks, mine["chunks"], mine["history"]):
                c.load_state(cstate)
                if c.ring is not None:
                    c.ring.copy_(ring)
        self._step = mine["step"]
        self._delays = None if mine["delays"] is None else [(list(f), list(b)) for f, b in mine["delays"]]
        self._passes, self._pass = mine["passes"]
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
