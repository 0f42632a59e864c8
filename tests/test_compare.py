"""One's own model and data (defined in a file the test writes) through a resumable comparison, sweeps from TOML,
records, claims and time to accuracy, with no change to the package: staleopt.compare and staleopt.registry."""
import json
import math
import textwrap
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import staleopt
from staleopt import data as datasets
from staleopt import models, registry, speedup, sweep
from staleopt.cli import main
from staleopt.config import RunConfig
from staleopt.errors import ConfigError, LoopError

USER_FILE = textwrap.dedent('''\
    """A user's own model and data, nothing from staleopt."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset


    def tiny_net(num_classes, input_shape, hidden=16):
        return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), hidden), nn.ReLU(),
                             nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


    def blobs(n=300, seed=0):
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(3, (n,), generator=g)
        x = 2 * torch.randn(3, 6, generator=g)[y] + torch.randn(n, 6, generator=g)
        return TensorDataset(x[:200], y[:200]), TensorDataset(x[200:], y[200:])
    ''')
SMALL = {"epochs": 2, "batch_size": 20, "lr": 0.05}


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    path = tmp_path / "my_models.py"
    path.write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)
    before = {id(reg): set(reg) for reg in (models._USER, datasets._USER)}
    yield path
    for reg in (models._USER, datasets._USER):  # this test's registrations end with it
        for name in set(reg) - before[id(reg)]:
            del reg[name]
    datasets.shape.cache_clear()


def test_compare_with_factories_from_a_user_file_in_worker_processes_then_resumes(user_file):
    tiny_net = registry.load_spec(f"{user_file}:tiny_net")
    blobs = registry.load_spec(f"{user_file}:blobs")
    out = user_file.parent / "cmp"
    result = staleopt.compare(tiny_net, blobs, methods=["gpipe", "pipemare"], stages=[2, "max"], seeds=[0, 1],
                              out=out, workers=2, bar=False, **SMALL)
    assert result.report.ok and len(result.report.finished) == 8
    runs = sweep.runs(out)
    assert set(runs["model"]) == {"tiny_net"} and set(runs["data"]) == {"blobs"}
    assert sorted(set(runs["stages"])) == [2, 3]  # "max" = the model's 3 Linear layers
    assert result.records["run"].nunique() == 8 and set(result.summary["method"]) == {"gpipe", "pipemare"}
    for name in ("records.csv", "summary.csv", "speedup.csv", "claims.csv", "report.json",
                 "accuracy_vs_stages.png", "accuracy_vs_epoch_P3.png", "accuracy_vs_time_P3.png"):
        assert (out / name).stat().st_size > 0, name
    gpipe_best = result.records[result.records["method"] == "gpipe"].groupby("run")["test_acc"].max().mean()
    assert result.target == pytest.approx(gpipe_best - 0.01)
    assert json.loads((out / "report.json").read_text())["target"] == result.target
    assert set(result.claims["verdict"]) <= {"holds", "does not hold", "not evaluated"}
    assert "P=2" in result.table().columns
    # the same call again trains nothing: every run is done
    again = staleopt.compare(tiny_net, blobs, methods=["gpipe", "pipemare"], stages=[2, "max"], seeds=[0, 1],
                             out=out, workers=1, bar=False, **SMALL)
    assert len(again.report.skipped) == 8 and not again.report.finished
    pd.testing.assert_frame_equal(again.summary, result.summary)


