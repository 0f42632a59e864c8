"""A report's figures and tables show the same configurations, numbers and intervals (found by a read-only review):
a sweep that varies a key within a method and P (lr), a key left unset for some runs (max_steps None), cells with
different numbers of runs, and the colours of one method across the report's figures."""
import inspect

import numpy as np
import pandas as pd
import pytest

from staleopt import hardware, speedup, stats, sweep
from staleopt.compare import write_report
from staleopt.config import RunConfig
from staleopt.errors import ConfigError
from staleopt.plot import sweep as plots

ACCS = {"gpipe": [0.5, 0.8, 0.9], "pipemare": [0.6, 0.85, 0.92], "pipedream": [0.55, 0.82, 0.9]}


def fake_train(config, progress=False):
    """Records as a function of the config: pipemare at lr >= 0.5 falls apart and diverges at its last epoch."""
    accs = ACCS.get(config.method, [0.4, 0.6, 0.7])
    n, p = config.microbatches, int(config.stages)
    rows = []
    for e in range(1, config.epochs + 1):
        a = accs[min(e, len(accs)) - 1] - 0.01 * config.seed
        if config.method == "pipemare" and config.lr >= 0.5:
            a = [0.3, 0.2, 0.1][min(e, 3) - 1]
        rows.append({"epoch": e, "step": 10 * e, "train_loss": 1.0, "test_loss": 1.0, "test_acc": a,
                     "wall_time": 0.1, "status": "ok", "tau_max": 0,
                     "utilization": n / (n + p - 1) if config.method == "gpipe" else 1.0, "memory_bytes": 1000,
                     "memory_ratio_gpipe": 1.0})
    if config.method == "pipemare" and config.lr >= 0.5:
        rows[-1]["status"] = "diverged"
    return pd.DataFrame(rows)


def _sweep(tmp_path, configs):
    sweep.run_sweep(configs, tmp_path / "sweep", train_fn=fake_train, bar=False)
    return sweep.collect(tmp_path / "sweep")


def _quality_means(fig):
    ax = next(a for a in fig.axes if a.get_title() == "model quality")
    return sorted(round(float(c.lines[0].get_xydata()[0][1]), 4) for c in ax.containers)


BASE = dict(model="mlp", data="synthetic", epochs=3, batch_size=20, microbatches=4, stages=3)


def test_a_key_varied_within_a_method_is_a_configuration_of_the_tables_as_of_the_figure(tmp_path):
    """A sweep over lr: summary.csv pooled lr = 0.05 with lr = 0.5 into one row per method and P (a mean of a run
    that trained and one that diverged) while the figure beside it drew a line per (method, lr); the claims
    pooled them too. Now the tables have a row per line, and the claims are not evaluated, saying why."""
    configs = [RunConfig(**BASE, method=m, lr=lr, seed=s) for m in ("gpipe", "pipemare") for lr in (0.05, 0.5)
               for s in (0, 1)]
    records = _sweep(tmp_path, configs)
    assert sweep.varying_keys(records) == ["lr"]
    result = write_report(records, tmp_path / "report", target=0.85)
    assert len(result.summary) == 4 and set(result.summary["lr"]) == {0.05, 0.5}
    fig = plots.plot_accuracy_vs_stages(records, "best_acc", target=0.85)
    assert _quality_means(fig) == sorted(round(v, 4) for v in result.summary["best_acc"])
    assert set(result.claims["verdict"]) == {"not evaluated"}
    assert result.claims["evidence"].str.contains("differ in lr").all()
    table = result.table()
    assert list(table.index) == ["gpipe lr=0.05", "gpipe lr=0.5", "pipemare lr=0.05", "pipemare lr=0.5"]


def test_a_key_that_differs_only_between_methods_splits_nothing(tmp_path):
    """GPipe at N = 4 against pipemare at N = 1 (a key set per method): one configuration per method and P, the
    speedup in the table is the one the figure draws, and the claims are evaluated."""
    configs = ([RunConfig(**{**BASE, "microbatches": 4}, method="gpipe", seed=s) for s in (0, 1)]
               + [RunConfig(**{**BASE, "microbatches": 1}, method="pipemare", seed=s) for s in (0, 1)])
    records = _sweep(tmp_path, configs)
    assert sweep.varying_keys(records) == [] and plots.line_keys(records) == ["method"]
    result = write_report(records, tmp_path / "report", target=0.85)
    fast = result.speedup.set_index("method")["speedup"]
    fig = plots.plot_accuracy_vs_stages(records, "best_acc", target=0.85)
    ax = next(a for a in fig.axes if "speedup" in a.get_ylabel())
    drawn = sorted(round(float(line.get_xydata()[0][1]), 4) for line in ax.lines if len(line.get_xydata()))
    assert drawn == sorted(round(v, 4) for v in fast)
    assert not result.claims["evidence"].str.contains("differ in").any()


