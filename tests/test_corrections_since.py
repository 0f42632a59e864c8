"""The corrections published since the seeds against their formulas (float64), docs/corrections.md.

The model is a chain of shifts, ``out = x + a_0 + ... + a_{P-1}`` with loss ``0.5 |out - y|^2``, one
stage per shift: stage ``i``'s gradient is ``out - y`` with every stage's forward view in ``out``,
whatever its backward view, so each test's oracle writes the whole iteration by hand (a list of weight
versions, ``w_v = w_0`` for ``v < 0``) without the engine.
"""
import copy
import math

import pytest
import torch
from torch import nn

import staleopt
from staleopt import hardware, methods, schedules
from staleopt.corrections import (DelayCompensation, DiscrepancyCorrection, GapAware, LRReschedule,
                                  NesterovLookahead, StalenessAware, Stashing, Warmup, WeightPrediction, t1_factor)
from staleopt.errors import CorrectionError

from helpers import batches, mlp, train

P, DIM, LR, STEPS = 3, 2, 0.1, 12


class Shift(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a, dtype=torch.float64))

    def forward(self, x):
        return x + self.a


def chain(values=((0.3, -0.2), (0.1, 0.4), (-0.5, 0.2))):
    return nn.Sequential(*[Shift(v) for v in values])


def data(steps=STEPS, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(DIM, generator=g, dtype=torch.float64), torch.randn(DIM, generator=g, dtype=torch.float64))
            for _ in range(steps)]


def run_engine(corrections, schedule="dataflow", steps=STEPS, memory="minimal", base=None):
    model = chain()
    opt = staleopt.PipelineOptimizer(model, (base or (lambda ps: torch.optim.SGD(ps, lr=LR)))(model.parameters()),
                                     stages=P, schedule=schedule, corrections=corrections, memory=memory)
    history = []
    for x, y in data(steps):
        opt.zero_grad()
        (0.5 * ((model(x) - y) ** 2).sum()).backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history, opt


def oracle(update, tau, steps=STEPS):
    """``w_{t+1,i} = update(i, t, g_i, W)`` with ``g_i = x + sum_j w_{t - tau_j, j} - y``; ``W[v]`` the versions."""
    W = [[p.detach().clone() for p in chain().parameters()]]
    out = []
    for t, (x, y) in enumerate(data(steps)):
        stale = [W[max(t - tau[j], 0)][j] for j in range(P)]
        g = x + sum(stale) - y
        W.append([update(i, t, g.clone(), W) for i in range(P)])
        out.append(W[-1])
    return out


def assert_iterates(got, want):
    for t, (a, b) in enumerate(zip(got, want)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.allclose(u, v, rtol=1e-13, atol=1e-15), f"step {t}, stage {i}: {u} != {v}"


TAU = [5, 3, 1]  # dataflow, P = 3, N = 1


def stale(W, t, i, tau):
    return W[max(t - tau, 0)][i]


# ----------------------------------------------------------------------------- DC-ASGD
@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("stash", [False, True])
def test_delay_compensation_constant_lambda(memory, stash):
    lam = 0.7

    def update(i, t, g, W):
        w = W[t][i]
        return w - LR * (g + lam * g * g * (w - stale(W, t, i, TAU[i])))

    got, _ = run_engine(([Stashing()] if stash else []) + [DelayCompensation(lam)], memory=memory)
    assert_iterates(got, oracle(update, TAU))


def test_delay_compensation_adaptive_lambda():
    lam, m, eps = 2.0, 0.95, 1e-7
    ms = [torch.zeros(DIM, dtype=torch.float64) for _ in range(P)]

    def update(i, t, g, W):
        ms[i] = m * ms[i] + (1 - m) * g * g
        w = W[t][i]
        return w - LR * (g + lam / (ms[i] + eps).sqrt() * g * g * (w - stale(W, t, i, TAU[i])))

    got, _ = run_engine([DelayCompensation(lam, mean_square_decay=m, eps=eps)])
    assert_iterates(got, oracle(update, TAU))


def test_delay_compensation_by_hand_one_scalar_stage():
    """P = 2 (delays 3 and 1), scalars: the first steps written out."""
    model = nn.Sequential(Shift([1.0]), Shift([0.0]))
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.5), stages=2,
                                     corrections=[DelayCompensation(0.5)])
    assert opt.tau_fwd == [3, 1]
    a0, a1 = [], []
    for _ in range(3):
        opt.zero_grad()
        (0.5 * (model(torch.zeros(1, dtype=torch.float64)) ** 2).sum()).backward()
        opt.step()
        a0.append(model[0].a.item()), a1.append(model[1].a.item())
    # t = 0: g = 1 + 0 = 1 for both stages; w_t = w_stale: a0 = 1 - 0.5 = 0.5, a1 = 0 - 0.5 = -0.5
    # t = 1: g = a0(w_-2 = w_0) + a1(w_0) = 1; stage 1 reads w_0: a1 = -0.5 - 0.5 (1 + 0.5 * 1 * (-0.5 - 0)) = -0.875
    #        stage 0 reads w_0: a0 = 0.5 - 0.5 (1 + 0.5 * 1 * (0.5 - 1)) = 0.125
    # t = 2: g = a0(w_0) + a1(w_1) = 1 - 0.5 = 0.5
    #        a0 = 0.125 - 0.5 (0.5 + 0.5 * 0.25 * (0.125 - 1)) = 0.125 - 0.5 * 0.390625 = -0.0703125
    #        a1 = -0.875 - 0.5 (0.5 + 0.5 * 0.25 * (-0.875 + 0.5)) = -0.875 - 0.5 * 0.453125 = -1.1015625
    assert a0 == [0.5, 0.125, -0.0703125] and a1 == [-0.5, -0.875, -1.1015625]


