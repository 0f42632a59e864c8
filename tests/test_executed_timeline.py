"""Train an MLP by literally executing a pipeline timeline; compare with PipelineOptimizer (docs/design.md §1, §4).

The executor below knows nothing about delays. Each stage (one Linear+tanh)
keeps its own weights and their past versions; it runs the forward and
backward passes of :func:`staleopt.timeline.simulate` in slot order, each with
the weight version that event reads — the forward computes
``x_out = tanh(W x_in + b)`` and stores ``x_in, x_out``; the backward computes
``dz = delta_out * (1 - x_out^2)`` from the stored activations, the weight
gradient ``dz^T x_in`` and the error ``dz W`` with the weights the backward
reads — and applies its optimizer step when the schedule's update lands. The
loss of a minibatch is the mean over its microbatches of the mean squared
error. PipelineOptimizer with the same method must reach the same weights:
with one pass per minibatch where every microbatch of a minibatch reads the
same version, and with ``microbatch_passes=True`` (one pass per microbatch)
everywhere, including 1F1B, dataflow and pb with ``N > 1``.
"""
import pytest
import torch
from torch import nn

from staleopt import PipelineOptimizer
from staleopt.timeline import simulate

WIDTHS = [6, 5, 4, 5, 3]          # 4 stages
MB_SIZE = 3
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-3


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers).double()


