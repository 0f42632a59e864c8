"""The language model ``gpt`` and training it on task "lm" data: tied head, causality, units, steps, records."""
import math

import pandas as pd
import pytest
import torch

from staleopt import data, models, sweep, train
from staleopt.checkpoint import Checkpoint, read_records
from staleopt.config import RunConfig
from staleopt.errors import ConfigError
from staleopt.partition import units_of

from test_checkpoint import interrupted_run, same_records
from test_models import _forward_order, _owner_names

MARKOV = dict(data="text-markov", data_kwargs={"train_tokens": 20000, "test_tokens": 2000, "context": 16})
SMALL = dict(model="gpt", model_kwargs={"d_model": 16, "heads": 2}, optimizer="adam", lr=0.01, batch_size=16,
             epochs=2, **MARKOV)


def tokens(b=3, t=12, v=20, seed=0):
    return torch.randint(v, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie, units", [(True, 6 * 2 + 3), (False, 6 * 2 + 4)])
def test_gpt_maps_tokens_to_logits_with_its_head_tied_by_default(tie, units):
    m = models.get("gpt", seed=0, num_classes=20, input_shape=(12,), tie=tie)
    x = tokens()
    assert m(x).shape == (3, 12, 20)
    assert (m.head.weight is m.tok.weight) == tie and m.head.bias is None
    assert len(units_of(m)) == units == models.num_units("gpt", tie=tie)
    order = [n for n in _forward_order(m, x) if n in _owner_names(m)]  # the tied head owns no unit
    assert order == _owner_names(m), "stage 0 is next to the input"
    assert _owner_names(m)[-1] == ("ln" if tie else "head")
    assert m(x[:, :5]).shape == (3, 5, 20), "shorter windows read the first positions"


def test_gpt_is_causal():
    m = models.get("gpt", seed=0, num_classes=20, input_shape=(12,)).eval()
    x = tokens()
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % 20
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.equal(a[:, :7], b[:, :7]) and not torch.allclose(a[:, 7:], b[:, 7:])


def test_causal_attention_matches_torch():
    m = models.get("gpt", seed=0, num_classes=20, input_shape=(12,), d_model=16, heads=2).double()
    attn, x = m.layers[0].attn, torch.randn(3, 10, 16, dtype=torch.float64)
    q, k, v = attn.qkv(x).view(3, 10, 3, 2, 8).permute(2, 0, 3, 1, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(attn(x), attn.proj(ref.transpose(1, 2).reshape(3, 10, 16)), atol=1e-12)


def test_gpt_init_is_seeded_and_scaled():
    a = models.get("gpt", seed=3, layers=4).state_dict()
    b = models.get("gpt", seed=3, layers=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok.weight"], models.get("gpt", seed=4, layers=4).state_dict()["tok.weight"])
    assert abs(float(a["tok.weight"].std()) - 0.02) < 0.002
    assert abs(float(a["layers.0.fc2.weight"].std()) - 0.02 / math.sqrt(8)) < 0.001
    assert float(a["layers.0.fc1.bias"].abs().max()) == 0 and torch.equal(a["ln.weight"], torch.ones(64))


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_steps_compute_the_forward_bit_for_bit(tie):
    m = models.get("gpt", seed=0, num_classes=20, input_shape=(12,), tie=tie)
    x, out = tokens(), tokens()
    for step in models.steps(m):
        out = step(x) if out is None else step(out)
        x = None
    assert torch.equal(out, m(tokens()))
    assert len(models.steps(m)) == 2 + 6 * 2 + 2


def test_gpt_refuses_bad_sizes_and_inputs():
    with pytest.raises(ConfigError, match="heads \\| d_model"):
        models.get("gpt", d_model=30, heads=4)
    with pytest.raises(ConfigError, match="input_shape \\(features,\\)"):
        models.get("gpt", input_shape=(1, 40))
    with pytest.raises(ConfigError, match="tie must be True or False"):
        models.get("gpt", tie="yes")
    m = models.get("gpt", num_classes=20, input_shape=(12,))
    with pytest.raises(ConfigError, match="int64 token windows"):
        m(torch.randn(2, 12))
    with pytest.raises(ConfigError, match="longer than its context 12"):
        m(tokens(t=13))


def test_lm_data_and_other_models_do_not_pair():
    with pytest.raises(ConfigError, match="'gpt' is a language model and data 'mnist1d' has task 'classification'"):
        RunConfig(model="gpt")
    with pytest.raises(ConfigError, match="language-modelling dataset.*model 'mlp'.*use a language model \\(gpt\\)"):
        RunConfig(model="mlp", **MARKOV)
    with pytest.raises(ConfigError, match="unknown option 'num_classes'"):
        RunConfig(**{**SMALL, "model_kwargs": {"num_classes": 3}})  # the vocabulary comes from the data


def test_a_users_lm_dataset_with_a_classifier_fails_when_loaded():
    def windows():
        return data.load("text-markov", train_tokens=200, test_tokens=100, context=8)
    data.register("lm-test-windows", windows, replace=True)
    try:
        config = RunConfig(model="mlp", data="lm-test-windows", batch_size=8)
        with pytest.raises(ConfigError, match="dataset 'lm-test-windows' is a language-modelling dataset"):
            train.run(config)
    finally:
        data._USER.pop("lm-test-windows")


def test_training_records_the_loss_per_token_its_perplexity_and_the_best_loss():
    config = RunConfig(**SMALL)
    records = train.run(config)
    d = data.load("text-markov", **MARKOV["data_kwargs"])
    assert list(records.columns) == list(train.RECORD_COLUMNS) and (records["status"] == "ok").all()
    assert (records["best_loss"] == d.best_loss).all()
    assert (records["test_ppl"] == records["test_loss"].map(math.exp)).all()
    assert records["test_acc"].between(0, 1).all()
    assert records["test_loss"].iloc[-1] < d.info["unigram_loss"] - 0.2, "a small gpt learns the chain"
    model = models.get("gpt", seed=0, num_classes=16, input_shape=(16,), d_model=16, heads=2)
    first = train._evaluate(model, d, torch.device("cpu"), "gpt")
    assert abs(first["test_loss"] - math.log(16)) < 0.05, "an untrained model predicts about uniformly"
    pd.testing.assert_frame_equal(records.drop(columns="wall_time"), train.run(config).drop(columns="wall_time"))


def test_a_classifier_records_no_perplexity_and_no_best_loss():
    records = train.run(RunConfig(model="mlp", data="synthetic", data_kwargs={"num_samples": 100}, epochs=1,
                                  batch_size=20))
    assert records["test_ppl"].isna().all() and records["best_loss"].isna().all()


@pytest.mark.parametrize("tie", [False, True])
def test_gpt_trains_in_a_pipeline_and_with_recompute(tie):
    """The tied head reads its replica in the last stage, so checkpoint_segments puts it in the last segment (it
    placed it by the embedding's stage: a StageOrderError the user could not act on)."""
    methods = ("pipemare-recompute",) if tie else ("pipedream", "pipemare-recompute")
    for method in methods:
        records = train.run(RunConfig(**{**SMALL, "model_kwargs": {"d_model": 16, "heads": 2, "tie": tie},
                                         "method": method, "stages": 4, "epochs": 1}))
        assert (records["status"] == "ok").all() and records["tau_max"].iloc[0] > 0


def test_records_and_checkpoints_of_earlier_runs_without_the_new_columns_still_read(tmp_path):
    config = RunConfig(model="mlp", data="synthetic", data_kwargs={"num_samples": 100}, epochs=2, batch_size=20)
    plain = train.run(config)
    state = interrupted_run(config, tmp_path / "run.ckpt", None, 1)  # saved at the end of epoch 1
    for record in state["records"]:  # as a checkpoint written before test_ppl and best_loss existed
        del record["test_ppl"], record["best_loss"]
    Checkpoint(tmp_path / "run.ckpt").save(state)
    same_records(train.run(config, checkpoint=Checkpoint(tmp_path / "run.ckpt")), plain)
    old = tmp_path / "records.csv"
    old.write_text(plain.drop(columns=["test_ppl", "best_loss"]).to_csv(index=False))
    assert list(read_records(old, None, sweep.RECORD_COLUMNS).columns) == \
        [c for c in train.RECORD_COLUMNS if c not in ("test_ppl", "best_loss")]


def test_train_command_prints_the_perplexity_and_the_best_loss_of_a_language_model(capsys):
    from staleopt.cli import main
    args = ["train", "--model", "gpt", "--model-kwargs", '{"d_model": 16, "heads": 2}', "--data", "text-markov",
            "--data-kwargs", '{"train_tokens": 2000, "test_tokens": 500, "context": 16}', "--batch-size", "16",
            "--epochs", "1", "--optimizer", "adam", "--lr", "0.01"]
    assert main(args) == 0
    header, row = capsys.readouterr().out.splitlines()[1:3]
    assert header.split()[:6] == ["epoch", "step", "train_loss", "test_loss", "test_ppl", "best_loss"]
    assert math.isclose(float(row.split()[4]), math.exp(float(row.split()[3])), rel_tol=1e-3)
    assert main(["train", "--model", "mlp", "--data", "synthetic", "--data-kwargs", '{"num_samples": 100}',
                 "--epochs", "1", "--batch-size", "20"]) == 0
    assert "test_ppl" not in capsys.readouterr().out
