"""staleopt.methods.build: a Pipeline answers a method's delays, lr factors, utilization and copies (docs/design.md §2, §5)."""
import math

import pytest

import staleopt
from staleopt import hardware, methods, schedules
from staleopt.config import RunConfig
from staleopt.corrections import DiscrepancyCorrection, LRReschedule, Stashing, t1_factor
from staleopt.errors import ConfigError, CorrectionError, ScheduleError


def test_build_resolves_methods_schedules_aliases_and_objects():
    p = methods.build("pipemare", 4, 2, anneal_steps=500, decay=0.3)
    assert isinstance(p.schedule, schedules.Dataflow)
    assert [type(c) for c in p.corrections] == [LRReschedule, DiscrepancyCorrection]
    assert (p.corrections[0].anneal_steps, p.corrections[1].decay) == (500, 0.3)
    assert (p.name, p.stages, p.microbatches) == ("pipemare", 4, 2)
    assert methods.build("dataflow", 4).corrections == []
    assert methods.build(schedules.get("pb"), 3).name == "pb"
    assert methods.build(methods.get("pipedream"), 3).stashes
    # aliases: the timelines' old names for two methods, resolved by the methods themselves
    assert methods.get("1f1b-flush") is methods.get("pipedream-flush")
    assert methods.build("dataflow-stash", 3).stashes and "dataflow-stash" not in methods.names()
    with pytest.raises(ScheduleError, match="unknown schedule or method 'nope'"):
        methods.build("nope", 2)
    with pytest.raises(ScheduleError, match="no hyperparameter"):
        methods.build("gpipe", 2, decay=0.1)


def test_a_pipeline_passes_through_build_only_for_its_own_shape():
    p = methods.build("1f1b", 3, 2)
    assert methods.build(p, 3, 2) is p
    with pytest.raises(ScheduleError, match="built for stages=3, microbatches=2"):
        methods.build(p, 4, 2)
    with pytest.raises(ScheduleError, match="overrides"):
        methods.build(p, 3, 2, anneal_steps=3)


def test_delays_are_the_schedules_after_every_correction_and_are_copies():
    P, N = 5, 2
    p = methods.build("pipedream", P, N)
    tf = [math.ceil((P - 1 - i) / N) for i in range(P)]
    assert p.delays == (tf, tf)                         # Stashing: tau_bkwd := tau_fwd
    p.delays[0][0] = 99                                 # callers get copies
    assert p.delays == (tf, tf)


def test_lr_factors_are_t1_at_step_k():
    p = methods.build("pipemare-t1", 4, 1, anneal_steps=8)
    tf = [7, 5, 3, 1]
    for k in (0, 3, 8, 20):
        assert p.lr_factors(k) == [t1_factor(t, k, 8) for t in tf]
    assert methods.build("1f1b", 4).lr_factors(5) == [1.0] * 4


@pytest.mark.parametrize("method, args", [("pipemare-w", {"warmup_steps": 6, "anneal_steps": 10}),
                                          ("pipemare", {"anneal_steps": 10}), ("staleness-aware", {})])
def test_lr_factors_are_the_engines_at_every_step(method, args):
    """Pipeline.lr_factors(t) is what the training engine multiplies lr by at step t: 1 through PipeMareW's
    warmup, then T1 of the refilling delays with k = t - W (it applied T1 of the full delays inside the warmup
    and stopped annealing K steps after step 0). asynchronous_lr_factors(k): the full pipeline's, k steps in."""
    import torch

    P = 4
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(P)])
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=P, schedule=method,
                                     method_args=args)
    p = methods.build(method, P, 1, **args)
    x = torch.randn(4, 3)
    for t in range(25):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        assert p.lr_factors(t) == [opt.lr_factor(i) for i in range(P)], t
    W = args.get("warmup_steps", 0)
    assert p.asynchronous_lr_factors(3) == p.without_phases().lr_factors(3)
    if "anneal_steps" in args:
        assert p.asynchronous_lr_factors(3) == [t1_factor(t, 3, 10) for t in [7, 5, 3, 1]]
    if W:  # three steps after the warmup the pipeline is refilling: min(tau, 3), not the full delays
        assert p.lr_factors(W + 3) == [t1_factor(min(t, 3), 3, 10) for t in [7, 5, 3, 1]] != \
            p.asynchronous_lr_factors(3)
    with pytest.raises(ConfigError, match="step"):
        p.lr_factors(-1)


