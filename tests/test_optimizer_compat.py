"""torch.optim conventions: transparency, schedulers, checkpoints, evaluation, bad inputs, delay tables."""
import copy
import io
import warnings

import pytest
import torch
from torch import nn

import staleopt
from staleopt import schedules
from staleopt.errors import (ConfigError, DelayError, LoopError, OptimizerMismatchError, ScheduleError, StageError,
                             StaleoptError)

from helpers import batches, mlp, mse, train


def convnet(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).double()


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_transparency_zero_delays_bit_identical(name):
    """All delays 0: the wrapper is bit-identical to the base optimizer alone (conv net with BatchNorm)."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(6, 2, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g))
            for _ in range(50)]
    runs = []
    for wrap in (False, True):
        model = convnet()
        opt = OPTIMIZERS[name](model.parameters())
        if wrap:
            opt = staleopt.PipelineOptimizer(model, opt, stages=5, schedule="sync")
        train(model, opt, data, loss_fn=nn.functional.cross_entropy)
        runs.append(copy.deepcopy(model.state_dict()))
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_is_an_optimizer_with_live_param_groups():
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="1f1b")
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is base.param_groups
    opt.param_groups[0]["lr"] = 0.3
    assert base.param_groups[0]["lr"] == 0.3
    assert opt.state is base.state


@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=12),
])
def test_lr_schedulers_drive_the_wrapper(make_sched):
    """A scheduler on the wrapper gives the same lrs and weights as on a base with the same delays built in."""
    data = batches(12, seed=2)

    def run(model, opt):
        sched, lrs = make_sched(opt), []
        for x, y in data:
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
            lrs.append(opt.param_groups[0]["lr"])
            sched.step()
        return lrs

    model, ref_model = mlp(seed=2), mlp(seed=2)
    lrs = run(model, staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
                                                stages=3, schedule="sync"))
    ref_lrs = run(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.5))
    assert lrs == ref_lrs
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["dataflow", "pipedream", "1f1b", "pb"])
def test_state_dict_round_trip_mid_run_is_bit_identical(method):
    data = batches(20, seed=3)
    model = mlp(seed=3)
    opt = staleopt.PipelineOptimizer(model, torch.optim.Adam(model.parameters(), lr=1e-2), stages=3,
                                     schedule=method, microbatches=1)
    train(model, opt, data[:9])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, data[9:])
    expected = [p.detach().clone() for p in model.parameters()]

    buf.seek(0)
    ckpt = torch.load(buf)
    model2 = mlp(seed=99)
    model2.load_state_dict(ckpt["model"])
    opt2 = staleopt.PipelineOptimizer(model2, torch.optim.Adam(model2.parameters(), lr=1e-2), stages=3,
                                      schedule=method, microbatches=1)
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.step_count == 9
    train(model2, opt2, data[9:])
    for a, b in zip(expected, model2.parameters()):
        assert torch.equal(a, b)


def test_hogwild_state_dict_resumes_the_random_delays():
    data = batches(16, seed=4)
    model = mlp(seed=4)
    make = lambda m: staleopt.PipelineOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.05), stages=3,
                                                schedule="hogwild", seed=11)
    opt = make(model)
    train(model, opt, data[:7])
    sd = copy.deepcopy(opt.state_dict())
    msd = copy.deepcopy(model.state_dict())
    train(model, opt, data[7:])
    model2 = mlp(seed=4)
    model2.load_state_dict(msd)
    opt2 = make(model2)
    opt2.load_state_dict(sd)
    train(model2, opt2, data[7:])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_evaluation_and_state_dict_see_current_weights():
    model = mlp(seed=5)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.5), stages=3,
                                     schedule="dataflow")
    data = batches(6, seed=5)
    train(model, opt, data)
    w_t = [p.detach().clone() for p in model.parameters()]
    x, y = data[0]
    model.train()
    out = model(x)  # parameters now hold the stale forward view
    assert any(not torch.equal(p, w) for p, w in zip(model.parameters(), w_t))
    sd = model.state_dict()  # at rest semantics: state_dict sees w_t
    for (k, v), w in zip(sd.items(), w_t):
        assert torch.equal(v, w)
    with opt.current_weights():
        for p, w in zip(model.parameters(), w_t):
            assert torch.equal(p, w)
    model.eval()
    with torch.no_grad():
        ev = model(x)
    for p, w in zip(model.parameters(), w_t):
        assert torch.equal(p, w)
    ref = mlp(seed=0)
    ref.load_state_dict(sd)
    assert torch.equal(ev, ref(x))
    model.train()
    mse(out, y).backward()  # the pending backward still works after the evaluation in between
    opt.step()


def test_a_submodules_state_dict_mid_pass_sees_current_weights():
    """``ddp.module.state_dict()`` or a LightningModule's ``net.state_dict()`` between a training forward and its
    backward reads ``w_t``, as the root's does (it read the stale forward view: a checkpoint of stale weights)."""
    model = nn.Sequential(mlp(seed=5))
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.5), stages=3,
                                     schedule="dataflow")
    data = batches(6, seed=5)
    train(model, opt, data)
    w_t = {k: v.clone() for k, v in model[0].state_dict().items()}
    x, y = data[0]
    out = model(x)
    assert any(not torch.equal(p, w_t[k]) for k, p in model[0].named_parameters())
    for sub in (model[0], model[0][0]):
        assert all(torch.equal(v, w_t[k if sub is model[0] else "0." + k]) for k, v in sub.state_dict().items())
    mse(out, y).backward()
    opt.step()


