"""float16 / bfloat16 parameters: corrections that keep running statistics of squares keep them in float32
(``StageView.zeros(statistics=True)``), autocast around parameters already in its dtype is not warned about,
and Gap-Aware reads the base optimizer's groups as they are at each step (``add_param_group``)."""
import contextlib
import warnings

import pytest
import torch
from torch import nn

import staleopt
from helpers import batches, mlp, mse

STATISTICS = ("gap-aware", "xpipe", "dc-asgd-a")  # Gap-Aware's v, XPipe's own Adam moments, DC-ASGD-a's mean square


def _train(method, dtype, steps=6, base=None, values=None):
    """``steps`` steps of ``method`` with the parameters and data in ``dtype``; ``values``: start from weights and
    data rounded to that dtype (a float32 run that starts where a half-precision one does)."""
    values = values or dtype
    model = mlp(dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(values))
    model = model.to(dtype)
    opt = staleopt.PipelineOptimizer(model, (base or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))(
        model.parameters()), stages=3, schedule=method)
    for x, y in batches(steps, dtype=torch.float32):
        opt.zero_grad()
        mse(model(x.to(values).to(dtype)), y.to(values).to(dtype)).backward()
        opt.step()
    return model, opt


def _flat(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("method", STATISTICS)
def test_half_parameters_train_as_float32_does(method):
    """In float16 these corrections' eps (1e-8) and the squared steps round to 0, and the update was 0/0: NaN
    weights from the first step (Gap-Aware) or the third (XPipe), no error. With float32 statistics the run
    follows the float32 run from the same (float16-representable) weights to float16's rounding."""
    for dtype in (torch.float16, torch.bfloat16):
        half, _ = _train(method, dtype)
        ref, _ = _train(method, torch.float32, values=dtype)
        assert torch.isfinite(_flat(half)).all(), (method, dtype)
        # (measured: at most 3.6e-3 in float16, 2.4e-2 in bfloat16, Gap-Aware's; plain dataflow 4e-4 and 3e-3)
        tol = 0.06 if dtype is torch.bfloat16 else 0.01
        assert (_flat(half) - _flat(ref)).abs().max() < tol, (method, dtype)


@pytest.mark.parametrize("method", STATISTICS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_statistics_are_float32_for_half_parameters_and_counted(method, dtype):
    _, opt = _train(method, dtype, steps=1)
    want = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    buffers = [t for k in opt.corrections for t in _statistics(k)]
    assert buffers and all(t.dtype == want for t in buffers)
    numel = sum(v.numel for v in opt.chunks if v.H)
    assert sum(t.numel() * t.element_size() for t in buffers) >= numel * want.itemsize  # (memory_bytes counts them)
    assert opt.memory_bytes() >= opt.history_bytes() + sum(t.numel() * t.element_size() for t in buffers)


def _statistics(correction):
    """The running statistics a correction keeps (empty for the others)."""
    name = type(correction).__name__
    if name == "GapAware":
        return [flat for flat, _ in correction._v.values()]
    if name == "DelayCompensation":
        return [flat for flat, _ in correction._ms.values()]
    if name == "WeightPrediction":
        return [flat for key in ("m", "v") for flat in correction._buffers.get(key, [])]
    return []


def test_float32_statistics_leave_float32_runs_bit_for_bit():
    """The statistics' dtype is the parameters' own for float32 and float64: nothing changes there (a float64
    run is the same as one whose statistics were made by the parameters' dtype)."""
    for method in STATISTICS:
        a, _ = _train(method, torch.float64)
        b, _ = _train(method, torch.float64)
        assert torch.equal(_flat(a), _flat(b))
        _, opt = _train(method, torch.float64, steps=1)
        assert all(t.dtype == torch.float64 for k in opt.corrections for t in _statistics(k))


def test_gap_aware_reads_groups_added_after_it_was_built():
    """``add_param_group`` on the wrapper, before the first step: Gap-Aware trains the added group exactly as if
    the base optimizer had held it from the start (it cached the groups when it was built: KeyError)."""
    def run(split):
        model = mlp()
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        first = [p for m in linears[:2] for p in m.parameters()]
        last = list(linears[2].parameters())
        base = torch.optim.SGD([{"params": first}] + ([] if split else [{"params": last, "lr": 0.05}]),
                               lr=0.1, momentum=0.9)
        with warnings.catch_warnings():  # (the split run holds the last layer once add_param_group ran)
            warnings.filterwarnings("ignore", "2 trainable model parameter", UserWarning)
            opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="gap-aware")
        if split:
            opt.add_param_group({"params": last, "lr": 0.05})
        for x, y in batches(5):
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
        return model

    assert torch.equal(_flat(run(True)), _flat(run(False)))


def test_gap_aware_leaves_parameters_the_base_does_not_hold():
    """A model parameter that no group of the base optimizer holds is not moved and not damped (it raised a bare
    KeyError at the first step)."""
    model = mlp()
    held = [p for m in list(model)[:-1] for p in m.parameters()]
    with pytest.warns(UserWarning, match="not in the base optimizer"):
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(held, lr=0.1, momentum=0.9), stages=3,
                                         schedule="gap-aware")
    last = [p.detach().clone() for p in model[-1].parameters()]
    for x, y in batches(4):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(last, model[-1].parameters()))
    assert all(torch.isfinite(g).all() for g in opt.corrections[-1].gap(opt.chunks[0], opt.step_count, 1))


@pytest.mark.parametrize("params, warned", [(torch.bfloat16, False), (torch.float32, True)])
def test_autocast_warns_only_where_it_copies_weights(params, warned):
    """Autocast makes no copy of a weight already in its dtype, so bfloat16 parameters under bfloat16 autocast
    train exactly as without autocast, backward views included: no warning (it said the step behaves as with
    weight stashing). float32 parameters are copied, and warned about (docs/wrapper.md)."""
    def run(autocast):
        model = mlp(dtype=params)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                         schedule="dataflow")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches(5, dtype=params):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                    out = model(x)
                mse(out.to(params), y).backward()
                opt.step()
        return model, [w for w in caught if "autocast" in str(w.message)]

    with_autocast, caught = run(True)
    assert bool(caught) is warned
    if not warned:
        assert torch.equal(_flat(with_autocast), _flat(run(False)[0]))


def test_autocast_that_casts_no_weight_gives_no_warning():
    """bfloat16 weights with a LayerNorm kept in float32, under bfloat16 autocast: autocast casts no weight (the
    layer norm runs in float32), so dataflow's backward views apply and it trains otherwise than stashing. The
    parameters' dtypes differ from autocast's, and that alone warned that the step behaves as with stashing: the
    graph decides now (its casts, found once per autocast dtype)."""
    def run(schedule):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        model.to(torch.bfloat16)[3].float()
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.5), stages=3,
                                         schedule=schedule)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches(5, in_dim=4, out_dim=2, dtype=torch.bfloat16):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                mse(out.float(), y.float()).backward()
                opt.step()
        return model, [w for w in caught if "autocast" in str(w.message)]

    model, caught = run("dataflow")
    assert caught == []
    assert not torch.equal(_flat(model), _flat(run("pipemare-stash")[0]))
