"""A training pass reads the stored versions in place: the parameters point at the history's rows
(docs/engine.md, "Parameters that point at the history"), and everything outside the pass sees
their own storage holding ``w_t``. Every case is checked bit for bit against the reference engine,
which copies every view."""
import copy
import math
import warnings

import pytest
import torch
from torch import nn

import staleopt
from helpers import batches, mlp, mse
from staleopt.reference import ReferencePipelineOptimizer

SIZES = (5, 24, 24, 24, 3)


def conv_mlp(seed=0):
    """Convolutions (``conv1d`` saves the weight itself) and linear layers (``F.linear`` saves ``weight.t()``)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Unflatten(1, (1, 5)), nn.Conv1d(1, 4, 3, padding=1), nn.Tanh(),
                         nn.Conv1d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(20, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def _inside(p, ring):
    start = ring.data_ptr()
    return start <= p.data_ptr() < start + ring.numel() * ring.element_size()


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("method", ["dataflow", "pipedream", "pipemare"])
def test_a_pass_reads_the_rows_and_everything_else_the_own_storage(method, memory):
    """During a training pass the delayed stages' parameters point into their rows; after the backward pass,
    in eval and in ``state_dict`` between the forward and the backward, they are their own storage with
    ``w_t``. Reading ``w_t`` mid-pass does not change the gradient (the backward points at the row again)."""
    runs = []
    for cls in (ReferencePipelineOptimizer, staleopt.PipelineOptimizer):
        model = conv_mlp(seed=2)
        own = [p.data_ptr() for p in model.parameters()]
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=4, schedule=method,
                  memory=memory) if cls is staleopt.PipelineOptimizer else \
            cls(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=4, schedule=method)
        for step, (x, y) in enumerate(batches(8, in_dim=5, out_dim=3, batch=6, seed=3)):
            opt.zero_grad()
            out = model(x)
            if cls is staleopt.PipelineOptimizer and step >= 2:
                delayed = [v for v in opt.chunks if v.H and opt.tau_fwd[v.stage]]
                assert delayed and all(_inside(p, v.ring) for v in delayed for p in v.params)
            with opt.current_weights():
                at_rest = {k: t.clone() for k, t in model.state_dict().items()}
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
            assert [p.data_ptr() for p in model.parameters()] == own
            mse(out, y).backward()
            assert [p.data_ptr() for p in model.parameters()] == own
            assert all(torch.equal(at_rest[k], t) for k, t in model.state_dict().items())
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _scaled_run(cls, method, memory, bad_steps):
    model = mlp(SIZES, seed=5)
    kw = {"memory": memory} if cls is staleopt.PipelineOptimizer else {}
    opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=4, schedule=method, **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for k, (x, y) in enumerate(batches(7, in_dim=SIZES[0], out_dim=SIZES[-1], seed=6)):
        if k in bad_steps:
            x = x.clone()
            x[0, 0] = math.inf
        opt.zero_grad()
        scaler.scale(mse(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    return opt, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("method, memory", [("dataflow", "fast"), ("pipedream", "minimal"), ("pipemare", "fast")])
def test_a_step_a_grad_scaler_skips_runs_again_exactly(method, memory):
    """``torch.amp.GradScaler`` skips ``step()`` after an inf gradient, so the same step runs again: where a pass
    drops nothing (``"fast"``'s spare row, T2's included; stashing's row is never written) it trains on, bit for
    bit the reference."""
    ref_opt, ref = _scaled_run(ReferencePipelineOptimizer, method, None, {3, 4})
    opt, mine = _scaled_run(staleopt.PipelineOptimizer, method, memory, {3, 4})
    assert opt.step_count == ref_opt.step_count == 5
    assert all(torch.equal(a, b) for a, b in zip(ref, mine))


@pytest.mark.parametrize("method", ["dataflow", "pipemare"])
def test_a_skipped_step_after_minimal_dropped_its_version_is_refused(method):
    """In ``memory="minimal"`` the last pass writes its backward view over ``w_(t-H)`` (dataflow: ``w_t``;
    pipemare: T2's ``w_t - tau delta``): the step run again after a skipped ``step()`` cannot read it, and says
    so (never a silently different view)."""
    with pytest.raises(staleopt.errors.LoopError, match="GradScaler skips step.*memory='fast'"):
        _scaled_run(staleopt.PipelineOptimizer, method, "minimal", {3})


def test_microbatch_forwards_ahead_of_their_backwards_are_refused():
    """``microbatch_passes=True``: pass ``j`` reads microbatch ``j``'s delays forward and backward. Two forwards
    whose graphs would share one row with different versions (a summed loss) raise; one forward and backward
    per microbatch trains bit for bit the reference."""
    data = batches(4, in_dim=SIZES[0], out_dim=SIZES[-1], batch=6, seed=8)

    def run(cls, summed):
        model = mlp(SIZES, seed=9)
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4, schedule="pipedream",
                  microbatches=2, microbatch_passes=True)
        for x, y in data:
            opt.zero_grad()
            parts = list(zip(x.chunk(2), y.chunk(2)))
            if summed:
                sum(mse(model(a), b) / 2 for a, b in parts).backward()
            else:
                for a, b in parts:
                    (mse(model(a), b) / 2).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(ReferencePipelineOptimizer, False),
                                                  run(staleopt.PipelineOptimizer, False)))
    with pytest.raises(staleopt.errors.LoopError, match="microbatch_passes=True, microbatch j.s backward before"):
        run(staleopt.PipelineOptimizer, True)


def test_microbatch_passes_more_or_fewer_than_n_say_so():
    """``microbatch_passes=True`` with ``N = 2``: a third training forward in a step raises with the count and the
    fix; a step after one pass warns once that the second microbatch did not run."""
    model = mlp(SIZES, seed=9)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4,
                                     schedule="dataflow", microbatches=2, microbatch_passes=True)
    (x, y), = batches(1, in_dim=SIZES[0], out_dim=SIZES[-1], batch=6, seed=8)
    opt.zero_grad()
    for a, b in zip(x.chunk(2), y.chunk(2)):
        mse(model(a), b).backward()
    with pytest.raises(staleopt.errors.LoopError, match=r"training forward 3 since the last zero_grad\(\) or step\(\)"
                                                        r".*N=2.*x.chunk\(N\)"):
        model(x)
    opt.step()
    with pytest.warns(UserWarning, match=r"step\(\) after 1 of N=2 microbatch passes.*microbatches 1..1"):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
        for a, b in zip(x.chunk(2), y.chunk(2)):  # (a full step: no warning either)
            mse(model(a), b).backward()
        opt.step()


def _pair(run, method, memory, **kw):
    """``run(model, opt)`` with the reference engine and with this one: the weights, bit for bit."""
    out = []
    for cls in (ReferencePipelineOptimizer, staleopt.PipelineOptimizer):
        model = mlp(SIZES, seed=5)
        extra = {"memory": memory} if cls is staleopt.PipelineOptimizer else {}
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=4, schedule=method,
                  **extra, **kw)
        run(model, opt)
        out.append([p.detach().clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("method", ["dataflow", "pipedream", "pipemare"])
def test_a_retained_graph_reads_its_backward_views_again(method, memory):
    """A graph kept with ``retain_graph=True`` aliases the rows its forward read until the next forward: a second
    backward through it (at once, or after another pass's forward and backward) reads the backward views again."""
    data = batches(7, in_dim=SIZES[0], out_dim=SIZES[-1], batch=6, seed=3)

    def twice(model, opt):
        for x, y in data:
            opt.zero_grad()
            out = model(x)
            mse(out, y).backward(retain_graph=True)
            (out ** 2).mean().backward()
            opt.step()

    def interleaved(model, opt):
        for x, y in data:
            opt.zero_grad()
            a = model(x[:3])
            mse(a, y[:3]).backward(retain_graph=True)
            mse(model(x[3:]), y[3:]).backward()
            (a ** 2).mean().backward()
            opt.step()

    assert _pair(twice, method, memory)
    assert _pair(interleaved, method, memory)


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("method", ["dataflow", "pipedream"])
def test_a_rollback_during_a_pass_trains_as_the_reference(method, memory):
    """A checkpoint loaded between a training forward and its backward (the model's and the optimizer's, in either
    order, or the optimizer's alone) replaces ``w_t``, not the rows the pass pointed the parameters at."""
    data = batches(9, in_dim=SIZES[0], out_dim=SIZES[-1], batch=6, seed=3)

    def rollback(order):
        def run(model, opt):
            saved = None
            for k, (x, y) in enumerate(data):
                if k == 3:
                    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
                opt.zero_grad()
                out = model(x)
                if k == 5:
                    for which in order:
                        (model if which == "model" else opt).load_state_dict(saved[which == "opt"])
                    continue
                mse(out, y).backward()
                opt.step()
        return run

    for order in (("model", "opt"), ("opt", "model"), ("opt",)):
        assert _pair(rollback(order), method, memory)


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("schedule", ["sync", "dataflow", "pipedream"])
def test_one_middle_parameter_given_new_storage_is_refused(schedule, memory):
    """``p.data = p.data * mask`` (pruning) on a parameter neither first nor last of its stage raises
    ``LoopError`` naming the in-place fix, before any update (the storage check compared the first and last
    parameter only: the engine pointed the pruned parameter back at its old storage, and the pruned values
    vanished without a word)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=2,
                                     schedule=schedule, memory=memory)
    x = torch.ones(3, 2)
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    bias = model[0].bias  # stage 0 = 0.weight, 0.bias, 1.weight, 1.bias
    bias.data = torch.zeros_like(bias)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(staleopt.errors.LoopError, match=r"p.data = new_tensor.*change weights in place"):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    assert torch.equal(bias, torch.zeros(2))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing updated


@pytest.mark.parametrize("mid_pass", [True, False])
def test_parameters_replaced_during_a_step_are_refused(mid_pass):
    """A module whose parameters are re-allocated (``module.half().double()``, ``model.to(...)`` on part of the
    model) between a training forward and its backward, or at rest before a forward, raises ``LoopError``
    instead of being pointed back at the old storage."""
    data = batches(4, in_dim=SIZES[0], out_dim=SIZES[-1], batch=6, seed=3)
    for which in (0, 2, 4):
        model = mlp(SIZES, seed=5)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4,
                                         schedule="dataflow", memory="fast")
        with pytest.raises(staleopt.errors.LoopError, match="moved or replaced"):
            for k, (x, y) in enumerate(data):
                opt.zero_grad()
                if k == 2 and not mid_pass:
                    model[which].half().double()
                out = model(x)
                if k == 2 and mid_pass:
                    model[which].half().double()
                mse(out, y).backward()
                opt.step()


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("method", ["dataflow", "pipedream", "hogwild"])
def test_a_forward_inside_passes_with_delays_and_its_backward_outside(method, memory):
    """The passes of ``opt.passes_with_delays`` copy their views in (they do not point at rows), so a forward
    inside the block whose backward runs after it trains as the reference engine does."""
    data = batches(8, in_dim=SIZES[0], out_dim=SIZES[-1], seed=6)

    def run(model, opt):
        for x, y in data:
            opt.zero_grad()
            with opt.passes_with_delays([1, 1, 1, 0], [1, 1, 1, 0]):
                out = model(x)
            mse(out, y).backward()
            opt.step()

    assert _pair(run, method, memory, seed=1)
