"""Smoke test of experiments/bench_overhead.py: it runs and writes its tables. It times nothing.

What it does check is what the benchmark's ratios rest on: the hand-rolled baseline is the same
simulation (same weights as the wrapper), and the memory it reports is the memory allocated.
"""
import functools
import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

import staleopt
from staleopt import schedules
from helpers import batches, mlp, mse

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load("bench_overhead")


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _wrapper_weights(method, stages, method_args=None):
    """The weights after the wrapper's steps on ``batches(6)`` (float64 MLP, SGD lr 0.1, momentum 0.9)."""
    model = mlp()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stages=stages,
                                     schedule=method, method_args=method_args)
    for x, y in batches(6):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    return _flat(model)


@pytest.mark.parametrize("method, schedule, stash", [("dataflow", "dataflow", False), ("pipedream", "1f1b", True)])
def test_hand_rolled_baseline_is_the_same_simulation(bench, method, schedule, stash):
    """The deque-of-state_dicts loop and the wrapper give bit-identical weights (float64 MLP)."""
    model = mlp()
    tf, tb = schedules.get(schedule).delays(3, 1)
    hand = bench.HandRolled(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            staleopt.partition_model(model, 3), tf, list(tf) if stash else tb)
    for x, y in batches(6):
        hand.train_step(x, y, mse)
    assert torch.equal(_wrapper_weights(method, 3), _flat(model))
    assert not torch.equal(_flat(model), _flat(mlp()))


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("method, copies", [("dataflow", 2), ("pipemare", 2)])
def test_floors_are_the_same_simulation(bench, method, copies, stages):
    """A method's floor (its moves and arithmetic, no bookkeeping: pointer moves, the copies, for pipemare
    T1's per-stage lr and T2's rewrite and accumulator) and the wrapper give bit-identical weights (float64
    MLP: nn.Linear saves weight.t(), a view of the row the forward pointed at; pipemare while annealing),
    and the floor copies the weights as often as the engine does."""
    args = {"anneal_steps": 4} if method == "pipemare" else {}
    model = mlp()
    tf, _ = schedules.get("dataflow").delays(stages, 1)
    floor = bench.FLOORS[method](model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 staleopt.partition_model(model, stages), tf, **args)
    for x, y in batches(6):
        with bench.OpCounter() as counter:  # (SGD itself copies nothing)
            floor.train_step(x, y, mse)
        assert counter.copy_bytes == copies * sum(p.numel() * p.element_size() for p in floor.params)
    assert torch.equal(_wrapper_weights(method, stages, args or None), _flat(model))
    assert not torch.equal(_flat(model), _flat(mlp())) and floor.seconds > 0


@pytest.mark.parametrize("without, method, corrections", [
    (("t1", "t2-rewrite", "t2-update"), "dataflow", False),  # the spare row alone: dataflow's weights
    (("t1", "t2-update"), "dataflow", False),  # + T2's rewrite of a delta that stays 0: still dataflow's weights
    (("t1",), "dataflow", True),  # T2 alone
    (("t2-rewrite", "t2-update"), "pipemare-t1", False),  # T1 alone
])
def test_ladder_floors_are_the_pieces_they_keep(bench, without, method, corrections):
    """A floor without some of pipemare's pieces is bit for bit the wrapper with just the others (float64 MLP,
    3 stages, annealing)."""
    model = mlp()
    tf, _ = schedules.get("dataflow").delays(3, 1)
    floor = bench.PipemareFloor(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                staleopt.partition_model(model, 3), tf, anneal_steps=4, without=without)
    for x, y in batches(6):
        floor.train_step(x, y, mse)
    wrapper = mlp()
    opt = staleopt.PipelineOptimizer(wrapper, torch.optim.SGD(wrapper.parameters(), lr=0.1, momentum=0.9), stages=3,
                                     schedule=method, method_args={"anneal_steps": 4} if method != "dataflow" else None,
                                     corrections=[staleopt.corrections.DiscrepancyCorrection(bench.methods.DECAY)]
                                     if corrections else ())
    for x, y in batches(6):
        opt.zero_grad()
        mse(wrapper(x), y).backward()
        opt.step()
    assert torch.equal(_flat(wrapper), _flat(model)) and not torch.equal(_flat(model), _flat(mlp()))