def test_a_key_unset_for_some_runs_keeps_its_rows_and_its_baseline(tmp_path):
    """max_steps None for half the runs: the speedup table dropped those configurations (pandas' groupby drops a
    NaN key) and never matched their GPipe baseline; it has the summary's rows now."""
    configs = [RunConfig(**BASE, method=m, max_steps=cap, seed=s) for m in ("gpipe", "pipemare")
               for cap in (None, 30) for s in (0, 1)]
    records = _sweep(tmp_path, configs)
    keys = ["method", "stages", "max_steps"]
    fast = speedup.speedup_table(records, 0.85, keys=keys)
    assert len(fast) == 4 and fast["speedup"].notna().all()
    assert fast[fast["method"] == "gpipe"]["speedup"].tolist() == [1.0, 1.0]


def test_total_memory_follows_each_lines_configuration(tmp_path):
    """pipemare at N = 1 and N = 4 at one P: run_memory kept one configuration per method and P, and the figure
    drew the N = 1 total on the N = 4 line."""
    configs = [RunConfig(**{**BASE, "microbatches": n}, method=m, seed=0) for m in ("gpipe", "pipemare")
               for n in (1, 4)]
    records = _sweep(tmp_path, configs)
    memory = hardware.run_memory(records)
    assert len(memory) == 4 and "microbatches" in memory.columns
    fig = plots.plot_accuracy_vs_stages(records, "best_acc", memory=memory)
    ax = next(a for a in fig.axes if a.get_ylabel() == "total memory (x GPipe)")
    drawn = sorted(round(float(line.get_xydata()[0][1]), 6) for line in ax.lines)
    assert drawn == sorted(round(v, 6) for v in memory["total_ratio_gpipe"])


def test_the_interval_caption_names_every_kind_of_cell():
    """Cells of 4 and 3 runs: t-intervals and ranges; the caption said only the largest cell's kind."""
    assert stats.interval_caption([4, 3, 4]) == ("mean [95% t-interval within [0, 1]] over 4 seeds, [min, max] "
                                                 "where a cell has 3 seeds")
    assert stats.interval_caption([3, 3]) == stats.interval_caption(3) == "mean [min, max] over 3 seeds"
    assert stats.interval_caption(pd.Series([5, 4])) == "mean [95% t-interval within [0, 1]] over 4-5 seeds"


def test_a_method_keeps_its_colour_in_every_figure(tmp_path):
    """A method with no run at the largest P: the epoch figure coloured the others by their place among the
    lines it draws, so pipemare took pipedream's colour."""
    configs = ([RunConfig(**{**BASE, "stages": p}, method=m, seed=0) for m in ("gpipe", "pipemare") for p in (1, 3)]
               + [RunConfig(**{**BASE, "stages": 1}, method="pipedream", seed=0)])
    records = _sweep(tmp_path, configs)

    def colours(fig, ax_pick):
        ax = ax_pick(fig)
        handles, labels = ax.get_legend_handles_labels() if ax.get_legend_handles_labels()[1] else \
            (fig.legends[0].legend_handles, [t.get_text() for t in fig.legends[0].texts])
        return {lab: tuple(np.round(h.get_color(), 4)) for h, lab in zip(handles, labels)
                if lab in ACCS and hasattr(h, "get_color")}
    stages_fig = plots.plot_accuracy_vs_stages(records, "best_acc")
    epoch_fig = plots.plot_accuracy_vs_epoch(records, 3)
    by_stage = colours(stages_fig, lambda f: next(a for a in f.axes if a.get_title() == "throughput"))
    by_epoch = colours(epoch_fig, lambda f: f.axes[0])
    assert by_epoch and all(by_epoch[m] == by_stage[m] for m in by_epoch)


def test_a_key_only_one_method_sets_keeps_the_gpipe_baseline(tmp_path):
    """A sweep over pipemare's T2 decay (GPipe leaves it unset): each decay is a configuration, and its speedup is
    over the GPipe runs, whose unset decay matches any (every pipemare speedup was NaN)."""
    configs = ([RunConfig(**BASE, method="gpipe", seed=s) for s in (0, 1)]
               + [RunConfig(**BASE, method="pipemare", decay=d, seed=s) for d in (0.1, 0.5) for s in (0, 1)])
    records = _sweep(tmp_path, configs)
    assert sweep.varying_keys(records) == ["decay"]
    result = write_report(records, tmp_path / "report", target=0.85)
    fast = result.speedup
    assert len(fast) == 3 and fast["speedup"].notna().all() and (fast[fast.method == "pipemare"].speedup > 1).all()


