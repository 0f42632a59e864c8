"""The engine's cost floor, counted (not timed): weight copies per step, host syncs per step.

Every aten op the step dispatches is seen by a ``TorchDispatchMode``; the bytes written by the
ops that move weights (``copy_``, ``_foreach_copy_``, ``cat``, ``split_with_sizes_copy``) are
counted in units of the delayed weights, so a change that adds a move (or a model-sized
temporary copy) fails here.
"""
import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import staleopt
from helpers import batches, mlp, mse

SIZES = (5, 40, 40, 40, 3)


class _Moves(TorchDispatchMode):
    """Bytes written by the weight-moving ops, and the ops that read a tensor back to the host."""

    SYNCS = ("_local_scalar_dense", "item", "is_nonzero", "equal")

    def __init__(self):
        super().__init__()
        self.bytes, self.syncs, self.ops = 0, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops += not func.is_view
        if name == "copy_":
            self.bytes += args[0].numel() * args[0].element_size()
        elif name == "_foreach_copy_":
            self.bytes += sum(t.numel() * t.element_size() for t in args[0])
        elif name == "cat":
            self.bytes += sum(t.numel() * t.element_size() for t in args[0])
        elif name == "split_with_sizes_copy":
            self.bytes += sum(t.numel() * t.element_size() for t in kwargs["out"])
        elif name in self.SYNCS:
            self.syncs.append(name)
        return func(*args, **kwargs)


def _step(model, opt, x, y, mode=None):
    with mode if mode is not None else contextlib.nullcontext():
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()


#: weight copies per step in units of the delayed weights: (minimal, fast). dataflow and pipedream swap
#: twice (3 copies each: a loop may run more passes in a step, so the forward view is kept) and push once;
#: a view T2 rewrites in place keeps H + 1 rows in either mode and moves by plain copies.
COPIES = {"dataflow": (7, 3), "pipedream": (7, 3), "pipemare-t1": (7, 3), "pipemare": (4, 4)}


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("method", sorted(COPIES))
def test_weight_copies_per_step(method, memory):
    model = mlp(SIZES)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01), stages=4,
                                     schedule=method, memory=memory)
    delayed = sum(p.numel() * p.element_size() for v in opt.chunks if v.H for p in v.params)
    data = batches(12, in_dim=SIZES[0], out_dim=SIZES[-1])
    for x, y in data[:10]:  # past the first steps (w_v = w_0 for v < 0) and pipemare's warmup
        _step(model, opt, x, y)
    counts = []
    for x, y in data[10:]:
        mode = _Moves()
        _step(model, opt, x, y, mode)
        counts.append(mode.bytes / delayed)
    want = COPIES[method][memory == "fast"]
    assert counts == [want, want]


