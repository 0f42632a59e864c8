"""Corrections against their formulas (float64), composition, phases, the method zoo and bad inputs."""
import copy
import math

import pytest
import torch

import staleopt
from staleopt import methods, schedules
from staleopt.corrections import (DiscrepancyCorrection, LRReschedule, Stashing, VerticalSync, Warmup, WeightPrediction,
                                  t1_factor)
from staleopt.errors import CorrectionError, ScheduleError

from helpers import TRAINABLE_METHODS, batches, linears, mlp, mse, oracle_grads, snapshot, train


# ----------------------------------------------------------------------------- T1
def test_t1_factor_formula():
    K = 100
    assert t1_factor(0, 0, K) == 1.0                       # no delay: factor 1
    assert t1_factor(7, 0, K) == pytest.approx(1 / 7)        # k = 0: 1 / tau
    assert t1_factor(7, 50, K) == pytest.approx(7 ** -0.5)   # k = K/2: 1 / sqrt(tau)
    assert t1_factor(7, 100, K) == 1.0                      # k = K: base lr
    assert t1_factor(7, 1000, K) == 1.0                     # beyond K


@pytest.mark.parametrize("anneal_steps", [0, 1, 10, 1000])
def test_t1_factors_of_all_stages_are_t1_factor_bit_for_bit(anneal_steps):
    """lr_factors computes p_k once per step; every stage's factor is still t1_factor's, exactly."""
    t1 = LRReschedule(anneal_steps)
    taus = [0, 1, 2, 3, 7, 38, 77, 213]
    for step in (0, 1, 5, 9, 10, 11, 499, 999, 1000, 1001, 5000):
        assert t1.lr_factors((taus, [0] * len(taus)), step) == [t1_factor(t, step, anneal_steps) for t in taus]


def test_t1_applies_per_stage_lr_on_top_of_the_scheduler():
    """OneCycleLR drives the wrapper; each stage's SGD update is -scheduler_lr * factor * grad."""
    model = mlp(seed=1)
    K = 8
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                     schedule="pipemare-t1", method_args={"anneal_steps": K})
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20, cycle_momentum=False)
    tau = opt.tau_fwd
    assert tau == [5, 3, 1]
    for k, (x, y) in enumerate(batches(20, seed=1)):
        opt.zero_grad()
        mse(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad.clone() for p in model.parameters()]
        lr = sched.get_last_lr()[0]
        opt.step()
        for j, (p, b, g) in enumerate(zip(model.parameters(), before, grads)):
            stage = j // 2
            expected = b - lr * t1_factor(tau[stage], k, K) * g
            torch.testing.assert_close(p.detach(), expected, atol=1e-14, rtol=0)
        assert all(g["lr"] == lr for g in opt.param_groups)  # never overwritten
        sched.step()


