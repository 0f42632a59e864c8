"""A lower-is-better metric (a language model's test perplexity) through every consumer of the records: the
per-run table, the summary, time to a target, the claims, the figures, ``staleopt results`` and the ledger's
verdicts, on hand-made records (numbers derived by hand; no language model is trained)."""
import json
import math

import pandas as pd
import pytest

from staleopt import claims, metrics, speedup, stats, sweep
from staleopt.claims import Beats, Degrades, Faster, Matches
from staleopt.cli import main
from staleopt.commands.demo import pivot
from staleopt.errors import ConfigError, SweepConfigError
from staleopt.ledger import spec, verdict
from staleopt.ledger.verdict import NOT, REPRODUCED
from staleopt.metrics import ACCURACY, PERPLEXITY, TEST_LOSS
from staleopt.plot import ledger as ledger_plots
from staleopt.plot import sweep as plots

#: test perplexity per epoch (10 steps each) of seeds 0, 1, 2; the same at P = 2 and P = 8 unless given per P.
PPL = {"gpipe": [[40, 20, 12, 11], [40, 22, 12, 10], [38, 20, 13, 12]],        # best 11, 10, 12: mean 11
       ("pipemare", 2): [[35, 15, 12, 12.5], [36, 16, 13, 13], [34, 15, 14, 14]],  # best 12, 13, 14: mean 13
       ("pipemare", 8): [[40, 30, 25, 25]] * 3}                                  # best 25
BEST_LOSS = 1.0  # the data's best achievable loss, nats per token


def lm_records(ppl=PPL):
    rows = []
    for method in ("gpipe", "pipemare"):
        for p in (2, 8):
            for seed, values in enumerate(ppl.get((method, p), ppl.get(method))):
                for epoch, v in enumerate(values, 1):
                    rows.append({"run": f"{method}-{p}-{seed}", "method": method, "stages": p, "microbatches": 4,
                                 "seed": seed, "epoch": epoch, "step": 10 * epoch, "train_loss": 1.0 / epoch,
                                 "test_loss": math.log(v), "test_acc": math.nan, "test_ppl": float(v),
                                 "best_loss": BEST_LOSS, "utilization": 1.0 if method == "pipemare" else 0.5,
                                 "memory_ratio_gpipe": 1.0, "status": "ok"})
    return pd.DataFrame(rows)


def cls_records():
    return pd.DataFrame([{"run": f"r{s}", "method": "gpipe", "stages": 2, "microbatches": 4, "seed": s, "epoch": e,
                          "step": 10 * e, "train_loss": 0.5, "test_loss": 0.4, "test_acc": 0.5 + 0.1 * e + s / 100,
                          "status": "ok"} for s in (0, 1) for e in (1, 2)])


# ----------------------------------------------------------------------------------------------- metrics

def test_the_task_is_read_off_the_records():
    assert metrics.task_of(cls_records()) == "classification"
    assert metrics.task_of(cls_records().assign(test_ppl=math.nan, best_loss=math.nan)) == "classification"
    assert metrics.task_of(lm_records()) == "lm" and metrics.of(lm_records()) is PERPLEXITY
    regression = cls_records().assign(test_acc=math.nan, test_ppl=math.nan)
    assert metrics.task_of(regression) == "regression" and metrics.of(regression) is TEST_LOSS
    assert metrics.task_of(pd.DataFrame()) == "classification"                   # nothing to read: as before
    diverged = lm_records().assign(test_ppl=math.inf)                           # exp of an overflowed loss
    assert metrics.task_of(diverged) == "lm"
    with pytest.raises(ConfigError, match="mix tasks"):
        metrics.task_of(pd.concat([cls_records(), lm_records()]))
    assert metrics.of(pd.concat([cls_records(), lm_records()]), "test_loss") is TEST_LOSS
    with pytest.raises(ConfigError, match="unknown metric"):
        metrics.get("bleu")
    assert metrics.per_run_column("final_ppl") == (PERPLEXITY, "final")
    with pytest.raises(ConfigError, match="best_acc"):
        metrics.per_run_column("best_bleu")


