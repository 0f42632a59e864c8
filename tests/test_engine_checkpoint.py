"""Checkpoints written by an earlier release load into this one and continue bit for bit.

``fixtures/checkpoints_v0.pt`` was written by ``fixtures/make_checkpoints.py`` with the engine of
commit d8cecb1 (state-dict format 0, before the History rewrite), on the test machine's CPU: float64
matrix products differ in the last bit between BLAS builds, so the fixture is regenerated (with that
commit's code) where the expected weights are computed.
"""
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_checkpoints  # noqa: E402


@pytest.fixture(scope="module")
def stored():
    return torch.load(FIXTURES / "checkpoints_v0.pt", weights_only=False)


@pytest.mark.parametrize("case", sorted(make_checkpoints.CASES))
def test_format_0_checkpoint_resumes_bit_identically(stored, case):
    ckpt = stored[case]
    model, opt = make_checkpoints.build(case)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert opt.step_count == make_checkpoints.STEPS_BEFORE
    make_checkpoints.train(case, model, opt, make_checkpoints.STEPS_AFTER, make_checkpoints.STEPS_BEFORE)
    for got, want in zip(model.parameters(), ckpt["expected"]):
        assert torch.equal(got.detach(), want)
