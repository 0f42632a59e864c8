"""Statistics, time to accuracy and the demo's claims on small hand-made records (numbers derived by hand)."""
import math

import pandas as pd
import pytest

from staleopt import claims, speedup, stats
from staleopt.claims import Beats, Degrades, Diverges, Faster, LessMemory, Matches, NeverDiverges
from staleopt.errors import ConfigError

#: test accuracy per epoch (10 steps each) of seeds 0, 1, 2; the same at P = 2 and P = 8 unless given per P.
ACC = {"gpipe": [[0.5, 0.7, 0.9, 0.92], [0.5, 0.8, 0.9, 0.94], [0.6, 0.7, 0.85, 0.93]],
       "pipemare": [[0.6, 0.9, 0.92, 0.91], [0.5, 0.85, 0.93, 0.9], [0.7, 0.92, 0.9, 0.9]],
       ("dataflow", 2): [[0.5, 0.8, 0.9, 0.9]] * 3,
       ("dataflow", 8): [[0.3, 0.1], [0.4, 0.5, 0.1], [0.1]]}  # every run diverges in its last epoch


def hand_records(methods=("gpipe", "pipemare", "dataflow"), stages=(2, 8)):
    rows = []
    for method in methods:
        for p in stages:
            for seed, accs in enumerate(ACC.get((method, p), ACC.get(method))):
                for epoch, acc in enumerate(accs, 1):
                    diverged = method == "dataflow" and p == 8 and epoch == len(accs)
                    rows.append({"run": f"{method}-{p}-{seed}", "method": method, "stages": p, "microbatches": 4,
                                 "seed": seed, "epochs": 4, "epoch": epoch, "step": 10 * epoch, "test_acc": acc,
                                 "train_loss": math.nan if diverged else 1.0 / epoch,
                                 "memory_ratio_gpipe": {"gpipe": 1.0, "pipemare": 4 / 3, "dataflow": 1.0}[method],
                                 "status": "diverged" if diverged else "ok"})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------- stats

def test_steps_to_target_is_the_first_epoch_at_the_target():
    r = hand_records()
    run = r[r.run == "gpipe-2-2"]
    assert stats.steps_to_target(run, 0.9) == 40.0 and stats.steps_to_target(run, 0.85) == 30.0
    assert stats.steps_to_target(run, 0.5) == 10.0 and math.isnan(stats.steps_to_target(run, 0.95))
    with pytest.raises(ConfigError, match="finite"):
        stats.steps_to_target(run, math.nan)


def test_per_run_counts_divergence_and_keeps_diverged_runs():
    table = stats.per_run(hand_records(), ["method", "stages"], target=0.9).set_index("run")
    assert table.loc["dataflow-8-1", ["best_acc", "final_acc", "epochs_run", "steps_run", "diverged"]].tolist() == \
        [0.5, 0.1, 3, 30, True]
    assert stats.divergence_count(table["diverged"]) == (3, 18)
    assert table.loc["pipemare-8-0", "steps_to_target"] == 20 and math.isnan(table.loc["dataflow-8-0", "steps_to_target"])
    assert stats.status_text(0, 3) == "ok" and stats.status_text(3, 3) == "diverged"
    assert stats.status_text(1, 3) == "1/3 diverged"
    # mean 0.93 of 0.92, 0.94, 0.93; s = 0.01; t_{0.975, 2} = 4.302653
    assert stats.mean_ci_text([0.92, 0.94, 0.93]) == "0.930 [0.920, 0.940]"  # 3 seeds: their range
    four = [0.92, 0.94, 0.93, 0.95]
    half = 3.182446 * (sum((v - 0.935) ** 2 for v in four) / 3) ** 0.5 / 2
    assert stats.mean_ci_text(four) == f"0.935 [{0.935 - half:.3f}, {0.935 + half:.3f}]"
    assert stats.mean_ci_text([0.5]) == "0.500" and stats.mean_ci_text([]) == "-"
    with pytest.raises(ConfigError, match="columns"):
        stats.per_run(hand_records().drop(columns="status"), ["method"])
    with pytest.raises(ConfigError, match=r"\(0, 1\)"):
        stats.t_interval([1.0, 2.0], level=1.5)


