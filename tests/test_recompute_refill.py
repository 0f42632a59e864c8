"""PipeMare Recompute's third delay (App. A.3, D.1) and the refill after a flush (PipeMare §4), against the
executed timeline."""
import math

import pytest

from staleopt import hardware, methods, schedules
from staleopt.errors import ConfigError, DelayError, ScheduleError
from staleopt.timeline import simulate


def test_recompute_delays_default_to_the_backwards():
    """Every schedule without PipeMare Recompute recomputes inside the backward pass: tau_recomp = tau_bkwd."""
    for name in ["sync", "dataflow", "1f1b", "pb", "2bw", "hogwild"]:
        s = schedules.get(name)
        assert s.recompute_delays(4, 4) == s.delays(4, 4)[1]
        assert s.microbatch_recompute_delays(4, 4) == s.microbatch_delays(4, 4)[1]
        assert s.segments(4) == [] and s.cached_inputs(4, 4) == [0] * 4
    custom = schedules.get("custom", tau_fwd=[3, 1], tau_bkwd=[1, 0])
    assert custom.recompute_delays(2) == [1, 0] and repr(custom) == "Custom(tau_fwd=[3, 1], tau_bkwd=[1, 0])"
    custom = schedules.get("custom", tau_fwd=[3, 1], tau_bkwd=[1, 0], tau_recomp=[2, 1])
    assert custom.recompute_delays(2) == [2, 1] and methods.build(custom, 2).recompute_delays == [2, 1]
    assert methods.build("pipedream", 4).recompute_delays == [3, 2, 1, 0]       # stashing: the forward's version


def test_custom_recompute_errors():
    with pytest.raises(DelayError, match="between tau_bkwd and tau_fwd"):
        schedules.get("custom", tau_fwd=[3, 1], tau_bkwd=[1, 0], tau_recomp=[4, 1])
    with pytest.raises(DelayError, match="tau_recomp has 1"):
        schedules.get("custom", tau_fwd=[3, 1], tau_recomp=[2])
    with pytest.raises(DelayError, match=">= 0"):
        schedules.get("custom", tau_fwd=[3, 1], tau_recomp=[-1, 0])


@pytest.mark.parametrize("P", range(1, 8))
def test_dataflow_recompute_closed_forms_equal_the_executed_timeline(P):
    """App. A.3 timing: tau_recomp = ceil((2(b-i)+1-j)/N) between tau_fwd and tau_bkwd = 0 (App. D.1), equal
    to tau_fwd only in the segment holding the last stage; recomputed activations 2(b-i)+1 and cached inputs
    2(P-1-b) per segment, as executed."""
    for S in range(1, P + 1):
        schedule = schedules.DataflowRecompute(segment=S)
        segments = schedule.segments(P)
        assert segments[0][0] == 0 and segments[-1][1] == P - 1
        assert all(b - a + 1 == S for a, b in segments[:-1])
        last = {i: b for a, b in segments for i in range(a, b + 1)}
        for N in range(1, 4):
            tl = simulate(schedule, P, N, 2)
            tf, tb = schedule.delays(P, N)
            assert (tl.tau_fwd, tl.tau_bkwd) == (tf, tb) == schedules.Dataflow().delays(P, N)
            expected = [[max(0, math.ceil((2 * (last[i] - i) + 1 - j) / N)) for j in range(N)] for i in range(P)]
            assert [list(r) for r in tl.tau_recomp_microbatch] == schedule.microbatch_recompute_delays(P, N) \
                == expected
            tr = schedule.recompute_delays(P, N)
            assert tl.tau_recomp == tr
            for i in range(P):
                assert tf[i] >= tr[i] >= tb[i]
                if N == 1:
                    assert (tr[i] == tf[i]) == (last[i] == P - 1)
            long = simulate(schedule, P, N, 6 * P)
            assert long.peak_in_flight == schedule.in_flight(P, N) == [2 * (last[i] - i) + 1 for i in range(P)]
            assert long.peak_cached_inputs == schedule.cached_inputs(P, N)
            assert long.peak_cached_inputs == [2 * (P - 1 - b) if i == a else 0
                                               for i in range(P) for a, b in [min(
                                                   (s for s in segments if s[0] <= i <= s[1]))]]
            assert tl.steady_state_utilization == 1.0


