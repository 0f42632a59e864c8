"""A diverged language model's perplexity is ``inf`` (or ~1e170): one rule in every table, figure, claim and target.

A run whose metric is infinite has diverged; it counts with that value in every mean and interval (the mean is
``inf``, the interval the range ``[min, inf]``), the figures mark it at the axis' edge, the claims are decided on
the numbers their evidence prints, a spread of values near a float's limit is computed without overflow, and a
baseline whose runs set no finite target leaves a report without its time-to-target table, never no report.
"""
import dataclasses
import math
import warnings

import numpy as np
import pandas as pd
import pytest

from staleopt import claims, metrics, speedup, stats, sweep, train
from staleopt.commands import demo
from staleopt.compare import write_report
from staleopt.config import RunConfig
from staleopt.errors import ConfigError
from staleopt.plot import sweep as plots

INF = math.inf
#: A tiny GPT on a Markov chain.
LM = dict(model="gpt", model_kwargs={"d_model": 16, "heads": 2}, optimizer="adam", lr=0.01, batch_size=16, epochs=3,
          data="text-markov", data_kwargs={"train_tokens": 4000, "test_tokens": 1000, "context": 16})
#: test perplexity per epoch of seeds 0, 1, 2 (10 steps an epoch); dataflow's seed 0 at P = 8 overflowed at once,
#: its seed 1 went to 1e170 (finite, beyond every other value), gpipe's seed 2 at P = 2 diverged before any
#: finite evaluation when ``gpipe_inf``.
PPL = {"gpipe": [[30.0, 20.0, 15.0], [31.0, 21.0, 16.0], [29.0, 19.0, 14.0]],
       ("dataflow", 2): [[32.0, 24.0, 18.0]] * 3,
       ("dataflow", 8): [[INF], [40.0, 1e170], [35.0, 25.0, 21.0]]}


def lm_records(gpipe_inf=False):
    rows = []
    for method in ("gpipe", "dataflow"):
        for p in (2, 8):
            for seed, ppls in enumerate(PPL.get((method, p), PPL.get(method))):
                if gpipe_inf and method == "gpipe":
                    ppls = [INF]
                for epoch, ppl in enumerate(ppls, 1):
                    bad = not ppl < 1e100
                    rows.append({"run": f"{method}-{p}-{seed}", "method": method, "stages": p, "microbatches": 4,
                                 "seed": seed, "epochs": 3, "epoch": epoch, "step": 10 * epoch, "test_ppl": ppl,
                                 "test_loss": math.log(ppl), "test_acc": 0.3, "train_loss": 3.0,
                                 "utilization": 0.5, "memory_ratio_gpipe": 1.0, "status": "diverged" if bad else "ok"})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------- stats

def test_an_infinite_value_counts_in_the_mean_and_the_interval_is_the_range():
    assert stats.t_interval([INF, 20.0, 30.0])[0] == INF and math.isnan(stats.t_interval([INF, 20.0, 30.0])[1])
    assert stats.t_interval([INF, 20.0, 30.0])[2] == 3, "an infinite value is counted, not dropped"
    assert stats.interval([INF, 20.0, 30.0, 25.0], bounds=None) == (INF, 20.0, INF, 4, "range")
    assert stats.mean_ci_text([INF, 20.0, 30.0], digits=2, bounds=None) == "inf [20.00, inf]"
    # NaN is a missing value: left out of n, as before
    assert stats.interval([math.nan, 20.0, 30.0], bounds=None) == (25.0, 20.0, 30.0, 2, "range")


def test_the_spread_of_values_near_a_floats_limit_does_not_overflow():
    mean, lo, hi, n, kind = stats.interval([1.16e170, 2.07e133], bounds=None)  # (x - mean) ** 2 overflows a float
    assert (mean, lo, hi, n, kind) == ((1.16e170 + 2.07e133) / 2, 2.07e133, 1.16e170, 2, "range")
    xs = [1.16e170, 2.0e170, 1.5e170, 0.9e170]
    mean, half, n = stats.t_interval(xs)
    s = float(np.std(np.array(xs) / 1e170, ddof=1)) * 1e170
    assert n == 4 and math.isclose(mean, sum(x / 4 for x in xs), rel_tol=1e-12)
    assert math.isclose(half, 3.182446305284263 * s / 2, rel_tol=1e-9)
    big = [1.5e308, 1.7e308]  # their sum is beyond a float; the mean is not
    assert math.isclose(stats.t_interval(big)[0], 1.6e308, rel_tol=1e-12)


