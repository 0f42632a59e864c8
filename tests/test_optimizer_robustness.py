"""Edge cases found in review: copies of the model, rest state after skipped steps, groups, odd models."""
import copy
import gc
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import staleopt
from staleopt import schedules
from staleopt.errors import ConfigError, LoopError, StaleoptError

from helpers import batches, mlp, mse, train


def _opt(model, schedule="pipemare", **kw):
    return staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                      stages=3, schedule=schedule, **kw)


def test_model_copies_and_pickles_are_independent_of_the_optimizer():
    model = mlp(seed=1)
    opt = _opt(model)
    train(model, opt, batches(4, seed=1))
    twin = copy.deepcopy(model)  # AveragedModel / EMA do this
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (twin, loaded):
        for a, b in zip(m.parameters(), model.parameters()):
            assert torch.equal(a, b)
        x, y = batches(1, seed=2)[0]
        mse(m(x), y).backward()  # the copy's hooks are no-ops: it trains as a plain model
    with pytest.raises(StaleoptError, match="state_dict"):
        copy.deepcopy(opt)
    train(model, opt, batches(2, seed=3))  # the original still works


def test_parameters_hold_current_weights_after_every_backward():
    """A step skipped by GradScaler (backward without step) leaves w_t in the parameters (at rest)."""
    model = mlp(seed=4)
    opt = _opt(model)
    train(model, opt, batches(6, seed=4))
    w_t = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1, seed=5)[0]
    opt.zero_grad()
    mse(model(x), y).backward()
    for p, w in zip(model.parameters(), w_t):
        assert torch.equal(p, w)


def test_a_training_forward_without_backward_leaves_its_stale_view_until_rest():
    """docs/wrapper.md: a forward in train mode with grad enabled leaves the stale views in the parameters until
    its backward ends, an eval-mode or no_grad forward, ``state_dict()`` or ``current_weights()`` (or ``step()``);
    ``model.eval()`` alone changes nothing."""
    model = mlp(seed=4)
    opt = _opt(model)
    train(model, opt, batches(6, seed=4))
    x, _ = batches(1, seed=5)[0]

    def at_rest():
        return all(torch.equal(p, w) for p, w in zip(model.parameters(), w_t))

    def current():
        with opt.current_weights():
            assert at_rest()

    def no_grad_forward():
        with torch.no_grad():
            model(x)

    def eval_forward():
        model.eval()
        model(x)
        model.train()

    w_t = [p.detach().clone() for p in model.parameters()]
    for back_to_rest in (current, model.state_dict, no_grad_forward, eval_forward):
        model(x)  # a prediction in train mode: stage 0 reads w_(t - 5)
        assert not at_rest()
        model.eval()
        assert not at_rest()  # (switching modes moves nothing)
        model.train()
        back_to_rest()
        assert at_rest()


@pytest.mark.parametrize("replace", ["load_state_dict(assign=True)", "module.weight = nn.Parameter"])
def test_a_replaced_parameter_detaches_the_wrapper_and_a_new_one_trains(replace):
    """The model then holds Parameters neither the wrapper nor its base optimizer has: before, every later step
    silently left the weights as they were. Now the wrapper detaches (its next step raises DetachedError), and
    one built after the replacement trains as one built on a model that had those weights all along."""
    model, other = mlp(seed=4), mlp(seed=7)
    opt = _opt(model)
    train(model, opt, batches(2, seed=4))
    if replace.startswith("load"):
        model.load_state_dict(other.state_dict(), assign=True)
    else:
        model[0].weight = nn.Parameter(other[0].weight.detach().clone())
    with pytest.raises(staleopt.errors.DetachedError, match="was replaced by another Parameter.*build the base "
                                                              "optimizer and a new PipelineOptimizer"):
        train(model, opt, batches(1, seed=5))
    fresh = mlp(seed=0)
    fresh.load_state_dict(model.state_dict())  # (in place: the same weights)
    new, ref = _opt(model), _opt(fresh)
    train(model, new, batches(3, seed=6))
    train(fresh, ref, batches(3, seed=6))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_reregistering_the_same_parameter_changes_nothing_and_meta_parameters_are_refused():
    model = mlp(seed=4)
    opt = _opt(model)
    model[0].weight = model[0].weight  # (the same object: registered again)
    train(model, opt, batches(2, seed=4))
    assert opt.step_count == 2
    with torch.device("meta"):
        ghost = mlp(seed=4)
    with pytest.raises(ConfigError, match="meta device.*to_empty"):
        _opt(ghost)


