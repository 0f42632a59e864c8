"""Training one config: the documented recipe by hand, determinism, divergence, defaults, hardware columns, CLI."""
import json
import math
import sys

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from staleopt import data as datasets
from staleopt import hardware, models, train
from staleopt.cli import main
from staleopt.config import RunConfig
from staleopt.errors import ConfigError
from staleopt.optimizer import PipelineOptimizer

SMALL = dict(model="mlp", model_kwargs={"depth": 3, "hidden": 16}, data="synthetic",
             data_kwargs={"num_samples": 250, "input_shape": [1, 8], "num_classes": 4, "separation": 0.5},
             batch_size=16, epochs=3, lr=0.05)


def cfg(**kw):
    return RunConfig(**{**SMALL, **kw})


def reference(config: RunConfig, anneal_steps: int):
    """The module docstring's recipe written out by hand for a step lr schedule (test loss after training)."""
    d = datasets.load(config.data, **config.data_kwargs)
    spe = len(d.train) // config.batch_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = models.get(config.model, seed=config.seed, num_classes=d.num_classes, input_shape=d.input_shape,
                           **config.model_kwargs)
        base = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
        opt = PipelineOptimizer(model, base, stages=config.stages, schedule=config.method,
                                method_args={"anneal_steps": anneal_steps, "decay": 0.1})
        bounds = [m * spe for m in config.lr_milestones]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: config.lr_gamma ** sum(k >= b for b in bounds))
        g = torch.Generator().manual_seed(config.seed)
        losses = []
        for _ in range(config.epochs):
            n = len(d.train)
            order = torch.randperm(n, generator=g)
            x_all, y_all = d.train.tensors
            for s in range(0, n - n % config.batch_size, config.batch_size):
                idx = order[s:s + config.batch_size]
                opt.zero_grad()
                loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
                loss.backward()
                opt.step()
                sched.step()
                losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            x, y = d.test.tensors
            out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).sum().item() / len(y), losses, spe


