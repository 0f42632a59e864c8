"""Runs that are never lost or silently wrong , and files that cannot run code.

Each test stands for one case of the fault-injection study: a kill at a dangerous moment (simulated in
process by an exception raised exactly there, or a real SIGKILL), a damaged or hostile file, a full or
read-only disk (simulated: a full filesystem needs root), and inputs that used to end in a traceback.
"""
import errno
import functools
import json
import os
import pickle
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from staleopt import checkpoint, data, lease, sweep, train
from staleopt.checkpoint import Checkpoint
from staleopt.cli import main
from staleopt.config import RunConfig
from staleopt.errors import (CheckpointError, ConfigError, DataError, OutputError, RunFileError, SweepConfigError,
                             UnsafeCheckpointError)

from test_sweep import SWEEP, _write, fake_train

SMALL = dict(model="mlp", model_kwargs={"depth": 3, "hidden": 16}, data="synthetic",
             data_kwargs={"num_samples": 250, "input_shape": [1, 8], "num_classes": 4, "separation": 0.5},
             batch_size=16, epochs=3, lr=0.05, method="pipemare", stages=3)  # 12 steps per epoch


def cfg(**kw):
    return RunConfig(**{**SMALL, **kw})


def same_records(a, b):
    pd.testing.assert_frame_equal(a.drop(columns="wall_time").reset_index(drop=True),
                                  b.drop(columns="wall_time").reset_index(drop=True))


class Killed(BaseException):
    """Raised where a kill -9 would strike: no ``except Exception`` of the code under test catches it."""


def kill_before_writing(monkeypatch, name):
    """Make the atomic write of the file called ``name`` die before it starts, as a kill there would."""
    write = checkpoint.atomic_write_text

    def dying(path, text):
        if Path(path).name == name:
            raise Killed(name)
        write(path, text)
    monkeypatch.setattr(checkpoint, "atomic_write_text", dying)


class Evil:
    """A pickle that creates ``path`` when unpickled: proof that loading it ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _train_args(tmp_path, config, *extra):
    (tmp_path / "c.json").write_text(json.dumps(config.to_dict()))
    return ["train", "--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "rec.csv"), *extra]


# ------------------------------------------------------------------ 1. a finished `train --out` stays finished

def test_rerunning_a_finished_train_out_trains_nothing_and_rewrites_nothing(tmp_path, monkeypatch, capsys):
    args = _train_args(tmp_path, cfg())
    assert main(args) == 0
    table = capsys.readouterr().out.splitlines()[1:]  # (the header line names the run)
    out = tmp_path / "rec.csv"
    written, marker = out.read_text(), json.loads((tmp_path / "rec.csv.done").read_text())
    assert marker["status"] == "ok" and marker["rows"] == 3 and not (tmp_path / "rec.csv.ckpt").exists()
    calls = []
    monkeypatch.setattr(train, "run", lambda *a, **k: calls.append(1))
    capsys.readouterr()
    assert main(args) == 0  # a retried job: prints the finished records, trains nothing
    assert not calls and out.read_text() == written
    printed = capsys.readouterr().out.splitlines()
    assert "finished earlier" in printed[0]
    assert printed[1].split() == table[0].split()  # the columns the run printed (no NaN test_ppl, best_loss)
    def fails(*a, **k):  # (e.g. a batch larger than the data, --device cuda without a GPU)
        raise ConfigError("fails at once")
    monkeypatch.setattr(train, "run", fails)
    assert main(args + ["--rerun"]) == 2  # a rerun that trains nothing leaves the finished run as it was
    assert out.read_text() == written and json.loads((tmp_path / "rec.csv.done").read_text()) == marker
    monkeypatch.undo()
    assert main(args + ["--rerun"]) == 0  # asked for: trained again from step 0, same records
    assert out.read_text().count("\n") == 4 and "resumed" not in capsys.readouterr().out


def test_a_kill_between_the_last_records_and_the_marker_resumes_to_the_same_records(tmp_path, monkeypatch, capsys):
    c = cfg()
    args = _train_args(tmp_path, c)
    kill_before_writing(monkeypatch, "rec.csv.done")
    with pytest.raises(Killed):
        main(args)
    monkeypatch.undo()
    assert (tmp_path / "rec.csv.ckpt").exists()  # kept until the marker is written
    assert main(args) == 0
    assert "resumed from its checkpoint at step 24" in capsys.readouterr().out  # only the last epoch again
    same_records(pd.read_csv(tmp_path / "rec.csv", **checkpoint.EXACT_FLOATS), train.run(c))


def test_train_out_never_overwrites_what_it_did_not_write(tmp_path, capsys):
    (tmp_path / "rec.csv").write_text("precious\n")
    assert main(_train_args(tmp_path, cfg())) == 2
    assert "neither a finished run" in capsys.readouterr().err and (tmp_path / "rec.csv").read_text() == "precious\n"
    (tmp_path / "rec.csv").unlink()
    assert main(_train_args(tmp_path, cfg())) == 0
    assert main(_train_args(tmp_path, cfg(seed=1))) == 2  # another config, same --out
    assert "holds the finished run" in capsys.readouterr().err


def test_a_damaged_train_out_names_rerun_not_its_folder(tmp_path, capsys):
    """The advice for a damaged finished run was "delete the run's folder": for train --out that folder is the
    user's own (work/ of work/r.csv), with whatever else is in it."""
    args = _train_args(tmp_path, cfg())
    assert main(args) == 0
    for name, text in (("rec.csv", "epoch,status\n1,ok\n"), ("rec.csv.done", "{")):
        (tmp_path / name).write_text(text)
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err
        assert name in err and "pass --rerun to train the run again" in err and "folder" not in err