def test_toml_sweep_and_cli_take_file_specs(user_file, capsys):
    spec = user_file.parent / "mine.toml"
    spec.write_text(textwrap.dedent(f'''\
        name = "mine"
        [base]
        model = "my_models.py:tiny_net"
        model_kwargs = {{hidden = 8}}
        data = "my_models.py:blobs"
        data_kwargs = {{n = 250}}
        epochs = 1
        batch_size = 20
        [grid]
        method = ["gpipe", "pipedream"]
        stages = [3]
        '''))
    assert main(["sweep", str(spec), "--out", "out", "--no-bar", "--download"]) == 0
    records = sweep.collect(user_file.parent / "out")
    assert records["run"].nunique() == 2 and set(records["model"]) == {"my_models.py:tiny_net"}
    assert main(["results", "out"]) == 0
    assert main(["train", "--model", "my_models.py:tiny_net", "--data", "my_models.py:blobs", "--stages", "2",
                 "--epochs", "1", "--batch-size", "20", "--method", "pipemare"]) == 0
    assert "pipemare P=2" in capsys.readouterr().out
    assert main(["compare", "--model", "my_models.py:tiny_net", "--data", "my_models.py:blobs", "--methods",
                 "gpipe,pipemare", "--stages", "3", "--seeds", "0", "--set", "epochs=1", "--set", "batch_size=20",
                 "--set", 'model_kwargs={"hidden": 8}', "--out", "c", "--no-bar"]) == 0
    out = capsys.readouterr().out
    assert "P=3" in out and "claims" in out and (user_file.parent / "c" / "claims.csv").is_file()
    assert set(sweep.runs(user_file.parent / "c")["model_kwargs"]) == {'{"hidden":8}'}
    assert main(["compare", "--model", "my_models.py:tiny_net", "--set", "epochs"]) == 2


def test_registered_name_in_config_and_errors(user_file):
    fn = registry.load_spec("my_models.py:tiny_net")
    assert staleopt.register_model("tiny_net", fn) == "tiny_net"
    assert staleopt.register_model("tiny_net", fn) == "tiny_net"  # the same factory again: a no-op
    staleopt.register_data("blobs", registry.load_spec("my_models.py:blobs"))
    cfg = RunConfig(model="tiny_net", data="blobs", model_kwargs={"hidden": 4}, stages="max").resolve()
    assert cfg.stages == 3
    with pytest.raises(ConfigError, match="unknown option 'width'"):
        RunConfig(model="tiny_net", data="blobs", model_kwargs={"width": 4})
    with pytest.raises(ConfigError, match="already registered.*replace=True"):
        staleopt.register_model("tiny_net", lambda num_classes, input_shape: nn.Linear(1, 1))
    with pytest.raises(ConfigError, match="built in"):
        staleopt.register_model("mlp", fn)
    with pytest.raises(ConfigError, match="without ':'"):
        staleopt.register_model("a:b", fn)
    with pytest.raises(ConfigError, match="model = 'my_cnn' is not allowed.*register_model"):
        RunConfig(model="my_cnn")
    with pytest.raises(ConfigError, match="cannot load model 'my_models.py:nothing'"):
        RunConfig(model="my_models.py:nothing")
    with pytest.raises(ConfigError, match="not a file"):
        RunConfig(model="elsewhere.py:tiny_net")
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        staleopt.register_model("not_a_model", lambda: 3)
        models.get("not_a_model")


def test_a_lambda_cannot_go_to_worker_processes(user_file, tmp_path):
    staleopt.register_model("tiny_net", lambda num_classes, input_shape: nn.Linear(6, num_classes))
    staleopt.register_model("unused", lambda num_classes, input_shape: nn.Linear(6, num_classes))
    cfgs = [RunConfig(model="tiny_net", data="my_models.py:blobs", stages=1, seed=s, **SMALL) for s in (0, 1)]
    with pytest.raises(ConfigError, match="model 'tiny_net' .*cannot be sent to worker processes.*top level"):
        sweep.run_sweep(cfgs, tmp_path / "w", workers=2, bar=False)
    assert set(registry.snapshot({"mlp"}, {"blobs"})["model"]) == set()  # only what the runs name is sent


def test_factory_without_the_data_shape_and_data_read_off_the_samples():
    x = torch.randn(10, 2, 5)
    d = datasets.from_datasets(TensorDataset(x[:8], torch.tensor([0, 1, 4, 0, 1, 1, 0, 0])),
                               TensorDataset(x[8:], torch.tensor([2, 0])), name="mine")
    assert (d.num_classes, d.input_shape, d.task) == (5, (2, 5), "classification")
    r = datasets.from_datasets(TensorDataset(x[:8], torch.randn(8, 3)), TensorDataset(x[8:], torch.randn(2, 3)))
    assert (r.num_classes, r.task) == (3, "regression")
    staleopt.register_model("fixed_shape", _fixed)
    try:
        assert isinstance(models.get("fixed_shape", num_classes=3, input_shape=(6,)), nn.Linear)
    finally:
        del models._USER["fixed_shape"]