def test_run_follows_the_documented_recipe():
    c = cfg(method="pipemare", stages=4, lr_schedule="step", lr_milestones=[2], lr_gamma=0.5)
    rec = train.run(c)
    # first lr phase = 2 epochs of 200 // 16 = 12 steps; K = a quarter of it
    test_loss, test_acc, losses, spe = reference(c, anneal_steps=(2 * 12) // 4)
    assert spe == 12 and rec["step"].tolist() == [12, 24, 36]
    assert rec["test_loss"].iloc[-1] == pytest.approx(test_loss, rel=1e-6)
    assert rec["test_acc"].iloc[-1] == pytest.approx(test_acc, abs=1e-12)
    assert rec["train_loss"].tolist() == pytest.approx([sum(losses[i:i + 12]) / 12 for i in (0, 12, 24)],
                                                       rel=1e-12)
    # another K gives other numbers, so the comparison above can fail
    assert reference(c, anneal_steps=1)[0] != pytest.approx(test_loss, rel=1e-6)
    assert rec["lr_base"].tolist() == [0.05, 0.025, 0.025]


def test_same_config_same_records_and_caller_rng_untouched():
    c = cfg(method="pipedream", stages=3, seed=7)
    torch.manual_seed(123)
    a = train.run(c)
    after = torch.rand(3)
    torch.manual_seed(123)
    b = train.run(c.to_dict())
    assert torch.equal(after, torch.rand(3))
    pd.testing.assert_frame_equal(a.drop(columns="wall_time"), b.drop(columns="wall_time"))
    assert list(a.columns) == list(train.RECORD_COLUMNS) and (a["status"] == "ok").all()
    assert a["wall_time"].is_monotonic_increasing
    other = train.run(c.replace(seed=8))
    assert not other["train_loss"].equals(a["train_loss"])


def test_divergence_ends_the_run_and_is_recorded():
    rec = train.run(cfg(method="1f1b", stages=4, optimizer="sgd", lr=1e4, epochs=5))
    assert rec["status"].iloc[-1] == "diverged" and (rec["status"].iloc[:-1] == "ok").all()
    assert len(rec) < 5 or rec["step"].iloc[-1] < 5 * 12
    last = rec["train_loss"].iloc[-1]
    assert not math.isfinite(last) or last > 100.0
    # a bound the first loss already exceeds, before any update, does not fit the loss's scale (a regression's MSE
    # on large targets): every run would read "diverged" at step 0, so it is refused with the fix
    with pytest.raises(ConfigError, match="before any update"):
        train.run(cfg(divergence_loss=1e-3))


def test_a_non_finite_evaluation_is_divergence(monkeypatch):
    """w_t can overflow while the training loss (on stale forward weights) is still finite: the evaluation
    on w_t is where it shows first, and the run ends there as diverged instead of going on as "ok"."""
    evaluate = train._evaluate
    calls = []

    def overflowed_at_epoch_2(*args):
        calls.append(1)
        out = evaluate(*args)
        return {**out, "test_loss": math.nan} if len(calls) == 2 else out

    monkeypatch.setattr(train, "_evaluate", overflowed_at_epoch_2)
    rec = train.run(cfg(method="pipemare", stages=4, epochs=4))
    assert rec["status"].tolist() == ["ok", "diverged"] and math.isfinite(rec["train_loss"].iloc[-1])


def test_default_step_counts_scale_with_the_run():
    n = 200  # SMALL's training samples; 12 steps per epoch of 16
    c = cfg(epochs=8)  # 96 steps
    assert train.method_args(c.replace(method="gpipe"), n) == {}
    assert train.method_args(c.replace(method="pipemare"), n) == {"anneal_steps": 24}
    assert train.method_args(c.replace(method="pipemare", decay=0.3, anneal_steps=5), n) == {
        "anneal_steps": 5, "decay": 0.3}
    assert train.method_args(c.replace(method="pipemare-t1", lr_schedule="step", lr_milestones=[4, 6]), n) == {
        "anneal_steps": 12}
    assert train.method_args(c.replace(method="pipemare-w"), n) == {"anneal_steps": 24, "warmup_steps": 24}
    assert train.method_args(c.replace(method="pb-hybrid", max_steps=50), n) == {"pipelined_steps": 25}
    assert train.total_steps(c.replace(max_steps=50), n) == 50
    with pytest.raises(ConfigError, match="batch_size"):
        train.steps_per_epoch(c.replace(batch_size=400), n)


def test_lr_schedules_by_hand():
    c = cfg(epochs=4)
    cos = train.lr_lambda(c.replace(lr_schedule="cosine"), 12, 48)
    assert [cos(k) for k in (0, 24, 48)] == pytest.approx([1.0, 0.5, 0.0], abs=1e-15)
    step = train.lr_lambda(c.replace(lr_schedule="step", lr_milestones=[1, 3], lr_gamma=0.1), 12, 48)
    assert [step(k) for k in (0, 11, 12, 35, 36)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])
    rec = train.run(c.replace(lr_schedule="cosine", epochs=2))
    assert rec["lr_base"].iloc[-1] == pytest.approx(0.0, abs=1e-15)


def test_hardware_columns_and_max_stages():
    units = models.num_units("mlp", depth=3, hidden=16)
    gp = train.run(cfg(method="gpipe", stages=4, microbatches=2, max_steps=3))
    assert gp["utilization"].iloc[0] == pytest.approx(2 / (2 + 4 - 1))
    assert gp["memory_ratio_gpipe"].iloc[0] == 1.0 and gp["tau_max"].iloc[0] == 0
    assert gp["step"].iloc[-1] == 3 and len(gp) == 1
    pd_ = train.run(cfg(method="pipedream", stages="max", max_steps=2))
    model = models.get("mlp", depth=3, hidden=16, num_classes=4, input_shape=(1, 8))
    report = hardware.memory_report(model, "pipedream", units, 1, optimizer="sgd-momentum")
    assert pd_["tau_max"].iloc[0] == units - 1  # 1F1B: tau_0 = P - 1
    assert pd_["memory_bytes"].iloc[0] == report.weight_optimizer_bytes
    assert pd_["memory_ratio_gpipe"].iloc[0] == pytest.approx(report.ratio_to_gpipe) and report.ratio_to_gpipe > 1
    assert pd_["utilization"].iloc[0] == 1.0


def test_regression_task_reports_loss_not_accuracy():
    c = cfg(data_kwargs={"task": "regression", "num_samples": 120, "input_shape": [1, 8], "num_classes": 2},
            method="pipemare", stages=2, epochs=2)
    rec = train.run(c)
    assert rec["test_acc"].isna().all() and rec["test_loss"].map(math.isfinite).all()


