"""Checkpoints: a run resumed from any step has the records of the uninterrupted run, in process and after kill -9."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from staleopt import data, sweep, train
from staleopt.checkpoint import Checkpoint, atomic_write_bytes, read as read_checkpoint
from staleopt.cli import main
from staleopt.config import RunConfig
from staleopt.errors import CheckpointError

from helpers import wait_for

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(model="mlp", model_kwargs={"depth": 3, "hidden": 16}, data="synthetic",
             data_kwargs={"num_samples": 250, "input_shape": [1, 8], "num_classes": 4, "separation": 0.5},
             batch_size=16, epochs=3, lr=0.05)  # 12 steps per epoch


def cfg(**kw):
    return RunConfig(**{**SMALL, **kw})


class Interrupted(Exception):
    pass


def interrupted_run(config, path, every, saves):
    """Run ``config`` checkpointing into ``path`` and stop it (as a crash would) right after its ``saves``-th save."""
    ckpt = Checkpoint(path, every=every)
    save, count = ckpt.save, []

    def counting(state):
        save(state)
        count.append(1)
        if len(count) == saves:
            raise Interrupted
    ckpt.save = counting
    with pytest.raises(Interrupted):
        train.run(config, checkpoint=ckpt)
    return read_checkpoint(path)


def same_records(a, b):
    pd.testing.assert_frame_equal(a.drop(columns="wall_time"), b.drop(columns="wall_time"))


@pytest.mark.parametrize("kw, every, saves", [
    (dict(method="pipemare", stages=3), 5, 3),  # T1 + T2 state, mid-epoch (step 15 of epoch 2)
    (dict(method="pipemare", stages=3), None, 1),  # at an epoch end
    (dict(method="hogwild", stages=3, optimizer="adam", lr=0.01), 7, 4),  # random delays, Adam moments
    (dict(method="pipedream", stages="max", lr_schedule="step", lr_milestones=[2], lr_gamma=0.5,
          weight_decay=1e-3), 12, 2),  # stashed versions, lr scheduler; step 24 = an epoch end
    (dict(model="resnet1d", model_kwargs={"depth": 8}, data_kwargs={"num_samples": 100, "input_shape": [1, 40],
          "num_classes": 4}, method="1f1b", stages=4, batch_size=8, epochs=2), 3, 2),  # BatchNorm statistics
])
def test_a_resumed_run_has_the_uninterrupted_records(tmp_path, kw, every, saves):
    c = cfg(**kw)
    plain = train.run(c)  # never checkpointed: saving must not change the run either
    path = tmp_path / "run.ckpt"
    state = interrupted_run(c, path, every, saves)
    assert 0 < state["optimizer"]["staleopt"]["step"] < plain["step"].iloc[-1]
    resumed = train.run(c, checkpoint=Checkpoint(path, every=every))
    assert resumed.attrs["resumed_at_step"] == state["optimizer"]["staleopt"]["step"]
    same_records(resumed, plain)
    assert resumed["wall_time"].is_monotonic_increasing
    assert not path.exists()  # deleted once the run is done


def test_a_resumed_cifar_run_redraws_the_augmentation_of_its_epoch(tmp_path, monkeypatch):
    """Mid-epoch resume with augmented CIFAR batches: the crops and flips come from the data-order generator,
    drawn for the whole pass, so the steps after the checkpoint see the same images as without interruption."""
    from test_data import write_cifar
    write_cifar(tmp_path / "data", "cifar10", n_per_file=16)  # 80 training images: 5 steps per epoch
    monkeypatch.setenv("STALEOPT_DATA", str(tmp_path / "data"))
    c = RunConfig(model="mlp", model_kwargs={"depth": 2, "hidden": 16}, data="cifar10",
                  data_kwargs={"verify": False}, batch_size=16, epochs=2, lr=0.05, method="pipemare", stages=3)
    plain = train.run(c)
    no_aug = train.run(RunConfig(**{**c.to_dict(), "data_kwargs": {"verify": False, "augment": False}}))
    assert not plain["train_loss"].equals(no_aug["train_loss"])  # the augmentation is in use
    state = interrupted_run(c, tmp_path / "run.ckpt", 3, 4)  # saves at steps 3, 5 (epoch end), 6, 9
    assert (state["epoch"], state["batch"], state["optimizer"]["staleopt"]["step"]) == (2, 4, 9)
    same_records(train.run(c, checkpoint=Checkpoint(tmp_path / "run.ckpt", every=3)), plain)


def test_checkpoint_holds_the_state_and_is_kept_on_request(tmp_path):
    c = cfg(method="pipemare", stages=3)
    records = tmp_path / "rec.csv"
    ckpt = Checkpoint(tmp_path / "sub" / "run.ckpt", every=5, keep=True, records=records)
    out = train.run(c, checkpoint=ckpt)
    state = read_checkpoint(ckpt.path)
    assert state["run_id"] == c.run_id() and state["config"] == c.to_dict()
    assert (state["epoch"], state["batch"], state["optimizer"]["staleopt"]["step"]) == (4, 0, 36)  # the end
    assert len(state["losses"]) == 0 and len(state["records"]) == 3
    assert {"torch", "order", "python", "numpy"} <= set(state["rng"])
    pd.testing.assert_frame_equal(pd.read_csv(records, **sweep._EXACT_FLOATS), out)
    assert not list(tmp_path.glob("**/.*.tmp"))  # no temporary file left behind
    # resuming from the kept checkpoint of a finished run trains nothing
    again = train.run(c, checkpoint=Checkpoint(ckpt.path))
    assert again.attrs["resumed_at_step"] == 36
    same_records(again, out)


class HostAugmented(torch.utils.data.Dataset):
    """A map-style dataset whose augmentation draws from numpy's global RNG and Python's ``random``."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + torch.from_numpy(np.random.normal(0, 0.5, self.x[i].shape).astype(np.float32))
        return (x.flip(-1) if random.random() < 0.5 else x), int(self.y[i])


