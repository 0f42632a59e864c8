"""The tool talks while it works: staleopt train prints each epoch as it ends, Ctrl-C stops with one line saying
how to resume, a sweep's bar names its runs in flight, and `staleopt demo --quick` is the demo's recipe, shorter."""
import json

import pandas as pd
import pytest

from staleopt import sweep, train
from staleopt.cli import main
from staleopt.commands.demo import DEFAULT_SWEEP, QUICK_SWEEP
from staleopt.config import RunConfig

TINY = {"model": "mlp", "model_kwargs": {"depth": 2, "hidden": 8}, "data": "synthetic",
        "data_kwargs": {"num_samples": 200, "input_shape": [1, 8], "num_classes": 3}, "batch_size": 20,
        "epochs": 3, "method": "pipemare", "stages": 3}


def test_each_epoch_is_reported_as_it_ends(monkeypatch):
    batches = []
    real = train.datasets.batches

    def counting(dataset, *args, **kwargs):
        for b in real(dataset, *args, **kwargs):
            if kwargs.get("shuffle"):
                batches.append(1)
            yield b
    monkeypatch.setattr(train.datasets, "batches", counting)
    seen = []
    records = train.run(RunConfig(**TINY), on_epoch=lambda r: seen.append((r["epoch"], len(batches), r)))
    # at the end of epoch e, exactly e epochs of minibatches (8 of 20 samples each) had been trained
    assert [(e, n) for e, n, _ in seen] == [(1, 8), (2, 16), (3, 24)]
    pd.testing.assert_frame_equal(pd.DataFrame([r for _, _, r in seen]), records)  # NaN columns (test_ppl) equal


def test_train_command_prints_a_row_per_epoch(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(TINY))
    assert main(["train", "--config", str(tmp_path / "c.json"), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["epoch", "step"])
    assert [line.split()[0] for line in lines[head + 1:head + 4]] == ["1", "2", "3"]


@pytest.mark.parametrize("argv, hint", [
    (["train", "--out", "x.csv"], "resume from x.csv.ckpt"),
    (["train"], "pass --out FILE"),
    (["sweep", "s.toml"], "finished runs are kept"),
])
def test_ctrl_c_is_one_line_that_says_how_to_resume(argv, hint, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("staleopt.commands.train.run", interrupted)
    monkeypatch.setattr("staleopt.commands.sweep.run_sweep_command", interrupted)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "interrupted" in err and hint in err and "Traceback" not in err


def test_sweep_bar_names_the_runs_in_flight(tmp_path):
    cfg = RunConfig(**TINY)
    run_dir = tmp_path / "runs" / cfg.run_id()
    run_dir.mkdir(parents=True)
    (run_dir / "records.csv").write_text("epoch,step\n1,8\n2,16\n")
    text = sweep._in_flight([(None, cfg.to_dict(), str(run_dir), False, {})])
    assert text == f"{cfg.run_id()[:6]} pipemare P=3 2/3 ep"


def test_quick_demo_is_the_demo_recipe_on_fewer_runs():
    """The same recipe (so its runs are the demo's own runs of those methods and that seed), fewer methods and
    seeds."""
    full, quick = sweep.load_sweep(DEFAULT_SWEEP), sweep.load_sweep(QUICK_SWEEP)
    assert quick.base == full.base
    assert set(quick.grid["method"]) < set(full.grid["method"]) and quick.grid["stages"] == full.grid["stages"]
    assert set(quick.grid["seed"]) < set(full.grid["seed"])
    assert len(quick.configs) == 8 and {c.run_id() for c in quick.configs} < {c.run_id() for c in full.configs}
    assert main(["demo", "--quick", "--sweep", str(DEFAULT_SWEEP)]) == 2  # one sweep file or the other