def test_a_checkpoint_between_the_last_backward_and_step_warns_and_resumes_by_stepping():
    """Saved after the step's last backward and before step() in memory='minimal': the save warns; a process
    that loads it with the gradients steps on exactly; one that runs the pass again gets a LoopError naming this
    cause (it named retried passes and skipped steps only)."""
    import copy

    def build():
        model = mlp(seed=8)
        return model, staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.3), stages=3,
                                                 schedule="dataflow")

    data = batches(7, seed=8)
    model, opt = build()
    train(model, opt, data[:5])
    x, y = data[5]
    opt.zero_grad()
    mse(model(x), y).backward()
    with pytest.warns(UserWarning, match=r"after the step's last backward pass and before opt.step\(\)"):
        ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                              "grads": [p.grad for p in model.parameters()]})
    opt.step()
    train(model, opt, data[6:])
    for redo in (False, True):
        m2, o2 = build()
        m2.load_state_dict(ckpt["model"])
        o2.load_state_dict(ckpt["opt"])
        if redo:
            o2.zero_grad()
            with pytest.raises(LoopError, match=r"resumes a checkpoint saved after the step's last backward"):
                mse(m2(x), y).backward()
                o2.step()
            continue
        for p, g in zip(m2.parameters(), ckpt["grads"]):
            p.grad = g.clone()
        o2.step()
        train(m2, o2, data[6:])
        assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), model.parameters()))
    with warnings.catch_warnings():  # after step() (and in memory='fast') a save is silent
        warnings.simplefilter("error")
        opt.state_dict()