def _host_augmented():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return HostAugmented(x[:96], y[:96]), torch.utils.data.TensorDataset(x[96:], y[96:])  # 6 steps per epoch


def host_augmented_cfg():
    data.register("host-augmented", _host_augmented, replace=True)
    return cfg(data="host-augmented", data_kwargs={}, epochs=2, method="pipedream", stages=2)


def host_states():
    """The caller's Python ``random`` and numpy states, comparable with ``==``."""
    kind, key, *rest = np.random.get_state()
    return random.getstate(), (kind, key.tolist(), *rest)


def test_a_dataset_drawing_from_numpy_and_random_is_deterministic_and_the_caller_rng_untouched():
    """run() seeded only torch: the same config trained twice drew other numpy/random augmentations (train loss
    1.0918 against 1.1028); seeded from the config's seed now, and the caller's states are put back."""
    c = host_augmented_cfg()
    np.random.seed(1), random.seed(1)
    before = host_states()
    a = train.run(c)
    assert host_states() == before  # the caller's own draws continue where they were
    np.random.rand(), random.random()  # the caller's state does not reach the run either
    same_records(train.run(c), a)
    other = train.run(c.replace(seed=1))
    assert not other["train_loss"].equals(a["train_loss"])


@pytest.mark.parametrize("every, saves", [(4, 1), (4, 3), (None, 1)])  # steps 4 and 8 (mid-epoch), 6 (epoch end)
def test_a_resumed_run_redraws_the_numpy_and_random_augmentation(tmp_path, every, saves):
    """The checkpoint held torch's RNG only: resumed mid-epoch, a transform drawing from numpy or ``random`` drew
    from another position of their streams, even for a caller who seeded them before each launch."""
    c = host_augmented_cfg()

    def launch(run, *args, **kw):
        np.random.seed(0), random.seed(0)  # (a caller's seeding: the same before each launch)
        return run(*args, **kw)
    plain = launch(train.run, c)
    path = tmp_path / "run.ckpt"
    state = launch(interrupted_run, c, path, every, saves)
    assert {"python", "numpy"} <= set(state["rng"])
    resumed = launch(train.run, c, checkpoint=Checkpoint(path, every=every))
    assert resumed.attrs["resumed_at_step"] == state["optimizer"]["staleopt"]["step"] > 0
    same_records(resumed, plain)


def test_a_checkpoint_saved_without_the_numpy_and_random_states_still_resumes(tmp_path):
    """Checkpoints of earlier versions lack ``random``'s and numpy's states: they resume as they did then (exactly,
    for data that does not draw from them)."""
    c = cfg(method="pipemare", stages=3)
    plain = train.run(c)
    path = tmp_path / "run.ckpt"
    state = interrupted_run(c, path, 5, 4)  # step 15, mid-epoch
    del state["rng"]["python"], state["rng"]["numpy"]
    atomic_write_bytes(path, state)
    resumed = train.run(c, checkpoint=Checkpoint(path, every=5))
    assert resumed.attrs["resumed_at_step"] == state["optimizer"]["staleopt"]["step"] > 0
    same_records(resumed, plain)


