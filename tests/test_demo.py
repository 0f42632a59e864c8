"""End to end with the real trainer: a sweep killed with SIGKILL resumes to the uninterrupted records;
the demo and plot commands on it; the sweep figures' numbers checked against hand-made records."""
import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from staleopt import claims, machine, speedup, sweep
from staleopt.cli import main
from staleopt.commands.demo import DEFAULT_SWEEP, complete, markdown, speedup_pivot
from staleopt.errors import ConfigError
from staleopt.plot import sweep as plots
from matplotlib.collections import PolyCollection

from helpers import sweep_killed_after_first_run

REPO = Path(__file__).resolve().parents[1]
TINY = """\
name = "tiny-demo"
description = "2 methods x 2 stage counts, synthetic data"
[base]
model = "mlp"
model_kwargs = {depth = 3, hidden = 32}
data = "synthetic"
data_kwargs = {num_samples = 1000, input_shape = [1, 8], num_classes = 4}
batch_size = 20
epochs = 4
lr = 0.05
[grid]
method = ["1f1b", "pipemare"]
stages = [2, 4]
seed = [0]
"""


def _records(sweep_dir):
    return sweep.collect(sweep_dir).drop(columns="wall_time").sort_values(["run", "epoch"], ignore_index=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    path = root / "tiny.toml"
    path.write_text(TINY)
    clean = root / "clean"
    report = sweep.run_sweep(path, clean, bar=False)
    assert report.ok and len(report.finished) == 4
    return path, clean


def test_killed_sweep_resumes_to_the_uninterrupted_records(tiny, tmp_path):
    path, clean = tiny
    killed = tmp_path / "killed"
    tests = os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    sweep_killed_after_first_run(path, killed, ["--train-fn", "helpers:train_then_stall"],
                                 env={"OMP_NUM_THREADS": "1", "PYTHONPATH": tests})
    states = sweep.runs(killed)["state"].tolist()
    done = [r for r, s in zip(sweep.runs(killed)["run"], states) if s == "done"]
    assert len(done) == 1, states
    kept = {r: (killed / "runs" / r / "records.csv").read_bytes() for r in done}

    report = sweep.run_sweep(path, killed, bar=False)
    assert sorted(report.skipped) == sorted(done) and len(report.finished) == 4 - len(done) and report.ok
    assert all((killed / "runs" / r / "records.csv").read_bytes() == b for r, b in kept.items())
    pd.testing.assert_frame_equal(_records(killed), _records(clean))
    assert len(_records(clean)) == 4 * 4 and set(_records(clean)["status"]) == {"ok"}


def test_demo_command_prints_table_and_writes_figures(tiny, capsys):
    path, clean = tiny
    assert main(["demo", "--sweep", str(path), "--out", str(clean), "--workers", "1", "--no-bar"]) == 0
    out = capsys.readouterr().out
    assert "4 runs (4 already done" in out and "P=2" in out and "P=4" in out and "pipemare" in out
    for name in ("accuracy_vs_stages.png", "accuracy_vs_epoch_P4.png", "summary.csv", "records.csv"):
        assert (clean / name).stat().st_size > 0
    summary = pd.read_csv(clean / "summary.csv")
    best = _records(clean).groupby("run")["test_acc"].max()
    runs = sweep.runs(clean).set_index("run")
    for row in summary.itertuples():
        run = runs[(runs["method"] == row.method) & (runs["stages"] == row.stages)].index.item()
        assert row.best_acc == best[run]
    assert (clean / "records.csv").read_text().count("\n") == 1 + 16
    info = json.loads((clean / "run.json").read_text())  # provenance: what ran, where, on which code, how loaded
    assert info["sweep"] == str(path.resolve()) and info["runs"] == 4 and info["workers"] == 1
    assert info["commit"] == machine.source_commit() and isinstance(info["load_average"], float)


def test_run_json_names_a_sweep_file_of_the_checkout_by_its_path_in_it():
    """docs/demo-checks/*/run.json name their sweep files so (docgen reads each one's description from it)."""
    from types import SimpleNamespace
    from staleopt.commands.demo import provenance
    info = provenance(1.0, SimpleNamespace(total=0, finished=[]), [], 1, 1, 0.8, DEFAULT_SWEEP)
    assert info["sweep"] == "experiments/demo.toml"


def test_demo_summarizes_only_the_runs_of_its_sweep_file(tiny, tmp_path, capsys):
    path, clean = tiny
    subset = tmp_path / "subset.toml"
    subset.write_text(TINY.replace("stages = [2, 4]", "stages = [2]"))
    out = tmp_path / "out"
    import shutil
    shutil.copytree(clean / "runs", out / "runs")  # holds the P=4 runs too
    assert main(["demo", "--sweep", str(subset), "--out", str(out), "--workers", "1", "--no-bar"]) == 0
    assert "2 runs (2 already done" in capsys.readouterr().out
    summary = pd.read_csv(out / "summary.csv")
    assert summary["stages"].tolist() == [2, 2] and (summary["runs"] == 1).all()


def test_plot_command(tiny, tmp_path):
    _, clean = tiny
    assert main(["plot", str(clean), "--out", str(tmp_path / "a.png")]) == 0
    assert main(["plot", str(clean), "--curves", "--stages", "2", "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "c.png").stat().st_size > 0
    assert main(["plot", str(clean), "--curves", "--stages", "3"]) == 2  # no such P: an error, not a crash
    assert main(["plot", str(clean), "--dpi", "0", "--out", str(tmp_path / "d.png")]) == 2  # not matplotlib's crash
    assert main(["plot", str(clean), "--curves", "--stages", "2", "--target", "0.9"]) == 2  # --curves has no target
    assert main(["plot", str(clean), "--target", "95", "--out", str(tmp_path / "t.png")]) == 2  # a percentage
    assert not (tmp_path / "d.png").exists() and not (tmp_path / "t.png").exists()
    assert main(["plot", str(tmp_path)]) == 2


def test_demo_sweep_file_keeps_the_papers_methods_and_recipe():
    spec = sweep.load_sweep(DEFAULT_SWEEP)
    assert spec.base["data"] == "mnist1d" and spec.base["model"] == "resnet1d"
    assert set(spec.grid["method"]) >= {"gpipe", "pipedream", "pipemare-stash", "1f1b", "dataflow", "pipemare-t1",
                                        "pipemare"}
    assert len(spec.grid["seed"]) >= 3 and "max" in spec.grid["stages"]
    units = max(c.stages for c in spec.configs)
    assert units > 16 and len(spec.configs) == len(spec.grid["method"]) * len(spec.grid["stages"]) * len(spec.grid["seed"])


def _committed():
    records = pd.read_csv(REPO / "docs" / "demo" / "records.csv")
    return records, pd.read_csv(REPO / "docs" / "demo" / "claims.csv"), json.loads((REPO / "docs" / "demo" / "run.json").read_text())


def test_committed_demo_output_comes_from_the_demo_sweep_file():
    records, _, info = _committed()
    assert set(records["run"]) == {c.run_id() for c in sweep.load_sweep(DEFAULT_SWEEP).configs}
    assert info["runs"] == len(set(records["run"])) and info["run_seconds"] > 0 and info["target"] == claims.DEMO_TARGET


def test_committed_claims_are_what_the_committed_records_give():
    records, committed, info = _committed()
    table = claims.evaluate(complete(records), target=info["target"])
    pd.testing.assert_frame_equal(table, committed)
    assert set(committed["verdict"]) == {"holds"}  # the demo states only claims that hold
    summary = sweep.summarize(records, by=["method", "stages"])
    pd.testing.assert_frame_equal(summary, pd.read_csv(REPO / "docs" / "demo" / "summary.csv"), check_dtype=False)
    fast = speedup.speedup_table(records, info["target"])
    pd.testing.assert_frame_equal(fast, pd.read_csv(REPO / "docs" / "demo" / "speedup.csv"), check_dtype=False)


#: The committed runs of sweep files other than the demo's own: its checks and the --quick preview (its timing).
CHECKS = sorted(p for kind in ("demo-checks", "demo-lm-checks") if (REPO / "docs" / kind).is_dir()
                for p in (REPO / "docs" / kind).iterdir()) + [REPO / "docs" / "demo-quick"]


@pytest.mark.parametrize("directory", CHECKS, ids=lambda d: f"{d.parent.name}/{d.name}")
def test_each_committed_check_is_its_sweep_files_runs_and_its_tables_what_they_give(directory):
    """docs/demo.md and docs/language-models.md show the demo's robustness checks (docgen's demo-checks blocks)
    and the --quick preview's time:
    each committed check holds every run of the sweep file its run.json names, and its claims and summary are
    what those records give at its target; a check may find a claim that does not hold (the momentum recipe)."""
    info = json.loads((directory / "run.json").read_text())
    path = REPO / info["sweep"]
    records = complete(pd.read_csv(directory / "records.csv"), path)
    assert set(records["run"]) == {c.run_id() for c in sweep.load_sweep(path).configs} and info["commit"]
    assert info["runs"] == len(set(records["run"])) and "+changes" not in info["commit"]
    table = claims.evaluate(records, target=info["target"])
    pd.testing.assert_frame_equal(table, pd.read_csv(directory / "claims.csv"))
    pd.testing.assert_frame_equal(sweep.summarize(records, by=["method", "stages"]),
                                  pd.read_csv(directory / "summary.csv"), check_dtype=False)


RERUNS = sorted((REPO / "docs" / "demo-reruns").iterdir()) if (REPO / "docs" / "demo-reruns").is_dir() else []


@pytest.mark.parametrize("directory", RERUNS, ids=lambda d: d.name)
def test_each_rerun_of_the_demo_retrained_it_from_scratch_on_committed_code(directory):
    """docs/demo.md's demo-reruns block says whether today's code trains the committed run (docgen compares the
    files): a rerun counts only if it trained every run of the demo's own sweep file, on a commit, with its
    result files present."""
    info = json.loads((directory / "run.json").read_text())
    assert info["sweep"] == "experiments/demo.toml" and info["target"] == claims.DEMO_TARGET
    assert info["runs_trained_now"] == info["runs"] == len(sweep.load_sweep(DEFAULT_SWEEP).configs)
    assert info["commit"] and "+changes" not in info["commit"]
    from staleopt.docgen import RESULT_FILES
    assert all((directory / f).is_file() for f in RESULT_FILES)


def test_the_reruns_block_says_which_result_files_differ_from_the_committed_run(tmp_path):
    import shutil
    from staleopt import docgen
    shutil.copytree(REPO / "docs" / "demo", tmp_path / "demo")
    rerun = tmp_path / "demo-reruns" / "2026-01-01-abc1234"
    rerun.mkdir(parents=True)
    for f in docgen.RESULT_FILES:
        shutil.copy(tmp_path / "demo" / f, rerun / f)
    (rerun / "run.json").write_text(json.dumps({
        "date": "2026-01-01", "commit": "abc1234", "cpu": "X", "cores": 2, "load_average": 0.5, "torch": "2.14.1",
        "workers": 2, "worker_threads": 1, "runs_trained_now": 42, "runs": 42, "seconds": 600}))
    assert "byte-identical" in docgen.demo_reruns(tmp_path)
    summary = pd.read_csv(rerun / "summary.csv")
    summary.loc[0, "best_acc"] += 0.001  # one run's accuracy moved (another CPU's rounding, or the code)
    summary.to_csv(rerun / "summary.csv", index=False)
    line = docgen.demo_reruns(tmp_path)
    assert "byte-identical" not in line and "different from the committed run's: `summary.csv`" in line


@pytest.mark.parametrize("directory", sorted((REPO / "docs" / "demo-other-cpus").iterdir()), ids=lambda d: d.name)
def test_demo_claims_hold_on_every_cpu_the_demo_was_recorded_on(directory):
    """The demo states only what holds on another CPU too: each recorded run's claims, at the demo's target, hold,
    and its committed tables are what its records give."""
    records = complete(pd.read_csv(directory / "records.csv"))
    info = json.loads((directory / "run.json").read_text())
    assert info["target"] == claims.DEMO_TARGET and info["cpu"]
    table = claims.evaluate(records, target=claims.DEMO_TARGET)
    assert set(table["verdict"]) == {"holds"}, table[table["verdict"] != "holds"].to_string()
    pd.testing.assert_frame_equal(table, pd.read_csv(directory / "claims.csv"))
    pd.testing.assert_frame_equal(speedup.speedup_table(records, claims.DEMO_TARGET),
                                  pd.read_csv(directory / "speedup.csv"), check_dtype=False)


def test_demo_from_records_with_a_new_target_records_it(tiny, tmp_path):
    """--from-records --target rebuilds the tables at that target and says so in run.json, which the README's
    block (markdown) reads: the block's caption and its speedup table are at the same target."""
    import shutil
    path, clean = tiny
    out = tmp_path / "demo"
    shutil.copytree(clean, out)
    assert main(["demo", "--sweep", str(path), "--out", str(out), "--workers", "1", "--no-bar", "--target", "0.3"]) == 0
    assert json.loads((out / "run.json").read_text())["target"] == 0.3
    assert main(["demo", "--sweep", str(path), "--out", str(out), "--from-records", "--target", "0.4",
                 "--figures", str(tmp_path / "img")]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["target"] == 0.4 and json.loads((out / "report.json").read_text())["target"] == 0.4
    records = complete(pd.read_csv(out / "records.csv"), path)
    pd.testing.assert_frame_equal(speedup.speedup_table(records, 0.4), pd.read_csv(out / "speedup.csv"),
                                  check_dtype=False)
    assert "Time to accuracy 0.400" in markdown(out)


def test_demo_from_records_refuses_a_cut_records_file(tmp_path, capsys):
    """A records.csv cut at a line boundary (a partial copy) was rebuilt into tables that counted a one-epoch run as
    finished, over the correct ones, exit 0: refused; a file without some of the sweep's runs is warned about."""
    import shutil
    out = tmp_path / "demo"
    shutil.copytree(REPO / "docs" / "demo", out)
    lines = (out / "records.csv").read_text().splitlines(keepends=True)
    before = (out / "claims.csv").read_text()
    (out / "records.csv").write_text("".join(lines[:-2]))  # the last run gone, the one before without its last epoch
    assert main(["demo", "--from-records", "--out", str(out), "--figures", str(tmp_path / "img")]) == 2
    assert "not whole" in capsys.readouterr().err and (out / "claims.csv").read_text() == before
    last = lines[-1].split(",")[0]
    (out / "records.csv").write_text("".join(x for x in lines if not x.startswith(last + ",")))
    with pytest.warns(UserWarning, match="holds 41 of the 42 runs"):
        assert main(["demo", "--from-records", "--out", str(out), "--figures", str(tmp_path / "img")]) == 0


def test_a_run_cut_by_its_max_steps_or_a_divergence_is_whole():
    """A records file's run that ends before its last epoch is a cut copy unless it diverged or reached max_steps
    (the speedup tables' own rule, speedup._capped)."""
    from staleopt.commands.demo import _check_whole

    def rec(status="ok", max_steps=None, step=20):
        return pd.DataFrame([{"run": "r", "epoch": 1, "epochs": 5, "step": 10, "status": "ok", "max_steps": max_steps},
                             {"run": "r", "epoch": 2, "epochs": 5, "step": step, "status": status,
                              "max_steps": max_steps}])
    for whole in (rec(max_steps=20), rec(max_steps=20.0), rec(status="diverged")):
        _check_whole(whole, Path("r.csv"))
    for cut in (rec(), rec(max_steps=21), rec(max_steps=float("nan"))):
        with pytest.raises(ConfigError, match="r.csv is not whole: 1 run"):
            _check_whole(cut, Path("r.csv"))


def test_demo_of_a_users_sweep_file_refuses_a_bad_target_before_training(tmp_path, capsys):
    """demo --sweep FILE checked --target only after every run had trained (its metric is the FILE's data's)."""
    sweep_file = tmp_path / "mine.toml"
    sweep_file.write_text('[base]\nmodel = "mlp"\ndata = "synthetic"\nepochs = 1\n[grid]\nmethod = ["gpipe"]\n')
    assert main(["demo", "--sweep", str(sweep_file), "--out", str(tmp_path / "d"), "--target", "85"]) == 2
    assert "0.85 for 85%" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_demo_from_records_refuses_a_sweep_file_that_made_none_of_its_runs(tmp_path, capsys):
    """--sweep FILE fills the config columns records.csv leaves out: one that trained none of its runs put its
    model, data and epochs in the tables and rewrote memory.csv, exit 0. Refused, nothing rewritten."""
    import shutil
    out = tmp_path / "demo"
    shutil.copytree(REPO / "docs" / "demo", out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    other = tmp_path / "other.toml"
    other.write_text('[base]\nmodel = "mlp"\ndata = "synthetic"\nepochs = 1\n[grid]\nmethod = ["gpipe"]\n')
    assert main(["demo", "--from-records", "--sweep", str(other), "--out", str(out),
                 "--figures", str(tmp_path / "img")]) == 2
    assert "holds none of the runs of" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


def test_demo_from_records_of_whole_records_reads_no_sweep_file(tmp_path):
    """Records that hold every config column take nothing from the sweep file: one edited since (or another one)
    was refused as "made none of its runs" though it fills nothing."""
    import shutil
    out = tmp_path / "demo"
    shutil.copytree(REPO / "docs" / "demo", out)
    whole = complete(pd.read_csv(out / "records.csv"))
    whole.to_csv(out / "records.csv", index=False)
    other = tmp_path / "other.toml"
    other.write_text('[base]\nmodel = "mlp"\ndata = "synthetic"\nepochs = 1\n[grid]\nmethod = ["gpipe"]\n')
    assert main(["demo", "--from-records", "--sweep", str(other), "--out", str(out),
                 "--figures", str(tmp_path / "img")]) == 0
    assert (out / "claims.csv").is_file()


def test_demo_from_records_keeps_the_target_its_report_was_written_with(tmp_path):
    """A comparison's folder (report.json, no run.json) came back at the MNIST-1D demo's 0.80, its target (here
    0.9) replaced in speedup.csv, claims.csv and report.json without a word."""
    import shutil
    out = tmp_path / "cmp"
    shutil.copytree(REPO / "docs" / "demo", out)
    (out / "run.json").unlink()
    report = json.loads((out / "report.json").read_text())
    (out / "report.json").write_text(json.dumps({**report, "target": 0.9}))
    assert main(["demo", "--from-records", "--out", str(out), "--figures", str(tmp_path / "img")]) == 0
    assert json.loads((out / "report.json").read_text())["target"] == 0.9
    assert set(pd.read_csv(out / "speedup.csv")["target"]) == {0.9}


@pytest.mark.parametrize("damage", ["run.json: {", "run.json: [1]", "report.json: {", "records.csv: ",
                                    "records.csv: head",
                                    "records.csv: cut", "records.csv: binary", "figures"])
def test_demo_from_records_names_an_unreadable_input(tmp_path, capsys, damage):
    """Damaged inputs of --from-records were raw tracebacks (JSONDecodeError, AttributeError, EmptyDataError,
    KeyError, ParserError, UnicodeDecodeError, FileExistsError): typed errors naming the file."""
    import shutil
    out = tmp_path / "demo"
    shutil.copytree(REPO / "docs" / "demo", out)
    text = (out / "records.csv").read_text()
    name, _, what = damage.partition(": ")
    figures = tmp_path / "img"
    if name == "figures":
        figures.write_text("a file")
    elif name in ("run.json", "report.json"):
        (out / name).write_text(what)
    else:
        (out / name).write_bytes({"": b"", "head": text.splitlines()[0].encode() + b"\n",
                                  "cut": text[:700].encode(), "binary": b"\x00\xff\xfe"}[what])
    assert main(["demo", "--from-records", "--out", str(out), "--figures", str(figures)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("--figures" if name == "figures" else name) in err


def test_readme_demo_block_is_generated_from_the_committed_run():
    block = markdown(REPO / "docs" / "demo")
    for page in ("README.md", "docs/demo.md"):
        text = (REPO / page).read_text()
        begin, end = "<!-- demo-claims:begin -->\n", "<!-- demo-claims:end -->"
        assert text[text.index(begin) + len(begin):text.index(end)] == block, page


# ----------------------------------------------------------------------------- figures by hand

def _hand_records():
    """2 methods x 2 stage counts x 2 seeds; pipemare at P=8 seed 1 diverged in epoch 2."""
    rows = []
    acc = {("gpipe", 2): ([0.5, 0.7], [0.6, 0.8]), ("gpipe", 8): ([0.5, 0.7], [0.6, 0.8]),
           ("pipemare", 2): ([0.4, 0.6], [0.5, 0.65]), ("pipemare", 8): ([0.3, 0.5], [0.45])}
    util = {("gpipe", 2): 0.5, ("gpipe", 8): 1 / 8, ("pipemare", 2): 1.0, ("pipemare", 8): 1.0}
    mem = {("gpipe", 2): 1.0, ("gpipe", 8): 1.0, ("pipemare", 2): 4 / 3, ("pipemare", 8): 4 / 3}
    for (method, p), seeds in acc.items():
        for seed, accs in enumerate(seeds):
            for epoch, a in enumerate(accs, 1):
                diverged = (method, p, seed, epoch) == ("pipemare", 8, 1, 1)
                rows.append({"run": f"{method}-{p}-{seed}", "method": method, "stages": p, "seed": seed,
                             "lr": 0.1, "microbatches": 4, "epoch": epoch, "step": 10 * epoch, "test_acc": a,
                             "train_loss": math.nan if diverged else 1.0 / epoch,
                             "status": "diverged" if diverged else "ok",
                             "utilization": util[method, p], "memory_ratio_gpipe": mem[method, p]})
    return pd.DataFrame(rows)


def test_per_run_table_by_hand():
    table = plots.per_run(_hand_records()).set_index(["method", "stages", "seed"])
    assert table.loc[("pipemare", 8, 1), ["best_acc", "final_acc", "epochs_run", "diverged"]].tolist() == \
        [0.45, 0.45, 1, True]
    assert table.loc[("gpipe", 2, 1), "best_acc"] == 0.8 and table["diverged"].sum() == 1
    assert plots.line_keys(_hand_records()) == ["method"]


def test_accuracy_vs_stages_figure_numbers():
    fig = plots.plot_accuracy_vs_stages(_hand_records())
    util_ax, mem_ax, acc_ax = fig.axes[:3]
    bars = {c.get_label(): c for c in acc_ax.containers}
    assert list(bars) == ["gpipe", "pipemare"]  # METHOD_ORDER
    line, _, (segments,) = bars["pipemare"].lines
    # the diverged run stays in the mean at P=8: (0.5 + 0.45) / 2
    np.testing.assert_allclose(line.get_ydata(), [0.625, 0.475])
    # two stage counts are two categories, not a trend: not joined, each method beside the other
    assert line.get_linestyle() == "None"
    np.testing.assert_allclose(np.asarray(line.get_xdata(), float), [0.075, 1.075])
    np.testing.assert_allclose(np.asarray(bars["gpipe"].lines[0].get_xdata(), float), [-0.075, 0.925])
    assert [t.get_text() for t in acc_ax.get_xticklabels()] == ["2", "8"]
    # 2 seeds: the interval is their range (never past [0, 1]); pipemare at P=2 has 0.6 and 0.65
    np.testing.assert_allclose(np.array([seg[:, 1] for seg in segments.get_segments()], float),
                               [[0.6, 0.65], [0.45, 0.5]])
    util = {ln.get_label(): ln.get_ydata() for ln in util_ax.get_lines()}
    np.testing.assert_allclose(util["gpipe"], [0.5, 0.125])
    mem = {ln.get_label(): ln.get_ydata() for ln in mem_ax.get_lines()}
    np.testing.assert_allclose(mem["pipemare"], [4 / 3, 4 / 3])
    crosses = [c for c in acc_ax.collections if c.get_label() == "_diverged"]
    assert len(crosses) == 1
    np.testing.assert_allclose(crosses[0].get_offsets(), [[1.075, 0.45]])
    seeds = [c for c in acc_ax.collections if c.get_label() == "_seed"]
    assert sum(len(c.get_offsets()) for c in seeds) == 7  # every seed a dot, the diverged one an x
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["gpipe", "pipemare", "diverged run"]
    assert fig._suptitle.get_text() == "2 seeds"  # read off the records (these have no model, data or epochs)


def test_many_stage_counts_are_a_log_axis_with_lines():
    records = pd.concat([_hand_records().assign(stages=lambda r, p=p: r["stages"].map({2: p, 8: 2 * p}),
                                                run=lambda r, p=p: r["run"] + f"-{p}") for p in (2, 16)])
    acc_ax = plots.plot_accuracy_vs_stages(records).axes[2]
    line = {c.get_label(): c for c in acc_ax.containers}["gpipe"].lines[0]
    assert acc_ax.get_xscale() == "log" and line.get_linestyle() == "-"


def test_time_to_accuracy_panel_and_figure_numbers():
    # target 0.6: GPipe reaches it after 20 and 10 steps (mean 15), PipeMare after 20 and 20 at P = 2; at P = 8
    # PipeMare's seed 1 diverged before it, so P = 8 has no PipeMare point. GPipe's time: 15 (N + P - 1) / N, N = 4
    fig = plots.plot_accuracy_vs_stages(_hand_records(), target=0.6)
    speed = {ln.get_label(): ln for ln in fig.axes[3].get_lines()}
    np.testing.assert_allclose(speed["gpipe"].get_ydata(), [1.0, 1.0])
    np.testing.assert_allclose(speed["pipemare"].get_xdata(), [0])  # the category of P = 2
    np.testing.assert_allclose(speed["pipemare"].get_ydata(), [15 * 5 / 4 / 20])
    assert "0.600" in fig.axes[3].get_ylabel()
    fig = plots.plot_accuracy_vs_time(_hand_records(), 8, target=0.6)
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    np.testing.assert_allclose(lines["gpipe"].get_xdata(), [10 * 11 / 4, 20 * 11 / 4])
    np.testing.assert_allclose(lines["gpipe"].get_ydata(), [0.55, 0.75])
    np.testing.assert_allclose(lines["pipemare"].get_xdata(), [10, 20])
    np.testing.assert_allclose(lines["pipemare"].get_ydata(), [(0.3 + 0.45) / 2, (0.5 + 0.45) / 2])
    np.testing.assert_allclose(lines["target 0.600"].get_ydata(), [0.6, 0.6])
    crosses = [c for c in ax.collections if c.get_label() == "_diverged"]
    np.testing.assert_allclose(crosses[0].get_offsets(), [[10, 0.45]])
    table = speedup_pivot(speedup.speedup_table(_hand_records(), 0.6))
    assert table.loc["pipemare", "P=2"] == "0.94x" and table.loc["pipemare", "P=8"] == "- (0/2)"
    assert table.loc["gpipe", "P=8"] == "1.00x"
    # target 0.5 at P = 8: GPipe after 10 steps (time 27.5), PipeMare's seed 0 after 20, seed 1 never
    assert speedup_pivot(speedup.speedup_table(_hand_records(), 0.5)).loc["pipemare", "P=8"] == "1.38x (1/2)"
    # ... and the figure draws that point, saying 1/2, instead of dropping the method at P = 8
    ax = plots.plot_accuracy_vs_stages(_hand_records(), target=0.5).axes[3]
    speed = {ln.get_label(): ln for ln in ax.get_lines()}
    np.testing.assert_allclose(speed["pipemare"].get_ydata()[-1], 27.5 / 20)
    assert [t.get_text() for t in ax.texts] == ["1/2"]


def test_a_speedup_cell_without_a_gpipe_time_keeps_its_count():
    """Runs that reached the target with no GPipe time to compare (no GPipe runs) were a bare "-", as if none
    had reached it."""
    records = _hand_records()
    table = speedup_pivot(speedup.speedup_table(records[records["method"] == "pipemare"], 0.5))
    assert table.loc["pipemare"].tolist() == ["- (2/2 reached, no gpipe time)", "- (1/2 reached, no gpipe time)"]
    assert speedup_pivot(speedup.speedup_table(records[records["method"] == "pipemare"], 0.7)).loc[
        "pipemare", "P=2"] == "- (0/2)"


@pytest.mark.parametrize("path", sorted((REPO / "experiments").glob("*.toml")), ids=lambda p: p.name)
def test_example_sweeps_are_valid(path):
    spec = sweep.load_sweep(path)
    assert spec.configs and spec.name