def test_a_diverged_run_without_a_value_scores_the_metrics_worst():
    r = lm_records()
    r.loc[r["run"] == "dataflow-8-0", ["test_ppl", "test_loss"]] = math.nan
    table = stats.per_run(r, ["method", "stages"], metric=metrics.PERPLEXITY).set_index("run")
    assert table.loc["dataflow-8-0", ["best_ppl", "final_ppl", "diverged"]].tolist() == [INF, INF, True]
    assert metrics.PERPLEXITY.worst == INF and metrics.ACCURACY.worst == 0.0 and metrics.TEST_LOSS.worst == INF


# ----------------------------------------------------------------------- tables, claims, figures agree

def test_the_table_the_claim_and_the_figure_say_inf_alike():
    records = lm_records()
    summary = sweep.summarize(records, by=["method", "stages"])
    cell = demo.pivot(summary).loc["dataflow", "P=8"]
    assert cell == "inf [21.00, inf] (2/3 div)", cell
    ctx_claims = claims.evaluate(records, [claims.Beats("gpipe", "dataflow", "max", 2.0)], target=20.0)
    evidence, verdict = ctx_claims.loc[0, ["evidence", "verdict"]]
    assert "dataflow inf [21.00, inf] (2/3 div)" in evidence and verdict == "holds", evidence
    fig = plots.plot_accuracy_vs_stages(records, target=20.0)
    quality = fig.axes[2]
    top = quality.get_ylim()[1]
    assert top < 100, "the axis spans the runs that did not diverge, not 1e170"
    marks = [c for c in quality.collections if c.get_label() == "_beyond"]
    ys = sorted({float(y) for c in marks for y in c.get_offsets()[:, 1]})
    assert ys == [top], "the inf mean, the inf seed and the 1e170 seed sit at the axis' top"
    assert len(marks) == 3, "dataflow at P = 8: its mean and its two seeds beyond the axis"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("beyond the axis") for t in legend) and "diverged run" in legend


def test_the_epoch_curve_ends_beyond_the_axis_where_the_table_says_inf():
    fig = plots.plot_accuracy_vs_epoch(lm_records(), 8)
    ax = fig.axes[0]
    top = ax.get_ylim()[1]
    marks = [c for c in ax.collections if c.get_label() == "_beyond"]
    assert marks and {float(y) for c in marks for y in c.get_offsets()[:, 1]} == {top}
    dataflow = next(line for line in ax.get_lines() if line.get_label() == "dataflow")
    assert list(dataflow.get_ydata()) == [INF, INF, INF], "the seed that overflowed at once is carried at inf"


def test_without_a_diverged_run_the_figures_mark_nothing():
    records = lm_records()
    records = records[~records["run"].str.startswith("dataflow-8")]
    fig = plots.plot_accuracy_vs_stages(records, target=20.0)
    assert not [c for c in fig.axes[2].collections if c.get_label() == "_beyond"]
    lo, hi = fig.axes[2].get_ylim()
    assert lo < 14.0 and hi > 18.0


def test_a_demo_cell_without_a_value_keeps_its_divergence_count():
    assert demo._cell(math.nan, math.nan, math.nan, 3, 3) == "- (3/3 div)"
    assert demo._cell(0.5, 0.4, 0.6, 0, 3) == "0.500 [0.400, 0.600]"


# --------------------------------------------------------------------------------------------- target

def test_the_default_target_is_over_the_baselines_runs_with_a_finite_best():
    records = lm_records()
    records.loc[records["run"] == "gpipe-2-2", "test_ppl"] = INF
    finite = [15.0, 16.0, 15.0, 16.0, 14.0]  # gpipe's best at P = 2 (seeds 0, 1) and P = 8 (seeds 0, 1, 2)
    assert math.isclose(speedup.default_target(records), sum(finite) / 5 * 1.01, rel_tol=1e-12)
    with pytest.raises(ConfigError, match="no 'gpipe' run has a finite best test perplexity.*--target"):
        speedup.default_target(lm_records(gpipe_inf=True))


