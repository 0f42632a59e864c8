"""Models by name: ``get(name, num_classes=..., input_shape=..., seed=...) -> nn.Module``.

Every model takes ``num_classes`` and ``input_shape`` (a sample's shape,
without the batch dimension) so it can be built from :class:`staleopt.data.Data`.
Its *units* (parametrized operators, :func:`staleopt.partition.units_of`) are
registered in the order the forward pass runs them, so stage 0 is next to the
input; the number of units is the largest possible number of stages.

===============  ============  =====  ===========================================================
name             input         units  model
===============  ============  =====  ===========================================================
resnet1d         (C, L)        12n+3  1-D ResNet for MNIST-1D, ``depth = 6n+2`` (default 20: 39 units)
cnn1d            (C, L)        d+1    plain 1-D CNN, ``depth`` conv+ReLU layers (default 8: 9 units)
mlp              any           d+1    ``depth`` hidden Linear+ReLU layers (default 2)
transformer      (C, L)        6l+4   pre-norm Transformer encoder classifier over patches of L
gpt              (T,) tokens   6l+3   decoder-only Transformer language model (GPT-2 layout), logits
                                      ``(B, T, V)``; ``6l+4`` units with ``tie=False``
lenet5           (C, H, W)     5      LeNet-5 (LeCun et al. 1998), ReLU + max-pool
resnet20/32/56   (3, H, W)     12n+3  CIFAR ResNet (He et al. 2016 §4.2), option A shortcuts
resnet50-cifar   (3, H, W)     107    torchvision ResNet-50, 3x3 stride-1 stem, no max-pool
                                      (the PipeMare CIFAR-10 setup, PipeMare §4.1)
===============  ============  =====  ===========================================================

Every model but ``gpt`` maps a float batch ``(B, *input_shape)`` to ``(B, num_classes)``
(classification or regression data). ``gpt`` is the language model (:attr:`ModelInfo.lm`): an
int64 batch of token windows ``(B, T)`` to next-token logits ``(B, T, V)``; it takes the
vocabulary size as ``num_classes`` and the window as ``input_shape = (T,)``, which is what a
``"lm"`` dataset gives (:mod:`staleopt.data`), and trains on such data only (:func:`check_task`).

ResNet units: ``depth - 1`` convolutions, each followed by a batch norm, plus
the classifier: ``2 (depth - 1) + 1``. Option A shortcuts (identity, stride-2
subsampling and zero-padded channels where the shape changes) have no
parameters, so they add no units.

:func:`steps` gives each model's forward pass as layers that read one unit
each (equal to ``model(x)`` bit for bit), which
:func:`staleopt.segments.checkpoint_segments` runs with a recompute
schedule's segments checkpointed (PipeMare App. A.3).
"""
from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import registry
from .errors import ConfigError, StaleoptError
from .partition import units_of
from .segments import Step
from .validate import check_int

__all__ = ["get", "names", "info", "num_units", "table", "steps", "ModelInfo", "register", "registered",
           "ResNet1d", "CNN1d", "MLP", "TransformerClassifier", "GPT", "LeNet5", "CifarResNet", "resnet50_cifar",
           "check_task"]


def _shape(input_shape, dims: int, name: str) -> Tuple[int, ...]:
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != dims or min(shape) < 1:
        want = {1: "(features,)", 2: "(channels, length)", 3: "(channels, height, width)"}[dims]
        raise ConfigError(f"{name} needs input_shape {want}, got {tuple(input_shape)}")
    return shape


