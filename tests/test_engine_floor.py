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


#: weight copies per step in units of the delayed weights: (minimal, fast). A forward points the parameters at
#: the row of their version (docs/engine.md, "Parameters that point at the history"): pipedream (backward =
#: forward version) then moves the weights only by push (1, either mode); dataflow's last pass writes w_t over
#: the expiring w_(t-H), and push copies w_t there again at step() (a change between backward and step is part
#: of w_t: minimal 2); pipemare's minimal last pass writes w_t there too, T2 rewrites it in place, and push
#: copies w_t into the spare row (2); in fast a view points at its spare row, copies the forward version in and
#: writes the backward view over it, then push (dataflow: 3; pipemare: T2 rewrites it, then push copies w_t,
#: 3), so that an expired version outlives the step's passes.
COPIES = {"dataflow": (2, 3), "pipedream": (1, 1), "pipemare-t1": (2, 3), "pipemare": (2, 3)}


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


def _accumulate(model, opt, x, y, passes, style, mode=None):
    """One step of ``passes`` passes: forward then backward each (``"interleaved"``), or every forward first and
    the summed loss's one backward (``"summed"``)."""
    with mode if mode is not None else contextlib.nullcontext():
        opt.zero_grad()
        parts = list(zip(x.chunk(passes), y.chunk(passes)))
        if style == "interleaved":
            for xs, ys in parts:
                (mse(model(xs), ys) / passes).backward()
        else:
            sum(mse(model(xs), ys) / passes for xs, ys in parts).backward()
        opt.step()


#: passes per step: a constant count, an epoch's shorter last accumulation (HF Trainer, Lightning), a step
#: that repeats the longest count
PASSES = [3, 3, 3, 1, 3, 3, 2, 3, 3]


@pytest.mark.parametrize("style", ["interleaved", "summed"])
@pytest.mark.parametrize("method", ["dataflow", "pipedream", "hogwild"])
def test_the_last_pass_drops_the_expiring_version_exactly(method, style):
    """``memory="minimal"`` learns the passes per step (the most any step ran) and, at the last one, drops
    ``w_(t-H)``: weights bit-equal to the reference engine's after every step. dataflow: a step of the learned
    count moves the weights 6 times per earlier pass plus 2 (its last forward points the parameters at
    ``w_(t-H)``'s row and the backward writes ``w_t`` over it; push copies ``w_t`` there again; summed: the last
    forward follows pending ones, so it swaps, then copies back, 5 in all with push), a shorter step the safe 6 per pass plus the push
    (summed: 7), and so does step 0 (whose every training forward puts w_0 back to compare it: 6 per pass plus
    1 in either style). pipedream: every pass points at ``w_(t-H)``'s row, which its backward reads too: push
    alone, 1 per step."""
    from staleopt.reference import ReferencePipelineOptimizer
    data = batches(len(PASSES), in_dim=SIZES[0], out_dim=SIZES[-1], batch=6)
    runs, copies = [], []
    for cls in (ReferencePipelineOptimizer, staleopt.PipelineOptimizer):
        model = mlp(SIZES, seed=7)
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=4, schedule=method,
                  seed=2)
        delayed = sum(p.numel() * p.element_size() for v in opt.chunks if v.H for p in v.params)
        weights = []
        for (x, y), passes in zip(data, PASSES):
            mode = _Moves()
            _accumulate(model, opt, x, y, passes, style, mode)
            weights.append([p.detach().clone() for p in model.parameters()])
            copies.append(mode.bytes / delayed)
        runs.append(weights)
    for a, b in zip(*runs):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    if method == "hogwild":
        return  # random delays: the forward view is not always w_(t-H)
    counts = copies[len(PASSES):]
    if method == "pipedream":
        assert counts == [1] * len(PASSES)
        return
    safe = {n: (6 * n + 1 if style == "interleaved" else 7) for n in set(PASSES)}
    last = {n: (6 * n - 4 if style == "interleaved" else 5) for n in set(PASSES)}
    assert counts == [6 * n + 1 if t == 0 else safe[n] if n < max(PASSES) else last[n]
                      for t, n in enumerate(PASSES)]