def test_bad_checkpoints_are_clear_errors(tmp_path):
    path = tmp_path / "run.ckpt"
    interrupted_run(cfg(method="1f1b", stages=2), path, None, 1)
    with pytest.raises(CheckpointError, match="holds run .* not run .*Delete the file"):
        train.run(cfg(method="1f1b", stages=2, seed=1), checkpoint=Checkpoint(path))
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable checkpoint.*delete it"):
        train.run(cfg(), checkpoint=Checkpoint(path))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(CheckpointError, match="checkpoint every = .* must be an int >= 1 or None"):
            Checkpoint(path, every=bad)


def test_a_checkpoint_of_another_layout_is_a_checkpoint_error(tmp_path):
    """A checkpoint of this run's id saved by another train function (its own state) ended in KeyError: 'model'."""
    c, path = cfg(), tmp_path / "run.ckpt"
    atomic_write_bytes(path, {"run_id": c.resolve().run_id(), "weights": torch.zeros(2), "step": 3})
    with pytest.raises(CheckpointError, match=f"{path} is not a checkpoint of staleopt.train.run .*lacks "
                                              r"\['model', .*another train function.*delete the file"):
        train.run(c, checkpoint=Checkpoint(path))


@pytest.mark.parametrize("kw", [dict(max_steps=20), dict(lr=2.0)], ids=["max_steps", "diverged"])
def test_a_kept_checkpoint_of_a_run_that_stopped_early_trains_nothing(tmp_path, kw):
    """A run that ended before its last epoch (max_steps, or it diverged) kept a final checkpoint saying "go on at
    the next epoch": resumed from it, the run trained on after its end and added records."""
    c, path = cfg(method="pipemare", stages=3, **kw), tmp_path / "run.ckpt"
    first = train.run(c, checkpoint=Checkpoint(path, keep=True))
    assert len(first) < c.epochs and read_checkpoint(path)["finished"] is True
    again = train.run(c, checkpoint=Checkpoint(path, keep=True))
    assert again.attrs["resumed_at_step"] == first["step"].iloc[-1]
    same_records(again, first)