def test_train_out_a_folder_or_empty_is_refused_before_training(tmp_path, capsys):
    """``--out DIR`` (with ``--rerun``) trained a whole epoch, then failed at the first save, keeping nothing;
    ``--out ""`` (an unset shell variable) trained and saved nothing, without a word."""
    args = _train_args(tmp_path, cfg())
    at = args.index("--out") + 1
    for out, why in ((str(tmp_path), "is a folder"), ("", "argument --out: empty")):
        args[at] = out
        assert main(args + ["--rerun"] * bool(out)) == 2
        err = capsys.readouterr()
        assert why in err.err and "epoch" not in err.out


# ------------------------------------------------------------------ 2. a sweep deletes the checkpoint after `done`

def test_a_sweep_killed_before_done_keeps_the_checkpoint_and_resumes_from_it(tmp_path, monkeypatch):
    c = cfg()
    kill_before_writing(monkeypatch, "done")
    with pytest.raises(Killed):
        sweep.run_sweep([c], tmp_path, bar=False)
    monkeypatch.undo()
    run_dir = tmp_path / "runs" / c.run_id()
    assert (run_dir / "checkpoint.pt").exists() and sweep.run_state(run_dir) == "incomplete"
    report = sweep.run_sweep([c], tmp_path, bar=False)
    assert report.ok and json.loads((run_dir / "done").read_text())["resumed_at_step"] == 24
    assert not (run_dir / "checkpoint.pt").exists()
    same_records(sweep.collect(tmp_path)[list(train.RECORD_COLUMNS)], train.run(c))


