"""Stability advisor: PipeMare's quadratic-model bound applied to a real model, stage by stage.

For each pipeline stage ``i`` the advisor

1. estimates the stage's curvature ``lam_i``: the largest eigenvalue of the
   Hessian block ``H_ii`` of the loss on one batch, restricted to the stage's
   parameters, by seeded power iteration on Hessian-vector products;
2. turns it into the largest stable step size for the stage's forward delay
   ``tau_i``: PipeMare Lemma 1, ``(2/lam_i) sin(pi/(4 tau_i + 2))`` (exact for
   the delayed quadratic), or with momentum ``beta`` the first unstable step
   size of the heavy-ball companion matrix (App. B.2,
   :func:`staleopt.theory.max_stable_lr`), or, for a method whose correction
   holds Nesterov momentum (:class:`~staleopt.corrections.NesterovLookahead`:
   ``pipemare-stash-nesterov``), that of the look-ahead's companion matrix at
   the stage's ``gamma_i``;
3. compares it with the step size the stage actually gets: ``lr`` times the
   method's per-stage factors (T1's ``1/tau_i^{p_k}``, PipeMare eq. 4, at T1
   step ``k``).

What the model leaves out: coupling between stages (``H_ij``, ``i != j``),
forward/backward discrepancy (the sensitivities ``Delta`` and ``Phi`` of a real
network are unknown, so T2, ``tau_bkwd`` and ``tau_recomp`` do not enter; the
table shows them, ``tau_recomp`` for methods that recompute ahead of the
backward, with the convention of :mod:`staleopt.theory` and the executed
timeline), weight prediction, the gradient rewrites of DC-ASGD and Gap-Aware, and
adaptive optimizers (the bound is for SGD with heavy-ball momentum, which is
``torch.optim.SGD(momentum=beta, dampening=0)`` with ``alpha = lr``). When the
Hessian is block diagonal and the loss quadratic, the bound is exact.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import pandas as pd
import torch
from torch import nn

from . import methods, theory
from .corrections import LRReschedule, NesterovLookahead
from .errors import ConfigError
from .partition import Partition, partition_model
from .validate import check_fraction, check_int

__all__ = ["Advice", "Curvature", "advise", "hessian_top_eigenvalue", "stage_curvatures"]


class Curvature(NamedTuple):
    """A top-eigenvalue estimate: ``value``, whether power iteration ``converged``, Hessian-vector ``products`` used."""

    value: float
    converged: bool
    products: int


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(a, b))


def _power(op: Callable, v: List[torch.Tensor], iters: int, tol: float) -> Tuple[float, bool, float, int]:
    """Power iteration on ``op`` from unit vector ``v``.

    Stops when ``v`` is an eigenvector to within ``||op(v) - mu v|| <= sqrt(tol) ||op(v)||``
    (then the Rayleigh quotient ``mu`` is off by about ``tol``, relative) or
    after ``iters`` products. Returns ``mu``, whether it stopped on the
    residual, the largest ``||op(v)||`` seen (a lower estimate of the
    spectral radius) and the number of products.
    """
    mu, norm_max = 0.0, 0.0
    for k in range(1, iters + 1):
        hv = op(v)
        mu = float(_dot(v, hv))
        norm = float(torch.sqrt(_dot(hv, hv)))
        norm_max = max(norm_max, norm)
        if norm == 0.0:
            return 0.0, True, 0.0, k
        res = [h - mu * x for h, x in zip(hv, v)]
        if float(torch.sqrt(_dot(res, res))) <= tol ** 0.5 * norm:
            return mu, True, norm_max, k
        v = [x / norm for x in hv]
    return mu, False, norm_max, iters


def hessian_top_eigenvalue(loss: torch.Tensor, params: Sequence[torch.Tensor], iters: int = 50,
                           tol: float = 1e-5, seed: int = 0) -> Curvature:
    """Largest (algebraic) eigenvalue of ``d^2 loss / d params^2`` by power iteration on Hessian-vector products.

    ``v -> H v`` is ``autograd.grad(grad(loss) . v)``; the start vector is
    Gaussian from a CPU generator seeded with ``seed``. A run stops when its
    vector is an eigenvector to relative accuracy ``sqrt(tol)`` (the Rayleigh
    quotient, which approaches the eigenvalue from below, is then accurate to
    about ``tol``) or after ``iters`` products. When that run ends negative or
    unconverged (the dominant eigenvalue is negative, or ``+-rho`` compete, as
    in indefinite Hessians), a second run on ``H + s I`` with
    ``s = 1.05 x`` the first run's spectral-radius estimate (positive
    semidefinite, dominant eigenvalue ``lam_max + s``) returns ``nu - s``; if
    that run does not converge either (eigenvalues clustered near the top),
    ``converged`` is False and ``value`` is only a lower bound.
    ``loss``'s graph must still be alive (it is retained).
    """
    check_int("iters", iters, 1, why="Hessian-vector products per power-iteration run")
    check_fraction("tol", tol)
    params = list(params)
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None and g.requires_grad]
    if not pairs:
        return Curvature(0.0, True, 0)  # the loss is at most linear in these parameters
    ps, gs = [p for p, _ in pairs], [g for _, g in pairs]
    gen = torch.Generator().manual_seed(int(seed))
    v = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=p.device, dtype=p.dtype) for p in ps]
    n = float(torch.sqrt(_dot(v, v)))
    v = [x / n for x in v]

    def hvp(vec):
        out = torch.autograd.grad(gs, ps, grad_outputs=vec, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if h is None else h.detach() for p, h in zip(ps, out)]

    mu, converged, rho, k = _power(hvp, v, iters, tol)
    if converged and mu >= 0.0:
        return Curvature(mu, True, k)
    shift = 1.05 * max(rho, abs(mu))
    nu, converged, _, k2 = _power(lambda vec: [h + shift * x for h, x in zip(hvp(vec), vec)], v, iters, tol)
    # both are Rayleigh quotients of H, lower bounds on lam_max: the larger is the better estimate (an unconverged
    # shifted run can end below the first run's)
    return Curvature(max(nu - shift, mu), converged, k + k2)


def _check_batch(batch):
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ConfigError("batch must be an (inputs, targets) pair; the loss is loss_fn(model(inputs), targets)")
    return batch


def stage_curvatures(model: nn.Module, loss_fn: Callable, batch, partition: Partition, iters: int = 50,
                     tol: float = 1e-5, seed: int = 0) -> List[Curvature]:
    """Top Hessian eigenvalue of ``loss_fn(model(x), y)`` restricted to each stage's parameters.

    ``batch = (x, y)``; stage ``i``'s power iteration is seeded with ``seed + i``.
    """
    return _curvatures(model, loss_fn, batch, [stage.params for stage in partition], iters, tol, seed)


def _curvatures(model: nn.Module, loss_fn: Callable, batch, groups: List[List[torch.Tensor]], iters: int, tol: float,
                seed: int) -> List[Curvature]:
    """:func:`stage_curvatures` of the parameter lists ``groups`` (stage ``i``'s seeded with ``seed + i``)."""
    x, y = _check_batch(batch)
    loss = loss_fn(model(x), y)
    if loss.dim() != 0:
        raise ConfigError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)} (use reduction='mean')")
    return [hessian_top_eigenvalue(loss, params, iters, tol, seed + i) for i, params in enumerate(groups)]


