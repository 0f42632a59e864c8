"""PipelineOptimizer with a ``torch.compile``'d model.

Supported way: give the wrapper the *compiled* module, ``PipelineOptimizer(torch.compile(model), base)``.
Its hooks then run in eager mode around the compiled forward, the weight views are in-place
swaps/copies into the parameters the graph reads, and nothing is recompiled from step to step.
Giving it the original module while calling the compiled one works the same way: the wrapper's
hooks are kept out of dynamo (they used to be traced, and their step-dependent state failed the
guards: a recompile every step). The tests use ``backend="aot_eager"`` (AOTAutograd's joint forward/backward
graph, which decides what the backward saves, without inductor's C++ compile time); set
``STALEOPT_TEST_INDUCTOR=1`` to also run the default inductor backend (slow: a minute of compiling).
"""
import os

import pytest
import torch

import staleopt
from helpers import batches, mlp, mse

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

STAGES = 3


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(method, steps=6, backend=None, wrap="compiled", counts=None):
    """Train ``mlp()`` with ``method``; ``backend`` None is eager. Returns (weights, compile counter)."""
    dynamo.reset()
    model = mlp()
    counter = CompileCounterWithBackend(backend) if backend else None
    call = torch.compile(model, backend=counter) if backend else model
    target = call if wrap == "compiled" else model
    opt = staleopt.PipelineOptimizer(target, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     stages=STAGES, schedule=method)
    for x, y in batches(steps):
        opt.zero_grad()
        mse(call(x), y).backward()
        opt.step()
        if counts is not None:
            counts.append(counter.frame_count)
    return _flat(model), counter


@pytest.mark.parametrize("method", ["dataflow", "pipedream", "pipemare"])
def test_compiled_model_under_the_wrapper_equals_eager(method):
    eager, _ = _train(method)
    counts = []
    compiled, counter = _train(method, backend="aot_eager", counts=counts)
    assert torch.allclose(compiled, eager, rtol=0, atol=1e-12)
    assert counts == [1] * len(counts)  # compiled once, no recompile in later steps


def test_backward_view_reaches_the_compiled_backward():
    """dataflow (backward on w_t) and dataflow + stashing (backward on the stale view) differ when
    compiled exactly as in eager: AOTAutograd saves the parameters themselves for ``W^T delta``."""
    plain, _ = _train("dataflow", backend="aot_eager")
    stash, _ = _train("pipemare-stash", backend="aot_eager")
    assert (plain - stash).abs().max() > 1e-4


def test_eval_forward_adds_one_graph_and_training_resumes_without_recompiling():
    dynamo.reset()
    model = mlp()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    opt = staleopt.PipelineOptimizer(compiled, torch.optim.SGD(model.parameters(), lr=0.1), stages=STAGES,
                                     schedule="pipemare")
    data = batches(6)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        mse(compiled(x), y).backward()
        opt.step()
        if i == 2:
            compiled.eval()
            with torch.no_grad():
                compiled(x)
            compiled.train()
    assert counter.frame_count == 2  # one training graph, one no-grad eval graph


def test_wrapping_the_uncompiled_module_works_without_recompiles():
    """The wrapper's hooks are kept out of dynamo: wrapping the original module and calling the
    compiled one runs them eagerly around the graph, the weights are right and nothing recompiles
    (before, dynamo traced the hooks, whose step counter changes every step, and recompiled)."""
    eager, _ = _train("dataflow", steps=4)
    counts = []
    got, _ = _train("dataflow", steps=4, backend="aot_eager", wrap="original", counts=counts)
    assert torch.allclose(got, eager, rtol=0, atol=1e-12)
    assert counts == [1] * len(counts), counts


@pytest.mark.skipif(not os.environ.get("STALEOPT_TEST_INDUCTOR"), reason="set STALEOPT_TEST_INDUCTOR=1 (slow)")
def test_inductor_equals_eager():
    eager, _ = _train("pipemare")
    counts = []
    compiled, _ = _train("pipemare", backend="inductor", counts=counts)
    assert torch.allclose(compiled, eager, rtol=0, atol=1e-12)
    assert counts == [1] * len(counts)