def test_a_baseline_without_a_finite_best_leaves_a_report_without_its_time_table(tmp_path):
    config = RunConfig(**LM)
    records = lm_records(gpipe_inf=True)
    records = records.assign(**{k: v for k, v in sweep._flat(config.to_dict()).items() if k not in records.columns})
    with pytest.warns(UserWarning, match="finite best.*no time-to-target table"):
        target = speedup.target_or_none(records)
    assert target is None
    with warnings.catch_warnings():  # told once (above): the report's figure draws no time panel, not warning again
        warnings.simplefilter("error")
        result = write_report(records, tmp_path, target=None, metric=metrics.PERPLEXITY)
    figure = plots.plot_accuracy_vs_stages(records, target=math.nan)
    assert not [ax for ax in figure.axes if ax.get_title().startswith("time to")], "target NaN: no time panel"
    assert (tmp_path / "summary.csv").is_file() and (tmp_path / "claims.csv").is_file()
    assert result.speedup_table().empty
    with pytest.warns(UserWarning, match="finite best"):
        fig = plots.plot_accuracy_vs_stages(records)
    assert not [ax for ax in fig.axes if ax.get_title().startswith("time to")], "no speedup panel without a target"
    assert not (tmp_path / "speedup.csv").exists()


# ----------------------------------------------------------------------------------------------- train

def test_an_lm_whose_perplexity_overflows_has_diverged(monkeypatch):
    """A test loss of 800 nats per token is finite but its perplexity is not: the run diverged there, as it does at
    a NaN loss (whose perplexity reads inf, the worst), instead of going on as "ok"."""
    evaluate, calls = train._evaluate, []

    def overflowed_at_epoch_2(*args):
        calls.append(1)
        out = evaluate(*args)
        return {**out, "test_loss": 800.0, "test_ppl": train._ppl(800.0)} if len(calls) == 2 else out

    monkeypatch.setattr(train, "_evaluate", overflowed_at_epoch_2)
    rec = train.run(RunConfig(**LM))
    assert rec["status"].tolist() == ["ok", "diverged"] and rec["test_ppl"].iloc[-1] == INF
    assert train._ppl(math.nan) == INF and train._ppl(708.0) == math.exp(708.0)


# ------------------------------------------------------------------------------ the ledger, regression, summary

def _ledger_runs(method, scores, diverged=()):
    return [{"recipe": "r", "method": method, "stages": 4, "seed": s, "score": v, "diverged": s in diverged}
            for s, v in enumerate(scores)]


def test_the_ledger_pairs_two_diverged_runs_as_no_gap_not_as_a_missing_seed():
    from staleopt.ledger import spec, verdict
    check = spec.Check("c", "a claim", "Paper §1", "1.0", "matches", {"a": {"recipe": "r", "method": "x"},
                                                                      "b": {"recipe": "r", "method": "y"}})
    one = verdict.evaluate(check, _ledger_runs("x", [-INF, 0.90, 0.91], {0}) + _ledger_runs("y", [-INF, 0.90, 0.90],
                                                                                           {0}), "e", "")
    assert one.gaps[0] == (0, 0.0) and "1 paired seed(s) where both diverged count as no gap" in one.reason
    every = verdict.evaluate(check, _ledger_runs("x", [-INF] * 3, {0, 1, 2}) + _ledger_runs("y", [-INF] * 3,
                                                                                            {0, 1, 2}), "e", "")
    assert every.verdict == verdict.NOT and "both diverged (an infinite score) in all 3 paired seeds" in every.reason
    rows = [verdict.Row("e", "c", "claim", "s", "n", "set", "ours", verdict.NOT, gaps=tuple(enumerate(g)), horizon=h,
                        ratio=0.01 / h, steps=100 * h) for h, g in {1: [0.1, 0.2, 0.1], 4: [-INF, 0.2, 0.1]}.items()]
    trend = verdict.trend(rows)
    assert trend.label == verdict.WIDENING and "infinite (a diverged run) at 4x" in trend.text, trend.text


