"""PipelineOptimizer with torch.amp: GradScaler on the wrapper, skipped steps, CPU bfloat16 autocast."""
import contextlib
import copy
import math
import warnings

import pytest
import torch

import staleopt
from helpers import batches, mlp, mse

METHOD, STAGES, ARGS = "pipemare", 3, {"anneal_steps": 4, "decay": 0.5}  # T1 and T2 active


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _wrapped(dtype=torch.float64, method=METHOD, momentum=0.9, memory="minimal"):
    model = mlp(dtype=dtype)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    args = ARGS if method == METHOD else None
    return model, staleopt.PipelineOptimizer(model, base, stages=STAGES, schedule=method, method_args=args,
                                             memory=memory)


def _reference(data, clip=None, memory="minimal"):
    """The same training without a scaler."""
    model, opt = _wrapped(memory=memory)
    for x, y in data:
        opt.zero_grad()
        mse(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model, opt


@pytest.mark.parametrize("clip", [None, 0.5])
def test_scaler_on_the_wrapper_equals_unscaled_training(clip):
    """Power-of-two scales are exact: ``scale -> backward -> unscale_(wrapper) [-> clip] -> step(wrapper)``
    gives the unscaled run's weights bit for bit (unscaling twice would not)."""
    data = batches(6)
    ref, _ = _reference(data, clip)
    model, opt = _wrapped()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    for x, y in data:
        opt.zero_grad()
        scaler.scale(mse(model(x), y)).backward()
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() > 2.0 ** 12  # it grew: several different scales were used
    assert opt.step_count == len(data)
    assert torch.equal(_flat(model), _flat(ref))


def test_skipped_step_does_not_advance_history():
    """An inf gradient makes ``scaler.step`` skip ``opt.step``: step count, weights (w_t as seen by
    ``state_dict``) and the base optimizer's state stay; the next steps continue as if the bad batch
    never happened. (``memory="fast"``: ``"minimal"`` drops ``w_(t-H)`` in the step's last pass and refuses
    to run the step again, tests/test_engine_pointing.py.)"""
    data = batches(5)
    ref, ref_opt = _reference(data, memory="fast")
    model, opt = _wrapped(memory="fast")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

    def train(x, y):
        opt.zero_grad()
        scaler.scale(mse(model(x), y)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    for x, y in data[:3]:
        train(x, y)
    before = copy.deepcopy(model.state_dict())
    momentum = {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.state.values())}
    bad = data[3][0].clone()
    bad[0, 0] = math.inf
    train(bad, data[3][1])
    assert scaler.get_scale() == 2.0 ** 9  # the step was skipped and the scale backed off
    assert opt.step_count == 3
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(momentum[k], v["momentum_buffer"]) for k, v in enumerate(opt.state.values()))
    for x, y in data[3:]:
        train(x, y)
    assert opt.step_count == ref_opt.step_count == 5
    assert torch.equal(_flat(model), _flat(ref))
    assert all(torch.equal(a, b) for a, b in zip(opt.state_dict()["staleopt"]["history"]["rings"],
                                                 ref_opt.state_dict()["staleopt"]["history"]["rings"]))


def _bf16_autocast_works() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    except (RuntimeError, TypeError):
        return False


needs_bf16 = pytest.mark.skipif(not _bf16_autocast_works(), reason="CPU bfloat16 autocast not supported here")


def _autocast_run(method, steps=4, scaler=None, dtype=torch.float32, autocast=True):
    model, opt = _wrapped(dtype, method, momentum=0.0)
    for x, y in batches(steps, dtype=dtype):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = mse(out.float(), y.float())
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return model, opt