def test_utilization_of_phased_methods():
    P, N = 8, 4
    sync = N / (N + P - 1)
    assert methods.build("gpipe", P, N).utilization() == sync
    assert methods.build("pipemare-w", P, N).utilization(total_steps=4000) == methods.amortized_utilization(
        [(1000, sync), (3000, 1.0)])
    assert methods.build("pipemare-w", P, N, warmup_steps=0).utilization() == 1.0
    hybrid = methods.build("pb-hybrid", P, N)
    assert hybrid.utilization(total_steps=3000) == methods.amortized_utilization(
        [(1000, 1.0), (2000, N / (N + 2 * P - 2))])  # its synchronous phase pipelines the N microbatches
    assert methods.build("pb-hybrid", P, 1).utilization(total_steps=3000) == pytest.approx(
        methods.hybrid_speedup(3000, 1000, P) / (2 * P - 1))  # at N = 1 the stale-weights paper's speedup
    with pytest.raises(ConfigError, match="total_steps"):
        hybrid.utilization()
    assert hardware.amortized_utilization is methods.amortized_utilization


def test_weight_copies_hand_counts():
    w = [10, 20, 30, 40]
    sgdm = "sgd-momentum"
    # PipeDream, N = 1: stash sum_i |w_i| (P-1-i)
    assert methods.build("pipedream", 4).weight_copies(w, sgdm) == dict(
        stash_bytes=10 * 3 + 20 * 2 + 30 * 1, second_version_bytes=0, prediction_bytes=0, t2_bytes=0)
    # 2BW: one second buffer per stage
    assert methods.build("pipedream-2bw", 4, 4).weight_copies(w, sgdm)["second_version_bytes"] == 100
    assert methods.build("pipedream-2bw", 1, 1).weight_copies([10], sgdm)["second_version_bytes"] == 0
    # T2: one delta per stage with tau_fwd > tau_bkwd (all dataflow stages)
    assert methods.build("pipemare", 4).weight_copies(w, sgdm)["t2_bytes"] == 100
    # prediction: stages with a version gap (1F1B's last stage has none); XPipe's own Adam moments
    assert methods.build("spectrain", 4).weight_copies(w, sgdm)["prediction_bytes"] == 60
    assert methods.build("spectrain", 4).weight_copies(w, "adam")["prediction_bytes"] == 120
    assert methods.build("xpipe", 4).weight_copies(w, sgdm)["prediction_bytes"] == 180
    assert methods.build("xpipe", 4).weight_copies(w, "adam")["prediction_bytes"] == 60
    p = methods.build("pipemare-stash", 4, 2)
    assert p.extra_versions() == p.delays[0] and p.stashes


def test_version_policy_and_timeline_names():
    cases = {"gpipe": ("current", "gpipe"), "pipedream-flush": ("current", "pipedream-flush"),
             "1f1b": ("current", "1f1b"), "pipedream": ("stash", "pipedream"), "pipeoptim": ("current", "1f1b"),
             "pipedream-2bw": ("minibatch", "2bw"), "pipemare": ("current", "dataflow"),
             "pipemare-stash": ("stash", "dataflow-stash"), "pb-hybrid": ("current", "pb")}
    for name, (policy, timeline) in cases.items():
        p = methods.build(name, 2, 2)
        assert (p.version_policy, p.timeline_name) == (policy, timeline), name
    with pytest.raises(ScheduleError, match="vertical sync"):
        methods.build("pipedream-vs", 2).program(1)


def test_hyperparameters_and_the_run_config_pipeline():
    assert methods.hyperparameters("pipemare") == {"anneal_steps": 1000, "decay": 0.1, "accumulator": "causal"}
    assert methods.hyperparameters("dataflow") == {} == methods.hyperparameters("gpipe")
    cfg = RunConfig(model="mlp", data="synthetic", method="pipemare", stages=3, decay=0.5)
    p = cfg.pipeline()
    assert (p.stages, p.corrections[1].decay, p.corrections[0].anneal_steps) == (3, 0.5, 1000)
    assert cfg.pipeline(anneal_steps=7, decay=0.2).corrections[0].anneal_steps == 7
    with pytest.raises(ConfigError, match="resolved"):
        RunConfig(model="mlp", data="synthetic", method="pipemare", stages="max").pipeline()


def test_table_lists_each_method_once():
    rows = methods.table()
    assert [r["method"] for r in rows] == methods.names()
    assert {r["schedule"] for r in rows} <= set(schedules.names())
    assert next(r for r in rows if r["method"] == "pipedream")["corrections"] == type(Stashing()).__name__


def test_t2_methods_take_the_accumulator_convention():
    """T2's methods pass ``accumulator`` through (causal by default, as theory.py); a bad name says the choices."""
    for name in ("pipemare", "pipemare-w", "pipemare-recompute"):
        t2 = [c for c in methods.resolve(name)[1] if isinstance(c, DiscrepancyCorrection)]
        assert [c.accumulator for c in t2] == ["causal"], name
        t2 = [c for c in methods.resolve(name, accumulator="current")[1] if isinstance(c, DiscrepancyCorrection)]
        assert [c.accumulator for c in t2] == ["current"], name
    with pytest.raises(CorrectionError, match=r"one of \('causal', 'current'\)"):
        methods.resolve("pipemare", accumulator="delayed")