def test_ladder_rungs_add_one_piece_each(bench):
    """Each rung of the budget ladder does what the rung before does plus the piece its label names, counted per
    step (float64 MLP, 3 stages): the hooks run and move nothing (no op beyond the plain step's); then two weight
    copies (the stale forward views: w_t over the expiring row, push), the spare row (push's copy goes there
    instead: no op more), T2's rewrite (one op), T2's update (two: the difference and the lerp), T1's groups (one
    parameter group per stage, no op)."""
    x, y = batches(1)[0]
    counts = []
    for label, floor_type in [("plain", None)] + list(bench.LADDER):
        model = mlp()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        floor = None if floor_type is None else floor_type(model, base, staleopt.partition_model(model, 3),
                                                           schedules.get("dataflow").delays(3, 1)[0])
        calls = []
        if floor is not None:
            for hook in ("_forward", "_backward", "_end"):
                setattr(floor, hook, functools.partial(lambda f, name, *a: (calls.append(name), f(*a))[1],
                                                       getattr(floor, hook), hook))
            model._forward_pre_hooks.clear(), model._forward_hooks.clear()  # (the hooks as bound above)
            model.register_forward_pre_hook(floor._forward), model.register_forward_hook(floor._output)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        for _ in range(2):
            with bench.OpCounter() as counter:
                if floor is None:
                    base.zero_grad()
                    mse(model(x), y).backward()
                    base.step()
                else:
                    floor.train_step(x, y, mse)
        counts.append((counter.ops, counter.copy_bytes / weights, len(base.param_groups)))
        assert floor is None or calls == ["_forward", "_backward", "_end"] * 2, label
    (plain, hooks, views, spare, rewrite, update, t1) = counts
    assert hooks == plain and plain[1:] == (0, 1)
    assert views == (plain[0] + 2, 2, 1) and spare == (views[0], 2, 1)
    assert rewrite == (spare[0] + 1, 2, 1) and update == (rewrite[0] + 2, 2, 1) and t1 == (update[0], 2, 3)


def test_ladder_floor_refuses_unknown_pieces(bench):
    model = mlp()
    with pytest.raises(ValueError, match="t3"):
        bench.PipemareFloor(model, torch.optim.SGD(model.parameters(), lr=0.1), staleopt.partition_model(model, 3),
                            schedules.get("dataflow").delays(3, 1)[0], without=("t1", "t3"))


def test_hooks_rung_trains_as_the_plain_loop(bench):
    model, plain = mlp(), mlp()
    floor = bench.HooksFloor(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             staleopt.partition_model(model, 3), schedules.get("dataflow").delays(3, 1)[0])
    base = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(6):
        floor.train_step(x, y, mse)
        base.zero_grad()
        mse(plain(x), y).backward()
        base.step()
    assert torch.equal(_flat(model), _flat(plain))


def test_hooks_rung_allocates_no_rows(bench):
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    args = (staleopt.partition_model(model, 3), schedules.get("dataflow").delays(3, 1)[0])
    before = bench._storages()
    floor = bench.HooksFloor(model, base, *args)
    assert floor.rows == [] and bench.new_storage_bytes(before) == 0
    before = bench._storages()
    moving = bench.DataMovementFloor(model, base, *args)  # (the rung above it keeps tau rows per parameter)
    assert bench.new_storage_bytes(before) > 0
    del floor, moving