def test_closure_and_zero_grad():
    model = mlp(seed=6)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                     schedule="1f1b")
    x, y = batches(1, seed=6)[0]

    def closure():
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and opt.step_count == 1
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    mse(model(x), y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_add_param_group_joins_the_pipeline():
    model = mlp(seed=7)
    params = list(model.parameters())
    base = torch.optim.SGD(params[:4], lr=0.1)
    with pytest.warns(UserWarning, match="not in the base optimizer"):
        opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="1f1b")
    opt.add_param_group({"params": params[4:], "lr": 0.01})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.01
    with pytest.raises(OptimizerMismatchError, match="not in the pipeline partition"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_history_is_minimal_and_compact():
    model = mlp((5, 7, 6, 3))
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                     schedule="dataflow")  # tau_fwd = (5, 3, 1)
    sizes = [s.numel for s in opt.partition]
    itemsize = 8
    # exactly max(tau) past versions per stage: sum_i max(tau_fwd_i, tau_bkwd_i) * |w_i|
    assert opt.history_bytes() == sum(t * n * itemsize for t, n in zip([5, 3, 1], sizes))
    assert [c.ring.shape[0] for c in opt.chunks] == [5, 3, 1]
    train(model, opt, batches(7))
    assert opt.history_bytes() == sum(t * n * itemsize for t, n in zip([5, 3, 1], sizes))
    # T2 rewrites the backward view in place: one free slot per corrected stage, plus its delta buffer and its
    # factors 0, -1, .., -5
    m3 = mlp()
    t2 = staleopt.PipelineOptimizer(m3, torch.optim.SGD(m3.parameters(), lr=0.1), stages=3, schedule="pipemare")
    assert [c.ring.shape[0] for c in t2.chunks] == [6, 4, 2]
    assert t2.memory_bytes() == t2.history_bytes() + (sum(sizes) + 6) * itemsize
    m2 = mlp()
    sync = staleopt.PipelineOptimizer(m2, torch.optim.SGD(m2.parameters(), lr=0.1), stages=3, schedule="sync")
    assert sync.history_bytes() == 0


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_typed_errors():
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    n_units = 3
    with pytest.raises(StageError, match=f"1 <= stages <= {n_units}"):
        staleopt.PipelineOptimizer(model, base, stages=4)
    with pytest.raises(StageError, match="1 <= stages"):
        staleopt.PipelineOptimizer(model, base, stages=0)
    with pytest.raises(ConfigError, match="microbatches"):
        staleopt.PipelineOptimizer(model, base, stages=2, microbatches=0)
    with pytest.raises(ScheduleError, match="dataflow") as e:
        staleopt.PipelineOptimizer(model, base, stages=2, schedule="pipemore")
    assert "valid" in str(e.value) or "methods:" in str(e.value)
    with pytest.raises(DelayError, match=">= 0"):
        schedules.get("custom", tau_fwd=[1, -1, 0])
    with pytest.raises(DelayError, match="integers"):
        schedules.get("custom", tau_fwd=[1, 0.5, 0])
    with pytest.raises(DelayError, match="one delay per stage"):
        staleopt.PipelineOptimizer(model, base, stages=3, schedule=schedules.get("custom", tau_fwd=[1, 0]))
    with pytest.raises(DelayError, match="tau_bkwd has 2"):
        schedules.get("custom", tau_fwd=[1, 0, 0], tau_bkwd=[0, 0])
    other = nn.Linear(2, 2)
    with pytest.raises(OptimizerMismatchError, match="not in the model"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(list(model.parameters()) + [other.weight], lr=0.1),
                                   stages=2)
    with pytest.warns(UserWarning, match="will not train"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(list(model.parameters())[:2], lr=0.1), stages=2)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(StageError, match="no trainable parameters"):
        staleopt.PipelineOptimizer(frozen, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), stages=1)
    with pytest.raises(ConfigError, match="torch.optim.Optimizer"):
        staleopt.PipelineOptimizer(model, "sgd", stages=1)
    # every error is a StaleoptError and a ValueError
    for cls in (StageError, DelayError, ScheduleError, OptimizerMismatchError, ConfigError):
        assert issubclass(cls, StaleoptError) and issubclass(cls, ValueError)


def test_moving_the_model_after_construction_is_detected():
    model = mlp()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3)
    model.float()
    x, y = batches(1)[0]
    mse(model(x.float()), y.float()).backward()
    with pytest.raises(StaleoptError, match="moved or replaced"):
        opt.step()


# ----------------------------------------------------------------------------- delay tables
DELAY_TABLES = {
    # (schedule, P, N): (tau_fwd, tau_bkwd)
    ("sync", 4, 1): ([0, 0, 0, 0], [0, 0, 0, 0]),
    ("dataflow", 4, 1): ([7, 5, 3, 1], [0, 0, 0, 0]),
    ("dataflow", 4, 2): ([4, 3, 2, 1], [0, 0, 0, 0]),
    ("dataflow", 4, 4): ([2, 2, 1, 1], [0, 0, 0, 0]),
    ("dataflow", 1, 1): ([1], [0]),
    ("1f1b", 4, 1): ([3, 2, 1, 0], [0, 0, 0, 0]),
    ("1f1b", 4, 2): ([2, 1, 1, 0], [0, 0, 0, 0]),
    ("1f1b", 5, 4): ([1, 1, 1, 1, 0], [0, 0, 0, 0, 0]),
    ("pb", 4, 1): ([6, 4, 2, 0], [0, 0, 0, 0]),
    ("pb", 3, 2): ([2, 1, 0], [0, 0, 0]),
    ("pb", 4, 3): ([2, 2, 1, 0], [0, 0, 0, 0]),
    ("2bw", 4, 4): ([1, 1, 1, 1], [1, 1, 1, 1]),
    ("2bw", 1, 1): ([0], [0]),
}


@pytest.mark.parametrize("key", sorted(DELAY_TABLES))
def test_schedule_delay_tables(key):
    name, P, N = key
    assert schedules.get(name).delays(P, N) == DELAY_TABLES[key]