# --------------------------------------------------------------------------------- time to accuracy

def test_time_to_target_prices_steps_by_utilization():
    # GPipe at P = 8, N = 4: utilization 4 / 11, so T(n) = 11 n / 4; the asynchronous methods: T(n) = n
    table = speedup.time_to_target(hand_records(), 0.9).set_index("run")
    assert table.loc["gpipe-8-2", "steps_to_target"] == 40 and table.loc["gpipe-8-2", "time_to_target"] == 110.0
    assert table.loc["gpipe-2-2", "time_to_target"] == pytest.approx(40 * 5 / 4)
    assert table.loc["pipemare-8-1", "time_to_target"] == 30.0
    assert math.isnan(table.loc["dataflow-8-0", "time_to_target"])


def test_speedup_table_against_gpipe_at_the_same_p():
    s = speedup.speedup_table(hand_records(), 0.9).set_index(["method", "stages"])
    # GPipe reaches 0.9 after 30, 30, 40 steps (mean 100/3); PipeMare after 20, 30, 20 (mean 70/3)
    assert s.loc[("gpipe", 8), "steps_to_target"] == pytest.approx(100 / 3)
    assert s.loc[("gpipe", 8), "time_to_target"] == pytest.approx(100 / 3 * 11 / 4)
    assert s.loc[("pipemare", 8), "speedup"] == pytest.approx((100 / 3 * 11 / 4) / (70 / 3))
    assert s.loc[("pipemare", 2), "speedup"] == pytest.approx((100 / 3 * 5 / 4) / (70 / 3))
    assert s.loc[("gpipe", 2), "speedup"] == pytest.approx(1.0)
    assert s.loc[("dataflow", 2), "speedup"] == pytest.approx((100 / 3 * 5 / 4) / 30)
    assert s.loc[("dataflow", 8), ["reached", "runs", "diverged"]].tolist() == [0, 3, 3]
    assert math.isnan(s.loc[("dataflow", 8), "speedup"])


def test_pipeline_time_of_a_warmup_method_amortizes_its_synchronous_phase():
    # pipemare-w, 4 epochs of 10 steps: warmup = anneal = total // 4 = 10 steps at 4 / 11 (P = 8, N = 4), then 1
    rows = [{"run": "w", "method": "pipemare-w", "stages": 8, "microbatches": 4, "seed": 0, "epochs": 4,
             "epoch": e, "step": 10 * e, "test_acc": 0.2 * e, "train_loss": 1.0, "status": "ok"} for e in (1, 2, 3, 4)]
    timed = speedup.with_pipeline_time(pd.DataFrame(rows))
    assert timed["pipeline_time"].tolist() == pytest.approx([27.5, 37.5, 47.5, 57.5])
    explicit = speedup.with_pipeline_time(pd.DataFrame([{**r, "warmup_steps": 5} for r in rows]))
    assert explicit["pipeline_time"].iloc[0] == pytest.approx(5 * 11 / 4 + 5)
    plain = speedup.with_pipeline_time(hand_records())
    g = plain[plain.run == "gpipe-8-0"]
    assert g["pipeline_time"].tolist() == pytest.approx([10 * e * 11 / 4 for e in (1, 2, 3, 4)])


def test_default_target_and_bad_input():
    assert speedup.default_target(hand_records()) == pytest.approx(0.93 - 0.01)
    with pytest.raises(ConfigError, match="no 'gpipe' runs"):
        speedup.default_target(hand_records(methods=("pipemare",)))
    with pytest.raises(ConfigError, match="microbatches"):
        speedup.time_to_target(hand_records().drop(columns="microbatches"), 0.9)


# ------------------------------------------------------------------------------------------ claims