def test_new_storage_bytes_counts_allocated_tensors(bench):
    before = bench._storages()
    kept = [torch.empty(1000, dtype=torch.float64), torch.empty(10, dtype=torch.float32)]
    view = kept[0][:10]  # a view shares its storage: counted once
    assert bench.new_storage_bytes(before) == 8000 + 40
    del kept, view


def test_a_storage_freed_after_the_baseline_hides_no_new_one(bench):
    """A garbage tensor (in a reference cycle) alive at the baseline and collected afterwards: a tensor of its size
    allocated then is counted (the baseline holds what it saw, so the new one cannot take its address; before,
    one run in about fifteen of this file counted 40 bytes instead of 8040)."""
    import gc
    for _ in range(20):
        cycle = [torch.empty(1000, dtype=torch.float64)]
        cycle.append(cycle)
        garbage = cycle[0].data_ptr()
        del cycle
        before = bench._storages()
        gc.collect()
        new = torch.empty(1000, dtype=torch.float64)
        assert new.data_ptr() != garbage and bench.new_storage_bytes(before) == 8000
        del new, before


def test_engine_clock_times_the_end_of_backward_callback(bench, monkeypatch):
    """The end-of-backward callback (``_on_backward_end``, which restores ``w_t``) counts as engine time:
    made to spin 20 ms of this thread's CPU time, the engine time per step grows by at least that."""
    def spin(self):
        t = bench.clock()
        while bench.clock() - t < 0.02:
            pass
        return original(self)

    original = staleopt.PipelineOptimizer._on_backward_end
    monkeypatch.setattr(staleopt.PipelineOptimizer, "_on_backward_end", spin)
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = staleopt.PipelineOptimizer(model, base, stages=3, schedule="pipedream")
    clock = bench.EngineClock(opt, base)
    for x, y in batches(2):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    assert clock.seconds >= 2 * 0.02
    clock.remove()


def test_engine_counts_the_moves_and_ops_a_simulator_adds(bench):
    """The counts per step against the plain step: dataflow moves its delayed weights twice (its forward points
    at w_(t-H)'s row, its backward writes w_t over it, push copies w_t there again at step()), three times in
    memory="fast" (w_(t-H) copied into the spare row it points at, then w_t, then push); the plain variant adds
    nothing to itself."""
    spec = bench.QUICK["cnn1d"]
    x, y = spec.batch_of()
    plain = bench.Variant("plain", spec, 3, x, y, "plain")
    minimal = bench.Variant("dataflow", spec, 3, x, y, "staleopt", "dataflow")
    fast = bench.Variant("fast", spec, 3, x, y, "staleopt", "dataflow", memory="fast")
    delayed = sum(v.numel * 4 for v in minimal.opt.chunks if v.H) / sum(p.numel() * 4 for p in minimal.model.parameters())
    assert bench.engine_counts(plain, plain) == (0, 0)
    ops, copies = bench.engine_counts(minimal, plain)
    assert ops > 0 and copies == pytest.approx(2 * delayed)
    assert bench.engine_counts(fast, plain)[1] == pytest.approx(3 * delayed)
    for v in (plain, minimal, fast):
        v.release()