def test_per_stage_lr_keeps_the_users_groups():
    model = mlp(seed=6)
    params = list(model.parameters())
    base = torch.optim.SGD([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.01}], lr=0.05)
    before = base.state_dict()
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="pipemare-t1", method_args={"anneal_steps": 5})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == 0.01
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda k: 1.0, lambda k: 0.5])
    train(model, opt, batches(3, seed=6))
    sched.step()
    assert len(opt.param_groups) == 2
    base.load_state_dict(before)  # a checkpoint of the plain optimizer still fits


def test_leaf_outputs_do_not_collect_hooks():
    class WithTemperature(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp(seed=7)
            self.log_temp = nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return self.body(x), self.log_temp

    model = WithTemperature().double()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=2,
                                     schedule="dataflow")
    for x, y in batches(10, seed=7):
        opt.zero_grad()
        out, lt = model(x)
        (mse(out, y) * lt.exp()).backward()
        opt.step()
    assert not model.log_temp._backward_hooks


def test_unfrozen_parameters_are_warned_about():
    model = mlp(seed=8)
    model[0].requires_grad_(False)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=2,
                                     schedule="dataflow")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, opt, batches(2, seed=8))
    model[0].requires_grad_(True)
    with pytest.warns(UserWarning, match="frozen when the PipelineOptimizer was built"):
        train(model, opt, batches(1, seed=8))