def test_a_resume_under_another_thread_count_trains_under_the_saved_one(tmp_path):
    """torch's float results depend on its thread count, which was neither in the run id nor in the checkpoint: a run
    resumed under another count mixed both. The rest of the run now trains under the saved count, with a warning,
    and the caller's count is put back. A checkpoint saved without a count resumes under the caller's, silently."""
    c, path = cfg(method="pipemare", stages=3), tmp_path / "run.ckpt"
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert interrupted_run(c, path, 5, 3)["threads"] == 1
        torch.set_num_threads(2)
        seen = []
        with pytest.warns(UserWarning, match="saved under 1 torch thread.*has 2.*continues under 1"):
            resumed = train.run(c, checkpoint=Checkpoint(path, every=5),
                                on_epoch=lambda record: seen.append(torch.get_num_threads()))
        assert seen == [1, 1] and resumed.attrs["threads"] == 1 and torch.get_num_threads() == 2
        torch.set_num_threads(1)
        state = interrupted_run(c, path, 5, 3)
        del state["threads"], state["finished"]  # as saved before they were
        atomic_write_bytes(path, state)
        torch.set_num_threads(2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert train.run(c, checkpoint=Checkpoint(path, every=5)).attrs["threads"] == 2
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------------------------- kill -9 of real processes

SLOW = {**SMALL, "data_kwargs": {**SMALL["data_kwargs"], "num_samples": 1250}, "epochs": 4}  # 62 steps/epoch
SWEEP = f"""\
name = "kill"
[base]
model = "mlp"
model_kwargs = {{depth = 3, hidden = 16}}
data = "synthetic"
data_kwargs = {json.dumps(SLOW["data_kwargs"]).replace('"', "").replace(":", " =")}
batch_size = 16
epochs = 4
lr = 0.05
method = "pipemare"
[grid]
stages = [3, 1]
"""


def killed_when(args, ready):
    """Start ``python -m staleopt.cli ARGS`` and SIGKILL it as soon as ``ready()`` is true."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "staleopt.cli", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_for(ready, "checkpoint", proc, poll=0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_killed_sweep_resumes_the_run_in_flight_from_its_checkpoint(tmp_path):
    path = tmp_path / "kill.toml"
    path.write_text(SWEEP)
    first, second = sweep.load_sweep(path).configs
    out = tmp_path / "out"
    ckpt = out / "runs" / first.run_id() / "checkpoint.pt"
    killed_when(["sweep", str(path), "--out", str(out), "--no-bar", "--checkpoint-every", "10"],
                lambda: ckpt.exists())
    saved_at = read_checkpoint(ckpt)["optimizer"]["staleopt"]["step"]
    total = 4 * (1000 // 16)
    assert 10 <= saved_at < total and sweep.run_state(out / "runs" / first.run_id()) == "incomplete"

    report = sweep.run_sweep(path, out, bar=False, checkpoint_every=10)
    assert sorted(report.finished) == sorted([first.run_id(), second.run_id()]) and report.ok
    done = json.loads((out / "runs" / first.run_id() / "done").read_text())
    assert done["resumed_at_step"] == saved_at  # trained total - saved_at steps, not total
    assert json.loads((out / "runs" / second.run_id() / "done").read_text())["resumed_at_step"] == 0
    assert not list(out.glob("runs/*/checkpoint.pt")) and not list(out.glob("runs/*/claim.*"))
    records = sweep.collect(out)
    for c in (first, second):
        mine = records[records.run == c.run_id()].reset_index(drop=True)[list(train.RECORD_COLUMNS)]
        same_records(mine, train.run(c))


def test_killed_train_command_resumes_from_its_checkpoint(tmp_path, capsys):
    c = RunConfig(**SLOW, method="pipedream", stages=3)
    out = tmp_path / "rec.csv"
    args = ["train", "--config", str(tmp_path / "c.json"), "--out", str(out), "--checkpoint-every", "25"]
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))
    ckpt = tmp_path / "rec.csv.ckpt"
    killed_when(args, lambda: ckpt.exists())
    saved_at = read_checkpoint(ckpt)["optimizer"]["staleopt"]["step"]
    assert 25 <= saved_at < 4 * 62
    assert main(args) == 0
    assert f"resumed from its checkpoint at step {saved_at}" in capsys.readouterr().out
    same_records(pd.read_csv(out, **sweep._EXACT_FLOATS), train.run(c))
    assert not ckpt.exists()
    assert main(["train", "--epochs", "1", "--checkpoint-every", "3"]) == 2  # needs --out


def test_a_worker_killed_in_a_process_pool_fails_only_its_run_which_resumes(tmp_path):
    from staleopt import lease
    path = tmp_path / "kill.toml"
    path.write_text(SWEEP)
    configs = sweep.load_sweep(path).configs
    out = tmp_path / "out"
    killed, over = [], threading.Event()

    def kill_a_worker():  # the claim file names the process that trains the run
        while not over.is_set():
            for c in configs:
                run_dir = out / "runs" / c.run_id()
                held = lease.holder(run_dir) if (run_dir / "checkpoint.pt").exists() else None
                if held is not None:
                    os.kill(held[0].pid, signal.SIGKILL)
                    killed.append(c)
                    return
            time.sleep(0.005)
    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    try:
        report = sweep.run_sweep(path, out, workers=2, bar=False, checkpoint_every=10)
    finally:
        over.set()
        killer.join()
    assert killed and report.failed == [killed[0].run_id()] and not report.ok
    other = next(c for c in configs if c is not killed[0])
    assert report.finished == {other.run_id(): "ok"}  # the other worker's run went on to the end
    run_dir = out / "runs" / killed[0].run_id()
    assert "died: killed by signal SIGKILL" in (run_dir / "error.txt").read_text()
    assert sweep.run_state(run_dir) == "failed"
    saved_at = read_checkpoint(run_dir / "checkpoint.pt")["optimizer"]["staleopt"]["step"]

    again = sweep.run_sweep(path, out, bar=False, checkpoint_every=10)
    assert again.ok and list(again.finished) == [killed[0].run_id()]
    done = json.loads((out / "runs" / killed[0].run_id() / "done").read_text())
    assert done["resumed_at_step"] == saved_at > 0
    records = sweep.collect(out)
    mine = records[records.run == killed[0].run_id()].reset_index(drop=True)[list(train.RECORD_COLUMNS)]
    same_records(mine, train.run(killed[0]))