def test_quick_run_writes_tables_and_plot(bench, tmp_path):
    assert bench.main(["--quick", "--out", str(tmp_path), "--models", "cnn1d", "--rounds", "1"]) == 0
    for name in ("step.csv", "memory.csv", "handrolled.csv", "recompute.csv", "growth.csv", "growth.png",
                 "budget.csv", "meta.json"):
        assert (tmp_path / name).is_file(), name
    from staleopt.machine import cpu_name, source_commit
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["cpu"] == cpu_name() != ""  # (docs/performance.md)
    assert meta["commit"] == source_commit()  # (the code the run measured)
    assert meta["device"] == "cpu" and meta["clock"] == "thread CPU time"
    ladder = pd.read_csv(tmp_path / "budget.csv")
    assert list(ladder.rung) == [label for label, _ in bench.LADDER] + ["the wrapper: pipemare"]
    assert (ladder.ratio > 0).all() and (ladder.ratio_q1 <= ladder.ratio).all() and (ladder.ratio <= ladder.ratio_q3).all()
    step = pd.read_csv(tmp_path / "step.csv")
    assert set(step.variant) == {"pipemare", "pipedream", "pipeoptim", "dataflow", "dataflow (memory=fast)",
                                 "pipedream (memory=fast)", "hand-rolled dataflow", "hand-rolled pipedream",
                                 "floor dataflow", "floor pipemare"}
    assert (step.engine_ms >= 0).all() and (step.ratio > 0).all()
    wrapped = step[~step.variant.str.startswith(("hand-rolled", "floor"))]
    assert (wrapped.engine_ops > 0).all() and (wrapped.engine_copies > 0).all()
    mem = pd.read_csv(tmp_path / "memory.csv")
    assert (mem.measured_bytes == mem.engine_reported_bytes).all()  # the engine's account is what it allocated
    assert (mem.measured_bytes >= mem.minimum_bytes).all()
    exact = mem[mem.method.isin(["pipedream", "pipeoptim", "dataflow"])]
    assert (exact.measured_bytes == exact.minimum_bytes).all()
    hand = pd.read_csv(tmp_path / "handrolled.csv")
    assert (hand.max_abs_weight_diff == 0).all() and (hand.memory_ratio > 1).all()
    floors = step[step.variant.str.startswith("floor")]
    assert len(floors) == 2 and (floors.floor_weight_diff == 0).all() and step.floor_weight_diff.isna().sum() == 8
    floor = hand[hand.simulation == "dataflow"]  # (the hand-rolled deque and the engine against the same floor)
    assert (floor.floor_engine_ms >= 0).all() and (floor.over_floor > 0).all()
    fast = mem[mem.method.str.endswith("(memory=fast)")]  # one more version per delayed stage
    assert len(fast) == 2 and (fast.measured_bytes > fast.minimum_bytes).all() and (hand.fast_engine_ms >= 0).all()
    growth = pd.read_csv(tmp_path / "growth.csv")
    assert set(growth.axis) == {"stages", "width", "size"}  # (size: a GPT language model)
    size = growth[growth.axis == "size"]
    assert len(size) == 1 and size.model.iloc[0].startswith("GPT") and (size.dataflow_engine_ms > 0).all()
    stages = growth[growth.axis == "stages"].sort_values("value")
    assert stages.dataflow_bytes.is_monotonic_increasing
    assert (growth.dataflow_bytes == growth.dataflow_minimum_bytes).all()
    check_recompute_table(bench, pd.read_csv(tmp_path / "recompute.csv"))
    # the docs' tables come from these CSVs (experiments/bench_markdown.py): one row per shown variant
    md = load("bench_markdown")
    assert md.main([str(tmp_path)]) == 0
    assert md.step_table(step).count("\n| cnn1d (9) |") == 2
    assert md.growth_table(growth).count("\n| size | 32 | 4 |") == 1
    goals = pd.read_csv(tmp_path / "goals.csv")  # the engine's, on the engine-bound ResNet-20 (absent with --models cnn1d)
    assert md.goals_table(goals).startswith("| goal | target | measured | met |")
    assert md.budget_table(ladder).count("\n| ") == len(bench.LADDER) + 1  # (the rungs, the wrapper)
    table = md.recompute_table(pd.read_csv(tmp_path / "recompute.csv")).splitlines()
    assert len(table) == 2 + 6 and all(line.count("|") == 10 for line in table)
    assert [line.split(" | ")[1] for line in table[2:]] == [label for label, _, _ in bench.RECOMPUTE] * 2


