"""Checkpoints written by an earlier release load into this one and continue exactly.

``fixtures/checkpoints_v0.pt`` was written by ``fixtures/make_checkpoints.py`` with the engine of
commit d8cecb1 (state-dict format 0, before the History rewrite) on the 2-core AMD EPYC test machine.
The continuation is bit-identical on the CPU that wrote the file (checked there after the rewrite); another CPU's float64 kernels round a matmul differently (measured:
up to 5.6e-17 apart on an AMD EPYC), so the stored weights are compared to 1e-12, far below what a
misread field (a wrong version, step or learning rate) changes.
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
def test_format_0_checkpoint_resumes_exactly(stored, case):
    ckpt = stored[case]
    model, opt = make_checkpoints.build(case)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert opt.step_count == make_checkpoints.STEPS_BEFORE
    make_checkpoints.train(case, model, opt, make_checkpoints.STEPS_AFTER, make_checkpoints.STEPS_BEFORE)
    for got, want in zip(model.parameters(), ckpt["expected"]):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-12)
