"""Weight prediction: PipeOptim (optimizer-dependent), SpecTrain (SGDM) and XPipe (Adam), PipeOptim §III."""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from .. import history
from ..errors import CorrectionError
from .base import Correction

__all__ = ["WeightPrediction"]


def _step_sizes(values, where, device, sign: float = -1.0) -> List[torch.Tensor]:
    """One 0-d float64 tensor per entry of ``values``: a Python number as it is, a Tensor lr ``t`` as
    ``sign * t * factor * s`` for its ``where`` entry ``(factor, s)``. A fixed number of tensor ops
    whatever the number of stages or tensors, none of which reads a value back to the host."""
    if not any(isinstance(v, torch.Tensor) for v in values):
        return list(torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True).unbind())
    unique: Dict[int, int] = {}
    tensors = []
    for v in values:
        if isinstance(v, torch.Tensor) and id(v) not in unique:
            unique[id(v)] = len(tensors)
            tensors.append(v)
    # one lr per group (a 1-element lr of any shape as 0-d), copied to the device without waiting for it
    lrs = torch.stack([t.reshape(()) for t in tensors]).to(device=device, dtype=torch.float64, non_blocking=True)
    index = torch.tensor([unique.get(id(v), 0) for v in values]).to(device, non_blocking=True)
    scale = torch.tensor([sign * f * s if isinstance(v, torch.Tensor) else 0.0 for v, (f, s) in zip(values, where)],
                         dtype=torch.float64).to(device, non_blocking=True)
    plain = torch.tensor([0.0 if isinstance(v, torch.Tensor) else v for v in values],
                         dtype=torch.float64).to(device, non_blocking=True)
    return list(torch.addcmul(plain, lrs[index], scale).unbind())


