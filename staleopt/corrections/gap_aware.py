"""Gap-aware damping of stale gradients, Barkai, Hakimi and Schuster, ICLR 2020."""
from __future__ import annotations

from typing import Dict, List

import torch

from .. import history
from ..errors import CorrectionError
from .base import Correction
from .stale_weights import StaleWeights

__all__ = ["GapAware"]


class GapAware(Correction):
    r"""Divide each stale gradient by its *Gap* (Barkai, Hakimi, Schuster, ICLR 2020, "Gap-Aware").

    Per stage ``i`` with ``tau_i = tau_fwd_i`` of the step, per element, before the base step::

        G   = 1 + |w_t - w_{t - tau_i}| / C          # the Gap: the staleness in units of C
        g  <-  g / G

    The Gap measures staleness by how far the weights moved since the gradient's weights were read,
    in units of the average step a parameter takes, so a parameter that did not move is not
    penalised however old the gradient (the paper's argument against dividing by ``tau``). The weights
    used are the forward view ``w_{t - tau_fwd_i}`` (raw), as for
    :class:`~staleopt.corrections.DelayCompensation`. Stages with ``tau_i = 0`` are left alone.

    ``C``, the average step, is the authors' (their pipeline implementation, saareliad/FTPipe, read, not
    copied). Over ``torch.optim.SGD`` it is the running RMS of the update *direction* ``d`` times the
    largest learning rate ``eta_max`` the scheduler has set so far (per param group), with ``d`` the
    undamped gradient (no momentum) or the base's momentum buffer as the previous step left it::

        v_k = beta * v_{k-1} + (1 - beta) * d_t^2      # first, at each step k = 1, 2, ... the base steps it
        C   = eta_max * (sqrt(v_k / (1 - beta^k)) + eps)
        g  <-  g / G + lambda * w_t * (1 / G - 1)      # SGD's weight decay lambda w_t is damped too

    ``k`` counts a parameter's own steps, as torch's Adam counts ``state["step"]``: a step where it has no
    gradient, or that it takes in no group (before an ``add_param_group`` hands it to the base), neither
    enters ``v`` nor ``k`` (a global count would bias-correct its young average as an old one: ``C`` too
    small, the gradient damped too hard). Until its first measured step ``G = 1``.

    Over any other base optimizer (Adam: the authors record the applied step inside their own Adam)
    ``C`` is the running RMS of the applied step, bias-corrected, measured after each base step::

        C   = sqrt(v_k / (1 - beta^k)) + eps,   v_{k+1} = beta * v_k + (1 - beta) * (w_{t+1} - w_t)^2

    (``k`` steps measured, all parameters at once; at ``k = 0`` every stored version is ``w_0`` and ``G = 1``),
    and the base's weight decay is not damped (the authors' Adam and AdamW divide it by the Gap too: a
    difference of ``lambda w_t (1 - 1/G)`` in the gradient Adam receives). While a group's ``eta_max`` is 0
    ``G = 1`` (the authors skip it; ``C = 0``). The two differ: with plain SGD at a constant learning rate the applied
    step is the *damped* gradient, so the RMS-of-step ``C`` is smaller and the Gap larger than the
    authors' (docs/corrections.md gives the measurement).

    Memory: one weight-sized buffer ``v`` per delayed stage (float32 for float16 or bfloat16 parameters, with
    ``C`` and ``G`` computed in it: ``eps`` and the squared steps are 0 in float16; ``StageView.zeros``), plus
    the stale versions (a real stage keeps ``tau_i`` of them; see
    :class:`~staleopt.corrections.stale_weights.StaleWeights`).
    """

    name, paper = "GA", "Barkai et al., ICLR 2020 (Gap-Aware)"
    assumes_minimize = True
    dense_gradients = True
    needs_raw_history = True

    rewrites_gradients = True

    def __init__(self, beta: float = 0.999, eps: float = 1e-8):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < float(beta) < 1.0:
            raise CorrectionError(f"GapAware(beta) must be a float in (0, 1), the decay of the running mean square "
                                  f"step (the authors use 0.999), got {beta!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not float(eps) > 0:
            raise CorrectionError(f"GapAware(eps) must be a positive number (added to the RMS step C so that a "
                                  f"parameter that never moved gets G = 1), got {eps!r}")
        self.beta, self.eps = float(beta), float(eps)

    def bind(self, engine):
        super().bind(engine)
        self._stale = StaleWeights(self)
        self._v: Dict[int, tuple] = {c.index: c.zeros(statistics=True) for c in self._stale.views}
        self._k = 0  # steps measured from the applied step (over SGD: each parameter's own count, _counts)
        self._counts: Dict[int, List[int]] = {c.index: [0] * len(c.params) for c in self._stale.views}
        base = engine.base_optimizer
        #: C from the update direction (the authors' SGD rule), else from the applied step
        self.from_direction = type(base) is torch.optim.SGD
        self._max_lr = [_larger(None, g["lr"]) for g in base.param_groups]
        self._wd0: Dict[tuple, torch.Tensor] = {}  # (weight decay, device) -> 0-d tensor

    def _steps(self, view) -> List[int]:
        """Per parameter of ``view``: ``k``, the steps in its running mean square."""
        return self._counts[view.index] if self.from_direction else [self._k] * len(view.params)

    def _scale(self, view):
        """Per parameter: ``C`` of ``view``'s elements, from the running mean square ``v`` (module docstring); a
        parameter the base optimizer does not hold takes the largest ``eta_max``; ``None`` (``G = 1``) at ``k = 0``
        and where ``eta_max`` is 0 (``C = 0``; the authors skip such a group), a 0-d tensor ``eta_max`` included
        (``C = inf`` there: no host read)."""
        groups, top = self._groups(), max(self._max_lr)
        out = []
        for p, v, k in zip(view.params, self._v[view.index][1], self._steps(view)):
            lr = 1.0 if not self.from_direction else self._max_lr[groups[id(p)]] if id(p) in groups else top
            if k == 0 or _never_stepped(lr):
                out.append(None)
                continue
            c = v.div(1.0 - self.beta ** k).sqrt_().add_(self.eps).mul_(lr)
            out.append(_unset(c) if isinstance(lr, torch.Tensor) else c)
        return out

    def _groups(self) -> Dict[int, int]:
        """:meth:`group_of`, with an ``eta_max`` for each group ``add_param_group`` added (it starts at their
        ``lr``). A parameter no group holds is absent: its gradient is left as it is."""
        groups = self.engine.base_optimizer.param_groups
        self._max_lr += [_larger(None, g["lr"]) for g in groups[len(self._max_lr):]]
        return self.group_of()

    def gap(self, view, step: int, tau: int):
        """Per-parameter Gaps ``G`` of ``view`` for a gradient ``tau`` steps stale, at ``before_update`` of ``step``
        (over SGD: after this step's direction entered ``v``)."""
        stale = self._stale.version(view, step, tau)
        return [torch.ones_like(w) if c is None else (w - s).to(c.dtype).abs_().div_(c).add_(1.0)
                for w, s, c in zip(view.data, stale, self._scale(view))]

    def _measure_direction(self, groups: Dict[int, int]):
        """The authors' SGD statistics, at the start of a step: ``eta_max`` and ``v`` from the direction
        (``groups``: :meth:`_groups`)."""
        base = self.engine.base_optimizer
        self._max_lr = [_larger(m, g["lr"]) for m, g in zip(self._max_lr, base.param_groups)]
        vs, moved, ds = [], [], []
        for c in self._stale.views:
            counts = self._counts[c.index]
            for j, (p, v) in enumerate(zip(c.params, self._v[c.index][1])):
                if p.grad is None or id(p) not in groups:
                    continue
                d = p.grad if base.param_groups[groups[id(p)]]["momentum"] == 0 else \
                    base.state[p].get("momentum_buffer")
                vs.append(v)
                counts[j] += 1
                if d is not None:                      # no buffer before the first step: d = 0
                    moved.append(v)
                    ds.append(d)
        if vs:
            torch._foreach_mul_(vs, self.beta)
        if moved:
            torch._foreach_addcmul_(moved, ds, ds, value=1.0 - self.beta)

    def before_update(self, delays, step):
        """``g /= G`` (over SGD with weight decay ``lambda``: ``g += lambda w (1/G - 1)``, the decay undamped) at
        every view with ``tau > 0``: a fixed number of foreach calls over all stages, block by block."""
        groups, live = self._groups(), self.engine.base_optimizer.param_groups
        if self.from_direction:
            self._measure_direction(groups)
        tf = delays[0]
        grads, ws, ss, vs, corrections, lrs, wds = [], [], [], [], [], [], []
        for c in self._stale.views:
            tau = tf[c.stage]
            if tau == 0:
                continue
            stale = self._stale.version(c, step, tau)
            for p, w, s, v, n in zip(c.params, c.data, stale, self._v[c.index][1], self._steps(c)):
                k = groups.get(id(p))
                if p.grad is None or k is None or n == 0:  # (n = 0: no statistics yet, G = 1)
                    continue
                if self.from_direction and _never_stepped(self._max_lr[k]):  # (C = 0: no average step; G = 1)
                    continue
                grads.append(p.grad)
                ws.append(w)
                ss.append(s)
                vs.append(v)
                corrections.append(1.0 - self.beta ** n)
                lrs.append(self._max_lr[k])
                wds.append(live[k]["weight_decay"] if self.from_direction else 0)
        widen = any(v.dtype != w.dtype for v, w in zip(vs, ws))  # (float32 statistics of half parameters)
        for a, b in history.blocks(grads):  # the temporaries are weight-sized: bounded blocks
            g = grads[a:b]
            scale = torch._foreach_div(vs[a:b], corrections[a:b])
            torch._foreach_sqrt_(scale)
            torch._foreach_add_(scale, self.eps)
            if self.from_direction:
                _scale_by(scale, lrs[a:b])
                scale = [_unset(c) if isinstance(f, torch.Tensor) else c for c, f in zip(scale, lrs[a:b])]
            G = torch._foreach_sub(ws[a:b], ss[a:b])
            if widen:  # G in the statistics' dtype: |w - s| / C overflows float16
                G = [x.to(v.dtype) for x, v in zip(G, vs[a:b])]
            torch._foreach_abs_(G)
            torch._foreach_div_(G, scale)
            torch._foreach_add_(G, 1.0)
            torch._foreach_div_(g, G)
            decayed = [k for k in range(b - a) if wds[a + k]]
            if decayed:
                inv = torch._foreach_reciprocal([G[k] for k in decayed])  # (1.0 / G is G.reciprocal() * 1.0)
                torch._foreach_sub_(inv, 1.0)
                torch._foreach_mul_(inv, [ws[a + k] for k in decayed])
                torch._foreach_addcmul_([g[k] for k in decayed], inv, [self._decay0(wds[a + k], g[k].device)
                                                                       for k in decayed])

    def _decay0(self, wd: float, device) -> torch.Tensor:
        """``wd`` as a 0-d float64 tensor on ``device``, made once (``addcmul_`` with it rounds as
        ``add_(alpha=wd)``)."""
        key = (wd, device)
        t = self._wd0.get(key)
        if t is None:
            t = self._wd0[key] = torch.tensor(wd, dtype=torch.float64, device=device)
        return t

    def after_update(self, chunks, delays, step):
        if not self.from_direction:
            new, old, vs = [], [], []
            for c in self._stale.views:
                new += c.data
                old += c.stored(step)
                vs += self._v[c.index][1]
            if vs:
                d = torch._foreach_sub(new, old)
                torch._foreach_mul_(vs, self.beta)
                torch._foreach_addcmul_(vs, d, d, value=1.0 - self.beta)
            self._k += 1
        self._stale.refresh(step)

    def state_dict(self):
        return {"stale": self._stale.state_dict(), "v": {i: f for i, (f, _) in self._v.items()}, "k": self._k,
                "counts": {i: list(n) for i, n in self._counts.items()}, "max_lr": list(self._max_lr)}

    def load_state_dict(self, state):
        self._stale.load_state_dict(state["stale"])
        for i, flat in state["v"].items():
            self._v[int(i)][0].copy_(flat)
        self._k = int(state["k"])
        counts = state.get("counts")  # (a state saved before the per-parameter counts: every one at k)
        if counts is None:
            counts = {i: [self._k] * len(n) for i, n in self._counts.items()}
        for i, n in counts.items():
            self._counts[int(i)][:] = [int(x) for x in n]
        self._max_lr = [x if isinstance(x, torch.Tensor) else float(x) for x in state.get("max_lr", self._max_lr)]

    def extra_bytes(self):
        return self._stale.nbytes() + sum(f.numel() * f.element_size() for f, _ in self._v.values()) + \
            sum(t.element_size() for t in self._wd0.values())

    def __repr__(self):
        return f"GapAware(beta={self.beta}, eps={self.eps})"


def _larger(m, lr):
    """``max(m, lr)`` (``m = None``: ``lr``), a 0-d tensor where either is one: a Tensor lr is never read back to
    the host (on a GPU, a sync per step)."""
    if not isinstance(lr, torch.Tensor) and not isinstance(m, torch.Tensor):
        return float(lr) if m is None else max(m, float(lr))
    ref = lr if isinstance(lr, torch.Tensor) else m
    lr = torch.as_tensor(lr, dtype=ref.dtype, device=ref.device).detach().clone()
    return lr if m is None else torch.maximum(torch.as_tensor(m, dtype=ref.dtype, device=ref.device), lr)


def _never_stepped(eta_max) -> bool:
    """A Python-number ``eta_max`` of 0: the group never took a step, ``C = 0`` (a 0-d tensor is not read back to the
    host: :func:`_unset` makes its ``C`` infinite instead)."""
    return not isinstance(eta_max, torch.Tensor) and not eta_max > 0


def _unset(c: torch.Tensor) -> torch.Tensor:
    """``C`` with its zeros (a group whose 0-d tensor ``eta_max`` is 0) made ``inf``, so that ``G = 1`` there."""
    return torch.where(c == 0, torch.inf, c)


def _scale_by(tensors: List[torch.Tensor], factors: list) -> None:
    """``t *= f`` per pair: one foreach call with Python-number factors, else one per distinct factor (a 0-d
    tensor, the ``eta_max`` of a group with a Tensor lr; as many calls as groups, not stages)."""
    if not any(isinstance(f, torch.Tensor) for f in factors):
        torch._foreach_mul_(tensors, factors)
        return
    by: Dict[int, tuple] = {}
    for t, f in zip(tensors, factors):
        by.setdefault(id(f), (f, []))[1].append(t)
    for f, ts in by.values():
        torch._foreach_mul_(ts, f)
