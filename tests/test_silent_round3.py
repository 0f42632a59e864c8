"""No silent failures, round 3: weights loaded after the optimizer was built, parameters shared between
stages, ``opt.checkpoint`` segments that do not match the schedule's, torch's checkpoint under delays."""
import copy

import pytest
import torch
from torch import nn

import staleopt
from staleopt.corrections import DelayCompensation, DiscrepancyCorrection, GapAware, WeightPrediction
from staleopt.reference import ReferencePipelineOptimizer

from helpers import batches, mlp, mse, train

SIZES = (5, 7, 6, 6, 3)  # four stages

# ----------------------------------------------------------------------------- weights loaded after the build
CASES = {
    "dataflow": dict(),
    "pipemare": dict(schedule="pipemare", method_args={"anneal_steps": 4, "decay": 0.3}),
    "pb, tau_bkwd > 0": dict(schedule="pb", microbatches=2),
    "dataflow + T2 + DC-ASGD + gap-aware": dict(corrections=[DiscrepancyCorrection(0.3), DelayCompensation(0.5),
                                                             GapAware(0.9)]),
    "1f1b + prediction": dict(schedule="1f1b", corrections=[WeightPrediction()]),
    "pipemare, microbatch passes": dict(schedule="pipemare", method_args={"anneal_steps": 4, "decay": 0.3},
                                        microbatches=2, microbatch_passes=True),
}
ENGINES = [(staleopt.PipelineOptimizer, "minimal"), (staleopt.PipelineOptimizer, "fast"),
           (ReferencePipelineOptimizer, "minimal")]


def _run(case, cls, memory, load_after, steps=12):
    """Train a float64 MLP from the 'pretrained' weights of seed 7, loaded before or after the build."""
    pretrained = mlp(SIZES, seed=7).state_dict()
    model = mlp(SIZES, seed=0)
    if not load_after:
        model.load_state_dict(pretrained)
    kwargs = {k: copy.deepcopy(v) for k, v in CASES[case].items()}
    opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=4, memory=memory, **kwargs)
    if load_after:
        model.load_state_dict(pretrained)
    passes = kwargs.get("microbatches", 1) if kwargs.get("microbatch_passes") else 1
    for x, y in batches(steps, in_dim=5, out_dim=3):
        opt.zero_grad()
        for k in range(passes):
            mse(model(x[k::passes]), y[k::passes]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cls, memory", ENGINES, ids=["minimal", "fast", "reference"])
@pytest.mark.parametrize("case", list(CASES))
def test_weights_loaded_after_the_build_are_w0(case, cls, memory):
    """'build, load pretrained, train' equals 'load pretrained, build, train' bit for bit (float64)."""
    before = _run(case, cls, memory, load_after=False)
    after = _run(case, cls, memory, load_after=True)
    for a, b in zip(after, before):
        assert torch.equal(a, b)


def test_the_fix_matters():
    """The pretrained start and the random one train differently (so the test above can fail)."""
    pretrained = _run("dataflow", staleopt.PipelineOptimizer, "minimal", load_after=False)
    model = mlp(SIZES, seed=0)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=4)
    train(model, opt, batches(12, in_dim=5, out_dim=3))
    assert any(not torch.equal(a, b) for a, b in zip(pretrained, model.parameters()))


def test_weights_loaded_between_backward_and_the_first_step_are_w0():
    """A change before step 0 updates the weights is w_0 for the later steps' stale reads (as a plain optimizer
    would step from the changed weights); the first gradient is what the forward pass computed."""
    data = batches(6, in_dim=5, out_dim=3)
    pretrained = mlp(SIZES, seed=7).state_dict()
    results = []
    for cls, memory in ENGINES:
        model = mlp(SIZES, seed=0)
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4, memory=memory)
        x, y = data[0]
        mse(model(x), y).backward()
        model.load_state_dict(pretrained)
        opt.step()
        train(model, opt, data[1:])
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(results, results[1:]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_change_at_rest_between_steps_is_part_of_w_t():
    """Weight clipping after every step: every engine pushes the clipped weights as w_t (the reference keeps
    every version as it found it at step()), and the stale stages read clipped versions."""
    results = []
    for cls, memory in ENGINES:
        model = mlp(SIZES, seed=0)
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.5), stages=4, memory=memory, schedule="pipemare")
        for x, y in batches(10, in_dim=5, out_dim=3):
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.2, 0.2)
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    assert all(p.abs().max() <= 0.2 for p in results[0])