def test_closure_only_optimizers_are_rejected():
    model = mlp()
    with pytest.raises(ConfigError, match="closure"):
        staleopt.PipelineOptimizer(model, torch.optim.LBFGS(model.parameters()), stages=3)


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
def test_complex_parameters_swap_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False)).to(torch.complex128)
    ref = copy.deepcopy(model)
    sched = schedules.get("custom", tau_fwd=[2, 0], tau_bkwd=[1, 0])
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=2, schedule=sched)
    ref_opt = staleopt.PipelineOptimizer(ref, torch.optim.SGD(ref.parameters(), lr=0.05), stages=2,
                                         schedule=sched, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(3, 4, dtype=torch.complex128, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).abs().pow(2).sum().backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_autocast_without_backward_views_is_warned_about():
    model = mlp(seed=9).float()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=3,
                                     schedule="dataflow")
    x, y = (t.float() for t in batches(1, seed=9)[0])
    with pytest.warns(UserWarning, match="under autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        mse(out.float(), y).backward()
    opt.step()


@pytest.mark.parametrize("memory, failing", [("minimal", "_swap"), ("fast", "_copy")])
def test_a_failed_move_leaves_the_bookkeeping_consistent(monkeypatch, memory, failing):
    """A move that raises (a swap at step 0, before the engine learned the passes per step; the copy into the
    spare row a forward points at) changes none of the history's bookkeeping, and training goes on."""
    from staleopt import history
    model = mlp(seed=10)
    opt = _opt(model, schedule="dataflow", memory=memory)
    train(model, opt, batches(0 if failing == "_swap" else 3, seed=10))
    state = {k: v for k, v in opt.history.state_dict().items() if k != "rings"}
    passing = opt.history._st.passing

    def boom(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(*((history.SlotHistory, "_swap") if failing == "_swap" else (history, "_copy")), boom)
    x, y = batches(1, seed=11)[0]
    with pytest.raises(RuntimeError, match="injected"):
        model(x)
    assert {k: v for k, v in opt.history.state_dict().items() if k != "rings"} == state
    assert opt.history._st.passing == passing
    monkeypatch.undo()
    train(model, opt, batches(2, seed=11))


def _retry_run(memory, fail, where, passes):
    """Steps of ``pipemare`` over 2 microbatches; with ``fail``, at step 4 the last microbatch's pass raises in
    its forward (a forward hook) or its backward (a gradient hook) once, is caught, its partial gradients put
    back, and run again: (final weights, whether the parameters were at rest after each backward, the global
    module hooks left after the pass run again)."""
    gc.collect()  # (an earlier test's wrapper holds its global hooks until it is collected: weakref.finalize)
    model = mlp(seed=12)
    opt = _opt(model, memory=memory, microbatches=2, microbatch_passes=passes)
    boom = {"on": False}

    def fail_once(*args):
        if boom["on"]:
            boom["on"] = False
            raise RuntimeError("injected")

    model[2].register_forward_hook(lambda m, a, out: fail_once() if where == "forward" else None)
    model[2].weight.register_hook(lambda g: fail_once() if where == "backward" else None)
    at_rest, left = [], None
    for step, (x, y) in enumerate(batches(8, seed=12)):
        opt.zero_grad()
        for j, (xc, yc) in enumerate(zip(x.chunk(2), y.chunk(2))):
            if fail and step == 4 and j == 1:
                grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                boom["on"] = True
                with pytest.raises(RuntimeError, match="injected"):
                    mse(model(xc), yc).backward()
                for p, g in zip(model.parameters(), grads):
                    p.grad = g
            mse(model(xc), yc).backward()
            if fail and step == 4 and j == 1:
                left = len(torch.nn.modules.module._global_forward_pre_hooks)
            at_rest.append(all(p.data_ptr() == d.data_ptr()
                               for v in opt.history.views for p, d in zip(v.params, opt.history._data[v.index])))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], at_rest, left


@pytest.mark.parametrize("passes", [False, True])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_pass_that_raised_and_runs_again_trains_as_if_it_had_not_failed(where, passes):
    """A training pass that raises (out of memory, a failing hook) and that the loop catches and runs again
    is the same pass (microbatch_passes: the same microbatch's delays; else not counted twice), the parameters
    are at rest after its backward and no recomputation watch is left behind (memory='fast': minimal
    may have dropped the version the pass reads, and then says so)."""
    want, _, _ = _retry_run("fast", False, where, passes)
    got, at_rest, left = _retry_run("fast", True, where, passes)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(at_rest)
    assert left == 0


def test_a_retried_pass_whose_version_minimal_memory_dropped_says_so():
    model = mlp(seed=13)
    opt = _opt(model)
    train(model, opt, batches(3, seed=13))
    model[2].weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected")))
    x, y = batches(1, seed=14)[0]
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="injected"):
        mse(model(x), y).backward()
    with pytest.raises(staleopt.errors.LoopError, match="backward raised.*memory='fast'"):
        model(x)


