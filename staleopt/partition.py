"""Split a model's trainable parameters into ``P`` contiguous pipeline stages.

The unit of partitioning is a *parametrized operator*: all trainable parameters
owned directly by one module (weight and bias fused), in module registration
order (PipeMare §4.1, "Pipeline Stages"). torchvision's ResNet-50 has 107 such
units (53 conv, 53 batch-norm, 1 linear), so at most 107 stages.

Strategies:

* ``"ops"`` (default): the same number of units per stage (the first
  ``U mod P`` stages take one more).
* ``"params"``: contiguous stages with balanced parameter counts (minimises
  the largest stage, exact dynamic programming over the unit sequence).
* explicit cut points: a list of the unit indices at which stages 1..P-1
  start (the stale-weights paper's Pipeline Placement Vector, §3).

Stages must be contiguous in the forward pass: data computed with the weights
of stage ``j`` may only meet the weights of stages ``>= j`` (torchgpipe's
``verify_module`` refuses what it cannot order for the same reason). Registration
order is only a proxy for execution order; :func:`dataflow` reads the real one
from a forward pass's autograd graph, :meth:`Partition.check` refuses a partition
it contradicts (:class:`~staleopt.errors.StageOrderError`), and
``partition_model(..., example_input=x)`` orders the units by their first use
in a forward pass on ``x`` instead of by registration.

Shared (tied) parameters belong to their first owner and appear once; frozen
parameters (``requires_grad=False``) are excluded. :attr:`Partition.shared` lists the parameters
a *later* stage uses too (GPT-2's ``lm_head`` tied to the token embedding, a module applied at two
places), found from the module registrations (a module that registers another's parameter sits in
the stage of its own unit, or of the last unit registered before it) and, given ``example_input``,
from the forward pass; :meth:`Partition.check` finds them in the first training forward.
:class:`~staleopt.PipelineOptimizer` gives a module of a later stage that registers one a replica
(:mod:`staleopt.replicas`: the engine's partition has one more unit in that stage) and refuses the
uses no replica can serve (:class:`~staleopt.errors.SharedParameterError`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._torch_compat import flatten, sequence_nr
from .errors import SharedParameterError, StageError, StageOrderError
from .validate import check_int

__all__ = ["Unit", "Stage", "SharedParameter", "Partition", "Dataflow", "units_of", "dataflow", "execution_order",
           "partition_model", "registered_shared", "refuse_shared", "leaf_variable", "Registration", "param_name",
           "foreign_registrations"]


@dataclass(frozen=True)
class Unit:
    """One parametrized operator: a module name and the trainable parameters it owns directly."""

    name: str
    module_type: str
    params: tuple  # of nn.Parameter
    param_names: tuple = ()  # their names in the module

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


@dataclass(frozen=True)
class Stage:
    """A contiguous run of units; ``index`` 0 is next to the input."""

    index: int
    units: tuple

    @property
    def params(self) -> List[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    @property
    def modules(self) -> List[str]:
        return [u.name for u in self.units]

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)


@dataclass(frozen=True)
class SharedParameter:
    """A trainable parameter used by a stage other than its owner's: ``name`` (as its owner registers it),
    the owner ``stage`` whose history holds it, and ``uses``: ``(where, stage)`` of each use elsewhere."""

    name: str
    stage: int
    uses: tuple

    def __str__(self) -> str:
        return (f"{self.name!r} (stage {self.stage}) is also used by "
                + ", ".join(f"{where} (stage {stage})" for where, stage in self.uses))


def _owner(name: str, module: nn.Module) -> str:
    """The name of the module whose unit holds ``module``'s own parameters: itself, or for a parametrization
    (``X.parametrizations.weight``) the module ``X`` it parametrizes."""
    if isinstance(module, parametrize.ParametrizationList):
        return name.rpartition("parametrizations.")[0].rstrip(".")
    return name


def _modules_in_order(model: nn.Module, order: Sequence[str] = (), remove_duplicate: bool = True):
    """``model.named_modules()``: given ``order`` (:attr:`Partition.module_order`, the modules an example forward
    called, first call first), those modules in that order, then the others in registration order."""
    named = list(model.named_modules(remove_duplicate=remove_duplicate))
    if not order:
        return named
    rank = {name: i for i, name in enumerate(order)}
    first: Dict[int, float] = {}  # a module object -> the rank of its first name
    for name, module in model.named_modules():
        first.setdefault(id(module), rank.get(name, math.inf))
    return sorted(named, key=lambda nm: first[id(nm[1])])  # (stable: ties keep registration order)


def units_of(model: nn.Module, order: Sequence[str] = ()) -> List[Unit]:
    """The model's parametrized operators in registration order, or in ``order`` (:func:`_modules_in_order`),
    tied and frozen parameters handled: a parameter registered by several modules belongs to the first. The
    parameters of a torch parametrization (``weight_norm``, ``spectral_norm``: ``X.parametrizations.weight``'s
    ``original0``, ...) belong to the unit of the module ``X`` they parametrize, with its own ones."""
    seen = set()
    units: List[Unit] = []
    at: Dict[str, int] = {}  # module name -> its unit's index
    for name, module in _modules_in_order(model, order):
        own = []
        for key, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                own.append((key, p))
        if not own:
            continue
        owner = _owner(name, module)
        if owner != name:  # a parametrization: its parameters join the unit of the module it parametrizes
            prefix = name[len(owner) + 1:] if owner else name
            own = [(f"{prefix}.{k}", p) for k, p in own]
            name, module = owner, model.get_submodule(owner)
        params, keys = tuple(p for _, p in own), tuple(k for k, _ in own)
        if name in at:
            u = units[at[name]]
            units[at[name]] = Unit(u.name, u.module_type, u.params + params, u.param_names + keys)
        else:
            at[name] = len(units)
            units.append(Unit(name or "<root>", type(module).__name__, params, keys))
    return units


@dataclass(frozen=True)
class Dataflow:
    """What the autograd graph of one forward pass says about a list of units (indices into it).

    ``first_use``: unit -> creation order of the first graph node that reads its weights.
    ``crossings``: pairs ``(a, b)``, ``b > a``: a weight of unit ``a`` is applied to data computed
    with the weights of unit ``b`` (weights used more than once, e.g. tied embeddings, are left out).
    ``copied``: units whose weights the graph reads through a copy (autocast's casts, ``.to(dtype)``).
    ``shared``: triples ``(a, b, j)``, ``b > a``: parameter ``j`` of unit ``a``, read by more than one node,
    is applied to data computed with the weights of unit ``b`` (tied weights, a module applied twice).
    ``computed``: units whose weight the graph applies to data after computing with it (``W * mask``,
    ``scale * W``, ``1 + W``, ``W.clone()``: an op on the weight path other than a view, a cast or a lookup), so
    the backward multiplies with a tensor computed from the forward's version (:data:`_READS_NO_INPUT`
    consumers, e.g. an addition, read no input in their backward and are left out).
    """

    first_use: Dict[int, int]
    crossings: FrozenSet[Tuple[int, int]]
    copied: FrozenSet[int]
    shared: FrozenSet[Tuple[int, int, int]] = frozenset()
    computed: FrozenSet[int] = frozenset()


#: Graph nodes (names without their trailing number) that pass a weight on unchanged in value: views, and casts
#: (``Dataflow.copied``); lookups (embeddings, indexing) whose result is data, read in no later backward as a weight.
_PASSES_WEIGHT = frozenset(
    "TBackward TransposeBackward PermuteBackward ViewBackward UnsafeViewBackward ReshapeAliasBackward "
    "ExpandBackward UnsqueezeBackward SqueezeBackward AsStridedBackward SliceBackward SelectBackward "
    "UnbindBackward SplitBackward SplitWithSizesBackward NarrowBackward AliasBackward DiagonalBackward "
    "ViewAsRealBackward ViewAsComplexBackward ToCopyBackward EmbeddingBackward EmbeddingBagBackward "
    "IndexBackward IndexSelectBackward GatherBackward".split())
#: Nodes whose backward reads none of their inputs: a computed weight they consume is not multiplied with.
_READS_NO_INPUT = frozenset("AddBackward SubBackward CatBackward StackBackward".split())


def _op(node) -> str:
    return node.name().rstrip("0123456789").lstrip("_")


def dataflow(outputs: Any, units: Sequence[Unit]) -> Dataflow:
    """Walk the autograd graph of ``outputs`` (any nesting of tensors) once.

    A node's *weight path* is a chain of one-input nodes (views, transposes, casts)
    down to one parameter; every other input of a node is *data*, labelled with the
    largest unit whose weights it was computed with. A node that applies a weight of
    unit ``a`` to data labelled ``b > a`` is a crossing.
    """
    unit_of = {id(p): i for i, u in enumerate(units) for p in u.params}
    roots = [t.grad_fn for t in flatten(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    top: Dict[Any, int] = {}  # node -> largest unit its value was computed with (-1: none)
    weight: Dict[Any, Optional[Tuple[int, int]]] = {}  # node -> (unit, id(param)) on a weight path
    first_use: Dict[int, int] = {}
    uses: Dict[int, int] = {}  # id(param) -> how many nodes read it
    found, copied, computed = set(), set(), set()
    changed: Dict[Any, bool] = {}  # weight-path node -> an op other than _PASSES_WEIGHT's lies between it and the leaf
    stack = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if node in top:
            continue
        leaf = leaf_variable(node)
        if leaf is not None:  # a leaf tensor, or the replica a module read (staleopt.replicas)
            u = unit_of.get(id(leaf))
            top[node], weight[node] = (-1, None) if u is None else (u, (u, id(leaf)))
            changed[node] = False
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in top)
            continue
        weights = [weight[c] for c in children if weight[c] is not None]
        data = [top[c] for c in children if weight[c] is None]
        top[node] = max([top[c] for c in children], default=-1)
        weight[node] = weights[0] if len(children) == 1 and weights else None
        if weights and data:
            found.update((w, max(data), pid) for w, pid in weights if max(data) > w)
            if _op(node) not in _READS_NO_INPUT:
                computed.update(weight[c][0] for c in children if weight[c] is not None and changed[c])
        if weight[node] is not None:
            changed[node] = changed[children[0]] or _op(node) not in _PASSES_WEIGHT
            if node.name().startswith("ToCopyBackward"):
                copied.add(weight[node][0])
        for c in children:
            if leaf_variable(c) is not None and weight[c] is not None:
                u, pid = weight[c]
                uses[pid] = uses.get(pid, 0) + 1
                first_use[u] = min(first_use.get(u, math.inf), sequence_nr(node))
    crossings = frozenset((a, b) for a, b, pid in found if uses.get(pid, 0) <= 1)
    index = {id(p): j for u in units for j, p in enumerate(u.params)}
    shared = frozenset((a, b, index[pid]) for a, b, pid in found if uses.get(pid, 0) > 1)
    return Dataflow(first_use, crossings, frozenset(copied), shared, frozenset(computed))


def leaf_variable(node) -> Optional[torch.Tensor]:
    """The tensor a graph node stands for when it ends a walk: an ``AccumulateGrad``'s leaf, or the replica a
    :class:`staleopt.replicas.ReplicaRead` node read (that read belongs to the replica's stage, not to the tied
    parameter behind it); else ``None``."""
    replica = getattr(node, "staleopt_replica", None)
    return replica if replica is not None else getattr(node, "variable", None)


def _cuts_ops(n_units: int, stages: int) -> List[int]:
    base, extra = divmod(n_units, stages)
    sizes = [base + (1 if i < extra else 0) for i in range(stages)]
    return [sum(sizes[:i]) for i in range(1, stages)]


def _cuts_params(sizes: Sequence[int], stages: int) -> List[int]:
    """Cut points minimising the largest stage's parameter count (ties: earlier cuts)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][j]: minimal max-stage size splitting the first j units into k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], arg[k][j] = cost, i
    cuts, j = [], n
    for k in range(stages, 0, -1):
        j = arg[k][j]
        cuts.append(j)
    return sorted(cuts)[1:]


