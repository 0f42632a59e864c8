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
parameters (``requires_grad=False``) are excluded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._torch_compat import flatten, sequence_nr
from .errors import StageError, StageOrderError
from .validate import check_int

__all__ = ["Unit", "Stage", "Partition", "Dataflow", "units_of", "dataflow", "execution_order", "partition_model"]


@dataclass(frozen=True)
class Unit:
    """One parametrized operator: a module name and the trainable parameters it owns directly."""

    name: str
    module_type: str
    params: tuple  # of nn.Parameter

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


def units_of(model: nn.Module) -> List[Unit]:
    """The model's parametrized operators in registration order (tied and frozen parameters handled)."""
    seen = set()
    units = []
    for name, module in model.named_modules():
        own = []
        for p in module.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                own.append(p)
        if own:
            units.append(Unit(name or "<root>", type(module).__name__, tuple(own)))
    return units


@dataclass(frozen=True)
class Dataflow:
    """What the autograd graph of one forward pass says about a list of units (indices into it).

    ``first_use``: unit -> creation order of the first graph node that reads its weights.
    ``crossings``: pairs ``(a, b)``, ``b > a``: a weight of unit ``a`` is applied to data computed
    with the weights of unit ``b`` (weights used more than once, e.g. tied embeddings, are left out).
    ``copied``: units whose weights the graph reads through a copy (autocast's casts, ``.to(dtype)``).
    """

    first_use: Dict[int, int]
    crossings: FrozenSet[Tuple[int, int]]
    copied: FrozenSet[int]


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
    found, copied = set(), set()
    stack = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if node in top:
            continue
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf tensor
            u = unit_of.get(id(node.variable))
            top[node], weight[node] = (-1, None) if u is None else (u, (u, id(node.variable)))
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
        if weight[node] is not None and node.name().startswith("ToCopyBackward"):
            copied.add(weight[node][0])
        for c in children:
            if hasattr(c, "variable") and weight[c] is not None:
                u, pid = weight[c]
                uses[pid] = uses.get(pid, 0) + 1
                first_use[u] = min(first_use.get(u, math.inf), sequence_nr(node))
    crossings = frozenset((a, b) for a, b, pid in found if uses.get(pid, 0) <= 1)
    return Dataflow(first_use, crossings, frozenset(copied))


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

    def stage_of(self, param: torch.Tensor) -> int:
        for s in self.stages:
            if any(p is param for p in s.params):
                return s.index
        raise KeyError("parameter is not in this partition")

    def check(self, flow: Dataflow) -> None:
        """Raise :class:`StageOrderError` if ``flow`` (of ``self.units``) shows data going to an earlier stage."""
        stage_of = {}
        for s in self.stages:
            for u in s.units:
                stage_of[id(u)] = s.index
        unit_stage = [stage_of.get(id(u)) for u in self.units]
        bad = sorted((a, b) for a, b in flow.crossings
                     if unit_stage[a] is not None and unit_stage[b] is not None and unit_stage[b] > unit_stage[a])
        if bad:
            a, b = bad[0]
            ua, ub = self.units[a], self.units[b]
            raise StageOrderError(
                f"stage {unit_stage[a]} holds {ua.name!r} ({ua.module_type}), whose weights the forward pass "
                f"applies to data computed by {ub.name!r} ({ub.module_type}) in the later stage "
                f"{unit_stage[b]}: stages follow the order in which modules are registered, and this model "
                f"registers {ua.name!r} before {ub.name!r} but runs it after, so its stages are not contiguous "
                f"in the pipeline. Order the units by execution: stages=staleopt.partition_model(model, "
                f"{self.num_stages}, example_input=x) (or register the modules in the order forward runs them)")

    def __repr__(self) -> str:
        rows = [("stage", "units", "modules", "params", "bytes")]
        for s in self.stages:
            mods = s.modules
            shown = mods[0] if len(mods) == 1 else f"{mods[0]} .. {mods[-1]}"
            rows.append((str(s.index), str(len(s.units)), shown, f"{s.numel:,}", f"{s.nbytes:,}"))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        lines = [f"Partition({len(self.stages)} stages, {len(self.units)} units, "
                 f"{sum(s.numel for s in self.stages):,} parameters)"]
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) if c == 2 else v.rjust(w)
                                          for c, (v, w) in enumerate(zip(r, widths))))
        return "\n".join(lines)


def execution_order(model: nn.Module, units: Sequence[Unit], example_input: Any) -> List[Unit]:
    """``units`` sorted by the first use of their weights in one forward pass on ``example_input``.

    The pass runs in eval mode (no BatchNorm statistics change) with grad enabled, and nothing
    is backpropagated; units the pass does not use keep their registration order, after the rest.
    """
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.enable_grad():
            flow = dataflow(model(*args), units)
    finally:
        for m, training in modes:
            m.training = training
    order = sorted(range(len(units)), key=lambda i: (flow.first_use.get(i, math.inf), i))
    return [units[i] for i in order]


def partition_model(model: nn.Module, stages: Union[int, Sequence[int]], strategy: str = "ops",
                    example_input: Any = None) -> Partition:
    """Split ``model`` into stages.

    ``stages`` is a stage count ``P`` (with ``strategy`` "ops" or "params") or a list of
    cut points (unit indices where stages 1..P-1 begin, strictly increasing). Units are in
    registration order, or, given ``example_input`` (a tensor or a tuple of forward
    arguments), in the order one forward pass on it first uses them (:func:`execution_order`).
    """
    units = units_of(model)
    if example_input is not None and units:
        units = execution_order(model, units, example_input)
    n = len(units)
    if n == 0:
        raise StageError("the model has no trainable parameters: nothing to pipeline "
                         "(check requires_grad, or pass the model whose weights you train)")
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple)):
        raise StageError(f"stages must be an int (number of stages) or a list of cut points, got {stages!r}")
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
    return Partition([Stage(i, tuple(units[bounds[i]:bounds[i + 1]])) for i in range(len(bounds) - 1)], units)
