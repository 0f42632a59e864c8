"""T2's accumulator convention and App. B.4's gamma, shared by theory and optimizer; the theory's recompute model
reproduced by training (PipeMare §3.2, App. B.4, App. D.1; docs/engine.md).

A one-parameter network whose gradient, by construction, is the quadratic model's sample::

    g_t = (lam + Delta) u_fwd - (Delta - Phi) u_bkwd - Phi u_recomp - eta_t

trained with PipelineOptimizer (+ opt.checkpoint, + T2) must give the iterates of
:func:`staleopt.theory.simulate_quadratic` to rounding, for both accumulators.
"""
import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from staleopt import PipelineOptimizer, schedules, theory
from staleopt.corrections import DiscrepancyCorrection
from staleopt.errors import CheckpointError, CorrectionError, OptimizerMismatchError


class Quadratic(nn.Module):
    """``L = a^2 w^2 / 2 + p w (w 1) + q w (w 1)|_checkpointed - eta w`` with the weight read through the views:

    * ``(w a)^2 / 2``: the square saves the activation ``w a`` (forward view): ``dL/dw = a^2 u_fwd``;
    * ``p w h``, ``h = w 1``: ``h`` is an activation (``u_fwd``) and the product saves the weight itself for
      the error ``dL/dh`` (``W^T delta``: ``u_bkwd``): ``p (u_fwd + u_bkwd)``;
    * the same inside ``opt.checkpoint``: ``h`` is recomputed (``u_recomp``): ``q (u_recomp + u_bkwd)``;
    * ``eta w``: ``-eta``.

    With ``a^2 = lam + 2 Delta - 2 Phi``, ``p = 2 Phi - Delta``, ``q = -Phi`` the sum is the model's ``g_t``.
    """

    def __init__(self, lam, delta, phi, w0):
        super().__init__()
        self.body = nn.Linear(1, 1, bias=False).double()
        with torch.no_grad():
            self.body.weight.fill_(w0)
        self.a2, self.p, self.q = lam + 2 * delta - 2 * phi, 2 * phi - delta, -phi
        assert self.a2 >= 0
        self.opt = None

    def forward(self, eta):
        w = self.body.weight.view(1)
        a = math.sqrt(self.a2)
        loss = 0.5 * (w * a) ** 2 + self.p * (w * (w * 1.0)) - eta * w
        if self.q:
            loss = loss + self.q * self.opt.checkpoint(lambda: w * (w * 1.0))
        return loss.sum()


def train_quadratic(lr, lam, tf, tb, tr, delta, phi, steps, decay=None, accumulator="causal", momentum=0.0,
                    noise_std=1.0, seed=0, w0=1.0):
    model = Quadratic(lam, delta, phi, w0)
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), stages=1,
                            schedule=schedules.get("custom", tau_fwd=[tf], tau_bkwd=[tb], tau_recomp=[tr]),
                            corrections=[] if decay is None else [DiscrepancyCorrection(decay, accumulator)])
    model.opt = opt
    noise = np.random.default_rng(seed).normal(0.0, noise_std, size=steps) if noise_std else np.zeros(steps)
    w = [w0]
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(steps):
            opt.zero_grad()
            model(torch.tensor([noise[t]], dtype=torch.float64)).backward()
            opt.step()
            w.append(model.body.weight.item())
    return np.array(w)


CASES = [(6, 0, 3), (6, 2, 4), (5, 1, 1), (5, 1, 5), (4, 0, 0)]


@pytest.mark.parametrize("tf,tb,tr", CASES)
@pytest.mark.parametrize("decay,accumulator", [(None, "causal"), (0.3, "causal"), (0.3, "current"),
                                               ("invariant", "causal"), ("invariant", "current")])
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_training_reproduces_the_theorys_recompute_iterates(tf, tb, tr, decay, accumulator, momentum):
    """T1-free, float64: the optimizer's iterates are simulate_quadratic's to rounding (1e-12 relative)."""
    kw = dict(lr=0.05, lam=1.0, tf=tf, tb=tb, tr=tr, delta=0.5, phi=0.3, steps=80, momentum=momentum)
    got = train_quadratic(decay=decay, accumulator=accumulator, **kw)
    want = theory.simulate_quadratic(0.05, 1.0, tf, tb, 0.5, steps=80, correction_decay=decay, momentum=momentum,
                                     tau_recomp=tr, phi=0.3, t2_accumulator=accumulator)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())
    assert np.abs(np.diff(want)).max() > 1e-3                    # the iterates move