SELF_KILL = """
import json, os, signal, sys
from pathlib import Path
from staleopt import checkpoint, sweep
from staleopt.config import RunConfig
write = checkpoint.atomic_write_text
def dying(path, text):
    if Path(path).name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 at exactly this moment
    write(path, text)
checkpoint.atomic_write_text = dying
sweep.run_sweep([RunConfig(**json.loads(sys.argv[3]))], sys.argv[1], bar=False)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("moment, resumed_at", [("done", 24), ("records.csv", 12)])
def test_a_sweep_process_killed_while_writing_its_files_loses_no_step(tmp_path, moment, resumed_at):
    """A real SIGKILL just before the done marker (the end of the run) or the first records (the end of epoch
    1, whose checkpoint was saved first): the dead process's claim is taken over at once and the relaunch resumes
    from the checkpoint of that moment to the same records."""
    import subprocess
    c = cfg()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SELF_KILL, str(tmp_path), moment, json.dumps(c.to_dict())],
                          env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    run_dir = tmp_path / "runs" / c.run_id()
    assert (run_dir / "checkpoint.pt").exists() and lease.claims(run_dir) and not (run_dir / "done").exists()
    report = sweep.run_sweep([c], tmp_path, bar=False)
    assert report.ok and json.loads((run_dir / "done").read_text())["resumed_at_step"] == resumed_at
    same_records(sweep.collect(tmp_path)[list(train.RECORD_COLUMNS)], train.run(c))


# ------------------------------------------------------------------ 3. one dead worker fails only its run

@functools.wraps(fake_train)  # (the runs it finishes are fake_train's: a relaunch with fake_train keeps them)
def suicidal_train(config, progress=False):
    """fake_train, except that the runs with two stages die as the out-of-memory killer would kill them."""
    if config.stages == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return fake_train(config, progress)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_dead_worker_fails_its_own_run_and_the_launch_goes_on(tmp_path, capsys):
    path = _write(tmp_path)
    configs = sweep.load_sweep(path).configs
    report = sweep.run_sweep(path, tmp_path / "s", workers=2, train_fn="test_runs_never_lost:suicidal_train",
                             bar=False)
    dead = sorted(c.run_id() for c in configs if c.stages == 2)
    assert sorted(report.failed) == dead and len(report.finished) == 2 and not report.ok
    for run_id in dead:
        assert "killed by signal SIGKILL" in (tmp_path / "s" / "runs" / run_id / "error.txt").read_text()
        assert not lease.claims(tmp_path / "s" / "runs" / run_id)
    assert main(["sweep", str(path), "--out", str(tmp_path / "s"), "--no-bar", "--workers", "2",
                 "--train-fn", "test_sweep:fake_train"]) == 0  # a relaunch retries them
    assert set(sweep.runs(tmp_path / "s")["state"]) == {"done"}


def test_worker_threads_beyond_any_machine_are_a_typed_error(tmp_path, capsys):
    path = _write(tmp_path)
    assert main(["sweep", str(path), "--out", str(tmp_path / "s"), "--worker-threads", str(10 ** 9)]) == 2
    assert "--worker-threads = 1000000000 must be an int" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="threads = 1000000000"):
        sweep.run_sweep(path, tmp_path / "s", workers=2, threads=10 ** 9, train_fn=fake_train, bar=False)


# ------------------------------------------------------------------ 4. damaged files are typed errors naming them

def test_a_checkpoint_with_64_overwritten_bytes_is_refused_not_resumed(tmp_path):
    c = cfg()
    path = tmp_path / "run.ckpt"
    train.run(c, checkpoint=Checkpoint(path, keep=True))
    blob = bytearray(path.read_bytes())
    at = len(blob) // 2
    blob[at:at + 64] = bytes(64)  # zeros inside the tensor data
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=f"{path} is damaged.*delete it"):
        train.run(c, checkpoint=Checkpoint(path))


def _finished_sweep(tmp_path):
    out = tmp_path / "s"
    sweep.run_sweep(_write(tmp_path), out, train_fn=fake_train, bar=False)
    return out, sorted((out / "runs").iterdir())


@pytest.mark.parametrize("damage", ["last row missing", "row cut mid-line", "empty", "binary", "bad config",
                                    "empty done", "config lacks a key", "empty config", "train_fn not a string"])
def test_results_reports_a_damaged_run_and_summarizes_the_others(tmp_path, capsys, damage):
    out, run_dirs = _finished_sweep(tmp_path)
    bad = run_dirs[1]
    records = bad / "records.csv"
    text = records.read_text()
    if damage == "last row missing":
        records.write_text("".join(text.splitlines(keepends=True)[:-1]))
    elif damage == "row cut mid-line":
        records.write_text(text[:text.rindex(",")])
    elif damage == "empty":
        records.write_text("")
    elif damage == "binary":
        records.write_bytes(bytes(range(256)))
    elif damage == "bad config":
        (bad / "config.json").write_text("{not json")
    elif damage == "config lacks a key":  # (results ended in "ValueError: cannot convert float NaN to integer")
        config = json.loads((bad / "config.json").read_text())
        del config["stages"]
        (bad / "config.json").write_text(json.dumps(config))
    elif damage == "empty config":
        (bad / "config.json").write_text("{}")
    elif damage == "train_fn not a string":  # (a launch ended in "TypeError: unhashable type: 'list'")
        (bad / "done").write_text(json.dumps({**json.loads((bad / "done").read_text()), "train_fn": ["x"]}))
    else:
        (bad / "done").write_text("")
    assert sweep.run_state(bad) == "damaged" and sweep.damage(bad)
    with pytest.raises(RunFileError, match=str(bad)):
        sweep.collect(out)
    capsys.readouterr()
    assert main(["results", str(out)]) == 1
    captured = capsys.readouterr()
    assert f"skipped a damaged run: {bad}" in captured.err and "Traceback" not in captured.err
    assert sorted(pd.read_csv(out / "results" / "records.csv")["run"].unique()) == \
        sorted(d.name for d in run_dirs if d != bad)
    assert main(["sweep", str(tmp_path / "sweep.toml"), "--out", str(out), "--dry-run"]) == 0
    assert "damaged" in capsys.readouterr().out
    report = sweep.run_sweep(tmp_path / "sweep.toml", out, train_fn=fake_train, bar=False)  # left alone
    assert list(report.damaged) == [bad.name] and not report.finished and not report.ok


def test_a_damaged_run_in_flight_is_reported_by_results_partial(tmp_path, capsys):
    out, run_dirs = _finished_sweep(tmp_path)
    (run_dirs[0] / "done").unlink()
    (run_dirs[0] / "records.csv").write_text("epoch,step,train_loss,test_acc,status\n1,10,0.5")
    assert main(["results", str(out), "--partial"]) == 1
    assert "a row without a status" in capsys.readouterr().err


def test_read_done_names_the_file(tmp_path):
    done = tmp_path / "done"
    done.write_text("")
    with pytest.raises(RunFileError, match=f"{done} is not a readable completion marker"):
        sweep.read_done(done)
    done.write_text('{"status": "ok", "rows": 3}')
    assert sweep.read_done(done)["rows"] == 3


# ------------------------------------------------------------------ 5. paths and pickles

@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", "..", "c:x"])
def test_a_sweep_name_cannot_leave_the_output_folder(tmp_path, name):
    with pytest.raises(SweepConfigError, match="must be a plain folder name"):
        sweep.load_sweep(_write(tmp_path, SWEEP.replace('name = "tiny"', f"name = {json.dumps(name)}")))


def test_a_crafted_checkpoint_cannot_run_code(tmp_path):
    marker = tmp_path / "code-ran"
    state = {"run_id": cfg().run_id(), "model": Evil(marker)}
    signed, bare = tmp_path / "signed.ckpt", tmp_path / "bare.ckpt"
    checkpoint.atomic_write_bytes(signed, state)  # a correct checksum: the attacker can compute it too
    torch.save(state, bare)
    for path in (signed, bare):
        with pytest.raises(UnsafeCheckpointError, match=f"{path} holds an object of type .*open.*refused"):
            train.run(cfg(), checkpoint=Checkpoint(path))
    assert not marker.exists()


def test_a_kept_checkpoint_holds_the_final_state(tmp_path):
    """--keep-checkpoint kept the state of the last epoch but one (of a 1-epoch run, nothing): it holds the end of
    the run, from which a resume trains nothing and returns the same records."""
    c, path = cfg(epochs=2), tmp_path / "run.ckpt"
    done = train.run(c, checkpoint=Checkpoint(path, keep=True))
    state = checkpoint.read(path)
    assert state["epoch"] == 3 and state["batch"] == 0
    again = train.run(c, checkpoint=Checkpoint(path, keep=True))
    assert again.attrs["resumed_at_step"] == done["step"].iloc[-1]
    same_records(again, done)


def test_every_checkpoint_state_loads_with_weights_only(tmp_path):
    for kw in (dict(), dict(method="hogwild", optimizer="adam", lr=0.01), dict(method="pipedream", stages="max"),
               dict(lr_schedule="step", lr_milestones=[2])):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.ckpt"
        train.run(cfg(**kw), checkpoint=Checkpoint(path, keep=True))
        state = checkpoint.read(path)
        assert {"torch", "order"} <= set(state["rng"]) and state["run_id"] == cfg(**kw).resolve().run_id()


@pytest.mark.parametrize("verify", [False, True])
def test_a_planted_cifar_file_cannot_run_code(tmp_path, verify):
    from test_data import write_cifar
    write_cifar(tmp_path, "cifar10")
    marker = tmp_path / "code-ran"
    planted = tmp_path / data.CIFAR_FOLDERS["cifar10"] / "data_batch_2"
    with open(planted, "wb") as f:
        pickle.dump({"data": Evil(marker)}, f, protocol=2)
    with pytest.raises(DataError) as e:
        data.load("cifar10", root=tmp_path, verify=verify)
    assert not marker.exists()
    if verify:  # refused by its md5 before reading; the message says what verify=False does
        assert "not the official files" in str(e.value) and "still read without running" in str(e.value)
    else:
        assert f"{planted} is not a CIFAR data file" in str(e.value) and "open, which a CIFAR file never holds" in str(e.value)


def test_cifar_files_are_read_without_pickle_load(tmp_path, monkeypatch):
    from test_data import write_cifar
    written = write_cifar(tmp_path, "cifar100")
    monkeypatch.setattr(pickle, "load", None)
    monkeypatch.setattr(pickle, "loads", None)
    d = data.load("cifar100", root=tmp_path, verify=False, augment=False)
    assert d.train.targets.tolist() == written["train"]["fine_labels"]
    assert np.array_equal(d.test.images.reshape(len(d.test), -1).numpy(), written["test"]["data"])


# ------------------------------------------------------------------ 6. one-line typed errors instead of tracebacks

def test_invalid_toml_in_train_config_is_a_typed_error(tmp_path, capsys):
    (tmp_path / "c.toml").write_text("epochs = = 3\n")
    assert main(["train", "--config", str(tmp_path / "c.toml")]) == 2
    assert "is not a readable TOML file" in capsys.readouterr().err
    (tmp_path / "c.json").write_text("[1, 2]")
    assert main(["train", "--config", str(tmp_path / "c.json")]) == 2
    assert "must hold a table of RunConfig fields" in capsys.readouterr().err


def test_a_garbage_claim_blocks_nothing(tmp_path, capsys):
    path = _write(tmp_path)
    out = tmp_path / "s"
    configs = sweep.load_sweep(path).configs
    run_dir = out / "runs" / configs[0].run_id()
    run_dir.mkdir(parents=True)
    (run_dir / "claim.0").write_text(json.dumps({"host": "h", "pid": "x", "started": 1, "launch": "l",
                                                  "claimed": "now"}))
    assert lease.read_owner(run_dir / "claim.0") is None and lease.holder(run_dir) is None
    assert main(["sweep", str(path), "--out", str(out), "--dry-run"]) == 0
    assert main(["results", str(out)]) == 0
    report = sweep.run_sweep(path, out, train_fn=fake_train, bar=False)
    assert report.ok and len(report.finished) == 4 and not lease.claims(run_dir)


def _unwritable(tmp_path):
    """A folder this process cannot write into: read-only, or (as root, whom permissions do not stop) a file."""
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "sub"


def test_an_unwritable_out_fails_before_training(tmp_path, monkeypatch, capsys):
    folder = _unwritable(tmp_path)
    calls = []
    monkeypatch.setattr(train, "run", lambda *a, **k: calls.append(1))
    assert main(_train_args(tmp_path, cfg())[:-1] + [str(folder / "rec.csv")]) == 2
    assert f"cannot write {folder}" in capsys.readouterr().err and not calls
    with pytest.raises(OutputError, match="cannot write"):
        sweep.run_sweep(_write(tmp_path), folder, train_fn=fake_train, bar=False)


def _disk_full(monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(checkpoint.os, "fsync", full)


def test_a_full_disk_is_a_typed_error_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    _disk_full(monkeypatch)
    with pytest.raises(OutputError, match=f"cannot write {tmp_path / 'x.txt'}: the disk is full"):
        checkpoint.atomic_write_text(tmp_path / "x.txt", "x")
    with pytest.raises(OutputError, match="the disk is full"):
        Checkpoint(tmp_path / "run.ckpt").save({"a": torch.zeros(3)})
    assert not list(tmp_path.iterdir())  # no 0-byte .tmp, no half file


def test_a_write_under_a_file_names_the_path_not_the_disk(tmp_path):
    """Every failed write advised freeing space, also when a file stood where a folder must be."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(OutputError, match="Not a directory.*a file stands where a folder must be") as e:
        checkpoint.atomic_write_text(tmp_path / "afile" / "x.txt", "x")
    assert "free space" not in str(e.value)