def _fixed():
    return nn.Linear(6, 3)


def test_time_to_accuracy_needs_no_registration_of_the_model():
    """Records of a registered model, read by a process that never registered it (staleopt results)."""
    rows = []
    for method in ("gpipe", "pipemare-w"):
        for epoch in (1, 2):
            rows.append({"run": method, "model": "nobody_registered_this", "data": "nor_this", "method": method,
                         "stages": 4, "microbatches": 4, "batch_size": 8, "epochs": 2, "lr": 0.1, "seed": 0,
                         "epoch": epoch, "step": 10 * epoch, "test_acc": 0.5 * epoch, "status": "ok"})
    table = speedup.speedup_table(pd.DataFrame(rows), 0.9).set_index("method")
    assert table.loc["pipemare-w", "reached"] == 1 and math.isfinite(table.loc["pipemare-w", "time_to_target"])


def test_tutorial_shows_the_code_of_its_file():
    """docs/tutorial.md's model and data are experiments/tutorial_models.py's, which its sweep file and commands name."""
    from staleopt import docgen
    repo = Path(__file__).resolve().parents[1]
    code = (repo / "experiments" / "tutorial_models.py").read_text()
    body = code[code.index('"""', 3) + 4:]  # after the module docstring
    page = docgen.code_blocks((repo / "docs" / "tutorial.md").read_text())
    assert body.strip() in page[0].code


def test_a_run_that_failed_is_named_in_a_warning_and_the_next_call_retries_it(tmp_path, monkeypatch):
    """A run whose data factory raised (its third call: the first resolves the shapes, the second feeds the first
    run) is left out of the tables with a warning that says so (before, the tables were silently over the other
    runs); calling compare again retries it."""
    monkeypatch.chdir(tmp_path)
    calls = []

    def flaky_net(num_classes, input_shape):
        return nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, num_classes))

    def flaky_blobs():
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("boom")
        g = torch.Generator().manual_seed(0)
        y = torch.randint(3, (120,), generator=g)
        x = 2 * torch.randn(3, 6, generator=g)[y] + torch.randn(120, 6, generator=g)
        return TensorDataset(x[:80], y[:80]), TensorDataset(x[80:], y[80:])

    before = {id(reg): set(reg) for reg in (models._USER, datasets._USER)}
    try:
        kw = dict(methods=["gpipe", "pipemare"], stages=[2], seeds=[0, 1], out="cmp", bar=False, epochs=1,
                  batch_size=20, lr=0.05)
        with pytest.warns(UserWarning, match=r"1 of 4 runs of this comparison did not finish: 1 failed \(\w+\)\. "
                                             r"Its tables, claims and figures are over the 3 runs"):
            result = staleopt.compare(flaky_net, flaky_blobs, **kw)
        failed, = result.report.failed
        assert "boom" in (tmp_path / "cmp" / "runs" / failed / "error.txt").read_text()
        assert result.summary["runs"].sum() == 3
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            again = staleopt.compare(flaky_net, flaky_blobs, **kw)
        assert again.report.ok and again.summary["runs"].sum() == 4 and list(again.report.finished) == [failed]
    finally:
        for reg in (models._USER, datasets._USER):
            for name in set(reg) - before[id(reg)]:
                del reg[name]
        datasets.shape.cache_clear()