@dataclass
class Partition:
    """The stages of one model. ``repr`` prints a table: stage, units, modules, parameters, bytes."""

    stages: List[Stage]
    units: List[Unit] = field(repr=False)
    #: parameters a stage other than their owner's uses (module docstring); filled by :func:`partition_model`
    shared: List[SharedParameter] = field(default_factory=list, repr=False)
    #: the engine's partition only: the :class:`~staleopt.replicas.Replica` of each tied parameter a later stage
    #: registers, one unit at the end of that stage (:mod:`staleopt.replicas`)
    replicas: List[Any] = field(default_factory=list, repr=False)
    #: the modules ``partition_model``'s example forward called, first call first (empty: none ran, and tied
    #: parameters belong to their first registration, extra registrations sit by registration order)
    module_order: Tuple[str, ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return len(self.stages)

    def __iter__(self):
        return iter(self.stages)

    def __getitem__(self, i: int) -> Stage:
        return self.stages[i]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def cuts(self) -> List[int]:
        """Unit index at which each stage after the first starts (the placement vector)."""
        out, k = [], 0
        for s in self.stages[:-1]:
            k += len(s.units)
            out.append(k)
        return out

    def stage_index(self) -> Dict[int, int]:
        """``id(param) -> stage index`` of every parameter: :meth:`stage_of` for lookups every step."""
        return {id(p): s.index for s in self.stages for p in s.params}

    def stage_of(self, param: torch.Tensor) -> int:
        for s in self.stages:
            if any(p is param for p in s.params):
                return s.index
        raise KeyError("parameter is not in this partition")

    def _unit_stages(self) -> List[Optional[int]]:
        stage_of = {id(u): s.index for s in self.stages for u in s.units}
        return [stage_of.get(id(u)) for u in self.units]

    def shared_in(self, flow: Dataflow) -> List[SharedParameter]:
        """The parameters ``flow`` (of ``self.units``) shows used by a later stage than their owner's."""
        unit_stage = self._unit_stages()
        uses: Dict[Tuple[int, int], set] = {}
        for a, b, j in flow.shared:
            if unit_stage[a] is not None and unit_stage[b] is not None and unit_stage[b] > unit_stage[a]:
                uses.setdefault((a, j), set()).add(b)
        return [SharedParameter(param_name(self.units[a], j), unit_stage[a],
                                tuple((f"the forward pass, on data computed by {self.units[b].name!r}", unit_stage[b])
                                      for b in sorted(bs)))
                for (a, j), bs in sorted(uses.items())]

    def check(self, flow: Dataflow, shared_parameters: str = "error") -> None:
        """Raise :class:`StageOrderError` if ``flow`` (of ``self.units``) shows data going to an earlier stage;
        :class:`SharedParameterError` if it shows a parameter used by a later stage than its owner's (unless
        ``shared_parameters="first-owner"``)."""
        unit_stage = self._unit_stages()
        bad = sorted((a, b) for a, b in flow.crossings
                     if unit_stage[a] is not None and unit_stage[b] is not None and unit_stage[b] > unit_stage[a])
        if bad:
            a, b = bad[0]
            ua, ub = self.units[a], self.units[b]
            if ua.module_type == "Replica" and ub.name.startswith(ua.name + "."):
                raise StageOrderError(
                    f"{ua.name!r} registers a tied weight ({ua.param_names[0]!r}) and applies it to data computed "
                    f"by its own submodule {ub.name!r} (stage {unit_stage[b]}), but its replica of that weight sits "
                    f"where {ua.name!r} is registered, before its submodules (stage {unit_stage[a]}): a module's "
                    "replica cannot follow the module's own children, and ordering by execution does not change "
                    f"that. Move that use into a submodule of {ua.name!r} registered after the others and called "
                    "last (self.out = nn.Linear(d, vocab, bias=False); self.out.weight = <the tied weight>; "
                    "return self.out(h)), or keep the module in one stage (explicit cut points: "
                    "stages=staleopt.partition_model(model, [cuts]))")
            raise StageOrderError(
                f"stage {unit_stage[a]} holds {ua.name!r} ({ua.module_type}), whose weights the forward pass "
                f"applies to data computed by {ub.name!r} ({ub.module_type}) in the later stage "
                f"{unit_stage[b]}: stages follow the order in which modules are registered, and this model "
                f"registers {ua.name!r} before {ub.name!r} but runs it after, so its stages are not contiguous "
                f"in the pipeline. Order the units by execution: stages=staleopt.partition_model(model, "
                f"{self.num_stages}, example_input=x) (staleopt train, RunConfig, compare: unit_order='execution', "
                "--unit-order execution), or register the modules in the order forward runs them")
        if shared_parameters != "first-owner":
            refuse_shared(self.shared_in(flow), self)

    def __repr__(self) -> str:
        rows = [("stage", "units", "modules", "params", "bytes")]
        for s in self.stages:
            mods = s.modules
            shown = mods[0] if len(mods) == 1 else f"{mods[0]} .. {mods[-1]}"
            rows.append((str(s.index), str(len(s.units)), shown, f"{s.numel:,}", f"{s.nbytes:,}"))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        copies = sum(r.tensor.numel() for r in self.replicas)
        lines = [f"Partition({len(self.stages)} stages, {len(self.units)} units, "
                 f"{sum(s.numel for s in self.stages):,} parameters"
                 + (f", {copies:,} of them in {len(self.replicas)} replica(s) of tied weights" if copies else "") + ")"]
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) if c == 2 else v.rjust(w)
                                          for c, (v, w) in enumerate(zip(r, widths))))
        return "\n".join(lines)