def make_data(minibatches: int, microbatches: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    M = minibatches * microbatches
    xs = torch.randn(M, MB_SIZE, WIDTHS[0], generator=g, dtype=torch.float64)
    ys = torch.randn(M, MB_SIZE, WIDTHS[-1], generator=g, dtype=torch.float64)
    return xs, ys


def execute_timeline(method: str, model: nn.Sequential, xs, ys, minibatches: int, microbatches: int):
    """Run ``simulate(method, ...)`` event by event; return each stage's final (W, b)."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    P, N = len(linears), microbatches
    tl = simulate(method, stages=P, microbatches=N, minibatches=minibatches)
    params = [[l.weight.detach().clone(), l.bias.detach().clone()] for l in linears]
    opts = [torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY) for ps in params]
    versions = [[(W.clone(), b.clone())] for W, b in params]      # versions[i][v] = stage i's w_v
    grads = [[torch.zeros_like(W), torch.zeros_like(b)] for W, b in params]
    acts, deltas = {}, {}
    updates = {}
    for stage, slot, t in tl.updates:
        updates.setdefault(slot, []).append((stage, t))
    by_slot = {}
    for e in tl.events:
        by_slot.setdefault(e.slot, []).append(e)
    for slot in range(tl.slots):
        for e in by_slot.get(slot, []):                  # in execution order (a cell's F before its B)
            i, m = e.stage, e.microbatch
            W, b = versions[i][e.version]
            if e.kind == "F":
                x_in = xs[m] if i == 0 else acts[(i - 1, m)][1]
                acts[(i, m)] = (x_in, torch.tanh(x_in @ W.T + b))
            else:
                x_in, x_out = acts[(i, m)]
                if i == P - 1:                         # d/dx_out of mean_j mean((x_out - y)^2)
                    delta_out = 2 * (x_out - ys[m]) / (x_out.numel() * N)
                else:
                    delta_out = deltas.pop((i, m))
                dz = delta_out * (1 - x_out ** 2)
                grads[i][0] += dz.T @ x_in
                grads[i][1] += dz.sum(0)
                if i > 0:
                    deltas[(i - 1, m)] = dz @ W           # W^T delta with the weights the backward reads
        for stage, t in updates.get(slot, []):          # updates land at the end of the slot
            for p, g in zip(params[stage], grads[stage]):
                p.grad = g.clone()
                g.zero_()
            opts[stage].step()
            assert len(versions[stage]) == t + 1
            versions[stage].append(tuple(p.clone() for p in params[stage]))
    return params


def run_optimizer(method: str, model: nn.Sequential, xs, ys, minibatches: int, microbatches: int):
    P = sum(isinstance(m, nn.Linear) for m in model)
    base = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    opt = PipelineOptimizer(model, base, stages=P, schedule=method, microbatches=microbatches)
    N = microbatches
    for t in range(minibatches):
        x = xs[t * N:(t + 1) * N].reshape(-1, WIDTHS[0])
        y = ys[t * N:(t + 1) * N].reshape(-1, WIDTHS[-1])
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()          # = mean over microbatches of their means
        loss.backward()
        opt.step()
    return [[m.weight.detach(), m.bias.detach()] for m in model if isinstance(m, nn.Linear)]


def run_optimizer_per_microbatch(method: str, model: nn.Sequential, xs, ys, minibatches: int, microbatches: int):
    """One forward/backward per microbatch (``microbatch_passes=True``): pass j sees microbatch j's delays."""
    P = sum(isinstance(m, nn.Linear) for m in model)
    base = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    opt = PipelineOptimizer(model, base, stages=P, schedule=method, microbatches=microbatches,
                            microbatch_passes=True)
    N = microbatches
    for t in range(minibatches):
        opt.zero_grad()
        for j in range(N):
            m = t * N + j
            (((model(xs[m]) - ys[m]) ** 2).mean() / N).backward()
        opt.step()
    return [[m.weight.detach(), m.bias.detach()] for m in model if isinstance(m, nn.Linear)]


def max_diff(a, b):
    return max((p - q).abs().max().item() for ps, qs in zip(a, b) for p, q in zip(ps, qs))


@pytest.mark.parametrize("method,microbatches", [
    ("1f1b", 1),             # 1F1B without stashing: stale forward, current backward
    ("pipedream", 1),        # 1F1B + weight stashing
    ("dataflow", 1),         # PipeMare's asynchronous dataflow pipeline
    ("pb", 1),               # pipelined backprop on 2P-1 accelerators
    ("gpipe", 3),            # synchronous: every microbatch reads w_t
    ("pipedream-flush", 2),
    ("pipedream-2bw", 4),    # N >= P: every microbatch of minibatch t reads w_{t-1}, both passes
    ("pipedream-2bw", 5),
])
def test_executed_timeline_equals_pipeline_optimizer(method, microbatches):
    K = 30
    xs, ys = make_data(K, microbatches, seed=1)
    executed = execute_timeline(method, make_model(0), xs, ys, K, microbatches)
    model = make_model(0)
    initial = [p.detach().clone() for p in model.parameters()]
    simulated = run_optimizer(method, model, xs, ys, K, microbatches)
    assert max_diff(executed, simulated) <= 1e-10
    # the weights moved, so the comparison is not vacuous
    assert max((p.detach() - q).abs().max().item() for p, q in zip(model.parameters(), initial)) > 1e-2


@pytest.mark.parametrize("method,microbatches", [("1f1b", 2), ("1f1b", 3), ("pipedream", 2), ("dataflow", 2),
                                                 ("dataflow", 4), ("pb", 3), ("gpipe", 2), ("pipedream-2bw", 4)])
def test_microbatch_passes_reproduce_the_executed_pipeline_exactly(method, microbatches):
    """With one pass per microbatch, microbatch j of every minibatch reads w_{t - ceil((D_i - j)/N)} as in
    the executed pipeline, and the weights agree to 1e-10 where the single-pass closed form cannot."""
    K = 30
    xs, ys = make_data(K, microbatches, seed=3)
    executed = execute_timeline(method, make_model(0), xs, ys, K, microbatches)
    simulated = run_optimizer_per_microbatch(method, make_model(0), xs, ys, K, microbatches)
    assert max_diff(executed, simulated) <= 1e-10


@pytest.mark.parametrize("method", ["1f1b", "dataflow"])
def test_closed_form_is_an_approximation_when_microbatches_read_different_versions(method):
    """With N > 1 the later microbatches of a minibatch read newer weights than the first
    (``tau_fwd[i][j] = ceil((D_i - j)/N)``); one pass per minibatch gives all of them the first one's
    delay, so the executed pipeline and PipelineOptimizer part ways — and the executor sees it
    (``microbatch_passes=True`` closes the gap, tested above)."""
    K, N = 30, 2
    assert not simulate(method, 4, N, 2).uniform
    xs, ys = make_data(K, N, seed=2)
    executed = execute_timeline(method, make_model(0), xs, ys, K, N)
    simulated = run_optimizer(method, make_model(0), xs, ys, K, N)
    assert max_diff(executed, simulated) > 1e-6