def test_checkpoint_of_the_spare_row_layout_resumes_exactly():
    """Before T2's views moved by copies, ``memory="minimal"`` kept them in ``H`` rows (``w_v`` in row
    ``v mod H``) plus a spare row, and saved no ``rows``: such a checkpoint loads into today's
    ``H + 1``-row layout and continues bit for bit."""
    def build():
        model = mlp(SIZES, seed=3)
        return model, staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                                 stages=4, schedule="pipemare",
                                                 method_args={"anneal_steps": 4, "decay": 0.3})
    data = batches(12, in_dim=SIZES[0], out_dim=SIZES[-1])
    model, opt = build()
    for x, y in data[:7]:
        _step(model, opt, x, y)
    state = copy.deepcopy(opt.state_dict())
    history = state["staleopt"]["history"]
    del history["rows"]
    t, old = history["t"], []
    for view, ring in zip(opt.chunks, history["rings"]):
        if ring is None or ring.shape[0] == view.H:
            old.append(ring)
            continue
        legacy = torch.full_like(ring, float("nan"))  # the spare row held nothing at rest
        for version in range(t - view.H, t):
            legacy[version % view.H] = ring[version % (view.H + 1)]
        old.append(legacy)
    assert any(o is not None and o.shape[0] > v.H for o, v in zip(old, opt.chunks))
    history["rings"] = old
    model2, opt2 = build()
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(state)
    for x, y in data[7:]:
        _step(model, opt, x, y)
        _step(model2, opt2, x, y)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_large_and_non_contiguous_parameters_swap_in_pieces(monkeypatch):
    """With blocks of 64 bytes every parameter is cut (a contiguous one into flat slices, a transposed one
    along its first dimension): the weights equal the reference engine's, and no block exceeds 64 bytes."""
    from staleopt import history
    from staleopt.reference import ReferencePipelineOptimizer
    monkeypatch.setattr(history, "SWAP_BLOCK_BYTES", 64)
    data = batches(8, in_dim=SIZES[0], out_dim=SIZES[-1])
    runs = []
    for cls in (ReferencePipelineOptimizer, staleopt.PipelineOptimizer):
        model = mlp(SIZES, seed=5)
        with torch.no_grad():
            for layer in model[::2]:  # a transposed (non-contiguous) weight
                layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous().t())
        assert not model[0].weight.is_contiguous()
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=4, schedule="dataflow")
        for x, y in data:
            _step(model, opt, x, y)
        if cls is staleopt.PipelineOptimizer:
            blocks = [b for bs in opt.history._swap_blocks.values() for b in bs]
            assert blocks and all(sum(sizes) * 8 <= 64 for _, _, sizes, _ in blocks)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _syncs(make_base, method, steps=6, device="cpu"):
    """Reads back to the host per step (the last ``steps - 3``) of ``method`` (None: the base alone)."""
    model = mlp(SIZES).to(device)
    base = make_base(model.parameters())
    opt = base if method is None else staleopt.PipelineOptimizer(model, base, stages=4, schedule=method)
    counts = []
    for i, (x, y) in enumerate(batches(steps, in_dim=SIZES[0], out_dim=SIZES[-1])):
        mode = _Moves()
        _step(model, opt, x.to(device), y.to(device), mode if i >= 3 else None)
        counts.append(len(mode.syncs))
    return counts[3:]


def _tensor_lr(cls, **kw):
    return lambda params: cls(params, lr=torch.tensor(0.01, dtype=torch.float64), **kw)


@pytest.mark.parametrize("method", ["dataflow", "pipedream", "pipemare", "pipemare-t1", "pipeoptim", "spectrain",
                                    "xpipe"])
@pytest.mark.parametrize("make_base", [_tensor_lr(torch.optim.Adam, fused=True),
                                       _tensor_lr(torch.optim.AdamW, fused=True, weight_decay=0.1)],
                         ids=["fused Adam", "fused AdamW"])
def test_no_host_reads_per_step_with_fused_adam_and_a_tensor_lr(make_base, method):
    """``.item()`` and the like (``_local_scalar_dense``) stall a GPU: the engine never calls them, even where a
    correction needs the lr (weight prediction, T1) or Adam's step (a tensor on the device when fused)."""
    assert _syncs(make_base, None) == [0, 0, 0]
    assert _syncs(make_base, method) == [0, 0, 0]


def test_weight_prediction_reads_no_tensor_lr_back_with_any_optimizer():
    """The generic rule (the last update over the lr) with a Tensor lr adds no host read to the optimizer's own."""
    make = _tensor_lr(torch.optim.RMSprop)
    assert _syncs(make, "pipeoptim") == _syncs(make, None)


def test_a_tensor_lr_predicts_like_a_float_lr():
    """Weight prediction and T1 with a Tensor lr give the weights of the same lr as a Python float."""
    runs = []
    for lr in (0.01, torch.tensor(0.01, dtype=torch.float64)):
        for method in ("pipeoptim",):
            model = mlp(SIZES, seed=2)
            opt = staleopt.PipelineOptimizer(model, torch.optim.Adam(model.parameters(), lr=lr, foreach=False),
                                             stages=4, schedule=method)
            for x, y in batches(8, in_dim=SIZES[0], out_dim=SIZES[-1]):
                _step(model, opt, x, y)
            runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-12, atol=0)
    assert not torch.equal(runs[0], torch.cat([p.detach().flatten() for p in mlp(SIZES, seed=2).parameters()]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["dataflow", "pipemare", "pipeoptim", "xpipe"])
def test_no_cuda_sync_per_step(method):
    """On a GPU, torch's sync debug mode raises at any synchronizing call inside the engine's step."""
    model = mlp(SIZES).cuda()
    base = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01, device="cuda"), fused=True)
    opt = staleopt.PipelineOptimizer(model, base, stages=4, schedule=method)
    data = [(x.cuda(), y.cuda()) for x, y in batches(6, in_dim=SIZES[0], out_dim=SIZES[-1])]
    for x, y in data[:3]:
        _step(model, opt, x, y)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in data[3:]:
            _step(model, opt, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("method", ["dataflow", "pipemare"])
def test_compiled_step_runs_the_engine_eagerly(method):
    """``torch.compile(opt.step)`` used to trace the engine's bookkeeping into a graph (pipemare then asked for
    version -5 at step 1); dynamo now skips the step: the same weights and step count as eager, bit for bit."""
    dynamo = pytest.importorskip("torch._dynamo")
    runs = []
    for compiled in (False, True):
        dynamo.reset()
        model = mlp()
        opt = staleopt.PipelineOptimizer(model, torch.optim.Adam(model.parameters(), lr=0.01), stages=3,
                                         schedule=method)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        for x, y in batches(5):
            opt.zero_grad()
            mse(model(x), y).backward()
            step()
        assert opt.step_count == 5
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])