def test_gaps_infinite_in_both_directions_have_no_mean_and_the_ledger_says_so():
    """One side diverged in one seed and the other in another: the gaps are +inf and -inf, whose mean is undefined;
    the verdict says why instead of "differs by +nan", and the trend does not call it an interval-less change."""
    from staleopt.ledger import spec, verdict
    check = spec.Check("c", "a claim", "Paper §1", "1.0", "matches", {"a": {"recipe": "r", "method": "x"},
                                                                      "b": {"recipe": "r", "method": "y"}})
    row = verdict.evaluate(check, _ledger_runs("x", [-INF, 0.90, 0.91], {0}) + _ledger_runs("y", [0.9, -INF, 0.90],
                                                                                           {1}), "e", "")
    assert row.verdict == verdict.NOT and "nan" not in row.reason, row.reason
    assert "infinite in both directions (1 seed(s) +inf, 1 -inf" in row.reason and row.diverged == (0, 1)
    degrades = spec.Check("d", "a claim", "Paper §1", "1.0", "degrades",
                          {"a": {"recipe": "r", "method": "x"}, "reference": {"recipe": "r", "method": "y"}})
    runs = _ledger_runs("x", [0.9, 0.9, 0.9]) + [{**r, "stages": 8} for r in _ledger_runs("x", [-INF, 0.5, 0.9], {0})]
    row = verdict.evaluate(degrades, runs + _ledger_runs("y", [0.9, -INF, 0.9], {1}), "e", "")
    assert row.verdict == verdict.NOT and "infinite in both directions" in row.reason, row.reason
    rows = [verdict.Row("e", "c", "claim", "s", "n", "set", "ours", verdict.NOT, gaps=tuple(enumerate(g)), horizon=h,
                        ratio=0.01 / h, steps=100 * h) for h, g in {1: [0.1, -INF, 0.1], 4: [-INF, 0.2, 0.1]}.items()]
    trend = verdict.trend(rows)
    assert trend.label == verdict.NO_TREND and "infinite (a diverged run) in 1 paired seed(s) and finite again in 1" \
        in trend.text, trend.text



def test_a_gap_infinite_on_the_claims_side_is_judged_and_no_missing_interval_is_described():
    """A diverged b in one seed (gains +inf, +0.5, +0.5: every seed favours a) read "partly: ... the 95% interval
    of the difference includes 0", and one seed read "the 95% interval reaches below": judged on the finite gaps,
    with the infinite ones in the claim's favour; the text counts the paired seeds (it said "1 paired seed")."""
    from staleopt.ledger import spec, verdict
    ab = {"a": {"recipe": "r", "method": "x"}, "b": {"recipe": "r", "method": "y"}}
    better = spec.Check("c", "a claim", "Paper §1", "1.0", "better", ab)
    row = verdict.evaluate(better, _ledger_runs("x", [0.9, 0.9, 0.91]) + _ledger_runs("y", [-INF, 0.4, 0.4], {0}),
                           "e", "")
    assert row.verdict == verdict.REPRODUCED, row.reason
    assert "1 of 3 paired seeds have an infinite gap in the claim's favour" in row.reason
    assert "(3 paired seeds, 1 infinite, no interval)" in row.ours and "1 paired seed" not in row.ours
    against = verdict.evaluate(better, _ledger_runs("x", [-INF, 0.9, 0.9], {0}) + _ledger_runs("y", [0.4] * 3), "e", "")
    assert against.verdict == verdict.NOT
    one = verdict.evaluate(spec.Check("c", "a claim", "Paper §1", "1.0", "not-worse", ab),
                           _ledger_runs("x", [0.9]) + _ledger_runs("y", [0.5]), "e", "")
    assert one.verdict == verdict.PARTLY and one.reason == "one paired seed: no interval", one.reason
    degrades = spec.Check("d", "a claim", "Paper §1", "1.0", "degrades",
                          {"a": {"recipe": "r", "method": "x"}, "reference": {"recipe": "r", "method": "y"}})
    runs = _ledger_runs("x", [0.9, 0.9, 0.91]) + [{**r, "stages": 8} for r in _ledger_runs("x", [-INF, 0.5, 0.51], {0})]
    row = verdict.evaluate(degrades, runs + _ledger_runs("y", [0.95, 0.95, 0.96]), "e", "")
    assert row.verdict == verdict.REPRODUCED and "drop: 1 of 3 paired seeds" in row.reason, row.reason


