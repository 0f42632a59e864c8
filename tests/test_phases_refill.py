"""PipeMareW's refill after the warmup (PipeMare §4) and the hybrid's switch (stale-weights §4) in training:
the engine's delays and the weights each pass reads equal the executed timeline's, pass by pass; a float64
PipeMareW (refill + T1 + T2) against a hand-written reference; the phases' convention with T1 and T2."""
import pytest
import torch

import staleopt
from staleopt import methods
from staleopt.corrections import DiscrepancyCorrection, Hybrid, LRReschedule, Warmup, refill, t1_factor
from staleopt.timeline import simulate

from helpers import batches, mlp, mse, oracle_grads, snapshot

SIZES = (5, 7, 6, 6, 3)  # four Linear layers: one stage each
P = 4


def _run(opt, model, data, N):
    """Train with N microbatch passes per step; per step and pass: (tau_fwd, tau_bkwd, forward view, backward
    view) as the engine had them, and every version w_0 .. w_K."""
    versions, seen = [snapshot(model)], []
    for x, y in data:
        opt.zero_grad()
        passes = []
        for xs, ys in zip(x.chunk(N), y.chunk(N)):
            out = model(xs)
            record = [list(opt.tau_fwd), list(opt.tau_bkwd), snapshot(model), None]
            out.register_hook(lambda g, r=record: r.__setitem__(3, snapshot(model)))
            (mse(out, ys) / N).backward()
            passes.append(record)
        opt.step()
        versions.append(snapshot(model))
        seen.append(passes)
    return seen, versions


CASES = [("pipemare-w", dict(warmup_steps=w, anneal_steps=5, decay=0.3), N) for w in (0, 1, 3, 6) for N in (1, 2, 3)] \
    + [("pb-hybrid", dict(pipelined_steps=p), N) for p in (0, 2, 5) for N in (1, 2)]


@pytest.mark.parametrize("name,args,N", CASES)
def test_engine_delays_and_reads_equal_the_executed_timeline(name, args, N):
    """Every pass of every step: the engine's delays equal the executed timeline's (after the run-start
    clamp min(tau, t), which the engine applies as w_{t - tau} = w_0) and equal Pipeline.microbatch_delays_at;
    with the raw views (no T2) the weights each forward and backward pass reads are w_{version} of the event."""
    K = 12
    pipeline = methods.build(name, P, N, **args)
    timeline = simulate(pipeline, P, N, K)
    model = mlp(SIZES, seed=2)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=P,
                                     schedule=name, method_args=args, microbatches=N, microbatch_passes=True)
    seen, _ = _run(opt, model, batches(K, in_dim=SIZES[0], batch=6 * N, seed=3), N)
    # the same pipeline without T2 (whose backward view is rewritten): the raw reads, checked against the events
    phase = Warmup(args["warmup_steps"]) if "warmup_steps" in args else Hybrid(args["pipelined_steps"])
    raw_model = mlp(SIZES, seed=2)
    raw = staleopt.PipelineOptimizer(raw_model, torch.optim.SGD(raw_model.parameters(), lr=0.05), stages=P,
                                     schedule=pipeline.schedule, corrections=[phase], microbatches=N,
                                     microbatch_passes=True)
    raw_seen, versions = _run(raw, raw_model, batches(K, in_dim=SIZES[0], batch=6 * N, seed=3), N)
    for t in range(K):
        expected = pipeline.microbatch_delays_at(t)
        for j in range(N):
            tf, tb = seen[t][j][:2]
            assert [min(d, t) for d in tf] == [row[j] for row in expected.fwd]
            assert [min(d, t) for d in tb] == [row[j] for row in expected.bkwd]
            assert raw_seen[t][j][:2] == seen[t][j][:2]
    for e in timeline.events:
        if e.kind == "R":
            continue
        t, j = e.minibatch, e.microbatch - e.minibatch * N
        tf, tb, fwd_view, bkwd_view = raw_seen[t][j]
        delay = (tf if e.kind == "F" else tb)[e.stage]
        assert min(delay, t) == e.delay, (e, delay)
        view = fwd_view if e.kind == "F" else bkwd_view
        assert all(torch.equal(a, b) for a, b in zip(view[e.stage], versions[e.version][e.stage])), e


def test_refill_by_hand():
    """P = 4, N = 1, W = 3: dataflow delays [7, 5, 3, 1]; steps 0-2 read w_t, step 3 too (the pipeline is
    empty), then one more version of delay each step up to the steady state."""
    model = mlp(SIZES, seed=1)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=P,
                                     corrections=[Warmup(3)])
    taus = []
    for x, y in batches(13, in_dim=SIZES[0], seed=1):
        taus.append(opt.tau_fwd)
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    assert taus[:4] == [[0, 0, 0, 0]] * 4
    assert taus[4:8] == [[1, 1, 1, 1], [2, 2, 2, 1], [3, 3, 3, 1], [4, 4, 3, 1]]
    assert taus[8:] == [[5, 5, 3, 1], [6, 5, 3, 1]] + [[7, 5, 3, 1]] * 3
    assert refill([7, 5, 3, 1], 2) == [2, 2, 2, 1] and Warmup(3).delays([7, 5], [0, 0], None) == ([7, 5], [0, 0])


