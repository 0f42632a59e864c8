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
        self.bytes, self.syncs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
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
