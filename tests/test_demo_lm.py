"""``staleopt demo --task lm``: the language-model demo end to end on a tiny GPT (tied head: the last stage holds a
replica), its perplexity tables, claims and README block; the committed run's files against its records."""
import json
from pathlib import Path

import pandas as pd
import pytest

from staleopt import claims, speedup, sweep
from staleopt.cli import main
from staleopt.commands.demo import LM_SWEEP, complete, markdown

REPO = Path(__file__).resolve().parents[1]
TINY_LM = """\
name = "tiny-demo-lm"
description = "a tiny GPT on text-markov"
[base]
model = "gpt"
model_kwargs = {d_model = 16, layers = 1, heads = 2}
data = "text-markov"
data_kwargs = {context = 8, train_tokens = 4000, test_tokens = 800}
microbatches = 2
batch_size = 16
optimizer = "adam"
lr = 0.003
epochs = 2
[grid]
method = ["gpipe", "pipedream", "pipemare", "pipemare-w", "dataflow"]
stages = [3]
seed = [0]
"""


def test_lm_demo_ranks_by_perplexity_and_evaluates_its_claims(tmp_path, capsys):
    path = tmp_path / "tiny-lm.toml"
    path.write_text(TINY_LM)
    out = tmp_path / "out"
    assert main(["demo", "--task", "lm", "--sweep", str(path), "--out", str(out), "--workers", "1", "--no-bar"]) == 0
    printed = capsys.readouterr().out
    assert "best test perplexity over epochs" in printed and "time to perplexity" in printed
    summary = pd.read_csv(out / "summary.csv")
    assert "best_ppl" in summary.columns and (summary["best_ppl"] > 1).all()
    verdicts = pd.read_csv(out / "claims.csv")
    assert len(verdicts) == len(claims.LM_DEMO_CLAIMS)
    assert set(verdicts["verdict"]) <= set(claims.VERDICTS) and "holds" in set(verdicts["verdict"])
    info = json.loads((out / "run.json").read_text())
    records = sweep.collect(out)
    assert info["target"] == pytest.approx(speedup.default_target(records))  # GPipe's best perplexity + 1 %
    block = markdown(out)
    assert "Best test perplexity over epochs (lower is better)" in block and "staleopt demo --task lm" in block
    # rebuilt from its records, the report is the same
    assert main(["demo", "--task", "lm", "--sweep", str(path), "--out", str(out), "--from-records"]) == 0
    pd.testing.assert_frame_equal(pd.read_csv(out / "claims.csv"), verdicts)


def test_quick_and_lm_are_two_demos():
    assert main(["demo", "--task", "lm", "--quick"]) == 2


@pytest.mark.skipif(not (REPO / "docs" / "demo-lm" / "records.csv").is_file(), reason="no committed LM demo run")
def test_committed_lm_demo_claims_are_what_its_records_give():
    header = (REPO / "docs" / "demo-lm" / "records.csv").read_text().splitlines()[0].split(",")
    assert len(header) == len(set(header)), "a column twice (pandas would read it as name.1)"
    records = pd.read_csv(REPO / "docs" / "demo-lm" / "records.csv")
    info = json.loads((REPO / "docs" / "demo-lm" / "run.json").read_text())
    assert set(records["run"]) == {c.run_id() for c in sweep.load_sweep(LM_SWEEP).configs}
    table = claims.evaluate(complete(records, LM_SWEEP), claims.LM_DEMO_CLAIMS, target=info["target"])
    pd.testing.assert_frame_equal(table, pd.read_csv(REPO / "docs" / "demo-lm" / "claims.csv"))
    block = markdown(REPO / "docs" / "demo-lm")
    text = (REPO / "docs" / "language-models.md").read_text()
    begin, end = "<!-- demo-lm-claims:begin -->\n", "<!-- demo-lm-claims:end -->"
    assert text[text.index(begin) + len(begin):text.index(end)] == block


@pytest.mark.parametrize("directory", sorted((REPO / "docs" / "demo-lm-other-cpus").iterdir()), ids=lambda d: d.name)
def test_lm_demo_claims_hold_on_every_cpu_it_was_recorded_on(directory):
    """The language-model demo's claims hold on each other CPU it was recorded on, at that run's own target
    (its GPipe runs' best perplexity + 1%), and the committed tables are what its records give."""
    records = complete(pd.read_csv(directory / "records.csv"), LM_SWEEP)
    info = json.loads((directory / "run.json").read_text())
    assert set(records["run"]) == {c.run_id() for c in sweep.load_sweep(LM_SWEEP).configs} and info["cpu"]
    assert info["target"] == pytest.approx(speedup.default_target(records), rel=1e-15)
    table = claims.evaluate(records, claims.LM_DEMO_CLAIMS, target=info["target"])
    assert set(table["verdict"]) == {"holds"}, table[table["verdict"] != "holds"].to_string()
    pd.testing.assert_frame_equal(table, pd.read_csv(directory / "claims.csv"))


def test_from_records_refuses_a_task_that_is_not_the_records_and_a_bad_target_before_training(tmp_path, capsys):
    """``--from-records`` filled the slimmed records' missing columns from the other task's sweep file (the LM
    demo's memory claim measured on resnet1d, PipeMareW's warmup from the cosine rule) and rewrote the report
    silently (with ``--sweep FILE`` it judged a classifier's accuracies by the LM demo's perplexity claims); ``--task
    lm --target 0.85`` trained the whole sweep before refusing the target."""
    import shutil
    root = Path(__file__).resolve().parents[1]
    for k, (src, wrong) in enumerate((("demo-lm", []), ("demo", ["--task", "lm"]),
                                      ("demo", ["--task", "lm", "--sweep", str(root / "experiments" / "demo.toml")]))):
        out = tmp_path / f"{src}-{k}"
        shutil.copytree(root / "docs" / src, out)
        before = (out / "claims.csv").read_text()
        assert main(["demo", "--from-records", "--out", str(out), *wrong]) == 2
        assert "pass --task" in capsys.readouterr().err and (out / "claims.csv").read_text() == before
    assert main(["demo", "--task", "lm", "--target", "0.85", "--out", str(tmp_path / "lm"), "--no-bar"]) == 2
    assert "perplexity" in capsys.readouterr().err and not (tmp_path / "lm" / "runs").exists()