def test_custom_schedule_and_registry():
    s = schedules.get("custom", tau_fwd=[2, 1], tau_bkwd=[1, 0])
    assert s.delays(2, 1) == ([2, 1], [1, 0])
    assert set(schedules.names()) >= {"sync", "dataflow", "1f1b", "pb", "custom", "2bw", "hogwild"}
    with pytest.raises(ScheduleError, match="m >= d"):
        schedules.get("2bw").delays(4, 2)


def test_hogwild_is_seeded_truncated_and_has_the_requested_means():
    s = schedules.get("hogwild", tau_max=6, means=[4.5, 3.0, 1.0, 0.5])
    draws = []
    for _ in range(2):
        g = torch.Generator().manual_seed(3)
        draws.append([s.sample(4, 1, g)[0] for _ in range(4000)])
    assert draws[0] == draws[1]
    flat = [t for d in draws[0] for t in d]
    assert min(flat) == 0 and max(flat) == 6
    for i, m in enumerate([4.5, 3.0, 1.0, 0.5]):
        law = schedules.Hogwild.law(m, 6)
        assert float((law * torch.arange(7.0, dtype=torch.float64)).sum()) == pytest.approx(m, abs=1e-9)
        emp = sum(d[i] for d in draws[0]) / len(draws[0])
        assert emp == pytest.approx(m, abs=0.12)  # 4000 draws: a few standard errors
    # the law is the floor of a truncated exponential: geometric ratios
    law = schedules.Hogwild.law(1.0, 6)
    ratios = law[1:] / law[:-1]
    torch.testing.assert_close(ratios, torch.full_like(ratios, float(ratios[0])))
    assert schedules.get("hogwild").delays(4, 1) == ([14] * 4, [14] * 4)  # default tau_max: 2 x dataflow's max
    with pytest.raises(ScheduleError, match="below tau_max"):
        schedules.get("hogwild", tau_max=3, means=[3, 1]).sample(2, 1, torch.Generator())


def test_a_loop_that_bypasses_the_wrapped_model_is_warned_about():
    model = mlp(seed=8)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                     schedule="dataflow")
    x, y = batches(1, seed=8)[0]
    h = x
    for layer in model:  # calls the layers, not the wrapped model: no hook fires
        h = layer(h)
    mse(h, y).backward()
    with pytest.warns(UserWarning, match="saw no training forward pass"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()


def test_microbatch_passes_follow_the_per_microbatch_table_and_reset_at_zero_grad():
    model = mlp(seed=9)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                     schedule="dataflow", microbatches=2, microbatch_passes=True)
    assert opt.max_delays == ([3, 2, 1], [0, 0, 0])
    x, y = batches(1, seed=9)[0]
    seen = []
    for _ in range(2):  # an abandoned step (a GradScaler skip) is fine: zero_grad starts the passes again
        opt.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            mse(model(xs), ys).backward()
            seen.append(opt.tau_fwd)
    assert seen == [[3, 2, 1], [2, 1, 0]] * 2
    with pytest.raises(StaleoptError, match="training forward 3 since the last zero_grad.*N=2 runs exactly one "
                                            "training forward per microbatch"):
        model(x)
    opt.step()
    assert opt.tau_fwd == [3, 2, 1]


def test_memory_mode_is_checked():
    model = mlp()
    with pytest.raises(ConfigError, match="'minimal'.*'fast'.*GradScaler skips") as e:
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, memory="small")
    assert "fewer copies" not in str(e.value)  # 'fast' copies more per step than 'minimal' (docs/engine.md)


def _saved(method, base=torch.optim.SGD, memory="minimal", **overrides):
    """A model trained 4 steps by ``method`` and its optimizer's state dict."""
    model = mlp(seed=5)
    sched, corrections = staleopt.methods.resolve(method, **overrides)
    opt = staleopt.PipelineOptimizer(model, base(model.parameters(), lr=0.05), stages=3, schedule=sched,
                                     corrections=corrections, memory=memory)
    train(model, opt, batches(4, seed=5))
    return opt.state_dict()


def _fresh(method, base=torch.optim.SGD, memory="minimal", **overrides):
    model = mlp(seed=6)
    sched, corrections = staleopt.methods.resolve(method, **overrides)
    return staleopt.PipelineOptimizer(model, base(model.parameters(), lr=0.01), stages=3, schedule=sched,
                                      corrections=corrections, memory=memory)