def test_a_stage_whose_weights_the_forward_never_reads_is_warned_about():
    """An unused module (a head, a pooler) made a stage of its own that no forward computes: the stages that
    do ran with the delays of one stage more, silently."""
    class WithAuxHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.aux_head, self.b = nn.Linear(5, 7), nn.Linear(7, 2), nn.Linear(7, 3)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))
    model = WithAuxHead().double()
    opt = _opt(model)
    x, y = batches(1)[0]
    with pytest.warns(UserWarning, match=r"read no weight of stage\(s\) 1 \(\['aux_head'\]\).*3 stages.*2 compute"):
        mse(model(x), y).backward()
    opt.step()
    model.aux_head.requires_grad_(False)  # the fix the warning names
    fixed = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=2,
                                       schedule="pipemare")
    assert fixed.tau_fwd == [3, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mse(model(x), y).backward()
    fixed.step()


def test_an_output_the_hooks_cannot_reach_is_refused_and_a_registered_one_trains():
    """A model returning an object pytree cannot look into trained with no hook on its output: every backward
    read the forward's weights, with only a warning per step (and a first one saying no stage's weight was read).
    It is refused at the first training forward with w_t back in the parameters; the class registered with
    torch.utils._pytree trains bit for bit as the model that returns the tensor."""
    import dataclasses

    from staleopt.errors import LoopError

    class Out:
        def __init__(self, t):
            self.t = t

    @dataclasses.dataclass
    class Registered:
        t: torch.Tensor

    torch.utils._pytree.register_dataclass(Registered)

    class Wrapping(nn.Module):
        def __init__(self, wrap):
            super().__init__()
            self.net, self.wrap = mlp((5, 7, 7, 3)), wrap

        def forward(self, x):
            out = self.net(x)
            return self.wrap(out) if self.wrap is not None else out

    def run(wrap):
        torch.manual_seed(0)
        model = Wrapping(wrap).double()
        opt = _opt(model)
        for x, y in batches(6):
            opt.zero_grad()
            out = model(x)
            mse(out if wrap is None else out.t, y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    model = Wrapping(None).double()
    opt = _opt(model)
    for x, y in batches(4):  # stale views now differ from w_t
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    model.wrap = Out
    with pytest.raises(LoopError, match="returned a Out in which torch.utils._pytree finds no tensor.*"
                                        "register the class Out"):
        model(x)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "w_t is back"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(torch.equal(a, b) for a, b in zip(run(Registered), run(None)))


def test_a_logging_forward_after_the_last_backward_is_named_as_the_cause():
    """A train-mode forward with grad enabled between backward() and step() is a pass that reads a version the
    last backward dropped in minimal memory: the LoopError names it (it listed four other causes)."""
    from staleopt.errors import LoopError
    model = mlp((5, 7, 7, 3)).double()
    opt = _opt(model)
    with pytest.raises(LoopError, match=r"a forward for logging or metrics in train mode.*torch.no_grad\(\)"):
        for t, (x, y) in enumerate(batches(6)):
            opt.zero_grad()
            mse(model(x), y).backward()
            if t == 3:
                model(x)  # a metric computed from a fresh forward, no no_grad()
            opt.step()


@pytest.mark.parametrize("method,memory,accum", [("pipedream", "minimal", 1), ("pipemare", "minimal", 2),
                                                 ("dataflow", "fast", 1), ("pipeoptim", "minimal", 1)])
def test_a_step_with_no_gradient_is_a_skipped_batch(method, memory, accum):
    """step() with no gradient on any parameter (Lightning calls it after a training_step that returned None;
    a forward may have run) applies no update, so the simulated pipeline does not advance: the run equals the one
    that never saw that batch, bit for bit (before, it pushed w_t again and every later stale read was one version
    off), and it says so once."""
    import warnings as w

    def run(skip):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 2))
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         stages=3, schedule=method, memory=memory)
        g = torch.Generator().manual_seed(1)
        with w.catch_warnings(record=True) as caught:
            w.simplefilter("always")
            for k in range(7):
                batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(accum)]
                opt.zero_grad()
                if k == 3 and skip is not None:
                    if skip == "forward":
                        model(batches[0][0])  # a forward whose loss the trainer dropped
                    opt.step()
                    assert opt.step_count == 3
                    continue
                if k == 3:
                    continue  # the batch never reached the optimizer
                for x, y in batches:
                    ((model(x) - y) ** 2).mean().backward()
                opt.step()
        said = [str(c.message) for c in caught if "found no gradient on any parameter" in str(c.message)]
        return torch.cat([p.detach().flatten() for p in model.parameters()]), opt.step_count, said

    dropped, n, said = run(None)
    assert n == 6 and not said
    for skip in ("step", "forward"):
        weights, n, said = run(skip)
        assert torch.equal(weights, dropped) and n == 6 and len(said) == 1


def _float64_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _data(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(8, 3, generator=gen,
                                                                                 dtype=torch.float64))
            for _ in range(n)]