# ----------------------------------------------------------------------------- T2
@pytest.mark.parametrize("accumulator", ["causal", "current"])
def test_t2_matches_hand_computation(accumulator):
    """gamma, delta and the corrected backward view (reading delta_(t - tau_bkwd), or delta_t), step by step,
    against explicit formulas."""
    D, lr = 0.3, 0.05
    tf, tb = [4, 2, 0], [1, 0, 0]
    model = mlp(seed=2)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr), stages=3,
                                     schedule=schedules.get("custom", tau_fwd=tf, tau_bkwd=tb),
                                     corrections=[DiscrepancyCorrection(D, accumulator=accumulator)])
    t2 = opt.corrections[0]
    gamma = [D ** (1 / 3), D ** (1 / 2), None]
    deltas = []  # delta_t of every step
    assert t2.gamma[0] == pytest.approx(gamma[0]) and t2.gamma[1] == pytest.approx(gamma[1])
    assert t2.gamma[2] is None
    hist = [snapshot(model)]
    delta = [[torch.zeros_like(w) for w in layer] for layer in hist[0]]
    for t, (x, y) in enumerate(batches(15, seed=2)):
        deltas.append(delta)
        Wf = [hist[max(t - tf[i], 0)][i] for i in range(3)]
        Wb = []
        for i in range(3):
            raw = hist[max(t - tb[i], 0)][i]
            read = delta[i] if accumulator == "current" else \
                deltas[t - tb[i]][i] if t >= tb[i] else [torch.zeros_like(w) for w in raw]
            Wb.append([w - (tf[i] - tb[i]) * d for w, d in zip(raw, read)] if tf[i] > tb[i] else raw)
        grads = oracle_grads(x, y, Wf, Wb)
        new = [[w - lr * g for w, g in zip(hist[-1][i], grads[i])] for i in range(3)]
        delta = list(delta)
        for i in range(2):
            delta[i] = [gamma[i] * d + (1 - gamma[i]) * (a - b) for d, a, b in zip(delta[i], new[i], hist[-1][i])]
        hist.append(new)
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
        for i, l in enumerate(linears(model)):
            torch.testing.assert_close(l.weight.detach(), new[i][0], atol=1e-12, rtol=0)
            torch.testing.assert_close(l.bias.detach(), new[i][1], atol=1e-12, rtol=0)
        for i in range(2):
            expect = torch.cat([delta[i][0].flatten(), delta[i][1]])
            torch.testing.assert_close(t2.delta(i), expect, atol=1e-12, rtol=0)
    rows = [2, 1] if accumulator == "causal" else [1, 1]  # causal: stage 0 also keeps delta_(t-1)
    table = max(opt.max_delays[0]) + 1  # T2's factors 0, -1, .., -max(tau_fwd)
    assert t2.extra_bytes() == (sum(r * s.numel for r, s in zip(rows, opt.partition.stages[:2])) + table) * 8
    with pytest.raises(CorrectionError, match="T2 keeps no delta for stage 2.*corrected stages: \\[0, 1\\]"):
        t2.delta(2)
    with pytest.raises(CorrectionError, match="stage = 3 must be an int in 0..2"):
        t2.delta(3)


# ----------------------------------------------------------------------------- prediction
def _expected_dw(kind, opt_state, group, grad, w_prev):
    """PipeOptim Table I (and the generic rule) from a snapshot, by explicit formulas."""
    if kind == "sgd":
        mu, wd, nesterov = group["momentum"], group["weight_decay"], group["nesterov"]
        if mu and not nesterov:
            return opt_state["momentum_buffer"]
        d = grad + wd * w_prev
        return d + mu * opt_state["momentum_buffer"] if mu else d
    if kind in ("adam", "adamw"):
        b1, b2 = group["betas"]
        k = float(opt_state["step"])
        m_hat = opt_state["exp_avg"] / (1 - b1 ** k)
        v_hat = opt_state["exp_avg_sq"] / (1 - b2 ** k)
        d = m_hat / (v_hat.sqrt() + group["eps"])
        return d + group["weight_decay"] * w_prev if kind == "adamw" else d
    raise AssertionError(kind)


PREDICTION_CASES = {
    "sgd-momentum": ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "sgd-momentum-wd-dampening": ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.2,
                                                                     weight_decay=0.01)),
    "sgd-nesterov-wd": ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                          weight_decay=0.01)),
    "sgd-plain-wd": ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.01)),
    "adam": ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01)),
    "adamw": ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
}


