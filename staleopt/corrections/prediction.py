"""Weight prediction: PipeOptim (optimizer-dependent), SpecTrain (SGDM) and XPipe (Adam), PipeOptim §III."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from ..errors import CorrectionError
from .base import Correction

__all__ = ["WeightPrediction"]


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
      full copy of its state, and needs no knowledge of the optimizer.
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
    own-moment buffers when it keeps its own state.
    """

    name, paper = "prediction", "PipeOptim §III (eqs. 3-6, Table I)"
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
        if self.rule == "optimizer" and self._kind in ("sgd", "adam", "adamw"):
            for g in base.param_groups:
                if g.get("maximize", False):
                    raise CorrectionError("WeightPrediction does not support maximize=True: minimize the "
                                          "negated objective instead")
        self._buffers: Dict[str, List[torch.Tensor]] = {"dW": []}
        if self._own:
            self._buffers.update({"m": []} if self.rule == "sgdm" else {"m": [], "v": []})
        self._own_step = 0
        self._chunks = [c for c in engine.chunks if c.H]  # the views with a history
        self._split: Dict[str, List[List[torch.Tensor]]] = {key: [] for key in self._buffers}
        for c in self._chunks:
            for key in self._buffers:
                flat, views = c.zeros()
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
        """Parameter id -> its base-optimizer group, read afresh (groups may be added or reloaded)."""
        return {id(p): g for g in self.engine.param_groups for p in g["params"]}

    # ------------------------------------------------------------------ hooks
    def transform_stored(self, chunks, delays, step):
        tf, tb = delays
        groups = self._groups()
        for ci, c in enumerate(self._chunks):
            s = tf[c.stage] - tb[c.stage]
            if s <= 0:
                continue
            factor = self.engine.lr_factor(c.stage)  # the step size this stage really takes (T1)
            for stored, d, p in zip(c.stored(step), self._views("dW", ci), c.params):
                if id(p) in groups:  # parameters the base optimizer does not hold do not move
                    stored.add_(d, alpha=-float(groups[id(p)]["lr"]) * factor * s)

    def before_update(self, delays, step):
        """Keep what the update overwrites: ``w_t`` (generic rule) or ``wd * w_t`` (Nesterov, AdamW)."""
        if self.rule != "optimizer":
            return
        groups = self._groups()
        for ci, c in enumerate(self._chunks):
            for d, w, p in zip(self._views("dW", ci), c.data, c.params):
                g = groups.get(id(p))
                if g is None:
                    continue
                if self._kind == "other":
                    d.copy_(w)
                elif (self._kind == "sgd" and (not g["momentum"] or g["nesterov"])) or self._kind == "adamw":
                    d.copy_(w).mul_(g["weight_decay"])

    def after_update(self, chunks, delays, step):
        base = self.engine.base_optimizer
        if self._own:
            self._own_step += 1
        groups = self._groups()
        for ci, c in enumerate(self._chunks):
            own = {k: self._views(k, ci) for k in self._buffers if k != "dW"}
            for j, (d, w, p) in enumerate(zip(self._views("dW", ci), c.data, c.params)):
                g, st = groups.get(id(p)), base.state.get(p, {})
                if g is None:
                    d.zero_()
                    continue
                if self.rule == "optimizer" and self._kind == "other":
                    lr = float(g["lr"]) * self.engine.lr_factor(c.stage)
                    d.sub_(w).div_(lr)  # (w_{t-1} - w_t) / lr: the update the step applied
                    continue
                if p.grad is None:
                    d.zero_()
                    continue
                if self._own:
                    self._own_moments(d, own, j, p.grad)
                elif self.rule == "sgdm" or (self.rule == "optimizer" and self._kind == "sgd"):
                    self._sgd(d, g, st, p.grad, w)
                else:
                    self._adam(d, g, st, decoupled=self.rule == "optimizer" and self._kind == "adamw")

    def _sgd(self, d, g, st, grad, w):
        mu = g["momentum"]
        if mu and (self.rule == "sgdm" or not g["nesterov"]):
            d.copy_(st["momentum_buffer"])  # SpecTrain / PipeOptim Table I: dW = buf
        elif mu:
            d.add_(grad).add_(st["momentum_buffer"], alpha=mu)  # Nesterov: (wd w_t) + g + mu buf
        else:
            d.add_(grad)  # plain SGD: (wd w_t) + g

    def _adam(self, d, g, st, decoupled):
        beta1, beta2 = g["betas"]
        step = float(st["step"])
        v = st["max_exp_avg_sq"] if g.get("amsgrad", False) else st["exp_avg_sq"]
        direction = (st["exp_avg"] / (1 - beta1 ** step)) / (v.sqrt() / math.sqrt(1 - beta2 ** step) + g["eps"])
        if decoupled:
            d.add_(direction)  # d held wd * w_t
        else:
            d.copy_(direction)

    def _own_moments(self, d, own, j, grad):
        if self.rule == "sgdm":
            m = own["m"][j]
            m.mul_(self.momentum).add_(grad)
            d.copy_(m)
            return
        beta1, beta2 = self.betas
        m, v, k = own["m"][j], own["v"][j], self._own_step
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        d.copy_((m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt() + self.eps))

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

    def __repr__(self):
        return f"WeightPrediction(rule={self.rule!r}, state={self.state!r})"
