"""Small models and reference implementations shared by the tests."""
import functools

import torch
from torch import nn

from staleopt import methods
from staleopt import train as _train

#: Methods PipelineOptimizer trains: all but those recomputing ahead of the backward pass, which it refuses
#: until the engine has a recompute view (docs/schedules.md).
TRAINABLE_METHODS = [m for m in methods.names() if not methods.build(m, 4, 4).schedule.segments(4)]


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


def linears(model):
    return [m for m in model if isinstance(m, nn.Linear)]


def snapshot(model):
    """Current (weight, bias) per Linear layer."""
    return [[l.weight.detach().clone(), l.bias.detach().clone()] for l in linears(model)]


def oracle_grads(x, y, Wf, Wb):
    """Hand-derived gradient of ``mse`` for a Linear/tanh MLP: forward with ``Wf``, errors with ``Wb``.

    ``Wf[i]``, ``Wb[i]`` are (weight, bias) of layer i; weight gradients use the forward activations.
    """
    acts = [x]
    h = x
    n = len(Wf)
    for i in range(n):
        h = h @ Wf[i][0].T + Wf[i][1]
        if i < n - 1:
            h = torch.tanh(h)
        acts.append(h)
    delta = (acts[-1] - y) / x.shape[0]
    grads = [None] * n
    for i in reversed(range(n)):
        grads[i] = (delta.T @ acts[i], delta.sum(0))
        if i > 0:
            delta = (delta @ Wb[i][0]) * (1 - acts[i] ** 2)
    return grads


#: Seconds a test waits for a subprocess to reach a state (a file, a process exit) before calling it hung: a
#: guard against hangs, never reached by a merely slow machine (a loaded 2-core machine runs 10-20x slower).
PATIENCE = 900


def wait_for(condition, what, proc=None, poll=0.01):
    """Poll ``condition()`` until it is true; fail if ``proc`` (a ``Popen``) exits first, or after ``PATIENCE``."""
    import time

    deadline = time.monotonic() + PATIENCE
    while not condition():
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}: {err}")
        assert time.monotonic() < deadline, f"no {what} within {PATIENCE} s: hung"
        time.sleep(poll)


def train_then_stall(config, progress=False, checkpoint=None):
    """``staleopt.train.run`` for the first run this process trains; a later run waits until the process is
    killed (so a launch killed after its first run has exactly one done, however slow the machine). Its runs are
    ``staleopt.train.run``'s (``functools.wraps`` below): a launch with the default train function resumes them."""
    import time

    from staleopt import train
    if getattr(train_then_stall, "ran", False):
        while True:
            time.sleep(1)
    train_then_stall.ran = True
    return train.run(config, progress=progress, checkpoint=checkpoint)


train_then_stall = functools.wraps(_train.run)(train_then_stall)


def sweep_killed_after_first_run(sweep_file, out, extra_args=(), env=None):
    """Launch ``staleopt sweep`` in a real process and SIGKILL it once the first run is done (its train function
    must hold a second run back: :func:`train_then_stall`, or ``test_sweep.fake_train`` with ``FAKE_STALL``)."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "staleopt.cli", "sweep", str(sweep_file), "--out", str(out),
                             "--no-bar", *extra_args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: list(out.glob("runs/*/done")), "finished run", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