def param_name(unit: Unit, j: int) -> str:
    return f"{unit.name}.{unit.param_names[j]}" if unit.param_names else f"{unit.name}[{j}]"


def refuse_shared(shared: Sequence[SharedParameter], partition: Optional["Partition"] = None) -> None:
    """Raise :class:`SharedParameterError` naming ``shared`` (if any) and the ways out (for ``partition``, made in
    registration order, also ordering it by execution)."""
    if shared:
        by_execution = "" if partition is None or partition.module_order else (
            ". If the module that registers the tied weight first runs after its other users (an output layer "
            "registered before the embedding), order the partition by execution: stages=staleopt.partition_model("
            f"model, {partition.num_stages}, example_input=x) (staleopt train, RunConfig, compare: "
            "unit_order='execution') makes the first module the forward calls its owner and gives the others replicas")
        raise SharedParameterError(
            f"{len(shared)} trainable parameter(s) are used by more than one stage: {'; '.join(map(str, shared))}. "
            "A real pipeline holds a copy of such a weight on every stage that uses it, each read at its own "
            "stage's delay; staleopt does the same for a parameter that a module of the later stage registers "
            "(tied weights such as head.weight = tok.weight: staleopt.replicas), but one module object registered "
            "or applied in two stages, or a parameter read directly by a later stage, cannot read two stages' "
            "versions. Register a separate module per use whose weight is the tied one (self.head.weight = "
            "self.tok.weight), put every use in one stage (explicit cut points: stages=staleopt.partition_model("
            "model, [cuts])), untie it (Hugging Face models: config.tie_word_embeddings=False), or accept the "
            "owner's delay at every use with PipelineOptimizer(..., shared_parameters='first-owner')" + by_execution)