# ----------------------------------------------------------------------------- Gap-Aware
class OtherSGD(torch.optim.SGD):
    """SGD's step under another type: GapAware measures C from the applied step over it."""


@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_gap_aware_over_sgd_takes_c_from_the_undamped_gradient(memory):
    """The authors' SGD rule: v from the raw gradient, first; C = eta_max (sqrt(v / (1 - beta^k)) + eps), k = t + 1."""
    beta, eps = 0.9, 1e-8
    v = [torch.zeros(DIM, dtype=torch.float64) for _ in range(P)]

    def update(i, t, g, W):
        w = W[t][i]
        v[i] = beta * v[i] + (1 - beta) * g * g
        C = LR * ((v[i] / (1 - beta ** (t + 1))).sqrt() + eps)
        return w - LR * g / (1 + (w - stale(W, t, i, TAU[i])).abs() / C)

    got, _ = run_engine([GapAware(beta, eps)], memory=memory)
    assert_iterates(got, oracle(update, TAU))


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_gap_aware_over_sgd_leaves_the_gradient_undamped_while_the_largest_lr_is_0(tensor_lr):
    """A warmup from lr = 0 (its scheduler built before the wrapper): C = eta_max (...) was 0, so G = 1 + 0/0 and
    the weights became NaN at the first step (a group frozen at lr = 0 too). The authors skip such a group: G = 1
    until eta_max > 0."""
    beta, eps = 0.9, 1e-8
    v = [torch.zeros(DIM, dtype=torch.float64) for _ in range(P)]
    lr = [LR * min(1.0, t / 3) for t in range(STEPS)]

    def update(i, t, g, W):
        w, eta = W[t][i], max(lr[:t + 1])
        v[i] = beta * v[i] + (1 - beta) * g * g
        if eta > 0:
            g = g / (1 + (w - stale(W, t, i, TAU[i])).abs() / (eta * ((v[i] / (1 - beta ** (t + 1))).sqrt() + eps)))
        return w - lr[t] * g

    model = chain()
    base = torch.optim.SGD(model.parameters(), lr=torch.tensor(LR, dtype=torch.float64) if tensor_lr else LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(base, lambda t: min(1.0, t / 3))
    opt = staleopt.PipelineOptimizer(model, base, stages=P, schedule="dataflow", corrections=[GapAware(beta, eps)])
    got = []
    for x, y in data():
        opt.zero_grad()
        (0.5 * ((model(x) - y) ** 2).sum()).backward()
        opt.step()
        schedule.step()
        got.append([p.detach().clone() for p in model.parameters()])
    assert_iterates(got, oracle(update, TAU))


def test_gap_aware_over_sgd_momentum_uses_the_buffer_the_largest_lr_and_damps_weight_decay():
    """With momentum the direction is the buffer the previous step left (0 at first); eta_max is the largest lr
    so far; SGD's weight decay enters as lambda w / G."""
    beta, eps, mu, wd = 0.8, 1e-8, 0.7, 0.05
    lrs = [0.02, 0.06, 0.1, 0.08, 0.05, 0.03, 0.02, 0.1, 0.04, 0.01, 0.03, 0.02]
    model = chain()
    base = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=mu, weight_decay=wd)
    opt = staleopt.PipelineOptimizer(model, base, stages=P, corrections=[GapAware(beta, eps)])
    got = []
    for (x, y), lr in zip(data(), lrs):
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        (0.5 * ((model(x) - y) ** 2).sum()).backward()
        opt.step()
        got.append([p.detach().clone() for p in model.parameters()])
    v = [torch.zeros(DIM, dtype=torch.float64) for _ in range(P)]
    buf = [torch.zeros(DIM, dtype=torch.float64) for _ in range(P)]
    W, want = [[p.detach().clone() for p in chain().parameters()]], []
    for t, ((x, y), lr) in enumerate(zip(data(), lrs)):
        g = x + sum(stale(W, t, j, TAU[j]) for j in range(P)) - y
        new = []
        for i in range(P):
            w = W[t][i]
            v[i] = beta * v[i] + (1 - beta) * buf[i] * buf[i]
            C = max(lrs[:t + 1]) * ((v[i] / (1 - beta ** (t + 1))).sqrt() + eps)
            G = 1 + (w - stale(W, t, i, TAU[i])).abs() / C
            buf[i] = mu * buf[i] + (g + wd * w) / G
            new.append(w - lr * buf[i])
        W.append(new)
        want.append(new)
    assert_iterates(got, want)