def test_opt_checkpoint_in_a_compiled_model_compiles_once():
    """``opt.checkpoint`` is kept out of dynamo (a graph break at each call, the segment runs eagerly with its
    recompute view): the compiled model under ``pipemare-recompute`` compiles in the first step only and
    trains exactly as in eager."""
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.testing import CompileCounterWithBackend
    from test_engine_recompute import WIDTHS, Net, data

    class Unrolled(Net):   # the schedule's segments at P = 3, stages (0, 1) and (2, 2), between compiled code
        def forward(self, x):
            x = self.opt.checkpoint(self.run, 0, 1, torch.sin(x))
            return 2 * self.opt.checkpoint(self.run, 2, 2, x)

    runs, frames = [], []
    for compiled in (False, True):
        dynamo.reset()
        model = Unrolled(WIDTHS, [])
        counter = CompileCounterWithBackend("aot_eager")
        call = torch.compile(model, backend=counter) if compiled else model
        opt = staleopt.PipelineOptimizer(call, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                         schedule="pipemare-recompute")
        model.opt = opt
        for x, y in data(6):
            opt.zero_grad()
            ((call(x) - y) ** 2).mean().backward()
            opt.step()
            frames.append(counter.frame_count)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert frames[6] > 0 and frames[6:] == [frames[6]] * 6
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("method, args", [("dataflow", None), ("pipedream", None), ("pipeoptim", None),
                                          ("pipemare", {"anneal_steps": 2, "decay": 0.3})])
def test_ops_per_step_do_not_grow_with_the_stage_count(method, args, memory):
    """The history's moves, T2's rewrite and delta update and weight prediction are each a fixed number of
    foreach calls over all stages: a step dispatches as many ops at P = 3 as at P = 9 (base SGD with
    foreach, as on a GPU; pipemare past T1's annealing, whose per-stage groups add the base step's ops
    per stage while it anneals, docs/engine.md)."""
    sizes = (5,) + (12,) * 8 + (3,)
    counts = []
    for P in (3, 9):
        model = mlp(sizes)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                                                foreach=True),
                                         stages=P, schedule=method, method_args=args, memory=memory)
        data = batches(14, in_dim=sizes[0], out_dim=sizes[-1])
        for x, y in data[:13]:
            _step(model, opt, x, y)
        mode = _Moves()
        _step(model, opt, *data[13], mode)
        counts.append(mode.ops)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("method, base", [("pipemare", torch.optim.SGD), ("pipeoptim", torch.optim.Adam),
                                          ("xpipe", torch.optim.SGD)])
def test_weight_sized_temporaries_go_in_bounded_blocks(monkeypatch, method, base):
    """T2's ``w_{t+1} - w_t`` and weight prediction's Adam direction (the base's moments or its own) are
    temporaries computed block by block: 64-byte blocks (every tensor its own block, T2's cut in flat pieces)
    give the weights of one block, bit for bit."""
    from staleopt import history
    runs = []
    for block in (history.SWAP_BLOCK_BYTES, 64):
        monkeypatch.setattr(history, "SWAP_BLOCK_BYTES", block)
        model = mlp(seed=6)
        kw = {"momentum": 0.9} if base is torch.optim.SGD else {}
        opt = staleopt.PipelineOptimizer(model, base(model.parameters(), lr=0.05, **kw), stages=3, schedule=method,
                                         **({"method_args": {"anneal_steps": 4, "decay": 0.3}}
                                            if method == "pipemare" else {}))
        for x, y in batches(6):
            _step(model, opt, x, y)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