@dataclass
class Advice:
    """What :func:`advise` found: ``table`` (a pandas DataFrame, one row per stage) and the inputs.

    Columns: ``stage``, ``params``, ``tau_fwd``, ``tau_bkwd`` (and ``tau_recomp``
    for a method that recomputes ahead of the backward), ``curvature``
    (top Hessian eigenvalue of the stage), ``max_stable_lr`` (quadratic-model
    bound for that curvature and ``tau_fwd``), ``lr_factor`` (the method's
    per-stage multiplier, e.g. T1's), ``effective_lr = lr * lr_factor``,
    ``headroom = max_stable_lr / effective_lr``, ``exceeds``
    (``effective_lr >= max_stable_lr``) and ``converged`` (False: the power
    iteration ran out of ``iters``; the curvature is then a lower bound and
    the stage's bound optimistic).
    """

    table: "object"
    method: str
    lr: float
    momentum: float
    step: int

    @property
    def nesterov(self) -> bool:
        """The method's correction holds Nesterov momentum: the table has its ``momentum`` per stage."""
        return "momentum" in self.table.columns

    @property
    def stable(self) -> bool:
        """No stage exceeds its bound."""
        return not bool(self.table["exceeds"].any())

    @property
    def max_lr(self) -> float:
        """The largest base ``lr`` that keeps every stage below its bound: ``min_i max_stable_lr_i / lr_factor_i``."""
        return float((self.table["max_stable_lr"] / self.table["lr_factor"]).min())

    def __str__(self) -> str:
        bound = ("Nesterov look-ahead companion matrix, the stage's momentum" if self.nesterov else "Lemma 1"
                 if self.momentum == 0 else f"momentum companion matrix, beta={self.momentum:g}")
        t = self.table.copy()
        for c in ("curvature", "max_stable_lr", "lr_factor", "effective_lr", "headroom"):
            t[c] = t[c].map(lambda v: f"{v:.4g}")
        lines = [f"stability advice: method={self.method}, lr={self.lr:g}, T1 step k={self.step} "
                 f"(quadratic model, {bound})", t.to_string(index=False)]
        bad = [int(s) for s in self.table.loc[self.table["exceeds"], "stage"]]
        verdict = (f"lr={self.lr:g} exceeds the bound of stage(s) {', '.join(map(str, bad))}: expect divergence"
                   if bad else f"lr={self.lr:g} is below every stage's bound")
        lines.append(f"{verdict}; largest stable lr: {self.max_lr:.4g}")
        loose = [int(s) for s in self.table.loc[~self.table["converged"], "stage"]]
        if loose:
            lines.append(f"note: the curvature of stage(s) {', '.join(map(str, loose))} did not converge "
                         "(a lower bound); raise iters for a firmer bound")
        return "\n".join(lines)

    def _repr_html_(self) -> str:  # notebooks
        return f"<pre>{self.__str__()}</pre>"


