"""PipeMare Recompute in training: the built-in models checkpoint the schedule's segments (staleopt.segments)."""
import functools
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from staleopt import data as datasets
from staleopt import models, schedules, segments, train
from staleopt.checkpoint import Checkpoint
from staleopt.cli import main
from staleopt.config import RunConfig
from staleopt.corrections import DiscrepancyCorrection, LRReschedule
from staleopt.errors import ConfigError, LoopError, StageError, StageOrderError
from staleopt.optimizer import PipelineOptimizer
from staleopt.schedules import DataflowRecompute
from staleopt.segments import Step, checkpoint_segments, run_layers

SYNTH = dict(data="synthetic", data_kwargs={"num_samples": 200, "input_shape": [1, 8], "num_classes": 4,
                                            "separation": 0.5}, batch_size=16, epochs=2, lr=0.05)
MLP = dict(model="mlp", model_kwargs={"depth": 3, "hidden": 16}, **SYNTH)
COLUMNS = ["step", "train_loss", "test_loss", "test_acc", "lr_base", "status"]


def hand_loop(config: RunConfig, forward):
    """train.run's loop written out, with ``forward(model, opt)`` installed as the model's forward."""
    d = datasets.load(config.data, **config.data_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = models.get(config.model, seed=config.seed, num_classes=d.num_classes, input_shape=d.input_shape,
                           **config.model_kwargs)
        pipeline = config.pipeline(**train.method_args(config, len(d.train)))
        opt = PipelineOptimizer(model, train.build_optimizer(config, model.parameters()), stages=config.stages,
                                schedule=pipeline.schedule, corrections=pipeline.corrections, seed=config.seed)
        model.forward = forward(model, opt)
        order = torch.Generator().manual_seed(config.seed)
        rows = []
        for _ in range(config.epochs):
            losses = []
            for x, y in datasets.batches(d.train, config.batch_size, shuffle=True, generator=order, drop_last=True):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                losses.append(loss.item())
                loss.backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                x, y = d.test.tensors
                out = model(x)
            model.train()
            rows.append({"train_loss": sum(losses) / len(losses),
                         "test_loss": F.cross_entropy(out, y, reduction="sum").item() / len(y),
                         "test_acc": (out.argmax(1) == y).sum().item() / len(y)})
    return pd.DataFrame(rows), opt


def test_train_equals_a_loop_that_checkpoints_each_segment_by_hand():
    config = RunConfig(method="pipemare-recompute", stages=4, **MLP)
    records = train.run(config)

    def forward(model, opt):
        net = model.net  # Flatten, Linear, ReLU, Linear, ReLU, Linear, ReLU, Linear: one Linear per stage
        assert opt.schedule.segments(4) == [(0, 1), (2, 3)]
        first = lambda x: F.relu(net[3](F.relu(net[1](net[0](x)))))   # stages 0-1
        second = lambda h: net[7](F.relu(net[5](h)))                  # stages 2-3
        return lambda x: opt.checkpoint(second, opt.checkpoint(first, x))

    by_hand, opt = hand_loop(config, forward)
    assert opt.tau_recomp == [3, 1, 3, 1] and opt.tau_fwd == [7, 5, 3, 1]
    for col in ("train_loss", "test_loss", "test_acc"):
        assert records[col].tolist() == by_hand[col].tolist()  # bit for bit
    assert records["status"].tolist() == ["ok", "ok"]
    # the recomputation matters: the same method without recompute (dataflow) trains differently
    plain = train.run(RunConfig(method="pipemare", stages=4, **MLP))
    assert plain["test_loss"].tolist() != records["test_loss"].tolist()


def test_without_checkpointing_the_recompute_method_fails_at_its_first_step():
    config = RunConfig(method="pipemare-recompute", stages=4, **MLP)
    with pytest.raises(LoopError, match="opt.checkpoint"):
        hand_loop(config, lambda model, opt: model.forward)


@pytest.mark.parametrize("name, kwargs, shape", [
    ("resnet1d", {"depth": 8, "width": 4}, (1, 16)),
    ("cnn1d", {"depth": 4, "width": 4}, (1, 16)),
    ("mlp", {"depth": 2, "hidden": 8}, (1, 8)),
    ("transformer", {"dim": 8, "heads": 2, "layers": 2}, (1, 16)),
    ("lenet5", {}, (1, 16, 16)),
    ("resnet20", {"width": 2}, (3, 8, 8)),
    ("resnet50-cifar", {}, (3, 4, 4)),
])
def test_steps_compute_the_forward_bit_for_bit_and_split_at_every_unit(name, kwargs, shape):
    model = models.get(name, seed=0, num_classes=3, input_shape=shape, **kwargs).double()
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    steps = models.steps(model)
    ref = model(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    out = run_layers(steps, x)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    # each step reads at most one unit, in the units' order, so any partition's boundaries fall between steps
    units = [u.name for u in models.units_of(model)]
    named = {id(m): n for n, m in model.named_modules()}
    declared = [s.modules if isinstance(s, Step) else (s,) if isinstance(s, nn.Module) else () for s in steps]
    assert all(len(d) <= 1 for d in declared)
    read = [named[id(m)] for d in declared for m in d if any(True for _ in m.parameters(recurse=False))]
    assert read == units


@pytest.mark.parametrize("name, kwargs, data_kwargs", [
    ("resnet1d", {"depth": 8, "width": 4}, {"input_shape": [1, 16]}),
    ("cnn1d", {"depth": 4, "width": 4}, {"input_shape": [1, 16]}),
    ("transformer", {"dim": 8, "heads": 2, "layers": 2}, {"input_shape": [1, 16]}),
    ("lenet5", {}, {"input_shape": [1, 16, 16]}),
])
def test_every_partitionable_built_in_model_trains_with_recompute(name, kwargs, data_kwargs):
    config = dict(model=name, model_kwargs=kwargs, data="synthetic", batch_size=16, epochs=1, lr=0.05, max_steps=4,
                  data_kwargs={"num_samples": 80, "num_classes": 3, "separation": 0.5, **data_kwargs})
    n_units = models.num_units(name, input_shape=data_kwargs["input_shape"], num_classes=3, **kwargs)
    for stages in (4, n_units):  # segments of round(sqrt(P)) stages; at P = units every boundary is a unit's
        rec = train.run(RunConfig(method="pipemare-recompute", stages=stages, **config))
        assert rec["status"].tolist() == ["ok"] and rec["step"].tolist() == [4] and math.isfinite(rec["test_loss"][0])


class RecomputeAtForward(DataflowRecompute):
    """dataflow-recompute's segments, recomputing with the forward's weights (``tau_recomp = tau_fwd``)."""

    def microbatch_recompute_delays(self, stages, microbatches):
        return self.microbatch_delays(stages, microbatches)[0]


def _train_steps(schedule, wrap, steps=6):
    torch.manual_seed(0)
    model = models.get("resnet1d", seed=0, num_classes=3, input_shape=(1, 16), depth=8, width=4).double()
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=9,
                            schedule=schedule, corrections=[LRReschedule(4), DiscrepancyCorrection(0.1)])
    if wrap:
        model.forward = functools.partial(checkpoint_segments, opt, models.steps(model))
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x, y = torch.randn(8, 1, 16, generator=g, dtype=torch.float64), torch.randint(3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict(), opt


def test_recompute_with_the_forward_weights_equals_no_checkpointing_bit_for_bit():
    wrapped, opt = _train_steps(RecomputeAtForward(), wrap=True)
    assert opt.schedule.segments(9) == [(0, 2), (3, 5), (6, 8)] and opt.tau_recomp == opt.tau_fwd
    plain, _ = _train_steps("dataflow", wrap=False)
    # weights and BatchNorm statistics: a recomputation leaves the running statistics as the forward left them
    assert plain.keys() == wrapped.keys() and all(torch.equal(plain[k], wrapped[k]) for k in plain)
    recomputed, opt = _train_steps("dataflow-recompute", wrap=True)
    assert opt.tau_recomp != opt.tau_fwd and not all(torch.equal(plain[k], recomputed[k]) for k in plain)


def test_a_method_without_recompute_never_checkpoints(monkeypatch):
    config = RunConfig(method="pipemare", stages=4, model="resnet1d", model_kwargs={"depth": 8, "width": 4},
                       **{**SYNTH, "data_kwargs": {**SYNTH["data_kwargs"], "input_shape": [1, 16]}})
    before = train.run(config)

    def refuse(*args, **kwargs):
        raise AssertionError("checkpointed")

    monkeypatch.setattr(PipelineOptimizer, "checkpoint", refuse)
    monkeypatch.setattr(segments, "checkpoint_segments", refuse)
    after = train.run(config)
    assert after[COLUMNS].equals(before[COLUMNS])
    # the helper itself runs the layers in order under a schedule without segments
    model = models.get("mlp", seed=0, num_classes=3, input_shape=(1, 8), depth=2, hidden=8)
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3, schedule="pipemare")
    x = torch.randn(4, 1, 8)
    assert torch.equal(checkpoint_segments(opt, models.steps(model), x), model(x))


def _mlp_opt(stages=4, **method_args):
    model = models.get("mlp", seed=0, num_classes=3, input_shape=(1, 8), depth=3, hidden=8)
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=stages,
                            schedule="pipemare-recompute", method_args=method_args)
    return model, opt