@needs_bf16
def test_bf16_autocast_with_stashing_equals_stale_gradient_reference():
    """PipeDream (1F1B + stashing) under bf16 autocast: ``w_{t+1} = w_t - lr grad f(w_{t-tau})`` per
    stage, the gradient taken under the same autocast on a copy holding the stale weights."""
    model, opt = _autocast_run("pipedream", steps=5)
    tau = opt.tau_fwd
    assert any(tau)
    ref = mlp(dtype=torch.float32)
    stage_of = [opt.partition.stage_of(p) for p in model.parameters()]
    history = [[p.detach().clone() for p in ref.parameters()]]  # history[t] = w_t
    for t, (x, y) in enumerate(batches(5, dtype=torch.float32)):
        stale = copy.deepcopy(ref)
        with torch.no_grad():
            for j, p in enumerate(stale.parameters()):
                p.copy_(history[max(t - tau[stage_of[j]], 0)][j])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = stale(x)
        mse(out.float(), y).backward()
        with torch.no_grad():
            for p, s in zip(ref.parameters(), stale.parameters()):
                p.add_(s.grad, alpha=-0.1)
        history.append([p.detach().clone() for p in ref.parameters()])
    assert torch.equal(_flat(model), _flat(ref))


@needs_bf16
def test_bf16_autocast_with_grad_scaler_runs_and_matches_unscaled():
    with pytest.warns(UserWarning, match="autocast"):  # pipemare's backward views (see the next test)
        model, opt = _autocast_run("pipemare", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
        plain, _ = _autocast_run("pipemare")
    assert opt.step_count == 4 and torch.isfinite(_flat(model)).all()
    assert torch.allclose(_flat(model), _flat(plain), rtol=0, atol=1e-6)


@needs_bf16
def test_autocast_backward_reads_the_forward_view_documented_limit():
    """Documented limit: autocast saves the *bf16 copy* of each weight it casts (linear, conv,
    matmul) for the backward, so the backward view ``u_bkwd`` never reaches those ops and a schedule
    with ``tau_bkwd != tau_fwd`` (dataflow, 1f1b, pb, T2) trains as if it stashed. Without autocast,
    or with the parameters themselves in bfloat16, the backward view applies. The wrapper warns."""
    with pytest.warns(UserWarning, match="autocast"):
        ac_plain, _ = _autocast_run("dataflow")
    ac_stash, _ = _autocast_run("pipemare-stash")  # dataflow + stashing
    assert torch.equal(_flat(ac_plain), _flat(ac_stash))
    for dtype in (torch.float32, torch.bfloat16):
        a, _ = _autocast_run("dataflow", dtype=dtype, autocast=False)
        b, _ = _autocast_run("pipemare-stash", dtype=dtype, autocast=False)
        assert not torch.equal(_flat(a), _flat(b))


@pytest.mark.parametrize("loop", ["eval-then-train", "microbatches"])
def test_several_forwards_in_one_autocast_region_each_read_their_own_view(loop):
    """autocast keeps its casts of the weights (keyed by the Parameter) to the end of the outermost region: a
    training forward after an eval forward in the same region multiplied with w_t's casts, and microbatch 1 with
    microbatch 0's view (pipedream is exact under autocast). One region per step equals one region per forward."""
    def run(one_region):
        model = mlp(dtype=torch.float32)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=STAGES,
                                         schedule="pipedream", microbatches=2,
                                         microbatch_passes=loop == "microbatches")
        def forward(x):  # in a region of its own unless the step's region is open
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(x)
        for x, y in batches(5, seed=3, dtype=torch.float32):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16) if one_region else contextlib.nullcontext():
                for xc, yc in (zip(x.chunk(2), y.chunk(2)) if loop == "microbatches" else [(x, y)]):
                    if loop == "eval-then-train":
                        model.eval()
                        with torch.no_grad():
                            forward(xc)
                        model.train()
                    mse(forward(xc).float(), yc).backward()
            opt.step()
        return _flat(model)
    assert torch.equal(run(one_region=True), run(one_region=False))


def test_zero_grad_between_a_forward_and_its_backward_counts_nothing():
    """microbatch_passes: a zero_grad() after microbatch 0's forward restarted the count, so microbatch 1 ran as
    microbatch 0 again (its older weights) and step() warned that microbatch 1 had not run."""
    def run(late):
        model, opt = _wrapped(method="dataflow")
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=STAGES,
                                         schedule="dataflow", microbatches=2, microbatch_passes=True)
        for x, y in batches(4, seed=5):
            if not late:
                opt.zero_grad()
            for j, (xc, yc) in enumerate(zip(x.chunk(2), y.chunk(2))):
                out = model(xc)
                if late and j == 0:
                    opt.zero_grad()
                mse(out, yc).backward()
            opt.step()
        return _flat(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(run(late=True), run(late=False))