class WeightPrediction(Correction):
    r"""The forward view predicts the weights the update will meet (PipeOptim §III, eqs. 3-6).

    ::

        W_hat_{t+s} = W_t - lr * s * dW_t                      # PipeOptim eq. (5)

    for a stage whose forward reads ``W_t = w_{t'-tau_fwd}``, with ``s = tau_fwd - tau_bkwd`` the
    version gap between its forward and the update its gradient enters, and ``lr``
    the step size the stage takes (the group's lr times T1's factor when combined). ``dW_t`` uses only what exists when ``W_t`` is
    current: the gradient and optimizer state of the update that produced ``W_t``.
    The engine therefore stores the *predicted* version ``W_hat`` in the history when
    ``W_t`` enters it, so a forward pass ``tau_fwd`` steps later reads a prediction
    made ``tau_fwd`` steps earlier, never one made with later information.

    Rules (``dW``):

    * ``"optimizer"`` (PipeOptim Table I, the base optimizer's own rule and state):
      SGD ``dW = buf`` (momentum buffer ``buf = mu buf + (1 - dampening)(g + wd w)``),
      Nesterov ``dW = g + wd w + mu buf``, no momentum ``dW = g + wd w``;
      Adam ``dW = m_hat / (sqrt(v_hat) + eps)`` (AMSGrad: the running max of ``v``);
      AdamW adds its decoupled ``wd w`` — Table I prints AdamW's row without it, but it
      is part of the update AdamW applies, so the prediction follows the optimizer. Any other optimizer: the last applied update,
      ``dW = (w_{t-1} - w_t) / lr``. We pick this over a dry run of the base step on
      cloned state because it is exact (for SGD and Adam it equals Table I's ``dW``
      up to rounding), costs one subtraction instead of an extra optimizer step and a
      full copy of its state, and needs no knowledge of the optimizer. A step taken at
      ``lr = 0`` (the first step of a warmup from 0) applied no update: its ``dW`` is 0,
      so the next forward views are not extrapolated (``0 / 0`` would write NaN weights).
    * ``"sgdm"`` — SpecTrain (PipeOptim eq. 6): ``dW = m``, the SGD momentum buffer.
    * ``"adam"`` — XPipe (PipeOptim eq. 6 with the moments in their right places):
      ``dW = m_hat / (sqrt(v_hat) + eps)``; the printed formula swaps ``m`` and ``v``.

    Backward pass: PipeOptim §III-B2 says SpecTrain and XPipe predict the backward weights too.
    Here every rule predicts, per stage, the version the stage's own backward pass meets (PipeOptim
    eq. 4's ``s``); on the schedules prediction accepts (``1f1b``, ``dataflow``, ``pb``) that
    backward reads exactly that version, ``w_t`` (``tau_bkwd = 0``, the executed timeline's
    version of every backward pass), so the backward prediction has gap 0 and is the identity.
    SpecTrain's own code aims every stage at one moment instead, the end of the minibatch's backward
    at stage 0, which adds a backward gap (docs/schedules.md, "Weight prediction's backward pass";
    not simulated).

    ``state``: ``"auto"`` reads the base optimizer's buffers when it has the ones the
    rule needs (SGD with momentum for ``"sgdm"``, Adam/AdamW for ``"adam"``) and keeps
    its own otherwise (``momentum``, ``betas``, ``eps``); ``"base"`` requires them
    (:class:`CorrectionError` if absent); ``"own"`` always keeps its own.

    Memory: one ``dW`` buffer per delayed stage, plus one (SpecTrain) or two (XPipe)
    own-moment buffers when it keeps its own state (XPipe's in float32 for float16 or bfloat16
    parameters: ``eps`` and the squared gradients are 0 in float16).
    """

    name, paper = "prediction", "PipeOptim §III (eqs. 3-6, Table I)"
    assumes_minimize = True
    dense_gradients = True
    rewrites_history = True
    RULES = ("optimizer", "sgdm", "adam")

    def __init__(self, rule: str = "optimizer", state: str = "auto", momentum: float = 0.9,
                 betas=(0.9, 0.999), eps: float = 1e-8):
        if rule not in self.RULES:
            raise CorrectionError(f"unknown WeightPrediction rule {rule!r}: use 'optimizer' (PipeOptim), "
                                  "'sgdm' (SpecTrain) or 'adam' (XPipe)")
        if state not in ("auto", "base", "own"):
            raise CorrectionError(f"WeightPrediction state must be 'auto', 'base' or 'own', got {state!r}")
        self.rule, self.state, self.momentum, self.betas, self.eps = rule, state, momentum, tuple(betas), eps

    # ------------------------------------------------------------------ setup
    def bind(self, engine):
        super().bind(engine)
        tf, tb = engine.max_delays
        stash = any(c.backward_reads_forward_view for c in engine.corrections)
        if any(b > 0 for b in tb) and not stash:
            raise CorrectionError("WeightPrediction needs backward passes on the current weights (tau_bkwd = 0, "
                                  "schedules 1f1b, dataflow, pb) or stashing; this schedule has tau_bkwd = "
                                  f"{tb}")
        base = engine.base_optimizer
        self._kind = self._base_kind(base)
        if self.rule == "sgdm":
            has = self._kind == "sgd" and all(g.get("momentum", 0) > 0 for g in base.param_groups)
        elif self.rule == "adam":
            has = self._kind in ("adam", "adamw")
        else:
            has = True
        if self.state == "base" and not has:
            need = "SGD with momentum > 0" if self.rule == "sgdm" else "Adam or AdamW"
            raise CorrectionError(f"WeightPrediction(rule={self.rule!r}, state='base') needs the state of "
                                  f"{need}, but the base optimizer is {type(base).__name__}: use state='auto' "
                                  "or 'own' to keep the moments in the correction")
        self._own = self.rule != "optimizer" and (self.state == "own" or not has)
        self._buffers: Dict[str, List[torch.Tensor]] = {"dW": []}
        if self._own:
            self._buffers.update({"m": []} if self.rule == "sgdm" else {"m": [], "v": []})
        self._own_step = 0
        self._groups_of: Optional[dict] = None  # the group_of map _by_param was built from
        self._chunks = [c for c in engine.chunks if c.H]  # the views with a history
        # the stage whose T1 factor a parameter's update takes: its owner's (a replica of a tied weight enters
        # its using stage's view as the tied parameter, which steps once, with the owner's factor)
        self._owner = engine.partition.stage_index()
        self._split: Dict[str, List[List[torch.Tensor]]] = {key: [] for key in self._buffers}
        for c in self._chunks:
            for key in self._buffers:  # (own Adam moments: float32 for half parameters, StageView.zeros)
                flat, views = c.zeros(statistics=key != "dW" and self.rule != "sgdm")
                self._buffers[key].append(flat)
                self._split[key].append(views)

    @staticmethod
    def _base_kind(base) -> str:
        if type(base) is torch.optim.AdamW:
            return "adamw"
        if type(base) is torch.optim.Adam:
            return "adamw" if base.defaults.get("decoupled_weight_decay", False) else "adam"
        if type(base) is torch.optim.SGD:
            return "sgd"
        return "other"

    def _views(self, key: str, ci: int) -> List[torch.Tensor]:
        """Per-parameter views of buffer ``key`` of chunk ``ci`` (built once in :meth:`bind`)."""
        return self._split[key][ci]

    def _groups(self) -> Dict[int, dict]:
        """Parameter id -> the base-optimizer group that holds it (:meth:`group_of`, rebuilt when that is)."""
        held = self.group_of()
        if self._groups_of is not held:
            live = self.engine.base_optimizer.param_groups
            self._groups_of, self._by_param = held, {i: live[k] for i, k in held.items()}
        return self._by_param

    # ------------------------------------------------------------------ hooks
    # Every hook is a fixed number of foreach calls over all stages (the per-tensor loops only build
    # lists), and none reads a tensor back to the host: a Tensor lr (or Adam's step on a device, fused
    # or capturable) stays a tensor. With Python-number lr the arithmetic is the per-tensor one's, bit
    # for bit (foreach runs the same kernels; ``addcmul_`` with a 0-d step size rounds as ``add_(alpha)``).
    def transform_stored(self, chunks, delays, step):
        tf, tb = delays
        groups = self._groups()
        stored, ds, alphas, where = [], [], [], []
        for ci, c in enumerate(self._chunks):
            s = tf[c.stage] - tb[c.stage]
            if s <= 0:
                continue
            for w, d, p in zip(c.stored(step), self._views("dW", ci), c.params):
                g = groups.get(id(p))
                if g is not None:  # parameters the base optimizer does not hold do not move
                    factor = self.engine.lr_factor(self._owner[id(p)])  # the step size it really takes (T1)
                    stored.append(w)
                    ds.append(d)
                    lr = g["lr"]
                    alphas.append(lr if isinstance(lr, torch.Tensor) else -float(lr) * factor * s)
                    where.append((factor, s))
        if not stored:
            return
        torch._foreach_addcmul_(stored, ds, _step_sizes(alphas, where, ds[0].device))

    def before_update(self, delays, step):
        """Keep what the update overwrites: ``w_t`` (generic rule) or ``wd * w_t`` (Nesterov, AdamW)."""
        if self.rule != "optimizer":
            return
        groups = self._groups()
        dst, src, decay = [], [], []
        for ci, c in enumerate(self._chunks):
            for d, w, p in zip(self._views("dW", ci), c.data, c.params):
                g = groups.get(id(p))
                if g is None:
                    continue
                if self._kind == "other":
                    dst.append(d)
                    src.append(w)
                elif (self._kind == "sgd" and (not g["momentum"] or g["nesterov"])) or self._kind == "adamw":
                    dst.append(d)
                    src.append(w)
                    decay.append(g["weight_decay"])
        if dst:
            torch._foreach_copy_(dst, src)
        if decay:  # (every entry but the generic rule's decays)
            torch._foreach_mul_(dst, decay)

    def after_update(self, chunks, delays, step):
        base = self.engine.base_optimizer
        if self._own:
            self._own_step += 1
        groups = self._groups()
        last = self.rule == "optimizer" and self._kind == "other"
        zero, rest = [], []
        for ci, c in enumerate(self._chunks):
            for j, (d, w, p) in enumerate(zip(self._views("dW", ci), c.data, c.params)):
                g = groups.get(id(p))
                if g is None or (p.grad is None and not last):
                    zero.append(d)
                else:
                    rest.append((ci, j, d, w, p, g, self._owner[id(p)]))
        if zero:
            torch._foreach_zero_(zero)
        if not rest:
            return
        if last:
            self._last_update(rest)
        elif self._own:
            self._own_moments(rest)
        elif self.rule == "sgdm" or (self.rule == "optimizer" and self._kind == "sgd"):
            self._sgd(rest, base.state)
        else:
            self._adam(rest, base.state, decoupled=self.rule == "optimizer" and self._kind == "adamw")

    def _last_update(self, rest):
        """``dW = (w_{t-1} - w_t) / lr``: the update the step applied (``d`` held ``w_{t-1}``); 0 where ``lr = 0``."""
        ds = [d for _, _, d, _, _, _, _ in rest]
        torch._foreach_sub_(ds, [w for _, _, _, w, _, _, _ in rest])
        lrs, where = [], []
        for _, _, _, _, _, g, stage in rest:
            lr, factor = g["lr"], self.engine.lr_factor(stage)
            lrs.append(lr if isinstance(lr, torch.Tensor) else float(lr) * factor)
            where.append((factor, 1))
        if any(isinstance(lr, torch.Tensor) for lr in lrs):  # (lr = 0 found on the device: no host sync)
            sizes = torch.stack(_step_sizes(lrs, where, ds[0].device, sign=1.0))
            applied = sizes != 0
            torch._foreach_div_(ds, list(torch.where(applied, sizes, 1.0).unbind()))
            torch._foreach_mul_(ds, list(applied.to(sizes.dtype).unbind()))  # dW = 0 after a step at lr = 0
            return
        still = [i for i, lr in enumerate(lrs) if lr == 0]
        if still:  # a step at lr = 0 applied no update: dW = 0, not 0 / 0
            torch._foreach_zero_([ds[i] for i in still])
            ds, lrs = [d for d, lr in zip(ds, lrs) if lr != 0], [lr for lr in lrs if lr != 0]
        if ds:
            torch._foreach_div_(ds, lrs)

    def _sgd(self, rest, state):
        copy_d, copy_s, add_d, add_g, nesterov = [], [], [], [], {}
        for _, _, d, _, p, g, _ in rest:
            mu = g["momentum"]
            if mu and (self.rule == "sgdm" or not g["nesterov"]):
                copy_d.append(d)  # SpecTrain / PipeOptim Table I: dW = buf
                copy_s.append(state[p]["momentum_buffer"])
                continue
            add_d.append(d)  # Nesterov: (wd w_t) + g + mu buf; plain SGD: (wd w_t) + g
            add_g.append(p.grad)
            if mu:
                pair = nesterov.setdefault(mu, ([], []))
                pair[0].append(d)
                pair[1].append(state[p]["momentum_buffer"])
        if copy_d:
            torch._foreach_copy_(copy_d, copy_s)
        if add_d:
            torch._foreach_add_(add_d, add_g)
        for mu, (dst, buf) in nesterov.items():
            torch._foreach_add_(dst, buf, alpha=mu)

    def _adam(self, rest, state, decoupled):
        """``dW = m_hat / (sqrt(v_hat) + eps)``, one batch per set of hyperparameters (not per stage)."""
        batches: Dict[tuple, list] = {}
        for _, _, d, _, p, g, _ in rest:
            st = state[p]
            on_device = bool(g.get("fused") or g.get("capturable")) or st["step"].device.type != "cpu"
            key = (tuple(g["betas"]), g["eps"], bool(g.get("amsgrad", False)),
                   st["step"].device if on_device else None)  # (None: steps read on the host)
            batches.setdefault(key, []).append((d, st))
        for (betas, eps, amsgrad, device), items in batches.items():
            ds = [d for d, _ in items]
            m = [st["exp_avg"] for _, st in items]
            v = [st["max_exp_avg_sq"] if amsgrad else st["exp_avg_sq"] for _, st in items]
            if device is not None:  # the bias corrections as tensors on the steps' device (no read to the host), in
                # float64 as the host path's Python floats (torch keeps the step in float32, where 1 - beta2^k came
                # out up to 1e-5 off, relative: 7e-8 in the weights after 8 steps, tests/test_engine_floor.py)
                steps = torch.stack([st["step"] for _, st in items]).to(torch.float64)
                bc1 = (1 - betas[0] ** steps).unbind()
                bc2 = (1 - betas[1] ** steps).sqrt_().unbind()
            else:
                steps = torch.stack([st["step"] for _, st in items]).tolist()  # (one host read, not one per tensor)
                bc1 = [1 - betas[0] ** k for k in steps]
                bc2 = [math.sqrt(1 - betas[1] ** k) for k in steps]
            for a, b in history.blocks(ds):  # (the temporaries: at most a block, not the model)
                num = torch._foreach_div(m[a:b], bc1[a:b])
                den = torch._foreach_sqrt(v[a:b])
                torch._foreach_div_(den, bc2[a:b])
                torch._foreach_add_(den, eps)
                torch._foreach_div_(num, den)
                if decoupled:
                    torch._foreach_add_(ds[a:b], num)  # d held wd * w_t
                else:
                    torch._foreach_copy_(ds[a:b], num)

    def _own_moments(self, rest):
        ds = [d for _, _, d, _, _, _, _ in rest]
        grads = [p.grad for _, _, _, _, p, _, _ in rest]
        m = [self._views("m", ci)[j] for ci, j, _, _, _, _, _ in rest]
        if self.rule == "sgdm":
            torch._foreach_mul_(m, self.momentum)
            torch._foreach_add_(m, grads)
            torch._foreach_copy_(ds, m)
            return
        beta1, beta2 = self.betas
        v, k = [self._views("v", ci)[j] for ci, j, _, _, _, _, _ in rest], self._own_step
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, grads, alpha=1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        for a, b in history.blocks(ds):  # (the temporaries: at most a block, not the model)
            num = torch._foreach_div(m[a:b], 1 - beta1 ** k)
            den = torch._foreach_div(v[a:b], 1 - beta2 ** k)
            torch._foreach_sqrt_(den)
            torch._foreach_add_(den, self.eps)
            torch._foreach_div_(num, den)
            torch._foreach_copy_(ds[a:b], num)

    def direction(self, stage: int) -> torch.Tensor:
        """The current ``dW`` of ``stage`` (flat)."""
        return torch.cat([self._buffers["dW"][ci] for ci, c in enumerate(self._chunks) if c.stage == stage])

    def state_dict(self):
        return {"buffers": self._buffers, "own_step": self._own_step}

    def load_state_dict(self, state):
        for key, bufs in state["buffers"].items():
            for mine, saved in zip(self._buffers[key], bufs):
                mine.copy_(saved)
        self._own_step = state["own_step"]

    def extra_bytes(self):
        return sum(b.numel() * b.element_size() for bufs in self._buffers.values() for b in bufs)

    def __repr__(self):  # (the signature a checkpoint is checked against: settings at their defaults left out,
        # as before they were listed, so that checkpoints written then still load)
        extra = "".join(f", {k}={v!r}" for k, v, d in (("momentum", self.momentum, 0.9),
                                                       ("betas", self.betas, (0.9, 0.999)), ("eps", self.eps, 1e-8))
                        if v != d)
        return f"WeightPrediction(rule={self.rule!r}, state={self.state!r}{extra})"