@dataclass(frozen=True)
class Registration:
    """``module`` (named ``name``, sitting in ``stage``) registers as ``key`` the parameter ``j`` of ``unit``,
    which a module of another stage owns."""

    name: str
    module: nn.Module
    key: str
    unit: Unit
    j: int
    stage: int

    @property
    def param(self) -> nn.Parameter:
        return self.unit.params[self.j]


def foreign_registrations(model: nn.Module, stages: Sequence[Stage], order: Sequence[str] = ()) -> List[Registration]:
    """Every registration of a trainable parameter by a module (or a second registration of a module) in another
    stage than the unit that owns it: such a module sits in the stage of its own unit, else of the last unit
    before it in the partition's module order (``order``, :attr:`Partition.module_order`; else registration
    order)."""
    owner = {id(p): (u, j) for s in stages for u in s.units for j, p in enumerate(u.params)}
    stage_of = {id(u): s.index for s in stages for u in s.units}
    by_name = {u.name: u for s in stages for u in s.units}
    found, anchor = [], None
    for name, module in _modules_in_order(model, order, remove_duplicate=False):
        mine = by_name.get(_owner(name, module) or "<root>")
        name = name or "<root>"
        if mine is not None and any(p is q for q in module.parameters(recurse=False) for p in mine.params):
            anchor = mine
        else:
            mine = None
        here = 0 if anchor is None else stage_of[id(anchor)]
        for key, p in module._parameters.items():
            u, j = owner.get(id(p), (None, 0))
            if u is not None and u is not mine and here != stage_of[id(u)]:
                found.append(Registration(name, module, key, u, j, here))
    return found


