"""The reproduction ledger: experiment files at both scales, verdict rules on hand-made scores, the page generator
on small synthetic results, and one tiny end-to-end ``staleopt reproduce`` (no long training here)."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from staleopt import cli
from staleopt.config import RunConfig
from staleopt.errors import ConfigError, RunFileError, SweepConfigError
from staleopt.ledger import analytic, report, run as ledger, spec, verdict
from staleopt.ledger.verdict import NOT, NOT_RUN, PARTLY, REPRODUCED



# ------------------------------------------------------------------ the repository's experiment files

@pytest.mark.parametrize("scale", spec.SCALES)
def test_every_experiment_loads_and_every_check_selects_runs(scale):
    exps = spec.load_all(scale)
    assert {e.name for e in exps} >= {"pipemare-ablation", "pipemare-warmup", "pipemare-hogwild",
                                      "pipedream-stashing", "pipedream-2bw", "pipeoptim", "stale-weights"}
    for e in exps:
        assert e.checks and e.configs
        for c in e.checks:
            runs = e.configs_for(c)
            assert runs and set(r.run_id() for r in runs) <= set(e.recipe_of)
            for sel in c.selectors.values():
                assert spec.selects([e.row(r) for r in runs], sel)
            assert len({r.seed for r in runs}) >= 3     # >= 3 seeds everywhere
    models = {(c.model, c.data) for e in exps for c in e.configs}
    expected = {("resnet20", "cifar10"), ("gpt", "text-wikitext103")} if scale == "paper" else \
        {("resnet1d", "mnist1d"), ("transformer", "mnist1d"), ("gpt", "text-markov")}
    assert models == expected


def test_paper_scale_is_the_same_runs_on_cifar10():
    """Same experiments, checks and (method, stages, seed) runs at both scales; only the recipe differs
    (the largest stage counts: the Transformer's 28, ResNet-20's 39, the CPU GPT's 15, the paper GPT's 51)."""
    cpu, paper = spec.load_all("cpu"), spec.load_all("paper")
    largest = {("transformer", 28), ("resnet20", 39), ("gpt", 15), ("gpt", 51)}

    def keys(exps):   # the paper scale trains 3 seeds, the CPU scale 5
        return sorted({(e.name, c.method, "max" if (c.model, c.stages) in largest
                        and e.name in ("pipemare-warmup", "lm-pipemare") else c.stages, c.optimizer)
                       for e in exps for c in e.configs})
    assert keys(cpu) == keys(paper)
    assert [c.id for e in cpu for c in e.checks] == [c.id for e in paper for c in e.checks]
    assert all(c.device == "cuda" for e in paper for c in e.configs)


def test_recipes_follow_the_papers():
    """PipeMare's recipe: SGD momentum 0.9 and the image-classification T2 decay 0.5 (Tables 8-9)."""
    for scale in spec.SCALES:
        r = spec.load_recipes(spec.LEDGER_DIR / "recipes.toml", scale)
        assert r["pipemare"].base["optimizer"] == "sgd-momentum" and r["pipemare"].base["momentum"] == 0.9
        assert r["pipemare"].base["decay"] == 0.5 and r["pipemare-adam"].base["decay"] == 0.1
        assert len(r["pipemare"].seeds) >= 3


