"""Nesterov's method for asynchronous pipelines (Ajanthan et al., ICML 2025): the authors' NAdam base, and
the look-ahead in SGD form."""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from ..errors import CorrectionError
from .base import Correction

__all__ = ["NesterovLookahead", "RequireNAdam", "ASYNCPP_BETA1", "ASYNCPP_MOMENTUM_DECAY"]


def _check_momentum(what: str, value, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) < 1.0:
        raise CorrectionError(f"NesterovLookahead({what}) must be a float in [{low:g}, 1), got {value!r}")
    return float(value)


class NesterovLookahead(Correction):
    r"""Nesterov's accelerated gradient with the look-ahead in the update, for stale gradients
    (Ajanthan, Ramasinghe, Zuo, Avraham, Long, "Nesterov Method for Asynchronous Pipeline Parallel
    Optimization", ICML 2025).

    With ``g_t`` the stage's (stale) gradient, per stage ``i``::

        gamma_i = momentum + tau_i * (max_momentum - momentum) / (tau_max + 1)   # max_momentum=None: momentum
        m_{t+1} = gamma_i * m_t + g_t                                            # m_0 = 0
        g_t    <-  g_t + gamma_i * m_{t+1}                                        # the look-ahead step

    and the base optimizer, plain SGD, applies ``w_{t+1} = w_t - eta * (g_t + gamma_i m_{t+1})``:
    NAG in the form that moves the look-ahead from the gradient's point into the update
    (Sutskever et al. 2013; Dozat's NAdam), since an asynchronous pipeline cannot evaluate the
    gradient at ``w_t + gamma d_t``: it evaluates it at stale weights, and the look-ahead term
    pushes the weights further along the momentum to meet the delay. ``tau_i`` is the stage's
    asynchronous forward delay and ``tau_max`` the largest over stages (``engine.max_delays``).

    This is the SGD form of the look-ahead, not the authors' method: their reference implementation
    (PluralisResearch/AsyncPP) trains with ``torch.optim.NAdam`` (Dozat's look-ahead in the update with
    Adam's second moment and a momentum-decay schedule), which is the ``asyncpp`` method
    (:class:`RequireNAdam`). With ``max_momentum=None`` the rule does not depend on the delay, and over
    plain SGD without weight decay it is ``torch.optim.SGD(momentum, nesterov=True)`` bit for bit at every
    delay (tested):
    the ``pipemare-stash-nesterov`` method is ``pipemare-stash`` with Nesterov SGD. ``max_momentum``
    gives the reference code's optional ``--adaptive_momentum`` rule, ``gamma_i = momentum +
    (num_versions_i - 1)(0.99 - momentum) / P`` with ``num_versions_i - 1 = P - 1 - i`` the stage's 1F1B
    delay, at ``max_momentum = 0.99`` (``tau_max + 1 = P`` there; ``tau_max + 1`` generalises ``P`` to
    other schedules while keeping ``gamma_i < max_momentum``). The base's weight decay is added to the
    look-ahead direction, outside the momentum.

    Use it with ``torch.optim.SGD(params, lr)`` (no momentum): the correction holds the momentum.
    With another base optimizer the look-ahead direction feeds that optimizer's own rule (a warning
    says so). Memory: one weight-sized momentum buffer per stage (the same as SGD with momentum).
    """

    name, paper = "NAG", "Ajanthan et al., ICML 2025 (Nesterov for asynchronous PP)"
    dense_gradients = True

    rewrites_gradients = True

    def __init__(self, momentum: float = 0.9, max_momentum: Optional[float] = None):
        self.momentum = _check_momentum("momentum", momentum, 0.0)
        self.max_momentum = None if max_momentum is None else _check_momentum("max_momentum", max_momentum,
                                                                              self.momentum)

    def bind(self, engine):
        super().bind(engine)
        base = engine.base_optimizer
        if not (type(base) is torch.optim.SGD and all(g.get("momentum", 0) == 0 for g in base.param_groups)):
            warnings.warn(f"NesterovLookahead holds the momentum and rewrites the gradient into the Nesterov "
                          f"direction; the base optimizer {type(base).__name__} applies its own rule on top of it "
                          "(momentum twice, or Adam's moments of the look-ahead). For the paper's update use "
                          "torch.optim.SGD(params, lr) without momentum", stacklevel=4)
        self.gammas = self.stage_momenta(engine.max_delays[0])
        self._m = {c.index: c.zeros() for c in engine.chunks}
        # gamma_i as a 0-d float64 tensor per view (addcmul_ with it rounds exactly as add_(alpha=gamma_i))
        self._gamma0 = {c.index: torch.tensor(self.gammas[c.stage], dtype=torch.float64, device=c.params[0].device)
                        for c in engine.chunks}

    def stage_momenta(self, tau: List[int]) -> List[float]:
        """``gamma_i`` of every stage for asynchronous forward delays ``tau``."""
        if self.max_momentum is None:
            return [self.momentum] * len(tau)
        span = (self.max_momentum - self.momentum) / (max(tau) + 1)
        return [self.momentum + t * span for t in tau]

    def before_update(self, delays, step):
        """``m = gamma_i m + g``, ``g += gamma_i m``: three foreach calls over all stages."""
        ms, grads, gammas, gamma0 = [], [], [], []
        held = self.group_of()
        for c in self.engine.chunks:
            gamma, g0 = self.gammas[c.stage], self._gamma0[c.index]
            for p, m in zip(c.params, self._m[c.index][1]):
                if p.grad is not None and id(p) in held:
                    ms.append(m)
                    grads.append(p.grad)
                    gammas.append(gamma)
                    gamma0.append(g0)
        if ms:
            torch._foreach_mul_(ms, gammas)
            torch._foreach_add_(ms, grads)
            torch._foreach_addcmul_(grads, ms, gamma0)

    def momentum_buffer(self, stage: int) -> torch.Tensor:
        """The flat momentum ``m`` of ``stage`` (concatenated over its views)."""
        if not 0 <= stage < len(self.gammas):
            raise CorrectionError(f"NesterovLookahead.momentum_buffer(stage): stage must be in 0..{len(self.gammas) - 1}"
                                  f", got {stage!r}")
        return torch.cat([self._m[c.index][0] for c in self.engine.chunks if c.stage == stage])

    def state_dict(self):
        return {"m": {i: flat for i, (flat, _) in self._m.items()}}

    def load_state_dict(self, state):
        for i, flat in state["m"].items():
            self._m[int(i)][0].copy_(flat)

    def extra_bytes(self):
        return sum(f.numel() * f.element_size() for f, _ in self._m.values()) + \
            sum(t.element_size() for t in self._gamma0.values())

    def __repr__(self):
        return f"NesterovLookahead(momentum={self.momentum}, max_momentum={self.max_momentum})"