def test_direction_gain_and_target_of_each_metric():
    assert PERPLEXITY.best([12.0, math.nan, 10.0, 11.0]) == 10.0 and ACCURACY.best([0.2, 0.7, 0.5]) == 0.7
    assert PERPLEXITY.gain(10.0, 12.0) == 2.0 and ACCURACY.gain(0.9, 0.8) == pytest.approx(0.1)  # + : better
    assert PERPLEXITY.reached(pd.Series([13.0, 12.0, 11.0]), 12.0).tolist() == [False, True, True]
    assert ACCURACY.worse_by(0.93, 0.01) == pytest.approx(0.92)
    assert PERPLEXITY.worse_by(20.0, 0.01) == pytest.approx(20.2)               # relative: 1% of a perplexity
    assert ACCURACY.amount(0.02) == "0.02" and PERPLEXITY.amount(0.5) == "0.50 perplexity"


# ------------------------------------------------------------------------------------- stats and summary

def test_per_run_best_is_the_lowest_perplexity_and_excess_loss_is_above_the_best_loss():
    table = stats.per_run(lm_records(), ["method", "stages"], target=12.5).set_index("run")
    assert table.loc["pipemare-2-0", ["best_ppl", "final_ppl", "steps_to_target"]].tolist() == [12.0, 12.5, 30.0]
    assert math.isnan(table.loc["pipemare-2-1", "steps_to_target"])              # 13 at best: never <= 12.5
    assert table.loc["gpipe-2-1", "excess_loss"] == pytest.approx(math.log(10) - BEST_LOSS)
    assert "best_acc" not in table.columns
    run = lm_records()[lambda r: r.run == "gpipe-2-2"]
    assert stats.steps_to_target(run, 13) == 30 and stats.steps_to_target(run, 20) == 20
    assert math.isnan(stats.steps_to_target(run, 5.0))
    with pytest.raises(ConfigError, match="target test perplexity must be a finite number"):
        stats.steps_to_target(run, math.nan)


def test_an_unbounded_metric_is_never_clipped_to_the_unit_interval():
    values = [0.5, 1.5, 0.9, 1.3]
    _, lo, hi, _, kind = stats.interval(values, bounds=PERPLEXITY.bounds)
    assert kind == "t" and lo < 0.9 and hi > 1.0
    assert stats.interval(values)[2] == 1.0                                      # accuracy's bounds clip it
    assert stats.interval_caption(4, bounds=None) == "mean [95% t-interval] over 4 seeds"
    assert stats.interval_caption(4) == "mean [95% t-interval within [0, 1]] over 4 seeds"


def test_summary_of_a_language_model_and_unchanged_columns_for_a_classifier():
    s = sweep.summarize(lm_records(), by=["method", "stages"]).set_index(["method", "stages"])
    assert s.loc[("gpipe", 2), ["best_ppl", "best_ppl_lo", "best_ppl_hi"]].tolist() == [11.0, 10.0, 12.0]
    assert s.loc[("pipemare", 8), "final_ppl"] == 25.0
    assert s.loc[("gpipe", 2), "excess_loss"] == pytest.approx((math.log(11) + math.log(10) + math.log(12)) / 3 - 1)
    assert "best_acc" not in s.columns
    loss = sweep.summarize(lm_records(), by=["method", "stages"], metric="test_loss")
    assert loss.loc[0, "best_test_loss"] == pytest.approx(math.log(11 * 10 * 12) / 3)
    plain = sweep.summarize(cls_records(), by=["method", "stages"])
    with_new_columns = sweep.summarize(cls_records().assign(test_ppl=math.nan, best_loss=math.nan),
                                       by=["method", "stages"])
    pd.testing.assert_frame_equal(plain, with_new_columns)
    assert list(plain.columns[3:8]) == ["best_acc", "best_acc_lo", "best_acc_hi", "best_acc_ci", "final_acc"]
    table = pivot(sweep.summarize(lm_records(), by=["method", "stages"]))
    assert table.loc["gpipe", "P=2"] == "11.00 [10.00, 12.00]"
    with pytest.raises(ConfigError, match="no 'final_acc' .* pass one of best_ppl, final_ppl"):  # (AttributeError)
        pivot(sweep.summarize(lm_records(), by=["method", "stages"]), "final_acc")