def test_unset_is_one_value_whether_none_or_nan():
    """Records concatenated from runs that lack a column (NaN) and runs that set it to None: one value, not a key
    that splits every method (all claims were 'not evaluated'); 4 and 4.0 are one number."""
    assert not sweep.varies(pd.Series([None, float("nan"), None]))
    assert not sweep.varies(pd.Series([4, 4.0]))
    assert sweep.varies(pd.Series([None, 30]))
    records = pd.DataFrame({"run": ["a", "b", "c", "d"], "method": ["gpipe", "gpipe", "pipemare", "pipemare"],
                            "stages": 3, "seed": [0, 1, 0, 1], "max_steps": [None, float("nan"), None, None]})
    assert sweep.varying_keys(records) == []


def test_lines_with_an_unset_key_keep_styles_of_their_own(tmp_path):
    """Lines whose key is unset (NaN) all took one style: a NaN in a groupby key is never equal to another's."""
    configs = ([RunConfig(**BASE, method=m, seed=0) for m in ("gpipe", "pipedream")]
               + [RunConfig(**BASE, method="pipemare", decay=d, seed=0) for d in (0.1, 0.5)]
               + [RunConfig(**BASE, method="pipemare", seed=0)])
    records = _sweep(tmp_path, configs)
    lines = plots._lines(plots.per_run(records), plots.line_keys(records), None)
    looks = [(tuple(style["color"]), style["marker"]) for _, style, _ in lines]
    assert len(lines) == 5 and len(set(looks)) == 5


def test_run_memory_needs_no_dataframe_map(tmp_path, monkeypatch):
    """setup.cfg allows pandas 1.5, whose DataFrames have no .map (2.1 added it): every report raised there."""
    configs = [RunConfig(**{**BASE, "microbatches": n}, method="pipemare", seed=0) for n in (1, 4)]
    records = _sweep(tmp_path, configs)
    monkeypatch.delattr(pd.DataFrame, "map", raising=False)
    assert len(hardware.run_memory(records)) == 2


def test_records_of_a_train_function_without_hardware_columns_plot_and_say_what_is_left_out(tmp_path):
    """A --train-fn returns RECORD_COLUMNS only (no utilization, no memory_ratio_gpipe): the stages figure draws
    the quality (and speedup) panels and warns that the throughput and memory ones are left out, instead of a
    KeyError; a model or data this process cannot build leaves the total-memory panel out with a warning."""
    import warnings as w
    from test_sweep import SWEEP, fake_train
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP)
    sweep.run_sweep(path, tmp_path / "s", train_fn=fake_train, bar=False)
    records = sweep.collect(tmp_path / "s")
    assert "utilization" not in records.columns
    with pytest.warns(UserWarning, match="the records have no utilization or memory_ratio_gpipe"):
        fig = plots.plot_accuracy_vs_stages(records, target=0.5)
    titles = [ax.get_title() for ax in fig.axes]
    assert "model quality" in titles and "throughput" not in titles
    with w.catch_warnings():
        w.simplefilter("error")
        assert not hardware.run_memory(records)["total_ratio_gpipe"].isna().any()  # mlp on synthetic: built
    with pytest.warns(UserWarning, match="total memory .* of model 'mlp' on data 'no-such-data' is left out"):
        memory = hardware.run_memory(records.assign(data="no-such-data"))
    assert memory["total_ratio_gpipe"].isna().all()


def test_the_title_counts_the_seeds_of_a_line_whose_key_is_unset(tmp_path):
    """describe() grouped by the line keys with pandas' dropna: GPipe's runs (decay unset) were left out of the
    title's seed count, which said "2 seeds" beside summary.csv's 3 runs per GPipe cell."""
    base = dict(model="mlp", data="synthetic", epochs=3, batch_size=20, microbatches=4)
    records = _sweep(tmp_path, [RunConfig(**base, stages=p, method="gpipe", seed=s) for p in (1, 3) for s in (0, 1, 2)]
                     + [RunConfig(**base, stages=p, method="pipemare", decay=d, seed=s) for p in (1, 3)
                        for d in (0.1, 0.5) for s in (0, 1)])
    runs = sweep.summarize(records, by=[*plots.line_keys(records), "stages"])["runs"]
    assert (runs.min(), runs.max()) == (2, 3) and plots.describe(records).endswith("2-3 seeds")


NAN_BASE = dict(model="mlp", data="synthetic", epochs=3, batch_size=20, microbatches=4)


def _a_nan_in_seed_3(config, progress=False):
    """fake_train, but pipemare's seed 3 records NaN as its last accuracy (a user's train function may, without
    diverging)."""
    df = fake_train(config)
    if config.method == "pipemare" and config.seed == 3:
        df.loc[df.index[-1], "test_acc"] = np.nan
    return df