@pytest.mark.parametrize("style", ["interleaved", "summed"])
def test_a_step_with_more_passes_than_any_before_refuses_the_dropped_version(style):
    """After steps of 2 interleaved passes, a step of 3 finds ``w_(t-H)`` dropped at the end of its second:
    ``LoopError`` naming the fixes, never a silently wrong view; ``memory="fast"`` (one more version) trains it.
    Summed passes drop only once the backward pass starts, after every forward: a third forward only makes
    the step miss the count (the safe path), and it trains as in ``"fast"``."""
    data = batches(4, in_dim=SIZES[0], out_dim=SIZES[-1], batch=6)
    runs = []
    for memory in ("fast", "minimal"):
        model = mlp(SIZES)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4,
                                         schedule="dataflow", memory=memory)
        for x, y in data[:3]:
            _accumulate(model, opt, x, y, 2, style)
        if memory == "minimal" and style == "interleaved":
            with pytest.raises(staleopt.errors.LoopError, match="same number of passes.*memory='fast'"):
                _accumulate(model, opt, *data[3], 3, style)
            return
        _accumulate(model, opt, *data[3], 3, style)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_microbatch_passes_drop_at_the_nth_pass():
    """``microbatch_passes=True`` declares ``N`` passes: the ``N``-th drops ``w_(t-H)`` from step 1 on (6 (N - 1)
    + 2 copies: its forward points at ``w_(t-H)``'s row, its backward writes ``w_t`` over it, push; pb's microbatches
    share the delays). Under eq. (16) a step runs ``N`` passes per distinct delay:
    one that reads ``w_(t-H)`` after the count was reached revokes the expiry (bit-equal to the reference,
    ``tests/test_hogwild_eq16.py``)."""
    model = mlp(SIZES)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4,
                                     schedule="pb", microbatches=2, microbatch_passes=True)
    delayed = sum(p.numel() * p.element_size() for v in opt.chunks if v.H for p in v.params)
    counts = []
    for x, y in batches(4, in_dim=SIZES[0], out_dim=SIZES[-1], batch=6):
        mode = _Moves()
        _accumulate(model, opt, x, y, 2, "interleaved", mode)
        counts.append(mode.bytes / delayed)
    assert counts == [13, 8, 8, 8]


def test_a_checkpoint_mid_step_keeps_the_learned_passes():
    """Saved after the first of a step's two passes, the checkpoint carries the step's counts and the passes
    learned: the resumed run drops at the same pass (the same copies) and trains bit for bit alike; a checkpoint
    without the counts (an older release) takes the safe path in that step and learns afresh."""
    data = batches(6, in_dim=SIZES[0], out_dim=SIZES[-1], batch=6)

    def build():
        model = mlp(SIZES, seed=3)
        return model, staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                                 stages=4, schedule="dataflow")

    def finish(model, opt, x, y, mode):
        with mode:
            (mse(model(x[3:]), y[3:]) / 2).backward()
            opt.step()

    model, opt = build()
    for x, y in data[:3]:
        _accumulate(model, opt, x, y, 2, "interleaved")
    x, y = data[3]
    opt.zero_grad()
    (mse(model(x[:3]), y[:3]) / 2).backward()
    state = copy.deepcopy(opt.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    weights = copy.deepcopy(model.state_dict())
    runs = []
    for strip in (None, False, True):
        if strip is None:
            m, o = model, opt
        else:
            m, o = build()
            m.load_state_dict(weights)
            saved = copy.deepcopy(state)
            if strip:
                del saved["staleopt"]["pass_counts"]
            o.load_state_dict(saved)
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()
        delayed = sum(p.numel() * p.element_size() for v in o.chunks if v.H for p in v.params)
        mode = _Moves()
        finish(m, o, x, y, mode)
        copies = [mode.bytes / delayed]
        for x2, y2 in data[4:]:
            mode = _Moves()
            _accumulate(m, o, x2, y2, 2, "interleaved", mode)
            copies.append(mode.bytes / delayed)
        runs.append(([p.detach().clone() for p in m.parameters()], copies))
    assert runs[0][1] == runs[1][1] == [2, 8, 8]
    assert runs[2][1] == [7, 13, 8]
    for weights_, _ in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], weights_))


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
            assert blocks and all(sum(sizes) * 8 <= 64 for _, _, sizes, _, _ in blocks)
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


@pytest.mark.parametrize("method", ["gap-aware", "dc-asgd-a", "pipemare-stash-nesterov", "staleness-aware"])
def test_no_host_reads_per_step_with_fused_sgd_and_a_tensor_lr(method):
    """Gap-aware's eta_max (the largest lr so far, a factor of its C over SGD) was float(lr): a host read per group
    per step. With a Tensor lr it is a 0-d tensor (torch.maximum)."""
    make = _tensor_lr(torch.optim.SGD, momentum=0.9, fused=True)
    assert _syncs(make, None) == [0, 0, 0]
    assert _syncs(make, method) == [0, 0, 0]


