"""PipelineOptimizer under DistributedDataParallel: 2 gloo processes on CPU equal 1 process.

Each rank trains on its half of every minibatch; DDP averages the gradients,
so the update equals the one of a single process on the full batch (mean
loss, no batch-coupled layers), up to the all-reduce's summation order. The
wrapper is given either the DDP module or ``ddp.module``: both hook the same
forward (DDP's forward calls ``module(...)``) and both work.
"""
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import staleopt
from helpers import batches, mlp, mse

STEPS, STAGES, METHOD = 6, 3, "pipemare"
ARGS = {"anneal_steps": 4, "decay": 0.5}  # T1 and T2 both active over the run
SIZES = (5, 7, 6, 3)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _pipeline(target, model, passes: bool):
    """``passes``: two microbatches per step, pass ``j`` with microbatch ``j``'s delays."""
    kw = {"microbatches": 2, "microbatch_passes": True} if passes else {}
    return staleopt.PipelineOptimizer(target, _base(model), stages=STAGES, schedule=METHOD, method_args=ARGS, **kw)


def _reference(accumulate: int = 1, passes: bool = False, world: int = 2):
    """One process, full batch split into ``accumulate`` microbatches whose losses are averaged;
    microbatch ``j`` is the union of the ranks' microbatches ``j``."""
    model = mlp(SIZES)
    opt = _pipeline(model, model, passes)
    for x, y in batches(STEPS, batch=8):
        opt.zero_grad()
        per_rank = [(xr.chunk(accumulate), yr.chunk(accumulate)) for xr, yr in zip(x.chunk(world), y.chunk(world))]
        for j in range(accumulate):
            xm = torch.cat([xs[j] for xs, _ in per_rank])
            ym = torch.cat([ys[j] for _, ys in per_rank])
            (mse(model(xm), ym) / accumulate).backward()
        opt.step()
    return _flat(model), opt.state_dict()["staleopt"]["history"]["rings"]


def _train_rank(rank: int, world: int, wrap: str, accumulate: int, passes: bool = False):
    model = DDP(mlp(SIZES))
    target = model if wrap == "ddp" else model.module
    opt = _pipeline(target, model, passes)
    for x, y in batches(STEPS, batch=8):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        micro = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        for i, (xm, ym) in enumerate(micro):
            if i < len(micro) - 1:
                with model.no_sync():  # accumulate locally; the last backward all-reduces the sum
                    (mse(model(xm), ym) / accumulate).backward()
            else:
                (mse(model(xm), ym) / accumulate).backward()
        opt.step()
    return _flat(model), opt.state_dict()["staleopt"]["history"]["rings"]


class _Tied(torch.nn.Module):
    """Token embedding (stage 0) tied to the output layer (stage 2: a replica, staleopt.replicas)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.l1, self.l2 = torch.nn.Embedding(7, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(5, 7, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(self.tok(x))))))


def _tied_batches():
    g = torch.Generator().manual_seed(4)
    return [(torch.randint(0, 7, (8,), generator=g), torch.randn(8, 7, generator=g)) for _ in range(STEPS)]


def _train_tied(rank=None, world: int = 2):
    """The tied model under dataflow at 3 stages; ``rank``: that rank's half of every batch under DDP."""
    model = _Tied()
    target = model if rank is None else DDP(model)
    opt = staleopt.PipelineOptimizer(target, _base(model), stages=STAGES, schedule="dataflow")
    assert len(opt.replicas) == 1
    for x, y in _tied_batches():
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        mse(target(x), y).backward()
        opt.step()
    return _flat(model)


def _worker(rank: int, world: int, port: int, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {f"{wrap}/{acc}": _train_rank(rank, world, wrap, acc)
                   for wrap in ("ddp", "module") for acc in (1, 2)}
        results["passes"] = _train_rank(rank, world, "ddp", 2, passes=True)
        results["tied"] = _train_tied(rank, world)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    for attempt in range(2):
        out = tmp_path_factory.mktemp("ddp")
        try:
            mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
            break
        except mp.ProcessExitedException as e:
            # A rank killed by a signal ("terminate called without an active exception", SIGABRT, seen in 2 of
            # 8 full-suite runs on 2026-11-24 and never when rerun; no Python error) gets one more run. A Python
            # error in a rank (ProcessRaisedException) or a second crash fails the test.
            if attempt or e.signal_name is None:
                raise
            warnings.warn(f"the two gloo ranks crashed ({e}); running them once more")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("wrap", ["ddp", "module"])
def test_two_ranks_equal_one_process_full_batch(ranks, wrap):
    weights, _ = _reference()
    for r in ranks:
        got, _ = r[f"{wrap}/1"]
        assert torch.allclose(got, weights, rtol=0, atol=1e-6), (got - weights).abs().max()
    assert not torch.equal(weights, _flat(mlp(SIZES)))  # it trained


@pytest.mark.parametrize("wrap", ["ddp", "module"])
def test_ranks_keep_identical_histories(ranks, wrap):
    for acc in (1, 2):
        (w0, h0), (w1, h1) = ranks[0][f"{wrap}/{acc}"], ranks[1][f"{wrap}/{acc}"]
        assert torch.equal(w0, w1)
        assert len(h0) == len(h1) and any(h is not None for h in h0)
        for a, b in zip(h0, h1):
            assert (a is None and b is None) or torch.equal(a, b)


def test_no_sync_microbatch_accumulation_equals_full_batch(ranks):
    """Two microbatches per rank, the first under ``no_sync``: the engine accepts several
    forward/backward passes per step, and the result is the full-batch step."""
    weights, history = _reference(accumulate=2)
    full, _ = _reference(accumulate=1)
    assert torch.allclose(weights, full, rtol=0, atol=1e-12)
    for wrap in ("ddp", "module"):
        for r in ranks:
            got, hist = r[f"{wrap}/2"]
            assert torch.allclose(got, weights, rtol=0, atol=1e-6)
            for a, b in zip(hist, history):
                assert (a is None and b is None) or torch.allclose(a, b, rtol=0, atol=1e-6)


def test_no_sync_microbatch_passes_with_per_microbatch_delays(ranks):
    """``microbatch_passes=True``: pass ``j`` of each rank runs with microbatch ``j``'s delays; the
    ranks together equal one process running the global microbatches ``j``."""
    weights, history = _reference(accumulate=2, passes=True)
    assert not torch.allclose(weights, _reference(accumulate=2)[0], rtol=0, atol=1e-6)  # other delays
    for r in ranks:
        got, hist = r["passes"]
        assert torch.allclose(got, weights, rtol=0, atol=1e-6)
        for a, b in zip(hist, history):
            assert (a is None and b is None) or torch.allclose(a, b, rtol=0, atol=1e-6)
    assert torch.equal(ranks[0]["passes"][0], ranks[1]["passes"][0])


def test_a_tied_weight_replica_gradient_is_all_reduced(ranks):
    """The replica's gradient reaches the tied parameter through autograd, so DDP's all-reduce carries both
    uses: 2 ranks equal one process on the full batch."""
    weights = _train_tied()
    for r in ranks:
        assert torch.allclose(r["tied"], weights, rtol=0, atol=1e-6), (r["tied"] - weights).abs().max()
    assert torch.equal(ranks[0]["tied"], ranks[1]["tied"])