def test_claims_are_decided_from_the_records():
    table = claims.evaluate(hand_records(), [
        Beats("gpipe", "pipemare", "max", 0.005),       # 0.93 - 0.92333 = +0.00667
        Beats("gpipe", "pipemare", "max", 0.01),
        Matches("pipemare", "gpipe", 8, 0.01),
        Diverges("dataflow", "max"),
        Diverges("dataflow", "min"),
        NeverDiverges(("gpipe", "pipemare")),
        NeverDiverges(("gpipe", "dataflow")),
        Degrades("dataflow", "min", "max", 0.5),      # 0.9 at P = 2, (0.3 + 0.5 + 0.1) / 3 = 0.3 at P = 8
        Faster("pipemare", "gpipe", "max", 3.9),       # 3.93x
        Faster("pipemare", "gpipe", "max", 4.0),
        Faster("dataflow", "gpipe", "max", 1.0),       # never reaches the target
        LessMemory("gpipe", "pipemare"),
        LessMemory("pipemare", "gpipe", 2),
    ], target=0.9)
    assert list(table.columns) == ["claim", "evidence", "verdict"]
    assert table["verdict"].tolist() == ["holds", "does not hold", "holds", "holds", "does not hold", "holds",
                                         "does not hold", "holds", "holds", "does not hold", "does not hold",
                                         "holds", "does not hold"]
    assert table["evidence"][11] == "gpipe 1.00x GPipe vs pipemare 1.33x GPipe (analytic)"
    assert table["claim"][0] == "gpipe beats pipemare at P = 8 by >= 0.01"
    assert "gpipe 0.930 [0.920, 0.940]" in table["evidence"][0] and "+0.007" in table["evidence"][0]
    assert table["evidence"][3] == "3/3 runs diverged"
    assert "dataflow 0.300 [0.100, 0.500]" in table["evidence"][7] and "(3/3 div)" in table["evidence"][7]
    assert "-0.600" in table["evidence"][7]
    assert "speedup 3.93x" in table["evidence"][8] and "0/3 reached" in table["evidence"][10]
    assert "reaches 0.900" in table["claim"][8]


def test_a_time_claim_says_why_a_speedup_that_meets_its_factor_does_not_hold():
    """At 0.925, 1 of 3 pipemare runs and 2 of 3 gpipe runs reach the target at P = 8: the speedup of the runs
    that did (3.67x) meets the factor, and the claim needs every run, a rule the evidence did not state."""
    table = claims.evaluate(hand_records(), [Faster("pipemare", "gpipe", "max", 1.25)], target=0.925)
    (evidence,), (verdict,) = table["evidence"], table["verdict"]
    assert verdict == "does not hold" and "speedup 3.67x" in evidence
    assert evidence.endswith(": not every run reached it (1 of 3 pipemare runs, 2 of 3 gpipe runs)")
    (held,) = claims.evaluate(hand_records(), [Faster("pipemare", "gpipe", "max", 1.25)], target=0.9)["evidence"]
    assert "not every run" not in held  # (every run reached 0.9)
    (never,) = claims.evaluate(hand_records(), [Faster("dataflow", "gpipe", "max", 1.0)], target=0.9)["evidence"]
    assert never.endswith("speedup -: not every run reached it (0 of 3 dataflow runs)")


def test_claims_the_records_cannot_decide_are_not_evaluated():
    table = claims.evaluate(hand_records(methods=("gpipe", "pipemare")),
                            [Diverges("dataflow", "max"), Beats("pipemare", "gpipe", 16), Matches("pipemare", "gpipe")])
    assert table["verdict"].tolist() == ["not evaluated", "not evaluated", "holds"]
    assert "lack" in table["evidence"][0] and "P in [2, 8]" in table["evidence"][1]
    # the statement where it can be said (the records lack the method), else the claim's repr (they lack the P)
    assert table["claim"][0] == "dataflow diverges at P = 8 (every run)" and table["claim"][1].startswith("Beats(")
    with pytest.raises(ConfigError, match="no finished runs"):
        claims.evaluate(hand_records().iloc[:0])
    markdown = claims.format_table(table)
    assert markdown.splitlines()[0] == "| claim | evidence | verdict |" and markdown.endswith("| holds |")


