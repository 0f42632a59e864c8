"""Tied parameters held as real pipelines hold them: one replica per stage that uses them.

A parameter registered by two modules that sit in different stages (GPT-2's ``lm_head.weight`` tied to
the token embedding ``wte.weight``) is, in a real pipeline (Megatron-LM, ``torch.distributed.
pipelining``), a copy on each stage that uses it: each copy is read at its own stage's delay and the
copies' gradients are summed every step, so every copy takes the same update (docs/design.md §1).
The engine does exactly that:

* the owner (the first module that registers the parameter, as :func:`staleopt.partition.units_of`
  assigns it: in registration order, or for a partition made with ``example_input`` the first the
  forward calls) keeps the parameter; every other stage ``b`` that registers it gets a **replica**: a
  tensor of the same shape in a unit of stage ``b`` (named after the using module), whose versions the
  history keeps at stage ``b``'s depth ``H_b`` like any other weight of that stage, and which every
  correction sees in stage ``b``'s :class:`~staleopt.history.StageView` (its ``params`` entry is the
  tied parameter, for its gradient and optimizer state; its ``data`` entry is the replica);
* during a training forward the using module reads the replica through :class:`ReplicaRead`, whose
  backward hands the gradient to the tied parameter: autograd sums the uses' gradients into one
  ``.grad`` (the all-reduce of a real pipeline), which DDP, gradient clipping and GradScaler see;
* the base optimizer updates the tied parameter once; the replica then takes the new value
  (:meth:`Replicas.follow`), as each copy applies the same update. A change made to the tied
  parameter at rest (a checkpoint loaded into the model) reaches the replicas at the next training
  forward or step.

Memory: each replica is one weight copy plus its stage's ``H_b`` stored versions
(:meth:`Replicas.nbytes` and the history's bytes), what the pipeline's stage ``b`` holds.

Refused (:class:`~staleopt.errors.SharedParameterError`, by the engine): a module registered under two
names in different stages, or a parameter read directly (not through a module registering it) by a
later stage: one module object cannot read two stages' versions; register a second module whose weight
is the first's (``head.weight = tok.weight``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from .errors import CorrectionError
from .partition import Partition, Registration, SharedParameter, Stage, Unit, param_name, foreign_registrations

__all__ = ["Replica", "ReplicaRead", "Replicas", "plan_replicas", "refuse_with_replicas"]


@dataclass(frozen=True)
class Replica:
    """Stage ``stage``'s copy ``tensor`` of the tied parameter ``master`` (owned by ``owner_stage`` as ``name``),
    read by ``module`` (``module_name`` in the model) as its parameter ``key``."""

    name: str
    master: nn.Parameter = field(repr=False)
    tensor: torch.Tensor = field(repr=False)
    module: nn.Module = field(repr=False)
    module_name: str
    key: str
    stage: int
    owner_stage: int

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class ReplicaRead(torch.autograd.Function):
    """``forward(master, holder)`` returns a view of the replica ``holder[0]`` (what the using module reads: the
    engine loads its stage's versions into that storage); ``backward`` passes the gradient to ``master``.

    The node keeps the replica as ``node.staleopt_replica``, so graph walks (:func:`staleopt.partition.dataflow`,
    :func:`staleopt.recompute.reached_parameters`) see the replica, in its stage, where the module read it."""

    @staticmethod
    def forward(ctx, master, holder):
        ctx.staleopt_replica = holder[0]
        return holder[0].view_as(holder[0])

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def plan_replicas(model: nn.Module, partition: Partition,
                  allocate: bool = True) -> Tuple[List[Replica], List[SharedParameter]]:
    """The replicas ``partition`` needs, and the shared parameters no replica can serve (to refuse).
    ``allocate=False`` (memory reports) gives each replica the tied parameter itself as its ``tensor``.

    A module that registers a parameter owned by a unit of another stage sits in the stage of its own unit,
    else of the last unit before it in the partition's module order (:func:`staleopt.partition.foreign_registrations`).
    It gets a replica when it is one module object in one stage; a module object registered in two stages
    (or the owner's module registered again elsewhere) cannot, and neither can a use only the forward pass
    shows (found later, by :meth:`Partition.check`)."""
    uses: Dict[Tuple[int, str], List[Registration]] = {}  # (id(module), key) -> where it is registered
    for r in foreign_registrations(model, partition.stages, partition.module_order):
        uses.setdefault((id(r.module), r.key), []).append(r)
    replicas, refused, served = [], {}, set()
    for found in uses.values():
        first = found[0]
        u, p, pname = first.unit, first.param, param_name(first.unit, first.j)
        owner_stage = partition.stage_of(p)
        owner_module = model if u.name == "<root>" else model.get_submodule(u.name)
        if len({r.stage for r in found}) == 1 and first.module is not owner_module:
            with torch.no_grad():
                tensor = p.detach().clone() if allocate else p
            replicas.append(Replica(pname, p, tensor, first.module, first.name, first.key, first.stage, owner_stage))
            served.add((pname, first.stage))
        else:
            for r in found:
                refused.setdefault(pname, (owner_stage, []))[1].append(
                    (f"{r.name!r} (one module object registered in several places)", r.stage))
    for sp in partition.shared:  # uses the registrations or an example forward found that no replica serves
        known = {st for _, st in refused.get(sp.name, (0, []))[1]}
        rest = [(where, st) for where, st in sp.uses if (sp.name, st) not in served and st not in known]
        if rest:
            refused.setdefault(sp.name, (sp.stage, []))[1].extend(rest)
    return replicas, [SharedParameter(n, s, tuple(ws)) for n, (s, ws) in refused.items()]


class Replicas:
    """The replicas of one engine: the partition the engine runs on, the substitution hooks, the syncs."""

    def __init__(self, partition: Partition, replicas: Sequence[Replica]):
        self.items = list(replicas)
        self.partition = _with_replicas(partition, self.items)
        self._by_module: Dict[int, List[Replica]] = {}
        for r in self.items:
            self._by_module.setdefault(id(r.module), []).append(r)
        self._masters = [r.master.data for r in self.items]
        self._tensors = [r.tensor for r in self.items]
        self._saved: Dict[int, List[Tuple[Replica, torch.Tensor]]] = {}

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def nbytes(self) -> int:
        """Bytes of the replicas' current weights (their stored versions are in the history's bytes)."""
        return sum(r.nbytes for r in self.items)

    def hooks(self, active) -> List:
        """Forward pre- and post-hooks on each using module: while ``active()`` (the engine's model in training
        mode) and gradients are on, the module reads its replicas through :class:`ReplicaRead`; afterwards (also when
        its forward raises) it holds the tied parameter again."""
        handles = []
        for group in self._by_module.values():
            module = group[0].module
            handles.append(module.register_forward_pre_hook(_Substitute(self, group, active)))
            handles.append(module.register_forward_hook(_PutBack(self), always_call=True))
        return handles

    def follow(self) -> None:
        """Every replica takes its tied parameter's value (the parameters at rest hold ``w_t``)."""
        if self.items:
            torch._foreach_copy_(self._tensors, self._masters)

    def put_back(self, module: nn.Module) -> None:
        for r, original in self._saved.pop(id(module), ()):
            module._parameters[r.key] = original


class EngineHook:
    """A hook the engine registers on the user's model (the wrapper's callbacks, the replica hooks). A copy or
    a pickle of the model (``copy.deepcopy``, ``AveragedModel``, ``torch.save(model)``) gets an inert hook
    in its place: the copy is not the model the engine drives, and a replica hook would otherwise carry
    the engine's replica tensors (a weight-sized copy of each tied matrix) into every copy."""

    def __deepcopy__(self, memo):
        return _Inert()

    def __reduce__(self):
        return _Inert, ()


class _Inert:
    def __call__(self, *args):
        return None


class _Substitute(EngineHook):
    def __init__(self, owner: Replicas, group: List[Replica], active):
        self.owner, self.group, self.active = owner, group, active

    def __call__(self, module, args):
        if torch.is_grad_enabled() and self.active():  # (the model's mode decides, not the module's own)
            saved = self.owner._saved.setdefault(id(module), [])
            for r in self.group:
                saved.append((r, module._parameters[r.key]))
                module._parameters[r.key] = ReplicaRead.apply(r.master, [r.tensor])


class _PutBack(EngineHook):
    def __init__(self, owner: Replicas):
        self.owner = owner

    def __call__(self, module, args, output):
        self.owner.put_back(module)


def _with_replicas(partition: Partition, replicas: Sequence[Replica]) -> Partition:
    """``partition`` with one unit per replica at the end of its stage (units in pipeline order)."""
    if not replicas:
        return partition
    extra: Dict[int, List[Unit]] = {}
    for r in replicas:
        extra.setdefault(r.stage, []).append(Unit(r.module_name, "Replica", (r.tensor,), (r.key,)))
    stages = [Stage(s.index, tuple(s.units) + tuple(extra.get(s.index, ()))) for s in partition]
    units = [u for s in stages for u in s.units]
    return Partition(stages, units, list(partition.shared), list(replicas), partition.module_order)


def refuse_with_replicas(corrections: Sequence) -> None:
    """A correction that rewrites gradients per stage view (``rewrites_gradients``) would rewrite a tied
    parameter's gradient once per view that holds it: refused while replicas exist."""
    bad = [type(c).__name__ for c in corrections if c.rewrites_gradients]
    if bad:
        raise CorrectionError(f"{', '.join(bad)} rewrite(s) each stage's gradient in place, and a tied parameter's "
                              "gradient belongs to every stage that holds a replica of it (staleopt.replicas), so "
                              "it would be rewritten once per stage: untie the parameter (staleopt's gpt: model_kwargs "
                              "{\"tie\": false}, on the command line --model-kwargs '{\"tie\": false}'; Hugging "
                              "Face models: config.tie_word_embeddings=False), put its uses in one stage, or use "
                              "another correction")