def test_a_gap_that_changes_sign_between_horizons_is_reversed_not_persisting():
    """lm-warmup-matches-sync went from -0.067 [-0.103, -0.032] at 1x to +0.057 [+0.011, +0.102] at 4x: the size
    barely changed, so the trend read "persisting"; both ends clear 0 on opposite sides: "reversed"."""
    from staleopt.ledger import verdict
    gaps = {1: [-0.05, -0.08, -0.07], 4: [0.06, 0.04, 0.07]}
    rows = [verdict.Row("e", "c", "claim", "s", "n", "set", "ours", verdict.NOT, gaps=tuple(enumerate(g)), horizon=h,
                        ratio=0.01 / h, steps=100 * h) for h, g in gaps.items()]
    assert verdict.trend(rows).label == verdict.REVERSED
    same_side = [dataclasses.replace(r, gaps=tuple((s, abs(g)) for s, g in r.gaps)) for r in rows]
    assert verdict.trend(same_side).label == verdict.PERSISTING


def test_a_claim_on_two_infinite_means_is_not_evaluated():
    """pipedream's and gpipe's mean perplexity both inf (one run of each diverged): gain(inf, inf) = 0 made "within
    0.25 perplexity" hold for runs at 60 against 3; the claim is not evaluated, with the reason."""
    def records(p=4):
        rows = []
        for method, ppls in (("gpipe", [3.0, 3.0]), ("pipedream", [60.0, 60.0])):
            for seed, v in enumerate([INF] + ppls):
                div = math.isinf(v)
                rows.append(dict(run=f"{method}-{seed}", method=method, stages=p, microbatches=4, seed=seed, epochs=1,
                                 epoch=1, step=10, test_acc=0.3, test_loss=INF if div else math.log(v), test_ppl=v,
                                 train_loss=1.0, memory_ratio_gpipe=1.0, status="diverged" if div else "ok"))
        return pd.DataFrame(rows)
    table = claims.evaluate(records(), [claims.Matches("pipedream", "gpipe", "max", 0.25),
                                        claims.Beats("gpipe", "pipedream", "max", 0.0)])
    assert list(table.verdict) == ["not evaluated"] * 2
    assert all("both means are inf" in e for e in table.evidence), list(table.evidence)


def test_the_ledgers_rows_file_is_strict_json_where_a_gap_is_infinite(tmp_path):
    """reproductions.csv held Python's -Infinity in its gaps, which no strict JSON reader takes; the README's ledger
    table reads the strings back as the same numbers, and the file names the seeds where a run diverged."""
    import json
    from staleopt import docgen
    from staleopt.ledger import run as ledger_run, spec, verdict
    check = spec.Check("pipemare-x", "a claim", "Paper §1", "1.0", "matches", {"a": {"recipe": "r", "method": "x"},
                                                                               "b": {"recipe": "r", "method": "y"}})
    row = verdict.evaluate(check, _ledger_runs("x", [-INF, 0.90, 0.91], {0}) + _ledger_runs("y", [0.9, 0.90, 0.90]),
                           "pipemare-e", "")
    ledger_run.rows_csv([row], tmp_path / "rows.csv")
    written = pd.read_csv(tmp_path / "rows.csv").iloc[0]

    def strict(x):
        raise ValueError(f"not strict JSON: {x}")
    assert json.loads(written["gaps"], parse_constant=strict) == [[0, "-inf"], [1, 0.0], [2, pytest.approx(0.01)]]
    assert json.loads(written["diverged"]) == [0]
    assert "-inf (not reproduced)" in docgen.ledger_pipemare(tmp_path / "rows.csv")


