"""Each schedule object owns its facts, and the executed timelines agree with each of them (docs/design.md §2, §4, §5)."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from staleopt import PipelineOptimizer, advise, hardware, methods, schedules
from staleopt.config import RunConfig
from staleopt.errors import ConfigError, DelayError, ScheduleError
from staleopt.timeline import simulate

PNS = [(1, 1), (2, 1), (3, 2), (4, 4), (5, 3), (6, 6)]
ALIASES = ["1f1b-flush", "dataflow-stash"]


def every_name():
    """Every registered method, schedule and alias; custom is built from arguments, so as an object."""
    return methods.names() + [n for n in schedules.names() if n != "custom"] + ALIASES


def runs(name, P, N):
    """Whether ``name`` can run ``P`` stages with ``N`` microbatches (2BW needs N >= P)."""
    return not (methods.build(name, 1).schedule.name == "2bw" and 1 < P and N < P)


def executed(name):
    """Whether a timeline executes ``name``: a pipeline schedule, and no vertical sync (not modelled)."""
    pipeline = methods.build(name, 1)
    return pipeline.schedule.name in schedules.pipelines() and not any(
        type(c).__name__ == "VerticalSync" for c in pipeline.corrections)


def test_pipeline_schedules_are_the_ones_with_programs():
    assert schedules.pipelines() == ["1f1b", "2bw", "dataflow", "dataflow-recompute", "pb", "sync"]


@pytest.mark.parametrize("name", every_name())
def test_every_name_works_in_simulate_in_flight_delays_and_utilization(name):
    """The timeline and the hardware model accept the same names and agree on every fact of the schedule.

    For each name with a timeline: the delays (largest per stage, after the
    corrections) equal the executed timeline's; the in-flight counts and the
    extra weight versions equal a long run's peaks (phased methods: a run of
    their pipelined phase); the recompute delays and cached inputs too; the steady-state
    utilization (phased methods: their pipelined phase only) equals the
    timeline's. Names without a fixed pipeline raise ScheduleError in both.
    """
    for P, N in PNS:
        if not runs(name, P, N):
            continue
        pipeline = methods.build(name, P, N)
        assert hardware.effective_delays(name, P, N) == pipeline.delays
        phase = dict(total_steps=10, warmup_steps=0, pipelined_steps=10)
        utilization = hardware.pipeline_utilization(name, P, N, **phase)
        assert utilization == pipeline.utilization(**phase)
        if not executed(name):
            with pytest.raises(ScheduleError, match="no timeline"):
                simulate(name, P, N, 2)
            if pipeline.schedule.name not in schedules.pipelines():
                with pytest.raises(ScheduleError, match="no fixed pipeline"):
                    hardware.in_flight_counts(name, P, N)
            continue
        tl = simulate(name, P, N, 2)
        long = simulate(pipeline.without_phases(), P, N, 6 * P)     # phased methods: the pipelined phase
        assert (tl.tau_fwd, tl.tau_bkwd) == pipeline.delays, (name, P, N)
        assert tl.tau_recomp == pipeline.recompute_delays, (name, P, N)
        assert hardware.in_flight_counts(name, P, N) == pipeline.in_flight() == long.peak_in_flight, (name, P, N)
        assert pipeline.cached_inputs() == long.peak_cached_inputs, (name, P, N)
        assert [v - 1 for v in long.peak_versions] == pipeline.extra_versions(), (name, P, N)
        assert utilization == pytest.approx(tl.steady_state_utilization, abs=1e-15), (name, P, N)


def test_schedule_delays_equal_the_executed_timeline_for_every_pipeline_schedule():
    """Closed forms of each schedule object = the executed timeline's, per stage and per microbatch."""
    for name in schedules.pipelines():
        schedule = schedules.get(name)
        for P in range(1, 7):
            for N in range(1, 5):
                if name == "2bw" and 1 < P and N < P:
                    continue
                tl = simulate(schedule, P, N, 2)
                assert (tl.tau_fwd, tl.tau_bkwd) == schedule.delays(P, N), (name, P, N)
                tf, tb = schedule.microbatch_delays(P, N)
                assert [list(r) for r in tl.tau_fwd_microbatch] == tf, (name, P, N)
                assert [list(r) for r in tl.tau_bkwd_microbatch] == tb, (name, P, N)
                assert tl.steady_state_utilization == pytest.approx(schedule.utilization(P, N), abs=1e-15)


