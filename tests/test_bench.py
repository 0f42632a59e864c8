"""Smoke test of experiments/bench_overhead.py: it runs and writes its tables. It times nothing.

What it does check is what the benchmark's ratios rest on: the hand-rolled baseline is the same
simulation (same weights as the wrapper), and the memory it reports is the memory allocated.
"""
import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import torch

import staleopt
from staleopt import schedules
from helpers import batches, mlp, mse

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "bench_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method, schedule, stash", [("dataflow", "dataflow", False), ("pipedream", "1f1b", True)])
def test_hand_rolled_baseline_is_the_same_simulation(bench, method, schedule, stash):
    """The deque-of-state_dicts loop and the wrapper give bit-identical weights (float64 MLP)."""
    out = []
    for kind in ("staleopt", "hand"):
        model = mlp()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if kind == "staleopt":
            opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule=method)
        else:
            tf, tb = schedules.get(schedule).delays(3, 1)
            hand = bench.HandRolled(model, base, staleopt.partition_model(model, 3), tf, list(tf) if stash else tb)
        for x, y in batches(6):
            if kind == "staleopt":
                opt.zero_grad()
                mse(model(x), y).backward()
                opt.step()
            else:
                hand.train_step(x, y, mse)
        out.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(out[0], out[1])
    assert not torch.equal(out[0], torch.cat([p.detach().flatten() for p in mlp().parameters()]))


def test_new_storage_bytes_counts_allocated_tensors(bench):
    before = bench._storages()
    kept = [torch.empty(1000, dtype=torch.float64), torch.empty(10, dtype=torch.float32)]
    view = kept[0][:10]  # a view shares its storage: counted once
    assert bench.new_storage_bytes(before) == 8000 + 40
    del kept, view


def test_quick_run_writes_tables_and_plot(bench, tmp_path):
    assert bench.main(["--quick", "--out", str(tmp_path), "--models", "cnn1d", "--rounds", "1"]) == 0
    for name in ("step.csv", "memory.csv", "handrolled.csv", "growth.csv", "growth.png", "meta.json"):
        assert (tmp_path / name).is_file(), name
    step = pd.read_csv(tmp_path / "step.csv")
    assert set(step.variant) == {"pipemare", "pipedream", "pipeoptim", "dataflow", "dataflow (memory=fast)",
                                 "pipedream (memory=fast)", "hand-rolled dataflow", "hand-rolled pipedream"}
    assert (step.engine_ms >= 0).all() and (step.ratio > 0).all()
    mem = pd.read_csv(tmp_path / "memory.csv")
    assert (mem.measured_bytes == mem.engine_reported_bytes).all()  # the engine's account is what it allocated
    assert (mem.measured_bytes >= mem.minimum_bytes).all()
    exact = mem[mem.method.isin(["pipedream", "pipeoptim", "dataflow"])]
    assert (exact.measured_bytes == exact.minimum_bytes).all()
    hand = pd.read_csv(tmp_path / "handrolled.csv")
    assert (hand.max_abs_weight_diff == 0).all() and (hand.memory_ratio > 1).all()
    fast = mem[mem.method.str.endswith("(memory=fast)")]  # one more version per delayed stage
    assert len(fast) == 2 and (fast.measured_bytes > fast.minimum_bytes).all() and (hand.fast_engine_ms >= 0).all()
    growth = pd.read_csv(tmp_path / "growth.csv")
    assert set(growth.axis) == {"stages", "width"}
    stages = growth[growth.axis == "stages"].sort_values("value")
    assert stages.dataflow_bytes.is_monotonic_increasing
    assert (growth.dataflow_bytes == growth.dataflow_minimum_bytes).all()