def test_gap_aware_with_a_tensor_lr_steps_as_with_a_float_lr():
    """eta_max as a 0-d tensor multiplies C as the float did, bit for bit (two groups: one factor per group)."""
    runs = []
    for lr in (0.05, torch.tensor(0.05, dtype=torch.float64)):
        model = mlp(SIZES, seed=2)
        params = list(model.parameters())
        base = torch.optim.SGD([{"params": params[::2]}, {"params": params[1::2], "lr": lr * 2}], lr=lr,
                               momentum=0.9, weight_decay=1e-3)
        opt = staleopt.PipelineOptimizer(model, base, stages=4, schedule="gap-aware")
        for x, y in batches(8, in_dim=SIZES[0], out_dim=SIZES[-1]):
            _step(model, opt, x, y)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])


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


def _pipeoptim_weights(**adam):
    model = mlp(SIZES, seed=2)
    opt = staleopt.PipelineOptimizer(model, torch.optim.Adam(model.parameters(), **adam), stages=4,
                                     schedule="pipeoptim")
    for x, y in batches(8, in_dim=SIZES[0], out_dim=SIZES[-1]):
        _step(model, opt, x, y)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_fused_adam_predicts_in_float64_as_the_host_path():
    """With ``Adam(fused=True)`` (Adam's step a tensor the prediction must not read back) the bias corrections
    ``1 - beta^k`` were computed in the step's float32: 7e-8 off in the weights after 8 steps against the same
    run's host path (Python floats). They are float64 tensors now: the two agree to float64 rounding (fused Adam's
    own kernel rounds its update differently, by about 1e-16)."""
    fused = _pipeoptim_weights(lr=0.01, fused=True)
    torch.testing.assert_close(fused, _pipeoptim_weights(lr=0.01, foreach=False), rtol=1e-12, atol=1e-15)


def test_a_one_element_tensor_lr_predicts_as_a_0d_one():
    """``lr=torch.tensor([0.01])`` (torch takes it) made the prediction's step sizes an (n, n) matrix: a shape error
    at the first step. It is the 0-d lr's value now, bit for bit."""
    one = _pipeoptim_weights(lr=torch.tensor([0.01], dtype=torch.float64), fused=True)
    assert torch.equal(one, _pipeoptim_weights(lr=torch.tensor(0.01, dtype=torch.float64), fused=True))


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


@pytest.mark.parametrize("method", ["pipemare", "staleness-aware"])
def test_a_compiled_base_step_with_per_stage_step_sizes_is_refused_before_anything_moves(method):
    """``base.step = torch.compile(base.step)`` (the recipe for compiling the update) raised torch's internal
    dynamo error in the middle of the wrapper's step under T1 (the per-stage groups are a dict subclass dynamo
    cannot trace), after the history had kept w_t: refused, at construction or (compiled later) before the step
    changes anything; a method without per-stage step sizes compiles and steps as in eager."""
    pytest.importorskip("torch._dynamo")
    from staleopt.errors import OptimizerMismatchError
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    eager_step = base.step
    base.step = torch.compile(eager_step, backend="aot_eager")
    with pytest.raises(OptimizerMismatchError, match="leave the base optimizer's step uncompiled"):
        staleopt.PipelineOptimizer(model, base, stages=3, schedule=method)
    runs = []
    for compile_later in (False, True):
        model = mlp()
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule=method)
        for i, (x, y) in enumerate(batches(4)):
            if compile_later and i == 2:
                eager_step = base.step
                base.step = torch.compile(eager_step, backend="aot_eager")
                opt.zero_grad()
                mse(model(x), y).backward()
                with pytest.raises(OptimizerMismatchError):
                    opt.step()
                del base.step  # back to the eager step: the refused step changed nothing, so step() again
                opt.step()
                continue
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
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


def _sgd_foreach(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True)


def _adam_foreach(params):
    return torch.optim.Adam(params, lr=0.01, foreach=True)


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("method, args, make_base", [
    ("dataflow", None, _sgd_foreach), ("pipedream", None, _sgd_foreach), ("pipeoptim", None, _sgd_foreach),
    ("pipemare", {"anneal_steps": 2, "decay": 0.3}, _sgd_foreach), ("pipeoptim", None, _adam_foreach),
    ("xpipe", None, _adam_foreach)])
