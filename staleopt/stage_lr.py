"""Per-stage step sizes (T1) over the base optimizer's parameter groups, keeping the optimizer's group state."""
from __future__ import annotations

import copy
import operator
from typing import Dict, List, Optional, Tuple

import torch

from .errors import OptimizerMismatchError

__all__ = ["StageGroups", "stepping_optimizers"]


def _inner(obj) -> List[torch.optim.Optimizer]:
    """The optimizers held by ``obj``'s attributes (directly or in a list, tuple or dict)."""
    found = []
    for value in vars(obj).values():
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        found += [v for v in values if isinstance(v, torch.optim.Optimizer) and v is not obj]
    return found


def stepping_optimizers(base: torch.optim.Optimizer) -> List[torch.optim.Optimizer]:
    """``base`` and every optimizer it wraps (timm's ``Lookahead``, accelerate's ``AcceleratedOptimizer``,
    ...), recursively: the ones whose ``param_groups`` the per-stage groups must replace for a step.

    A wrapped optimizer must step the same group dicts as ``base`` (the same list, or a list of the same
    dicts), else per-stage step sizes set in ``base``'s groups would not reach it:
    :class:`~staleopt.errors.OptimizerMismatchError`.
    """
    out, todo = [base], _inner(base)
    while todo:
        opt = todo.pop()
        if any(opt is o for o in out):
            continue
        mine, theirs = base.param_groups, opt.param_groups
        if not (mine is theirs or (len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs)))):
            raise OptimizerMismatchError(
                f"{type(base).__name__} wraps a {type(opt).__name__} that steps parameter groups of its own, so "
                "per-stage step sizes (T1: pipemare, pipemare-t1, staleness-aware, ...) set in the wrapper's "
                f"groups would not reach the optimizer that updates the weights: wrap the {type(opt).__name__} "
                f"itself, or use a method without per-stage step sizes")
        out.append(opt)
        todo += _inner(opt)
    refuse_compiled(out)
    return out


def refuse_compiled(optimizers: List[torch.optim.Optimizer]) -> None:
    """:class:`~staleopt.errors.OptimizerMismatchError` where one of ``optimizers`` has a ``torch.compile``d
    ``step``: dynamo cannot trace it over the per-stage groups (:class:`_Group`, a dict subclass: torch raised an
    internal error in the middle of the wrapper's step), and T1's ``lr`` changes at every step, a recompile each."""
    for opt in optimizers:
        step = getattr(opt, "step", None)
        if step is not None and hasattr(step, "_torchdynamo_orig_callable") and \
                not getattr(step, "_torchdynamo_disable", False):
            raise OptimizerMismatchError(
                f"the {type(opt).__name__}'s step is torch.compile'd, which per-stage step sizes (T1: pipemare, "
                "pipemare-t1, staleness-aware, ...) cannot step through (their per-stage parameter groups, and an lr "
                "that changes at every step): leave the base optimizer's step uncompiled (compile the model), or "
                "use a method without per-stage step sizes")


class _Group(dict):
    """A parameter group the base optimizer steps (per stage, or per distinct factor): a dict that notes any
    write to itself in ``written``, a cell shared by all groups of one :class:`StageGroups`, so that finding out
    whether a step wrote a group key costs one read instead of a look at every value. :class:`StageGroups`
    writes through ``dict``'s own methods, which note nothing."""

    __slots__ = ("written",)

    def __init__(self, items: dict, written: list):
        dict.__init__(self, items)
        self.written = written

    def _wrote(self) -> None:
        written = getattr(self, "written", None)  # (unset while copy or pickle rebuilds the dict)
        if written is not None:
            written[0] = True

    def __setitem__(self, key, value):
        self._wrote()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        self._wrote()
        dict.__delitem__(self, key)

    def __ior__(self, other):
        self._wrote()
        dict.update(self, other)
        return self

    def setdefault(self, key, default=None):
        if key not in self:
            self._wrote()
        return dict.setdefault(self, key, default)

    def update(self, *args, **kwargs):
        self._wrote()
        dict.update(self, *args, **kwargs)

    def pop(self, *args):
        self._wrote()
        return dict.pop(self, *args)

    def popitem(self):
        self._wrote()
        return dict.popitem(self)

    def clear(self):
        self._wrote()
        dict.clear(self)