@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_gap_aware_over_other_optimizers_divides_by_the_gap_in_average_steps(memory):
    beta, eps = 0.9, 1e-8
    v = [torch.zeros(DIM, dtype=torch.float64) for _ in range(P)]

    def update(i, t, g, W):
        w = W[t][i]
        if t > 0:  # k = t steps measured
            C = (v[i] / (1 - beta ** t)).sqrt() + eps
            g = g / (1 + (w - stale(W, t, i, TAU[i])).abs() / C)
        new = w - LR * g
        v[i] = beta * v[i] + (1 - beta) * (new - w) ** 2
        return new

    got, opt = run_engine([GapAware(beta, eps)], memory=memory, base=lambda ps: OtherSGD(ps, lr=LR))
    assert not opt.corrections[0].from_direction
    assert_iterates(got, oracle(update, TAU))


def test_gap_aware_by_hand():
    """One stage of delay 1 behind one of delay 3 (P = 2), scalars, beta = 0.5."""
    model = nn.Sequential(Shift([1.0]), Shift([0.0]))
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.5), stages=2,
                                     corrections=[GapAware(0.5, eps=1e-300)])
    seen = []
    for _ in range(2):
        opt.zero_grad()
        (0.5 * (model(torch.zeros(1, dtype=torch.float64)) ** 2).sum()).backward()
        opt.step()
        seen.append((model[0].a.item(), model[1].a.item()))
    # eta_max = 0.5; C = 0.5 sqrt(v_k / (1 - 0.5^k)), v_k = 0.5 v_{k-1} + 0.5 g^2 from the raw gradient
    # t = 0: k = 1, g = 1: v = 0.5, C = 0.5; every version is w_0, G = 1: a = (0.5, -0.5)
    # t = 1: k = 2, g = 1 (both read w_0): v = 0.75, C = 0.5 sqrt(0.75 / 0.75) = 0.5;
    #        gaps |0.5 - 1| = 0.5 and |-0.5 - 0| = 0.5: G = 1 + 1 = 2, g = 0.5
    #        a = (0.5 - 0.25, -0.5 - 0.25)
    assert seen == [(0.5, -0.5), (0.25, -0.75)]