def test_default_segment_is_sqrt_p_and_errors():
    assert schedules.get("dataflow-recompute").segments(16) == [(0, 3), (4, 7), (8, 11), (12, 15)]
    assert schedules.get("dataflow-recompute").segments(10) == [(0, 2), (3, 5), (6, 8), (9, 9)]
    with pytest.raises(ScheduleError, match="does not fit"):
        schedules.get("dataflow-recompute", segment=5).delays(4)
    with pytest.raises(ScheduleError, match="segment"):
        schedules.get("dataflow-recompute", segment=0)


def test_pipemare_recompute_method():
    p = methods.build("pipemare-recompute", 16, 1)
    assert p.schedule.segments(16) == [(0, 3), (4, 7), (8, 11), (12, 15)]
    assert p.delays == methods.build("pipemare", 16, 1).delays
    assert p.recompute_delays[:4] == [7, 5, 3, 1] and p.recompute_delays[12:] == [7, 5, 3, 1]
    assert [type(c).__name__ for c in p.corrections] == ["LRReschedule", "DiscrepancyCorrection"]
    q = methods.build("pipemare-recompute", 6, 2, segment=3, anneal_steps=7)
    assert q.schedule.segment == 3 and q.corrections[0].anneal_steps == 7
    assert methods.hyperparameters("pipemare-recompute") == {"segment": None, "anneal_steps": 1000, "decay": 0.1,
                                                             "accumulator": "causal"}


def test_hardware_prices_the_executed_segments():
    """memory_report of a recompute pipeline: its own cached inputs and recomputed activations (the timeline's)."""
    from torch import nn
    import torch
    P, mb = 4, 2
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(P)])
    x = torch.zeros(1, 8)
    r = hardware.memory_report(model, "pipemare-recompute", P, 1, microbatch_size=mb, example_input=x)
    a = 8 * 4 * mb                                            # one stage's input activation, float32
    long = simulate(methods.build("pipemare-recompute", P, 1), P, 1, 6 * P)
    assert r.recompute_segment == 2                           # round(sqrt(4))
    assert r.activation_recompute_bytes == a * (sum(long.peak_in_flight) + sum(long.peak_cached_inputs))
    assert r.activation_bytes == a * sum(schedules.Dataflow().in_flight(P, 1))
    with pytest.raises(ConfigError, match="own segments"):
        hardware.memory_report(model, "pipemare-recompute", P, 1, microbatch_size=mb, example_input=x,
                               recompute_segment=2)


def every_executed_pipeline():
    for name in methods.names() + ["dataflow", "pb", "sync", "2bw", "dataflow-recompute"]:
        hp = methods.hyperparameters(name)
        variants = [{}]
        if "warmup_steps" in hp:
            variants = [dict(warmup_steps=w) for w in (0, 1, 3, 9)]
        if "pipelined_steps" in hp:
            variants = [dict(pipelined_steps=w) for w in (0, 1, 3, 9)]
        if name == "pipedream-vs" or methods.build(name, 1).schedule.name not in schedules.pipelines():
            continue                                          # no timeline (vertical sync, hogwild's random delays)
        for P, N in [(1, 1), (2, 1), (3, 2), (4, 4), (5, 3), (5, 1)]:
            if methods.build(name, 1).schedule.name == "2bw" and 1 < P and N < P:
                continue
            for v in variants:
                yield name, P, N, v