@pytest.mark.parametrize("schedule", ["dataflow", "1f1b", "pipemare"])
def test_a_change_at_rest_between_two_passes_is_part_of_w_t_in_both_memory_modes(schedule):
    """SAM: perturb w_t at rest, a second pass, undo, step. memory='fast' kept a row copy of w_t from the first
    pass as 'saved' and put it back after the second backward, losing the perturbation (the undo then drifted
    the weights): both modes must train as the reference engine."""
    from staleopt.reference import ReferencePipelineOptimizer

    def train_sam(cls, memory):
        m = _float64_net()
        opt = cls(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), stages=3, schedule=schedule,
                  memory=memory)
        for x, y in _data(6):
            opt.zero_grad()
            mse(m(x), y).backward()
            with torch.no_grad():
                e = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in m.parameters()]
                for p, d in zip(m.parameters(), e):
                    p.add_(d)
            opt.zero_grad()
            mse(m(x), y).backward()
            with torch.no_grad():
                for p, d in zip(m.parameters(), e):
                    p.sub_(d)
            opt.step()
        return torch.nn.utils.parameters_to_vector(m.parameters()).detach()

    reference = train_sam(ReferencePipelineOptimizer, "minimal")
    for memory in ("minimal", "fast"):
        assert torch.allclose(train_sam(staleopt.PipelineOptimizer, memory), reference, rtol=0, atol=1e-12), memory


def test_a_logging_forward_does_not_hide_a_pass_more_than_minimal_memory_keeps():
    """A train-mode forward without backward before a step with more passes than any earlier one: the step's
    second pass reads a version minimal memory dropped, so it raises LoopError as without the logging forward
    (it silently read w_t instead)."""
    from staleopt.errors import LoopError
    data = _data(4)
    for log in (False, True):
        m = _float64_net()
        opt = staleopt.PipelineOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), stages=3, schedule="dataflow")
        opt.zero_grad()
        mse(m(data[0][0]), data[0][1]).backward()
        opt.step()
        opt.zero_grad()
        if log:
            m(data[1][0]).mean().item()
        mse(m(data[2][0]), data[2][1]).backward()
        with pytest.raises(LoopError, match="dropped that version"):
            mse(m(data[3][0]), data[3][1]).backward()


@pytest.mark.parametrize("method", ["dc-asgd", "dc-asgd-a", "gap-aware", "xpipe", "spectrain", "pipeoptim"])
def test_corrections_that_read_the_gradient_as_a_descent_direction_refuse_maximize(method):
    """maximize=True: torch negates the gradient inside its step; these corrections read p.grad before it (DC's
    g*g*(w - s), Gap-Aware's decay term, a prediction's own moments) and trained silently wrong: refused, at
    construction and for a group that turns it on later."""
    from staleopt.errors import CorrectionError
    model = mlp(seed=1)
    with pytest.raises(CorrectionError, match="maximize=True"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, maximize=True),
                                   stages=3, schedule=method)
    opt = _opt(model, method)
    train(model, opt, batches(2, seed=1))
    opt.param_groups[0]["maximize"] = True
    x, y = batches(1, seed=2)[0]
    opt.zero_grad()
    mse(model(x), y).backward()
    with pytest.raises(CorrectionError, match="maximize=True"):
        opt.step()


def test_maximize_trains_as_minimizing_the_negated_objective_where_no_correction_reads_the_gradient():
    def run(maximize):
        model = mlp(seed=1).double()
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                                                maximize=maximize), stages=3, schedule="pipemare")
        for x, y in batches(4, seed=1):
            opt.zero_grad()
            loss = mse(model(x.double()), y.double())
            (-loss if maximize else loss).backward()
            opt.step()
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("method", ["dc-asgd-a", "gap-aware", "xpipe", "pipeoptim", "pipemare-stash-nesterov"])
def test_sparse_gradients_are_refused_by_corrections_that_need_dense_ones(method):
    """nn.Embedding(sparse=True): these corrections' foreach kernels have no sparse version (a raw torch error
    from inside step() before); dataflow and pipemare train."""
    from staleopt.errors import CorrectionError

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.l1, self.head = nn.Embedding(11, 6, sparse=True), nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.l1(self.emb(x)))).mean(1)

    for name in (method, "pipemare"):
        torch.manual_seed(0)
        model = Net()
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, schedule=name)
        opt.zero_grad()
        model(torch.randint(0, 11, (4, 5))).pow(2).mean().backward()
        if name == method:
            with pytest.raises(CorrectionError, match="sparse=False"):
                opt.step()
        else:
            opt.step()