def test_gap_aware_leaves_a_parameter_that_did_not_move_undamped():
    """A gap of 0 means G = 1 exactly, however stale: the gradient passes unchanged."""
    model = chain()
    model[0].a.requires_grad_(True)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=P,
                                     corrections=[GapAware()])
    ga = opt.corrections[0]
    for x, y in data(4):
        opt.zero_grad()
        (0.5 * ((model(x) - y) ** 2).sum()).backward()
        model[0].a.grad[0] = 0.0  # element 0 of stage 0 never moves
        opt.step()
    G = ga.gap(opt.chunks[0], opt.step_count, 5)
    assert G[0][0].item() == 1.0 and G[0][1].item() > 1.0


def test_gap_aware_bias_corrects_a_late_parameter_by_its_own_steps():
    """Over SGD a parameter handed to the base by ``add_param_group`` after ``K`` steps starts its running mean
    square then: at its first step ``C = eta (|d| + eps)``, as at a run's first step (a global count bias-corrected
    its one-step average by ``1 - beta^(K+1)``: ``C`` too small by ``sqrt(1 - beta)``, the gradient damped harder)."""
    model = chain()
    with pytest.warns(UserWarning, match="not in the base optimizer"):
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD([model[0].a, model[1].a], lr=LR), stages=P,
                                         corrections=[GapAware(0.5, eps=1e-300)])
    ga, W = opt.corrections[0], [model[2].a.detach().clone()]
    for k, (x, y) in enumerate(data(8)):
        if k == 6:
            opt.add_param_group({"params": [model[2].a]})
        opt.zero_grad()
        (0.5 * ((model(x) - y) ** 2).sum()).backward()
        d = model[2].a.grad.clone()
        opt.step()
        W.append(model[2].a.detach().clone())
        if k == 6:
            G = ga.gap(opt.chunks[2], opt.step_count, 1)[0]
            torch.testing.assert_close((W[-1] - W[-2]).abs() / (G - 1), LR * d.abs(), rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- Staleness-aware
def test_staleness_aware_divides_the_step_by_tau():
    def update(i, t, g, W):
        return W[t][i] - LR / TAU[i] * g

    got, _ = run_engine([StalenessAware()])
    assert_iterates(got, oracle(update, TAU))


def test_t1_generalises_staleness_aware():
    """T1's factor with p_k = 1 (k = 0) is Zhang et al.'s 1/tau; it anneals to 1, theirs does not."""
    sa = StalenessAware()
    for k in (0, 10, 1000):
        assert sa.lr_factors(([7, 3, 0], [0, 0, 0]), k) == [1 / 7, 1 / 3, 1.0]
    assert [t1_factor(t, 0, 100) for t in (7, 3, 0)] == pytest.approx([1 / 7, 1 / 3, 1.0], rel=1e-15)
    assert t1_factor(7, 100, 100) == 1.0


# ----------------------------------------------------------------------------- Nesterov look-ahead
@pytest.mark.parametrize("max_momentum", [None, 0.99])
def test_nesterov_lookahead(max_momentum):
    mu = 0.8
    gammas = [mu if max_momentum is None else mu + t * (max_momentum - mu) / (max(TAU) + 1) for t in TAU]
    m = [torch.zeros(DIM, dtype=torch.float64) for _ in range(P)]

    def update(i, t, g, W):
        m[i] = gammas[i] * m[i] + g
        return W[t][i] - LR * (g + gammas[i] * m[i])

    got, opt = run_engine([NesterovLookahead(mu, max_momentum)])
    assert opt.corrections[0].gammas == pytest.approx(gammas, rel=1e-15)
    assert_iterates(got, oracle(update, TAU))
    assert torch.allclose(opt.corrections[0].momentum_buffer(0), m[0], rtol=1e-13)


def test_nesterov_with_no_delay_is_torch_nesterov_sgd():
    """tau = 0: the correction over plain SGD is torch's SGD(momentum, nesterov=True), bit for bit."""
    model, ref = mlp(seed=3), mlp(seed=3)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.0),
                                     stages=3, schedule="sync", corrections=[NesterovLookahead(0.9)])
    base = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    data_ = batches(6, seed=4)
    train(model, opt, data_)
    train(ref, base, data_)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_nesterov_adaptive_momentum_equals_the_reference_rule_on_1f1b():
    """AsyncPP's --adaptive_momentum: gamma_i = mu + (P - 1 - i)(0.99 - mu)/P on a 1F1B pipeline."""
    model = mlp((5, 7, 6, 6, 3), seed=0)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01), stages=4,
                                     schedule="pipedream", corrections=[NesterovLookahead(0.9, 0.99)])
    assert opt.tau_fwd == [3, 2, 1, 0]
    assert opt.corrections[-1].gammas == pytest.approx([0.9 + (4 - 1 - i) * 0.09 / 4 for i in range(4)], rel=1e-15)