def check_recompute_table(bench, rec: pd.DataFrame) -> None:
    """Table 8: (a), (b), (c) for both ResNet-20 settings at the max P, with the dataflow-recompute segments."""
    assert list(rec.model) == ["resnet20-tiny"] * 3 + ["resnet20"] * 3
    assert list(rec.checkpoint) == ["none", "torch.utils.checkpoint", "opt.checkpoint"] * 2
    assert list(rec.method) == ["pipemare", "pipemare", "pipemare-recompute"] * 2
    P = staleopt.models.num_units("resnet20")
    assert (rec.stages == P).all()
    segments = " ".join(f"{a}-{b}" for a, b in schedules.get("dataflow-recompute").segments(P))
    assert (rec.segments == segments).all()
    timed = ["step_ms", "ratio_plain", "ratio_a", "ratio_b", "engine_ms", "engine_min_ms"]
    assert rec[timed].notna().all().all() and (rec[timed] > 0).all().all()
    for q in ("plain", "a", "b"):
        assert (rec[f"ratio_{q}_q1"] <= rec[f"ratio_{q}"]).all() and (rec[f"ratio_{q}"] <= rec[f"ratio_{q}_q3"]).all()
    schedule = schedules.get("dataflow-recompute")
    (fwd, _), recomp = schedule.delays(P, 1), schedule.recompute_delays(P)
    for key, g in rec.groupby("model", sort=False):
        a, b, c = (g.iloc[k] for k in range(3))
        assert a.ratio_a == 1 and b.ratio_b == 1
        assert (a.recompute_engine_ms, b.recompute_engine_ms) == (0, 0) and c.recompute_engine_ms >= 0
        assert b.probes_ms > 0 and a.probes_ms == c.probes_ms == 0
        # memory: exact, what the engine reports, its documented minimum plus T2's free slot (as in table 2)
        assert (g.measured_bytes == g.memory_bytes).all()
        assert a.memory_bytes == b.memory_bytes and a.history_bytes == c.history_bytes  # same tau_fwd, tau_bkwd
        assert len(set(g.memory_bytes - g.minimum_bytes)) == 1
        # T2's causal accumulator: the recompute view reads delta_(t - tau_recomp), so T2 keeps tau_recomp_i more
        # rows of |w_i| at each stage recomputed ahead of its forward's view (tau_bkwd = 0 < tau_recomp < tau_fwd;
        # the last segment recomputes in its forward's slot, tau_recomp = tau_fwd, and reads no delta)
        part = staleopt.partition_model(bench.QUICK[key].build(), P)
        ahead = sum(recomp[s.index] * s.nbytes for s in part if recomp[s.index] < fwd[s.index])
        assert c.memory_bytes - a.memory_bytes == ahead > 0


def test_source_commit_names_the_checkouts_head():
    """The commit a benchmark's meta.json records is this checkout's HEAD (``+changes`` where a tracked file was
    edited); outside a git checkout, nothing."""
    import shutil
    import subprocess

    from staleopt import machine
    root = Path(machine.__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        assert machine.source_commit() is None
        return
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert machine.source_commit() == head + ("+changes" if changed else "")


def test_device_option_refuses_what_it_cannot_run_on(bench, tmp_path):
    """``--device`` takes cpu or cuda[:N]; a device this torch cannot use stops the run with the reason before
    anything is measured (argparse: exit status 2)."""
    wrong = ["tpu", "not-a-device"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in wrong:
        with pytest.raises(SystemExit) as e:
            bench.main(["--quick", "--out", str(tmp_path / device), "--device", device])
        assert e.value.code == 2 and not (tmp_path / device).exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_run_on_cuda(bench, tmp_path):
    """The benchmark on a GPU: models, batches and history on it, durations between synchronizations."""
    assert bench.main(["--quick", "--out", str(tmp_path), "--models", "cnn1d", "--rounds", "1", "--device",
                       "cuda", "--no-growth"]) == 0
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["device"].startswith("cuda") and meta["clock"] == "wall time between CUDA synchronizations"
    assert (pd.read_csv(tmp_path / "step.csv").engine_ms > 0).all()
