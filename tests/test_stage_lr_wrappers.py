"""Per-stage step sizes (T1) reach the optimizer that steps when the base optimizer wraps another one.

timm's ``Lookahead`` steps its inner optimizer's parameter groups: before, the per-stage groups replaced
only ``Lookahead.param_groups``, so the inner AdamW stepped with the unscaled lr and ``lookahead_step``
never advanced (after 12 steps the weights were plain AdamW's under ``dataflow``). The reference here
is built by hand in float64: the same schedule without T1, the inner optimizer over one group per stage
whose lr is scaled by PipeMare eq. 4's factor before every step.
"""
import pytest
import torch

import staleopt
from staleopt import methods
from staleopt.corrections import LRReschedule
from staleopt.corrections.lr_reschedule import t1_factor
from staleopt.errors import OptimizerMismatchError
from helpers import batches, mlp, mse

timm_optim = pytest.importorskip("timm.optim")

SIZES, STAGES, STEPS, K, LR = (5, 7, 6, 6, 3), 4, 12, 8, 0.02


def _lookahead(groups):
    return timm_optim.Lookahead(torch.optim.AdamW(groups, lr=LR, weight_decay=0.01), alpha=0.5, k=3)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("method", ["pipemare-t1", "pipemare"])
def test_lookahead_under_per_stage_lr_equals_a_hand_scaled_reference(method):
    args = {"anneal_steps": K} if method == "pipemare-t1" else {"anneal_steps": K, "decay": 0.3}
    data = batches(STEPS, in_dim=SIZES[0], out_dim=SIZES[-1])

    model = mlp(SIZES)
    base = _lookahead(model.parameters())
    opt = staleopt.PipelineOptimizer(model, base, stages=STAGES, schedule=method, method_args=args)
    for x, y in data:
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()

    ref_model = mlp(SIZES)
    schedule, corrections = methods.resolve(method, **args)
    rest = [c for c in corrections if not isinstance(c, LRReschedule)]
    assert len(rest) == len(corrections) - 1
    partition = staleopt.partition_model(ref_model, STAGES)
    ref_base = _lookahead([{"params": s.params} for s in partition])  # one group per stage, by hand
    ref = staleopt.PipelineOptimizer(ref_model, ref_base, stages=partition, schedule=schedule, corrections=rest)
    for k, (x, y) in enumerate(data):
        ref.zero_grad()
        mse(ref_model(x), y).backward()
        for stage, group in enumerate(ref_base.param_groups):
            group["lr"] = LR * t1_factor(ref.tau_fwd[stage], k, K)
        ref.step()

    assert all(g["lookahead_step"] == STEPS for g in ref_base.param_groups)
    assert base.param_groups[0]["lookahead_step"] == STEPS  # Lookahead's own state advanced, never reset
    assert torch.equal(_flat(model), _flat(ref_model))
    # and it is neither plain AdamW under the same delays (Lookahead lost) nor Lookahead without T1
    for lookahead, t1 in ((False, True), (True, False)):
        other = mlp(SIZES)
        inner = torch.optim.AdamW(other.parameters(), lr=LR, weight_decay=0.01)
        o = staleopt.PipelineOptimizer(other, timm_optim.Lookahead(inner, alpha=0.5, k=3) if lookahead else inner,
                                       stages=STAGES, schedule=method if t1 else schedule,
                                       **({"method_args": args} if t1 else {"corrections": rest}))
        for x, y in data:
            o.zero_grad()
            mse(other(x), y).backward()
            o.step()
        assert (_flat(other) - _flat(model)).abs().max() > 1e-6


def test_lookahead_checkpoint_keeps_its_step_per_stage():
    """The per-stage ``lookahead_step`` travels in the wrapper's state dict and resumes exactly."""
    import copy
    data = batches(10, in_dim=SIZES[0], out_dim=SIZES[-1])

    def build():
        model = mlp(SIZES)
        return model, staleopt.PipelineOptimizer(model, _lookahead(model.parameters()), stages=STAGES,
                                                 schedule="pipemare-t1", method_args={"anneal_steps": K})
    model, opt = build()
    for i, (x, y) in enumerate(data):
        if i == 4:
            state, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    model2, opt2 = build()
    model2.load_state_dict(weights)
    opt2.load_state_dict(state)
    for x, y in data[4:]:
        opt2.zero_grad()
        mse(model2(x), y).backward()
        opt2.step()
    assert torch.equal(_flat(model), _flat(model2))


class _CopiesGroups(torch.optim.Optimizer):
    """A wrapper that steps an inner optimizer over group dicts of its own: T1 cannot reach it."""

    def __init__(self, inner):
        self.inner = inner
        super().__init__([dict(g) for g in inner.param_groups], inner.defaults)

    def step(self, closure=None):
        return self.inner.step(closure)


def test_a_wrapper_whose_inner_groups_cannot_be_driven_is_refused():
    model = mlp(SIZES)
    base = _CopiesGroups(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(OptimizerMismatchError, match="_CopiesGroups wraps a SGD.*would not reach"):
        staleopt.PipelineOptimizer(model, base, stages=STAGES, schedule="pipemare-t1")
    staleopt.PipelineOptimizer(model, base, stages=STAGES, schedule="dataflow")  # no per-stage lr: fine