class _Split:
    """One base-optimizer group of a stage: ``group`` is stepped, ``own`` are the keys the optimizer wrote."""

    __slots__ = ("user", "stage", "group", "own", "shown")

    def __init__(self, user: dict, stage: int, params: list, shown: dict, written: list):
        self.user, self.stage, self.own, self.shown = user, stage, set(), shown
        self.group = _Group({**user, "params": params}, written)


class StageGroups:
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

    An optimizer that wraps another (timm's ``Lookahead``) steps its inner optimizer's groups: the
    per-stage groups replace the groups of every optimizer in the chain for the step
    (:func:`stepping_optimizers`), so the inner one steps them with the stage's ``lr`` and the
    wrapper's own keys (``lookahead_step``) live on in them as own keys.

    Whether a step wrote a group key is noted by the groups themselves (:class:`_Group`), and while no key
    became own and the user's groups hold the same values (but ``lr``) as at the last step, only ``lr`` is set
    in the stepped groups: per step, a stage costs the base optimizer's own work on its group and one ``lr``.

    While no group has own keys, the stages of a user group whose factors are equal step as one group
    (as many groups as distinct factors, not stages: a foreach optimizer's launches per step follow the
    distinct delays, and a torch optimizer's arithmetic per tensor does not depend on which tensors
    share its group, so the result is the same bit for bit). A key such a step writes becomes the own
    key of each of its stages, which step apart from then on.
    """

    def __init__(self, stage_of: Dict[int, int]):
        self._stage_of = stage_of
        self._users: List[dict] = []
        self._lists: List[Tuple[list, int]] = []  # each user group's params list and its length when split
        self._splits: List[_Split] = []
        self._own = False
        self._stepped: Optional[List[dict]] = None  # the group list the base optimizer steps over
        self._merged: Dict[tuple, Tuple[List[dict], List[List[_Split]]]] = {}  # factor pattern -> groups, members
        self._driven: Optional[tuple] = None  # (base, its stepping optimizers, their group lists and lengths)
        self._last: Optional[tuple] = None  # (splits, factors, merged) of the latest _merge
        self._written = [False]  # a stepped group was written (by the base optimizer: _Group)
        self._values: Optional[tuple] = None  # (merged, the user groups' values but lr) the merged groups hold

    def _sync(self, groups: List[dict]) -> List[_Split]:
        """Splits of ``groups``, reusing those of user groups seen before (same dict object) whose ``params`` are
        the same list of the same length (as :meth:`Correction.group_of <staleopt.corrections.base.Correction.
        group_of>`: a list replaced or grown between steps is split again; the step trained the old one)."""
        if len(groups) == len(self._users) and all(a is b and a["params"] is ps and len(ps) == n
                                                   for a, b, (ps, n) in zip(groups, self._users, self._lists)):
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
            splits += [_Split(group, s, ps, shown, self._written) for s, ps in self._by_stage(group)]
        self._users, self._splits = list(groups), splits
        self._lists = [(g["params"], len(g["params"])) for g in groups]
        self._own = any(sp.own for sp in splits)
        self._merged, self._values = {}, None
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
        if self._own:
            for sp in splits:
                g, own, user = sp.group, sp.own, sp.user
                for k, v in user.items():
                    if k != "params" and (k not in own or v is not sp.shown.get(k)):
                        dict.__setitem__(g, k, v)
                dict.__setitem__(g, "lr", user["lr"] * (factors[sp.stage] if sp.stage >= 0 else 1.0))
            stepped, members = [sp.group for sp in splits], [[sp] for sp in splits]
        else:
            stepped, members = self._merge(splits, factors)
        if self._stepped is None or len(self._stepped) != len(stepped) or \
                any(a is not b for a, b in zip(self._stepped, stepped)):
            self._stepped = stepped
        driven = self._drive(base)
        self._written[0] = False
        before = [o.param_groups for o in driven]
        for o in driven:
            o.param_groups = self._stepped
        try:
            base.step()
        finally:
            for o, g in zip(reversed(driven), reversed(before)):
                o.param_groups = g
        if not self._written[0]:
            return  # the step wrote no group key (torch's SGD, Adam, ...): nothing becomes own
        self._values = None  # (the merged groups no longer hold just the user's values)
        shown = set()
        for group, sps in zip(stepped, members):  # a key the step wrote (not the value set from the user's
            for k, v in group.items():           # group) becomes own, in each stage the group stepped
                if k == "lr" or k == "params":
                    continue
                for n, sp in enumerate(sps):
                    if k not in sp.own and (k not in sp.user or sp.user[k] is not v):
                        sp.own.add(k)
                        dict.__setitem__(sp.group, k, v if n == 0 else copy.deepcopy(v))  # (updated in place)
                        self._own = True
        for sp in splits:
            if sp.own and id(sp.shown) not in shown:  # the first stage of a user group shows its own keys
                shown.add(id(sp.shown))
                for k in sp.own:
                    sp.user[k] = sp.shown[k] = sp.group[k]

    def _drive(self, base: torch.optim.Optimizer) -> List[torch.optim.Optimizer]:
        """:func:`stepping_optimizers` of ``base``, found again when one of them holds another group list or
        another number of groups (``add_param_group``) than at the last step."""
        seen = self._driven
        if seen is None or seen[0] is not base or \
                any(o.param_groups is not g or len(g) != n for o, g, n in zip(seen[1], seen[2], seen[3])):
            driven = stepping_optimizers(base)
            groups = [o.param_groups for o in driven]
            seen = self._driven = (base, driven, groups, [len(g) for g in groups])
        return seen[1]

    def _merge(self, splits: List[_Split], factors: List[float]) -> Tuple[List[dict], List[List[_Split]]]:
        """One group per (user group, distinct factor) and the stages it steps; the groups persist while the
        pattern of equal factors does (T1's factors are a function of the delays: a fixed pattern)."""
        key_f = tuple(factors)
        last = self._last
        if last is not None and last[0] is splits and last[1] == key_f:
            merged = last[2]
        else:
            classes: Dict[tuple, int] = {}
            pattern = []
            for sp in splits:
                f = factors[sp.stage] if sp.stage >= 0 else 1.0
                pattern.append(classes.setdefault((id(sp.user), f), len(classes)))
            key = tuple(pattern)
            merged = self._merged.get(key)
            if merged is None:
                if len(self._merged) >= 16:  # random delays (Hogwild) draw ever new patterns
                    self._merged.clear()
                members: List[List[_Split]] = [[] for _ in classes]
                for sp, c in zip(splits, pattern):
                    members[c].append(sp)
                groups = [_Group({"params": [p for sp in sps for p in sp.group["params"]]}, self._written)
                          for sps in members]
                merged = self._merged[key] = (groups, members)
            self._last = (splits, key_f, merged)
        groups, members = merged
        values = tuple([v for u in self._users for k, v in u.items() if k != "lr"])  # (compared by identity)
        held = self._values
        if held is None or held[0] is not merged or len(held[1]) != len(values) or \
                not all(map(operator.is_, held[1], values)):
            for g, sps in zip(groups, members):
                params = g["params"]
                dict.update(g, sps[0].user)  # every key from the user's group but the parameters
                dict.__setitem__(g, "params", params)
            self._values = (merged, values)
        for g, sps in zip(groups, members):
            dict.__setitem__(g, "lr", sps[0].user["lr"] * (factors[sps[0].stage] if sps[0].stage >= 0 else 1.0))
        return merged

    def state(self, groups: List[dict]) -> List[dict]:
        """Every stage group's own keys (empty dicts while the optimizer writes no group state)."""
        return [{k: sp.group[k] for k in sorted(sp.own)} for sp in self._sync(groups)]

    def check_state(self, groups: List[dict], state: List[dict]) -> None:
        """:class:`~staleopt.errors.OptimizerMismatchError` where :meth:`load_state` cannot load ``state`` (empty:
        a checkpoint without group state, loads as such)."""
        n = len(self._sync(groups))
        if state and len(state) != n:
            raise OptimizerMismatchError(f"the checkpoint has {len(state)} per-stage parameter groups but this "
                                         f"optimizer has {n}: rebuild it with the same parameter groups")

    def load_state(self, groups: List[dict], state: List[dict]) -> None:
        self.check_state(groups, state)
        splits = self._sync(groups)
        state = state or [{} for _ in splits]
        self._values = None
        for sp, own in zip(splits, state):
            sp.own = set(own)
            dict.update(sp.group, own)
            for k in own:
                sp.shown[k] = sp.user.get(k)
        self._own = any(sp.own for sp in splits)