def test_train_command_prints_and_writes_records(tmp_path, capsys):
    out = tmp_path / "rec.csv"
    rc = main(["train", "--model", "mlp", "--model-kwargs", '{"depth": 3, "hidden": 16}', "--data", "synthetic",
               "--data-kwargs", '{"num_samples": 250, "input_shape": [1, 8], "num_classes": 4}',
               "--method", "pipemare", "--stages", "max", "--epochs", "2", "--batch-size", "16",
               "--lr", "0.05", "--out", str(out)])
    assert rc == 0
    rec = pd.read_csv(out)
    assert len(rec) == 2 and list(rec.columns) == list(train.RECORD_COLUMNS)
    printed = capsys.readouterr().out
    assert "test_acc" in printed and "P=4" in printed
    direct = train.run(RunConfig(model="mlp", model_kwargs={"depth": 3, "hidden": 16}, data="synthetic",
                                 data_kwargs={"num_samples": 250, "input_shape": [1, 8], "num_classes": 4},
                                 method="pipemare", stages=4, epochs=2, batch_size=16, lr=0.05))
    assert rec["test_loss"].tolist() == pytest.approx(direct["test_loss"].tolist(), rel=1e-12)
    assert main(["train", "--method", "nope"]) == 2


def test_train_flags_override_a_config_file(tmp_path):
    import argparse
    import json

    from staleopt.cli import build_parser
    from staleopt.commands.train import config_from_args
    path = tmp_path / "base.json"
    path.write_text(json.dumps({**SMALL, "method": "pipemare", "stages": 3, "divergence_loss": 5.0}))
    args = build_parser().parse_args(["train", "--config", str(path), "--stages", "max", "--seed", "4",
                                      "--divergence-loss", "none", "--lr-schedule", "step", "--lr-milestones", "1,2"])
    c = config_from_args(args)
    assert (c.method, c.stages, c.seed, c.divergence_loss, c.lr_milestones) == ("pipemare", 4, 4, None, [1, 2])
    assert c.model_kwargs == SMALL["model_kwargs"] and isinstance(args, argparse.Namespace)
    toml = tmp_path / "base.toml"
    toml.write_text('method = "1f1b"\nstages = 2\n')
    assert config_from_args(build_parser().parse_args(["train", "--config", str(toml)])).method == "1f1b"


def test_config_checks_what_would_fail_every_run():
    from staleopt.config import RunConfig
    from staleopt.errors import ConfigError
    for bad in (0.0, 1.0):
        with pytest.raises(ConfigError, match="decay"):
            RunConfig(method="pipemare", decay=bad)
    with pytest.raises(ConfigError, match="m >= d"):
        RunConfig(method="pipedream-2bw", stages=4, microbatches=2, batch_size=64)


def test_a_phase_longer_than_the_run_is_a_whole_run_in_that_phase():
    from staleopt import train
    from staleopt.config import RunConfig
    cfg = RunConfig(model="mlp", data="synthetic", method="pipemare-w", stages=3, epochs=1, max_steps=3,
                    warmup_steps=50, batch_size=32)
    records = train.run(cfg)
    assert list(records["status"]) == ["ok"]
    assert records["utilization"].iloc[0] == pytest.approx(1 / 3)  # synchronous throughout: N/(N+P-1)


def test_settings_that_would_have_no_effect_are_refused():
    """lr_milestones and lr_gamma belong to lr_schedule 'step' (and 'step' needs milestones); momentum to an
    optimizer that has one: given otherwise they changed nothing, silently."""
    from staleopt.config import RunConfig
    from staleopt.errors import ConfigError
    with pytest.raises(ConfigError, match="lr_milestones = \\[3\\] are the epochs where lr_schedule 'step'"):
        RunConfig(lr_schedule="cosine", lr_milestones=[3])
    with pytest.raises(ConfigError, match="lr_milestones = \\[\\] .*lr_schedule = 'step'"):
        RunConfig(lr_schedule="step")
    with pytest.raises(ConfigError, match="lr_gamma = 0.5 is lr_schedule 'step''s factor"):
        RunConfig(lr_gamma=0.5)
    with pytest.raises(ConfigError, match="momentum = 0.5 has no effect with optimizer 'sgd'"):
        RunConfig(optimizer="sgd", momentum=0.5)
    assert RunConfig(lr_schedule="step", lr_milestones=[2], lr_gamma=0.5).lr_gamma == 0.5
    assert RunConfig(optimizer="sgd-momentum", momentum=0.5).momentum == 0.5