@pytest.mark.parametrize("saved, loaded, differs", [
    (("pipeoptim", {}), ("spectrain", {}), r"WeightPrediction\(rule='optimizer'.*rule='sgdm'"),
    (("pipemare-w", {"warmup_steps": 2}), ("pipemare-w", {"warmup_steps": 1000}), r"Warmup\(steps=2\)"),
    (("pipemare", {"decay": 0.1}), ("pipemare", {"decay": 0.5}), r"decay=0.1.*decay=0.5"),
    (("gap-aware", {"beta": 0.9}), ("gap-aware", {}), r"beta=0.9,"),
])
def test_a_checkpoint_of_other_correction_settings_is_refused(saved, loaded, differs):
    """The signature holds each correction's settings (it held their class names: pipeoptim's state loaded into
    spectrain, PipeMareW's 2 warmup steps into 1000 — back to synchronous in mid-run)."""
    state = _saved(saved[0], **saved[1])
    with pytest.raises(OptimizerMismatchError, match="corrections .*" + differs):
        _fresh(loaded[0], **loaded[1]).load_state_dict(state)


def test_a_refused_checkpoint_leaves_the_base_optimizer_as_it_was():
    """Every refusal comes before the base optimizer loads (a memory-mode mismatch was refused after it: its
    momentum and lr were the checkpoint's, the weights and history the run's), and names what differs."""
    state = _saved("pipemare", memory="minimal")
    opt = _fresh("pipemare", memory="fast")
    before = copy.deepcopy(opt.base_optimizer.state_dict())
    with pytest.raises(OptimizerMismatchError, match="memory 'minimal' in the checkpoint, 'fast' here"):
        opt.load_state_dict(state)
    older = copy.deepcopy(state)  # a checkpoint from before the signature recorded the memory mode
    del older["staleopt"]["signature"]["memory"], older["staleopt"]["signature"]["base"]
    older["staleopt"]["signature"]["chunks"] = opt._signature()["chunks"]  # (rows that happen to agree)
    with pytest.raises(staleopt.errors.CheckpointError, match="memory='minimal'.*memory='fast'"):
        opt.load_state_dict(older)
    assert opt.base_optimizer.state_dict() == before
    with pytest.raises(OptimizerMismatchError, match="base 'SGD' in the checkpoint, 'Adam' here"):
        _fresh("pipemare", base=torch.optim.Adam).load_state_dict(state)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_nadam_resumes_bit_for_bit_in_every_parameter_dtype(dtype):
    """torch's load casts NAdam's 0-d mu_product (kept in float32) to the parameters' dtype: the resumed run
    then computed it in float64 (differing by ~1e-11) or rounded it (bfloat16: 0.091214 -> 0.091309). The
    wrapper's load keeps the saved dtype (asyncpp steps NAdam)."""
    def build(seed):
        model = mlp(seed=seed).to(dtype)
        opt = staleopt.PipelineOptimizer(model, torch.optim.NAdam(model.parameters(), lr=1e-2, momentum_decay=0.004),
                                         stages=3, schedule="pipedream")
        return model, opt
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(8, seed=7)]
    model, opt = build(7)
    train(model, opt, data[:4])
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, data[4:])
    again, opt2 = build(8)
    again.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    assert {st["mu_product"].dtype for st in opt2.base_optimizer.state.values()} == {torch.float32}
    train(again, opt2, data[4:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("base", [lambda ps: torch.optim.Adam(ps, lr=0.01),
                                  lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)])
def test_a_0d_parameters_state_is_cast_on_load_as_torch_casts_it(base):
    """The wrapper's load kept the saved dtype of every 0-d state tensor (for NAdam's mu_product), so a 0-d
    parameter's own state (a learnable temperature's exp_avg, momentum_buffer) kept a float32 checkpoint's dtype in
    a float64 model: Adam then failed inside torch, SGD kept a float32 buffer silently. Cast as torch's load casts."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.temp = nn.Linear(5, 6), nn.Linear(6, 3), nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x * self.temp)))
    data = batches(6, seed=3, dtype=torch.float32)
    model = Net()
    opt = staleopt.PipelineOptimizer(model, base(model.parameters()), stages=2, schedule="dataflow")
    train(model, opt, data[:3])
    state = copy.deepcopy(opt.state_dict())
    plain_model = Net().double()
    plain = base(plain_model.parameters())
    plain.load_state_dict({k: v for k, v in state.items() if k != "staleopt"})
    again = Net().double()
    again.load_state_dict(model.state_dict())
    opt2 = staleopt.PipelineOptimizer(again, base(again.parameters()), stages=2, schedule="dataflow")
    opt2.load_state_dict(state)
    got = {k: v.dtype for k, v in opt2.base_optimizer.state[again.temp].items() if k != "step"}
    assert got == {k: v.dtype for k, v in plain.state[plain_model.temp].items() if k != "step"}
    assert set(got.values()) == {torch.float64}
    train(again, opt2, [(x.double(), y.double()) for x, y in data[3:]])


def test_a_partition_of_another_model_object_is_refused():
    """A Partition made from a copy of the model (or before the model was rebuilt) would train without its delays,
    with only unrelated warnings: refused at construction."""
    model, twin = mlp(seed=1), mlp(seed=1)
    part = staleopt.partition_model(twin, 3)
    with pytest.raises(StageError, match="not this model's"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=part)
    staleopt.PipelineOptimizer(twin, torch.optim.SGD(twin.parameters(), lr=0.1), stages=part)


def test_a_partition_that_misses_trainable_parameters_is_refused():
    """A Partition made before a head was added (or a layer unfrozen) holds no stage for it: the head would train
    without delay and the only warning blamed a freeze. Refused at construction, naming the parameters; one that
    the base optimizer does not update is no one's business."""
    model = mlp()
    part = staleopt.partition_model(model, 2)
    model.add_module("head", nn.Linear(3, 2).double())
    with pytest.raises(StageError, match=r"\['head.weight', 'head.bias'\].*partition_model\(model"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=part)
    body = [p for n, p in model.named_parameters() if not n.startswith("head")]
    staleopt.PipelineOptimizer(model, torch.optim.SGD(body, lr=0.1), stages=part)


@pytest.mark.parametrize("microbatch_passes", [True, False])
def test_a_checkpoint_between_a_forward_and_its_backward_resumes_by_running_that_microbatch_again(microbatch_passes):
    """The saved pass counts leave out the forward whose backward had not run (a new process cannot run it): the
    resumed loop runs the step again and equals the uninterrupted run (under microbatch_passes it raised 'training
    forward 4', and a plain loop learnt 4 forwards per step, losing minimal memory's cheap last pass)."""
    import torch.nn.functional as F
    N = 3
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(6, 12, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6, 12), generator=g)

    def build():
        m = mlp(seed=1)
        kw = {"microbatches": N, "microbatch_passes": True} if microbatch_passes else {}
        return m, staleopt.PipelineOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.05), stages=3, **kw)

    def step(m, o, s):
        o.zero_grad()
        for xj, yj in zip(X[s].chunk(N), Y[s].chunk(N)):
            (F.cross_entropy(m(xj), yj) / N).backward()
        o.step()

    ref, ref_opt = build()
    for s in range(6):
        step(ref, ref_opt, s)
    model, opt = build()
    for s in range(3):
        step(model, opt, s)
    opt.zero_grad()
    F.cross_entropy(model(X[3].chunk(N)[0]), Y[3].chunk(N)[0])  # microbatch 0's forward of step 3 ...
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # ... and the checkpoint
    again, again_opt = build()
    again.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["opt"])
    for s in range(3, 6):
        step(again, again_opt, s)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), ref.parameters()))
    assert again_opt._expected == ref_opt._expected