@pytest.mark.parametrize("case", sorted(PREDICTION_CASES))
def test_prediction_formula_and_information_availability(case):
    """Forward view at step t == w_{t-tau} - lr * tau * dW(state when w_{t-tau} was current)."""
    kind, make = PREDICTION_CASES[case]
    model = mlp(seed=3)
    opt = staleopt.PipelineOptimizer(model, make(model.parameters()), stages=3, schedule="pipeoptim")
    tau = opt.tau_fwd
    assert tau == [2, 1, 0]
    group = opt.param_groups[0]
    snaps = []  # snaps[t]: (w_t, base state after update t-1, grad of step t-1)
    last_grads = None
    for t, (x, y) in enumerate(batches(12, seed=3)):
        params = list(model.parameters())
        snaps.append(([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"]), last_grads,
                      snaps[-1][0] if snaps else None))
        opt.zero_grad()
        out = model(x)
        for stage in range(2):
            s = tau[stage]
            src = t - s
            for j in (2 * stage, 2 * stage + 1):
                w_src = snaps[max(src, 0)][0][j]
                if src <= 0:
                    expected = w_src  # before the first update there is no direction
                else:
                    w_prev, state, grad = snaps[src][3][j], snaps[src][1].get(j, {}), snaps[src][2][j]
                    expected = w_src - group["lr"] * s * _expected_dw(kind, state, group, grad, w_prev)
                torch.testing.assert_close(params[j].detach(), expected, atol=1e-12, rtol=0)
        for j in (4, 5):  # last stage: no delay, no prediction
            torch.testing.assert_close(params[j].detach(), snaps[t][0][j], atol=0, rtol=0)
        mse(out, y).backward()
        last_grads = [p.grad.clone() for p in params]
        opt.step()


def test_prediction_generic_fallback_is_the_last_applied_update_on_rmsprop():
    model = mlp(seed=4)
    lr = 1e-2
    opt = staleopt.PipelineOptimizer(model, torch.optim.RMSprop(model.parameters(), lr=lr), stages=3,
                                     schedule="pipeoptim")
    wp = opt.corrections[0]
    for x, y in batches(6, seed=4):
        before = torch.cat([p.detach().flatten() for p in opt.partition[0].params])
        train(model, opt, [(x, y)])
        after = torch.cat([p.detach().flatten() for p in opt.partition[0].params])
        torch.testing.assert_close(wp.direction(0), (before - after) / lr, atol=1e-12, rtol=0)



@pytest.mark.parametrize("tensor_lr", [False, True])
def test_prediction_generic_fallback_after_a_step_at_lr_zero_is_no_prediction(tensor_lr):
    """A warmup from lr = 0 (LambdaLR(k / W), HF's linear warmup): the step at lr 0 applied no update, so its dW
    is 0 (not 0 / 0, which wrote NaN into the stored versions and so every later forward); the later steps' dW
    is the last applied update over the lr again. Same with a Tensor lr (found on the device)."""
    model = mlp(seed=4)
    lr = torch.tensor(1e-2, dtype=torch.float64) if tensor_lr else 1e-2
    base = torch.optim.RMSprop(model.parameters(), lr=lr)
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="pipeoptim")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, k / 3))
    wp = opt.corrections[0]
    for k, (x, y) in enumerate(batches(6, seed=4)):
        step_lr = float(opt.param_groups[0]["lr"])
        before = torch.cat([p.detach().flatten() for p in opt.partition[0].params])
        train(model, opt, [(x, y)])
        after = torch.cat([p.detach().flatten() for p in opt.partition[0].params])
        if k == 0:
            assert step_lr == 0 and torch.equal(before, after)
            assert torch.equal(wp.direction(0), torch.zeros_like(before))
        else:
            torch.testing.assert_close(wp.direction(0), (before - after) / step_lr, atol=1e-10, rtol=1e-6)
        sched.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())

def test_prediction_generic_fallback_agrees_with_table_one_for_sgd_momentum():
    """The justification of the fallback: for SGD-momentum (w_{t-1} - w_t)/lr equals the momentum buffer."""
    model = mlp(seed=5)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="pipeoptim")
    wp = opt.corrections[0]
    wp._kind = "other"  # force the generic rule on an optimizer Table I covers
    train(model, opt, batches(5, seed=5))
    buf = torch.cat([base.state[p]["momentum_buffer"].flatten() for p in opt.partition[0].params])
    torch.testing.assert_close(wp.direction(0), buf, atol=1e-12, rtol=0)


def test_spectrain_and_xpipe_directions():
    model = mlp(seed=6)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="spectrain")
    train(model, opt, batches(4, seed=6))
    buf = torch.cat([base.state[p]["momentum_buffer"].flatten() for p in opt.partition[0].params])
    torch.testing.assert_close(opt.corrections[0].direction(0), buf, atol=0, rtol=0)

    # XPipe on SGD keeps its own Adam moments; on Adam it reads Adam's: m_hat / (sqrt(v_hat) + eps)
    m1, m2 = mlp(seed=7), mlp(seed=7)
    o1 = staleopt.PipelineOptimizer(m1, torch.optim.Adam(m1.parameters(), lr=1e-2), stages=3, schedule="xpipe")
    o2 = staleopt.PipelineOptimizer(m2, torch.optim.Adam(m2.parameters(), lr=1e-2), stages=3,
                                    schedule="1f1b", corrections=[WeightPrediction("adam", state="own")])
    train(m1, o1, batches(6, seed=7))
    train(m2, o2, batches(6, seed=7))
    torch.testing.assert_close(o1.corrections[0].direction(0), o2.corrections[0].direction(0), atol=1e-12, rtol=0)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- phases, sync, 2bw
