"""The wrapper's construction and checkpoint API: keyword-only arguments, one way to say the stages,
state dicts through torch's optimizer hooks, the versioned ``"staleopt"`` entry, declared needs."""
import pytest
import torch

import staleopt
from staleopt.corrections import Correction, DiscrepancyCorrection, WeightPrediction
from staleopt.errors import CheckpointError, ConfigError, CorrectionError

from helpers import batches, mlp, train


def _opt(model, **kw):
    return staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                      stages=3, **kw)


def test_arguments_after_the_base_optimizer_are_keyword_only():
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="only positional arguments.*stages=4"):
        staleopt.PipelineOptimizer(model, base, 3, "dataflow")


def test_partition_strategy_is_refused_next_to_a_partition():
    model = mlp()
    part = staleopt.partition_model(model, 3, "params")
    with pytest.raises(ConfigError, match="already a Partition"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=part,
                                   partition="params")
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=part)
    assert opt.partition is part


def test_state_dict_runs_hooks_registered_on_the_wrapper():
    model = mlp(seed=1)
    opt = _opt(model, schedule="pipemare", method_args={"anneal_steps": 4, "decay": 0.3})
    train(model, opt, batches(3))
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(("post", "staleopt" in sd)))
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(("load-pre", "staleopt" in sd)))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load-post"))
    state = opt.state_dict()
    assert state["staleopt"]["format"] == staleopt.PipelineOptimizer.FORMAT
    assert seen == ["pre", ("post", True)]
    opt.load_state_dict(state)
    # the engine's load pre hook runs first and takes its entry out; the user's sees the base optimizer's part
    assert seen[2:] == [("load-pre", False), "load-post"]


def test_newer_format_is_refused_and_missing_keys_get_defaults():
    model = mlp(seed=2)
    opt = _opt(model, schedule="1f1b")
    train(model, opt, batches(2))
    state = opt.state_dict()
    newer = {**state, "staleopt": {**state["staleopt"], "format": staleopt.PipelineOptimizer.FORMAT + 1}}
    with pytest.raises(CheckpointError, match="newer"):
        opt.load_state_dict(newer)
    trimmed = {k: v for k, v in state["staleopt"].items() if k not in ("stage_groups", "passes", "delays")}
    opt.load_state_dict({**state, "staleopt": trimmed})
    assert opt.step_count == 2


def test_memory_modes_do_not_load_each_others_history():
    model = mlp(seed=3)
    fast = _opt(model, schedule="dataflow", memory="fast")
    train(model, fast, batches(2))
    state = fast.state_dict()
    with pytest.raises(staleopt.StaleoptError):
        _opt(model, schedule="dataflow").load_state_dict(state)


def test_declared_needs_refuse_contradictions_without_type_checks():
    model = mlp(seed=4)
    with pytest.raises(CorrectionError, match="raw weight history"):
        _opt(model, schedule="1f1b", corrections=[WeightPrediction(), DiscrepancyCorrection(0.3)])

    class RewritesHistory(Correction):  # any correction declaring the same need meets the same refusal
        rewrites_history = True

    with pytest.raises(CorrectionError, match="DiscrepancyCorrection needs the raw weight history.*RewritesHistory"):
        _opt(model, schedule="dataflow", corrections=[DiscrepancyCorrection(0.3), RewritesHistory()])



class _Probe(Correction):
    """Reads, in before_update (after w_t was pushed), every version the history must still hold."""

    needs_raw_history = True

    def __init__(self):
        self.read = []

    def before_update(self, delays, step):
        minimal = self.engine.history.strategy == "minimal"
        for v in self.engine.chunks:
            if v.H:
                oldest = step - v.H + minimal  # minimal: pushing w_t overwrote w_(t-H)
                self.read.append((v, [(u, [x.clone() for x in v.stored(u)]) for u in range(oldest, step + 1)]))
                with pytest.raises(CorrectionError, match=f"version {oldest - 1} is not stored at step {step}"):
                    v.stored(oldest - 1)


@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_stored_versions_are_the_weights_of_that_version_or_an_error(memory):
    """A stored version is that version's weights, or an error: never a row a later version overwrote."""
    model = mlp(seed=2)
    probe = _Probe()
    opt = _opt(model, schedule="dataflow", corrections=[probe], memory=memory)
    weights = []  # w_0, w_1, ... per parameter
    for x, y in batches(8):
        weights.append([p.detach().clone() for p in model.parameters()])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    index = {id(p): j for j, p in enumerate(model.parameters())}
    assert probe.read
    for v, rows in probe.read:
        for version, tensors in rows:
            want = weights[max(version, 0)]  # w_v = w_0 for v < 0
            assert all(torch.equal(x, want[index[id(p)]]) for x, p in zip(tensors, v.params)), (v, version)


def test_misuse_of_the_helpers_is_a_typed_error_naming_the_fix(tmp_path):
    """Raw AttributeError/TypeError/FileExistsError, a 'please report this' mid-backward, and a claim that read
    back as damaged (so any launch took the run over), before these checks."""
    from staleopt import lease
    from staleopt.segments import checkpoint_segments

    def build(schedule):
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 2))
        return m, staleopt.PipelineOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), stages=3,
                                             schedule=schedule)
    x = torch.randn(5, 3)
    m, opt = build("dataflow-recompute")
    with pytest.raises(ConfigError, match="opt.base_optimizer is the optimizer it wraps"):
        checkpoint_segments(opt.base_optimizer, list(m), x)
    m, opt = build("pipemare")  # T2 rewrites backward views up to the largest tau_bkwd, 0
    for _ in range(3):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    with pytest.raises(ConfigError, match=r"tau_bkwd\[0\] = 2 .*DiscrepancyCorrection"):
        with opt.passes_with_delays([4, 3, 1], [2, 1, 0]):
            pass
    with pytest.raises(ConfigError, match="two lists of delays"):
        with opt.passes_with_delays(3, [0, 0, 0]):
            pass
    with pytest.raises(ConfigError, match="launch must be a non-empty str"):
        lease.acquire(tmp_path / "run", 123)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        lease.acquire(tmp_path / "afile", "x")