@pytest.mark.parametrize("method", ["pipemare-t1", "staleness-aware"])
def test_per_stage_lr_steps_the_parameters_a_group_holds_now(method):
    """A group's ``params`` edited between steps (a layer removed to freeze it, one appended to start training it):
    torch.optim steps the list as it is now. Under per-stage step sizes the base stepped the lists of the first
    split for ever (a removed layer kept training, an appended one never trained), silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    params, lr = list(model.parameters()), 0.05
    with pytest.warns(UserWarning, match="will not train"):
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(params[:4], lr=lr), stages=3, schedule=method)
    g = torch.Generator().manual_seed(1)
    for t in range(6):
        if t == 3:
            group = opt.param_groups[0]
            group["params"] = [p for p in group["params"] if not any(p is q for q in params[:2])]
            group["params"].extend(params[4:])
        x, y = torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
        before = [p.detach().clone() for p in params]
        opt.zero_grad()
        mse(model(x), y).backward()
        grads = [p.grad.clone() for p in params]
        opt.step()
        held = params[:4] if t < 3 else params[2:]
        for p, w, d in zip(params, before, grads):
            f = opt.lr_factor(opt.partition.stage_of(p))
            want = w.add(d, alpha=-lr * f) if any(p is q for q in held) else w
            assert torch.equal(p.detach(), want), (t, f)