def test_warmup_is_gpipe_then_switches_exactly():
    data = batches(10, seed=8)
    m1, m2 = mlp(seed=8), mlp(seed=8)
    o1 = staleopt.PipelineOptimizer(m1, torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9), stages=3,
                                    schedule="pipemare-w", method_args={"warmup_steps": 5, "anneal_steps": 4,
                                                                        "decay": 0.2})
    o2 = staleopt.PipelineOptimizer(m2, torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.9), stages=3,
                                    schedule="gpipe")
    taus = []
    for t, (x, y) in enumerate(data):
        taus.append(o1.tau_fwd)
        train(m1, o1, [(x, y)])
        if t < 5:
            train(m2, o2, [(x, y)])
            for a, b in zip(m1.parameters(), m2.parameters()):
                assert torch.equal(a, b)
    assert taus[:5] == [[0, 0, 0]] * 5   # then the pipeline refills: min(tau, t - 5) (PipeMare §4)
    assert taus[5:] == [[0, 0, 0], [1, 1, 1], [2, 2, 1], [3, 3, 1], [4, 3, 1]]
    t1 = o1.corrections[1]
    assert t1.lr_factors(([5, 3, 1], [0, 0, 0]), 5) == [pytest.approx(1 / 5), pytest.approx(1 / 3), 1.0]  # k = 0
    assert t1.lr_factors(([5, 3, 1], [0, 0, 0]), 9) == [1.0, 1.0, 1.0]  # k = 4 = K


def test_hybrid_is_pipelined_then_synchronous():
    model = mlp(seed=9)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                     schedule="pb-hybrid", method_args={"pipelined_steps": 4})
    taus = []
    for t, (x, y) in enumerate(batches(8, seed=9)):
        taus.append(opt.tau_fwd)
        w_t = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        out = model(x)
        if t >= 4:  # synchronous: the forward runs on w_t
            for p, w in zip(model.parameters(), w_t):
                assert torch.equal(p, w)
        mse(out, y).backward()
        opt.step()
    assert taus[:4] == [[4, 2, 0]] * 4 and taus[4:] == [[0, 0, 0]] * 4


def test_vertical_sync_and_2bw_delays():
    model = mlp(seed=10)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                     schedule="pipedream-vs")
    assert (opt.tau_fwd, opt.tau_bkwd) == ([2, 2, 2], [2, 2, 2])
    assert VerticalSync().delays([3, 2, 1], [0, 0, 0], 0) == ([3, 3, 3], [0, 0, 0])
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                     schedule="pipedream-2bw", microbatches=3)
    assert (opt.tau_fwd, opt.tau_bkwd) == ([1, 1, 1], [1, 1, 1])


def test_hogwild_through_the_optimizer_is_reproducible():
    runs = []
    for _ in range(2):
        model = mlp(seed=11)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                         schedule=schedules.get("hogwild", tau_max=4, means=[2.0, 1.5, 0.5]), seed=5)
        taus = []
        for x, y in batches(20, seed=11):
            taus.append(opt.tau_fwd)
            train(model, opt, [(x, y)])
        runs.append((taus, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(0 <= t <= 4 for ts in runs[0][0] for t in ts) and len({tuple(t) for t in runs[0][0]}) > 3
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- the zoo
ZOO_OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
}
SMALL_STEPS = {"anneal_steps": 30, "decay": 0.1, "warmup_steps": 10, "pipelined_steps": 50}


@pytest.mark.parametrize("method", TRAINABLE_METHODS)
def test_zoo_every_method_trains_and_round_trips(method):
    data = batches(100, seed=12, batch=4)
    args = {k: v for k, v in SMALL_STEPS.items() if k in methods.get(method).defaults}
    for name, make in ZOO_OPTIMIZERS.items():
        model = mlp(seed=12)
        N = 3 if method == "pipedream-2bw" else 1  # 2BW needs N >= P
        opt = staleopt.PipelineOptimizer(model, make(model.parameters()), stages=3, schedule=method,
                                         microbatches=N, method_args=args, seed=0)
        losses = train(model, opt, data[:60])
        assert all(math.isfinite(l) for l in losses), (method, name)
        sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        train(model, opt, data[60:])
        model2 = mlp(seed=0)
        model2.load_state_dict(msd)
        opt2 = staleopt.PipelineOptimizer(model2, make(model2.parameters()), stages=3, schedule=method,
                                          microbatches=N, method_args=args, seed=0)
        opt2.load_state_dict(sd)
        train(model2, opt2, data[60:])
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b), (method, name)