def _reference_pipemare_w(model, data, lr, W, K, D):
    """Hand-written PipeMareW on an MLP with one Linear per stage, plain SGD (PipeMare §3-4):
    d_i(t) = 0 (t < W), min(tau_i, t - W) (t >= W); u_fwd_i = w_{t - d_i}; T2: u_bkwd_i = w_t - d_i delta_i,
    delta_{t+1} = gamma_i delta_t + (1 - gamma_i)(w_{t+1} - w_t), gamma_i = D^(1/tau_i) with the asynchronous
    tau_i; T1: lr_i = lr / d_i^(1 - min(k/K, 1)), k = max(t - W, 0)."""
    tau = [2 * (P - 1 - i) + 1 for i in range(P)]
    gamma = [D ** (1.0 / f) for f in tau]
    ws = [snapshot(model)]
    delta = [[torch.zeros_like(a) for a in layer] for layer in ws[0]]
    for t, (x, y) in enumerate(data):
        d = [0 if t < W else min(f, t - W) for f in tau]
        k = max(t - W, 0)
        wf = [ws[max(t - d[i], 0)][i] for i in range(P)]
        wb = [[a - d[i] * e for a, e in zip(ws[t][i], delta[i])] for i in range(P)]
        grads = oracle_grads(x, y, wf, wb)
        new = [[a - lr * t1_factor(d[i], k, K) * g for a, g in zip(ws[t][i], grads[i])] for i in range(P)]
        delta = [[gamma[i] * e + (1 - gamma[i]) * (n - a) for e, n, a in zip(delta[i], new[i], ws[t][i])]
                 for i in range(P)]
        ws.append(new)
    return ws


@pytest.mark.parametrize("W", [0, 2, 5])
def test_pipemare_w_equals_a_hand_written_float64_reference(W):
    K, D, lr, steps = 6, 0.3, 0.05, 16
    data = batches(steps, in_dim=SIZES[0], seed=4)
    model = mlp(SIZES, seed=5)
    ref = _reference_pipemare_w(mlp(SIZES, seed=5), data, lr, W, K, D)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr), stages=P,
                                     schedule="pipemare-w", method_args={"warmup_steps": W, "anneal_steps": K,
                                                                         "decay": D})
    for t, (x, y) in enumerate(data):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
        for mine, theirs in zip(snapshot(model), ref[t + 1]):
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, atol=1e-13, rtol=0)


def _flat(layer):
    return torch.cat([a.reshape(-1) for a in layer])


def test_t1_and_t2_across_the_switch():
    """T1: k counts from the switch and tau_i is the step's refilling delay (factor 1 through the warmup and
    while the delay is 0 or 1); T2: gamma_i from the asynchronous delays, u_bkwd_i = w_t - d_i(t) delta_i with
    the step's gap d_i(t) (none at the switch, where the refilling delay is 0, though delta tracked the warmup)."""
    W, K = 3, 8
    model = mlp(SIZES, seed=6)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=P,
                                     corrections=[Warmup(W), LRReschedule(K), DiscrepancyCorrection(0.2)])
    t2 = opt.corrections[2]
    assert opt.phase_offset == W
    assert t2.gamma == [pytest.approx(0.2 ** (1 / f)) for f in (7, 5, 3, 1)]
    factors = []
    for t, (x, y) in enumerate(batches(10, in_dim=SIZES[0], seed=6)):
        opt.zero_grad()
        out = model(x)
        backward = []
        out.register_hook(lambda g: backward.append(snapshot(model)))
        delta = [t2.delta(i).clone() for i in range(P)]
        mse(out, y).backward()
        tf, w_t = opt.tau_fwd, snapshot(model)
        assert tf == refill([7, 5, 3, 1], max(t - W, 0)) and opt.tau_bkwd == [0] * P
        for i in range(P):
            if tf[i] == 0:
                assert torch.equal(_flat(backward[0][i]), _flat(w_t[i]))
            else:
                torch.testing.assert_close(_flat(backward[0][i]), _flat(w_t[i]) - tf[i] * delta[i], atol=1e-15, rtol=0)
        if t == W:
            assert all(d.abs().max() > 0 for d in delta)          # delta tracked the warmup's updates
        opt.step()
        factors.append([opt.lr_factor(i) for i in range(P)])
        assert factors[-1] == [t1_factor(d, max(t - W, 0), K) for d in tf]
    assert factors[:W + 2] == [[1.0] * P] * (W + 2)     # the warmup, the switch (delay 0), delay 1
    assert factors[W + 2] == [pytest.approx(2 ** -(1 - 2 / K))] * 3 + [1.0]