# ---------------------------------------------------------------------------------- time to a target

def test_time_to_a_perplexity_is_the_first_epoch_at_or_below_it():
    assert speedup.default_target(lm_records()) == pytest.approx(11 * 1.01)      # GPipe's best plus 1%
    fast = speedup.speedup_table(lm_records(), 12.5).set_index(["method", "stages"])
    assert fast.loc[("gpipe", 2), ["runs", "reached", "steps_to_target"]].tolist() == [3, 3, pytest.approx(100 / 3)]
    assert fast.loc[("pipemare", 2), ["reached", "steps_to_target"]].tolist() == [1, 30.0]
    # GPipe: 100/3 steps at utilization 0.5 (the analytic one: N / (N + P - 1) = 4/5 at P = 2)
    assert fast.loc[("pipemare", 2), "speedup"] == pytest.approx(fast.loc[("gpipe", 2), "time_to_target"] / 30)
    assert fast.loc[("pipemare", 8), "reached"] == 0


# ------------------------------------------------------------------------------------------ claims

def test_claims_on_perplexity_read_lower_as_better():
    table = claims.evaluate(lm_records(), [
        Beats("gpipe", "pipemare", 2, 1.5),       # 11 against 13: better by 2 perplexity
        Beats("pipemare", "gpipe", 2, 0.0),       # worse: a negative gain
        Matches("pipemare", "gpipe", 2, 2.5),
        Matches("pipemare", "gpipe", 2, 1.0),
        Degrades("pipemare", 2, 8, 10.0),         # 13 -> 25: worse by 12
        Faster("gpipe", "pipemare", 2, 1.0),      # pipemare: 1 of 3 reach 12.5
    ], target=12.5)
    assert table.verdict.tolist() == ["holds", "does not hold", "holds", "does not hold", "holds", "does not hold"]
    assert table.claim[0] == "gpipe beats pipemare at P = 2 by >= 1.50 perplexity"
    assert table.evidence[0] == "gpipe 11.00 [10.00, 12.00] vs pipemare 13.00 [12.00, 14.00]: +2.000"
    assert table.evidence[1].endswith(": -2.000")
    assert table.claim[2] == "pipemare within 2.50 perplexity of gpipe at P = 2"
    assert table.evidence[4].endswith(": -12.000")
    assert table.claim[5].startswith("gpipe reaches 12.50 >= 1x sooner") and "1/3 reached it" in table.evidence[5]
    # the default target of a perplexity is GPipe's best plus 1%, not the demo's accuracy
    auto = claims.evaluate(lm_records(), [Faster("gpipe", "pipemare", 2)])
    assert "reaches 11.11" in auto.claim[0]


# ------------------------------------------------------------------------------------------- figures

def test_figures_label_their_axes_from_the_metric():
    fig = plots.plot_accuracy_vs_stages(lm_records())
    ax = fig.axes[2]
    assert ax.get_ylabel().startswith("best test perplexity\n(mean [min, max] over 3 seeds")
    assert ax.get_ylim()[1] > 25                                                 # no [0, 1] axis
    assert fig.axes[3].get_ylabel() == "speedup to perplexity 11.11 (x GPipe)"
    final = plots.plot_accuracy_vs_stages(lm_records(), metric="final_test_loss").axes[2]
    assert final.get_ylabel().startswith("final test loss")
    with pytest.raises(ConfigError, match="unknown per-run value"):
        plots.plot_accuracy_vs_stages(lm_records(), metric="best_bleu")
    curves = plots.plot_accuracy_vs_epoch(lm_records(), 2).axes[0]
    assert curves.get_ylabel() == "test perplexity (mean over seeds; thin: each seed)" and curves.get_ylim()[1] > 30
    timed = plots.plot_accuracy_vs_time(lm_records(), 2, target=12.5).axes[0]
    assert "target 12.50" in [t.get_text() for t in timed.get_legend().get_texts()]
    acc = plots.plot_accuracy_vs_epoch(cls_records(), 2).axes[0]
    assert acc.get_ylabel() == "test accuracy (mean over seeds; thin: each seed)" and acc.get_ylim() == (0.0, 1.0)