def advise(model: nn.Module, loss_fn: Callable, batch, method: Union[str, object], stages: Union[int, Partition],
           microbatches: int = 1, lr: float = 0.1, momentum: float = 0.0, *, step: int = 0,
           partition: str = "ops", method_args: Optional[dict] = None, iters: int = 30, tol: float = 1e-4,
           seed: int = 0) -> Advice:
    """Per-stage stability check of ``lr`` for ``method`` on ``model`` (module docstring).

    Args:
        model, loss_fn, batch: the loss is ``loss_fn(model(inputs), targets)`` with
            ``batch = (inputs, targets)``; its Hessian is taken at the model's current weights.
        method: a method or schedule name (``"pipemare"``, ``"1f1b"``, ...), a Schedule, or a
            :class:`~staleopt.methods.Pipeline` built for the partition's stage count.
        stages: a stage count or a :class:`~staleopt.partition.Partition`.
        microbatches: ``N``, enters the delay formulas.
        lr: the base step size (what the lr scheduler sets); ``momentum``: heavy-ball ``beta`` (0 for a method
            whose correction holds the momentum, :class:`~staleopt.corrections.NesterovLookahead`: its ``gamma_i``
            is used, with the look-ahead's bound).
        step: T1 step ``k`` at which the lr factors are taken (0: the start, factor ``1/tau``).
        method_args: a method's hyperparameters, e.g. ``{"anneal_steps": 500}``.
        iters, tol, seed: power iteration (per stage, seeded ``seed + i``).

    Example::

        advice = staleopt.advise(model, nn.functional.cross_entropy, (x, y), "pipemare", stages=8, lr=0.1)
        print(advice)            # table + verdict
        advice.max_lr            # largest base lr every stage tolerates
    """
    if not (float(lr) > 0.0 and math.isfinite(float(lr))):
        raise ConfigError(f"lr must be a finite number > 0, got {lr!r}")
    if not 0.0 <= float(momentum) <= 1.0:
        raise ConfigError(f"momentum must lie in [0, 1] (heavy-ball beta), got {momentum!r}")
    check_int("step", step, minimum=0, why="T1's step counter k")
    check_int("iters", iters, 1, why="Hessian-vector products per power-iteration run")
    check_fraction("tol", tol)
    part = stages if isinstance(stages, Partition) else partition_model(model, stages, partition)
    P = part.num_stages
    pipeline = methods.build(method, P, microbatches, **(method_args or {}))
    tf, tb = pipeline.delays                    # the asynchronous phase's, after the method's corrections
    tr, recomputes = pipeline.recompute_delays, bool(pipeline.schedule.segments(P))
    factors = pipeline.asynchronous_lr_factors(step)
    if step and factors == pipeline.asynchronous_lr_factors(0) \
            and not any(isinstance(c, LRReschedule) for c in pipeline.corrections):
        raise ConfigError(f"step is the step counter of T1's lr rescheduling, which method {pipeline.name!r} does "
                          f"not have, so step = {step} would change nothing: leave it out, or pick a method with T1")
    held = [k for k in pipeline.corrections if isinstance(k, NesterovLookahead)]
    if held and momentum:
        raise ConfigError(f"method {pipeline.name!r} holds Nesterov momentum in its correction ({held[0]!r}), to be "
                          f"used over SGD without momentum; momentum={momentum!r} would add heavy-ball momentum on "
                          "top: leave momentum=0 (the advisor takes the correction's gamma per stage)")
    gammas = held[0].stage_momenta(list(tf)) if held else None
    # Measure on a copy: the model's buffers (BatchNorm statistics) stay untouched, and a
    # PipelineOptimizer's hooks, inert in copies, do not swap stale views in (curvature at w_t).
    # Each stage's parameters found on the copy by name: a partition's cut points index its own unit order, which
    # for one made in execution order (example_input) is not the registration order a new partition would take.
    # (A replica of a tied parameter is no parameter of the model: its owner stage measures that matrix.)
    probe = copy.deepcopy(model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    on_probe = dict(probe.named_parameters())
    groups = [[on_probe[name_of[id(p)]] for p in stage.params if id(p) in name_of] for stage in part]
    curv = _curvatures(probe, loss_fn, batch, groups, iters, tol, seed)
    rows = []
    for i, stage in enumerate(part):
        lam = curv[i].value
        if lam <= 0.0:
            bound = math.inf  # no positive curvature: the quadratic model puts no limit on the step size
        elif gammas is not None:
            bound = theory.max_stable_lr(lam, tf[i], momentum=gammas[i], nesterov=True)
        elif momentum == 0.0:
            bound = float(theory.lemma1_bound(lam, tf[i]))
        else:
            bound = theory.max_stable_lr(lam, tf[i], momentum=float(momentum))
        eff = float(lr) * factors[i]
        row = {"stage": i, "params": stage.numel, "tau_fwd": tf[i], "tau_bkwd": tb[i]}
        if gammas is not None:
            row["momentum"] = gammas[i]
        if recomputes:
            row["tau_recomp"] = tr[i]
        rows.append({**row, "curvature": lam, "max_stable_lr": bound, "lr_factor": factors[i], "effective_lr": eff,
                     "headroom": bound / eff, "exceeds": eff >= bound, "converged": curv[i].converged})
    return Advice(pd.DataFrame(rows), pipeline.name, float(lr), float(momentum), step)