def test_a_create_graph_backward_of_a_delayed_pipeline_is_warned_about():
    """A gradient penalty (autograd.grad(create_graph=True)): the later backward of its graph reads w_t in layers
    that save the parameter itself (convolutions), outside the simulated semantics: warned once (it was silent);
    a synchronous schedule has nothing to warn about."""
    for schedule, expected in (("pipedream", 1), ("sync", 0)):
        model = mlp(seed=1)
        opt = _opt(model, schedule)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for x, y in batches(3, seed=1):
                x = x.clone().requires_grad_(True)
                opt.zero_grad()
                out = model(x)
                (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                (mse(out, y) + gx.pow(2).mean()).backward()
                opt.step()
        assert sum("create_graph=True" in str(w.message) for w in seen) == expected, schedule


def test_a_forward_that_reads_none_of_the_parameters_is_named_as_training_without_delays():
    """torch.func per-sample gradients (functional_call over detached copies): the hooks fire but no stage reads a
    stale version. The warning advised freezing every stage (which would stop training): it now says why."""
    from torch.func import functional_call, grad, vmap
    model = mlp(seed=1)
    opt = _opt(model, "dataflow")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return mse(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))
    x, y = batches(1, seed=1)[0]
    with pytest.warns(UserWarning, match="read none of the model's parameters.*without the simulated delays"):
        per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for n, p in model.named_parameters():
        p.grad = per_sample[n].mean(0)
    opt.step()


def test_an_embedding_that_renormalizes_in_its_forward_is_refused_under_delays():
    """nn.Embedding(max_norm=...) renormalizes its looked-up rows in place in the forward: under delays that forward
    reads a stored w_(t-tau), so w_t was never renormalized (norm 3.4 against 0.5 undelayed, before). Refused with
    the fix; without delays it trains as in plain torch, and the fix (renormalize w_t at rest after step) keeps
    w_t's rows bounded."""

    class Net(nn.Module):
        def __init__(self, max_norm):
            super().__init__()
            self.emb, self.l1, self.head = nn.Embedding(11, 6, max_norm=max_norm), nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.l1(self.emb(x)))).mean(1)

    torch.manual_seed(0)
    model = Net(0.5)
    with pytest.raises(ConfigError, match=r"\['emb'\].*max_norm=None.*embedding_renorm_"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, schedule="pipemare")
    plain = copy.deepcopy(model)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, schedule="gpipe")
    base = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = torch.randint(0, 11, (4, 5))
    for m, o in ((model, opt), (plain, base)):
        for _ in range(2):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    assert torch.equal(model.emb.weight, plain.emb.weight)  # without delays, as plain torch
    opt.remove_hooks()
    model = Net(None)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=5.0), stages=3, schedule="pipemare")
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            torch.embedding_renorm_(model.emb.weight, x.unique(), 0.5, 2.0)
    assert model.emb.weight[x.unique()].norm(dim=1).max() <= 0.5 + 1e-6