def test_a_full_disk_fails_the_runs_not_the_launch(tmp_path, monkeypatch):
    out = tmp_path / "s"
    (out / "runs").mkdir(parents=True)
    _disk_full(monkeypatch)
    report = sweep.run_sweep(_write(tmp_path), out, train_fn=fake_train, bar=False)
    assert len(report.failed) == 4 and not report.finished
    assert not list(out.glob("runs/*/.*.tmp")) and not list(out.glob("runs/*/error.txt"))


@pytest.mark.parametrize("timeout", ["inf", "nan", "0"])
def test_an_infinite_claim_timeout_is_a_typed_error(tmp_path, capsys, timeout):
    assert main(["sweep", str(_write(tmp_path)), "--out", str(tmp_path / "s"), "--claim-timeout", timeout]) == 2
    assert "--claim-timeout: claim timeout must be > 0 seconds and finite" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="finite"):
        sweep.run_sweep(_write(tmp_path), tmp_path / "s", train_fn=fake_train, bar=False,
                        claim_timeout=float(timeout))


def test_an_empty_done_file_makes_the_run_damaged_not_a_crash(tmp_path, capsys):
    out, run_dirs = _finished_sweep(tmp_path)
    (run_dirs[0] / "done").write_text("")
    assert sweep.run_state(run_dirs[0]) == "damaged"
    assert main(["sweep", str(tmp_path / "sweep.toml"), "--out", str(out), "--no-bar",
                 "--train-fn", "test_sweep:fake_train"]) == 1
    err = capsys.readouterr().err
    assert f"damaged, left alone: {run_dirs[0] / 'done'} is not a readable completion marker" in err