def test_cli_lists_and_dry_runs_the_paper_scale(tmp_path, capsys):
    assert cli.main(["reproduce", "--list"]) == 0
    assert "t2-at-max-p" in capsys.readouterr().out
    assert cli.main(["reproduce", "--scale", "paper", "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "resnet20/cifar10" in out and "pending" in out and "mnist1d" not in out
    assert cli.main(["reproduce", "--claim", "t2-at-max-p", "--out", str(tmp_path), "--dry-run"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if "pending" in l]
    assert len(lines) == 10 and all("pipemare" in l and "P=39" in l for l in lines)
    shards = []  # --shard K/N --dry-run listed every run, not the shard's (sweep --dry-run --shard lists its own)
    for k in (1, 2):
        argv = ["reproduce", "--claim", "t2-at-max-p", "--out", str(tmp_path), "--dry-run", "--shard", f"{k}/2"]
        assert cli.main(argv) == 0
        shards.append({l.split()[0] for l in capsys.readouterr().out.splitlines() if "pending" in l})
    assert len(shards[0]) == len(shards[1]) == 5 and shards[0] | shards[1] == {l.split()[0] for l in lines}


def test_list_shows_the_selected_claims_and_tier_and_modes_exclude_each_other(tmp_path, capsys):
    """--list listed every experiment with the quick tier's run count whatever --claim and --tier said, --list
    --dry-run did only --list, and --dry-run --report-only estimated training for runs it would never train."""
    exps = spec.load_all("cpu")
    assert cli.main(["reproduce", "--list", "--tier", "ladder"]) == 0
    ladder = len(ledger.plan([(e, None) for e in exps], "ladder")[0])
    assert ladder > len(ledger.plan([(e, None) for e in exps], "quick")[0])
    assert capsys.readouterr().out.splitlines()[-1] == f"{ladder} distinct runs at scale cpu, tier ladder"
    assert cli.main(["reproduce", "--list", "--claim", "t1-recovers", "--tier", "ladder"]) == 0
    lines = capsys.readouterr().out.splitlines()
    e, check = spec.find(exps, "t1-recovers")
    runs = len(e.configs_for(check, "ladder"))
    assert lines[0].startswith(f"{e.name}: ") and lines[0].endswith(f", {runs} runs")
    assert lines[1].split()[:4] == ["t1-recovers", check.rule, str(runs), "runs"]
    assert lines[2] == f"{runs} distinct runs at scale cpu, tier ladder" and len(lines) == 3
    assert cli.main(["reproduce", "--list", "--claim", "t1-recovers"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{len(e.configs_for(check, 'quick'))} distinct runs at " \
                                                        "scale cpu, tier quick"
    for modes in (["--list", "--dry-run"], ["--dry-run", "--report-only"], ["--list", "--report-only"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["reproduce", *modes, "--out", str(tmp_path / "r")])
        assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_missing_dataset_is_refused_before_any_run_and_download_fetches_it(tmp_path, capsys, monkeypatch):
    """``--scale paper`` without CIFAR-10 named ``--download``, which reproduce lacked, and launched every run to
    fail: the data is checked first, and ``--download`` is the flag the message names."""
    monkeypatch.setenv("STALEOPT_DATA", str(tmp_path / "data"))
    argv = ["reproduce", "--scale", "paper", "--claim", "t2-at-max-p", "--out", str(tmp_path / "r"), "--no-bar"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "cifar10 not found" in err and "--download" in err
    assert not (tmp_path / "r" / "runs").exists()       # no run was launched
    calls = []

    def load(name, download=False, **kwargs):
        calls.append((name, download))
        raise SweepConfigError("stop here")
    monkeypatch.setattr("staleopt.data.load", load)
    assert cli.main(argv + ["--download"]) == 2 and calls == [("cifar10", True)]


def test_module_entry_point_runs_one_claim():
    """``python -m staleopt.ledger run NAME`` is ``staleopt reproduce --claim NAME``."""
    from staleopt.ledger.__main__ import reproduce_argv
    assert reproduce_argv(["run", "2bw-matches-sync", "--dry-run"]) == ["reproduce", "--claim", "2bw-matches-sync",
                                                                        "--dry-run"]
    assert reproduce_argv(["all", "--workers", "1"]) == reproduce_argv(["--workers", "1"]) == ["reproduce", "--workers",
                                                                                                "1"]
    assert reproduce_argv(["run"]) == ["reproduce"]


def test_unknown_names_and_bad_files_raise_typed_errors(tmp_path):
    exps = spec.load_all("cpu")
    with pytest.raises(ConfigError, match="no experiment or check named 'nope'"):
        spec.find(exps, "nope")
    with pytest.raises(ConfigError, match="scale"):
        spec.load_recipes(spec.LEDGER_DIR / "recipes.toml", "gpu")
    (tmp_path / "recipes.toml").write_text(_RECIPES)
    bad = {"rule = \"better\"": "rule = \"bigger\"", "method = \"gpipe\"}": "method = \"pipemare\"}"}
    for old, new in bad.items():
        (tmp_path / "x.toml").write_text(_EXPERIMENT.replace(old, new))
        with pytest.raises(SweepConfigError, match="bigger|selects none"):
            spec.load_experiment(tmp_path / "x.toml")
    (tmp_path / "recipes.toml").write_text(_RECIPES + "\n[tiny.gpu]\nseeds = [0]\n")
    with pytest.raises(SweepConfigError, match=r"\[tiny.gpu\], which no scale reads"):
        spec.load_recipes(tmp_path / "recipes.toml", "cpu")
    (tmp_path / "recipes.toml").write_text(_RECIPES.replace("[tiny.paper]", "[tiny.other]"))
    with pytest.raises(SweepConfigError, match=r"\[tiny.paper\]"):
        spec.load_recipes(tmp_path / "recipes.toml", "cpu")
    # a plain key above the scales' tables was called "the table [tiny.epochs]"; tiny.cpu = 3 a TypeError
    for text, says in (("[tiny]\nepochs = 3\n" + _RECIPES, r"recipe \[tiny\] sets epochs outside its scales' tables"),
                       (_RECIPES.replace("[tiny.cpu]", "[tiny]\ncpu = 3\n[x.cpu]"),
                        "missing \\(or not a table\\): cpu"),
                       ("tiny = 3\n", r"needs the tables \[tiny.cpu\], \[tiny.paper\], not tiny = 3")):
        (tmp_path / "recipes.toml").write_text(text)
        with pytest.raises(SweepConfigError, match=says):
            spec.load_recipes(tmp_path / "recipes.toml", "cpu")
    # two experiments' runs share one folder: one run written two ways across them is refused too
    (tmp_path / "recipes.toml").write_text(_RECIPES)
    (tmp_path / "x.toml").write_text(_EXPERIMENT + '[[runs]]\nrecipe = "tiny"\nmethod = ["gpipe"]\nstages = [1]\n'
                                     'model_kwargs = {hidden = 128}\n')
    with pytest.raises(SweepConfigError, match=r"x.toml: runs .* are one run written two ways"):
        spec.load_experiment(tmp_path / "x.toml")
    assert cli.main(["reproduce", "--workers", "0", "--list"]) == 2     # a ConfigError, reported by the CLI
    with pytest.raises(SweepConfigError, match="ledger folder .* is a file"):  # (was: "FILE/recipes.toml does not
        spec.load_all("cpu", tmp_path / "recipes.toml")                     # exist")


def test_reproduce_doc_a_folder_is_refused_before_any_run_trains(tmp_path, capsys):
    """--doc DIR trained every run, then died with an IsADirectoryError traceback writing the page."""
    out = tmp_path / "out"
    for doc, why in ((tmp_path, "is a folder"), (tmp_path / "f.txt" / "page.md", "is a file, not a folder")):
        (tmp_path / "f.txt").write_text("")
        assert cli.main(["reproduce", "--claim", "t2-at-max-p", "--out", str(out), "--doc", str(doc)]) == 2
        assert why in capsys.readouterr().err and not out.exists()
        assert cli.main(["reproduce", "--claim", "t2-at-max-p", "--out", str(out), "--doc", str(doc), "--dry-run"]) == 2
        assert why in capsys.readouterr().err
    for flag in ("--list", "--dry-run"):  # (they write nothing: --doc's folder was made)
        assert cli.main(["reproduce", flag, "--out", str(out), "--doc", str(tmp_path / "new" / "page.md")]) == 0
        assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------ verdict rules on hand-made scores

def _runs(method, values, stages=4, recipe="r", diverged=()):
    return [{"recipe": recipe, "method": method, "stages": stages, "seed": s, "score": v, "diverged": s in diverged}
            for s, v in enumerate(values)]


def _check(rule, **sel):
    return spec.Check("c", "a claim", "Paper §1", "1.0", rule, {k: {"recipe": "r", **v} for k, v in sel.items()})


@pytest.mark.parametrize("a, b, expected", [
    ([0.90, 0.91, 0.92], [0.80, 0.82, 0.81], REPRODUCED),     # every seed ahead by ~0.1
    ([0.90, 0.80, 0.92], [0.85, 0.82, 0.81], PARTLY),         # ahead on average, one seed behind
    ([0.80, 0.81, 0.82], [0.90, 0.91, 0.92], NOT),
])
def test_better(a, b, expected):
    row = verdict.evaluate(_check("better", a={"method": "x"}, b={"method": "y"}), _runs("x", a) + _runs("y", b),
                           "e", "setting")
    assert row.verdict == expected
    assert ("difference +" in row.ours) == (sum(a) > sum(b))
    assert (row.reason == "") == (expected == REPRODUCED)


def test_not_worse_and_matches_use_the_margin():
    close = _runs("x", [0.901, 0.899, 0.902]) + _runs("y", [0.900, 0.900, 0.900])
    above = _runs("x", [0.95, 0.96, 0.95]) + _runs("y", [0.90, 0.90, 0.90])
    behind = _runs("x", [0.85, 0.86, 0.85]) + _runs("y", [0.90, 0.90, 0.90])
    ab = {"a": {"method": "x"}, "b": {"method": "y"}}
    assert verdict.evaluate(_check("not-worse", **ab), close, "e", "").verdict == REPRODUCED
    assert verdict.evaluate(_check("not-worse", **ab), above, "e", "").verdict == REPRODUCED
    assert verdict.evaluate(_check("not-worse", **ab), behind, "e", "").verdict == NOT
    assert verdict.evaluate(_check("matches", **ab), close, "e", "").verdict == REPRODUCED
    row = verdict.evaluate(_check("matches", **ab), above, "e", "")
    assert row.verdict == NOT and "+0.053" in row.reason
    noisy = _runs("x", [0.91, 0.89, 0.905]) + _runs("y", [0.90, 0.90, 0.90])   # mean +0.002, wide interval
    assert verdict.evaluate(_check("matches", **ab), noisy, "e", "").verdict == PARTLY


def test_a_reason_past_the_margin_reads_past_it():
    """A difference just past the margin is printed with the digits that show it (0.0104, not 0.010 against the
    margin 0.01), in both rules' reasons; the page names the checks whose file sets another margin."""
    ab = {"a": {"method": "x"}, "b": {"method": "y"}}
    behind = _runs("x", [0.8896, 0.8896, 0.8896]) + _runs("y", [0.90, 0.90, 0.90])  # behind by 0.0104
    row = verdict.evaluate(_check("not-worse", **ab), behind, "e", "")
    assert row.verdict == NOT and "behind by 0.0104, more than the margin 0.01" in row.reason
    row = verdict.evaluate(_check("matches", **ab), behind, "e", "")
    assert row.verdict == NOT and "differs by -0.0104, more than the margin ±0.01" in row.reason
    wide = spec.Check("lm-c", "a claim", "Paper §1", "1.0", "matches", {k: {"recipe": "r", **v} for k, v in ab.items()},
                      margin=0.05)
    page = report.markdown([row], {}, {}, checks={("e", "c"): _check("matches", **ab), ("e", "lm-c"): wide})
    assert "Margins other than 0.01, in the units of the check's metric" in page and "`lm-c` 0.05" in page
    assert "Margins other than" not in report.markdown([row], {}, {}, checks={("e", "c"): _check("matches", **ab)})
    # the margin as the file writes it (0.005 read "0.01", 0.004 "±0.00", 0.125 "-0.12": each against its verdict)
    for rule, m, a, says in (
            ("not-worse", 0.005, [0.894, 0.8935, 0.8945], "behind by 0.006, more than the margin 0.005"),
            ("matches", 0.004, [0.905, 0.9052, 0.9049], "differs by +0.005, more than the margin ±0.004"),
            ("not-worse", 0.125, [0.78, 0.77, 0.79], "mean difference -0.120 is above -0.125, but the 95% interval "
                                                     "reaches below -0.125"),
            ("matches", 0.005, [0.9051, 0.9049, 0.9041], "mean difference +0.0047 is within ±0.005")):
        c = spec.Check("c", "claim", "s", "n", rule, {k: {"recipe": "r", **v} for k, v in ab.items()}, margin=m)
        row = verdict.evaluate(c, _runs("x", a) + _runs("y", [0.9, 0.9, 0.9]), "e", "")
        assert says in row.reason, row.reason


def test_gap_grows_pairs_seeds_across_stage_counts():
    runs = (_runs("pm", [0.90, 0.91, 0.90], stages=4) + _runs("t1", [0.90, 0.90, 0.90], stages=4)
            + _runs("pm", [0.85, 0.86, 0.85], stages=39) + _runs("t1", [0.70, 0.72, 0.71], stages=39))
    row = verdict.evaluate(_check("gap-grows", a={"method": "pm"}, b={"method": "t1"}), runs, "e", "")
    assert row.verdict == REPRODUCED and "P=4->39" in row.ours
    shrinking = [dict(r, score=1.0 - r["score"]) for r in runs]
    assert verdict.evaluate(_check("gap-grows", a={"method": "pm"}, b={"method": "t1"}), shrinking, "e", "").verdict == NOT


def test_degrades_needs_a_growing_drop_and_counts_diverged_runs():
    ref = _runs("gpipe", [0.95, 0.96, 0.95], stages=1)
    runs = ref + _runs("df", [0.94, 0.95, 0.94], stages=4) + _runs("df", [0.10, 0.10, 0.40], stages=39, diverged=(0, 1))
    check = _check("degrades", a={"method": "df"}, reference={"method": "gpipe"})
    row = verdict.evaluate(check, runs, "e", "")
    assert row.verdict == REPRODUCED and "2 diverged" in row.ours
    one_survivor = ref + _runs("df", [0.94, 0.95, 0.94], stages=4) + _runs("df", [0.1, 0.1, 0.9], stages=39,
                                                                          diverged=(0, 1))
    row = verdict.evaluate(check, one_survivor, "e", "")
    assert row.verdict == PARTLY and "2 of 3 runs diverged there" in row.reason
    flat = ref + _runs("df", [0.94, 0.95, 0.94], stages=4) + _runs("df", [0.945, 0.95, 0.94], stages=39)
    row = verdict.evaluate(check, flat, "e", "")
    assert row.verdict == NOT and "no worse at P=39" in row.reason


def test_a_rows_estimate_is_the_mean_of_the_gaps_its_figure_draws():
    """The table's gap column (estimate ± half_width), the trend and the figure read one per-seed quantity: for a
    degrades check the drop from the reference at the largest P (the table showed the drop from the smallest
    P while the figure and the trend drew the drop from the reference: docs/reproductions.md's pb-drop-grows
    read +0.071 beside a trend of +0.214)."""
    from staleopt.stats import t_interval
    ref = _runs("gpipe", [0.95, 0.96, 0.95], stages=1)
    runs = (ref + _runs("df", [0.90, 0.85, 0.94], stages=4) + _runs("df", [0.60, 0.70, 0.40], stages=39)
            + _runs("sync2", [0.96, 0.95, 0.97], stages=4) + _runs("sync2", [0.90, 0.96, 0.94], stages=39))
    checks = [_check("degrades", a={"method": "df"}, reference={"method": "gpipe"}),
              _check("better", a={"method": "gpipe"}, b={"method": "df", "stages": 39}),
              _check("gap-grows", a={"method": "sync2"}, b={"method": "df"})]
    for check in checks:
        row = verdict.evaluate(check, runs, "e", "")
        mean, half, _ = t_interval([g for _, g in row.gaps])
        assert (row.estimate, row.half_width) == (mean, half), check.rule
    row = verdict.evaluate(checks[0], runs, "e", "")
    assert row.estimate == pytest.approx((0.35 + 0.26 + 0.55) / 3)  # gpipe minus df at P = 39, per seed


def test_missing_runs_read_not_yet_run():
    row = verdict.evaluate(_check("better", a={"method": "x"}, b={"method": "y"}), _runs("x", [0.9, 0.9, 0.9]), "e", "")
    assert row.verdict == NOT_RUN and row.ours == "-"
    one_p = _runs("pm", [0.9] * 3) + _runs("t1", [0.8] * 3)
    assert verdict.evaluate(_check("gap-grows", a={"method": "pm"}, b={"method": "t1"}), one_p, "e", "").verdict == NOT_RUN


def test_stages_max_selects_the_largest_stage_count():
    rows = _runs("pm", [0.9] * 3, stages=4) + _runs("pm", [0.8] * 3, stages=39) + _runs("pm", [0.8] * 3, stages=39,
                                                                                           recipe="other")
    got = spec.selects(rows, {"recipe": "r", "method": "pm", "stages": "max"})
    assert len(got) == 3 and {r["stages"] for r in got} == {39} and {r["recipe"] for r in got} == {"r"}


def test_largest_p_means_the_largest_planned_not_the_largest_finished():
    exp = spec.load_all("cpu")[0]
    check = exp.check("t2-at-max-p")
    assert exp.resolved(check).selectors["a"]["stages"] == 39
    early = [dict(r, score=0.9, diverged=False) for r in (exp.row(c) for c in exp.configs) if r["stages"] == 4]
    assert verdict.evaluate(exp.resolved(check), early, exp.name, "").verdict == NOT_RUN


# ------------------------------------------------------------------ the page, from small synthetic results

_RECIPES = """
[tiny.cpu]
description = "synthetic data, MLP, 2 epochs"
seeds = [0, 1, 2]
model = "mlp"
data = "synthetic"
data_kwargs = {num_samples = 256}
optimizer = "sgd-momentum"
lr = 0.05
epochs = 2
batch_size = 32
[tiny.paper]
description = "CIFAR-10"
seeds = [0, 1, 2]
model = "resnet20"
data = "cifar10"
epochs = 200
"""

_EXPERIMENT = """
title = "Tiny"
paper = "A paper"
[[runs]]
recipe = "tiny"
method = ["gpipe"]
stages = [1]
[[runs]]
recipe = "tiny"
method = ["pipedream"]
stages = [3]
[[check]]
id = "tiny-better"
claim = "stashing beats synchronous training"
source = "A paper §1"
paper_number = "+1 point"
rule = "better"
a = {recipe = "tiny", method = "pipedream"}
b = {recipe = "tiny", method = "gpipe"}
"""


def _fake_run(out, config: RunConfig, accs, status="ok", seconds=30.0, finished="2026-11-23T15:00:00+0000"):
    run_dir = Path(out) / "runs" / config.run_id()
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    pd.DataFrame({"epoch": range(1, len(accs) + 1), "step": range(1, len(accs) + 1), "train_loss": 0.5,
                  "test_acc": accs, "status": status}).to_csv(run_dir / "records.csv", index=False)
    (run_dir / "done").write_text(json.dumps({"status": status, "seconds": seconds, "finished": finished}))


def test_page_from_synthetic_results(tmp_path):
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "recipes.toml").write_text(_RECIPES)
    (tmp_path / "ledger" / "tiny.toml").write_text(_EXPERIMENT)
    (tmp_path / "ledger" / "other.toml").write_text(_EXPERIMENT.replace("tiny-better", "tiny-unrun")
                                                    .replace('stages = [3]', 'stages = [2]'))
    exps = spec.load_all("cpu", tmp_path / "ledger")
    tiny = next(e for e in exps if e.name == "tiny")
    out = tmp_path / "out"
    for c in tiny.configs:   # final accuracy: pipedream 0.9 + seed/100, gpipe 0.8 (the last epoch counts)
        if c.method == "pipedream":  # (30 s each, by launch l1; gpipe's 90 s each an hour later, by killed l2)
            _fake_run(out, c, [0.95, 0.9 + c.seed / 100])
        else:
            _fake_run(out, c, [0.5, 0.8], seconds=90.0, finished="2026-11-23T16:00:00+0000")
    t0 = 1795445940.0  # 2026-11-23 14:59:00 UTC
    ledger.record_launch(out, "l1", t0, "staleopt reproduce --out out")
    ledger.record_launch(out, "l1", t0, "staleopt reproduce --out out", t0 + 90, trained=3, cpu=180.0)
    ledger.record_launch(out, "l2", t0 + 100, "staleopt reproduce --out out")       # killed: no end
    extra = [verdict.Row("analytic", "a1", "an analytic claim", "P §2", "7%", "analytic", "7.0%", REPRODUCED)]
    rows = ledger.write_page(tmp_path / "page.md", exps, out, extra)
    page = (tmp_path / "page.md").read_text()
    by_id = {r.id: r for r in rows}
    assert by_id["tiny-better"].verdict == REPRODUCED
    assert "pipedream P=3: 0.910 ± 0.025 (3 runs)" in by_id["tiny-better"].ours
    assert "difference +0.110 [+0.085, +0.135]" in by_id["tiny-better"].ours
    assert by_id["tiny-unrun"].verdict == NOT_RUN
    assert "2026-11-23 14:59:00 UTC to 2026-11-23 15:00:30 UTC" in page and "1.5 min" in page
    assert "`staleopt reproduce --out out`" in page and "6 of 9 finished (3 trained" in page
    assert "3.0 CPU-min (user + system, all workers) for the 3 runs" in page
    # 180 CPU-s over the 90 run-s of l1's runs, for all 6 runs' 360 run-s (by run count: 6 CPU-min, half of it)
    assert "whose runs' wall times add up to 1.5 run-min; at that rate the 6 finished runs took about 12 CPU-min, " \
           "i.e. about 6 min on 2 otherwise idle cores" in page
    assert "started 2026-11-23 15:00:40 UTC" in page and "no end recorded" in page
    assert "first run started 2026-11-23 14:59:30 UTC, last finished 2026-11-23 16:00:00 UTC" in page
    assert "add up to 6.0 run-min" in page
    assert "Verdicts: 2 reproduced, 0 partly, 0 not reproduced, 1 not yet run." in page
    assert page.index("## Tiny (A paper)") < page.index("## Analytic rows")
    assert "| an analytic claim (`a1`) |" in page


def test_another_machines_verdicts_are_compared_from_its_table_not_typed_in(tmp_path):
    """The page's "another machine" paragraph was typed in, and went stale when the page was rebuilt on another
    CPU: it is computed from that machine's table (PAGE-another-cpu.csv and .json beside the page)."""
    def row(check, horizon, v):
        return verdict.Row("e", check, "claim", "s", "n", "set", "ours", v, horizon=horizon)
    here = [row("a", 1, REPRODUCED), row("a", 2, REPRODUCED), row("b", 1, PARTLY), row("b", 2, NOT),
            row("c", 1, NOT_RUN), verdict.Row("analytic", "u", "claim", "s", "n", "set", "ours", REPRODUCED)]
    theirs = [{"experiment": e, "id": i, "horizon": str(h), "verdict": v} for e, i, h, v in
              (("e", "a", 1, PARTLY), ("e", "a", 2, REPRODUCED), ("e", "b", 1, PARTLY), ("e", "b", 2, NOT),
               ("e", "c", 1, NOT), ("analytic", "u", 1, REPRODUCED))]
    text = report.another_machine(here, theirs, {"date": "D", "machine": "M", "commit": "C"}, "x.csv")
    # (the analytic rows train nothing, so cannot differ between CPUs: they were counted as checks that kept theirs)
    assert "At 1x, 1 of the 2 trained checks both evaluate kept their verdict; 1 moved (`a` partly there, " \
           "reproduced here)" in text and "At each check's longest horizon, 2 of the 2 trained checks both " \
           "evaluate kept" in text
    page = tmp_path / "page.md"
    assert ledger._another_machine(page, here) == ""  # (no table beside the page: no paragraph)
    pd.DataFrame(theirs).to_csv(tmp_path / "page-another-cpu.csv", index=False)
    (tmp_path / "page-another-cpu.json").write_text('{"date": "D", "machine": "M", "commit": "C"}')
    assert ledger._another_machine(page, here) == text.replace("x.csv", "page-another-cpu.csv")
    (tmp_path / "page-another-cpu.json").write_text('{"date": "D"}')
    with pytest.raises(RunFileError, match="date, machine and commit"):
        ledger._another_machine(page, here)


def test_table_escapes_pipes():
    row = verdict.Row("e", "x", "a | b", "s", "n", "set", "ours", NOT, "why | not")
    assert "a \\| b" in report.table([row]) and "**not reproduced**: why \\| not" in report.table([row])


def test_reproduce_end_to_end_is_resumable(tmp_path, monkeypatch, capsys):
    """Two tiny runs trained by the command, the page written; a second launch trains nothing."""
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "recipes.toml").write_text(_RECIPES.replace("seeds = [0, 1, 2]\nmodel = \"mlp\"",
                                                                       "seeds = [0]\nmodel = \"mlp\""))
    (tmp_path / "ledger" / "tiny.toml").write_text(_EXPERIMENT)
    monkeypatch.setattr("staleopt.ledger.analytic.analytic_rows", lambda: [])
    args = ["reproduce", "--ledger-dir", str(tmp_path / "ledger"), "--out", str(tmp_path / "out"),
            "--doc", str(tmp_path / "page.md"), "--workers", "1", "--no-bar"]
    assert cli.main(args) == 0
    assert "2 trained now" in capsys.readouterr().out
    page = (tmp_path / "page.md").read_text()
    assert "tiny-better" in page and "(1 runs)" in page and "1 paired seed, no interval" in page
    assert cli.main(args) == 0
    assert "2 already done, 0 trained now" in capsys.readouterr().out
    assert [e["trained"] for e in ledger.launches(tmp_path / "out")] == [2, 0]


# ------------------------------------------------------------------ analytic rows

def test_utilization_and_lemma1_rows_are_reproduced():
    rows = analytic._utilization() + analytic._lemma1()
    assert {r.id: r.verdict for r in rows} == {"gpipe-utilization": REPRODUCED, "pipemare-utilization": REPRODUCED,
                                              "lemma1-boundary": REPRODUCED}
    assert "7.0%" in rows[0].ours and "13.1%" in rows[0].ours and "17.1%" in rows[0].ours
    assert not math.isnan(float(rows[1].ours.split("%")[0]))


# ------------------------------------------------------------------ horizons: run length as an axis of the ledger

def test_at_horizon_scales_every_duration_and_nothing_else():
    c = RunConfig(method="pipemare", stages=4, epochs=3, lr=0.05, lr_schedule="step", lr_milestones=[1, 2],
                  anneal_steps=10, warmup_steps=None, max_steps=50)
    long_ = spec.at_horizon(c, 4)
    assert (long_.epochs, long_.lr_milestones, long_.anneal_steps, long_.max_steps) == (12, [4, 8], 40, 200)
    assert long_.replace(epochs=3, lr_milestones=[1, 2], anneal_steps=10, max_steps=50) == c   # nothing else moved
    assert spec.at_horizon(c, 1) is c
    w = RunConfig(lr_schedule="linear-warmup", lr_warmup_steps=5, epochs=2)
    assert spec.at_horizon(w, 3).lr_warmup_steps == 15
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="horizon"):
            spec.at_horizon(c, bad)


def test_unset_correction_lengths_follow_the_run_length():
    """T1's K, PipeMareW's W and the hybrid's switch are fractions of the run when the recipe leaves them unset."""
    from staleopt.train import method_args
    for method, key in (("pipemare", "anneal_steps"), ("pipemare-w", "warmup_steps"), ("pb-hybrid", "pipelined_steps")):
        c = RunConfig(method=method, stages=4, epochs=2)
        assert method_args(spec.at_horizon(c, 8), 640)[key] == 8 * method_args(c, 640)[key]


_LADDER = _EXPERIMENT.replace('paper = "A paper"', 'paper = "A paper"\nhorizons = [1, 2]\n'
                              'paper_horizon = {delay = 2, steps = 20000, source = "A paper, Table 1"}')


def _ladder_dir(tmp_path, text=_LADDER):
    (tmp_path / "ledger").mkdir(exist_ok=True)
    (tmp_path / "ledger" / "recipes.toml").write_text(_RECIPES)
    (tmp_path / "ledger" / "tiny.toml").write_text(text)
    return tmp_path / "ledger"


def test_horizons_expand_the_runs_and_the_tiers_select_them(tmp_path):
    exp = spec.load_experiment(_ladder_dir(tmp_path) / "tiny.toml")
    check = exp.check("tiny-better")
    assert check.horizons == (1, 2) and check.paper_horizon.ratio == 2 / 20000
    quick, ladder = exp.configs_for(check, "quick"), exp.configs_for(check, "ladder")
    assert len(quick) == 6 and len(ladder) == 12
    assert {c.epochs for c in quick} == {2} and {c.epochs for c in ladder} == {2, 4}
    assert all(exp.horizon_of[c.run_id()] == c.epochs // 2 for c in ladder)
    configs, _ = ledger.plan([(exp, None)], "ladder")
    assert [c.epochs for c in configs] == [2] * 6 + [4] * 6           # the quick tier first
    with pytest.raises(ConfigError, match="tier"):
        exp.configs_for(check, "full")


@pytest.mark.parametrize("value, match", [("[2, 4]", "must include 1"), ("[1, 1]", "distinct"), ("[1, 0]", "distinct"),
                                          ('"8"', "list"), ("[1, 2.5]", "whole numbers")])
def test_bad_horizons_are_refused(tmp_path, value, match):
    d = _ladder_dir(tmp_path, _LADDER.replace("horizons = [1, 2]", f"horizons = {value}"))
    with pytest.raises(SweepConfigError, match=match):
        spec.load_experiment(d / "tiny.toml")


def test_bad_paper_horizon_and_check_level_override(tmp_path):
    d = _ladder_dir(tmp_path, _LADDER.replace("delay = 2,", "delay = 0,"))
    with pytest.raises(SweepConfigError, match="paper_horizon"):
        spec.load_experiment(d / "tiny.toml")
    d = _ladder_dir(tmp_path, _LADDER.replace('rule = "better"', 'rule = "better"\nhorizons = [1]'))
    exp = spec.load_experiment(d / "tiny.toml")
    assert exp.check("tiny-better").horizons == (1,) and len(exp.configs_for(None, "ladder")) == 6


def test_the_repository_ladder_reaches_8x_for_the_pipemare_rows():
    """Issue: the checks not reproduced at 1x and their references, up to at least 8x for the PipeMare rows."""
    exps = {e.name: e for e in spec.load_all("cpu")}
    for name, ids in {"pipemare-ablation": ["t1-recovers", "pipemare-matches-sync", "t2-at-max-p"],
                      "pipemare-hogwild": ["hogwild-t1-matches-sync"], "pipemare-warmup": ["warmup-matches-sync"]}.items():
        for cid in ids:
            check = exps[name].check(cid)
            assert max(check.horizons) >= 8 and check.paper_horizon is not None, cid
    assert exps["pipemare-ablation"].check("t1-recovers").paper_horizon.ratio == 27 / 156400
    quick, _ = ledger.plan([(e, None) for e in exps.values()], "quick")
    ladder, _ = ledger.plan([(e, None) for e in exps.values()], "ladder")
    assert {e.horizon_of[c.run_id()] for e in exps.values() for c in quick if c.run_id() in e.horizon_of} == {1}
    assert {c.run_id() for c in quick} < {c.run_id() for c in ladder}      # the ladder reuses the quick tier


def _gap_rows(gaps_by_h, rule="not-worse"):
    return [verdict.Row("e", "c", "claim", "s", "n", "set", "ours", REPRODUCED if max(g) > -0.01 else NOT,
                        gaps=tuple(enumerate(g)), horizon=h, ratio=0.01 / h, steps=100 * h)
            for h, g in gaps_by_h.items()]


@pytest.mark.parametrize("gaps, expected", [
    ({1: [-0.30, -0.25, -0.28], 8: [-0.02, -0.01, -0.03]}, verdict.CLOSING),
    ({1: [-0.30, -0.25, -0.28], 8: [-0.29, -0.27, -0.26]}, verdict.PERSISTING),
    ({1: [0.01, 0.02, 0.00], 8: [0.10, 0.12, 0.09]}, verdict.WIDENING),
    ({1: [-0.20, -0.22, -0.21], 8: [0.05, 0.04, 0.06]}, verdict.CLOSING),     # closed and crossed over
    ({1: [-0.02, -0.01, -0.02], 8: [0.05, 0.05, 0.04]}, verdict.WIDENING),    # crossed over to a larger size
    ({1: [-0.02, 0.03, 0.00], 8: [0.01, -0.01, 0.002]}, verdict.ABSENT),      # no gap at either end
])
def test_trend_from_paired_seeds(gaps, expected):
    t = verdict.trend(_gap_rows(gaps))
    assert t.label == expected, t.text
    assert "at 1x" in t.text and "at 8x" in t.text and "3 paired seeds" in t.text


def test_trend_needs_two_horizons_and_horizon_verdict_words():
    assert verdict.trend(_gap_rows({1: [0.1, 0.2]})).label == verdict.NO_TREND
    rows = _gap_rows({1: [-0.3, -0.2], 2: [-0.1, -0.2], 4: [0.0, 0.001], 8: [0.0, 0.002]})
    assert verdict.horizon_verdict(rows) == "reproduced at 8x, 4x; not reproduced at 2x, 1x"
    assert verdict.horizon_verdict(rows[2:]) == "reproduced at every horizon (4x, 8x)"


def test_page_and_figure_at_two_horizons(tmp_path):
    exps = spec.load_all("cpu", _ladder_dir(tmp_path))
    exp = exps[0]
    out = tmp_path / "out"
    for c in exp.configs:    # at 1x pipedream is behind gpipe on every seed, at 2x ahead (by less) on every seed
        h = exp.horizon_of[c.run_id()]
        acc = 0.8 + (0.05 if h == 2 else -0.1) * (c.method == "pipedream") + c.seed / 1000
        pd.DataFrame({"epoch": [1, 2], "step": [10 * h, 20 * h], "train_loss": 0.5, "test_acc": [0.5, acc],
                      "status": "ok", "tau_max": 2 if c.method == "pipedream" else 0, "wall_time": [1.0, 2.0]}) \
            .pipe(lambda df: _fake_records(out, c, df))
    rows = ledger.write_page(tmp_path / "page.md", exps, out, tier="ladder")
    assert [(r.horizon, r.verdict, r.steps) for r in rows] == [(1, NOT, 20), (2, REPRODUCED, 40)]
    assert rows[0].ratio == 2 / 20 and rows[1].ratio == 2 / 40
    page = (tmp_path / "page.md").read_text()
    assert "**reproduced at 2x; not reproduced at 1x**" in page and "trend: closing" in page, page
    assert "**`tiny-better` at each run length.**" in page and "| 2x | 40 | 5% |" in page
    assert "The paper's run: tau_max / steps = 2 / 20,000 = 0.01%" in page
    assert "![Tiny (A paper): each check's gap against tau_max / steps](img/reproductions/tiny.png)" in page
    assert (tmp_path / "img" / "reproductions" / "tiny.png").stat().st_size > 1000
    assert "Verdicts at 1x (the quick tier): 0 reproduced, 0 partly, 1 not reproduced" in page
    quick = ledger.write_page(tmp_path / "quick.md", exps, out, tier="quick")
    assert [r.horizon for r in quick] == [1] and "Verdicts: 0 reproduced" in (tmp_path / "quick.md").read_text()


def _fake_records(out, config, records):
    run_dir = Path(out) / "runs" / config.run_id()
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    records.to_csv(run_dir / "records.csv", index=False)
    (run_dir / "done").write_text(json.dumps({"status": "ok", "seconds": 30.0, "finished": "2026-11-23T15:00:00+0000"}))


def test_cost_is_estimated_from_finished_runs_before_training(tmp_path):
    exp = spec.load_experiment(_ladder_dir(tmp_path) / "tiny.toml")
    configs, _ = ledger.plan([(exp, None)], "ladder")
    out = tmp_path / "out"
    assert "cost unknown" in ledger.estimate(configs, out, 2, calibrate=False)
    for c in configs[:6]:    # the 1x runs: 16 steps (2 epochs of 256 * 0.8 // 32 ... as the data gives) in 1.6 s
        _fake_records(out, c, pd.DataFrame({"epoch": [2], "step": [16], "test_acc": [0.5], "status": "ok",
                                            "wall_time": [1.6]}))
    text = ledger.estimate(configs, out, 2, calibrate=False)
    assert text.startswith("6 of 12 runs to train")
    assert "100.0 ms/step" in text and "from 6 finished runs" in text
    assert ledger.estimate(configs[:6], out, 2) == f"all 6 runs are finished in {out}: nothing to train"


def test_an_interrupted_launch_records_no_cpu_time(tmp_path):
    out = tmp_path / "out"
    ledger.record_launch(out, "a", 0.0, "c", 60.0, trained=4, cpu=120.0)
    ledger.record_launch(out, "b", 70.0, "c", 100.0, trained=2, cpu=None)
    info = ledger.provenance(out, 10, 6)
    assert "2.0 CPU-min (user + system, all workers) for the 4 runs" in info["CPU time"]
    assert "1 interrupted launch(es) that trained 2 runs did not record theirs" in info["CPU time"]


def test_report_only_without_runs_and_a_damaged_launch_log_refuse_before_writing(tmp_path, monkeypatch, capsys):
    """--report-only on a directory with no finished run refuses (a --doc would be overwritten with empty rows);
    a damaged launches.jsonl line is a RunFileError naming the file and line, raised before any figure is drawn."""
    monkeypatch.setattr("staleopt.ledger.analytic.analytic_rows", lambda: [])
    ledger_dir = _ladder_dir(tmp_path)
    page = tmp_path / "docs" / "page.md"
    args = ["reproduce", "--ledger-dir", str(ledger_dir), "--out", str(tmp_path / "missing"), "--tier", "ladder",
            "--report-only", "--doc", str(page)]
    assert cli.main(args) == 2
    assert "--report-only found no finished run" in capsys.readouterr().err
    assert not page.exists()
    exps = spec.load_all("cpu", ledger_dir)
    out = tmp_path / "out"
    for c in exps[0].configs:
        _fake_records(out, c, pd.DataFrame({"epoch": [1], "step": [10], "train_loss": 0.5, "test_acc": [0.8],
                                            "status": "ok", "tau_max": 0, "wall_time": [1.0]}))
    good = '{"started": "2026-11-23 15:00:00 UTC", "ended": null}\n'
    for bad in ('{"started": \n', '{"started": "2026-11-23 15:00:00 UTC", "ended": "yesterday"}\n'):
        (out / "launches.jsonl").write_text(good + bad)  # (a time the page could not read: a ValueError)
        with pytest.raises(RunFileError, match=r"launches.jsonl, line 2"):
            ledger.write_page(page, exps, out, tier="ladder")
    assert not page.exists() and not (page.parent / "img").exists()


def test_a_selector_that_matches_two_runs_of_a_seed_is_refused(tmp_path):
    """b = {method = "gpipe"} over gpipe at P = 1 and 3: the verdict kept one run per seed, whichever sorted last by
    run id (P = 3 for seed 0, P = 1 for the others), while the text averaged all six. Refused at load, naming the
    key; a rule that compares stage counts selects several per seed, one per P; hand-built rows are refused too."""
    two = _EXPERIMENT.replace('method = ["gpipe"]\nstages = [1]', 'method = ["gpipe"]\nstages = [1, 3]')
    with pytest.raises(SweepConfigError, match=r"b = .*gpipe.* matches 2 configurations of seed 0 \(stages = "
                                               r"\['1', '3'\]\).*add the key"):
        spec.load_experiment(_ladder_dir(tmp_path, two) / "tiny.toml")
    spec.load_experiment(_ladder_dir(tmp_path, two.replace('method = "gpipe"}', 'method = "gpipe", stages = 1}'))
                         / "tiny.toml")
    grows = two.replace('rule = "better"', 'rule = "gap-grows"').replace('stages = [3]', 'stages = [1, 3]')
    spec.load_experiment(_ladder_dir(tmp_path, grows) / "tiny.toml")
    rows = _runs("x", [0.9, 0.9]) + _runs("y", [0.8, 0.8]) + _runs("y", [0.7], stages=39)
    with pytest.raises(ConfigError, match="two runs of seed 0 in one compared group"):
        verdict.evaluate(_check("better", a={"method": "x"}, b={"method": "y"}), rows, "e", "")


def test_the_committed_page_and_rows_file_show_todays_trends_and_paper_runs():
    """docs/reproductions.md and its CSV are built from runs that are not always on the machine, so a change of the
    trend rule or of a check's paper_horizon left them stale (the new trend 'reversed' and hogwild's paper marker
    54 read 'persisting' and 27 for two sessions): what they derive from the recorded gaps alone is today's."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    df = pd.read_csv(docs / "reproductions.csv")
    page = (docs / "reproductions.md").read_text()
    experiments = {e.name: e for e in spec.load_all("cpu", spec.LEDGER_DIR)}
    rows = [verdict.Row(r.experiment, r.id, r.claim, "", "", "", "", r.verdict, horizon=int(r.horizon),
                        ratio=float(r.ratio), steps=int(r.steps),
                        gaps=tuple((int(s), float(g)) for s, g in json.loads(r.gaps)))
            for r in df.itertuples() if r.experiment in experiments]
    laddered = [g for g in report.group(rows) if len(g) > 1]
    assert len(laddered) >= 20
    for g in laddered:
        e = experiments[g[0].experiment]
        check = e.resolved(next(c for c in e.checks if c.id == g[0].id))
        assert set(df.loc[df["id"] == check.id, "trend"]) == {verdict.trend(g).label}, check.id
        for line in report.horizon_table(g, check).rstrip("\n").split("\n")[-2:]:  # the trend, the paper's run
            assert line in page, f"{check.id}: regenerate docs/reproductions.md (staleopt reproduce --report-only)"


def test_the_committed_pages_intro_and_other_machine_paragraph_are_todays():
    """The page's intro is the template's, and its paragraph on the other machine's ladder is what the code derives
    from the two committed tables alone (it counted the analytic rows, which train nothing, for two sessions after
    the rule left them out: "37 of 43" where the rule gives 31 of 37): regenerable without the runs."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    page = (docs / "reproductions.md").read_text()
    assert page.startswith(report._INTRO)
    rows = [verdict.Row(r.experiment, r.id, r.claim, "", "", "", "", r.verdict, horizon=int(r.horizon))
            for r in pd.read_csv(docs / "reproductions.csv").itertuples()]
    paragraph = ledger._another_machine(docs / "reproductions.md", rows)
    assert paragraph.startswith("**Another machine") and paragraph in page


# ------------------------------------------------------------------ selectors, planned runs and what a row says

def _tiny(tmp_path, runs, checks, horizons="[1]"):
    """A ledger folder with the tiny recipe and one experiment of ``runs`` and ``checks`` (TOML text)."""
    text = f'title = "Tiny"\npaper = "A paper"\nhorizons = {horizons}\n{runs}\n{checks}'
    return spec.load_all("cpu", _ladder_dir(tmp_path, text))[0]


def _check_toml(rule, **sel):
    lines = [f"{k} = {{recipe = \"tiny\", {v}}}" for k, v in sel.items()]
    return "\n".join(["[[check]]", 'id = "c"', 'claim = "a claim"', 'source = "s"', 'paper_number = "n"',
                      f'rule = "{rule}"', *lines]) + "\n"


def test_a_selector_on_a_length_the_horizons_scale_picks_one_configuration_at_every_horizon(tmp_path):
    """anneal_steps = 20 was matched against the scaled configs: at 2x it picked the anneal-10 runs (10 x 2), the
    planner trained (20, 4 epochs), never (40, 4), and the 2x row compared another configuration."""
    exp = _tiny(tmp_path, '[[runs]]\nrecipe = "tiny"\nmethod = ["gpipe"]\nstages = [1]\n[[runs]]\nrecipe = "tiny"\n'
                'method = ["pipemare"]\nstages = [3]\nanneal_steps = [10, 20]\n',
                _check_toml("better", a='method = "pipemare", anneal_steps = 20', b='method = "gpipe"'), "[1, 2]")
    planned = {(c.anneal_steps, c.epochs) for c in exp.configs_for(exp.checks[0]) if c.method == "pipemare"}
    assert planned == {(20, 2), (40, 4)}
    out = tmp_path / "out"
    for c in exp.configs:   # anneal-20 0.95 at every horizon, anneal-10 0.5, gpipe 0.8
        base = exp.base_of[c.run_id()]
        _fake_run(out, c, [0.4, (0.8 if c.method == "gpipe" else 0.95 if base["anneal_steps"] == 20 else 0.5)
                           + c.seed / 1000])
    rows = ledger.rows([(exp, None)], out, tier="ladder")
    assert [(r.horizon, r.verdict) for r in rows] == [(1, REPRODUCED), (2, REPRODUCED)]
    assert all(r.estimate == pytest.approx(0.15) for r in rows)


def test_a_table_or_list_selector_matches_the_finished_runs_json_cells(tmp_path):
    """collect stores dicts and lists as JSON strings: b = {..., model_kwargs = {hidden = 64}} planned and trained
    its runs, then read "not yet run" for good."""
    exp = _tiny(tmp_path, '[[runs]]\nrecipe = "tiny"\nmethod = ["gpipe"]\nstages = [1]\n'
                'model_kwargs = [{hidden = 64}, {hidden = 128}]\n[[runs]]\nrecipe = "tiny"\nmethod = ["pipedream"]\n'
                'stages = [3]\nmodel_kwargs = {hidden = 64}\n',
                _check_toml("better", a='method = "pipedream"', b='method = "gpipe", model_kwargs = {hidden = 64}'))
    out = tmp_path / "out"
    for c in exp.configs:
        _fake_run(out, c, [0.5, (0.9 if c.method == "pipedream" else 0.8) + c.seed / 1000])
    row = ledger.rows([(exp, None)], out)[0]
    assert row.verdict == REPRODUCED and row.estimate == pytest.approx(0.1)
    cells = [{"recipe": "r", "model_kwargs": '{"hidden":64}', "lr_milestones": "[2,4]"}]   # (hand-built rows too)
    assert spec.selects(cells, {"recipe": "r", "model_kwargs": {"hidden": 64}, "lr_milestones": [2, 4]}) == cells
    assert spec.selects(cells, {"recipe": "r", "lr_milestones": [2]}) == []


def test_degrades_or_gap_grows_at_one_stage_count_is_refused_at_load(tmp_path):
    """A check comparing the smallest P with the largest whose selectors see one P was planned, trained, and read
    "not yet run: needs ... two or more stage counts" for good."""
    runs = ('[[runs]]\nrecipe = "tiny"\nmethod = ["gpipe"]\nstages = [1]\nmicrobatches = 2\n[[runs]]\nrecipe = "tiny"\n'
            'method = ["dataflow"]\nstages = [2, 3]\n[[runs]]\nrecipe = "tiny"\nmethod = ["pipemare"]\n'
            'stages = [1, 3]\n')    # (each at two P, only P = 3 in common)
    for rule, sel, says in (
            ("degrades", dict(a='method = "dataflow", stages = "max"', reference='method = "gpipe"'),
             r"rule 'degrades' compares the smallest P with the largest, but a = .* at P = 3 has fewer than two"),
            ("gap-grows", dict(a='method = "pipemare"', b='method = "dataflow"'),
             r"a = .* at P = 1, 3 and b = .* at P = 2, 3 share fewer than two stage counts")):
        with pytest.raises(SweepConfigError, match=says):
            _tiny(tmp_path, runs, _check_toml(rule, **sel))
    _tiny(tmp_path, runs, _check_toml("degrades", a='method = "dataflow"', reference='method = "gpipe"'))


def test_a_metric_the_runs_do_not_record_is_said_not_read_as_not_yet_run():
    """metric = "test_ppl" on classifiers: every run scored NaN and the row read "not yet run" (with a column of
    another experiment's runs in the folder) or raised a bare KeyError (without)."""
    check = spec.Check("c", "a claim", "s", "n", "better", {"a": {"recipe": "r", "method": "x"},
                                                           "b": {"recipe": "r", "method": "y"}}, metric="test_ppl")
    runs = _runs("x", [0.9] * 3) + _runs("y", [0.8] * 3)
    for rows in (runs, [dict(r, test_acc=r["score"], test_ppl=math.nan) for r in runs]):
        row = verdict.evaluate(check, rows, "e", "")
        assert row.verdict == NOT and "6 finished run(s) compared record no test perplexity ('test_ppl')" in row.reason
    row = verdict.evaluate(check, [dict(r, test_acc=r["score"]) for r in runs], "e", "")
    assert "they record test_acc: name one of those" in row.reason


_STAGES = '''[[runs]]
recipe = "tiny"
method = ["gpipe"]
stages = [1]
microbatches = 2
[[runs]]
recipe = "tiny"
method = ["dataflow", "pipemare", "pipedream"]
stages = [1, 2, 3]
'''


def _stages_run(tmp_path):
    """Checks b (better), d (degrades), g (gap-grows) with P = 3 of dataflow and pipemare and gpipe's seed 2 still
    training."""
    checks = (_check_toml("better", a='method = "gpipe"', b='method = "pipedream", stages = 3').replace('"c"', '"b"')
              + _check_toml("degrades", a='method = "dataflow"', reference='method = "gpipe"').replace('"c"', '"d"')
              + _check_toml("gap-grows", a='method = "pipemare"', b='method = "dataflow"').replace('"c"', '"g"'))
    exp = _tiny(tmp_path, _STAGES, checks)
    out = tmp_path / "out"
    acc = {("dataflow", 1): 0.93, ("dataflow", 2): 0.80, ("pipemare", 1): 0.93, ("pipemare", 2): 0.90,
           ("pipedream", 3): 0.80, ("gpipe", 1): 0.95}
    for c in exp.configs:
        if not (c.stages == 3 and c.method != "pipedream" or c.method == "gpipe" and c.seed == 2):
            _fake_run(out, c, [0.5, acc.get((c.method, c.stages), 0.5) + c.seed / 1000])
    return exp, out


def _finish_p3(exp, out):
    for c in exp.configs:
        if c.stages == 3 and c.method != "pipedream":
            _fake_run(out, c, [0.5, (0.70 if c.method == "dataflow" else 0.88) + c.seed / 1000])


def test_a_verdict_on_fewer_seeds_than_planned_says_so(tmp_path):
    """gpipe's seed 2 still training was dropped from the paired difference without a word: reproduced on 2 of 3
    seeds, beside means over all 3 (degrades alike). The reason says on how many seeds."""
    exp, out = _stages_run(tmp_path)
    rows = {r.id: r for r in ledger.rows([(exp, None)], out)}
    assert rows["b"].verdict == REPRODUCED and len(rows["b"].gaps) == 2
    assert rows["b"].reason == "on 2 of 3 planned seeds (1 run not finished)"
    _finish_p3(exp, out)
    rows = {r.id: r for r in ledger.rows([(exp, None)], out)}
    assert rows["d"].verdict == REPRODUCED and rows["d"].reason == "on 2 of 3 planned seeds (1 run not finished)"
    assert rows["g"].verdict == REPRODUCED and rows["g"].reason == ""     # (no gpipe there: every seed)


def test_degrades_and_gap_grows_wait_for_the_largest_planned_p(tmp_path):
    """degrades and gap-grows took "the largest P" from the finished runs: with P = 3 planned and not finished they
    were judged from P = 1 to P = 2, and read reproduced (P = 3 may not degrade). Not yet run, saying which P is
    missing."""
    exp, out = _stages_run(tmp_path)
    rows = {r.id: r for r in ledger.rows([(exp, None)], out)}
    for cid in "dg":
        assert rows[cid].verdict == NOT_RUN, rows[cid]
        assert rows[cid].reason == "no finished runs yet at P=3 (the largest planned); the rule compares P=1 with P=3"
    _finish_p3(exp, out)
    assert {r.id: r.verdict for r in ledger.rows([(exp, None)], out)} == {"b": REPRODUCED, "d": REPRODUCED,
                                                                          "g": REPRODUCED}


def test_a_run_that_two_configurations_reach_at_two_horizons_is_refused(tmp_path):
    """epochs = [2, 4] with horizons [1, 2]: the 2x run of epochs 2 is the 1x run of epochs 4. The loader kept the
    first and the other row read "not yet run" for good."""
    runs = ('[[runs]]\nrecipe = "tiny"\nmethod = ["gpipe"]\nstages = [1]\n[[runs]]\nrecipe = "tiny"\n'
            'method = ["pipedream"]\nstages = [3]\nepochs = [2, 4]\n')
    with pytest.raises(SweepConfigError, match=r"at horizon 2x is the run of another 1x configuration at 1x"):
        _tiny(tmp_path, runs, _check_toml("better", a='method = "pipedream", epochs = 2', b='method = "gpipe"'),
              "[1, 2]")
    _tiny(tmp_path, runs.replace("epochs = [2, 4]", "epochs = [2, 3]"),
          _check_toml("better", a='method = "pipedream", epochs = 2', b='method = "gpipe"'), "[1, 2]")
