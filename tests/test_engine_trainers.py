"""The wrapper inside real trainers: the four ways it used to fail silently, written as the
trainers trigger them (Lightning's lr_find then fit, schedule-free / Adan group state under T1,
accelerate's autocast inside forward, modules registered out of execution order)."""
import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import staleopt
from staleopt.corrections import DiscrepancyCorrection, LRReschedule, Warmup, t1_factor
from staleopt.errors import DetachedError, StageOrderError

from helpers import batches, mlp, mse, train


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _wrap(model, lr=0.05, method="pipemare", **kw):
    return staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                      stages=3, schedule=method, **kw)


def _hooks(model):
    """The root's forward hooks and every module's state_dict pre-hooks (a wrapper's: one per module owning a
    parameter; 2 + 3 for an mlp)."""
    return len(model._forward_pre_hooks) + len(model._forward_hooks) + \
        sum(len(m._state_dict_pre_hooks) for m in model.modules())


# ----------------------------------------------------------------------------- (a) one live wrapper
def test_lr_find_then_fit_trains_like_a_fresh_run():
    """Lightning's Tuner.lr_find: wrapper A sweeps the lr for a few steps, the initial weights are
    restored, fit builds wrapper B. B's run must equal a fresh run bit for bit."""
    data = batches(12, seed=1)
    model = mlp(seed=1)
    initial = copy.deepcopy(model.state_dict())
    finder = _wrap(model)
    sweep = torch.optim.lr_scheduler.ExponentialLR(finder, gamma=3.0)
    for x, y in data[:4]:
        finder.zero_grad()
        mse(model(x), y).backward()
        finder.step()
        sweep.step()
    model.load_state_dict(initial)  # lr_find restores the checkpoint it took before the sweep
    fit = _wrap(model)
    train(model, fit, data)

    fresh = mlp(seed=1)
    train(fresh, _wrap(fresh), data)
    _assert_equal(_weights(model), _weights(fresh))
    assert _hooks(model) == 5  # B's own hooks only


def test_fit_twice_continues_from_the_current_weights():
    """A second fit() builds a new wrapper on the trained model, even right after a forward pass
    whose backward never ran (the parameters held a stale view): B starts from A's w_t."""
    data = batches(10, seed=2)
    model = mlp(seed=2)
    first = _wrap(model)
    train(model, first, data[:5])
    w_t = _weights(model)
    model(data[0][0])  # a training forward: the parameters now hold the forward views
    second = _wrap(model)
    _assert_equal(_weights(model), w_t)
    train(model, second, data[5:])

    fresh = mlp(seed=2)
    with torch.no_grad():
        for p, w in zip(fresh.parameters(), w_t):
            p.copy_(w)
    train(fresh, _wrap(fresh), data[5:])
    _assert_equal(_weights(model), _weights(fresh))


@pytest.mark.parametrize("first, second", [("pipedream", "pipemare"), ("dataflow", "dataflow")])
def test_a_second_wrapper_with_lr_zero_does_not_move_the_weights(first, second):
    data = batches(8, seed=3)
    model = mlp(seed=3)
    train(model, _wrap(model, method=first), data[:4])
    before = _weights(model)
    frozen = _wrap(model, lr=0.0, method=second)
    train(model, frozen, data[4:])
    _assert_equal(_weights(model), before)


def test_the_replaced_wrapper_raises_a_typed_error_and_its_hooks_are_gone():
    data = batches(4, seed=4)
    model = mlp(seed=4)
    old = _wrap(model)
    train(model, old, data[:2])
    x, y = data[2]
    out = model(x)  # a backward pending from the old wrapper: its tensor hook must stay inert
    new = _wrap(model)
    assert _hooks(model) == 5
    mse(out, y).backward()
    for use in (old.step, old.zero_grad, old.state_dict, lambda: old.load_state_dict(new.state_dict()),
                lambda: old.current_weights().__enter__()):
        with pytest.raises(DetachedError, match="took over its parameters"):
            use()
    train(model, new, data[3:])