def test_demo_claims_default_target_is_gpipe_minus_a_point():
    table = claims.evaluate(hand_records(), [Faster("pipemare", "gpipe", "max", 1.0)])
    assert "reaches 0.920" in table["claim"][0]


def test_the_default_claims_are_the_metrics():
    """Records in perplexity are judged by the language-model demo's claims (compare() on a user's LM judged
    them by the classification demo's, whose margins are in accuracy, read as perplexity), regression records
    by the demo's claims without an accuracy margin; accuracy records by the demo's."""
    acc = hand_records()
    ppl = acc.assign(test_ppl=1 / acc["test_acc"], test_acc=math.nan)
    loss = acc.assign(test_loss=1 - acc["test_acc"], test_acc=math.nan)
    for records, want in ((acc, claims.DEMO_CLAIMS), (ppl, claims.LM_DEMO_CLAIMS)):
        table = claims.evaluate(records)
        assert len(table) == len(want)
        assert table["claim"].tolist() == claims.evaluate(records, want)["claim"].tolist()
    table = claims.evaluate(loss)
    kept = claims.default_claims("test_loss")
    assert kept and not any(isinstance(c, (Beats, Matches)) for c in kept) and len(table) == len(kept)
    assert claims.default_claims(claims.metrics.PERPLEXITY) is claims.LM_DEMO_CLAIMS
    # a metric named explicitly picks its claims, whatever the records' task
    assert len(claims.evaluate(ppl.assign(test_loss=1 - acc["test_acc"]), metric="test_loss")) == len(kept)


def test_evidence_shows_the_digits_that_decide_a_verdict():
    """A speedup of 3.93... against a factor between it and 3.935 printed as "3.93x" (or 1.2468 as "1.25x" against
    1.25) next to "does not hold"; the evidence now prints as many digits as tell the two apart."""
    records = hand_records()
    (speed,) = claims.evaluate(records, [Faster("pipemare", "gpipe", "max", 1.0)], target=0.9)["evidence"]
    s = float(speed.split("speedup ")[1].rstrip("x"))
    exact = speedup.speedup_table(records, 0.9).set_index(["method", "stages"]).loc[("pipemare", 8), "speedup"]
    above = round(exact, 2) + 0.001 if round(exact, 2) > exact else exact + 0.0001
    assert f"{above:.2f}" == f"{s:.2f}" or f"{above:.2f}" == f"{exact:.2f}"
    table = claims.evaluate(records, [Faster("pipemare", "gpipe", "max", above),
                                      Beats("gpipe", "pipemare", "max", 0.00667)], target=0.9)
    assert table["verdict"].tolist() == ["does not hold", "does not hold"]
    shown = float(table["evidence"][0].split("speedup ")[1].rstrip("x"))
    assert shown < above and f"{shown}" != f"{above:.2f}"
    assert "+0.006667" in table["evidence"][1]       # gain 0.00666... against a margin of 0.00667
    assert "+0.007" in claims.evaluate(records, [Beats("gpipe", "pipemare", "max", 0.01)])["evidence"][0]


def test_the_demo_times_a_users_sweep_against_gpipes_best_not_the_demos_accuracy(tmp_path):
    """``staleopt demo --sweep MY.toml`` timed every user sweep to accuracy 0.80 (the demo's), also a regression
    sweep's test loss, and saved it as the sweep's target: the demo's 0.80 is for the demo's own sweep files."""
    import argparse
    from staleopt import speedup
    from staleopt.commands import demo
    records = hand_records()
    args = argparse.Namespace(task="classification", sweep=None, quick=False)
    assert demo._default_target(args, records) == claims.DEMO_TARGET
    args.sweep = str(demo.DEFAULT_SWEEP)
    assert demo._default_target(args, records) == claims.DEMO_TARGET
    args.sweep = str(tmp_path / "mine.toml")
    assert demo._default_target(args, records) == speedup.default_target(records) != claims.DEMO_TARGET
    loss = records.drop(columns="test_acc").assign(test_loss=1 - records["test_acc"])
    assert demo._default_target(args, loss) == speedup.default_target(loss, metric="test_loss")
