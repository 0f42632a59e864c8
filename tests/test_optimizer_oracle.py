"""The contract of docs/design.md §1 against hand-derived gradients and a store-everything reference (float64)."""
import torch

import staleopt
from staleopt import schedules

from helpers import batches, mlp, mse, train


def test_hand_derived_oracle_mlp_custom_delays():
    """3-layer MLP, P=3, tau_fwd=(3,1,0), tau_bkwd=(1,0,0), plain SGD: explicit matrix formulas, 20 steps."""
    model = mlp((5, 7, 6, 3))
    lin = [m for m in model if isinstance(m, torch.nn.Linear)]
    W = [[l.weight.detach().clone(), l.bias.detach().clone()] for l in lin]
    history = [[[w.clone() for w in layer] for layer in W]]  # history[t][layer] = (weight, bias) of w_t
    lr, tf, tb = 0.05, (3, 1, 0), (1, 0, 0)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr), stages=3,
                                     schedule=schedules.get("custom", tau_fwd=list(tf), tau_bkwd=list(tb)))
    data = batches(20)
    for t, (x, y) in enumerate(data):
        def view(i, tau):
            return history[max(t - tau, 0)][i]
        # forward with u_fwd
        Wf = [view(i, tf[i]) for i in range(3)]
        Wb = [view(i, tb[i]) for i in range(3)]
        a0 = x
        h1 = torch.tanh(a0 @ Wf[0][0].T + Wf[0][1])
        h2 = torch.tanh(h1 @ Wf[1][0].T + Wf[1][1])
        out = h2 @ Wf[2][0].T + Wf[2][1]
        # backward: errors propagate with u_bkwd, weight gradients use forward activations
        d3 = (out - y) / x.shape[0]
        g3 = (d3.T @ h2, d3.sum(0))
        d2 = (d3 @ Wb[2][0]) * (1 - h2 ** 2)
        g2 = (d2.T @ h1, d2.sum(0))
        d1 = (d2 @ Wb[1][0]) * (1 - h1 ** 2)
        g1 = (d1.T @ a0, d1.sum(0))
        cur = history[-1]
        history.append([[w - lr * g for w, g in zip(cur[i], gi)] for i, gi in enumerate((g1, g2, g3))])

        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
        for i, l in enumerate(lin):
            torch.testing.assert_close(l.weight.detach(), history[-1][i][0], atol=1e-10, rtol=0)
            torch.testing.assert_close(l.bias.detach(), history[-1][i][1], atol=1e-10, rtol=0)
    assert opt.step_count == 20


def _stage_params(model, stage):
    lin = [m for m in model if isinstance(m, torch.nn.Linear)]
    return [lin[stage].weight, lin[stage].bias]


def reference_delayed_sgd(model, data, lr, tau, momentum=0.0):
    """w_{t+1} = w_t - lr * grad f(w_{t-tau}) per stage, storing every past weight vector."""
    lin = [m for m in model if isinstance(m, torch.nn.Linear)]
    hist = [[torch.cat([l.weight.detach().flatten(), l.bias.detach()]) for l in lin]]
    shapes = [(l.weight.shape, l.bias.shape) for l in lin]
    buf = [torch.zeros_like(h) for h in hist[0]]
    for t, (x, y) in enumerate(data):
        ws = []
        for i, (ws_, bs_) in enumerate(shapes):
            v = hist[max(t - tau[i], 0)][i].clone().requires_grad_(True)
            ws.append(v)
        h = x
        for i, (wshape, bshape) in enumerate(shapes):
            n = wshape.numel()
            h = h @ ws[i][:n].view(wshape).T + ws[i][n:]
            if i < len(shapes) - 1:
                h = torch.tanh(h)
        grads = torch.autograd.grad(mse(h, y), ws)
        new = []
        for i, g in enumerate(grads):
            buf[i] = momentum * buf[i] + g if t > 0 or momentum else g
            new.append(hist[-1][i] - lr * (buf[i] if momentum else g))
        hist.append(new)
    return hist[-1]