def test_layers_that_do_not_follow_the_segments_raise_typed_errors():
    model, opt = _mlp_opt(segment=2)  # segments [(0, 1), (2, 3)], one Linear per stage
    net, x = model.net, torch.randn(4, 1, 8)
    with pytest.raises(StageError, match="different segments"):  # one layer straddles the two segments
        checkpoint_segments(opt, [net[0], nn.Sequential(*net[1:6]), *net[6:]], x)
    with pytest.raises(StageOrderError, match="order"):
        checkpoint_segments(opt, [net[0], net[5], net[1]], x)
    with pytest.raises(StageError, match=r"no parameter of stages \[3\]"):
        checkpoint_segments(opt, list(net[:7]), x)
    # a plain function reads no declared weights: the stage it reads counts as missing ...
    with pytest.raises(StageError, match=r"no parameter of stages \[3\].*Step"):
        checkpoint_segments(opt, [*net[:7], lambda h: net[7](h)], x)
    # ... and joins the segment of the layer before it, where the weights it reads are caught
    with pytest.raises(StageError, match=r"read the weights of stages \[2\]"):
        checkpoint_segments(opt, [*net[:5], lambda h: net[5](h), Step(lambda h: h, net[5]), *net[6:]], x)
    with pytest.raises(StageError, match="nn.Module"):
        Step(lambda h: h, "fc1")
    with pytest.raises(ConfigError, match="not a built-in"):
        models.steps(nn.Linear(2, 2))
    # a custom tau_recomp recomputes ahead of the backward but names no segments: the helper cannot group
    custom = schedules.get("custom", tau_fwd=[7, 5, 3, 1], tau_bkwd=[0, 0, 0, 0], tau_recomp=[3, 1, 3, 1])
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4, schedule=custom)
    with pytest.raises(ConfigError, match=r"no segments.*opt.checkpoint\(segment, x\)"):
        checkpoint_segments(opt, models.steps(model), x)