def test_schedules_without_a_pipeline():
    custom = schedules.get("custom", tau_fwd=[2, 0], tau_bkwd=[1, 0])
    assert methods.build(custom, 2).delays == ([2, 0], [1, 0])
    for fact in (lambda: custom.utilization(2), lambda: custom.in_flight(2), lambda: custom.program(2, 1, 1)):
        with pytest.raises(ScheduleError):
            fact()
    with pytest.raises(ScheduleError, match="no timeline"):
        simulate(custom, 2, 1, 1)
    with pytest.raises(DelayError, match="one delay per stage"):
        custom.check(3)
    hogwild = schedules.get("hogwild")
    assert hogwild.utilization(4, 1) == 1.0 and hogwild.extra_versions(4) == [0] * 4
    with pytest.raises(ScheduleError, match="no fixed pipeline"):
        hogwild.in_flight(4)


def test_sync_has_two_flush_orders_with_one_delay_law():
    """GPipe and PipeDream-Flush: the same delays and utilization, different in-flight counts and programs."""
    gpipe, flush = schedules.Sync(), schedules.Sync(order="1f1b")
    P, N = 5, 3
    assert gpipe.delays(P, N) == flush.delays(P, N) == ([0] * P, [0] * P)
    assert gpipe.utilization(P, N) == flush.utilization(P, N) == N / (N + P - 1)
    assert gpipe.in_flight(P, N) == [3, 3, 3, 3, 3] and flush.in_flight(P, N) == [3, 3, 3, 2, 1]
    assert simulate(gpipe, P, N, 1).kind == "gpipe" and simulate(flush, P, N, 1).kind == "pipedream-flush"
    assert methods.resolve("pipedream-flush")[0].order == "1f1b" and methods.resolve("gpipe")[0].order == "gpipe"
    # a checkpoint's signature records repr(schedule): unchanged for both orders
    assert repr(gpipe) == repr(flush) == "Sync()"
    with pytest.raises(ScheduleError, match="order"):
        schedules.Sync(order="interleaved")


def test_2bw_rule_is_written_once():
    """Every entry point refuses N < P for 2BW with the schedule's own message (2BW paper §3.1, m >= d)."""
    with pytest.raises(ScheduleError) as rule:
        schedules.TwoBW().check(4, 2)
    message = str(rule.value)
    assert "m >= d" in message and "N=2 < P=4" in message
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    entries = [
        lambda: schedules.get("2bw").delays(4, 2),
        lambda: methods.build("pipedream-2bw", 4, 2),
        lambda: simulate("2bw", 4, 2, 1),
        lambda: hardware.in_flight_counts("pipedream-2bw", 4, 2),
        lambda: hardware.pipeline_utilization("pipedream-2bw", 4, 2),
        lambda: hardware.effective_delays("2bw", 4, 2),
        lambda: hardware.memory_report(model, "pipedream-2bw", 4, 2),
        lambda: RunConfig(method="pipedream-2bw", stages=4, microbatches=2),
        lambda: PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=4,
                                  schedule="pipedream-2bw", microbatches=2),
        lambda: advise(model, nn.functional.mse_loss, (x, y), "pipedream-2bw", stages=4, microbatches=2),
    ]
    for entry in entries:
        with pytest.raises(ScheduleError) as e:
            entry()
        assert str(e.value) == message
    assert methods.build("pipedream-2bw", 1, 1).delays == ([0], [0])   # one stage: no pipeline, no rule


def test_bad_counts_raise_config_errors_that_name_the_argument():
    for schedule in ("sync", "1f1b", "2bw", "dataflow", "pb", "hogwild"):
        with pytest.raises(ConfigError, match="stages = 0 must be an int >= 1"):
            schedules.get(schedule).check(0, 1)
        with pytest.raises(ConfigError, match="microbatches = 1.5 must be an int >= 1"):
            methods.build(schedule, 2, 1.5)
    with pytest.raises(ConfigError, match="minibatches = 0 must be an int >= 1"):
        simulate("1f1b", 2, 1, 0)


def test_core_modules_do_not_import_drawing_code():
    code = ("import sys, staleopt, staleopt.timeline, staleopt.hardware, staleopt.train, staleopt.config; "
            "print('matplotlib.pyplot' in sys.modules, 'staleopt.plot' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


def test_hogwild_means_are_one_positive_number_per_stage():
    """means=[] was taken for "not given" (the dataflow means drove the run while the repr said means=[]); a
    string mean was a raw ValueError."""
    with pytest.raises(ScheduleError, match="hogwild got 0 means for 3 stages"):
        schedules.get("hogwild", means=[]).check(3)
    for bad in (["x", 1], [True, 1], "12", 3):
        with pytest.raises(ScheduleError, match="hogwild means must be a list of finite numbers > 0"):
            schedules.get("hogwild", means=bad)
    assert schedules.get("hogwild", means=(m for m in (2, 1))).means == [2.0, 1.0]  # (any iterable, read once)