def test_the_accumulators_differ_exactly_where_theory_says():
    """causal and current agree bit for bit when tau_bkwd = tau_recomp = 0 and differ otherwise."""
    kw = dict(lr=0.05, lam=1.0, delta=0.5, phi=0.3, steps=40, decay=0.3)
    same = [train_quadratic(tf=4, tb=0, tr=0, accumulator=a, **kw) for a in ("causal", "current")]
    assert np.array_equal(*same)
    other = [train_quadratic(tf=6, tb=2, tr=4, accumulator=a, **kw) for a in ("causal", "current")]
    assert np.abs(other[0] - other[1]).max() > 1e-6


def test_t2_on_the_recompute_weights_stabilises_what_recompute_destabilises():
    """PipeMare App. D: with recompute, delayed SGD (T1-free) diverges where T2 applied to the backward and the
    recompute weights converges. The theory's spectral radius predicts both; training shows both."""
    args = dict(lr=0.1, curvature=1.0, tau_fwd=6, tau_bkwd=0, delta=4.0, tau_recomp=3, phi=1.0)
    assert theory.spectral_radius(**args) > 1.1
    for decay in (0.1, "invariant"):
        assert theory.spectral_radius(**args, correction_decay=decay) < 0.96
    kw = dict(lr=0.1, lam=1.0, tf=6, tb=0, tr=3, delta=4.0, phi=1.0, steps=400, noise_std=0.0)
    plain = train_quadratic(**kw)
    assert not np.abs(plain[-1]) < 1e6                           # diverged (or overflowed)
    for decay in (0.1, "invariant"):
        corrected = train_quadratic(decay=decay, **kw)
        assert abs(corrected[-1]) < 1e-4


def test_gamma_rule_and_the_shared_names():
    """decay='invariant' is App. B.4's gamma = 1 - 2/(k+1) per stage, k = tau_fwd - tau_bkwd (theory.t2_gamma)."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]).double()
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4, schedule="dataflow",
                            corrections=[DiscrepancyCorrection("invariant")])
    t2 = opt.corrections[0]
    assert t2.gamma == [1 - 2 / (k + 1) for k in (7, 5, 3, 1)] == [theory.t2_gamma("invariant", k, 0)
                                                                   for k in (7, 5, 3, 1)]
    assert repr(t2) == "DiscrepancyCorrection(decay='invariant')"
    assert repr(DiscrepancyCorrection(0.2, "current")) == "DiscrepancyCorrection(decay=0.2, accumulator='current')"
    with pytest.raises(CorrectionError, match="'causal', 'current'"):
        DiscrepancyCorrection(0.2, "newest")
    with pytest.raises(CorrectionError, match="invariant"):
        DiscrepancyCorrection("invariants")
    assert theory.ACCUMULATORS == ("causal", "current")


def test_the_ring_is_as_deep_as_the_views_need_and_only_where_needed():
    """causal: 1 + max(tau_bkwd, tau_recomp) accumulators per corrected stage; current: one; none uncorrected;
    plus the table of factors 0, -1, .., -max(tau_fwd) (float64 here)."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)]).double()
    size = 12 * 8                                                # one stage: 3x3 + 3 float64
    sched = schedules.get("custom", tau_fwd=[5, 3, 2], tau_bkwd=[1, 0, 2], tau_recomp=[3, 0, 2])
    for accumulator, rows in (("causal", [4, 1, 0]), ("current", [1, 1, 0])):
        opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, schedule=sched,
                                corrections=[DiscrepancyCorrection(0.3, accumulator)])
        table = (5 + 1) * 8
        assert opt.corrections[0].extra_bytes() == sum(rows) * size + table
        assert opt.memory_bytes() == opt.history_bytes() + sum(rows) * size + table


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3)).double()
        self.opt = None

    def forward(self, x):
        x = self.opt.checkpoint(lambda h: torch.tanh(self.layers[1](torch.tanh(self.layers[0](h)))), x)
        return self.layers[2](x)


