"""Long runs can be watched: a bar over each run's optimizer steps with its ETA (train and sweeps), and the
records of runs in flight (``staleopt results --partial``)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from staleopt import sweep, train
from staleopt.checkpoint import Checkpoint
from staleopt.cli import main
from staleopt.config import RunConfig
from staleopt.optimizer import PipelineOptimizer

from helpers import PATIENCE, wait_for

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(model="mlp", model_kwargs={"depth": 2, "hidden": 16}, data="synthetic",
             data_kwargs={"num_samples": 250, "input_shape": [1, 8], "num_classes": 4}, batch_size=16, epochs=3,
             lr=0.05, method="pipemare", stages=3)  # 12 steps per epoch, 36 in all
#: tqdm's line: "<desc>:  42%|...| 15/36 [00:01<00:02, 9.8step/s, ...]" (elapsed<remaining)
BAR = re.compile(r"(?P<desc>[0-9a-f]{16} [\w-]+ P=\S+): +\d+%\|[^|]*\| (?P<n>\d+)/(?P<total>\d+) "
                 r"\[(?P<elapsed>[\d:]+)<(?P<eta>[\d:]+|\?),? ?(?P<rest>[^\]]*)\]")


def bars(stderr: str):
    """Every state a tqdm bar was drawn in, in order: dicts with desc, n, total, eta (seconds or None), rest."""
    out = []
    for m in BAR.finditer(stderr.replace("\r", "\n")):
        eta = None if m["eta"] == "?" else sum(int(v) * 60 ** i for i, v in enumerate(reversed(m["eta"].split(":"))))
        out.append({"desc": m["desc"], "n": int(m["n"]), "total": int(m["total"]), "eta": eta, "rest": m["rest"]})
    return out


@pytest.fixture
def slow_steps(monkeypatch):
    """Each optimizer step takes 60 ms more, so a 36-step run lasts long enough for an ETA in seconds."""
    step = PipelineOptimizer.step

    def slow(self, *args, **kwargs):
        time.sleep(0.06)
        return step(self, *args, **kwargs)
    monkeypatch.setattr(PipelineOptimizer, "step", slow)


def test_train_progress_counts_steps_and_shows_the_eta(tmp_path, capsys, slow_steps):
    c = RunConfig(**SMALL)
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))
    assert main(["train", "--config", str(tmp_path / "c.json"), "--progress"]) == 0
    seen = bars(capsys.readouterr().err)
    assert seen and {b["desc"] for b in seen} == {f"{c.run_id()} pipemare P=3"} and {b["total"] for b in seen} == {36}
    assert seen[-1]["n"] == 36 and "epoch=3/3" in seen[-1]["rest"]
    assert [b["n"] for b in seen] == sorted(b["n"] for b in seen)
    assert any(b["n"] % 12 for b in seen)  # drawn within epochs, not only at their ends
    # after a few steps the ETA is known and about (36 - n) >= 24 steps of >= 60 ms: >= 1.4 s, not 0
    early = [b for b in seen if 3 <= b["n"] <= 12 and b["eta"] is not None]
    assert early and all(b["eta"] >= 1 for b in early), early


def test_a_resumed_train_shows_progress_from_its_checkpoint(tmp_path, capsys):
    c = RunConfig(**SMALL)
    out = tmp_path / "rec.csv"
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))
    ckpt = Checkpoint(out.with_name("rec.csv.ckpt"), every=5)
    save = ckpt.save

    class Stop(Exception):
        pass

    def stop_at_20(state):
        save(state)
        if state["optimizer"]["staleopt"]["step"] == 20:
            raise Stop
    ckpt.save = stop_at_20
    with pytest.raises(Stop):
        train.run(c, checkpoint=ckpt)
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "c.json"), "--out", str(out), "--progress"]) == 0
    captured = capsys.readouterr()
    seen = bars(captured.err)
    assert seen[0]["n"] == 20 and seen[-1]["n"] == 36 and "resumed from its checkpoint at step 20" in captured.out


def test_a_sweep_shows_each_runs_steps_and_its_own_bar_over_runs(tmp_path, capsys):
    configs = [RunConfig(**SMALL), RunConfig(**{**SMALL, "stages": 1, "epochs": 2})]
    sweep.run_sweep(configs, tmp_path / "out", progress=True, bar=True)
    err = capsys.readouterr().err
    seen = bars(err)
    for c, total in zip(configs, (36, 24)):
        mine = [b for b in seen if b["desc"].startswith(c.run_id())]
        assert mine and mine[-1]["n"] == mine[-1]["total"] == total
    assert re.search(r"sweep: 100%\|[^|]*\| 2/2 \[[\d:]+<[\d:]+", err.replace("\r", "\n"))


def _env(**extra):
    path = os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def gated_train(config, progress=False, checkpoint=None):
    """``train.run`` whose steps after the first epoch wait while the file ``$GATE`` exists."""
    step, gate = PipelineOptimizer.step, os.environ["GATE"]

    def gated(self, *args, **kwargs):
        while self.step_count >= 62 and os.path.exists(gate):  # 62 steps per epoch
            time.sleep(0.01)
        return step(self, *args, **kwargs)
    PipelineOptimizer.step = gated
    try:
        return train.run(config, progress=progress, checkpoint=checkpoint)
    finally:
        PipelineOptimizer.step = step


SWEEP = """\
name = "watch"
[base]
model = "mlp"
model_kwargs = {depth = 2, hidden = 16}
data = "synthetic"
data_kwargs = {num_samples = 1250, input_shape = [1, 8], num_classes = 4}
batch_size = 16
epochs = 4
lr = 0.05
method = "pipemare"
[grid]
stages = [3, 2]
"""


def test_worker_processes_show_each_runs_progress(tmp_path):
    path = tmp_path / "watch.toml"
    path.write_text(SWEEP.replace("epochs = 4", "epochs = 1"))
    proc = subprocess.run([sys.executable, "-m", "staleopt.cli", "sweep", str(path), "--out", str(tmp_path / "o"),
                           "--workers", "2", "--progress", "--no-bar"], env=_env(), capture_output=True, text=True,
                          timeout=PATIENCE)
    assert proc.returncode == 0, proc.stderr
    seen = bars(proc.stderr)
    for c in sweep.load_sweep(path).configs:
        mine = [b for b in seen if b["desc"].startswith(c.run_id())]
        assert mine and mine[-1]["n"] == mine[-1]["total"] == 62, proc.stderr[-2000:]


def test_records_of_a_run_in_flight_can_be_followed(tmp_path, capsys):
    path = tmp_path / "watch.toml"
    path.write_text(SWEEP)
    first = sweep.load_sweep(path).configs[0]
    out = tmp_path / "out"
    records = out / "runs" / first.run_id() / "records.csv"
    gate = tmp_path / "gate"
    gate.touch()  # the first run stops after its first epoch until the gate is removed
    proc = subprocess.Popen([sys.executable, "-m", "staleopt.cli", "sweep", str(path), "--out", str(out), "--no-bar",
                             "--train-fn", "test_progress:gated_train"], env=_env(GATE=str(gate)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: records.exists() and len(pd.read_csv(records)) >= 1, "first epoch's record", proc)
        # the run is in flight: results leaves it out, --partial shows its epochs so far
        assert sweep.run_state(records.parent) == "running"
        assert main(["results", str(out)]) == 0
        assert "no finished runs yet" in capsys.readouterr().out
        assert main(["results", str(out), "--partial"]) == 0
        shown = capsys.readouterr().out
        assert "--partial: runs not done count with their last recorded epoch" in shown
        listed = main(["sweep", str(path), "--out", str(out), "--dry-run"]), capsys.readouterr().out.splitlines()
        assert listed[0] == 0 and listed[1][0].startswith(f"{first.run_id()} running")
        assert re.search(r"claimed by \S+ \(launch \w+\), heartbeat \d+ s ago; 1/4 epochs recorded, checkpoint$",
                         listed[1][0]), listed[1][0]
        partial = sweep.collect(out, partial=True)
        mid = partial[partial.run == first.run_id()].reset_index(drop=True)
        assert list(mid["epoch"]) == [1] and mid["step"].iloc[0] == 62
        gate.unlink()
        assert proc.wait(timeout=PATIENCE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    final = sweep.collect(out)
    final = final[final.run == first.run_id()].reset_index(drop=True)
    assert len(final) == 4
    cols = [c for c in train.RECORD_COLUMNS if c != "wall_time"]
    pd.testing.assert_frame_equal(mid[cols], final[cols].iloc[:len(mid)])  # the epochs seen early are final