def test_a_wrapper_on_a_module_sharing_the_parameters_is_replaced_too():
    """torch.compile, DDP and Lightning wrap the user's module: one live wrapper per *set of weights*."""

    class Outer(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    model = mlp(seed=5)
    outer = Outer(model)
    first = _wrap(outer)
    _wrap(model)
    assert len(outer._forward_pre_hooks) + len(outer._forward_hooks) == 0 and _hooks(model) == 5
    with pytest.raises(DetachedError):
        first.step()


def test_wrappers_on_disjoint_models_coexist():
    """A GAN's generator and discriminator each get their own wrapper: neither replaces the other."""
    gen, disc = mlp(seed=6), mlp((3, 4, 2, 1), seed=7)
    g_opt, d_opt = _wrap(gen, method="dataflow"), _wrap(disc, method="dataflow")
    for x, y in batches(3, seed=6):
        g_opt.zero_grad()
        d_opt.zero_grad()
        disc(gen(x)).pow(2).mean().backward()
        g_opt.step()
        d_opt.step()
    assert g_opt.step_count == d_opt.step_count == 3


def test_a_collected_wrapper_leaves_no_active_hooks():
    data = batches(6, seed=8)
    model = mlp(seed=8)
    opt = _wrap(model)
    train(model, opt, data[:3])
    model(data[3][0])  # a pending forward (its tensor hooks reference the wrapper only weakly)
    with opt.current_weights():
        pass
    del opt
    gc.collect()
    assert _hooks(model) == 0
    twin = copy.deepcopy(model)
    for m in (model, twin):
        train(m, torch.optim.SGD(m.parameters(), lr=0.05), data[3:])
    _assert_equal(_weights(model), _weights(twin))


def test_remove_hooks_detaches():
    model = mlp(seed=9)
    opt = _wrap(model)
    train(model, opt, batches(2, seed=9))
    opt.remove_hooks()
    assert _hooks(model) == 0
    with pytest.raises(DetachedError, match="remove_hooks"):
        opt.step()


# ----------------------------------------------------------------------------- (b) group state under T1
class GroupStateSGD(torch.optim.Optimizer):
    """An optimizer that keeps state in its param groups, as schedule-free (``k``, ``weight_sum``)
    and timm's Adan / Lamb (``step``, which starts as ``None``) do, and whose update uses it."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr, k=0, weight_sum=0.0, step=None))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = 1 if group["step"] is None else group["step"] + 1
            group["k"] += 1
            group["weight_sum"] += group["lr"] ** 2
            c = group["lr"] ** 2 / group["weight_sum"]  # schedule-free's averaging weight
            for p in group["params"]:
                if p.grad is None:
                    continue
                z = self.state[p].setdefault("z", p.detach().clone())
                z.add_(p.grad, alpha=-group["lr"] / group["step"] ** 0.5)
                p.lerp_(z, c)


def _t1_run(model, data, warmup):
    """The method: dataflow + (warmup) + T1 + T2, all in the wrapper."""
    corrections = ([Warmup(warmup)] if warmup else []) + [LRReschedule(6), DiscrepancyCorrection(0.3)]
    opt = staleopt.PipelineOptimizer(model, GroupStateSGD(model.parameters(), lr=0.05), stages=3,
                                     schedule="dataflow", corrections=corrections)
    train(model, opt, data)
    return opt


def _hand_scaled_run(model, data, warmup):
    """The same method with T1 done by hand: one group per stage, lr scaled before every step."""
    layers = [m for m in model if isinstance(m, nn.Linear)]
    base = GroupStateSGD([{"params": list(l.parameters())} for l in layers], lr=0.05)
    corrections = ([Warmup(warmup)] if warmup else []) + [DiscrepancyCorrection(0.3)]
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="dataflow", corrections=corrections)
    for t, (x, y) in enumerate(data):
        for group, tau in zip(base.param_groups, opt.tau_fwd):
            group["lr"] = 0.05 * t1_factor(tau, max(t - warmup, 0), 6)
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("warmup", [0, 3])
def test_per_stage_lr_keeps_the_optimizers_group_state(warmup):
    data = batches(12, seed=10)
    model, ref = mlp(seed=10), mlp(seed=10)
    opt = _t1_run(model, data, warmup)
    ref_opt = _hand_scaled_run(ref, data, warmup)
    _assert_equal(_weights(model), _weights(ref))
    assert opt.param_groups[0]["step"] == opt.param_groups[0]["k"] == 12  # the user's group shows it
    assert opt.param_groups[0]["weight_sum"] == ref_opt.param_groups[0]["weight_sum"]  # stage 0's


def test_per_stage_group_state_survives_a_checkpoint():
    data = batches(12, seed=11)
    model = mlp(seed=11)
    opt = _t1_run(model, data[:5], warmup=0)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, data[5:])

    resumed = mlp(seed=0)
    resumed.load_state_dict(ckpt["model"])
    opt2 = staleopt.PipelineOptimizer(resumed, GroupStateSGD(resumed.parameters(), lr=0.05), stages=3,
                                      schedule="dataflow", corrections=[LRReschedule(6), DiscrepancyCorrection(0.3)])
    opt2.load_state_dict(ckpt["opt"])
    train(resumed, opt2, data[5:])
    _assert_equal(_weights(model), _weights(resumed))


def _lockstep_with_hand_t1(t, x, y, wrapped, hand):
    """Step ``t`` of both runs: the wrapper's T1 (K = 6) and, by hand, each stage group's ``lr`` scaled first."""
    for group, tau in zip(hand[1].param_groups, hand[1].tau_fwd):
        group["lr"] = 0.05 * t1_factor(tau, t, 6)
    for m, o in (wrapped, hand):
        o.zero_grad()
        mse(m(x), y).backward()
        o.step()


def test_a_user_write_to_an_optimizer_owned_group_key_reaches_every_stage():
    data = batches(6, seed=12)
    model, ref = mlp(seed=12), mlp(seed=12)
    opt = _t1_run(model, data[:3], warmup=0)
    ref_opt = _hand_scaled_run(ref, data[:3], warmup=0)
    opt.param_groups[0]["weight_sum"] = 1.0
    for group in ref_opt.param_groups:
        group["weight_sum"] = 1.0
    for t, (x, y) in enumerate(data[3:], start=3):
        _lockstep_with_hand_t1(t, x, y, (model, opt), (ref, ref_opt))
    _assert_equal(_weights(model), _weights(ref))


# ----------------------------------------------------------------------------- (c) autocast inside forward
def _accelerate_style(model):
    """What accelerate does for mixed precision: ``model.forward`` runs under autocast."""
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    return model


def test_autocast_inside_forward_is_detected():
    model = _accelerate_style(mlp(seed=13).float())
    opt = _wrap(model, method="dataflow")
    x, y = (t.float() for t in batches(1, seed=13)[0])
    with pytest.warns(UserWarning, match="inside model.forward"):
        out = model(x)
    mse(out.float(), y).backward()
    opt.step()


def test_autocast_inside_forward_is_fine_when_the_backward_view_is_the_forward_view():
    model = _accelerate_style(mlp(seed=14).float())
    opt = _wrap(model, method="pipedream")  # stashing: tau_bkwd = tau_fwd
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in batches(3, seed=14):
            opt.zero_grad()
            mse(model(x.float()).float(), y.float()).backward()
            opt.step()


# ----------------------------------------------------------------------------- (d) registration order
class HeadFirst(nn.Module):
    """Registers its output layer before its input layer (a common way to write a model)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(6, 3)
        self.body = nn.Linear(5, 6)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


class BodyFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _pair(dtype=torch.float64):
    torch.manual_seed(15)
    out_of_order = HeadFirst().to(dtype)
    in_order = BodyFirst().to(dtype)
    in_order.load_state_dict(out_of_order.state_dict())
    return out_of_order, in_order


def test_modules_registered_out_of_execution_order_are_refused():
    model, _ = _pair()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=2,
                                     schedule="dataflow")
    x, _ = batches(1, seed=15)[0]
    before = _weights(model)
    with pytest.raises(StageOrderError, match="registers 'head' before 'body' but runs it after.*example_input"):
        model(x)
    _assert_equal(_weights(model), before)
    assert opt.step_count == 0