@pytest.mark.parametrize("name,P,N,v", list(every_executed_pipeline()))
def test_delays_at_every_step_equal_the_executed_timeline(name, P, N, v):
    """Pipeline.microbatch_delays_at(t) = the delay of every pass of minibatch t in the executed timeline:
    warmup steps 0, then min(tau, t - W) while the pipeline refills after its last flush (PipeMareW,
    PipeMare §4), the hybrid's synchronous steps 0 after the drain (stale-weights §4)."""
    p = methods.build(name, P, N, **v)
    K = 12
    tl = simulate(p, P, N, K)
    seen = set()
    for e in tl.events:
        d = p.microbatch_delays_at(e.minibatch)
        want = {"F": d.fwd, "B": d.bkwd, "R": d.recomp}[e.kind][e.stage][e.microbatch - e.minibatch * N]
        assert e.delay == want, (e, want)
        seen.add(e.minibatch)
    assert seen == set(range(K))
    for t in range(K):
        per_stage = p.delays_at(t)
        assert per_stage.fwd == [max(r) for r in p.microbatch_delays_at(t).fwd]
        if not p.synchronous(t) and t - p.refilled_at(t) >= max(p.delays[0] + [0]):
            assert (per_stage.fwd, per_stage.bkwd) == p.delays and per_stage.recomp == p.recompute_delays


def test_pipemare_w_refill_by_hand():
    """P = 3, N = 1, W = 2 warmup steps: stage 0's forward delay runs 0, 0, then 0, 1, 2, ... up to 5."""
    p = methods.build("pipemare-w", 3, 1, warmup_steps=2)
    assert [p.delays_at(t).fwd[0] for t in range(10)] == [0, 0, 0, 1, 2, 3, 4, 5, 5, 5]
    assert [p.delays_at(t).fwd[2] for t in range(5)] == [0, 0, 0, 1, 1]
    tl = simulate(p, 3, 1, 10)
    assert [e.delay for e in tl.events if e.kind == "F" and e.stage == 0] == [0, 0, 0, 1, 2, 3, 4, 5, 5, 5]
    assert p.phases(10) == [(0, 2, True), (2, 8, False)]
    h = methods.build("pb-hybrid", 3, 1, pipelined_steps=4)
    assert h.phases(10) == [(0, 4, False), (4, 6, True)]
    assert [h.delays_at(t).fwd[0] for t in range(7)] == [0, 1, 2, 3, 0, 0, 0]


def test_phased_timeline_flushes_between_synchronous_minibatches():
    """A synchronous minibatch starts after the previous one drained: its first forward follows every update."""
    p = methods.build("pipemare-w", 3, 2, warmup_steps=3)
    tl = simulate(p, 3, 2, 5)
    for t in range(1, 4):
        first = min(e.slot for e in tl.events if e.minibatch == t)
        assert all(slot < first for s, slot, u in tl.updates if u == t - 1)
    assert (tl.tau_fwd, tl.tau_bkwd) == p.delays                # the steady state: the pipelined phase


def test_theory_timeline_and_advisor_share_the_recompute_convention():
    """One convention everywhere: a pass of minibatch t with delay tau reads w_{t-tau} and runs when its stage
    has applied exactly t - tau updates, so the accumulator it can read is delta_{t-tau}: theory's causal T2
    (``u_recomp = w_{t-tau_recomp} - (tau_fwd - tau_recomp) delta_{t-tau_recomp}``, App. D.1). The advisor's
    table and the theory's inputs are the pipeline's delays, which equal the timeline's."""
    import numpy as np
    from torch import nn
    import torch
    from staleopt import advise, theory
    P, N = 6, 2
    pipeline = methods.build("pipemare-recompute", P, N, segment=2)
    tl = simulate(pipeline, P, N, 5 * P)
    applied = {}
    for stage, slot, t in tl.updates:
        applied.setdefault(stage, []).append(slot)
    for e in tl.events:
        assert sum(slot < e.slot for slot in applied.get(e.stage, [])) == e.version   # updates seen = version read
    tf, tb = pipeline.delays
    tr = pipeline.recompute_delays
    assert (tl.tau_fwd, tl.tau_bkwd, tl.tau_recomp) == (tf, tb, tr)
    i = 0                                                       # first segment: tau_fwd > tau_recomp > tau_bkwd
    assert tf[i] > tr[i] > tb[i]
    w = theory.simulate_quadratic(0.01, 1.0, tf[i], tb[i], delta=2.0, tau_recomp=tr[i], phi=-1.0,
                                  correction_decay=0.1, steps=40, seed=1)
    c = theory.companion_matrix(0.01, 1.0, tf[i], tb[i], delta=2.0, tau_recomp=tr[i], phi=-1.0,
                                correction_decay=0.1)
    assert np.isfinite(w).all() and c.shape[0] == tf[i] + 1 + max(tb[i], tr[i]) + 1
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(P)])
    x, y = torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), torch.zeros(8, 3)
    table = advise(model, nn.functional.mse_loss, (x, y), "pipemare-recompute", stages=P, microbatches=N,
                   method_args={"segment": 2}, iters=5).table
    assert (table["tau_fwd"].tolist(), table["tau_bkwd"].tolist(), table["tau_recomp"].tolist()) == (tf, tb, tr)
    plain = advise(model, nn.functional.mse_loss, (x, y), "pipemare", stages=P, microbatches=N, iters=5).table
    assert "tau_recomp" not in plain.columns                  # the tables of other methods are unchanged