def _second_launch(tmp_path, seed):
    """``staleopt train`` of another configuration (another seed) into the same --out."""
    (tmp_path / f"c{seed}.json").write_text(json.dumps(cfg(epochs=1, seed=seed).to_dict()))
    return main(["train", "--config", str(tmp_path / f"c{seed}.json"), "--out", str(tmp_path / "rec.csv")])


def test_two_train_launches_on_one_out_cannot_both_write_it(tmp_path, monkeypatch, capsys):
    """Two `train --out OUT` launches that start before either has written anything (a job array whose --out forgot
    the task index) both trained and both exited 0: the last to finish replaced the other's finished run. The first
    now holds a claim beside OUT, and the second is refused at start, naming it."""
    save, second = Checkpoint.save, []

    def first_save(self, state):  # the second launch starts while the first has written nothing yet
        if not second:
            second.append(_second_launch(tmp_path, 1))
        save(self, state)
    monkeypatch.setattr(Checkpoint, "save", first_save)
    assert main(_train_args(tmp_path, cfg(epochs=2))) == 0  # (it saves at the end of epoch 1)
    assert second == [2]
    err = capsys.readouterr().err
    assert f"{tmp_path / 'rec.csv'} is being written by {socket.gethostname()}:{os.getpid()} (launch " in err
    assert json.loads((tmp_path / "rec.csv.done").read_text())["run_id"] == cfg(epochs=2).run_id()
    assert not list(tmp_path.glob("rec.csv.claim.*"))  # let go at the end