def test_a_setting_without_effect_is_refused_at_its_default_too_where_the_user_wrote_it(tmp_path):
    """RunConfig refused momentum 0.5 with plain sgd but not 0.9, its default (it cannot tell that from a key left
    out): --optimizer sgd --momentum 0.9 trained plain SGD silently. The commands and sweep files know the keys the
    user wrote; a ledger recipe's momentum a run with optimizer sgd inherits is not the user's."""
    from staleopt import sweep
    from staleopt.cli import build_parser
    from staleopt.commands.train import config_from_args
    from staleopt.ledger import spec
    for flags, key in ((["--optimizer", "sgd", "--momentum", "0.9"], "momentum = 0.9 has no effect"),
                       (["--lr-gamma", "0.1"], "lr_gamma = 0.1 is lr_schedule 'step''s factor")):
        with pytest.raises(ConfigError, match=key):
            config_from_args(build_parser().parse_args(["train", *flags]))
    path = tmp_path / "c.json"  # a run's config.json lists every field: its keys are not all the user's
    path.write_text(json.dumps(RunConfig(optimizer="sgd").to_dict()))
    assert config_from_args(build_parser().parse_args(["train", "--config", str(path)])).optimizer == "sgd"
    assert config_from_args(build_parser().parse_args(["train", "--optimizer", "sgd"])).momentum == 0.9  # unset
    with pytest.raises(ConfigError, match=r"run \{'optimizer': 'sgd'\}: momentum = 0.9 has no effect"):
        sweep.from_spec({"base": {"momentum": 0.9}, "grid": {"optimizer": ["sgd", "sgd-momentum"]}})
    assert len(sweep.from_spec({"base": {"momentum": 0.9}, "grid": {"optimizer": ["sgd", "sgd-momentum"]}},
                               inherited=["momentum"]).configs) == 2
    nesterov = [c for e in spec.load_all("cpu") for c in e.configs if c.method == "pipemare-stash-nesterov"]
    assert nesterov and all(c.optimizer == "sgd" for c in nesterov)
    old = {k: v for k, v in RunConfig(optimizer="sgd").to_dict().items() if k not in ("unit_order", "lr_warmup_steps")}
    path.write_text(json.dumps(old))  # a config.json written before the later fields: still a saved run's
    assert config_from_args(build_parser().parse_args(["train", "--config", str(path)])).optimizer == "sgd"
    path.write_text(json.dumps({"optimizer": "sgd", "momentum": 0.9}))  # a file of some fields: all the user's
    with pytest.raises(ConfigError, match="momentum = 0.9 has no effect"):
        config_from_args(build_parser().parse_args(["train", "--config", str(path)]))


def test_a_correction_setting_the_method_does_not_take_is_refused_in_train(tmp_path):
    """--decay 0.5 --method gpipe (and anneal/warmup/pipelined steps on methods without them) gave a new run id and
    the same training, silently. A saved config.json (every field) of a run with them unset passes."""
    from staleopt.cli import build_parser
    from staleopt.commands.train import config_from_args
    for flags, key in ((["--decay", "0.5", "--method", "gpipe"], "decay is a setting of pipemare"),
                       (["--anneal-steps", "10", "--method", "pipedream"], "anneal_steps is a setting of .*pipemare"),
                       (["--pipelined-steps", "10", "--method", "pipemare"], "method 'pipemare' does not take")):
        with pytest.raises(ConfigError, match=key):
            config_from_args(build_parser().parse_args(["train", *flags]))
    assert config_from_args(build_parser().parse_args(["train", "--decay", "0.5", "--method", "pipemare"])).decay == 0.5
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"method": "gpipe", "warmup_steps": 5}))
    with pytest.raises(ConfigError, match="warmup_steps is a setting of"):
        config_from_args(build_parser().parse_args(["train", "--config", str(path)]))
    path.write_text(json.dumps(RunConfig(method="gpipe").to_dict()))
    assert config_from_args(build_parser().parse_args(["train", "--config", str(path)])).method == "gpipe"
    # a file's settings under another --method: ignored (docs/experiments.md), not refused, and not kept in the run
    # id (a pipemare run's config.json under --method gpipe kept decay: a gpipe run under another id)
    plain = RunConfig(method="gpipe").run_id()
    for table in ({"method": "pipemare", "decay": 0.5}, RunConfig(method="pipemare", decay=0.5).to_dict()):
        path.write_text(json.dumps(table))
        with pytest.warns(UserWarning, match="--config's decay = 0.5 ignored: method 'gpipe' does not take it"):
            assert config_from_args(build_parser().parse_args(
                ["train", "--config", str(path), "--method", "gpipe"])).run_id() == plain
    assert config_from_args(build_parser().parse_args(
        ["train", "--config", str(path), "--method", "pipemare-w"])).decay == 0.5  # (taken: kept)