def test_ops_per_step_do_not_grow_with_the_stage_count(method, args, make_base, memory):
    """The history's moves, T2's rewrite and delta update and weight prediction are each a fixed number of
    foreach calls over all stages: a step dispatches as many ops at P = 3 as at P = 9 (base SGD or Adam with
    foreach, as on a GPU; pipemare past T1's annealing, whose per-stage groups add the base step's ops
    per stage while it anneals, docs/engine.md; prediction over Adam read each tensor's step apart)."""
    sizes = (5,) + (12,) * 8 + (3,)
    counts = []
    for P in (3, 9):
        model = mlp(sizes)
        opt = staleopt.PipelineOptimizer(model, make_base(model.parameters()),
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


def _t1_run(P, tau, steps=6, mode=None):
    """``steps`` steps of a custom schedule with T1 annealing (``tau`` per stage) over SGD with momentum
    (foreach); the ops the last step dispatched and the weights."""
    from staleopt import schedules
    from staleopt.corrections import LRReschedule
    sizes = (5,) + (6,) * 8 + (3,)  # nine layers, whatever P
    model = mlp(sizes)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True),
                                     stages=P, schedule=schedules.get("custom", tau_fwd=tau, tau_bkwd=[0] * P),
                                     corrections=[LRReschedule(100)])
    data = batches(steps, in_dim=sizes[0], out_dim=sizes[-1])
    for x, y in data[:-1]:
        _step(model, opt, x, y)
    mode = _Moves()
    _step(model, opt, *data[-1], mode)
    return mode.ops, [p.detach().clone() for p in model.parameters()]


def test_t1_launches_follow_the_distinct_factors_not_the_stages(monkeypatch):
    """While T1 anneals, the stages of equal factor (equal delays) step as one parameter group: the ops per step
    are the same at P = 3 and P = 9 when both have two distinct delays, and the weights equal those of one
    group per stage bit for bit."""
    assert _t1_run(3, [2, 2, 1])[0] == _t1_run(9, [2] * 8 + [1])[0]
    merged = _t1_run(9, [3, 3, 2, 2, 2, 1, 1, 1, 1])[1]
    from staleopt.stage_lr import StageGroups

    def per_stage(self, splits, factors):
        groups = [{**sp.user, "params": sp.group["params"],
                   "lr": sp.user["lr"] * (factors[sp.stage] if sp.stage >= 0 else 1.0)} for sp in splits]
        return groups, [[sp] for sp in splits]
    monkeypatch.setattr(StageGroups, "_merge", per_stage)
    apart = _t1_run(9, [3, 3, 2, 2, 2, 1, 1, 1, 1])[1]
    assert all(torch.equal(a, b) for a, b in zip(merged, apart))


def _engine_ops(method, P, layers, corrections):
    """Ops the wrapper adds to one step (the 13th), against the base optimizer alone on the same model."""
    sizes = (5,) + (6,) * (layers - 1) + (3,)
    data = batches(13, in_dim=sizes[0], out_dim=sizes[-1])
    counts = []
    for wrapped in (False, True):
        model = mlp(sizes)
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-3, foreach=True)
        opt = staleopt.PipelineOptimizer(model, base, stages=P, schedule=method, corrections=corrections) \
            if wrapped else base
        for x, y in data[:12]:
            _step(model, opt, x, y)
        mode = _Moves()
        _step(model, opt, *data[12], mode)
        counts.append(mode.ops)
    return counts[1] - counts[0]


@pytest.mark.parametrize("name", ["nesterov", "gap-aware", "dc-asgd", "dc-asgd-a"])
def test_the_corrections_since_the_seeds_launch_as_many_ops_whatever_the_tensors(name):
    """Nesterov's look-ahead, gap-aware damping and DC-ASGD are a fixed number of foreach calls over all stages:
    the ops the wrapper adds to a step are the same for 6 layers in 3 stages as for 12 layers in 6 (twice the
    tensors, twice the stages)."""
    from staleopt.corrections import DelayCompensation, GapAware, NesterovLookahead
    make = {"nesterov": lambda: [NesterovLookahead(0.5, 0.95)], "gap-aware": lambda: [GapAware(0.9)],
            "dc-asgd": lambda: [DelayCompensation(0.5)], "dc-asgd-a": lambda: [DelayCompensation(0.5, 0.9)]}[name]
    with pytest.warns(UserWarning) if name == "nesterov" else contextlib.nullcontext():
        assert _engine_ops("dataflow", 3, 6, make()) == _engine_ops("dataflow", 6, 12, make())


@pytest.mark.parametrize("memory", ["minimal", "fast"])
@pytest.mark.parametrize("method, args", [("dataflow", None), ("pipedream", None), ("pipeoptim", None),
                                          ("pipemare", {"anneal_steps": 2, "decay": 0.3}),
                                          ("pipemare-recompute", {"anneal_steps": 2, "decay": 0.3})])
