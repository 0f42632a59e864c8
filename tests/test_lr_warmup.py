"""The linear-warmup learning-rate schedules of RunConfig and T1's K from the warmup (PipeMare §3.1, Table 7)."""
import math

import pytest

from staleopt import train
from staleopt.config import RunConfig
from staleopt.errors import ConfigError

SMALL = dict(model="mlp", model_kwargs={"depth": 3, "hidden": 16}, data="synthetic",
             data_kwargs={"num_samples": 250, "input_shape": [1, 8], "num_classes": 4, "separation": 0.5},
             batch_size=16, epochs=3, lr=0.05)


def cfg(**kw):
    return RunConfig(**{**SMALL, **kw})


def test_warmup_factors_by_hand():
    """n = k + 1 updates, W = 4: n/W up to W, then 1 (linear-warmup) or sqrt(W/n) (inverse-sqrt, Fairseq)."""
    lin = train.lr_lambda(cfg(lr_schedule="linear-warmup", lr_warmup_steps=4), 12, 48)
    assert [lin(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    inv = train.lr_lambda(cfg(lr_schedule="inverse-sqrt", lr_warmup_steps=4), 12, 48)
    assert [inv(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [inv(k) for k in (4, 15, 99)] == [math.sqrt(4 / 5), 0.5, 0.2]


def test_t1_anneal_steps_are_five_warmups():
    """PipeMare §3.1: K = five times the linear warmup steps (its Transformer recipe); PipeMareW's warmup = K."""
    n = 200
    c = cfg(lr_schedule="linear-warmup", lr_warmup_steps=3)
    assert train.method_args(c.replace(method="pipemare"), n) == {"anneal_steps": 15}
    assert train.method_args(c.replace(method="pipemare-w"), n) == {"anneal_steps": 15, "warmup_steps": 15}
    assert train.method_args(c.replace(method="pipemare", anneal_steps=7), n) == {"anneal_steps": 7}
    assert train.method_args(c.replace(method="gpipe"), n) == {}


def test_warmup_steps_go_with_a_warmup_schedule_only():
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        cfg(lr_schedule="linear-warmup")
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        cfg(lr_schedule="cosine", lr_warmup_steps=5)
    with pytest.raises(ConfigError, match="lr_warmup_steps = 0 must be an int >= 1"):
        cfg(lr_schedule="inverse-sqrt", lr_warmup_steps=0)


def test_run_ids_of_earlier_configs_are_unchanged():
    """lr_warmup_steps and unit_order were added later: at their defaults they stay out of the hash (sweep folders
    keep their names; 8a89a35bfb023c83 is this config's id before either existed)."""
    from staleopt.config import _LATER_FIELDS
    c = cfg()
    assert c.to_dict()["lr_warmup_steps"] is None and c.to_dict()["unit_order"] == "registration"
    assert set(_LATER_FIELDS) == {"lr_warmup_steps", "unit_order"}
    before = {k: v for k, v in c.to_dict().items() if k not in _LATER_FIELDS}
    import hashlib
    import json
    blob = json.dumps(before, sort_keys=True, separators=(",", ":"))
    assert c.run_id() == hashlib.sha256(blob.encode()).hexdigest()[:16] == "8a89a35bfb023c83"
    assert cfg(lr_schedule="linear-warmup", lr_warmup_steps=5).run_id() != cfg(
        lr_schedule="linear-warmup", lr_warmup_steps=6).run_id()


def test_training_follows_the_warmup():
    rec = train.run(cfg(lr_schedule="linear-warmup", lr_warmup_steps=24, epochs=2, method="gpipe"))
    # 12 steps per epoch: after the first epoch the scheduler is at k = 12, the 13th update's n / W
    assert rec["lr_base"].tolist() == pytest.approx([0.05 * 13 / 24, 0.05], rel=1e-15)
