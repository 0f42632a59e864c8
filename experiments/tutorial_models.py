"""The model and data of docs/tutorial.md, as a file that sweeps and the command line can name
("experiments/tutorial_models.py:small_cnn"); tests/test_compare.py checks the page shows this code."""
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset


def small_cnn(num_classes, input_shape, width=16):
    """Two Conv1d + BatchNorm + ReLU layers, global average pooling, a linear classifier: 5 units."""
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv1d(channels, width, 5, padding=2), nn.BatchNorm1d(width), nn.ReLU(),
        nn.Conv1d(width, width, 5, padding=2), nn.BatchNorm1d(width), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(width, num_classes))


def waves(n=1200, length=32, noise=0.8, seed=0):
    """Noisy sine waves of 3 frequencies with random phases; the class is the frequency. 3/4 train, 1/4 test."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(3, (n,), generator=g)
    t = torch.arange(length) / length
    phase = 2 * math.pi * torch.rand(n, 1, generator=g)
    x = torch.sin(2 * math.pi * (y[:, None] + 1) * t + phase) + noise * torch.randn(n, length, generator=g)
    x = x[:, None, :]                                      # (samples, channels, length)
    cut = 3 * n // 4
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])