class _ShortcutA(nn.Module):
    """Option A shortcut (He et al. 2016 §4.1): subsample by ``stride``, zero-pad new channels."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.cin, self.cout, self.stride = cin, cout, stride

    def forward(self, x):
        if self.stride > 1:
            x = x[(..., *[slice(None, None, self.stride)] * (x.dim() - 2))]
        if self.cout > self.cin:
            pad = self.cout - self.cin
            x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1)
        return x


class _BasicBlock(nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))`` with 3-wide kernels (1-D or 2-D)."""

    def __init__(self, cin: int, cout: int, stride: int, dims: int):
        super().__init__()
        Conv, BN = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
        self.conv1 = Conv(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = BN(cout)
        self.conv2 = Conv(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = BN(cout)
        self.shortcut = _ShortcutA(cin, cout, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))

    def steps(self) -> List[Step]:
        """:meth:`forward` one unit at a time; the input rides along for the shortcut: ``(x, out)``."""
        return [Step(lambda x: (x, self.conv1(x)), self.conv1),
                Step(lambda s: (s[0], F.relu(self.bn1(s[1]))), self.bn1),
                Step(lambda s: (s[0], self.conv2(s[1])), self.conv2),
                Step(lambda s: F.relu(self.bn2(s[1]) + self.shortcut(s[0])), self.bn2)]


class _ResNet(nn.Module):
    """He et al. 2016 §4.2: a 3x3 stem, three groups of ``n`` basic blocks at widths w, 2w, 4w
    (strides 1, 2, 2), global average pooling and a linear classifier. ``depth = 6n + 2``."""

    def __init__(self, depth: int, num_classes: int, in_channels: int, width: int, dims: int):
        super().__init__()
        if (depth - 2) % 6 or depth < 8:
            raise ConfigError(f"ResNet depth must be 6n+2 with n >= 1 (8, 14, 20, 32, 44, 56, ...), got {depth}")
        check_int("width", width, 1)
        n = (depth - 2) // 6
        Conv, BN = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
        self.conv = Conv(in_channels, width, 3, 1, 1, bias=False)
        self.bn = BN(width)
        blocks, cin = [], width
        for g, cout in enumerate((width, 2 * width, 4 * width)):
            for b in range(n):
                blocks.append(_BasicBlock(cin, cout, 2 if (g > 0 and b == 0) else 1, dims))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv1d, nn.Conv2d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(x.flatten(2).mean(2))

    def steps(self) -> List[Callable]:
        """:meth:`forward` as layers of one unit each (:func:`steps`)."""
        return [self.conv, Step(lambda x: F.relu(self.bn(x)), self.bn),
                *(s for block in self.blocks for s in block.steps()),
                Step(lambda x: self.fc(x.flatten(2).mean(2)), self.fc)]


class ResNet1d(_ResNet):
    """1-D ResNet for sequences ``(C, L)`` such as MNIST-1D: the CIFAR ResNet with 1-D convolutions."""

    def __init__(self, num_classes: int = 10, input_shape=(1, 40), depth: int = 20, width: int = 8):
        c, _ = _shape(input_shape, 2, "resnet1d")
        super().__init__(depth, num_classes, c, width, dims=1)


class CifarResNet(_ResNet):
    """CIFAR ResNet-``depth`` of He et al. 2016 §4.2 (ResNet-20/32/56: n = 3/5/9), option A shortcuts."""

    def __init__(self, num_classes: int = 10, input_shape=(3, 32, 32), depth: int = 20, width: int = 16):
        c, _, _ = _shape(input_shape, 3, f"resnet{depth}")
        super().__init__(depth, num_classes, c, width, dims=2)


class CNN1d(nn.Module):
    """``depth`` layers of Conv1d(k=3, padding 1) + ReLU at ``width`` channels (every
    ``downsample_every``-th with stride 2), global average pooling, then a linear classifier.
    No normalization layers; convolutions use He (Kaiming) normal initialization."""

    def __init__(self, num_classes: int = 10, input_shape=(1, 40), depth: int = 8, width: int = 32,
                 downsample_every: int = 3):
        super().__init__()
        c, _ = _shape(input_shape, 2, "cnn1d")
        if depth < 1 or width < 1 or downsample_every < 1:
            raise ConfigError(f"cnn1d needs depth, width, downsample_every >= 1, got {depth}, {width}, "
                              f"{downsample_every}")
        layers = []
        for i in range(depth):
            stride = 2 if (i + 1) % downsample_every == 0 else 1
            layers += [nn.Conv1d(c if i == 0 else width, width, 3, stride, 1), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(width, num_classes)
        for m in self.features:
            if isinstance(m, nn.Conv1d):  # He init keeps a deep plain ReLU stack trainable
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.fc(self.features(x).mean(2))

    def steps(self) -> List[Callable]:
        """:meth:`forward` as layers of one unit each (:func:`steps`)."""
        return [*self.features, Step(lambda x: self.fc(x.mean(2)), self.fc)]


class MLP(nn.Module):
    """Flatten, ``depth`` hidden layers Linear(hidden) + ReLU, then Linear(num_classes)."""

    def __init__(self, num_classes: int = 10, input_shape=(1, 40), depth: int = 2, hidden: int = 128):
        super().__init__()
        shape = tuple(int(s) for s in input_shape)
        if not shape or min(shape) < 1 or depth < 0 or hidden < 1:
            raise ConfigError(f"mlp needs a positive input_shape, depth >= 0, hidden >= 1; got {shape}, "
                              f"{depth}, {hidden}")
        layers, fan_in = [nn.Flatten()], math.prod(shape)
        for _ in range(depth):
            layers += [nn.Linear(fan_in, hidden), nn.ReLU()]
            fan_in = hidden
        layers.append(nn.Linear(fan_in, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)

    def steps(self) -> List[Callable]:
        """:meth:`forward` as layers of one unit each (:func:`steps`)."""
        return list(self.net)


class _Attention(nn.Module):
    """Multi-head self-attention: ``softmax(Q K^T / sqrt(d_head)) V`` with fused QKV projection; ``causal``:
    position ``t`` attends to positions ``<= t`` only (the scores of later ones are ``-inf``)."""

    def __init__(self, dim: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(self.attend(self.qkv(x)))

    def attend(self, qkv):
        """The heads' ``softmax(Q K^T / sqrt(d_head)) V``, concatenated, from the fused projection ``qkv``."""
        b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        if self.causal:
            later = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(later, -math.inf)
        a = torch.softmax(scores, dim=-1) @ v
        return a.transpose(1, 2).reshape(b, t, d)


class _EncoderLayer(nn.Module):
    """Pre-norm layer: ``x += attn(ln1(x)); x += fc2(gelu(fc1(ln2(x))))`` (6 units); a decoder layer
    with ``causal`` attention."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, causal: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads, causal)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def steps(self) -> List[Step]:
        """:meth:`forward` one unit at a time; the residual stream rides along: ``(x, branch)``."""
        attn = self.attn
        return [Step(lambda x: (x, self.ln1(x)), self.ln1),
                Step(lambda s: (s[0], attn.attend(attn.qkv(s[1]))), attn.qkv),
                Step(lambda s: s[0] + attn.proj(s[1]), attn.proj),
                Step(lambda x: (x, self.ln2(x)), self.ln2),
                Step(lambda s: (s[0], F.gelu(self.fc1(s[1]))), self.fc1),
                Step(lambda s: s[0] + self.fc2(s[1]), self.fc2)]


class _Positions(nn.Module):
    """Learned positional embedding added to the token sequence (its first ``T`` rows to ``T`` tokens)."""

    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(0.02 * torch.randn(tokens, dim))

    def forward(self, x):
        return x + self.weight[:x.shape[-2]]


class TransformerClassifier(nn.Module):
    """Encoder classifier for ``(C, L)`` inputs: the sequence is cut into ``L / patch`` tokens of
    ``C * patch`` features, embedded, given learned positions, passed through ``layers`` pre-norm
    encoder layers, mean-pooled, normalized and classified. Units: ``6 * layers + 4``."""

    def __init__(self, num_classes: int = 10, input_shape=(1, 40), dim: int = 32, heads: int = 4,
                 layers: int = 4, patch: int = 4, mlp_ratio: int = 2):
        super().__init__()
        c, length = _shape(input_shape, 2, "transformer")
        for name, v in (("dim", dim), ("heads", heads), ("layers", layers), ("patch", patch), ("mlp_ratio", mlp_ratio)):
            check_int(f"transformer {name}", v, 1)  # (before the modulos: heads = 0 was a ZeroDivisionError)
        if length % patch or dim % heads:
            raise ConfigError(f"transformer needs patch | L ({patch} | {length}) and heads | dim ({heads} | {dim})")
        self.patch = patch
        self.embed = nn.Linear(c * patch, dim)
        self.pos = _Positions(length // patch, dim)
        self.layers = nn.Sequential(*[_EncoderLayer(dim, heads, mlp_ratio) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        h = self.layers(self.pos(self.embed(self.tokens(x))))
        return self.head(self.ln(h.mean(1)))

    def tokens(self, x):
        """``(B, C, L) -> (B, L / patch, C * patch)``: the sequence cut into patches."""
        b, c, length = x.shape
        return x.view(b, c, length // self.patch, self.patch).permute(0, 2, 1, 3).reshape(b, length // self.patch, -1)

    def steps(self) -> List[Callable]:
        """:meth:`forward` as layers of one unit each (:func:`steps`)."""
        return [Step(lambda x: self.embed(self.tokens(x)), self.embed), self.pos,
                *(s for layer in self.layers for s in layer.steps()),
                Step(lambda h: self.ln(h.mean(1)), self.ln), self.head]


class GPT(nn.Module):
    """Decoder-only Transformer language model in GPT-2's layout (Radford et al. 2019, §2.3): token
    embedding ``tok`` plus learned positions, ``layers`` pre-norm decoder layers (causal multi-head
    self-attention, then an MLP ``d -> mlp_ratio d -> d`` with GELU), a final LayerNorm ``ln`` and the
    output layer ``head = Linear(d, V, bias=False)``. ``(B, T)`` int64 tokens, ``T <= context``, map to
    logits ``(B, T, V)``; position ``t``'s logits read tokens ``0..t`` only.

    ``tie`` (default): the output layer's weight *is* the token embedding's (``head.weight is
    tok.weight``, Press & Wolf 2017), so it is one parameter that stage 0 and the last stage both use
    (docs/design.md §1). ``tie=False`` gives the head a matrix of its own. Units: ``6 layers + 3``
    (``+ 4`` untied). Initialization: embeddings, positions and linear weights ``N(0, 0.02^2)``,
    biases 0, LayerNorms 1 and 0, and each residual branch's output projection (``attn.proj``,
    ``fc2``) ``N(0, 0.02^2 / (2 layers))`` (GPT-2 §2.3).
    """

    def __init__(self, vocab_size: int = 256, context: int = 128, d_model: int = 64, layers: int = 2,
                 heads: int = 4, mlp_ratio: int = 4, tie: bool = True):
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("context", context), ("d_model", d_model),
                        ("layers", layers), ("heads", heads), ("mlp_ratio", mlp_ratio)):
            check_int(f"gpt {name}", v, 1)
        if d_model % heads:
            raise ConfigError(f"gpt needs heads | d_model, got heads = {heads}, d_model = {d_model}: choose a "
                              "number of heads that divides d_model")
        if not isinstance(tie, bool):
            raise ConfigError(f"gpt tie must be True or False, got {tie!r}")
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = _Positions(context, d_model)
        self.layers = nn.Sequential(*[_EncoderLayer(d_model, heads, mlp_ratio, causal=True) for _ in range(layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif not name.startswith("ln") and ".ln" not in name:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, x):
        return self.head(self.ln(self.layers(self.pos(self.embed(x)))))

    def embed(self, x):
        """The token embedding of an int64 ``(B, T)`` batch, ``T <= context``."""
        if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2:
            raise ConfigError(f"gpt reads int64 token windows (B, T), got {x.dtype} of shape {tuple(x.shape)}")
        if x.shape[1] > self.context:
            raise ConfigError(f"gpt got windows of {x.shape[1]} tokens, longer than its context {self.context}: "
                              "build it with a larger context (input_shape=(T,))")
        return self.tok(x)

    def steps(self) -> List[Callable]:
        """:meth:`forward` as layers of one unit each (:func:`steps`); with ``tie`` the head reads ``tok``'s."""
        return [Step(self.embed, self.tok), self.pos, *(s for layer in self.layers for s in layer.steps()),
                self.ln, self.head]


def _gpt(num_classes: int = 256, input_shape=(128,), d_model: int = 64, layers: int = 2, heads: int = 4,
         mlp_ratio: int = 4, tie: bool = True) -> GPT:
    """:class:`GPT` for a ``"lm"`` dataset: ``vocab_size = num_classes``, ``context = T`` of ``input_shape = (T,)``."""
    (context,) = _shape(input_shape, 1, "gpt")
    return GPT(vocab_size=num_classes, context=context, d_model=d_model, layers=layers, heads=heads,
               mlp_ratio=mlp_ratio, tie=tie)


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling: conv5x5(6), pool, conv5x5(16), pool,
    fc120, fc84, fc(num_classes). 28x28 inputs are zero-padded by 2, as in the paper's 32x32 retina."""

    def __init__(self, num_classes: int = 10, input_shape=(3, 32, 32)):
        super().__init__()
        c, h, w = _shape(input_shape, 3, "lenet5")
        pad = 2 if min(h, w) < 32 else 0
        if min(h, w) + 2 * pad < 16:
            raise ConfigError(f"lenet5 needs images of at least 12x12, got {h}x{w}")
        self.conv1 = nn.Conv2d(c, 6, 5, padding=pad)
        self.conv2 = nn.Conv2d(6, 16, 5)
        hh, ww = ((h + 2 * pad - 4) // 2 - 4) // 2, ((w + 2 * pad - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * hh * ww, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))

    def steps(self) -> List[Callable]:
        """:meth:`forward` as layers of one unit each (:func:`steps`)."""
        return [Step(lambda x: F.max_pool2d(F.relu(self.conv1(x)), 2), self.conv1),
                Step(lambda x: F.max_pool2d(F.relu(self.conv2(x)), 2), self.conv2),
                Step(lambda x: F.relu(self.fc1(x.flatten(1))), self.fc1),
                Step(lambda x: F.relu(self.fc2(x)), self.fc2), self.fc3]


def resnet50_cifar(num_classes: int = 10, input_shape=(3, 32, 32)) -> nn.Module:
    """torchvision ResNet-50 with a 3x3 stride-1 stem convolution and no max-pool (PipeMare §4.1):
    53 convolutions + 53 batch norms + 1 linear = 107 units."""
    import torchvision
    c, _, _ = _shape(input_shape, 3, "resnet50-cifar")
    model = torchvision.models.resnet50(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(c, 64, 3, 1, 1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


def _bottleneck_steps(block) -> List[Step]:
    """torchvision's ``Bottleneck.forward`` one unit at a time, the input riding along: ``(x, out)``
    (``out += identity`` becomes ``out + identity``: the same sum)."""
    last = [Step(lambda s: block.relu(block.bn3(s[1]) + s[0]), block.bn3)]
    if block.downsample is not None:
        conv, bn = block.downsample
        last = [Step(lambda s: (s[0], block.bn3(s[1])), block.bn3),
                Step(lambda s: (s[1], conv(s[0])), conv),           # (out, conv(x))
                Step(lambda s: block.relu(s[0] + bn(s[1])), bn)]
    return [Step(lambda x: (x, block.conv1(x)), block.conv1),
            Step(lambda s: (s[0], block.relu(block.bn1(s[1]))), block.bn1),
            Step(lambda s: (s[0], block.conv2(s[1])), block.conv2),
            Step(lambda s: (s[0], block.relu(block.bn2(s[1]))), block.bn2),
            Step(lambda s: (s[0], block.conv3(s[1])), block.conv3), *last]


def _torchvision_resnet_steps(model) -> List[Callable]:
    """torchvision ``ResNet._forward_impl`` of Bottleneck blocks as layers of one unit each."""
    blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
    if not all(hasattr(b, "conv3") and (b.downsample is None or len(b.downsample) == 2) for b in blocks):
        raise ConfigError("staleopt.models.steps knows torchvision ResNets of Bottleneck blocks (resnet50-cifar); "
                          "write the steps of this model yourself (docs/wrapper.md)")
    return [model.conv1, Step(lambda x: model.maxpool(model.relu(model.bn1(x))), model.bn1),
            *(s for b in blocks for s in _bottleneck_steps(b)),
            Step(lambda x: model.fc(torch.flatten(model.avgpool(x), 1)), model.fc)]


def steps(model: nn.Module) -> List[Callable]:
    """A built-in model's forward pass as a sequence of layers that each read at most one unit
    (:mod:`staleopt.segments`): run in order they compute ``model(x)`` bit for bit, and every
    partition's stage boundaries fall between two of them, so any partition's recompute segments
    can be checkpointed (:func:`staleopt.segments.checkpoint_segments`). A tuple ``(x, out)`` carries
    a residual branch across a boundary.

    A user's model: its own ``steps()`` method when it has one (a list of modules, or
    :class:`~staleopt.segments.Step` functions that declare the modules they read), else the children
    of an ``nn.Sequential`` (whose forward is exactly that list)."""
    if callable(getattr(model, "steps", None)):
        return model.steps()
    if isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward:
        return list(model)
    tv = sys.modules.get("torchvision")
    if tv is not None and isinstance(model, tv.models.ResNet):
        return _torchvision_resnet_steps(model)
    raise ConfigError(f"staleopt.models.steps does not know the layers of {type(model).__name__} (not a built-in "
                      "model, not an nn.Sequential), so a recompute method cannot checkpoint its segments: give "
                      "the model a steps() method that returns its forward as a list of layers, each reading at "
                      "most one unit (a module, or staleopt.segments.Step(fn, *modules_fn_reads)), or build it as "
                      "an nn.Sequential; see docs/tutorial.md, 'Recompute methods on your model'")


@dataclass(frozen=True)
class ModelInfo:
    """A registry entry: how to build the model and what input it expects by default."""

    name: str
    factory: Callable[..., nn.Module]
    input_shape: Tuple[int, ...]
    description: str
    fixed: Tuple[Tuple[str, object], ...] = ()  # keyword arguments the name fixes (e.g. depth)
    user: bool = False                          # registered by the user (:func:`register`) or a spec
    lm: bool = False                            # a language model: trains on task "lm" data only

    def kwargs(self) -> List[str]:
        """Keyword arguments :func:`get` accepts for this model (``**kwargs`` left out)."""
        params = _parameters(self.factory)
        return [p for p, v in params.items() if p not in dict(self.fixed) and v.kind is not v.VAR_KEYWORD]

    def defaults(self) -> Dict[str, Any]:
        """The factory's keyword arguments that have a default, with it (what a given option's type is checked
        against: :class:`~staleopt.config.RunConfig`)."""
        return {k: v.default for k, v in _parameters(self.factory).items() if v.default is not v.empty}

    def takes_any(self) -> bool:
        """Whether the factory takes ``**kwargs`` (then any option is passed on to it)."""
        return any(v.kind is v.VAR_KEYWORD for v in _parameters(self.factory).values())


def _parameters(factory):
    try:
        return dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return {}


def _resnet(depth):
    return ModelInfo(f"resnet{depth}", CifarResNet, (3, 32, 32),
                     f"CIFAR ResNet-{depth} (He et al. 2016 §4.2), option A shortcuts", (("depth", depth),))


_REGISTRY: Dict[str, ModelInfo] = {m.name: m for m in [
    ModelInfo("resnet1d", ResNet1d, (1, 40), "1-D ResNet-20 for MNIST-1D (widths 8/16/32, option A shortcuts)"),
    ModelInfo("cnn1d", CNN1d, (1, 40), "plain 1-D CNN for MNIST-1D: 8 conv+ReLU layers, width 32, no normalization"),
    ModelInfo("mlp", MLP, (1, 40), "MLP: 2 hidden layers of 128, ReLU"),
    ModelInfo("transformer", TransformerClassifier, (1, 40),
              "pre-norm Transformer encoder classifier: 4 layers, dim 32, 4 heads, patches of 4"),
    ModelInfo("gpt", _gpt, (128,), "decoder-only Transformer LM (GPT-2 layout): 2 layers, d 64, 4 heads, "
              "tied embedding/head", lm=True),
    ModelInfo("lenet5", LeNet5, (3, 32, 32), "LeNet-5 (LeCun et al. 1998), ReLU + max-pool"),
    _resnet(20), _resnet(32), _resnet(56), _resnet(110),
    ModelInfo("resnet50-cifar", resnet50_cifar, (3, 32, 32),
              "torchvision ResNet-50, 3x3 stem, no max-pool (PipeMare CIFAR-10 setup)"),
]}


#: Models registered by the user (:func:`register`) and specs loaded (:mod:`staleopt.registry`), by name.
_USER: Dict[str, ModelInfo] = {}


def register(name: str, factory: Callable[..., nn.Module], *, description: str = "",
             replace: bool = False) -> str:
    """Make ``factory`` the model ``name`` everywhere a model name goes: ``RunConfig(model=name)``,
    sweeps (their worker processes too: :mod:`staleopt.registry`), :func:`staleopt.compare`.

    ``factory(num_classes=..., input_shape=..., **model_kwargs) -> nn.Module``: it gets the
    data's number of classes (outputs) and sample shape when it has parameters of those names,
    and the config's ``model_kwargs``. It must be deterministic given the RNG (the trainer seeds it).
    Registering the same factory again is a no-op; another factory under a taken name needs
    ``replace=True``. Built-in names cannot be replaced. Returns ``name``.
    """
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise ConfigError(f"a model name is a non-empty string without ':' or surrounding spaces, got {name!r} "
                          "(':' marks a 'module:function' spec)")
    if not callable(factory):
        raise ConfigError(f"model {name!r}: the factory must be callable (a function or nn.Module class), "
                          f"got {type(factory).__name__}")
    if name in _REGISTRY:
        raise ConfigError(f"model {name!r} is built in; register yours under another name")
    old = _USER.get(name)
    if old is not None and old.factory is not factory and not replace:
        raise ConfigError(f"model {name!r} is already registered with {old.factory!r}; pass replace=True "
                          "to register another factory under this name")
    _USER[name] = ModelInfo(name, factory, (), description or (factory.__doc__ or "").strip().split("\n")[0],
                            user=True)
    return name


def registered() -> Dict[str, Callable[..., nn.Module]]:
    """The factories registered by name in this process (specs left out: they load anywhere)."""
    return {n: e.factory for n, e in _USER.items() if not registry.is_spec(n)}


def names() -> List[str]:
    """The model names :func:`get` accepts (built-in, then registered; any ``module:function`` spec too)."""
    return list(_REGISTRY) + list(registered())


def info(name: str) -> ModelInfo:
    """The registry entry of ``name``: a built-in or registered model, or a ``module:function`` /
    ``file.py:function`` spec (loaded on first use, :mod:`staleopt.registry`)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _USER and not registry.is_spec(name):
        return _USER[name]
    if registry.is_spec(name):
        key = registry.spec_key(name)  # (a relative file spec names another file after os.chdir)
        if key not in _USER:
            factory = registry.load_spec(name, "model")
            _USER[key] = ModelInfo(name, factory, (), (factory.__doc__ or "").strip().split("\n")[0], user=True)
        return _USER[key]
    raise registry.unknown("model", name, names(), "staleopt.register_model")


def get(name: str, *, seed: Optional[int] = None, **kwargs) -> nn.Module:
    """Build model ``name``; ``kwargs`` go to its constructor (``num_classes``, ``input_shape``, ...).

    With ``seed`` the initialization draws from ``torch.manual_seed(seed)``
    inside a forked RNG, so the global RNG is left as it was.
    """
    entry = info(name)
    allowed = entry.kwargs()
    if entry.user and not entry.takes_any():  # a user's factory may not want the data's shape
        kwargs = {k: v for k, v in kwargs.items() if k in allowed or k not in ("num_classes", "input_shape")}
    bad = sorted(set(kwargs) - set(allowed))
    if bad and not entry.takes_any():
        raise ConfigError(f"model {name!r} got unknown argument(s) {bad}; allowed: {allowed}")
    kwargs = {**dict(entry.fixed), **kwargs}
    registry.check_arguments("model", name, _parameters(entry.factory), kwargs, "model_kwargs",
                             supplied=("num_classes", "input_shape"))  # (the data's: a caller without data says so)
    if seed is None:
        model = entry.factory(**kwargs)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = entry.factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {name!r}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def check_task(name: str, task: str, data: str = "the data") -> None:
    """Raise :class:`ConfigError` when built-in model ``name`` cannot train on ``task`` data: a language
    model (``gpt``) needs task ``"lm"`` and every other built-in model refuses it. A user's model is not
    checked (its factory decides what it reads)."""
    entry = info(name)
    if entry.user or entry.lm == (task == "lm"):
        return
    lms = [n for n, e in _REGISTRY.items() if e.lm]
    if entry.lm:
        raise ConfigError(f"model {name!r} is a language model and {data} has task {task!r}: train it on a "
                          f"text dataset (staleopt.data, task 'lm': text-markov, text-shakespeare, ...)")
    raise ConfigError(f"{data} is a language-modelling dataset (task 'lm': int64 token windows, next-token "
                      f"targets) and model {name!r} maps a sample to one output vector: use "
                      f"a language model ({', '.join(lms)})")


def num_units(name: str, **kwargs) -> int:
    """Number of parametrized operators of ``get(name, **kwargs)``: the largest stage count.

    Built on the meta device, so it costs no memory or initialization time (on the CPU
    for a user's factory that cannot run on the meta device). A user's factory that raises is a
    :class:`ConfigError` naming the model and the arguments it was given.
    """
    try:
        with torch.device("meta"):
            return len(units_of(get(name, **kwargs)))
    except Exception:           # a user's factory may not run on the meta device: built on the CPU below
        if not info(name).user:
            raise
    try:
        return len(units_of(get(name, seed=0, **kwargs)))
    except StaleoptError:
        raise
    except Exception as e:      # the user's factory: name it and what it was given, not a bare traceback
        raise ConfigError(f"model {name!r} raised {type(e).__name__} when built with {kwargs} to count its units: "
                          f"{e}; fix the factory (or the model_kwargs it is given)") from e


def table() -> List[Dict[str, object]]:
    """One row per model at its defaults: name, params, units (max stages), input shape, description."""
    rows = []
    for name, entry in _REGISTRY.items():
        with torch.device("meta"):
            model = get(name)
        rows.append({"name": name, "params": sum(p.numel() for p in model.parameters()),
                     "units": len(units_of(model)), "input_shape": entry.input_shape,
                     "description": entry.description})
    return rows