#: The AsyncPP recipe's NAdam settings (PluralisResearch/AsyncPP ``run.bash``, "Ours"): ``beta1`` and the
#: momentum-decay rate ``psi``; weight decay is decoupled.
ASYNCPP_BETA1, ASYNCPP_MOMENTUM_DECAY = 0.99, 0.004


class RequireNAdam(Correction):
    r"""The AsyncPP method's base optimizer: the look-ahead is NAdam's own (Ajanthan et al., ICML 2025).

    The authors' method is the base step of ``torch.optim.NAdam`` with decoupled weight decay, on a
    1F1B pipeline with weight stashing (their ``run.bash``: ``--optimizer nadamw --momentum 0.99``, the
    default ``momentum_decay = 0.004``). Per parameter, with ``g_t`` the gradient at the stashed weights
    ``w_{t - tau_i}`` (``tau_i = P - 1 - i``) and ``k = t + 1``::

        mu_k    = beta1 (1 - 0.5 * 0.96^(k psi))                   # momentum-decay schedule
        w      <- w_t (1 - lr lambda)                               # decoupled weight decay
        m_k     = beta1 m_{k-1} + (1 - beta1) g_t,    v_k = beta2 v_{k-1} + (1 - beta2) g_t^2
        w_{t+1} = w - lr [(1 - mu_k) / (1 - prod_{j<=k} mu_j) g_t + mu_{k+1} / (1 - prod_{j<=k+1} mu_j) m_k]
                      / (sqrt(v_k / (1 - beta2^k)) + eps)

    The second term is Nesterov's look-ahead in the update (Dozat): the step already takes the next
    momentum step ``mu_{k+1} m_k``, which with ``beta1 = 0.99`` reaches far enough along the momentum to
    meet the delay. Nothing is added on top of NAdam (the reference code's optional
    ``--adaptive_momentum``, ``beta1_i = beta1 + (P - 1 - i)(0.99 - beta1) / P``, is off in the recipe and
    is the identity at ``beta1 = 0.99``), so this correction changes no gradient, view or step size: it
    checks at :meth:`bind` that the base optimizer is ``torch.optim.NAdam`` with
    ``decoupled_weight_decay=True``, ``beta1 = 0.99`` and ``momentum_decay = 0.004``, and warns otherwise
    (any other base makes the method PipeDream, 1F1B + stashing, over that base). No extra memory.
    """

    name, paper = "AsyncPP NAdam", "Ajanthan et al., ICML 2025 (AsyncPP)"

    def bind(self, engine):
        super().bind(engine)
        base = engine.base_optimizer
        problems = []
        if type(base) is not torch.optim.NAdam:
            problems.append(f"the base optimizer is {type(base).__name__}, not torch.optim.NAdam")
        else:
            for k, g in enumerate(base.param_groups):
                wrong = [f"{key} = {got!r} (the recipe: {want!r})" for key, got, want in (
                    ("betas[0]", g["betas"][0], ASYNCPP_BETA1), ("momentum_decay", g["momentum_decay"],
                                                                 ASYNCPP_MOMENTUM_DECAY),
                    ("decoupled_weight_decay", g["decoupled_weight_decay"], True)) if got != want]
                if wrong:
                    problems.append(f"param group {k} has " + ", ".join(wrong))
        if problems:
            warnings.warn(f"the AsyncPP method is the authors' recipe only over torch.optim.NAdam(params, lr, betas="
                          f"({ASYNCPP_BETA1}, 0.999), momentum_decay={ASYNCPP_MOMENTUM_DECAY}, weight_decay=..., "
                          "decoupled_weight_decay=True) (RunConfig: optimizer = 'nadamw', momentum = 0.99); "
                          + "; ".join(problems) + ". Otherwise it runs as PipeDream (1F1B + stashing) over that "
                          "optimizer", stacklevel=4)

    def __repr__(self):
        return "RequireNAdam()"