def test_nesterov_warns_when_the_base_keeps_momentum():
    model = mlp(seed=0)
    with pytest.warns(UserWarning, match="holds the momentum"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stages=3,
                                   corrections=[NesterovLookahead()])


# ----------------------------------------------------------------------------- composition and checkpoints
def test_compensation_composes_with_t1_t2_and_warmup():
    """DC after PipeMare's T1 and T2 behind a warmup: T1 scales the step, DC reads the raw stale weights."""
    lam, K, W0 = 0.5, 6, 2
    got, _ = run_engine([Warmup(W0), LRReschedule(K), DiscrepancyCorrection(0.3), DelayCompensation(lam)])

    def tau_at(t):  # PipeMareW refills after its warmup: min(tau_i, t - W) (docs/schedules.md)
        return [0] * P if t < W0 else [min(tau, t - W0) for tau in TAU]

    def update(i, t, g, W):
        w = W[t][i]
        tau = tau_at(t)[i]
        return w - LR * t1_factor(tau, max(t - W0, 0), K) * (g + lam * g * g * (w - stale(W, t, i, tau)))

    Wv = [[p.detach().clone() for p in chain().parameters()]]
    want = []
    for t, (x, y) in enumerate(data()):
        g = x + sum(Wv[max(t - tau_at(t)[j], 0)][j] for j in range(P)) - y  # shifts: T2's backward view is inert
        Wv.append([update(i, t, g.clone(), Wv) for i in range(P)])
        want.append(Wv[-1])
    assert_iterates(got, want)


@pytest.mark.parametrize("make", [lambda: [DelayCompensation(0.3, 0.9)], lambda: [GapAware(0.9)],
                                  lambda: [NesterovLookahead(0.7, 0.95)], lambda: [StalenessAware()],
                                  lambda: [Stashing(), GapAware(), DelayCompensation()]],
                         ids=["dc-a", "ga", "nag", "sa", "stash+ga+dc"])
@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_state_dict_round_trip_continues_bit_for_bit(make, memory):
    first = data(16)
    model = chain()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=P, corrections=make(),
                                     memory=memory)

    def steps(m, o, batch):
        for x, y in batch:
            o.zero_grad()
            (0.5 * ((m(x) - y) ** 2).sum()).backward()
            o.step()

    steps(model, opt, first[:7])
    sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    steps(model, opt, first[7:])
    model2 = chain(((0.0, 0.0),) * P)
    model2.load_state_dict(msd)
    opt2 = staleopt.PipelineOptimizer(model2, torch.optim.SGD(model2.parameters(), lr=LR), stages=P,
                                      corrections=make(), memory=memory)
    opt2.load_state_dict(sd)
    steps(model2, opt2, first[7:])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_compensation_and_gap_need_the_raw_history():
    model = mlp(seed=0)
    for c in (DelayCompensation(), GapAware()):
        with pytest.raises(CorrectionError, match="raw weight history"):
            staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                       schedule="1f1b", corrections=[WeightPrediction(), c])