def registered_shared(model: nn.Module, stages: Sequence[Stage], order: Sequence[str] = ()) -> List[SharedParameter]:
    """The parameters :func:`foreign_registrations` finds, each with the places that register it."""
    stage_of = {id(u): s.index for s in stages for u in s.units}
    uses: Dict[Tuple[int, int], Dict[str, int]] = {}
    units: Dict[Tuple[int, int], Tuple[Unit, int]] = {}
    for r in foreign_registrations(model, stages, order):
        uses.setdefault((id(r.unit), r.j), {})[repr(r.name)] = r.stage
        units[(id(r.unit), r.j)] = (r.unit, r.j)
    return [SharedParameter(param_name(*units[k]), stage_of[k[0]], tuple(where.items())) for k, where in uses.items()]


def execution_order(model: nn.Module, units: Sequence[Unit], example_input: Any) -> List[Unit]:
    """``units`` sorted by the first use of their weights in one forward pass on ``example_input``.

    The pass runs in eval mode (no BatchNorm statistics change) with grad enabled, and nothing
    is backpropagated; units the pass does not use keep their registration order, after the rest.
    """
    flow = _probe(model, units, example_input)
    return [units[i] for i in _first_use_order(flow, len(units))]


def _first_use_order(flow: Dataflow, n: int) -> List[int]:
    """The indices of ``n`` units by the first use of their weights in ``flow``; unused ones last, in order."""
    return sorted(range(n), key=lambda i: (flow.first_use.get(i, math.inf), i))


