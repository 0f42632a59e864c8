"""Model zoo: unit counts (max stages), parameter counts, shapes, execution order, seeded init, CLI table."""
import pytest
import torch
from torch import nn

from staleopt import models
from staleopt.cli import main
from staleopt.errors import ConfigError
from staleopt.partition import units_of


def test_resnet50_cifar_has_pipemares_107_units():
    assert models.num_units("resnet50-cifar") == 107  # PipeMare §4.1: 107 stages on ResNet-50
    with torch.device("meta"):
        m = models.get("resnet50-cifar", num_classes=100)
    assert m.conv1.kernel_size == (3, 3) and m.conv1.stride == (1, 1) and isinstance(m.maxpool, nn.Identity)
    assert m.fc.out_features == 100
    kinds = [u.module_type for u in units_of(m)]
    assert (kinds.count("Conv2d"), kinds.count("BatchNorm2d"), kinds.count("Linear")) == (53, 53, 1)


@pytest.mark.parametrize("depth, params_m", [(20, 0.27), (32, 0.46), (56, 0.85)])
def test_cifar_resnets_match_he_et_al(depth, params_m):
    """He et al. 2016 §4.2: 6n+2 weighted layers (depth-1 convs + 1 fc), Table 6 parameter counts."""
    with torch.device("meta"):
        m = models.get(f"resnet{depth}")
    convs = [x for x in m.modules() if isinstance(x, nn.Conv2d)]
    bns = [x for x in m.modules() if isinstance(x, nn.BatchNorm2d)]
    fcs = [x for x in m.modules() if isinstance(x, nn.Linear)]
    assert (len(convs), len(bns), len(fcs)) == (depth - 1, depth - 1, 1)
    assert len(units_of(m)) == 2 * (depth - 1) + 1
    assert round(sum(p.numel() for p in m.parameters()) / 1e6, 2) == params_m
    assert [c.out_channels for c in convs][::len(convs) - 1] == [16, 64]


def test_unit_counts_follow_the_documented_formulas():
    assert models.num_units("resnet1d") == 39 and models.num_units("resnet1d", depth=14) == 27
    assert models.num_units("cnn1d", depth=5) == 6
    assert models.num_units("mlp", depth=4) == 5
    assert models.num_units("transformer", layers=3) == 6 * 3 + 4
    assert models.num_units("lenet5") == 5


def _forward_order(model, x):
    """Modules owning parameters, in the order the forward pass first calls them."""
    order = []
    owners = {id(m): n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}

    def hook(mod, _inp):
        if id(mod) in owners and owners[id(mod)] not in order:
            order.append(owners[id(mod)])

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()]
    model(x)
    for h in handles:
        h.remove()
    return order


def _owner_names(model):
    return [u.name for u in units_of(model)]


@pytest.mark.parametrize("name", [n for n in models.names() if n != "resnet50-cifar"] + ["resnet50-cifar"])
def test_forward_shape_and_units_in_execution_order(name):
    info = models.info(name)
    m = models.get(name, num_classes=7, seed=0).eval()
    x = torch.randint(7, (2, *info.input_shape)) if info.lm else torch.randn(2, *info.input_shape)
    with torch.no_grad():
        assert m(x).shape == ((2, *info.input_shape, 7) if info.lm else (2, 7))  # a LM: logits at every position
        # stage 0 must be next to the input: registration order == execution order (a tied head owns no unit)
        pos = {"<root>": ""}
        owners = [pos.get(n, n) for n in _owner_names(m)]
        assert [n for n in _forward_order(m, x) if n in owners] == owners


def test_models_accept_other_input_shapes():
    assert models.get("resnet1d", input_shape=(2, 64), num_classes=3)(torch.randn(4, 2, 64)).shape == (4, 3)
    assert models.get("cnn1d", input_shape=(1, 17))(torch.randn(2, 1, 17)).shape == (2, 10)
    assert models.get("transformer", input_shape=(3, 12), patch=3)(torch.randn(2, 3, 12)).shape == (2, 10)
    assert models.get("mlp", input_shape=(5,), num_classes=1)(torch.randn(2, 5)).shape == (2, 1)
    assert models.get("lenet5", input_shape=(1, 28, 28))(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ConfigError, match="channels, length"):
        models.get("resnet1d", input_shape=(3, 32, 32))
    with pytest.raises(ConfigError, match="patch"):
        models.get("transformer", patch=3)
    for size in ("heads", "patch", "dim"):  # (0 heads or patches was a ZeroDivisionError)
        with pytest.raises(ConfigError, match=f"transformer {size} = 0"):
            models.get("transformer", **{size: 0})


def test_seeded_init_is_deterministic_and_private():
    state = torch.get_rng_state()
    a = models.get("resnet1d", seed=3).state_dict()
    assert torch.equal(torch.get_rng_state(), state), "seeded init must not consume the global RNG"
    b = models.get("resnet1d", seed=3).state_dict()
    c = models.get("resnet1d", seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["conv.weight"], c["conv.weight"])


def test_transformer_attention_matches_torch():
    """The hand-written attention equals torch's scaled_dot_product_attention on the same projections."""
    m = models.get("transformer", seed=0, dim=16, heads=2).double()
    attn, x = m.layers[0].attn, torch.randn(3, 10, 16, dtype=torch.float64)
    q, k, v = attn.qkv(x).view(3, 10, 3, 2, 8).permute(2, 0, 3, 1, 4)
    ref = attn.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(3, 10, 16))
    assert torch.allclose(attn(x), ref, atol=1e-12)


def test_unknown_model_or_option():
    with pytest.raises(ConfigError, match="unknown model 'resnet19'.*resnet20"):
        models.get("resnet19")
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) \['depht'\].*depth"):
        models.get("resnet1d", depht=8)
    with pytest.raises(ConfigError, match="6n\\+2"):
        models.get("resnet1d", depth=10)


def test_models_command_prints_the_table(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("resnet50-cifar"))
    assert "107" in line.split() and "23,520,842" in line
    assert main(["models", "--markdown"]) == 0
    assert "| resnet20 | 269,722 | 39 | 3x32x32 |" in capsys.readouterr().out
