"""The engine on an accelerator: every method and correction trains there as it does on the CPU, what the wrapper
keeps lives there, and a checkpoint moves between the two.

The device is ``STALEOPT_TEST_DEVICE`` (default ``cuda``; ``cuda:1``, ... also; one with float64: not ``mps``),
and the module is skipped where torch cannot use it. ``STALEOPT_TEST_DEVICE=cpu python -m pytest
tests/test_accelerator.py`` runs the same checks with the CPU in the accelerator's place (then both runs are equal
bit for bit): the tests of the tests, on a machine without one.

On the accelerator the float64 weights are compared to the CPU's with a tolerance, not bit for bit: its kernels
may fuse a multiply and an add (one rounding instead of two) and sum a matrix product in another order.
"""
import copy
import io
import os

import pytest
import torch

import staleopt
from staleopt._torch_compat import flatten

from helpers import batches, mlp, mse
from test_engine_reference import ARGS, CASES, SIZES, STEPS, _views_seen

DEVICE = os.environ.get("STALEOPT_TEST_DEVICE", "cuda")


def _usable(device: str) -> bool:
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, ValueError):  # (not compiled in, no such device, no driver)
        return False
    return True


pytestmark = pytest.mark.skipif(not _usable(DEVICE), reason=f"needs the device {DEVICE!r} (STALEOPT_TEST_DEVICE)")

TOL = dict(rtol=1e-9, atol=1e-12)


def _build(case, base, device, memory="minimal"):
    kwargs = {k: copy.deepcopy(v) for k, v in CASES[case].items() if k != "passes"}
    model = mlp(SIZES, seed=4).to(device)
    params = model.parameters()
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3) if base == "sgd" else \
        torch.optim.Adam(params, lr=1e-2)
    return model, staleopt.PipelineOptimizer(model, opt, stages=4, memory=memory, **kwargs)


def _train(model, opt, data, passes, device):
    for x, y in data:
        opt.zero_grad()
        _views_seen(model, x.to(device), y.to(device), passes)
        opt.step()


def _same_weights(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), **TOL, msg=lambda m: f"{what}, {name}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_method_trains_there_as_on_the_cpu(case):
    """Each case of tests/test_engine_reference.py (every method, schedule and correction), with SGD and Adam, in
    both memory modes: the weights after training on the device are the CPU's; the wrapper's own state (history,
    corrections) is on the device, and it counts the same bytes there."""
    passes = CASES[case].get("passes", 1)
    data = batches(STEPS, in_dim=SIZES[0], batch=12, seed=5)
    for base in ("sgd", "adam"):
        if "prediction('adam'" in case and base == "sgd":
            continue  # (XPipe's own moments: one base optimizer is enough, as in test_engine_reference.py)
        for memory in ("minimal", "fast"):
            what = f"{case}, {base}, memory={memory}"
            (cpu_model, cpu_opt), (model, opt) = (_build(case, base, d, memory) for d in ("cpu", DEVICE))
            _train(cpu_model, cpu_opt, data, passes, "cpu")
            _train(model, opt, data, passes, DEVICE)
            _same_weights(model, cpu_model, what)
            assert opt.memory_bytes() == cpu_opt.memory_bytes(), what
            device = next(model.parameters()).device
            state = dict(opt.state_dict()["staleopt"])
            del state["generator"]  # (the CPU generator of random delays, by design)
            elsewhere = [x for x in flatten(state) if isinstance(x, torch.Tensor) and x.device != device]
            assert not elsewhere, f"{what}: {len(elsewhere)} tensors of the wrapper's state are not on {device}: " \
                f"{sorted({str(x.device) for x in elsewhere})}"


@pytest.mark.parametrize("method", ["pipemare", "pipedream", "pipeoptim"])
def test_checkpoint_moves_between_the_device_and_the_cpu(method):
    """A checkpoint saved on the device and loaded on the CPU (``map_location``), and back, continues as the run
    that never stopped."""
    kwargs = dict(schedule=method, method_args=ARGS.get(method))
    data = batches(8, in_dim=SIZES[0], batch=12, seed=5)

    def build(device):
        model = mlp(SIZES, seed=4).to(device)
        return model, staleopt.PipelineOptimizer(model, torch.optim.Adam(model.parameters(), lr=1e-2), stages=4,
                                                 **kwargs)

    whole_model, whole = build("cpu")
    _train(whole_model, whole, data, 1, "cpu")
    model, opt = build(DEVICE)
    _train(model, opt, data[:3], 1, DEVICE)
    for there, part in (("cpu", data[3:6]), (DEVICE, data[6:])):  # device -> CPU, then CPU -> device
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, map_location=there, weights_only=False)
        model, opt = build(there)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        _train(model, opt, part, 1, there)
    _same_weights(model, whole_model, f"{method}, resumed on the CPU and back on {DEVICE}")


@pytest.mark.parametrize("method", ["dataflow", "pipemare", "pipeoptim", "xpipe"])
def test_fused_adam_with_a_tensor_lr(method):
    """``Adam(fused=True)`` with a Tensor ``lr`` on the device (the configuration the engine's host-sync checks
    use, tests/test_engine_floor.py) trains as on the CPU."""
    runs = []
    for device in ("cpu", DEVICE):
        model = mlp(SIZES, seed=4).to(device)
        # (a float32 lr: torch's CUDA fused Adam reads it as a float, whatever the parameters' dtype)
        base = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2, device=device), fused=True)
        opt = staleopt.PipelineOptimizer(model, base, stages=4, schedule=method, method_args=ARGS.get(method))
        _train(model, opt, batches(STEPS, in_dim=SIZES[0], batch=12, seed=5), 1, device)
        runs.append(model)
    _same_weights(runs[1], runs[0], f"{method}, fused Adam, Tensor lr")


def test_grad_scaler_on_the_device_changes_nothing():
    """``GradScaler`` on the wrapper, on the device: a power-of-two loss scale leaves float32 weights as they are
    without it, bit for bit (the unscaled gradients are the same), as on the CPU (tests/test_amp.py)."""
    runs = []
    for scaled in (False, True):
        model = mlp(SIZES, seed=4, dtype=torch.float32).to(DEVICE)
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         stages=4, schedule="pipemare", method_args=ARGS["pipemare"])
        scaler = torch.amp.GradScaler(torch.device(DEVICE).type, init_scale=2.0 ** 10) if scaled else None
        for x, y in batches(STEPS, in_dim=SIZES[0], batch=12, seed=5, dtype=torch.float32):
            opt.zero_grad()
            loss = mse(model(x.to(DEVICE)), y.to(DEVICE))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])
