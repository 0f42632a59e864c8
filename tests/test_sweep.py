"""Sweeps: config hashing and validation, sweep files, kill -9 and resume, shards, summaries, CLI."""
import functools
import json
import os
import re
import random
import shutil
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import staleopt.train
from staleopt import sweep
from staleopt.cli import main
from staleopt.config import RunConfig
from staleopt.errors import ConfigError, SweepConfigError

from helpers import PATIENCE, sweep_killed_after_first_run, wait_for

REPO = Path(__file__).resolve().parents[1]


def fake_train(config, progress=False):
    """A deterministic stand-in for staleopt.train.run: records are a function of the run id only.

    ``$FAKE_LOG`` collects the run ids it was called with, ``$FAKE_PIDS`` the process ids it ran in (a run
    waits there until ``$FAKE_PROCESSES`` processes have started one);
    ``$FAKE_SLEEP`` seconds pass per run; after ``$FAKE_STALL`` runs in one process, a run waits until the
    process is killed (an event for the kill tests to wait on, instead of a race with a run's duration);
    method ``pb`` "diverges" after its first epoch.
    """
    if os.environ.get("FAKE_LOG"):
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(config.run_id() + "\n")
    if os.environ.get("FAKE_PIDS"):
        with open(os.environ["FAKE_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
        while len(set(open(os.environ["FAKE_PIDS"]).read().split())) < int(os.environ.get("FAKE_PROCESSES", "0")):
            time.sleep(0.05)
    fake_train.calls = getattr(fake_train, "calls", 0) + 1
    while os.environ.get("FAKE_STALL") and fake_train.calls > int(os.environ["FAKE_STALL"]):
        time.sleep(1)
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
    rng = random.Random(config.run_id())
    rows = []
    for epoch in range(1, config.epochs + 1):
        diverged = config.method == "pb" and epoch == 2
        rows.append({"epoch": epoch, "step": 10 * epoch, "train_loss": float("nan") if diverged else rng.random(),
                     "test_acc": rng.random(), "wall_time": 0.25 * epoch,
                     "status": "diverged" if diverged else "ok"})
        if diverged:
            break
    return pd.DataFrame(rows)


@functools.wraps(fake_train)  # (the runs it finishes are fake_train's: a relaunch with fake_train keeps them)
def broken_train(config, progress=False):
    if config.stages == 2:
        raise RuntimeError("boom")
    return fake_train(config, progress)


SWEEP = """\
name = "tiny"
[base]
model = "mlp"
data = "synthetic"
epochs = 3
[grid]
method = ["gpipe", "1f1b"]
stages = [1, 2]
seed = [0]
"""


def _write(tmp_path, text=SWEEP, name="sweep.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------- configs

def test_run_id_is_stable_under_equivalent_spellings():
    a = RunConfig(lr=1, model_kwargs={"width": 2, "depth": 14})
    b = RunConfig.from_dict({"model_kwargs": {"depth": 14, "width": 2}, "lr": 1.0})
    assert a.run_id() == b.run_id() and a.lr == 1.0 and isinstance(a.lr, float)
    assert RunConfig(seed=1).run_id() != RunConfig(seed=0).run_id()
    assert RunConfig.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    assert a.replace(seed=5).seed == 5 and a.replace(seed=5).model_kwargs == a.model_kwargs
    assert list(a.to_dict()) == sorted(a.to_dict())


def test_one_run_written_two_ways_is_refused_before_training(tmp_path):
    """An option written at its default gives the run another id (it pins the option if the default changes), so a
    sweep holding both spellings trained the same model twice, a line each in the tables: refused, naming both."""
    base = {"model": "mlp", "data": "synthetic", "method": "gpipe", "stages": 1, "epochs": 1}
    a, b = RunConfig(**base), RunConfig(**base, model_kwargs={"hidden": 128}, data_kwargs={"noise": 1.0})
    assert a.run_id() != b.run_id()
    with pytest.raises(ConfigError, match=rf"{a.run_id()} and {b.run_id()} are one run written two ways: "
                                          r"\{'hidden': 128, 'noise': 1.0\} are the defaults"):
        sweep.run_sweep([a, b], tmp_path / "out", bar=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(SweepConfigError, match=r"one run written two ways: \{'hidden': 128\} is the default"):
        sweep.from_spec({"base": base, "grid": {"model_kwargs": [{}, {"hidden": 128}]}}, source="s.toml")
    # a folder that holds the run written one way: a later sweep of the other spelling is refused before training
    sweep.run_sweep([RunConfig(**{**base, "data_kwargs": {"num_samples": 64}})], tmp_path / "out", bar=False)
    (tmp_path / "out" / "runs" / "x").mkdir()  # (a run of a model that no longer loads is not compared)
    (tmp_path / "out" / "runs" / "x" / "config.json").write_text(json.dumps({**a.to_dict(), "model": "gone.py:f"}))
    before = sorted(p.name for p in (tmp_path / "out" / "runs").iterdir())
    with pytest.raises(ConfigError, match=r"one run written two ways: \{'hidden': 128\} is the default"):
        sweep.run_sweep([RunConfig(**{**base, "data_kwargs": {"num_samples": 64}, "model_kwargs": {"hidden": 128}}),
                         RunConfig(**{**base, "data_kwargs": {"num_samples": 64}, "seed": 1})], tmp_path / "out",
                        bar=False)
    assert sorted(p.name for p in (tmp_path / "out" / "runs").iterdir()) == before
    other = RunConfig(**base, model_kwargs={"hidden": 64})  # not the default: two runs
    assert len(sweep.from_spec({"base": base, "grid": {"model_kwargs": [{}, {"hidden": 64}]}}).configs) == 2
    sweep.expand(base, {"seed": [0, 1]})  # (distinct runs pass)
    assert other.run_id() not in (a.run_id(), b.run_id())


def test_method_overrides_keep_only_what_the_method_takes():
    from staleopt import methods
    cfg = RunConfig(method="pipemare-w", anneal_steps=50, decay=0.5, pipelined_steps=9)
    assert cfg.method_overrides() == {"anneal_steps": 50, "decay": 0.5}
    schedule, corrections = methods.resolve(cfg.method, **cfg.method_overrides())
    assert schedule.name == "dataflow" and len(corrections) == 3
    assert RunConfig(method="gpipe", decay=0.5).method_overrides() == {}
    assert RunConfig(method="pb-hybrid", pipelined_steps=7).method_overrides() == {"pipelined_steps": 7}


def test_stages_max_resolves_to_the_unit_count():
    assert RunConfig(model="resnet1d", stages="max").resolve().stages == 39
    assert RunConfig(model="resnet1d", model_kwargs={"depth": 14}, stages="max").resolve().stages == 27
    with pytest.raises(ConfigError, match="stages = 4 exceeds the 3 parametrized operators"):
        RunConfig(model="mlp", stages=4).resolve()


@pytest.mark.parametrize("kwargs, message", [
    ({"lrr": 0.1}, "unknown config key 'lrr' \\(did you mean 'lr'\\?\\); allowed keys: model, model_kwargs"),
    ({"optimizer": "sgdm"}, "optimizer = 'sgdm' is not allowed.*allowed values: sgd, sgd-momentum, adam, adamw"),
    ({"method": "pipemar"}, "method = 'pipemar' is not allowed.*allowed values: .*gpipe"),
    ({"lr": -1.0}, "lr = -1.0 must lie in \\(0.0, inf\\)"),
    ({"epochs": 2.5}, "epochs = 2.5 must be an int >= 1"),
    ({"stages": True}, "stages = True must be an int"),
    ({"batch_size": 64, "microbatches": 5}, "microbatches = 5 must divide batch_size = 64"),
    ({"model_kwargs": {"depht": 3}}, "has unknown option 'depht'; allowed: depth, width"),
    ({"data_kwargs": {"samples": 3}}, "data_kwargs.*unknown option 'samples'.*num_samples"),
    ({"lr_milestones": [5, 3]}, "strictly increasing"),
    ({"device": "gpu0"}, "not a torch device"),
])
def test_bad_config_values_name_the_key_and_the_allowed_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(kwargs)


# --------------------------------------------------------------------------------- sweep files

def test_sweep_file_expands_the_grid_in_order(tmp_path):
    spec = sweep.load_sweep(_write(tmp_path))
    assert spec.name == "tiny" and len(spec.configs) == 4
    assert [(c.method, c.stages) for c in spec.configs] == [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("1f1b", 2)]
    assert all(c.model == "mlp" and c.epochs == 3 for c in spec.configs)
    dup = _write(tmp_path, SWEEP.replace("stages = [1, 2]", 'stages = [3, "max"]'), "dup.toml")
    assert [c.stages for c in sweep.load_sweep(dup).configs] == [3, 3]  # "max" == 3: one run each


@pytest.mark.parametrize("text, message", [
    ("[base]\nmodel='mlp'\n[grids]\nseed=[0]\n", "unknown top-level key 'grids'; allowed keys: name, description, base, grid"),
    ("[base]\nmodle='mlp'\n", r"\[base\] modle: unknown config key 'modle'; allowed keys: model, model_kwargs"),
    ("[grid]\nmethod=['gpipe','pipemar']\n", r"\[grid\] method\[1\]: method = 'pipemar' is not allowed.*allowed values:.*gpipe"),
    ("[grid]\noptimizer=['sgd','adamm']\n", r"\[grid\] optimizer\[1\].*allowed values: sgd, sgd-momentum, adam, adamw"),
    ("[grid]\nseed=3\n", r"\[grid\] seed: grid values must be a non-empty list"),
    ("[base]\nseed=1\n[grid]\nseed=[0]\n", r"\['seed'\] appear in both \[base\] and \[grid\]"),
    ("[base]\nmodel='mlp'\n[grid]\nstages=[1, 8]\n", "stages = 8 exceeds the 3 parametrized operators"),
    ("[base\n", "not valid TOML"),
    ("[grid]\nseed=[0, 1, 0]\n", r"\[grid\] seed\[2\]: 0 is already in the grid's seed list; give each value once"),
])
def test_bad_sweep_files_name_the_bad_key_and_the_allowed_values(tmp_path, text, message):
    with pytest.raises(SweepConfigError, match=message):
        sweep.load_sweep(_write(tmp_path, text))


# --------------------------------------------------------------------------------- running

def _records(sweep_dir):
    return sweep.collect(sweep_dir).sort_values(["run", "epoch"], ignore_index=True)


def test_killed_sweep_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    path = _write(tmp_path)
    killed, log = tmp_path / "killed", tmp_path / "calls.log"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "FAKE_STALL": "1",
           "FAKE_LOG": str(log)}
    sweep_killed_after_first_run(path, killed, ["--train-fn", "test_sweep:fake_train"], env)  # run 2 in flight

    states = sweep.runs(killed)["state"].tolist()
    assert states.count("done") == 1 and len(states) - states.count("done") <= 1, states
    first_done = sweep.runs(killed).query("state == 'done'")["run"].item()
    before = log.read_text().split()
    assert before[0] == first_done

    monkeypatch.setenv("FAKE_LOG", str(log))
    report = sweep.run_sweep(path, killed, train_fn=fake_train, bar=False)
    monkeypatch.delenv("FAKE_LOG")
    assert report.skipped == [first_done] and len(report.finished) == 3 and report.ok
    resumed_calls = log.read_text().split()[len(before):]
    assert first_done not in resumed_calls and len(resumed_calls) == 3

    clean = tmp_path / "clean"
    sweep.run_sweep(path, clean, train_fn=fake_train, bar=False)
    pd.testing.assert_frame_equal(_records(killed), _records(clean))
    assert set(sweep.runs(killed)["state"]) == {"done"} and len(_records(clean)) == 4 * 3
    again = sweep.run_sweep(path, clean, train_fn=fake_train, bar=False)
    assert len(again.skipped) == 4 and not again.finished


def test_process_pool_gives_the_same_records(tmp_path):
    path = _write(tmp_path)
    sweep.run_sweep(path, tmp_path / "serial", train_fn=fake_train, bar=False)
    report = sweep.run_sweep(path, tmp_path / "pool", workers=2, train_fn="test_sweep:fake_train", bar=False)
    assert report.ok and len(report.finished) == 4
    pd.testing.assert_frame_equal(_records(tmp_path / "serial"), _records(tmp_path / "pool"))


def _alive(pid):
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_a_killed_launch_leaves_no_worker_training(tmp_path, signame):
    """SIGTERM stops the pool's workers at once; after SIGKILL each worker sees its launch gone and exits."""
    import signal
    import subprocess

    pids = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-m", "staleopt.cli", "sweep", str(_write(tmp_path)), "--out",
                             str(tmp_path / "s"), "--no-bar", "--workers", "2", "--train-fn", "test_sweep:fake_train"],
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
                                 "FAKE_STALL": "0", "FAKE_PIDS": str(pids)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []

    def started():
        nonlocal workers
        workers = [int(p) for p in pids.read_text().split()] if pids.exists() else []
        return len(workers) >= 2
    try:
        wait_for(started, "two workers training", proc, poll=0.05)
        os.kill(proc.pid, getattr(signal, signame))
        proc.wait(timeout=PATIENCE)
        # the runs never end on their own (FAKE_STALL): a worker that exits does so because its launch died
        wait_for(lambda: not any(_alive(w) for w in workers), "exit of the workers after the launch died", poll=0.05)
        assert len(list((tmp_path / "s" / "runs").glob("*/done"))) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_records_round_trip_exactly_and_carry_the_config(tmp_path):
    spec = sweep.load_sweep(_write(tmp_path))
    sweep.run_sweep(spec, tmp_path / "s", train_fn=fake_train, bar=False)
    rec = sweep.collect(tmp_path / "s")
    cfg = spec.configs[3]
    mine = rec[rec.run == cfg.run_id()].reset_index(drop=True)
    want = fake_train(cfg)
    pd.testing.assert_frame_equal(mine[list(want.columns)], want)  # floats read back bit-exactly
    assert (mine.method == "1f1b").all() and (mine.stages == 2).all() and (mine.model_kwargs == "{}").all()
    saved = json.loads((tmp_path / "s" / "runs" / cfg.run_id() / "config.json").read_text())
    assert RunConfig.from_dict(saved).run_id() == cfg.run_id()


def test_failed_runs_are_recorded_and_retried(tmp_path, capsys):
    path = _write(tmp_path)
    report = sweep.run_sweep(path, tmp_path / "s", train_fn=broken_train, bar=False)
    assert not report.ok and len(report.failed) == 2 and len(report.finished) == 2
    failed = sweep.runs(tmp_path / "s").query("state == 'failed'")
    assert len(failed) == 2 and (failed.stages == 2).all()
    assert "RuntimeError: boom" in (tmp_path / "s" / "runs" / failed.run.iloc[0] / "error.txt").read_text()
    assert len(sweep.collect(tmp_path / "s").run.unique()) == 2
    assert main(["results", str(tmp_path / "s")]) == 1  # it says the failed runs are missing from its table
    err = capsys.readouterr().err
    assert "2 run(s) failed" in err and failed.run.iloc[0] in err and "the summary is over the runs that finished" in err
    retry = sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    assert sorted(retry.finished) == sorted(failed.run) and len(retry.skipped) == 2
    assert not (tmp_path / "s" / "runs" / failed.run.iloc[0] / "error.txt").exists()
    assert main(["results", str(tmp_path / "s")]) == 0 and "failed" not in capsys.readouterr().err


def broken_real_train(config, progress=False):
    if config.stages == 2 and config.seed == 1:
        raise RuntimeError("boom")
    return staleopt.train.run(config, progress)


def test_plot_says_which_runs_failed_and_exits_1(tmp_path, capsys):
    spec = sweep.from_spec({"name": "p", "base": {"model": "mlp", "data": "synthetic", "epochs": 1},
                            "grid": {"method": ["gpipe"], "stages": [1, 2], "seed": [0, 1]}})
    sweep.run_sweep(spec, tmp_path / "s", train_fn=broken_real_train, bar=False)
    assert main(["plot", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert "1 run(s) failed" in err and "the figure is over the runs that finished" in err
    assert (tmp_path / "s" / "plots" / "accuracy_vs_stages.png").is_file()  # (drawn all the same)


def test_train_function_must_return_records(tmp_path):
    report = sweep.run_sweep(sweep.load_sweep(_write(tmp_path)).configs[:1], tmp_path / "s",
                             train_fn=lambda c, progress: pd.DataFrame({"epoch": [1]}), bar=False)
    err = next((tmp_path / "s" / "runs").glob("*/error.txt")).read_text()
    assert report.failed and "missing ['step', 'train_loss', 'test_acc', 'status']" in err


# --------------------------------------------------------------------------------- shards

def test_shards_are_disjoint_complete_and_independent_of_grid_order(tmp_path):
    grid = SWEEP.replace("seed = [0]", "seed = [0, 1, 2]")
    configs = sweep.load_sweep(_write(tmp_path, grid)).configs
    reordered = sweep.load_sweep(_write(tmp_path, grid.replace('["gpipe", "1f1b"]', '["1f1b", "gpipe"]'),
                                        "b.toml")).configs
    everything = {c.run_id() for c in configs}
    assert len(everything) == 12
    for n in (1, 2, 3, 5, 12, 13):
        parts = [{c.run_id() for c in sweep.shard(configs, k, n)} for k in range(1, n + 1)]
        assert sum(len(p) for p in parts) == 12 and set().union(*parts) == everything
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
        assert parts == [{c.run_id() for c in sweep.shard(reordered, k, n)} for k in range(1, n + 1)]
    for bad in ("0/3", "4/3", "1-3", "a/b"):
        with pytest.raises(ConfigError, match="--shard"):
            sweep.parse_shard(bad)


def test_shard_option_runs_only_its_slice(tmp_path):
    path = _write(tmp_path)
    args = ["sweep", str(path), "--out", str(tmp_path / "s"), "--train-fn", "test_sweep:fake_train", "--no-bar"]
    sys.path.insert(0, str(REPO / "tests"))
    try:
        assert main(args + ["--shard", "2/3"]) == 0
        two = set(sweep.runs(tmp_path / "s").run)
        assert two == {c.run_id() for c in sweep.shard(sweep.load_sweep(path).configs, 2, 3)}
        assert main(args + ["--shard", "1/3"]) == 0 and main(args + ["--shard", "3/3"]) == 0
    finally:
        sys.path.remove(str(REPO / "tests"))
    assert set(sweep.runs(tmp_path / "s").state) == {"done"} and len(sweep.runs(tmp_path / "s")) == 4


# --------------------------------------------------------------------------------- summaries

def test_t_interval_matches_a_hand_computation():
    # mean 0.85, s = 0.05 (ddof 1), t_{0.975, 2} = 4.302653 (Student t table, 2 degrees of freedom)
    mean, half, n = sweep.t_interval([0.8, 0.9, 0.85])
    assert n == 3 and mean == pytest.approx(0.85, abs=1e-15)
    assert half == pytest.approx(4.302653 * 0.05 / 3 ** 0.5, rel=1e-6)
    # t_{0.95, 4} = 2.131847 for a 90% interval over 5 values 1..5: s = sqrt(2.5)
    assert sweep.t_interval([1, 2, 3, 4, 5], level=0.9)[1] == pytest.approx(2.131847 * 2.5 ** 0.5 / 5 ** 0.5, rel=1e-6)
    assert sweep.t_interval([0.7])[1] != sweep.t_interval([0.7])[1]  # NaN: no interval from one seed
    assert sweep.t_interval([float("nan"), 0.7, 0.9])[2] == 2


def test_accuracy_interval_stays_in_the_unit_interval():
    """A diverged seed (0.0) among good ones: the t-interval over 4 seeds reaches past 1; the summary's does not."""
    from staleopt import stats
    values = [0.0, 0.97, 0.98, 0.99]
    mean, half, _ = sweep.t_interval(values)
    assert mean + half > 1 and mean - half < 0
    assert stats.interval(values) == (mean, 0.0, 1.0, 4, "t")
    assert stats.interval(values, bounds=None)[1:3] == (mean - half, mean + half)
    assert stats.interval([0.1, 0.97, 0.98]) == (pytest.approx(2.05 / 3), 0.1, 0.98, 3, "range")
    assert stats.interval([0.5])[1:] == (0.5, 0.5, 1, "range")


def _hand_records():
    rows = []
    for method, accs in (("gpipe", [(0.5, 0.8), (0.6, 0.9), (0.7, 0.85)]), ("pb", [(0.4, 0.3), (0.2, 0.5), (0.1, 0.1)])):
        for seed, (a1, a2) in enumerate(accs):
            status2 = "diverged" if method == "pb" and seed == 0 else "ok"
            cfg = RunConfig(model="mlp", data="synthetic", method=method, stages=2, seed=seed)
            for epoch, acc, st in ((1, a1, "ok"), (2, a2, status2)):
                rows.append({"run": cfg.run_id(), **sweep._flat(cfg.to_dict()), "epoch": epoch, "step": epoch,
                             "train_loss": 1.0 / epoch, "test_acc": acc, "status": st})
    return pd.DataFrame(rows)


def test_summary_over_seeds_by_hand():
    s = sweep.summarize(_hand_records())
    assert list(s.columns[:2]) == ["method", "stages"] and "seed" not in s.columns and "lr" not in s.columns
    g = s[s.method == "gpipe"].iloc[0]
    assert g.runs == 3 and g.status == "ok" and g.diverged == 0
    assert g.best_acc == pytest.approx(0.85) and g.best_acc_ci == pytest.approx(4.302653 * 0.05 / 3 ** 0.5, rel=1e-6)
    assert g.final_acc == pytest.approx(0.85) and g.final_loss == pytest.approx(0.5)
    assert (g.best_acc_interval, g.best_acc_lo, g.best_acc_hi) == ("range", 0.8, 0.9)  # 3 seeds: their range
    p = s[s.method == "pb"].iloc[0]
    assert p.status == "1/3 diverged" and p.diverged == 1
    assert p.best_acc == pytest.approx((0.4 + 0.5 + 0.1) / 3) and p.final_acc == pytest.approx((0.3 + 0.5 + 0.1) / 3)
    assert len(sweep.summarize(_hand_records(), by=["stages"])) == 1  # methods pooled


def test_results_command_prints_and_writes_csv(tmp_path, capsys):
    path = _write(tmp_path, SWEEP.replace('method = ["gpipe", "1f1b"]', 'method = ["gpipe", "pb"]')
                  .replace("seed = [0]", "seed = [0, 1]"))
    sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    assert main(["results", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "mean [min, max] over 2 seeds" in out and "diverged" in out and "8 runs: 8 done" in out
    summary = pd.read_csv(tmp_path / "s" / "results" / "summary.csv")
    assert not (tmp_path / "s" / "summary.csv").exists()  # the demo's own file is not results'
    assert len(summary) == 4 and set(summary.runs) == {2}
    assert set(summary[summary.method == "pb"].status) == {"diverged"}
    assert len(pd.read_csv(tmp_path / "s" / "results" / "records.csv")) == 2 * 2 * 3 + 2 * 2 * 2  # pb stops at epoch 2
    assert main(["results", str(tmp_path / "nothing")]) == 2
    # time to accuracy: the gpipe runs set the default target; pb's runs never reach 0.99 of anything here
    fast = pd.read_csv(tmp_path / "s" / "results" / "speedup.csv")
    assert "time to accuracy" in out and set(fast.method) == {"gpipe", "pb"} and (fast.runs == 2).all()
    assert (fast[fast.method == "gpipe"].speedup.dropna() == 1.0).all()
    assert main(["results", str(tmp_path / "s"), "--target", "1.0"]) == 0  # reached by no run
    assert (pd.read_csv(tmp_path / "s" / "results" / "speedup.csv").reached == 0).all()
    assert set(pd.read_csv(tmp_path / "s" / "results" / "speedup.csv").target) == {1.0}
    kept = (tmp_path / "s" / "results" / "summary.csv").read_bytes()
    for bad in ("85", "-1"):  # an accuracy lies in [0, 1] (85: a percentage): refused, and no file changes
        assert main(["results", str(tmp_path / "s"), "--target", bad]) == 2
        assert "a target test accuracy lies in [0, 1]" in capsys.readouterr().err
    assert (tmp_path / "s" / "results" / "summary.csv").read_bytes() == kept
    assert main(["results", str(tmp_path / "s"), "--metric", "test_ppl"]) == 2  # the metric of another task
    assert "the records have no test perplexity" in capsys.readouterr().err
    (tmp_path / "s" / "report.json").write_text('{"target": 0.5}')  # the sweep's own target, as the demo writes it
    assert main(["results", str(tmp_path / "s")]) == 0
    assert set(pd.read_csv(tmp_path / "s" / "results" / "speedup.csv").target) == {0.5}
    per_p = pd.read_csv(tmp_path / "s" / "results" / "speedup.csv")
    capsys.readouterr()
    # --by method pools each method's runs over P: the caption counts runs, not seeds, and names the pooled key;
    # the time table stays per configuration (pooled, GPipe's time over all P matched no stage count)
    assert main(["results", str(tmp_path / "s"), "--by", "method"]) == 0
    out = capsys.readouterr().out
    assert "over 4 runs; a row pools its runs over every value of stages" in out and "over 4 seeds" not in out
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "s" / "results" / "speedup.csv"), per_p)


def test_sweep_dry_run_lists_states(tmp_path, capsys):
    path = _write(tmp_path)
    sweep.run_sweep(sweep.load_sweep(path).configs[:1], tmp_path / "s", train_fn=fake_train, bar=False)
    assert main(["sweep", str(path), "--out", str(tmp_path / "s"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [l.split()[1] for l in lines[:4]] == ["done", "pending", "pending", "pending"]
    assert lines[-1].endswith("4 runs in " + str(tmp_path / "s"))
    assert main(["sweep", str(_write(tmp_path, "[grid]\nseed=1\n", "bad.toml"))]) == 2
    (tmp_path / "a_file").write_text("")  # what the launch refuses, the dry run refuses too
    assert main(["sweep", str(path), "--out", str(tmp_path / "a_file"), "--dry-run"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["sweep", str(path), "--out", str(tmp_path / "s"), "--train-fn", "foo", "--dry-run"]) == 2
    assert "'module:function'" in capsys.readouterr().err


def test_summary_rejects_bad_groupings_and_levels_and_keeps_none_apart():
    rows = []
    for run, (anneal, seed) in enumerate([(None, 0), (None, 1), (2, 0), (2, 1)]):
        for epoch in (1, 2):
            rows.append({"run": f"r{run}", "epoch": epoch, "method": "pipemare", "stages": 3, "seed": seed,
                         "anneal_steps": anneal, "test_acc": 0.5 + 0.1 * run, "train_loss": 1.0, "status": "ok"})
    records = pd.DataFrame(rows)
    table = sweep.summarize(records)
    assert len(table) == 2 and list(table["runs"]) == [2, 2]  # None and 2 are different configs, not seeds
    with pytest.raises(ConfigError, match="did you mean 'stages'"):
        sweep.summarize(records, by=["method", "stage"])
    with pytest.raises(ConfigError, match=r"\(0, 1\)"):
        sweep.summarize(records, level=95)


def test_a_list_of_configs_names_each_run_as_a_sweep_file_does(tmp_path, monkeypatch):
    """run_sweep on a Python list resolves stages="max" as a sweep file does: "max" and the unit count it stands
    for are one run (it trained twice, under two run ids, and the records said stages "max", which the plots
    could not read), and a config listed twice runs once; a list of dicts is refused with the fix."""
    log = tmp_path / "log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    base = dict(model="mlp", data="synthetic", epochs=1, method="pipemare")
    units = RunConfig(**base, stages="max").resolve().stages
    configs = [RunConfig(**base, stages="max"), RunConfig(**base, stages=units), RunConfig(**base, stages="max")]
    report = sweep.run_sweep(configs, tmp_path / "out", train_fn=fake_train, bar=False)
    assert report.total == 1 and log.read_text().split() == [RunConfig(**base, stages=units).run_id()]
    assert list(sweep.collect(tmp_path / "out")["stages"]) == [units]
    with pytest.raises(ConfigError, match="list of RunConfig.*RunConfig.from_dict"):
        sweep.run_sweep([dict(base, stages=2)], tmp_path / "dicts", train_fn=fake_train, bar=False)


def test_runs_recorded_before_a_later_field_are_one_configuration_with_the_runs_after(tmp_path):
    """A config.json written before unit_order / lr_warmup_steps existed reads them at their defaults (as its run
    id does): a sweep extended after an upgrade is one configuration per method and P, not two."""
    path = _write(tmp_path)
    sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    first = sorted((tmp_path / "s" / "runs").iterdir())[0] / "config.json"
    old = {k: v for k, v in json.loads(first.read_text()).items() if k not in ("unit_order", "lr_warmup_steps")}
    first.write_text(json.dumps(old))
    records = sweep.collect(tmp_path / "s")
    assert set(records["unit_order"]) == {"registration"} and records["lr_warmup_steps"].isna().all()
    assert "unit_order" not in sweep.varying_keys(records) and "lr_warmup_steps" not in sweep.varying_keys(records)
    assert set(sweep.runs(tmp_path / "s")["unit_order"]) == {"registration"}


def other_train(config, progress=False):
    """Not fake_train: its records differ."""
    return fake_train(config, progress).assign(test_acc=0.01)


def test_a_relaunch_with_another_train_function_is_refused(tmp_path, capsys):
    """A finished run's results are its train function's (recorded in done): a launch with another function into
    the same folder would keep them as its own; it is refused before training anything. The same function (or a
    wrapper that says it is that function, functools.wraps) resumes as before."""
    path = _write(tmp_path)
    sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    done = sorted((tmp_path / "s" / "runs").glob("*/done"))
    assert {json.loads(d.read_text())["train_fn"] for d in done} == {"test_sweep:fake_train"}
    before = {d: d.read_bytes() for d in done}
    with pytest.raises(ConfigError, match="trained by the train function 'test_sweep:fake_train'.*not by this "
                                          "launch's 'test_sweep:other_train'"):
        sweep.run_sweep(path, tmp_path / "s", train_fn=other_train, bar=False)
    assert main(["sweep", str(path), "--out", str(tmp_path / "s"), "--no-bar"]) == 2  # the default train function
    assert "staleopt.train:run" in capsys.readouterr().err
    assert {d: d.read_bytes() for d in done} == before
    assert len(sweep.run_sweep(path, tmp_path / "s", train_fn=broken_train, bar=False).skipped) == len(done)


def checkpointing_crash(config, progress=False, checkpoint=None):
    """A train function that takes a checkpoint: it saves one of its own, then its machine goes down."""
    checkpoint.save({"run_id": config.run_id(), "weights": [1.0]})
    raise RuntimeError("the machine went down")


def checkpointing_train(config, progress=False, checkpoint=None):
    """fake_train with a ``checkpoint`` keyword (it leaves the checkpoint it finds as it is)."""
    return fake_train(config, progress)


def test_a_relaunch_does_not_resume_another_train_functions_checkpoint(tmp_path, capsys):
    """A finished run of another train function was refused, but an unfinished run's checkpoint was resumed by any
    function: its records were half one function's, half the other's. The function is recorded in the run's folder
    (train_fn) before it can write a checkpoint, and a launch with another one is refused the same way."""
    path, out = _write(tmp_path), tmp_path / "s"
    report = sweep.run_sweep(path, out, train_fn=checkpointing_crash, bar=False)
    assert len(report.failed) == 4
    run_dir = out / "runs" / report.failed[0]
    assert (run_dir / "train_fn").read_text() == "test_sweep:checkpointing_crash\n"
    with pytest.raises(ConfigError, match="4 run.* trained by the train function 'test_sweep:checkpointing_crash' "
                                          r"\(run .*checkpointed.*not by this launch's "
                                          "'test_sweep:checkpointing_train'"):
        sweep.run_sweep(path, out, train_fn=checkpointing_train, bar=False)
    assert main(["sweep", str(path), "--out", str(out), "--no-bar"]) == 2  # the default train function
    assert "not by this launch's 'staleopt.train:run'" in capsys.readouterr().err
    assert sweep.run_state(run_dir) == "failed" and (run_dir / "checkpoint.pt").is_file()
    # a launch that got past that check (a race with another launch) fails the run, naming both functions
    options = {"launch": "x", "checkpoint_every": None}
    result = sweep._execute(checkpointing_train, sweep.read_config(run_dir), str(run_dir), False, options)
    assert result[1] == "failed" and "CheckpointError" in (run_dir / "error.txt").read_text()
    assert "written by the train function 'test_sweep:checkpointing_crash'" in (run_dir / "error.txt").read_text()
    # a function without checkpoints resumes none: it may train the runs
    shutil.copytree(out, tmp_path / "copy")
    assert len(sweep.run_sweep(path, tmp_path / "copy", train_fn=fake_train, bar=False).finished) == 4
    # a run whose checkpoint predates the record resumes as before
    (run_dir / "train_fn").unlink()
    assert sweep._execute(checkpointing_train, sweep.read_config(run_dir), str(run_dir), False, options)[1] == "ok"


def test_checkpoint_options_are_refused_for_a_train_function_without_checkpoints(tmp_path, capsys):
    """--checkpoint-every and --keep-checkpoints were dropped without a word for a train function that takes no
    checkpoint: no checkpoint was written, so a killed run started over from step 0."""
    path, out = _write(tmp_path), tmp_path / "s"
    for options in (dict(checkpoint_every=5), dict(keep_checkpoints=True)):
        with pytest.raises(ConfigError, match="the train function 'test_sweep:fake_train' takes no checkpoint "
                                              "keyword.*checkpoint_every and keep_checkpoints.*do nothing"):
            sweep.run_sweep(path, out, train_fn=fake_train, bar=False, **options)
    assert main(["sweep", str(path), "--out", str(out), "--no-bar", "--train-fn", "test_sweep:fake_train",
                 "--checkpoint-every", "5", "--keep-checkpoints"]) == 2
    assert "--checkpoint-every, --keep-checkpoints" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written
    report = sweep.run_sweep(path, out, train_fn=checkpointing_train, bar=False, checkpoint_every=5,
                             keep_checkpoints=True)
    assert len(report.finished) == 4


def test_results_tells_runs_of_other_thread_counts_apart(tmp_path, capsys):
    """torch's float results depend on the thread count: a run's ``done`` records it, and results says when the
    runs it summarizes were trained under several."""
    path, out = _write(tmp_path), tmp_path / "s"
    sweep.run_sweep(path, out, train_fn=fake_train, bar=False)
    assert main(["results", str(out)]) == 0
    assert "thread counts" not in capsys.readouterr().out
    for i, done in enumerate(sorted((out / "runs").glob("*/done"))):
        done.write_text(json.dumps({**json.loads(done.read_text()), "threads": 1 if i else 2}))
    assert main(["results", str(out)]) == 0
    assert "different torch thread counts (3 under 1, 1 under 2;" in capsys.readouterr().out


def test_results_leaves_no_time_table_of_an_earlier_call_and_groups_by_constant_keys(tmp_path, capsys):
    """A speedup.csv that an earlier --target call wrote is removed when this call has no target (it would not
    match the new summary); --by a key that does not vary is one group per its value, not a crash; --by seed
    is refused (the summary is the mean over seeds), not silently dropped."""
    path = _write(tmp_path)
    sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    results = tmp_path / "s" / "results"
    assert main(["results", str(tmp_path / "s"), "--target", "0.5"]) == 0 and (results / "speedup.csv").is_file()
    records = sweep.collect(tmp_path / "s")
    only_pb = tmp_path / "pb"
    import shutil
    for run in set(records[records["method"] == "1f1b"]["run"]):  # a sweep folder without GPipe: no target
        shutil.copytree(tmp_path / "s" / "runs" / run, only_pb / "runs" / run)
    shutil.copytree(results, only_pb / "results")
    assert main(["results", str(only_pb)]) == 0 and not (only_pb / "results" / "speedup.csv").exists()
    capsys.readouterr()
    assert main(["results", str(tmp_path / "s"), "--by", "lr"]) == 0
    summary = pd.read_csv(results / "summary.csv")
    assert list(summary["lr"]) == [records["lr"].iloc[0]] and summary["runs"].item() == records["run"].nunique()
    for by in ("seed", "seed,method"):
        assert main(["results", str(tmp_path / "s"), "--by", by]) == 2
        assert "cannot group by 'seed'" in capsys.readouterr().err


def _refuse_to_load():
    raise AttributeError("Can't get attribute 'nb_train' on <module '__main__' (<class '_frozen_importlib.BuiltinImporter'>)>")


class _DefinedInANotebook:
    """A train function that pickles in the launch but not in a worker (a notebook's __main__ has no file)."""

    def __call__(self, config, progress=False):
        return fake_train(config, progress)

    def __reduce__(self):
        return _refuse_to_load, ()


def test_a_job_a_worker_cannot_read_fails_with_its_traceback_not_as_a_killed_worker(tmp_path):
    """A factory or train function from a notebook pickles by reference to __main__, which a spawned worker cannot
    resolve: the worker died in recv(), every error.txt blamed kill -9 or the out-of-memory killer and promised a
    resume that fails the same way."""
    path = _write(tmp_path)
    report = sweep.run_sweep(path, tmp_path / "pool", workers=2, train_fn=_DefinedInANotebook(), bar=False)
    assert len(report.failed) == 4 and not report.finished
    for error in (tmp_path / "pool" / "runs").glob("*/error.txt"):
        text = error.read_text()
        assert "could not read this run's job" in text and "Can't get attribute 'nb_train'" in text
        assert "out-of-memory" not in text and "workers=1" in text


def test_a_grid_that_varies_a_key_some_methods_ignore_says_they_train_once_per_value():
    """decay = [0.1, 0.5] over gpipe and pipemare trained gpipe twice (decay enters its run id, though gpipe has no
    T2), identical runs with a line each in the tables, silently: warned, naming the methods."""
    import warnings
    with pytest.warns(UserWarning, match=r"varies decay over \[0.1, 0.5\], which gpipe ignore.*once per value"):
        configs = sweep.expand({"epochs": 1}, {"method": ["gpipe", "pipemare"], "decay": [0.1, 0.5]})
    assert len(configs) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sweep.expand({"epochs": 1}, {"method": ["pipemare", "pipemare-w"], "decay": [0.1, 0.5]})
        sweep.expand({"epochs": 1, "decay": 0.5}, {"method": ["gpipe", "pipemare"]})


def test_results_outputs_are_checked_before_any_file_is_written(tmp_path, capsys):
    """--csv and --records naming a folder or a path in a missing folder, and a file where results/ goes, were raw
    OSErrors, some after results/records.csv had been rewritten; two outputs on one path, or one in a run's folder,
    were written over each other or over the run."""
    path = _write(tmp_path)
    sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    run = next((tmp_path / "s" / "runs").iterdir())
    (tmp_path / "afile").write_text("")
    for extra, says in ((["--csv", str(tmp_path)], "--csv .* is a folder"),
                        (["--records", str(tmp_path / "no" / "r.csv")], "--records .* does not exist"),
                        (["--csv", str(tmp_path / "afile" / "x.csv")], "does not exist \\(or is a file\\)"),
                        # (the summary overwrote the records; a run's own records.csv left the run damaged)
                        (["--csv", str(tmp_path / "x.csv"), "--records", str(tmp_path / "x.csv")],
                         "--csv and --records both write"),
                        (["--records", str(run / "records.csv")], "--records .* is inside .*runs")):
        before = (run / "records.csv").read_bytes()
        assert main(["results", str(tmp_path / "s"), *extra]) == 2
        assert re.search(says, capsys.readouterr().err)
        assert not (tmp_path / "s" / "results").exists() and not (tmp_path / "x.csv").exists()
        assert (run / "records.csv").read_bytes() == before
    (tmp_path / "s" / "results").mkdir()  # (a collision with a default path named "--records", not given)
    assert main(["results", str(tmp_path / "s"), "--csv", str(tmp_path / "s" / "results" / "records.csv")]) == 2
    assert "--csv and the records (default) both write" in capsys.readouterr().err
    (tmp_path / "s" / "results").rmdir()
    (tmp_path / "s" / "results").write_text("")
    assert main(["results", str(tmp_path / "s")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_plot_outputs_are_checked_before_drawing(tmp_path, capsys, monkeypatch):
    """An unknown suffix was matplotlib's ValueError after the drawing; a path under a file or a file where
    plots/ goes were raw FileExistsErrors; a folder without suffix wrote ADIR.png and said 'wrote ADIR'."""
    from staleopt.plot import sweep as plots
    path = _write(tmp_path)
    sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    drawn = []
    monkeypatch.setattr(plots, "plot_accuracy_vs_stages", lambda *a, **k: drawn.append(1))
    (tmp_path / "afile").write_text("")
    for out, says in ((tmp_path / "x.unknownext", "suffix names the image format"),
                      (tmp_path / "afile" / "x.png", "does not exist \\(or is a file\\)"),
                      (tmp_path, "suffix names the image format")):
        assert main(["plot", str(tmp_path / "s"), "--out", str(out)]) == 2
        assert re.search(says, capsys.readouterr().err)
    (tmp_path / "s" / "plots").write_text("")
    assert main(["plot", str(tmp_path / "s")]) == 2
    assert "is a file" in capsys.readouterr().err and not drawn


def test_results_totals_count_a_run_whose_config_is_missing(tmp_path, capsys):
    """A run folder with its done marker and records but no config.json was reported as damaged and then left out
    of the totals ("skipped a damaged run" above "2 runs: 2 done" for three folders)."""
    path = _write(tmp_path)
    sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    first = sorted((tmp_path / "s" / "runs").iterdir())[0]
    (first / "config.json").unlink()
    main(["results", str(tmp_path / "s")])
    out = capsys.readouterr()
    n = len(list((tmp_path / "s" / "runs").iterdir()))
    assert "skipped a damaged run" in out.err and f"{n} runs: 1 damaged, {n - 1} done" in out.out


def test_the_plot_functions_read_a_sweep_folders_target(tmp_path):
    """plot_accuracy_vs_stages(DIR) and plot_accuracy_vs_time(DIR, P) drew GPipe's best minus 0.01 where the
    folder's report (and its speedup.csv, and `staleopt plot`) holds another target: figure against table."""
    import warnings

    from staleopt.plot import sweep as plots
    out = tmp_path / "s"
    sweep.run_sweep(_write(tmp_path), out, train_fn=fake_train, bar=False)
    (out / "report.json").write_text(json.dumps({"target": 0.3, "metric": "test_acc"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stages = plots.plot_accuracy_vs_stages(out)
        time = plots.plot_accuracy_vs_time(out, 2)
    assert any("0.300" in ax.get_ylabel() for ax in stages.axes)
    assert [line.get_ydata()[0] for line in time.axes[0].get_lines() if line.get_label().startswith("target")] == [0.3]


def test_speedup_table_keeps_the_configurations_a_sweep_varies_apart(tmp_path):
    """speedup_table(records, target), the Python form of results' time table, pooled a sweep's two learning rates
    into one row per method and P (a mean over both), where results, the figures and summarize keep them apart."""
    from staleopt import speedup
    text = SWEEP.replace("stages = [1, 2]", "stages = [2]\nlr = [0.1, 0.02]")
    sweep.run_sweep(_write(tmp_path, text), tmp_path / "s", train_fn=fake_train, bar=False)
    table = speedup.speedup_table(sweep.collect(tmp_path / "s"), 0.0)
    assert list(table.columns[:3]) == ["method", "lr", "stages"] and len(table) == 4
    assert (table["runs"] == 1).all()