def _run(opt, model, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3, generator=g, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()


def _make(accumulator="causal", sched=None):
    model = Net()
    sched = sched or schedules.get("custom", tau_fwd=[5, 3, 1], tau_bkwd=[1, 1, 0], tau_recomp=[3, 2, 1])
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stages=3,
                            schedule=sched, corrections=[DiscrepancyCorrection(0.3, accumulator)])
    model.opt = opt
    return model, opt


def test_checkpoint_saves_and_loads_the_ring():
    """A run stopped and resumed from opt.state_dict() continues bit for bit (the past accumulators travel)."""
    model, opt = _make()
    _run(opt, model, 12, seed=1)
    whole = [p.detach().clone() for p in model.parameters()]
    model, opt = _make()
    _run(opt, model, 7, seed=1)
    state, weights = opt.state_dict(), model.state_dict()
    assert set(state["staleopt"]["corrections"][0]["rings"]) == {0, 1}
    model2, opt2 = _make()
    model2.load_state_dict(weights)
    opt2.load_state_dict(state)
    g = torch.Generator().manual_seed(1)
    for _ in range(7):                                            # skip the batches already seen
        torch.randn(4, 3, generator=g, dtype=torch.float64)
    for _ in range(5):
        opt2.zero_grad()
        model2(torch.randn(4, 3, generator=g, dtype=torch.float64)).pow(2).mean().backward()
        opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(model2.parameters(), whole))


def test_a_checkpoint_without_the_ring():
    """A T2 state holding only delta_t (saved before the causal accumulator) loads where no ring is needed
    (tau_bkwd = tau_recomp = 0, or accumulator='current'), and raises a CheckpointError where one is."""
    sched0 = schedules.get("custom", tau_fwd=[5, 3, 1], tau_bkwd=[0, 0, 0])
    model, opt = _make(sched=sched0)
    _run(opt, model, 3, seed=2)
    state = opt.state_dict()
    assert "rings" not in state["staleopt"]["corrections"][0]
    _, again = _make(sched=sched0)
    again.load_state_dict(state)
    assert torch.equal(again.corrections[0].delta(0), opt.corrections[0].delta(0))
    model, opt = _make("current")
    _run(opt, model, 3, seed=2)
    state = opt.state_dict()
    _, current = _make("current")
    current.load_state_dict(state)
    _, causal = _make("causal")
    with pytest.raises(OptimizerMismatchError, match="corrections .*accumulator='current'.* in the checkpoint"):
        causal.load_state_dict(state)  # today's checkpoints record the correction's settings
    older = copy.deepcopy(state)  # one saved when the signature named the corrections' classes only
    older["staleopt"]["signature"]["corrections"] = [type(k).__name__ for k in opt.corrections]
    with pytest.raises(CheckpointError, match="accumulator='current'"):
        causal.load_state_dict(older)


def test_run_config_takes_the_invariant_rule():
    from staleopt import methods
    from staleopt.config import RunConfig
    from staleopt.errors import ConfigError
    assert RunConfig(method="pipemare", decay="invariant").decay == "invariant"
    with pytest.raises(ConfigError, match="'invariant'"):
        RunConfig(method="pipemare", decay="invariants")
    _, corrections = methods.resolve("pipemare", decay="invariant")
    assert corrections[1].decay == "invariant"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_factor_table_rounds_as_float64_factors_and_as_add_alpha(dtype):
    """T2's factors ``0, -1, .., -max(tau_fwd)`` (in the weights' dtype where it holds them exactly) give the
    results float64 factors give, in every dtype; in float32/float64 also ``add_(alpha=...)``'s (the update
    as the paper writes it, ``w - k delta``)."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)]).to(dtype)
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, schedule="pipemare")
    (table,) = opt.corrections[-1]._factors.values()
    assert table.dtype == dtype and table.numel() == max(opt.max_delays[0]) + 1
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(1000, generator=g).to(dtype) for _ in table]
    d = [torch.randn(1000, generator=g).to(dtype) for _ in table]
    mine, wide = [x.clone() for x in w], [x.clone() for x in w]
    torch._foreach_addcmul_(mine, d, list(table.unbind()))
    torch._foreach_addcmul_(wide, d, [torch.tensor(-float(k), dtype=torch.float64) for k in range(len(w))])
    assert all(torch.equal(a, b) for a, b in zip(mine, wide))
    if dtype in (torch.float32, torch.float64):
        assert all(torch.equal(a, x.add(y, alpha=-float(k))) for k, (a, x, y) in enumerate(zip(mine, w, d)))