def test_2bw_at_one_stage_reads_the_current_version():
    """2BW at P = 1: the executed program (every microbatch of minibatch t starts after update t - 1 landed)
    reads w_t, delay 0; the paper's max(floor((k-1)/m) - 1, 0) assumes a pipeline (docs/schedules.md)."""
    for N in (1, 2, 3):
        tl = simulate("pipedream-2bw", 1, N, 6)
        assert {e.delay for e in tl.events} == {0}
        assert schedules.get("2bw").delays(1, N) == ([0], [0])


def test_training_a_recompute_delay_needs_opt_checkpoint():
    """With tau_recomp != tau_bkwd a step whose forward made no opt.checkpoint call would silently step as the
    schedule without recompute: the optimizer refuses that step and names the fix (docs/wrapper.md); with
    opt.checkpoint it trains (tests/test_engine_recompute.py checks what it computes)."""
    import torch
    from torch import nn
    from staleopt import PipelineOptimizer
    from staleopt.errors import LoopError

    class Net(nn.Sequential):
        def forward(self, x):
            return self.opt[0].checkpoint(super().forward, x) if self.opt else super().forward(x)

    def run(schedule, checkpoint):
        model = Net(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)]).double()
        opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4, schedule=schedule)
        model.opt = [opt] if checkpoint else []
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
        opt.step()

    custom = schedules.get("custom", tau_fwd=[3, 2, 1, 0], tau_bkwd=[0, 0, 0, 0], tau_recomp=[1, 1, 0, 0])
    for schedule in ("pipemare-recompute", custom):
        with pytest.raises(LoopError, match="no opt.checkpoint call ran.*torch.utils.checkpoint.*without_recompute"):
            run(schedule, checkpoint=False)
    with pytest.raises(LoopError, match="tau_recomp = \\[1, 1, 0, 0\\] \\(tau_bkwd = \\[0, 0, 0, 0\\]\\)"):
        run(custom, checkpoint=False)
    run(custom, checkpoint=True)
    run(schedules.get("dataflow-recompute").without_recompute(), checkpoint=False)
    run(schedules.get("custom", tau_fwd=[3, 2, 1, 0], tau_bkwd=[0, 0, 0, 0], tau_recomp=[0, 0, 0, 0]), False)


def test_what_if_recompute_memory_bounds_the_executed_one():
    """activation_memory's what-if keeps a segment's input until the segment's first backward: for the dataflow
    counts it is at least the executed pricing of the same segments, and exceeds it by the inputs held from the
    recomputation to that backward, (2S_k - 1) in_a per segment (docs/timelines-hardware.md)."""
    for P in range(1, 12):
        sizes = [(10 + 3 * i, 2 + i) for i in range(P)]                # unequal stages: a_i, in_i
        for S in range(1, P + 1):
            schedule = schedules.DataflowRecompute(segment=S)
            executed = hardware.recompute_activation_memory(sizes, schedule.in_flight(P), schedule.cached_inputs(P))
            _, what_if, _ = hardware.activation_memory(sizes, schedules.Dataflow().in_flight(P), S)
            extra = sum((2 * (b - a + 1) - 1) * sizes[a][1] for a, b in schedule.segments(P))
            assert what_if - executed == extra >= 0, (P, S)