def test_segments_must_align_with_a_partition_given_by_cut_points():
    def build(cuts):
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)),
                              nn.Linear(4, 2))
        return model, PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=cuts,
                                        schedule="pipemare-recompute", method_args={"segment": 2})

    x = torch.randn(3, 4)
    model, opt = build([1, 3])   # stages: Linear | block | Linear; segments [(0, 1), (2, 2)]: the block is inside
    assert torch.equal(checkpoint_segments(opt, list(model), x), model(x))
    model, opt = build([1, 2, 3])  # the block's Linears in stages 1 and 2, segments [(0, 1), (2, 3)]
    with pytest.raises(StageError, match=r"stages \[1, 2\].*\[\(0, 1\), \(2, 3\)\].*split it"):
        checkpoint_segments(opt, list(model), x)
    block = model[1]  # split as the message says: each of its Linears a layer of its own
    assert torch.equal(checkpoint_segments(opt, [model[0], block[0], block[1], block[2], model[2]], x), model(x))


def test_a_resumed_recompute_run_has_the_uninterrupted_records(tmp_path):
    from test_checkpoint import interrupted_run, same_records
    config = RunConfig(method="pipemare-recompute", stages=4, model="resnet1d", model_kwargs={"depth": 8, "width": 4},
                       **{**SYNTH, "data_kwargs": {**SYNTH["data_kwargs"], "input_shape": [1, 16]}})
    plain = train.run(config)
    state = interrupted_run(config, tmp_path / "run.ckpt", 5, 2)  # mid-epoch 1 (step 10 of 12 per epoch)
    assert state["optimizer"]["staleopt"]["step"] == 10
    same_records(train.run(config, checkpoint=Checkpoint(tmp_path / "run.ckpt", every=5)), plain)