def test_extra_bytes_count_each_buffer():
    sizes = {}  # 3 stages of 2 float64: 16 bytes each; every stage delayed
    for key, make in {"dc": lambda: DelayCompensation(), "dc-a": lambda: DelayCompensation(2.0, 0.95),
                      "ga": lambda: GapAware(), "nag": lambda: NesterovLookahead(), "sa": lambda: StalenessAware()}.items():
        model = chain()
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=P,
                                         corrections=[make()])
        sizes[key] = opt.corrections[0].extra_bytes()
    # DC: the kept oldest version per delayed stage; DC-a and GA: plus one statistic each; NAG: the momentum and
    # its 0-d gamma per view (float64)
    assert sizes == {"dc": 3 * 16, "dc-a": 6 * 16, "ga": 6 * 16, "nag": 3 * 16 + 3 * 8, "sa": 0}


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make, match", [
    (lambda: DelayCompensation(0), "positive"),
    (lambda: DelayCompensation(-1.0), "lambda of DC-ASGD"),
    (lambda: DelayCompensation("0.1"), "positive"),
    (lambda: DelayCompensation(0.1, mean_square_decay=1.0), r"None \(DC-ASGD-c"),
    (lambda: DelayCompensation(0.1, mean_square_decay=True), r"\[0, 1\)"),
    (lambda: DelayCompensation(0.1, eps=0), "square root"),
    (lambda: GapAware(1.0), r"\(0, 1\)"),
    (lambda: GapAware(0.9, eps=-1), "positive"),
    (lambda: NesterovLookahead(1.0), r"\[0, 1\)"),
    (lambda: NesterovLookahead(-0.1), r"\[0, 1\)"),
    (lambda: NesterovLookahead(0.9, 0.5), r"max_momentum\) must be a float in \[0.9, 1\)"),
    (lambda: NesterovLookahead(0.9, 1.0), r"\[0.9, 1\)"),
])
def test_bad_arguments_raise_typed_errors(make, match):
    with pytest.raises(CorrectionError, match=match):
        make()


def test_momentum_buffer_of_a_missing_stage():
    model = chain()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=P,
                                     corrections=[NesterovLookahead()])
    with pytest.raises(CorrectionError, match="0..2"):
        opt.corrections[0].momentum_buffer(3)


# ----------------------------------------------------------------------------- methods and the hardware model
def test_named_methods():
    assert [type(c).__name__ for c in methods.get("dc-asgd-a").corrections] == ["Stashing", "DelayCompensation"]
    assert methods.get("dc-asgd-a").corrections[1].mean_square_decay == 0.95
    assert methods.get("dc-asgd").corrections[1].mean_square_decay is None
    assert [type(c).__name__ for c in methods.get("staleness-aware").corrections] == ["StalenessAware"]
    p = methods.build("staleness-aware", 4)
    assert p.lr_factors(0) == p.lr_factors(10 ** 6) == [1 / 7, 1 / 5, 1 / 3, 1.0]
    assert methods.build("pipemare-stash-nesterov", 4).stashes and methods.build("gap-aware", 4).stashes


def test_hardware_counts_the_new_buffers():
    w = [10, 20, 30, 40]
    tau = [7, 5, 3, 1]  # dataflow, P = 4
    sgdm = "sgd-momentum"
    assert hardware.correction_bytes(methods.build("staleness-aware", 4), w, sgdm) == 0
    # with stashing the stale versions are the stash: only the statistics are extra
    assert hardware.correction_bytes(methods.build("dc-asgd", 4), w, sgdm) == 0
    assert hardware.correction_bytes(methods.build("dc-asgd-a", 4), w, sgdm) == 100
    assert hardware.correction_bytes(methods.build("gap-aware", 4), w, sgdm) == 100
    nag = methods.build("pipemare-stash-nesterov", 4)
    assert hardware.correction_bytes(nag, w, "sgd") == 100  # the momentum, all stages
    # without stashing the stage keeps tau_i versions itself
    bare = methods.Pipeline("dc", schedules.get("dataflow"), [DelayCompensation()], 4)
    assert hardware.correction_bytes(bare, w, sgdm) == sum(a * t for a, t in zip(w, tau))
    bare = methods.Pipeline("ga", schedules.get("dataflow"), [GapAware(), DelayCompensation()], 4)
    assert hardware.correction_bytes(bare, w, sgdm) == sum(a * t for a, t in zip(w, tau)) + 100


def test_memory_report_adds_the_correction_bytes():
    model = mlp(seed=0)
    plain = hardware.memory_report(model, "pipemare-stash", 3)
    for name, extra in [("gap-aware", 1), ("dc-asgd", 0), ("dc-asgd-a", 1)]:
        rep = hardware.memory_report(model, name, 3)
        delayed = sum(rep.stage_weight_bytes[i] for i, t in enumerate(rep.tau_fwd) if t > 0)
        assert rep.correction_bytes == extra * delayed
        assert rep.weight_optimizer_bytes == plain.weight_optimizer_bytes + rep.correction_bytes
    nag = hardware.memory_report(model, "pipemare-stash-nesterov", 3, optimizer="sgd")
    assert nag.correction_bytes == nag.weights_bytes
    assert nag.weight_optimizer_bytes == hardware.memory_report(model, "pipemare-stash", 3,
                                                                optimizer="sgd-momentum").weight_optimizer_bytes