def test_a_report_removes_the_files_of_the_last_report_it_does_not_write(user_file):
    """Two comparisons into one ``out``: the second has no gpipe (no target, so no time table or time figure)
    and a smaller largest P; the first one's speedup.csv and P=3 figures would contradict its tables: gone."""
    tiny_net = registry.load_spec(f"{user_file}:tiny_net")
    blobs = registry.load_spec(f"{user_file}:blobs")
    out = user_file.parent / "cmp"
    first = staleopt.compare(tiny_net, blobs, methods=["gpipe", "pipemare"], stages=[2, 3], seeds=[0], out=out,
                             bar=False, **SMALL)
    names = {p.name for p in first.files + first.figures}
    assert {"speedup.csv", "accuracy_vs_time_P3.png", "accuracy_vs_epoch_P3.png"} <= names
    assert all((out / n).is_file() for n in names)
    second = staleopt.compare(tiny_net, blobs, methods=["pipemare"], stages=[2], seeds=[0], out=out, bar=False,
                              **SMALL)
    now = {p.name for p in second.files + second.figures}
    assert "speedup.csv" not in now and "accuracy_vs_epoch_P2.png" in now
    for name in names - now:
        assert not (out / name).exists(), name
    listed = json.loads((out / "report.json").read_text())
    assert sorted(listed["files"] + listed["figures"] + ["report.json"]) == sorted(now)
    assert all((out / n).is_file() for n in now)
    (out / "mine.txt").write_text("a user's file")  # not a report's: never touched
    staleopt.compare(tiny_net, blobs, methods=["gpipe", "pipemare"], stages=[2], seeds=[0], out=out, bar=False,
                     **SMALL)
    assert (out / "mine.txt").read_text() == "a user's file"


def _scalar_targets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
    return TensorDataset(x[:40], y[:40]), TensorDataset(x[40:], y[40:])


def _token_pairs():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (48, 9), generator=g)
    return TensorDataset(tokens[:40, :-1], tokens[:40, 1:]), TensorDataset(tokens[40:, :-1], tokens[40:, 1:])


def test_scalar_regression_targets_train_on_the_per_sample_loss():
    """Scalar targets ``(B,)`` and the model's ``(B, 1)`` output (num_classes = 1): the loss is the mean squared
    error per sample (torch's mse_loss broadcast them into (B, B): a test loss some 15x too large, and a model
    that could only learn the mean)."""
    from staleopt import train
    staleopt.register_data("scalar_targets", _scalar_targets, replace=True)
    staleopt.register_model("linear_head", lambda num_classes, input_shape: nn.Sequential(
        nn.Linear(input_shape[0], 8), nn.Tanh(), nn.Linear(8, num_classes)), replace=True)
    cfg = RunConfig(model="linear_head", data="scalar_targets", method="gpipe", stages=2, epochs=1, batch_size=10,
                    lr=0.01)
    records = train.run(cfg)
    model = models.get("linear_head", seed=0, num_classes=1, input_shape=(4,))
    _, test = _scalar_targets()
    x, y = test.tensors
    d = datasets.from_datasets(*_scalar_targets())
    untrained = train._evaluate(model, d, torch.device("cpu"), "linear_head")["test_loss"]
    with torch.no_grad():
        assert math.isclose(untrained, float(((model(x).squeeze(1) - y) ** 2).mean()), rel_tol=1e-6)
    assert records["test_loss"].iloc[-1] < 0.9 * untrained


def test_own_token_data_is_a_language_model_task_and_wrong_outputs_are_refused():
    from staleopt import train
    d = datasets.from_datasets(*_token_pairs(), name="tokens")
    assert (d.task, d.num_classes, d.input_shape) == ("lm", 16, (8,))
    with pytest.raises(staleopt.errors.DataError, match="task 'classification' needs one integer class"):
        datasets.from_datasets(*_token_pairs(), task="classification")
    staleopt.register_data("token_pairs", _token_pairs, replace=True)
    records = train.run(RunConfig(model="gpt", data="token_pairs", method="pipemare", stages=2, epochs=1,
                                  batch_size=8, lr=0.01, optimizer="adam", model_kwargs={"d_model": 16, "heads": 2}))
    assert math.isfinite(records["test_ppl"].iloc[-1]) and records["test_ppl"].iloc[-1] < 40
    staleopt.register_model("three_outputs", lambda num_classes, input_shape: nn.Linear(6, 3), replace=True)
    staleopt.register_data("five_classes", lambda: (TensorDataset(torch.randn(20, 6), torch.arange(20) % 5),
                                                    TensorDataset(torch.randn(5, 6), torch.arange(5))), replace=True)
    with pytest.raises(ConfigError, match=r"'three_outputs' returns shape \(10, 3\).*classification, num_classes "
                                          r"= 5.*needs \(10, 5\)"):
        train.run(RunConfig(model="three_outputs", data="five_classes", stages=1, epochs=1, batch_size=10))