def test_stashing_equals_per_stage_delayed_gradient_sgd():
    model = mlp((5, 7, 6, 3), seed=3)
    tau = [4, 2, 0]
    ref = reference_delayed_sgd(mlp((5, 7, 6, 3), seed=3), batches(25, seed=4), 0.05, tau)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                     schedule=schedules.get("custom", tau_fwd=tau),
                                     corrections=[staleopt.corrections.Stashing()])
    assert opt.tau_bkwd == tau
    train(model, opt, batches(25, seed=4))
    lin = [m for m in model if isinstance(m, torch.nn.Linear)]
    for i, l in enumerate(lin):
        got = torch.cat([l.weight.detach().flatten(), l.bias.detach()])
        torch.testing.assert_close(got, ref[i], atol=1e-10, rtol=0)


def test_pipedream_method_is_stashed_1f1b():
    model = mlp(seed=5)
    ref = reference_delayed_sgd(mlp(seed=5), batches(15, seed=6), 0.05, [2, 1, 0])
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                     schedule="pipedream")
    assert (opt.tau_fwd, opt.tau_bkwd) == ([2, 1, 0], [2, 1, 0])
    train(model, opt, batches(15, seed=6))
    lin = [m for m in model if isinstance(m, torch.nn.Linear)]
    for i, l in enumerate(lin):
        torch.testing.assert_close(torch.cat([l.weight.detach().flatten(), l.bias.detach()]), ref[i],
                                   atol=1e-10, rtol=0)


def test_foreach_and_loop_paths_agree_exactly():
    outs = []
    for foreach in (True, False):
        model = mlp(seed=7)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         stages=3, schedule="dataflow", microbatches=2, foreach=foreach)
        train(model, opt, batches(12, seed=8))
        outs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_gradient_accumulation_sees_the_same_views():
    """Two forward/backward passes per step on half batches == one pass on the full batch."""
    data = batches(10, seed=9, batch=8)
    results = []
    for split in (1, 2):
        model = mlp(seed=10)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                         schedule=schedules.get("custom", tau_fwd=[3, 1, 0], tau_bkwd=[1, 0, 0]))
        for x, y in data:
            opt.zero_grad()
            for xs, ys in zip(x.chunk(split), y.chunk(split)):
                (mse(model(xs), ys) / split).backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


import pytest  # noqa: E402


@pytest.mark.parametrize("method", ["pipemare", "pipedream", "dataflow", "pipeoptim", "hogwild"])
def test_repeated_passes_within_a_step_see_the_same_views(method):
    """Accumulation over 1, 2 or 4 forward/backward passes, with an evaluation and an abandoned pass
    (what a GradScaler-skipped step leaves) in between, gives the same weights: swaps never lose a version."""
    data = batches(12, seed=12, batch=8)
    results = []
    plain = mlp(seed=13)
    opt = staleopt.PipelineOptimizer(plain, torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9),
                                     stages=3, schedule=method, seed=3)
    train(plain, opt, data)
    results.append([p.detach().clone() for p in plain.parameters()])
    for split in (1, 2, 4):
        model = mlp(seed=13)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         stages=3, schedule=method, seed=3)
        for x, y in data:
            opt.zero_grad()
            mse(model(x), y).backward()  # abandoned pass
            opt.zero_grad()
            with torch.no_grad():
                model(x)
            for xs, ys in zip(x.chunk(split), y.chunk(split)):
                (mse(model(xs), ys) / split).backward()
                with opt.current_weights():
                    pass
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("method", ["dataflow", "pipedream", "pipemare", "pipeoptim", "hogwild", "pb", "1f1b"])
def test_fast_memory_mode_gives_the_same_weights(method):
    """memory="fast" (copies through a spare slot) equals the swap-based minimal history exactly,
    with repeated passes, evaluation in between and a resumed checkpoint."""
    data = batches(14, seed=20, batch=8)
    results = []
    for memory in ("minimal", "fast"):
        model = mlp(seed=21)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         stages=3, schedule=method, seed=4, memory=memory)
        for k, (x, y) in enumerate(data):
            opt.zero_grad()
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                (mse(model(xs), ys) / 2).backward()
                if k % 3 == 0:
                    with torch.no_grad():
                        model.eval()
                        model(xs)
                        model.train()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
        H = sum(c.H * c.numel for c in opt.chunks) * 8
        if memory == "fast":
            assert opt.history_bytes() == sum((c.H + 1) * c.numel for c in opt.chunks if c.H) * 8
        elif method != "pipemare":
            assert opt.history_bytes() == H
    for a, b in zip(*results):
        assert torch.equal(a, b)