@pytest.mark.parametrize("method", ["pipemare-stash-nesterov", "dc-asgd-a"])
def test_a_parameter_the_base_does_not_hold_yet_feeds_no_state_and_resumes_exactly(method):
    """Nesterov's momentum and DC-ASGD-a's MeanSquare were built from the .grad of every model parameter, also one
    the base optimizer did not hold yet: that gradient, which the base's zero_grad never clears, added up step after
    step, and a run resumed from a checkpoint (which holds no .grad) then differed from the uninterrupted one."""
    import io
    steps, added, saved_at = 6, 3, 2
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64))
            for _ in range(steps)]

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).double()
        base = torch.optim.SGD(list(model[0].parameters()) + list(model[2].parameters()), lr=0.05)
        return model, staleopt.PipelineOptimizer(model, base, stages=3, schedule=method)

    def run(model, opt, start, stop):
        for i in range(start, stop):
            if i == added:
                opt.add_param_group({"params": list(model[4].parameters())})
            opt.zero_grad()
            ((model(data[i][0]) - data[i][1]) ** 2).mean().backward()
            opt.step()

    model, opt = build()
    run(model, opt, 0, steps)
    model2, opt2 = build()
    run(model2, opt2, 0, saved_at)
    buf = io.BytesIO()
    torch.save({"model": model2.state_dict(), "opt": opt2.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model3, opt3 = build()
    model3.load_state_dict(saved["model"])
    opt3.load_state_dict(saved["opt"])
    run(model3, opt3, saved_at, steps)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model3.parameters()))


@pytest.mark.parametrize("saved_with, loaded_into", [
    (lambda: [staleopt.corrections.WeightPrediction("adam", state="own")],
     lambda: [staleopt.corrections.WeightPrediction("adam", state="own", betas=(0.5, 0.9), eps=1e-2)]),
    (lambda: [staleopt.corrections.WeightPrediction("sgdm")],
     lambda: [staleopt.corrections.WeightPrediction("sgdm", momentum=0.5)]),
    (lambda: [staleopt.corrections.Stashing(), DelayCompensation(2.0, 0.95)],
     lambda: [staleopt.corrections.Stashing(), DelayCompensation(2.0, 0.95, eps=1e-2)])])
def test_a_checkpoint_is_refused_by_a_correction_with_other_settings(saved_with, loaded_into):
    """WeightPrediction's own momentum, betas and eps and DelayCompensation's eps were not in their repr (the
    checkpoint's signature): a checkpoint loaded into other settings without a word. At their defaults they stay out
    of it, so that checkpoints written before still load."""
    from staleopt.errors import OptimizerMismatchError

    def build(corrections):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
        return staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=2,
                                          schedule="1f1b", corrections=corrections)
    state = build(saved_with()).state_dict()
    build(saved_with()).load_state_dict(state)
    with pytest.raises(OptimizerMismatchError):
        build(loaded_into()).load_state_dict(state)
    assert repr(saved_with()[-1]) in ("WeightPrediction(rule='adam', state='own')",
                                      "WeightPrediction(rule='sgdm', state='auto')",
                                      "DelayCompensation(lam=2.0, mean_square_decay=0.95)")


@pytest.mark.parametrize("method", ["pipeoptim", "gap-aware", "dc-asgd-a"])
def test_a_correction_reads_the_groups_load_state_dict_puts_in_place(method):
    """The corrections read the base's groups once per change of them (Correction.group_of); load_state_dict keeps
    each group's params list but puts new group dicts in place, whose lr a correction then reads: a run loaded into
    an optimizer that had stepped at another lr continues as the run it was saved from."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64))
            for _ in range(6)]

    def build(lr):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).double()
        base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        return model, staleopt.PipelineOptimizer(model, base, stages=3, schedule=method)

    def run(model, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()

    model, opt = build(0.05)
    run(model, opt, data[:3])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    run(model, opt, data[3:])
    other, opt2 = build(0.5)
    run(other, opt2, data[:2])  # (its corrections have read its groups, at lr 0.5)
    other.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    run(other, opt2, data[3:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