@pytest.mark.parametrize("kind, fix", [("tuple", "its first element"), ("dict", "its 'logits' field"),
                                       ("object", "its 'logits' field"), ("none", "make the forward return a tensor")])
def test_a_model_that_returns_no_tensor_is_told_which_part_to_return(kind, fix):
    """A tuple, a dict or a Hugging Face-style output with .logits is refused naming the part to return (the
    message spoke of shapes and num_classes, which were not the problem)."""
    from types import SimpleNamespace

    from staleopt import train

    class Wrapped(nn.Module):
        def __init__(self, num_classes, input_shape):
            super().__init__()
            self.fc = nn.Linear(6, num_classes)

        def forward(self, x):
            out = self.fc(x)
            return {"tuple": (out, x), "dict": {"logits": out}, "object": SimpleNamespace(logits=out),
                    "none": None}[kind]

    staleopt.register_model("wrapped_output", Wrapped, replace=True)
    staleopt.register_data("five_classes", lambda: (TensorDataset(torch.randn(20, 6), torch.arange(20) % 5),
                                                    TensorDataset(torch.randn(5, 6), torch.arange(5))), replace=True)
    if kind in ("tuple", "dict"):  # the trainer's check of the output
        with pytest.raises(ConfigError, match=rf"'wrapped_output' returns a \w+, but the trainer needs one "
                                              rf"tensor.*{fix}"):
            train.run(RunConfig(model="wrapped_output", data="five_classes", stages=1, epochs=1, batch_size=10))
    else:  # no tensor the PipelineOptimizer's hooks can reach: it refuses the forward first
        with pytest.raises(LoopError, match=rf"returned a \w+ in which torch.utils._pytree finds no tensor.*{fix}"):
            train.run(RunConfig(model="wrapped_output", data="five_classes", stages=1, epochs=1, batch_size=10))


ROOT_SCALE = textwrap.dedent('''\
    import torch
    from torch import nn


    class RootScale(nn.Module):
        """A learned temperature registered at the root (unit 0 by registration) and applied to the logits last."""

        def __init__(self, num_classes, input_shape):
            super().__init__()
            self.temperature = nn.Parameter(torch.ones(()))
            self.body = nn.Sequential(nn.Linear(input_shape[-1], 8), nn.ReLU(), nn.Linear(8, num_classes))

        def forward(self, x):
            return self.body(x) * self.temperature
    ''')


def test_unit_order_execution_trains_a_model_registered_out_of_forward_order(user_file, capsys):
    """Registration order puts the root's temperature in stage 0 though it scales the last stage's output: refused,
    naming unit_order='execution', which orders the units by a forward on the first training microbatch (the
    temperature joins the last stage) from the config, the CLI and compare; the default keeps old run ids."""
    (user_file.parent / "root_scale.py").write_text(ROOT_SCALE)
    base = dict(model="root_scale.py:RootScale", data=f"{user_file}:blobs", method="pipemare", stages=2,
                epochs=1, batch_size=20, lr=0.05, max_steps=4)
    with pytest.raises(staleopt.errors.StageOrderError, match="unit_order='execution'"):
        staleopt.train.run(RunConfig(**base), progress=False)
    config = RunConfig(**base, unit_order="execution")
    records = staleopt.train.run(config, progress=False)
    assert set(records["status"]) == {"ok"} and records["train_loss"].notna().all()
    assert config.run_id() != RunConfig(**base).run_id()
    assert RunConfig(**base, unit_order="registration").run_id() == RunConfig(**base).run_id()
    model = registry.load_spec("root_scale.py:RootScale")(3, (6,))
    x = datasets.load(f"{user_file}:blobs").train[:5][0]
    part = staleopt.partition_model(model, 2, example_input=x)
    assert [list(s.modules) for s in part] == [["body.0", "body.2"], ["<root>"]]
    assert main(["--threads", "1", "train", "--model", "root_scale.py:RootScale", "--data", f"{user_file}:blobs",
                 "--method", "pipemare", "--stages", "2", "--batch-size", "20", "--epochs", "1", "--max-steps", "3",
                 "--unit-order", "execution", "--no-progress"]) == 0
    with pytest.raises(ConfigError, match="unit_order"):
        RunConfig(**base, unit_order="forward")