def test_the_first_step_updates_the_weights_it_finds():
    """w_1 = B - lr g(A): the gradient of the forward pass (at A), applied to the weights loaded since (B)."""
    data = batches(1, in_dim=5, out_dim=3)
    init, pretrained = mlp(SIZES, seed=0), mlp(SIZES, seed=7)
    model = copy.deepcopy(init)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4)
    x, y = data[0]
    mse(model(x), y).backward()
    mse(init(x), y).backward()
    model.load_state_dict(pretrained.state_dict())
    opt.step()
    for p, b, a in zip(model.parameters(), pretrained.parameters(), init.parameters()):
        assert torch.equal(p, torch.add(b, a.grad, alpha=-0.05))


# ----------------------------------------------------------------------------- parameters used by two stages
def _gpt2(tie=True):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class Twice(nn.Module):
    """One module applied at the start and at the end of the forward pass."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(self.c(self.b(self.a(x))))


def test_gpt2_tied_embedding_is_replicated_or_refused_on_request():
    model = _gpt2()
    part = staleopt.partition_model(model, 3)
    assert [(s.name, s.stage, s.uses) for s in part.shared] == [("transformer.wte.weight", 0, (("'lm_head'", 2),))]
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3)
    assert [(r.name, r.owner_stage, r.module_name, r.stage) for r in opt.replicas] == \
        [("transformer.wte.weight", 0, "lm_head", 2)]
    opt.remove_hooks()
    with pytest.raises(staleopt.errors.SharedParameterError,
                       match=r"'transformer.wte.weight' \(stage 0\) is also used by 'lm_head' \(stage 2\).*"
                             r"tie_word_embeddings=False.*shared_parameters='first-owner'"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                   shared_parameters="error")
    # one stage, untied, or the explicit opt-in: no replica
    assert not staleopt.partition_model(model, 1).shared and not staleopt.partition_model(_gpt2(False), 3).shared
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                     shared_parameters="first-owner")
    assert opt.replicas == ()
    x = torch.randint(0, 50, (2, 8))
    model(x, labels=x).loss.backward()
    opt.step()
    with pytest.raises(staleopt.errors.ConfigError, match="'replicate'.*'error'.*'first-owner'"):
        staleopt.PipelineOptimizer(_gpt2(), torch.optim.SGD(model.parameters(), lr=0.1), shared_parameters="copy")


def test_a_module_applied_in_two_stages_is_refused_at_the_first_forward():
    model, x = Twice(), torch.randn(2, 4)
    assert not staleopt.partition_model(model, 3).shared  # registered once: the graph shows the second use
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3)
    with pytest.raises(staleopt.errors.SharedParameterError,
                       match=r"'a.weight' \(stage 0\) is also used by the forward pass, on data computed by 'c' "
                             r"\(stage 2\)"):
        model(x)
    # given an example input, the partition sees it and the optimizer refuses it at construction
    part = staleopt.partition_model(model, 3, example_input=x)
    assert [s.name for s in part.shared] == ["a.weight", "a.bias"]
    with pytest.raises(staleopt.errors.SharedParameterError):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=part)
    # the explicit opt-in accepts it
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                     shared_parameters="first-owner")
    model(x).sum().backward()
    opt.step()


def test_a_module_registered_twice_in_two_stages_is_refused_at_construction():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Linear(4, 4), nn.Linear(4, 4), shared)
    with pytest.raises(staleopt.errors.SharedParameterError, match=r"'0.weight' \(stage 0\) is also used by '3'"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3)


# ----------------------------------------------------------------------------- opt.checkpoint against the segments
class Layers(nn.Module):
    """Four Linear + tanh stages; ``calls`` lists the layer ranges run through one opt.checkpoint each."""

    def __init__(self, calls):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4)).double()
        self.calls, self.opt = calls, None

    def run(self, first, last, x):
        for i in range(first, last + 1):
            x = torch.tanh(self.layers[i](x))
        return x

    def forward(self, x):
        done = 0
        for first, last in self.calls:
            x = self.run(done, first - 1, x)
            x = self.opt.checkpoint(self.run, first, last, x)
            done = last + 1
        return self.run(done, 3, x)


def _recompute_step(calls, schedule="pipemare-recompute", steps=2):
    model = Layers(calls)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4, schedule=schedule)
    model.opt = opt
    for x, y in batches(steps, in_dim=4, out_dim=4):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("calls, problem", [
    ([(0, 0), (1, 1), (2, 2), (3, 3)], r"segment \(0, 1\) is split over 2 calls; segment \(2, 3\) is split"),
    ([(0, 3)], r"call 1 reads stages \[0, 1, 2, 3\], across the segments \[\(0, 1\), \(2, 3\)\]"),
    ([(1, 2)], r"call 1 reads stages \[1, 2\], across"),
    ([(2, 3)], r"segment \(0, 1\) has no call"),
    ([(1, 1), (2, 3)], r"segment \(0, 1\)'s call leaves out \['layers.0.weight', 'layers.0.bias'\]"),
])
def test_checkpoint_calls_that_do_not_match_the_segments_are_refused(calls, problem):
    """pipemare-recompute, P = 4: segments (0, 1) and (2, 3); anything but one call per segment is refused."""
    with pytest.raises(staleopt.errors.SegmentError, match=r"segments \[\(0, 1\), \(2, 3\)\].*" + problem
                       + r".*exactly one opt.checkpoint call"):
        _recompute_step(calls)


def test_the_segment_check_runs_every_step():
    """A forward that matches the segments trains; one that stops matching later is refused at that step."""
    model = Layers([(0, 1), (2, 3)])
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4,
                                     schedule="pipemare-recompute")
    model.opt = opt
    data = batches(4, in_dim=4, out_dim=4)
    for x, y in data[:3]:
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    model.calls = [(0, 0), (1, 1), (2, 3)]
    with pytest.raises(staleopt.errors.SegmentError, match=r"segment \(0, 1\) is split over 2 calls"):
        model(data[3][0])
    assert opt.step_count == 3


def test_matching_calls_equal_checkpoint_segments():
    from staleopt.segments import checkpoint_segments

    class Segmented(Layers):
        def forward(self, x):
            return checkpoint_segments(self.opt, [nn.Sequential(m, nn.Tanh()) for m in self.layers], x)

    by_hand = _recompute_step([(0, 1), (2, 3)], steps=6)
    model = Segmented([])
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4,
                                     schedule="pipemare-recompute")
    model.opt = opt
    train(model, opt, batches(6, in_dim=4, out_dim=4))
    assert all(torch.equal(a, b) for a, b in zip(by_hand, model.parameters()))


def test_hf_per_layer_checkpointing_leaves_the_embeddings_out_of_stage_0s_segment():
    """Hugging Face's per-layer gradient checkpointing with opt.checkpoint swapped in: one call per block, the
    embeddings and the final norm and head outside: refused, naming them."""
    model = _gpt2(tie=False)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4,
                                     schedule="pipemare-recompute")
    model._set_gradient_checkpointing(True, opt.checkpoint)
    model.train()
    x = torch.randint(0, 50, (2, 8))
    with pytest.raises(staleopt.errors.SegmentError,
                       match=r"segment \(0, 1\)'s call leaves out \['transformer.wte.weight', "
                             r"'transformer.wpe.weight'\]; segment \(2, 3\)'s call leaves out "
                             r"\['transformer.ln_f.weight', 'transformer.ln_f.bias', 'lm_head.weight'\]"):
        model(x, labels=x)


# ----------------------------------------------------------------------------- torch's checkpoint under delays
def _hf_torch_checkpoint(schedule, steps=3):
    import warnings
    model = _gpt2(tie=False)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4, schedule=schedule)
    model._set_gradient_checkpointing(True, torch.utils.checkpoint.checkpoint)  # HF's default, torch's own
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            x = torch.randint(0, 50, (2, 8))
            opt.zero_grad()
            model(x, labels=x).loss.backward()
            opt.step()
    return [w for w in caught if issubclass(w.category, staleopt.errors.RecomputeNotice)]


def test_torch_checkpoint_under_differing_views_is_noticed_once():
    """pipemare (tau_bkwd = 0 < tau_fwd): torch's checkpoint recomputes with the backward view; noticed once."""
    notices = _hf_torch_checkpoint("pipemare")
    assert len(notices) == 1
    assert "backward view" in str(notices[0].message) and "tau_bkwd = [0, 0, 0, 0]" in str(notices[0].message)
    assert _hf_torch_checkpoint("gpipe") == []  # forward and backward views equal: the same activations
    with pytest.raises(staleopt.errors.LoopError, match="outside opt.checkpoint"):  # a recompute schedule refuses it
        _hf_torch_checkpoint("pipemare-recompute")


def test_the_notice_is_true():
    """Under pipemare, torch's checkpoint changes the trajectory (the notice's claim); under gpipe it does not."""
    def run(schedule, checkpoint):
        model = Layers([])
        model.forward = (lambda x: torch.utils.checkpoint.checkpoint(model.run, 0, 3, x, use_reentrant=False)) \
            if checkpoint else (lambda x: model.run(0, 3, x))
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4,
                                         schedule=schedule)
        train(model, opt, batches(6, in_dim=4, out_dim=4))
        return [p.detach() for p in model.parameters()]
    with pytest.warns(staleopt.errors.RecomputeNotice):
        with_ckpt = run("pipemare", True)
    assert any(not torch.equal(a, b) for a, b in zip(with_ckpt, run("pipemare", False)))
    assert all(torch.equal(a, b) for a, b in zip(run("gpipe", True), run("gpipe", False)))