def test_the_quality_caption_counts_the_values_each_interval_is_over(tmp_path):
    """The caption named the interval from the runs per cell, but stats.interval leaves a NaN value out (a user's
    train function may record one without a divergence): a cell of 4 runs with one NaN was drawn as [min, max] of
    3 under '95% t-interval over 4 seeds'."""
    sweep.run_sweep([RunConfig(**NAN_BASE, stages=p, method=m, seed=s) for m in ("gpipe", "pipemare") for p in (1, 3)
                     for s in range(4)], tmp_path / "sweep", train_fn=_a_nan_in_seed_3, bar=False)
    fig = plots.plot_accuracy_vs_stages(sweep.collect(tmp_path / "sweep"), "final_acc")
    label = next(a for a in fig.axes if a.get_title() == "model quality").get_ylabel()
    assert "[min, max] where a cell has 3 seeds" in label


def test_the_printed_captions_count_the_values_each_interval_is_over(tmp_path, capsys):
    """`staleopt results`, compare and the demo named the interval from the runs per cell while stats.interval
    leaves a NaN value out: a cell of 4 runs whose one run recorded NaN was printed as [min, max] of 3 under
    '95% t-interval over 4 seeds'."""
    from staleopt.cli import main
    sweep.run_sweep([RunConfig(**NAN_BASE, stages=3, method=m, seed=s) for m in ("gpipe", "pipemare") for s in range(4)],
                    tmp_path / "sweep", train_fn=_a_nan_in_seed_3, bar=False)
    summary = sweep.summarize(sweep.collect(tmp_path / "sweep")).set_index("method")
    assert summary["runs"].tolist() == [4, 4] and summary["final_acc_n"].to_dict() == {"gpipe": 4, "pipemare": 3}
    assert sweep.interval_sizes(summary, ["best_acc"]) == [4, 4]
    assert sweep.interval_sizes(summary, ["final_acc"]) == [4, 3]
    capsys.readouterr()
    assert main(["results", str(tmp_path / "sweep")]) == 0
    assert "t-interval within [0, 1]] over 4 seeds, [min, max] where a cell has 3 seeds" in capsys.readouterr().out


def test_a_method_missing_only_at_the_figures_p_is_not_called_missing_from_the_sweep():
    """plot --curves --stages 2 --methods pipemare said pipemare was "not in the sweep" when it only had no run at
    P = 2; a method in no run at all is still named as not in the sweep."""
    every = pd.DataFrame({"method": ["gpipe", "pipemare", "gpipe"], "stages": [2, 1, 1], "run": ["a", "b", "c"]})
    at = every[every["stages"] == 2]
    with pytest.raises(ConfigError, match=r"methods \['pipemare'\] have no run at P = 2"):
        plots._lines(at, ["method"], ["pipemare"], every)
    with pytest.raises(ConfigError, match=r"methods \['nope'\] are not in the sweep"):
        plots._lines(at, ["method"], ["pipemare", "nope"], every)
    assert [label for label, _, _ in plots._lines(at, ["method"], ["gpipe"], every)] == ["gpipe"]


def test_plot_curves_and_time_refuse_a_level_they_do_not_draw(tmp_path, capsys):
    """plot --curves/--time took any --level (2, nan) and drew the same figure for each (the curves draw means, no
    interval), where the default figure refuses --level 2: refused as --target is with --curves; the plot
    functions take no level."""
    from staleopt.cli import main
    records = _sweep(tmp_path, [RunConfig(**BASE, method=m, seed=s) for m in ("gpipe", "pipemare") for s in (0, 1)])
    folder = str(tmp_path / "sweep")
    for figure in ("--curves", "--time"):
        for level in ("2", "nan", "0.5", "0.95"):
            out = tmp_path / f"{figure[2:]}_{level}.png"
            assert main(["plot", folder, figure, "--stages", "3", "--level", level, "--out", str(out)]) == 2
            assert f"{figure} draws means and each seed's curve, no interval: leave --level out" in \
                capsys.readouterr().err and not out.exists()
        assert main(["plot", folder, figure, "--stages", "3", "--out", str(tmp_path / "ok.png"), "--dpi", "40"]) == 0
    assert main(["plot", folder, "--level", "0.5", "--out", str(tmp_path / "a.png"), "--dpi", "40"]) == 0
    assert main(["plot", folder, "--level", "2", "--out", str(tmp_path / "b.png")]) == 2
    for draw in (plots.plot_accuracy_vs_epoch, plots.plot_accuracy_vs_time):
        assert "level" not in inspect.signature(draw).parameters
