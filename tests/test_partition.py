"""Partitioning into stages of parametrized operators (PipeMare §4.1)."""
import itertools

import pytest
import torchvision
from torch import nn

from staleopt.errors import StageError
from staleopt.partition import partition_model, units_of


def test_resnet50_has_107_units():
    model = torchvision.models.resnet50(num_classes=10)
    units = units_of(model)
    assert len(units) == 107
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())
    assert sum(1 for u in units if u.module_type == "BatchNorm2d") == 53
    # weight and bias of one module are one unit
    fc = [u for u in units if u.name == "fc"][0]
    assert len(fc.params) == 2
    part = partition_model(model, 107)
    assert all(len(s.units) == 1 for s in part)
    with pytest.raises(StageError, match="1 <= stages <= 107"):
        partition_model(model, 108)


def test_ops_strategy_is_even_and_contiguous():
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(10)])
    part = partition_model(model, 4)
    assert [len(s.units) for s in part] == [3, 3, 2, 2]
    assert part.cuts == [3, 6, 8]
    assert [p for s in part for p in s.params] == list(model.parameters())


def test_params_strategy_minimises_the_largest_stage():
    sizes = [5, 1, 8, 2, 2, 9, 1, 4]
    model = nn.Sequential(*[nn.Linear(n, 1, bias=False) for n in sizes])
    for P in (2, 3, 4):
        part = partition_model(model, P, strategy="params")
        best = min(max(sum(sizes[a:b]) for a, b in zip((0,) + c, c + (len(sizes),)))
                   for c in itertools.combinations(range(1, len(sizes)), P - 1))
        assert max(s.numel for s in part) == best
        assert len(part) == P


def test_explicit_cut_points_are_the_placement_vector():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)])
    part = partition_model(model, [1, 4])
    assert [len(s.units) for s in part] == [1, 3, 2] and part.cuts == [1, 4]
    for bad in ([0, 2], [2, 2], [4, 1], [1, 6]):
        with pytest.raises(StageError, match="strictly increasing"):
            partition_model(model, bad)


def test_tied_parameters_appear_once_and_frozen_are_excluded():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.mid = nn.Linear(4, 4)
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight  # tied

    model = Tied()
    units = units_of(model)
    assert [u.name for u in units] == ["embed", "mid"]  # tied weight owned by its first owner; out has none left
    part = partition_model(model, 2)
    ids = [id(p) for s in part for p in s.params]
    assert len(ids) == len(set(ids)) == 3
    assert id(model.frozen.weight) not in ids


def test_partition_repr_is_a_table_and_reports_sizes():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    part = partition_model(model, 2)
    text = repr(part)
    assert "stage" in text and "params" in text and "bytes" in text
    assert part[0].numel == 40 and part[0].nbytes == 160 and part[0].modules == ["0"]
    assert part.stage_of(model[2].weight) == 1


def test_partition_errors():
    with pytest.raises(StageError, match="no trainable parameters"):
        partition_model(nn.ReLU(), 1)
    with pytest.raises(StageError, match="'ops', 'params'"):
        partition_model(nn.Linear(2, 2), 1, strategy="layers")
    with pytest.raises(StageError, match="int"):
        partition_model(nn.Linear(2, 2), 1.5)
    with pytest.raises(StageError, match=r"\"max\" \(one per parametrized operator, 1 here\).*got 'min'"):
        partition_model(nn.Linear(2, 2), "min")


def test_max_stages_is_one_per_parametrized_operator():
    """``stages="max"`` (as compare and sweep files take it): the wrapper pipelines every operator."""
    import staleopt
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert partition_model(model, "max").num_stages == 3 == len(partition_model(model, 3))
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages="max",
                                     schedule="dataflow")
    assert opt.partition.num_stages == 3 and opt.tau_fwd == [5, 3, 1]


# ----------------------------------------------------------------------------- execution order
import torch  # noqa: E402

from staleopt import models  # noqa: E402
from staleopt.errors import StageOrderError  # noqa: E402
from staleopt.partition import dataflow  # noqa: E402


class ShortcutFirst(nn.Module):
    """A residual block that computes its shortcut first but registers it last: a parallel branch,
    not a backward edge, so any partition of it is contiguous."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.shortcut = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        s = self.shortcut(x)
        return self.out(torch.relu(self.conv2(torch.relu(self.conv1(x))) + s))


class TiedLM(nn.Module):
    """Input embedding tied to the output layer (GPT-2): the tied weight belongs to stage 0."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.body(self.embed(idx))))


class RootTokens(nn.Module):
    """A class token owned by the root module (ViT): registered first, used after the patch embedding."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(1, 1, 4))
        self.embed = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.embed(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1)
        return self.head(h[:, 0])


def _check(model, x, stages, shared_parameters="error"):
    part = partition_model(model, stages)
    part.check(dataflow(model(x), part.units), shared_parameters)


@pytest.mark.parametrize("build, x", [
    (ShortcutFirst, torch.randn(3, 4)),
    (TiedLM, torch.randint(0, 10, (3, 5))),
])
def test_parallel_branches_and_tied_weights_are_contiguous(build, x):
    """(A tied weight read by a later stage is no stage-order error; tests/test_silent_round3.py: it is refused
    unless shared_parameters='first-owner'.)"""
    model = build()
    for stages in range(1, len(units_of(model)) + 1):
        _check(model, x, stages, "first-owner")


def test_a_root_parameter_used_late_is_refused_and_execution_order_fixes_it():
    model, x = RootTokens(), torch.randn(2, 5, 3)
    with pytest.raises(StageOrderError, match="'<root>'.*'embed'"):
        _check(model, x, 3)
    part = partition_model(model, 3, example_input=x)
    assert [s.modules for s in part] == [["embed"], ["<root>"], ["head"]]
    part.check(dataflow(model(x), part.units))
    assert model.training  # the probe ran in eval mode and put the mode back


@pytest.mark.parametrize("name", ["resnet20", "transformer", "cnn1d", "lenet5"])
def test_the_bundled_models_are_registered_in_execution_order(name):
    model = models.get(name, seed=0)
    x = torch.randn(2, *models.info(name).input_shape)
    units = units_of(model)
    assert [u.name for u in partition_model(model, len(units), example_input=x).units] == [u.name for u in units]
    _check(model, x, len(units))


def test_dataflow_sees_cast_weights():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3))
    assert dataflow(out, units_of(model)).copied == {0, 1}
    assert not dataflow(model(torch.randn(2, 3)), units_of(model)).copied


@pytest.mark.filterwarnings("error")
def test_a_parametrized_modules_parameters_are_one_unit_with_its_own():
    """weight_norm's originals (X.parametrizations.weight.original0/1) and X's bias: one unit (they were two,
    bias first, so the default partition raised a StageOrderError and a layer's weight and bias could land in
    different stages)."""
    from torch.nn.utils.parametrizations import weight_norm
    import copy

    import staleopt
    from staleopt.partition import param_name
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), weight_norm(nn.Linear(4, 4, bias=False)))
    units = units_of(model)
    assert [u.name for u in units] == ["0", "2"]
    assert units[0].param_names == ("bias", "parametrizations.weight.original0", "parametrizations.weight.original1")
    assert units[1].param_names == ("parametrizations.weight.original0", "parametrizations.weight.original1")
    assert all(dict(model.named_parameters())[param_name(u, j)] is p
               for u in units for j, p in enumerate(u.params))
    twin = copy.deepcopy(model)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages="max",
                                     schedule="sync")
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (twin, plain)):
        for _ in range(3):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    assert opt.partition.num_stages == 2 and not opt.replicas  # (the parametrization is not a second owner)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