def test_the_ledger_figure_fits_a_perplexitys_axis_to_the_seeds_that_did_not_diverge():
    """A diverged run's finite perplexity of 1e170 makes a gap of 1e170: the panel's axis stays on the other seeds'
    gaps and marks that one at the edge (it spanned 1e170 and squashed every other point onto 0)."""
    from staleopt.ledger import spec, verdict
    from staleopt.plot.ledger import horizon_figure
    check = spec.Check("c", "a claim", "Paper §1", "1.0", "matches", {"a": {"recipe": "r", "method": "x"},
                                                                      "b": {"recipe": "r", "method": "y"}},
                       metric="test_ppl", margin=1.0)

    def runs(x, y, div=()):
        return [{**r, "test_ppl": r["score"]} for r in _ledger_runs("x", x, div) + _ledger_runs("y", y)]
    rows = [dataclasses.replace(verdict.evaluate(check, runs(x, y, div), "e", ""), horizon=h, ratio=0.01 / h)
            for h, x, y, div in ((1, [30.2, 30.0, 29.6], [30.0, 30.1, 29.9], ()),
                                 (2, [1e170, 29.5, 29.8], [30.0, 30.1, 29.9], {0}))]
    assert rows[1].diverged == (0,) and rows[0].diverged == ()
    ax = horizon_figure([(check, rows)]).axes[0]
    lo, hi = ax.get_ylim()
    assert -5 < lo and hi < 5, (lo, hi)
    assert [c for c in ax.collections if c.get_label() == "_beyond"], "the diverged seed is marked at the edge"


def test_a_diverged_regression_run_with_a_nan_loss_counts_as_inf_in_the_curves_and_the_ledger():
    from staleopt.ledger import verdict
    rows = []
    for seed, losses in enumerate([[1.0, 0.5, 0.4], [1.2, 0.8, 0.45], [math.nan]]):
        for epoch, loss in enumerate(losses, 1):
            rows.append({"run": f"dataflow-{seed}", "method": "dataflow", "stages": 4, "microbatches": 1,
                         "seed": seed, "epoch": epoch, "step": 10 * epoch, "test_loss": loss, "test_acc": math.nan,
                         "test_ppl": math.nan, "train_loss": 1.0, "utilization": 0.5, "memory_ratio_gpipe": 1.0,
                         "status": "diverged" if math.isnan(loss) else "ok"})
    records = pd.DataFrame(rows)
    assert demo.pivot(sweep.summarize(records, by=["method", "stages"])).loc["dataflow", "P=4"] == \
        "inf [0.400, inf] (1/3 div)"
    line = next(x for x in plots.plot_accuracy_vs_epoch(records, 4).axes[0].get_lines() if x.get_label() == "dataflow")
    assert list(line.get_ydata()) == [INF] * 3, "the table's inf, not the mean of the other two seeds"
    scores = {r["run"]: r["score"] for r in verdict.scores(records, {f"dataflow-{s}": "r" for s in range(3)})}
    assert scores["dataflow-2"] == INF


def test_the_summary_losses_of_a_run_that_overflowed_are_inf():
    records = lm_records()
    records["best_loss"] = 1.0
    bad = records["run"] == "dataflow-8-0"
    records.loc[bad, ["test_loss", "train_loss"]] = math.nan
    table = stats.per_run(records, ["method", "stages"]).set_index("run")
    assert table.loc["dataflow-8-0", ["best_ppl", "final_loss", "excess_loss"]].tolist() == [INF, INF, INF]
    row = sweep.summarize(records, by=["method", "stages"]).set_index(["method", "stages"]).loc[("dataflow", 8)]
    assert row["final_loss"] == INF and row["excess_loss"] == INF


