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

Shared (tied) parameters belong to their first owner and appear once; frozen
parameters (``requires_grad=False``) are excluded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Union

import torch
from torch import nn

from .errors import StageError

__all__ = ["Unit", "Stage", "Partition", "units_of", "partition_model"]


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


def partition_model(model: nn.Module, stages: Union[int, Sequence[int]], strategy: str = "ops") -> Partition:
    """Split ``model`` into stages.

    ``stages`` is a stage count ``P`` (with ``strategy`` "ops" or "params") or a list of
    cut points (unit indices where stages 1..P-1 begin, strictly increasing).
    """
    units = units_of(model)
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
        if any(isinstance(c, bool) or not isinstance(c, int) for c in cuts):
            raise StageError(f"cut points must be ints, got {cuts!r}")
        if any(b <= a for a, b in zip([0] + cuts, cuts + [n])):
            raise StageError(f"cut points {cuts} must be strictly increasing within 1..{n - 1} "
                             f"(this model has {n} parametrized operators)")
    bounds = [0] + cuts + [n]
    return Partition([Stage(i, tuple(units[bounds[i]:bounds[i + 1]])) for i in range(len(bounds) - 1)], units)