def test_milestones_at_or_after_the_last_epoch_are_refused_and_decay_invariant_is_a_flag():
    """A step milestone >= epochs never applies (milestone m acts from the first step after m epochs): refused, like
    the other settings without effect. --decay takes 'invariant' (App. B.4) as --config and sweep files do."""
    from staleopt.cli import build_parser
    from staleopt.commands.train import config_from_args
    with pytest.raises(ConfigError, match=r"lr_milestones = \[1, 3\] include \[3\], at or after the end of the run "
                                          r"\(epochs = 3\)"):
        RunConfig(**SMALL, lr_schedule="step", lr_milestones=[1, 3])
    assert RunConfig(**SMALL, lr_schedule="step", lr_milestones=[1, 2]).lr_milestones == [1, 2]
    args = build_parser().parse_args(["train", "--method", "pipemare", "--decay", "invariant"])
    assert config_from_args(args).decay == "invariant"
    assert config_from_args(build_parser().parse_args(["train", "--method", "pipemare", "--decay", "0.3"])).decay == 0.3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--decay", "half"])


def test_model_and_data_options_of_the_wrong_type_are_refused_where_the_config_is_built():
    """An option whose default is an int takes an int (TOML's 16.0 is a float, true a bool): refused when the
    config is built, not inside the model or data factory in every run of a sweep (which a relaunch could never
    fix). A float option takes an int; None passes; a factory's own options are checked by its signature."""
    bad = [({"model_kwargs": {"hidden": 16.0}}, "model_kwargs .* 'hidden' = 16.0, which must be an int"),
           ({"model_kwargs": {"depth": True}}, "'depth' = True, which must be an int"),
           ({"data_kwargs": {"num_samples": "200"}}, "data_kwargs .* 'num_samples' = '200', which must be an int"),
           ({"data_kwargs": {"input_shape": 8}}, "'input_shape' = 8, which must be a list"),
           ({"data_kwargs": {"separation": "1"}}, "'separation' = '1', which must be a number")]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            RunConfig(**{**SMALL, **change})
    ok = RunConfig(**{**SMALL, "data_kwargs": {**SMALL["data_kwargs"], "separation": 2, "noise": 0.5}})
    assert ok.data_kwargs["separation"] == 2
    assert RunConfig(model="cnn1d", data="mnist1d", data_kwargs={"num_samples": 400}).data == "mnist1d"
    with pytest.raises(ConfigError, match="'scale_coeff' = 'x', which must be a number"):
        RunConfig(model="cnn1d", data="mnist1d", data_kwargs={"scale_coeff": "x"})