def test_partitioning_by_execution_order_trains_like_the_model_registered_in_order():
    model, in_order = _pair()
    data = batches(10, seed=16)
    part = staleopt.partition_model(model, 2, example_input=data[0][0])
    assert [s.modules for s in part] == [["body"], ["head"]]
    runs = []
    for m, stages in ((model, part), (in_order, 2)):
        opt = staleopt.PipelineOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), stages=stages,
                                         schedule="pipemare")
        train(m, opt, data)
        runs.append([m.body.weight.detach(), m.body.bias.detach(), m.head.weight.detach(), m.head.bias.detach()])
    _assert_equal(*runs)


def test_a_user_change_to_a_group_key_reaches_every_stage_at_the_next_step():
    """T1 with an optimizer that writes no group key (torch's SGD): the per-stage groups take only ``lr`` while
    the user's group is unchanged, and every other key the user (or a scheduler) changes at the next step —
    momentum and weight decay here, against one group per stage set by hand."""
    data = batches(8, seed=13)
    model, ref = mlp(seed=13), mlp(seed=13)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=3,
                                     schedule="dataflow", corrections=[LRReschedule(6)])
    layers = [m for m in ref if isinstance(m, nn.Linear)]
    base = torch.optim.SGD([{"params": list(l.parameters())} for l in layers], lr=0.05, momentum=0.9)
    ref_opt = staleopt.PipelineOptimizer(ref, base, stages=3, schedule="dataflow")
    for t, (x, y) in enumerate(data):
        if t == 3:
            opt.param_groups[0]["momentum"] = 0.5
            for group in base.param_groups:
                group["momentum"] = 0.5
        if t == 5:
            opt.param_groups[0].update(weight_decay=0.01)
            for group in base.param_groups:
                group["weight_decay"] = 0.01
        _lockstep_with_hand_t1(t, x, y, (model, opt), (ref, ref_opt))
    _assert_equal(_weights(model), _weights(ref))
    assert opt.param_groups[0]["momentum"] == 0.5 and "k" not in opt.param_groups[0]