def test_compare_out_never_overwrites_files_no_report_wrote(tmp_path, capsys):
    """compare --out D (and demo --out D) replaced a finished train --out D/records.csv run and the user's own
    summary.csv, exit 0: refused before training; an earlier report's or sweep's folder is rewritten as before."""
    from staleopt.compare import check_report_folder
    (tmp_path / "summary.csv").write_text("mine\n")
    with pytest.raises(ConfigError, match="summary.csv, which the report would overwrite"):
        check_report_folder(tmp_path)
    assert main(["compare", "--model", "mlp", "--data", "synthetic", "--stages", "1", "--seeds", "0",
                 "--out", str(tmp_path)]) == 2
    assert (tmp_path / "summary.csv").read_text() == "mine\n" and not (tmp_path / "runs").exists()
    (tmp_path / "records.csv.done").write_text("{}")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="finished staleopt train run"):
        check_report_folder(tmp_path)
    (tmp_path / "records.csv.done").unlink()
    check_report_folder(tmp_path)  # a sweep's folder: its report files are its own


def test_compare_out_never_overwrites_records_its_runs_cannot_rebuild(tmp_path):
    """A copy of a report (report.json, records.csv, no runs/) counted as an earlier report's folder: compare --out
    it replaced the records of 42 finished runs with its own, exit 0. Refused before training while records.csv
    holds a run without a finished runs/<id>, or does not read as records; passes once every run is there."""
    from staleopt.compare import check_report_folder
    repo = Path(__file__).resolve().parents[1]
    for name in ("records.csv", "report.json"):
        (tmp_path / name).write_bytes((repo / "docs" / "demo" / name).read_bytes())
    before = (tmp_path / "records.csv").read_bytes()
    assert main(["compare", "--model", "mlp", "--data", "synthetic", "--stages", "1", "--seeds", "0",
                 "--out", str(tmp_path)]) == 2
    assert (tmp_path / "records.csv").read_bytes() == before and not (tmp_path / "runs").exists()
    ids = sorted(set(pd.read_csv(tmp_path / "records.csv")["run"].astype(str)))
    with pytest.raises(ConfigError, match="holds 42 run"):  # (the same runs retrained into a copy: still lost)
        check_report_folder(tmp_path, runs=ids)
    ids = sorted(set(pd.read_csv(tmp_path / "records.csv")["run"].astype(str)))
    for run_id in ids[:-1]:
        (tmp_path / "runs" / run_id).mkdir(parents=True)
        (tmp_path / "runs" / run_id / "done").write_text("{}")
    with pytest.raises(ConfigError, match=f"holds 1 run\\(s\\) that .* does not \\(run {ids[-1]}\\)"):
        check_report_folder(tmp_path)
    check_report_folder(tmp_path, runs=[ids[-1]])  # (a damaged run's folder deleted: the report trains it again)
    (tmp_path / "runs" / ids[-1]).mkdir()
    (tmp_path / "runs" / ids[-1] / "done").write_text("{}")
    check_report_folder(tmp_path)  # every run rebuildable: the folder is the report's
    (tmp_path / "records.csv").write_text("not,a\nreport,\n")
    with pytest.raises(ConfigError, match="does not read as a report's records"):
        check_report_folder(tmp_path)