def test_train_out_stops_writing_once_its_claim_is_taken_over(tmp_path, monkeypatch, capsys):
    """The checkpoint and records writes of `train --out` are guarded by its claim; a dead launch's claim (kill -9)
    is taken over at once."""
    (tmp_path / "rec.csv.claim.0").write_text(json.dumps({"host": socket.gethostname(), "pid": 2 ** 22 + 1,
                                                          "started": None, "launch": "dead", "claimed": "then"}))
    save = Checkpoint.save

    def taken_over(self, state):  # its heartbeat stalled and another launch took OUT over
        claim = sorted(tmp_path.glob("rec.csv.claim.*"))[-1]
        (tmp_path / f"rec.csv.claim.{int(claim.name.rsplit('.', 1)[1]) + 1}").write_text(json.dumps(
            {"host": "elsewhere", "pid": 1, "started": None, "launch": "other", "claimed": "now"}))
        save(self, state)
    monkeypatch.setattr(Checkpoint, "save", taken_over)
    assert main(_train_args(tmp_path, cfg(epochs=2))) == 2
    assert "another launch took over" in capsys.readouterr().err
    assert not (tmp_path / "rec.csv.ckpt").exists() and not (tmp_path / "rec.csv").exists()
    assert not (tmp_path / "rec.csv.claim.0").exists()  # the dead launch's claim was taken over
    assert lease.read_owner(tmp_path / "rec.csv.claim.2").launch == "other"  # left to the launch that took over


def test_a_run_records_its_torch_thread_count(tmp_path):
    """torch's float results depend on the thread count: each run's done marker says which it trained under."""
    c = cfg(epochs=1)
    sweep.run_sweep([c], tmp_path / "s", bar=False, threads=1)
    assert sweep.read_done(tmp_path / "s" / "runs" / c.run_id() / "done")["threads"] == 1
    assert main(_train_args(tmp_path, c)) == 0
    assert json.loads((tmp_path / "rec.csv.done").read_text())["threads"] == torch.get_num_threads()


def test_a_learning_rate_beyond_float32_diverges_instead_of_failing(tmp_path):
    records = train.run(cfg(lr=1e308, epochs=1))
    assert records["status"].tolist() == ["diverged"]
    report = sweep.run_sweep([cfg(lr=1e308, epochs=1, optimizer="adam")], tmp_path, bar=False)
    assert list(report.finished.values()) == ["diverged"] and not report.failed