def test_method_table_and_resolution():
    rows = {r["method"]: r for r in methods.table()}
    assert rows["pipemare"]["corrections"] == "LRReschedule + DiscrepancyCorrection"
    assert rows["pipedream"]["schedule"] == "1f1b"
    sched, corr = methods.resolve("pipemare", decay=0.5)
    assert sched.name == "dataflow" and corr[1].decay == 0.5
    assert methods.resolve("1f1b")[1] == [] and methods.resolve("dataflow")[1] == []
    with pytest.raises(ScheduleError, match="accepts: accumulator, anneal_steps, decay"):
        methods.resolve("pipemare", warmup=3)


# ----------------------------------------------------------------------------- bad input
def test_bad_correction_inputs():
    with pytest.raises(CorrectionError, match="'optimizer'.*'sgdm'.*'adam'"):
        WeightPrediction("nesterov")
    with pytest.raises(CorrectionError, match="anneal_steps"):
        LRReschedule(-1)
    for d in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(CorrectionError, match=r"\(0, 1\)"):
            DiscrepancyCorrection(d)
    with pytest.raises(CorrectionError, match="Warmup"):
        Warmup(-3)
    model = mlp()
    with pytest.raises(CorrectionError, match="needs the state of SGD with momentum"):
        staleopt.PipelineOptimizer(model, torch.optim.Adam(model.parameters()), stages=3, schedule="1f1b",
                                   corrections=[WeightPrediction("sgdm", state="base")])
    with pytest.raises(CorrectionError, match="needs the state of Adam"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, schedule="1f1b",
                                   corrections=[WeightPrediction("adam", state="base")])
    with pytest.raises(CorrectionError, match="tau_bkwd = 0"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, schedule="2bw",
                                   microbatches=3, corrections=[WeightPrediction()])
    with pytest.raises(CorrectionError, match="Correction objects"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                   corrections=["t2"])
    with pytest.raises(CorrectionError, match=r"got one: Stashing\(\).*corrections=\[Stashing\(...\)\]"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                   corrections=Stashing())  # one object, not a list
    with pytest.raises(CorrectionError, match="takes a list of Correction objects.*got int 3"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, corrections=3)


def test_prediction_skips_parameters_outside_the_base_optimizer_and_follows_added_groups():
    for method in ("pipeoptim", "spectrain", "xpipe"):
        model = mlp(seed=13)
        params = list(model.parameters())
        with pytest.warns(UserWarning, match="will not train"):
            opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(params[2:], lr=0.05, momentum=0.9), stages=3,
                                             schedule=method)
        first = [p.detach().clone() for p in params[:2]]
        train(model, opt, batches(4, seed=13))
        for p, w in zip(params[:2], first):
            assert torch.equal(p, w)
        opt.add_param_group({"params": params[:2]})
        train(model, opt, batches(4, seed=14))
        assert not torch.equal(params[0], first[0])


def test_prediction_uses_the_t1_scaled_step_size():
    """Combined with T1, the stored prediction of stage 0 is w - (lr * factor) * s * dW."""
    model = mlp(seed=15)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="1f1b",
                                     corrections=[LRReschedule(100), WeightPrediction("optimizer")])
    train(model, opt, batches(3, seed=15))
    wp = opt.corrections[1]
    w_t = torch.cat([p.detach().flatten() for p in opt.partition[0].params])
    buf = torch.cat([base.state[p]["momentum_buffer"].flatten() for p in opt.partition[0].params])
    factor = t1_factor(2, 3, 100)
    opt.zero_grad()
    x, y = batches(1, seed=16)[0]
    mse(model(x), y).backward()
    opt.step()  # step 3 stores the prediction made from w_3 and the state after update 2
    stored = torch.cat([v.flatten() for v in opt.chunks[0].stored(3)])
    torch.testing.assert_close(stored, w_t - 0.05 * factor * 2 * buf, atol=1e-12, rtol=0)
    assert wp.direction(0).shape == buf.shape