def test_train_command_runs_pipemare_recompute(tmp_path):
    out = tmp_path / "rec.csv"
    args = ["train", "--model", "mlp", "--model-kwargs", '{"depth": 3, "hidden": 16}', "--data", "synthetic",
            "--data-kwargs", '{"num_samples": 200, "input_shape": [1, 8], "num_classes": 4, "separation": 0.5}',
            "--method", "pipemare-recompute", "--stages", "4", "--epochs", "2", "--batch-size", "16", "--lr", "0.05",
            "--out", str(out)]
    assert main(args) == 0
    direct = train.run(RunConfig(method="pipemare-recompute", stages=4, **MLP))
    assert pd.read_csv(out)["test_loss"].tolist() == pytest.approx(direct["test_loss"].tolist(), rel=1e-12)


def _tutorial_tiny_lm():
    """docs/tutorial.md's TinyLM (section 6), executed from the page."""
    from pathlib import Path

    from staleopt import docgen
    page = (Path(__file__).resolve().parents[1] / "docs" / "tutorial.md").read_text()
    code, = [b.code for b in docgen.code_blocks(page) if "class TinyLM" in b.code]
    scope = {"nn": nn, "torch": torch}
    exec(code, scope)
    return scope["TinyLM"]


def test_a_users_sequential_and_a_model_with_steps_train_with_recompute():
    """pipemare-recompute on a user's nn.Sequential runs its children as the layers (bit for bit a loop that
    checkpoints the segments by hand) and on a model with a steps() method, the tutorial's TinyLM, its steps
    (before, both were refused with advice to call checkpoint_segments, which train and compare users cannot)."""
    from torch.utils.data import TensorDataset

    def user_mlp(num_classes, input_shape):
        return nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                             nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, num_classes))

    g = torch.Generator().manual_seed(0)
    x = torch.randint(6, (96, 8), generator=g)
    tokens = (TensorDataset(x[:64], torch.roll(x[:64], -1, 1)), TensorDataset(x[64:], torch.roll(x[64:], -1, 1)))
    models.register("user_mlp", user_mlp, replace=True)
    models.register("user_tiny_lm", _tutorial_tiny_lm(), replace=True)
    datasets.register("user_tokens", lambda: tokens, replace=True)
    try:
        config = RunConfig(model="user_mlp", method="pipemare-recompute", stages=4, **SYNTH)
        records = train.run(config)

        def forward(model, opt):
            assert opt.schedule.segments(4) == [(0, 1), (2, 3)]
            first = lambda x: F.relu(model[3](F.relu(model[1](model[0](x)))))   # stages 0-1
            second = lambda h: model[7](F.relu(model[5](h)))                    # stages 2-3
            return lambda x: opt.checkpoint(second, opt.checkpoint(first, x))

        by_hand, _ = hand_loop(config, forward)
        for col in ("train_loss", "test_loss", "test_acc"):
            assert records[col].tolist() == by_hand[col].tolist()
        lm = dict(model="user_tiny_lm", data="user_tokens", batch_size=16, epochs=2, lr=0.5, stages=3)
        recomputed = train.run(RunConfig(method="pipemare-recompute", **lm))
        assert recomputed["status"].tolist() == ["ok", "ok"]
        assert recomputed["test_loss"].tolist() != train.run(RunConfig(method="pipemare", **lm))["test_loss"].tolist()
    finally:
        models._USER.pop("user_mlp", None)
        models._USER.pop("user_tiny_lm", None)
        datasets._USER.pop("user_tokens", None)


def test_a_model_without_steps_is_refused_naming_the_steps_method():
    class Net(nn.Module):
        def __init__(self, num_classes, input_shape):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, num_classes)

        def forward(self, x):
            return self.b(torch.relu(self.a(x.flatten(1))))

    class OwnForward(nn.Sequential):
        def forward(self, x):
            return super().forward(x) * 2

    for model in (Net(3, (1, 8)), OwnForward(nn.Flatten(), nn.Linear(8, 3))):
        with pytest.raises(ConfigError, match=r"give the model a steps\(\) method .* or build it as an "
                                              r"nn.Sequential; see docs/tutorial.md"):
            models.steps(model)