def _run_example(model: nn.Module, example_input: Any) -> Tuple[Any, Tuple[str, ...]]:
    """One forward pass on ``example_input`` in eval mode, grad enabled: its outputs, and the names of the
    modules it called, first call first (:attr:`Partition.module_order`)."""
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    names = {id(m): n for n, m in model.named_modules()}
    called: Dict[int, None] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a: called.setdefault(id(m))) for m in model.modules()]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.enable_grad():
            return model(*args), tuple(names[k] for k in called)
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes:
            m.training = training


def _probe(model: nn.Module, units: Sequence[Unit], example_input: Any) -> Dataflow:
    """The :class:`Dataflow` of one forward pass on ``example_input`` in eval mode, grad enabled."""
    return dataflow(_run_example(model, example_input)[0], units)


def partition_model(model: nn.Module, stages: Union[int, str, Sequence[int]], strategy: str = "ops",
                    example_input: Any = None) -> Partition:
    """Split ``model`` into stages.

    ``stages`` is a stage count ``P`` (with ``strategy`` "ops" or "params"), ``"max"`` (one stage per
    parametrized operator, as in :func:`staleopt.compare` and sweep files), or a list of
    cut points (unit indices where stages 1..P-1 begin, strictly increasing). Units are in
    registration order, or, given ``example_input`` (a tensor or a tuple of forward
    arguments), in the order one forward pass on it first uses them (:func:`execution_order`); then a
    parameter several modules register (tied weights) belongs to the first of them the pass calls, and
    the others read a replica in their own stage (:mod:`staleopt.replicas`), whatever their
    registration order.
    :attr:`Partition.shared` lists the parameters a stage other than their owner's uses (from the
    registrations, and from that forward pass).
    """
    units = units_of(model)
    used_late = frozenset()  # (a, b, j) of Dataflow.shared, as indices into the (reordered) units
    module_order: Tuple[str, ...] = ()
    if example_input is not None and units:
        outputs, module_order = _run_example(model, example_input)
        units = units_of(model, module_order)  # again: a tied weight's owner is the module called first
        flow = dataflow(outputs, units)
        order = _first_use_order(flow, len(units))
        position = {old: new for new, old in enumerate(order)}
        units = [units[i] for i in order]
        used_late = frozenset((position[a], position[b], j) for a, b, j in flow.shared)
    n = len(units)
    if n == 0:
        raise StageError("the model has no trainable parameters: nothing to pipeline "
                         "(check requires_grad, or pass the model whose weights you train)")
    if isinstance(stages, str) and stages == "max":
        stages = n
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple)):
        raise StageError(f"stages must be an int (number of stages), \"max\" (one per parametrized operator, {n} "
                         f"here) or a list of cut points, got {stages!r}")
    if isinstance(stages, int):
        if stages < 1 or stages > n:
            raise StageError(f"stages={stages} is out of range: this model has {n} parametrized "
                             f"operators, so use 1 <= stages <= {n}")
        if strategy == "ops":
            cuts = _cuts_ops(n, stages)
        elif strategy == "params":
            cuts = _cuts_params([u.numel for u in units], stages)
        else:
            raise StageError(f"unknown partition strategy {strategy!r}: use 'ops', 'params', "
                             "or pass a list of cut points as stages")
    else:
        cuts = list(stages)
        for c in cuts:
            check_int("cut point", c, why=f"cut points {cuts!r}", error=StageError)
        if any(b <= a for a, b in zip([0] + cuts, cuts + [n])):
            raise StageError(f"cut points {cuts} must be strictly increasing within 1..{n - 1} "
                             f"(this model has {n} parametrized operators)")
    bounds = [0] + cuts + [n]
    part = Partition([Stage(i, tuple(units[bounds[i]:bounds[i + 1]])) for i in range(len(bounds) - 1)], units,
                     module_order=module_order)
    found = {sp.name: sp for sp in registered_shared(model, part.stages, module_order)}
    for sp in part.shared_in(Dataflow({}, frozenset(), frozenset(), used_late)):
        found[sp.name] = SharedParameter(sp.name, sp.stage, (found[sp.name].uses if sp.name in found else ())
                                         + sp.uses)
    part.shared = list(found.values())
    return part