@pytest.mark.parametrize("kind", ["parametrizations", "old", "spectral"])
def test_a_parametrized_weight_under_differing_views_is_warned_about(kind):
    """weight_norm's backward reads g and v at the backward view while its saved norm and W^T delta hold the forward
    view (wrapper.md said "the forward view"): a mix no pipeline computes, warned at construction where a stage's two
    views differ; not under stashing (tau_bkwd = tau_fwd)."""
    norm = {"parametrizations": torch.nn.utils.parametrizations.weight_norm, "old": torch.nn.utils.weight_norm,
            "spectral": torch.nn.utils.spectral_norm}[kind]  # (the last two compute the weight in a pre-hook)

    def build(schedule):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (the old weight_norm is deprecated)
            model = nn.Sequential(norm(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=2,
                                       schedule=schedule).remove_hooks()
        return [str(w.message) for w in caught if "parametrized parameters" in str(w.message)]

    assert len(build("dataflow")) == 1 and "['0']" in build("dataflow")[0]
    assert build("pipemare-stash") == []


class _Masked(nn.Module):
    """``F.linear(h, l2.weight * mask)`` (a pruned layer): the product is computed from the forward view and saved
    for ``W^T delta``; ``how`` picks another computed weight, or none."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.how = nn.Linear(3, 4), nn.Linear(4, 2), how
        self.register_buffer("mask", (torch.rand(2, 4) > 0.5).to(torch.get_default_dtype()))

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        w = {"mask": self.l2.weight * self.mask, "clone": self.l2.weight.clone(), "plain": self.l2.weight}[self.how]
        return F.linear(h, w, self.l2.bias)


@pytest.mark.parametrize("how, schedule, warned", [("mask", "dataflow", True), ("clone", "pipemare", True),
                                                    ("mask", "pipemare-stash", False), ("plain", "dataflow", False)])
def test_a_weight_computed_in_the_forward_under_differing_views_is_warned_about(how, schedule, warned):
    """``W * mask`` (``scale * W``, ``W.clone()``) in the forward: the backward multiplies with the product made
    from the forward view, so the backward view never reaches it and the run trains as no pipeline does (1.6e-2
    from design §1's reference after 8 steps), silently. Warned at the first training forward, naming the unit,
    where the stage's views differ (T2's rewrite too); not under stashing, not for a weight read as it is."""
    model = _Masked(how)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=2,
                                     schedule=schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).mean().backward()
            opt.step()
    got = [str(w.message) for w in caught if "compute a weight from a parameter" in str(w.message)]
    assert len(got) == warned and (not warned or "['l2']" in got[0])


@pytest.mark.parametrize("name", staleopt.models.names())
def test_no_model_of_the_zoo_computes_a_weight(name):
    """The graph test of computed weights (``Dataflow.computed``) finds none in the models staleopt ships
    (embeddings, positional embeddings added to tokens, attention's packed projections, residual blocks)."""
    from staleopt.partition import dataflow, units_of
    model = staleopt.models.get(name, seed=0)
    shape = staleopt.models.info(name).input_shape
    x = torch.randint(0, 10, (2, *shape)) if name == "gpt" else torch.randn(2, *shape)
    assert dataflow(model(x), units_of(model)).computed == frozenset()


@pytest.mark.parametrize("method", ["dataflow", "pipemare"])
def test_stepping_the_base_optimizer_directly_is_refused(method):
    """base.step() (or scaler.step(base), a trainer given the base optimizer) never advanced the history: every
    training forward took the parameters for w_0 again and the run trained without delays (bit for bit the
    synchronous run), silently. Refused; the wrapper's own step, and the base after remove_hooks(), still step."""
    model = mlp(seed=0)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule=method)
    (x, y), = batches(1)
    opt.zero_grad()
    mse(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LoopError, match="stepped directly, not through the PipelineOptimizer"):
        base.step()
    assert opt.step_count == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.step()
    assert opt.step_count == 1 and not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.remove_hooks()
    base.step()


def test_a_grad_scaler_stepping_the_base_optimizer_is_refused():
    model = mlp(seed=0)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="dataflow")
    (x, y), = batches(1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(mse(model(x), y)).backward()
    with pytest.raises(LoopError, match="stepped directly"):
        scaler.step(base)
    assert opt.step_count == 0


@pytest.mark.parametrize("order", ["summed", "one after the other"])
def test_forwards_before_backwards_with_differing_microbatch_views_are_refused(order):
    """microbatch_passes=True with T2: each microbatch's backward view is rewritten with its own delays, and a
    backward pass loaded the latest forward's. A loop whose forwards all ran first (a summed loss, or the losses'
    backwards one after the other) trained microbatch 0 with microbatch 1's view (1e-3 from the reference after
    6 steps), silently: refused. Without T2 the backward views are equal (w_t) and the same loop trains."""
    from staleopt.corrections import DiscrepancyCorrection

    def losses(corrections):
        model = mlp()
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                         schedule="dataflow", microbatches=2, microbatch_passes=True,
                                         corrections=corrections)
        (x, y), = batches(1)
        opt.zero_grad()
        return [mse(model(xj), yj) / 2 for xj, yj in zip(x.chunk(2), y.chunk(2))]

    def backward(ls):
        if order == "summed":
            sum(ls).backward()
        else:
            for loss in ls:
                loss.backward()
    with pytest.raises(LoopError, match="forwards of 2 microbatches ran before this backward"):
        backward(losses([DiscrepancyCorrection(0.5)]))
    backward(losses([]))