def test_a_synchronous_warmup_as_long_as_the_run_is_warned_about():
    """pipemare-w's warmup (5 x lr_warmup_steps under a linear warmup) longer than the run trained plain GPipe
    while the records named pipemare-w, silently."""
    import warnings
    base = dict(method="pipemare-w", stages=3, epochs=1, max_steps=6, batch_size=16)
    for extra, warned in (({"lr_schedule": "linear-warmup", "lr_warmup_steps": 4}, True), ({"warmup_steps": 2}, False)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            train.run(cfg(**base, **extra))
        assert any("covers the whole run" in str(w.message) for w in seen) == warned, extra


@pytest.mark.parametrize("flag, value, says", [("--model-kwargs", "{bad", "expected JSON"),
                                               ("--stages", "abc", "or 'max'"),
                                               ("--lr-milestones", "a,b", "comma-separated epochs"),
                                               ("--divergence-loss", "x", "a number or 'none'")])
def test_a_bad_train_flag_value_says_what_the_flag_takes(capsys, flag, value, says):
    """argparse replaced these messages by "invalid _json value" (private names, the help text thrown away)."""
    with pytest.raises(SystemExit):
        main(["train", flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and says in err and "invalid _" not in err


def test_a_folder_given_for_a_file_is_called_a_folder(tmp_path, capsys):
    """``sweep DIR`` and ``train --config DIR`` said the existing folder "does not exist"."""
    for args in (["sweep", str(tmp_path)], ["train", "--config", str(tmp_path)]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "is a folder" in err and "does not exist" not in err


@pytest.mark.parametrize("args, flag", [
    (["train", "--model", "mlp", "--out", "r.csv", "--checkpoint-every", "0"], "--checkpoint-every"),
    (["hardware", "--model", "mlp", "--method", "gpipe", "--stages", "2", "--microbatch-size", "0"],
     "--microbatch-size"),
    (["compare", "--model", "mlp", "--data", "synthetic", "--stages", "1", "--seeds", "0", "--workers", "0"],
     "--workers"),
    (["compare", "--model", "mlp", "--data", "synthetic", "--stages", "1", "--seeds", "0", "--worker-threads", "0"],
     "--worker-threads")])
def test_a_bad_number_is_named_by_the_flag_typed(tmp_path, monkeypatch, capsys, args, flag):
    """The messages named internal parameters ("checkpoint every = 0", "microbatch_size = 0", "workers = 0")."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    assert f"{flag} = 0" in capsys.readouterr().err


@pytest.mark.parametrize("threads", ["0", "-5", "100000"])
def test_threads_outside_what_torch_starts_are_refused(capsys, threads):
    """Below 1 was raised to 1; 100000 was accepted, and the process crashed (SIGSEGV) with no message."""
    with pytest.raises(SystemExit):
        main(["--threads", threads, "models"])
    assert "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("args, flag", [
    (["train", "--config", "", "--model", "mlp", "--data", "synthetic"], "--config"),
    (["demo", "--sweep", " "], "--sweep"),
    (["sweep", "experiments/demo.toml", "--out", "", "--dry-run"], "--out"),
    (["timeline", "--method", "1f1b", "--out", ""], "--out"),
    (["hardware", "--model", "mlp", "--method", "gpipe", "--stages", "2", "--out", ""], "--out"),
    (["results", ""], "sweep_dir"),
    (["reproduce", "--doc", "", "--dry-run"], "--doc"),
    (["compare", "--model", "mlp", "--set", "", "--stages", "1"], "--set")])
def test_an_empty_argument_is_refused_not_read_as_not_given(tmp_path, monkeypatch, capsys, args, flag):
    """An unset shell variable: train --config '' trained the defaults, demo --sweep '' ran the full demo,
    sweep --out '' wrote to runs/<name>, timeline/hardware --out '' wrote nothing, each exit 0."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: empty" in err
    assert not list(tmp_path.iterdir())


def test_the_cli_shows_its_own_warnings_as_one_line_and_others_as_python_does(tmp_path, monkeypatch, capsys):
    """A sweep grid's warning printed Python's file:line and a source line under the message."""
    import warnings

    import staleopt.cli as cli
    import staleopt.sweep
    before = warnings.formatwarning
    # through main, shown as Python shows a warning (pytest records them instead): one line on stderr
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, file=None, line=None:
                        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line)))
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"method": "pipemare", "decay": 0.5, **SMALL, "max_steps": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["train", "--config", str(config), "--method", "gpipe", "--no-progress"]) == 0
    assert "staleopt train: warning: --config's decay = 0.5 ignored: method 'gpipe' does not take it\n" \
        in capsys.readouterr().err
    show = cli._one_line("sweep", before)
    assert show("the grid varies decay", UserWarning, staleopt.sweep.__file__, 9) == \
        "staleopt sweep: warning: the grid varies decay\n"
    assert show("x", UserWarning, torch.__file__, 9) == before("x", UserWarning, torch.__file__, 9)
    assert main(["timeline", "--method", "1f1b", "--out", str(tmp_path / "t.png")]) == 0
    assert warnings.formatwarning is before  # (restored after each command)