def test_each_summary_column_names_its_own_interval_and_results_says_where_inf_makes_a_range(tmp_path, capsys):
    """A run that diverged late (a finite best, a final perplexity of inf): its group's best has a t-interval and
    its final the range; one ``interval`` column said "range" for both, and ``staleopt results`` called every cell
    a t-interval."""
    from staleopt.cli import main

    def lm_train(config, progress=False):
        late = config.method == "pb" and config.seed == 3
        return pd.DataFrame([{"epoch": e, "step": 5 * e, "train_loss": 1.0, "test_loss": math.log(p),
                              "test_acc": math.nan, "test_ppl": p, "wall_time": 0.0, "utilization": 1.0,
                              "memory_ratio_gpipe": 1.0, "status": "diverged" if p == INF else "ok"}
                             for e, p in enumerate([30.0 + config.seed, INF if late else 20.0 + config.seed], 1)])
    path = tmp_path / "sweep.toml"
    path.write_text('name = "lm"\n[base]\nmodel = "mlp"\ndata = "synthetic"\nepochs = 2\n'
                    '[grid]\nmethod = ["gpipe", "pb"]\nstages = [2]\nseed = [0, 1, 2, 3]\n')
    sweep.run_sweep(path, tmp_path / "s", train_fn=lm_train, bar=False)
    assert main(["results", str(tmp_path / "s")]) == 0
    assert "t-interval] over 4 seeds; a mean of inf shows the range [min, inf])" in capsys.readouterr().out
    summary = pd.read_csv(tmp_path / "s" / "results" / "summary.csv").set_index("method")
    assert "interval" not in summary.columns
    assert summary.loc["pb", ["best_ppl_interval", "final_ppl_interval"]].tolist() == ["t", "range"]
    assert summary.loc["gpipe", ["best_ppl_interval", "final_ppl_interval"]].tolist() == ["t", "t"]


def test_an_lm_run_that_diverged_without_a_loss_takes_the_other_runs_task():
    """Records written before the inf rule (or by a custom train_fn): a diverged LM run whose test loss and
    perplexity are NaN but whose next-token accuracy has a value read as classification, and every table raised
    "the records mix tasks" instead of scoring the run the worst perplexity."""
    records = lm_records()
    records.loc[records["run"] == "dataflow-8-0", ["test_ppl", "test_loss"]] = math.nan
    assert records.loc[records["run"] == "dataflow-8-0", "test_acc"].notna().all()
    assert metrics.task_of(records) == "lm"
    row = sweep.summarize(records, by=["method", "stages"]).set_index(["method", "stages"]).loc[("dataflow", 8)]
    assert row["best_ppl"] == INF and row["status"] == "2/3 diverged"
    classifier = records.assign(test_ppl=math.nan, test_loss=1.0)  # its diverged run keeps a loss: still classified
    assert metrics.task_of(classifier) == "classification"


@pytest.mark.parametrize("target", [None, math.nan, "0.9", True])
def test_time_to_a_target_without_a_number_is_a_config_error(target):
    """shared_target's None (the records set no target) passed on to the time table: an AttributeError on a
    pandas row (the accuracy_vs_stages notebook on a sweep without GPipe runs) instead of saying what to pass."""
    says = "needs the target test perplexity as a number" if target is None else "a target is a finite number"
    with pytest.raises(ConfigError, match=says):
        speedup.speedup_table(lm_records(), target)


def test_the_default_target_leaves_out_a_baseline_run_that_diverged_at_1e170():
    records = lm_records()
    run = records["run"] == "gpipe-2-2"
    records.loc[run, "test_ppl"] = 1e170
    records.loc[run & (records["epoch"] == 3), "status"] = "diverged"
    assert math.isclose(speedup.default_target(records), 15.2 * 1.01, rel_tol=1e-12)  # 15, 16 at P = 2; 15, 16, 14
    every = lm_records()
    every.loc[every["method"] == "gpipe", "status"] = "diverged"  # all diverged (late): what they reached counts
    assert math.isclose(speedup.default_target(every), 15.0 * 1.01, rel_tol=1e-12)


def test_the_claims_without_a_target_are_not_evaluated_rather_than_raising():
    with pytest.warns(UserWarning, match="finite best"):
        table = claims.evaluate(lm_records(gpipe_inf=True))
    faster = table[table["claim"].str.contains("sooner")]
    assert (faster["verdict"] == "not evaluated").all() and faster["claim"].str.contains("none set").all()