def test_compare_target_without_gpipe_says_there_is_no_speedup(tmp_path, capsys):
    """--target without gpipe among --methods printed "speedup over GPipe" with a bare "-" in every cell, which
    read as "never reached" though every run reached it; the target still times the runs (speedup.csv, the figure
    against pipeline time), so the table says there is no gpipe run and keeps the counts."""
    out = tmp_path / "c"
    assert main(["compare", "--model", "mlp", "--data", "synthetic", "--set", 'data_kwargs={"num_samples": 100}',
                 "--set", "epochs=1", "--set", "max_steps=2", "--no-bar", "--seeds", "0", "--methods",
                 "pipedream,pipemare", "--stages", "1", "--target", "0.05", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "time to accuracy 0.050: no gpipe runs, so no speedup over GPipe (add gpipe to --methods" in printed
    assert printed.count("- (1/1 reached, no gpipe time)") == 2
    assert pd.read_csv(out / "speedup.csv")["reached"].tolist() == [1, 1]
    assert (out / "accuracy_vs_time_P1.png").exists()


def _raises(num_classes, input_shape):
    raise KeyError("no such layer")


@pytest.mark.parametrize("extra, why", [
    (["--target", "-3"], "lies in [0, 1], got -3.0"), (["--target", "85"], "0.85 for 85%"),
    (["--target", "nan"], "a finite number"), (["--metric", "test_ppl"], "a classification run records no"),
    (["--metric", "test_loss", "--set", 'data_kwargs={"task": "regresion"}'], "'regresion'")])  # (a KeyError)
def test_compare_refuses_a_target_or_metric_no_run_records_before_training(tmp_path, capsys, extra, why):
    """Each was refused only after every run of the comparison had trained."""
    out = tmp_path / "c"
    assert main(["compare", "--model", "mlp", "--data", "synthetic", "--stages", "1", "--seeds", "0",
                 "--no-bar", "--out", str(out)] + extra) == 2
    assert why in capsys.readouterr().err and not out.exists()
    with pytest.raises(ConfigError, match="a finite number"):
        speedup.check_target(math.inf, None)  # (a user's dataset: its metric is not known before it loads)


def test_a_users_factory_that_raises_is_a_config_error_naming_it_and_its_arguments():
    staleopt.register_model("raising_net", _raises)
    try:
        with pytest.raises(ConfigError, match=r"model 'raising_net' raised KeyError when built with "
                                              r"\{'num_classes': 3, 'input_shape': \(6,\)\}.*no such layer.*fix the"):
            models.num_units("raising_net", num_classes=3, input_shape=(6,))
    finally:
        del models._USER["raising_net"]


@pytest.mark.parametrize("setting, says", [("target=0.9", "pass --target"), ("workers=2", "pass --workers"),
                                           ("threads=2", "pass --worker-threads"), ("claims=none", "compare(claims=)"),
                                           ("stages=2", "pass --stages"), ("model=mlp", "pass --model")])
def test_compare_set_of_the_comparisons_own_arguments_is_refused_before_training(tmp_path, capsys, setting, says):
    """--set target=0.9 (workers, threads, metric, out, bar, stages, model, ...) reached compare() twice: a raw
    TypeError; --set claims=none trained every run, then failed evaluating the string as claims, with no report."""
    out = tmp_path / "c"
    assert main(["compare", "--model", "mlp", "--data", "synthetic", "--stages", "1", "--seeds", "0", "--no-bar",
                 "--out", str(out), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and not out.exists()
    with pytest.raises(ConfigError, match="claims must be a list of staleopt.claims.Claim"):
        staleopt.compare("mlp", "synthetic", stages=[1], seeds=[0], out=tmp_path / "d", claims="none")
    assert not (tmp_path / "d").exists()


def test_compare_leaves_a_damaged_run_out_with_a_warning(tmp_path):
    """A finished run whose records.csv was changed afterwards made compare raise RunFileError after the sweep,
    with no report, though its docstring says such runs are left out with a warning (as results does)."""
    import warnings
    kw = dict(methods=["gpipe", "1f1b"], stages=[2], seeds=[0], out=tmp_path / "c", epochs=1, max_steps=3,
              bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = staleopt.compare("mlp", "synthetic", **kw)
    run = sorted(first.records["run"].unique())[0]
    path = tmp_path / "c" / "runs" / run / "records.csv"
    path.write_text(path.read_text().replace(",3,", ",4,", 1))  # (its step no longer the one its done file holds)
    with pytest.warns(UserWarning, match=f"1 damaged \\({run}\\).*Damaged: .*records.csv"):
        again = staleopt.compare("mlp", "synthetic", **kw)
    assert set(again.records["run"]) == set(first.records["run"]) - {run}