def test_steady_steps_replay_what_earlier_steps_planned(monkeypatch, method, args, memory):
    """Per-step planning does not grow with the stages: once the delays stop changing, every history load replays
    the moves planned at an earlier step from the same state to the same targets, both relative to t (no
    SlotHistory._plan), and T2's rewrite reuses its lists; the weights stay those of the engine with planning (run
    again with every cached transition forgotten after each step, bit for bit)."""
    from staleopt import history

    calls = []

    def run(replay):
        model = mlp((5,) + (12,) * 6 + (3,))
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         stages=5, schedule=method, method_args=args, memory=memory)
        if method.endswith("-recompute"):
            layers = list(model)
            model.forward = lambda x: staleopt.segments.checkpoint_segments(opt, layers, x)
        planned, rewrites = [], lambda: [len(getattr(c, "_rewrites", ())) for c in opt.corrections]
        for t, (x, y) in enumerate(batches(16, in_dim=5, out_dim=3)):
            if t == 10:
                planned.clear()
                made = rewrites()
            _step(model, opt, x, y)
            if not replay:
                for state in opt.history._states.values():
                    state.next.clear()
            planned.append(len(calls))
        assert rewrites() == made  # T2 made its lists (per set of chunks and delays) before step 10
        return [p.detach().clone() for p in model.parameters()], planned

    plan = history.SlotHistory._plan
    monkeypatch.setattr(history.SlotHistory, "_plan", lambda self, targets: calls.append(1) or plan(self, targets))
    weights, planned = run(replay=True)
    steady = len(calls)
    assert len(set(planned)) == 1 and steady > 0  # the last six steps planned nothing new
    again, _ = run(replay=False)
    assert len(calls) > 2 * steady  # (planned afresh at every load)
    assert all(torch.equal(a, b) for a, b in zip(weights, again))


@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_random_delays_keep_the_cached_transitions_bounded(monkeypatch, memory):
    """Random delays (hogwild) meet ever new states and targets: the history forgets its cached transitions past
    ``MAX_PLANS`` (here 6), keeps only the states it still needs, and trains bit for bit as with them all kept."""
    from staleopt import history

    def run(limit):
        monkeypatch.setattr(history.SlotHistory, "MAX_PLANS", limit)
        model = mlp((5,) + (12,) * 6 + (3,))
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         stages=5, schedule="hogwild", seed=7, memory=memory)
        most, cleared, before = 0, 0, 0
        for x, y in batches(40, in_dim=5, out_dim=3):
            _step(model, opt, x, y)
            cached = sum(len(state.next) for state in opt.history._states.values())
            most, cleared = max(most, opt.history._plans), cleared + (opt.history._plans < before)
            before = opt.history._plans
            assert cached <= opt.history._plans <= limit
        return [p.detach().clone() for p in model.parameters()], most, cleared, len(opt.history._states)

    kept, most_kept, cleared_kept, states_kept = run(10 ** 6)
    forgot, most, cleared, states = run(6)
    assert most_kept > 6 and cleared_kept == 0  # (the run meets more transitions than the bound)
    assert most <= 6 and cleared > 0 and states < states_kept  # (the bound was reached: forgotten, states dropped)
    assert all(torch.equal(a, b) for a, b in zip(kept, forgot))


def _new_storages(before=None):
    import gc
    gc.collect()
    found = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                s = o.untyped_storage()
                ptr = s.data_ptr()
            except RuntimeError:  # (a fake tensor an earlier torch.compile left: no storage)
                continue
            if ptr and (before is None or ptr not in before):
                found[ptr] = s.nbytes()
    return found


@pytest.mark.parametrize("method, P, make_base", [
    ("pipemare", 8, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)),
    ("hogwild-t1", 8, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)),
    ("pipemare-stash-nesterov", 8, lambda ps: torch.optim.SGD(ps, lr=0.01)),
    ("gap-aware", 4, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=1e-4)),
    ("dc-asgd-a", 4, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)),
    ("pipeoptim", 4, lambda ps: torch.optim.Adam(ps, lr=0.01))])
def test_memory_bytes_counts_every_tensor_the_engine_keeps(method, P, make_base):
    """memory_bytes() left out hogwild's table of per-stage CDFs (P x (tau_max + 1) float64, 731 KB at P = 214),
    Nesterov's 0-d momenta and gap-aware's 0-d decays: it equals the bytes of every tensor storage that building
    the wrapper and stepping it left alive (the base optimizer's own state made before)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(P)])
    base = make_base(model.parameters())
    x = torch.randn(4, 2)
    model(x).pow(2).mean().backward()
    base.step()
    base.zero_grad(set_to_none=False)
    before = _new_storages()
    opt = staleopt.PipelineOptimizer(model, base, stages=P, schedule=method)
    for _ in range(4):
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()
    assert sum(_new_storages(before).values()) == opt.memory_bytes()