# ---------------------------------------------------------------------------------- staleopt results

def lm_train(config, progress=False):
    """A stand-in for staleopt.train.run on a language model: perplexity falls with the epochs, pb's more slowly."""
    slow = 2.0 if config.method == "pb" else 1.0
    rows = []
    for epoch in range(1, config.epochs + 1):
        loss = 1.0 + slow * (1.0 + config.seed / 10) / epoch
        rows.append({"epoch": epoch, "step": 5 * epoch, "train_loss": loss, "test_loss": loss,
                     "test_acc": math.nan, "test_ppl": math.exp(loss), "best_loss": 1.0, "lr_base": 0.1,
                     "wall_time": 0.0, "utilization": 1.0, "memory_ratio_gpipe": 1.0, "status": "ok"})
    return pd.DataFrame(rows)


def test_results_command_summarizes_perplexity(tmp_path, capsys):
    path = tmp_path / "sweep.toml"
    path.write_text('name = "lm"\n[base]\nmodel = "mlp"\ndata = "synthetic"\nepochs = 3\n'
                    '[grid]\nmethod = ["gpipe", "pb"]\nstages = [2]\nseed = [0, 1]\n')
    sweep.run_sweep(path, tmp_path / "s", train_fn=lm_train, bar=False)
    assert main(["results", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "(test perplexity, lower is better: mean [min, max] over 2 seeds)" in out
    assert "excess_loss" in out and "time to perplexity" in out
    summary = pd.read_csv(tmp_path / "s" / "results" / "summary.csv").set_index("method")
    assert {"best_ppl", "final_ppl", "excess_loss"} <= set(summary.columns) and "best_acc" not in summary.columns
    assert summary.loc["gpipe", "best_ppl"] == pytest.approx((math.exp(1 + 1 / 3) + math.exp(1 + 1.1 / 3)) / 2)
    assert summary.loc["pb", "excess_loss"] == pytest.approx((2 / 3 + 2.2 / 3) / 2)
    fast = pd.read_csv(tmp_path / "s" / "results" / "speedup.csv").set_index("method")
    # the target is GPipe's mean best plus 1%, 3.897: seed 0 (3.794) reaches it, seed 1 (3.922) and pb do not
    assert fast.loc["gpipe", "reached"] == 1 and fast.loc["pb", "reached"] == 0
    assert main(["results", str(tmp_path / "s"), "--metric", "test_loss"]) == 0
    assert "best_test_loss" in pd.read_csv(tmp_path / "s" / "results" / "summary.csv").columns
    # a report's target in another metric is not this one's
    (tmp_path / "s" / "report.json").write_text(json.dumps({"target": 0.5}))      # accuracy's (no metric named)
    assert speedup.shared_target(tmp_path / "s", sweep.collect(tmp_path / "s")) == pytest.approx(
        math.exp(1 + 1 / 3) * 0.5 * 1.01 + math.exp(1 + 1.1 / 3) * 0.5 * 1.01)
    (tmp_path / "s" / "report.json").write_text(json.dumps({"target": 5.0, "metric": "test_ppl"}))
    assert speedup.shared_target(tmp_path / "s", sweep.collect(tmp_path / "s")) == 5.0


# ------------------------------------------------------------------------------------------- ledger

def _lm_runs(method, ppl, metric_key=True):
    return [{"recipe": "r", "method": method, "stages": 4, "seed": s, "score": v, "test_ppl": v,
             "test_loss": math.log(v), "diverged": False, **({"metric": "test_ppl"} if metric_key else {})}
            for s, v in enumerate(ppl)]


def _check(rule="better", metric=None, margin=0.01):
    return spec.Check("c", "a claim", "Paper §1", "1.0", rule, {"a": {"recipe": "r", "method": "x"},
                                                               "b": {"recipe": "r", "method": "y"}}, margin,
                      metric=metric)


def test_ledger_verdicts_on_perplexity_take_lower_as_better():
    runs = _lm_runs("x", [10.0, 10.2, 10.1]) + _lm_runs("y", [12.0, 12.5, 12.2])
    row = verdict.evaluate(_check(), runs, "e", "s")
    assert row.verdict == REPRODUCED and row.estimate == pytest.approx(2.1333, abs=1e-3) and row.metric == "test_ppl"
    assert "gain (perplexity, lower is better) +2.133" in row.ours and "x P=4: 10.100" in row.ours
    assert verdict.evaluate(_check(), _lm_runs("x", [12.0, 12.5, 12.2]) + _lm_runs("y", [10.0, 10.2, 10.1]),
                            "e", "s").verdict == NOT
    on_loss = verdict.evaluate(_check(metric="test_loss"), runs, "e", "s")
    assert on_loss.verdict == REPRODUCED and on_loss.estimate == pytest.approx(
        sum(math.log(b / a) for a, b in [(10.0, 12.0), (10.2, 12.5), (10.1, 12.2)]) / 3)
    near = _lm_runs("x", [10.0, 10.2, 10.1]) + _lm_runs("y", [10.5, 10.6, 10.4])
    assert verdict.evaluate(_check("matches", "test_ppl", 1.0), near, "e", "s").verdict == REPRODUCED
    mixed = _lm_runs("x", [10.0, 10.2, 10.1]) + [dict(r, metric="test_acc") for r in _lm_runs("y", [12.0] * 3)]
    row = verdict.evaluate(_check(), mixed, "e", "s")
    assert row.verdict == NOT and "different metrics" in row.reason
    assert ledger_plots.gap_label(_check(), "test_ppl") == "y - x (perplexity)"
    assert ledger_plots.gap_label(_check()) == "x - y"                           # accuracy's, as before


def test_ledger_scores_are_in_each_runs_task_metric():
    records = lm_records()
    recipe_of = {r: "r" for r in records["run"].unique()}
    by_run = {r["run"]: r for r in verdict.scores(records, recipe_of)}
    assert by_run["pipemare-2-0"]["metric"] == "test_ppl" and by_run["pipemare-2-0"]["score"] == 12.5
    cls = verdict.scores(cls_records(), {"r0": "r", "r1": "r"})
    assert {r["metric"] for r in cls} == {"test_acc"} and cls[0]["score"] == pytest.approx(0.7)


_RECIPES = "".join(f'[{recipe}.{scale}]\ndescription = "{data}"\nseeds = [0, 1]\nmodel = "{model}"\ndata = "{data}"\n'
                   for recipe, model, data in (("lm", "gpt", "text-markov"), ("cls", "mlp", "synthetic"))
                   for scale in ("cpu", "paper"))


_EXPERIMENT = """
title = "LM"
[[runs]]
recipe = "lm"
method = ["gpipe", "pipemare"]
stages = [2]
[[check]]
id = "lm-matches"
claim = "PipeMare matches GPipe's perplexity"
source = "a paper"
paper_number = "-"
rule = "matches"
a = {recipe = "lm", method = "pipemare"}
b = {recipe = "lm", method = "gpipe"}
"""


def test_a_check_names_its_metric_and_its_margin_is_in_its_units(tmp_path):
    (tmp_path / "recipes.toml").write_text(_RECIPES)
    (tmp_path / "lm.toml").write_text(_EXPERIMENT + 'metric = "test_ppl"\nmargin = 2.0\n')
    check = spec.load_experiment(tmp_path / "lm.toml").checks[0]
    assert (check.metric, check.margin) == ("test_ppl", 2.0)
    (tmp_path / "lm.toml").write_text(_EXPERIMENT + "margin = 2.0\n")             # accuracy points: below 1
    with pytest.raises(SweepConfigError, match="margin must be a number in"):
        spec.load_experiment(tmp_path / "lm.toml")
    (tmp_path / "lm.toml").write_text(_EXPERIMENT + 'metric = "bleu"\n')
    with pytest.raises(SweepConfigError, match="unknown metric 'bleu'"):
        spec.load_experiment(tmp_path / "lm.toml")
    # a metric the selected runs do not record (a classifier's perplexity) read "not yet run" for good: refused
    (tmp_path / "cls.toml").write_text(_EXPERIMENT.replace('"lm"', '"cls"') + 'metric = "test_ppl"\nmargin = 2.0\n')
    with pytest.raises(SweepConfigError, match=r"selects runs of 'synthetic': a classification run records no "
                                               r"test perplexity"):
        spec.load_experiment(tmp_path / "cls.toml")


def test_staleopt_train_prints_perplexity_for_a_language_model(capsys):
    from staleopt.commands.train import _printer
    show = _printer()
    show({"epoch": 1, "step": 5, "train_loss": 3.0, "test_loss": 2.0, "test_acc": 0.25,
          "test_ppl": math.exp(2.0), "best_loss": 1.5, "lr_base": 0.1, "wall_time": 1.0, "status": "ok"})
    header, row = capsys.readouterr().out.splitlines()
    assert "test_ppl" in header and "best_loss" in header and "7.389" in row  # (test_acc: next-token accuracy)
    show = _printer()
    show({"epoch": 1, "step": 5, "train_loss": 3.0, "test_loss": 2.0, "test_acc": 0.5, "test_ppl": math.nan,
          "lr_base": 0.1, "wall_time": 1.0, "status": "ok"})
    header = capsys.readouterr().out.splitlines()[0]
    assert "test_acc" in header and "test_ppl" not in header
    show = _printer()  # a corpus (no best loss) whose first epoch's perplexity overflowed: test_ppl shown all the same
    show({"epoch": 1, "step": 5, "train_loss": 3.0, "test_loss": 800.0, "test_acc": 0.0, "test_ppl": math.inf,
          "best_loss": math.nan, "lr_base": 0.1, "wall_time": 1.0, "status": "ok"})
    header, row = capsys.readouterr().out.splitlines()
    assert "test_ppl" in header and "inf" in row and "best_loss" not in header


def cls_train(config, progress=False):
    """A stand-in for staleopt.train.run on a classifier: accuracy rises with the epochs, pipemare's more slowly."""
    slow = 2.0 if config.method == "pipemare" else 1.0
    rows = [{"epoch": e, "step": 5 * e, "train_loss": 1.0 / e, "test_loss": 1.0 / e,
             "test_acc": 1.0 - 0.5 * slow / e, "lr_base": 0.1, "wall_time": 0.0, "utilization": 1.0,
             "memory_ratio_gpipe": 1.0, "status": "ok"} for e in range(1, config.epochs + 1)]
    return pd.DataFrame(rows)


def test_results_times_each_method_against_gpipe_with_its_own_microbatches(tmp_path):
    """GPipe with N = 4 beside pipemare with N = 1 (a key set per method splits nothing, docs/experiments.md): the
    figures and compare time pipemare against that GPipe; ``results`` keyed its table by every summary column
    (microbatches too), found no GPipe with N = 1 and wrote NaN for the same cell."""
    from staleopt.config import RunConfig
    from staleopt.plot import sweep as plots
    configs = [RunConfig(model="mlp", data="synthetic", method=m, stages=2, microbatches=4 if m == "gpipe" else 1,
                         epochs=4, seed=s) for m in ("gpipe", "pipemare") for s in (0, 1)]
    sweep.run_sweep(configs, tmp_path / "s", train_fn=cls_train, bar=False)
    assert main(["results", str(tmp_path / "s"), "--target", "0.7"]) == 0
    got = pd.read_csv(tmp_path / "s" / "results" / "speedup.csv").set_index(["method", "stages"])["speedup"]
    records = sweep.collect(tmp_path / "s")
    figure = speedup.speedup_table(records, 0.7, keys=[*plots.line_keys(records), "stages"])
    assert got.loc[("pipemare", 2)] == figure.set_index(["method", "stages"]).loc[("pipemare", 2), "speedup"]
    assert math.isfinite(got.loc[("pipemare", 2)])


def test_a_perplexity_or_loss_interval_stays_in_the_values_range():
    """A t-interval over seeds [2.79, 2.80, 2.79, 9.0] reached below 0 for a perplexity (>= 1) and a loss (>= 0):
    tables, claims and figures printed 4.34 [-0.59, 9.28]; clipped to the metric's domain (only the interval)."""
    from staleopt import metrics, stats
    values = [2.79, 2.80, 2.79, 9.0]
    _, lo, hi, _, kind = stats.interval(values, 0.95, metrics.PERPLEXITY.limits)
    assert kind == "t" and lo == 1.0 and hi > 9.0
    assert stats.interval(values, 0.95, metrics.TEST_LOSS.limits)[1] == 0.0
    assert metrics.PERPLEXITY.bounds is None and metrics.PERPLEXITY.worse_by(2.0, 0.01) == 2.0 * 1.01
    rows = [{"run": f"r{s}", "method": "gpipe", "stages": 2, "seed": s, "epoch": 1, "test_ppl": v,
             "test_loss": math.log(v), "test_acc": math.nan, "train_loss": 1.0, "status": "ok"}
            for s, v in enumerate(values)]
    summary = sweep.summarize(pd.DataFrame(rows), by=["method", "stages"])
    assert summary["best_ppl_lo"].iloc[0] == 1.0


def test_phase_lengths_of_a_run_that_diverged_in_its_first_epoch_come_from_a_whole_epoch():
    """pipemare-w's warmup was re-derived from a run's first record as steps per epoch: a run that diverged at
    step 5 of a 40-step epoch got a warmup of 3 steps for the trainer's 30, and a pipeline time too short. The
    steps per epoch come from a run on the same data and batch size that ended one; with none, from the data's
    size; a warning where the data does not load."""
    import warnings

    from staleopt.config import RunConfig
    from staleopt.sweep import _flat
    from staleopt.train import method_args

    def rows(cfg, steps, status):
        return [{**_flat(cfg.to_dict()), "run": cfg.run_id(), "epoch": e, "step": s, "train_loss": 1.0,
                 "test_acc": 0.5, "status": st} for e, (s, st) in enumerate(zip(steps, status), 1)]

    base = dict(model="mlp", data="synthetic", stages=4, epochs=3, batch_size=20)
    warm = RunConfig(**base, method="pipemare-w")
    records = pd.DataFrame(rows(warm, [5], ["diverged"]) + rows(RunConfig(**base), [40, 80, 120], ["ok"] * 3))
    mine = records[records["run"] == warm.run_id()]
    assert speedup._phases(mine, records) == {"warmup_steps": float(method_args(warm, 40 * 20)["warmup_steps"])}
    assert speedup._phases(mine, records)["warmup_steps"] == 30.0
    assert speedup._phases(mine, mine)["warmup_steps"] == 30.0  # (alone: its data loaded, 800 samples)
    with pytest.warns(UserWarning, match="stopped within its first epoch.* does not load here .* may be too short"):
        assert speedup._phases(mine.assign(data="no-such-data"), mine)["warmup_steps"] == 3.0
