"""Small models and reference implementations shared by the tests."""
import torch
from torch import nn


def mlp(sizes=(5, 7, 6, 3), seed=0, dtype=torch.float64):
    """Linear+tanh layers, one stage per Linear; the last layer is linear."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(dtype)


def batches(n, in_dim=5, out_dim=3, batch=8, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, in_dim, generator=g, dtype=dtype), torch.randn(batch, out_dim, generator=g, dtype=dtype))
            for _ in range(n)]


def mse(out, y):
    return 0.5 * ((out - y) ** 2).sum(dim=1).mean()


def train(model, opt, data, loss_fn=mse):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
