"""The analytic hardware model against PipeMare Table 2, hand counts and the executed timelines (docs/design.md §5)."""
import math
import re
from fractions import Fraction

import pytest
import torch
import torchvision
from torch import nn

import staleopt
from staleopt import hardware, methods
from staleopt.cli import main
from staleopt.errors import ConfigError, ScheduleError
from staleopt.partition import partition_model
from staleopt.timeline import simulate

MIB = 2 ** 20


@pytest.fixture(scope="module")
def resnet50_cifar():
    """torchvision ResNet-50, 10 classes, 3x3 stride-1 stem without bias, no max-pool (PipeMare §4.1)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def own_units(model):
    """Bytes of each parametrized operator, in registration order (independent of staleopt.partition)."""
    out = []
    for module in model.modules():
        n = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False) if p.requires_grad)
        if n:
            out.append(n)
    return out


def own_stage_bytes(model, P):
    """Equal operator counts per stage, the first ``U mod P`` stages one more (PipeMare §4.1)."""
    units = own_units(model)
    q, r = divmod(len(units), P)
    out, start = [], 0
    for i in range(P):
        n = q + (i < r)
        out.append(sum(units[start:start + n]))
        start += n
    return out


# ------------------------------------------------------------------------ utilization

@pytest.mark.parametrize("P,N,percent", [(107, 8, 7.0), (107, 16, 13.1), (93, 19, 17.1)])
def test_gpipe_utilization_matches_pipemare_table_2(P, N, percent):
    assert round(100 * hardware.pipeline_utilization("gpipe", P, N), 1) == percent
    assert hardware.pipeline_utilization("pipedream-flush", P, N) == pytest.approx(N / (N + P - 1), abs=0)


def test_asynchronous_methods_are_fully_utilized():
    for name in ("1f1b", "pipedream", "pipemare", "pipemare-t1", "pipemare-stash", "pb",
                 "pipeoptim", "spectrain", "xpipe", "dataflow", "hogwild"):
        assert hardware.pipeline_utilization(name, 107, 8) == 1.0
    assert hardware.pipeline_utilization("pipedream-2bw", 107, 107) == 1.0
    with pytest.raises(ScheduleError, match="m >= d"):      # 2BW paper §3.1 needs N >= P
        hardware.pipeline_utilization("pipedream-2bw", 107, 8)


def kind_of(name):
    """The name of the timeline that executes ``name`` (ScheduleError when none does)."""
    pipeline = methods.build(name, 1)
    pipeline.program(1)
    return pipeline.timeline_name


def covered_methods():
    """Every method and schedule whose steady state both the hardware model and a timeline describe."""
    out = []
    for name in methods.names() + ["sync", "1f1b", "dataflow", "2bw", "pb"]:
        try:
            kind_of(name)
        except ScheduleError:
            continue
        out.append(name)
    return out


def test_hardware_utilization_equals_timeline_steady_state():
    names = covered_methods()
    assert {"gpipe", "pipedream-flush", "1f1b", "pipedream", "pipedream-2bw", "pipemare", "pb"} <= set(names)
    for name in names:
        for P in range(1, 7):
            for N in range(1, 5):
                if kind_of(name) == "2bw" and N < P:
                    continue
                # phased methods: the steady state of their pipelined phase (no warmup; all steps pipelined)
                phase = dict(total_steps=10, warmup_steps=0, pipelined_steps=10)
                expected = simulate(name, P, N, 1).steady_state_utilization
                assert hardware.pipeline_utilization(name, P, N, **phase) == pytest.approx(expected, abs=1e-15), \
                    (name, P, N)


def test_pipemare_w_amortized_over_warmup():
    """PipeMare §4: Util = (E_PM + E_Sync) / (E_PM / 1 + E_Sync / Util_Sync)."""
    P, N, warm, total = 107, 16, 30, 90
    u_sync = N / (N + P - 1)
    expected = (total - warm + warm) / ((total - warm) / 1 + warm / u_sync)
    got = hardware.pipeline_utilization("pipemare-w", P, N, total_steps=total, warmup_steps=warm)
    assert got == pytest.approx(expected, rel=1e-15)
    assert u_sync < got < 1
    # the method's own Warmup(steps) is the default warmup length
    warm_default = methods.resolve("pipemare-w")[1][0].steps
    assert hardware.pipeline_utilization("pipemare-w", P, N, total_steps=10 * warm_default) == pytest.approx(
        hardware.amortized_utilization([(warm_default, u_sync), (9 * warm_default, 1.0)]))
    with pytest.raises(ConfigError, match="total_steps"):
        hardware.pipeline_utilization("pipemare-w", P, N)


def test_hybrid_speedup_stale_weights_section_4():
    """n / (n_p / (2K+1) + (n - n_p)): 2K+1 when all pipelined, 1 when none, Amdahl bound n/(n - n_p)."""
    assert hardware.hybrid_speedup(100, 100, 4) == pytest.approx(7)
    assert hardware.hybrid_speedup(100, 0, 4) == 1
    assert hardware.hybrid_speedup(30_000, 20_000, 10 ** 7) == pytest.approx(3, rel=1e-6)
    P, n, n_p = 4, 40_000, 20_000
    u = hardware.pipeline_utilization("pb-hybrid", P, 1, total_steps=n, pipelined_steps=n_p)
    assert u * (2 * P - 1) == pytest.approx(hardware.hybrid_speedup(n, n_p, P))
    assert u == pytest.approx(hardware.amortized_utilization([(n_p, 1.0), (n - n_p, 1 / (2 * P - 1))]))
    with pytest.raises(ConfigError, match="positive and finite"):
        hardware.pipeline_utilization("pb-hybrid", P, 1, total_steps=0, pipelined_steps=0)
    with pytest.raises(ConfigError, match="positive and finite"):
        hardware.pipeline_utilization("pipemare-w", P, 1, total_steps=math.inf)


@pytest.mark.parametrize("P, N", [(3, 1), (3, 4), (4, 8)])
def test_the_hybrids_synchronous_phase_is_priced_as_its_timeline_runs_it(P, N):
    """With N microbatches the synchronous phase on 2P - 1 workers pipelines them, N / (N + 2P - 2), as the
    executed timeline shows (it was priced 1 / (2P - 1) whatever N: 0.2 against 0.5 at P = 3, N = 4)."""
    from staleopt.timeline import simulate
    steps = 40
    executed = simulate(methods.build("pb-hybrid", P, N, pipelined_steps=0), P, N, minibatches=steps).utilization
    assert hardware.pipeline_utilization("pb-hybrid", P, N, total_steps=steps, pipelined_steps=0) == \
        pytest.approx(executed)


def test_time_to_accuracy_divides_by_utilization():
    assert hardware.time_to_accuracy(1000, "gpipe", 107, 8) == pytest.approx(1000 * 114 / 8)
    assert hardware.time_to_accuracy(1000, "pipemare", 107, 8) == 1000


# ------------------------------------------------------------------------ weight memory

def test_gpipe_memory_of_cifar_resnet50_matches_table_2(resnet50_cifar):
    rep = hardware.memory_report(resnet50_cifar, "gpipe", 107, 8, optimizer="sgd-momentum")
    W = sum(own_units(resnet50_cifar))
    assert rep.weights_bytes == rep.gradients_bytes == rep.optimizer_bytes == W
    assert 269 * MIB <= rep.weight_optimizer_bytes <= 271 * MIB         # PipeMare Table 2: 1X (270MB)
    assert rep.ratio_to_gpipe == 1


@pytest.mark.parametrize("optimizer,extra", [("sgd-momentum", Fraction(1, 3)), ("adam", Fraction(1, 4))])
def test_t2_adds_one_weight_copy(resnet50_cifar, optimizer, extra):
    """PipeMare Table 2: PipeMare 1.33X (SGD momentum), 1.25X (Adam): T2's delta is one |W| buffer."""
    rep = hardware.memory_report(resnet50_cifar, "pipemare", 107, 8, optimizer=optimizer)
    gpipe = hardware.memory_report(resnet50_cifar, "gpipe", 107, 8, optimizer=optimizer)
    assert rep.t2_bytes == rep.weights_bytes
    assert Fraction(rep.weight_optimizer_bytes - gpipe.weight_optimizer_bytes, gpipe.weight_optimizer_bytes) == extra
    assert rep.ratio_to_gpipe == pytest.approx(float(1 + extra), abs=1e-15)


@pytest.mark.parametrize("method,P,N", [("pipedream", 107, 8), ("pipedream", 10, 1), ("pipemare-stash", 107, 8),
                                        ("pipemare-stash", 13, 3)])
def test_stash_bytes_are_sum_of_stage_bytes_times_delay(resnet50_cifar, method, P, N):
    """PipeMare App. A.1: Mem = sum_i |w_i| * tau_fwd_i, with the delays written out here."""
    w = own_stage_bytes(resnet50_cifar, P)
    if method == "pipedream":
        tau = [math.ceil((P - 1 - i) / N) for i in range(P)]
    else:
        tau = [math.ceil((2 * (P - 1 - i) + 1) / N) for i in range(P)]
    rep = hardware.memory_report(resnet50_cifar, method, P, N)
    assert list(rep.stage_weight_bytes) == w
    assert rep.stash_bytes == sum(a * b for a, b in zip(w, tau)) > 0
    assert rep.t2_bytes == rep.second_version_bytes == rep.prediction_bytes == 0


def test_weight_versions_agree_with_executed_timelines():
    """Extra weight copies of the memory model = versions a long executed run holds at once, minus 1."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)])
    P = 5
    w = [s.nbytes for s in partition_model(model, P)]
    for method, N in [("pipedream", 1), ("pipedream-2bw", 5), ("1f1b", 2), ("dataflow", 3), ("gpipe", 2)]:
        rep = hardware.memory_report(model, method, P, N)
        held = simulate(method, P, N, 6 * P).peak_versions
        extra = rep.stash_bytes + rep.second_version_bytes
        assert extra == sum(wi * (v - 1) for wi, v in zip(w, held)), method


def test_prediction_and_2bw_copies(resnet50_cifar):
    W = sum(own_units(resnet50_cifar))
    last = own_stage_bytes(resnet50_cifar, 107)[-1]
    assert hardware.memory_report(resnet50_cifar, "pipedream-2bw", 107, 107).second_version_bytes == W
    # PipeOptim Table I: [M, 2M] — the last 1F1B stage has no version gap, so it keeps no prediction
    assert hardware.memory_report(resnet50_cifar, "pipeoptim", 107, 8).prediction_bytes == W - last
    # XPipe with SGD momentum keeps its own Adam moments (2 slots) besides the predicted copy
    assert hardware.memory_report(resnet50_cifar, "xpipe", 107, 8).prediction_bytes == 3 * (W - last)
    assert hardware.memory_report(resnet50_cifar, "spectrain", 107, 8).prediction_bytes == W - last


# ------------------------------------------------------------------------ activations

def test_in_flight_counts_match_executed_timelines():
    for name in covered_methods():
        for P, N in [(1, 1), (3, 2), (5, 1), (4, 4), (6, 3)]:
            if kind_of(name) == "2bw" and N < P:
                continue
            steady = methods.build(name, P, N).without_phases()        # phased methods: the pipelined phase
            expected = simulate(steady, P, N, 6 * P).peak_in_flight
            assert hardware.in_flight_counts(name, P, N) == expected, (name, P, N)


def test_pipelined_backprop_last_stage_holds_the_microbatch_it_runs():
    """pb's last stage runs a microbatch's forward and backward in one cycle (stale-weights §3): it holds that
    microbatch's activations while it runs (counted 0 at slot ends before); with one stage, plain training's one."""
    for P in (1, 2, 4):
        assert simulate(methods.build("pb", P, 1), P, 1, 6 * P).peak_in_flight == \
            hardware.in_flight_counts("pb", P) == [max(2 * (P - 1 - i), 1) for i in range(P)]
    model, x = uniform_model(1), torch.zeros(2, 4)
    pb, gpipe = (hardware.memory_report(model, m, 1, microbatch_size=2, example_input=x) for m in ("pb", "gpipe"))
    assert pb.activation_bytes == gpipe.activation_bytes > 0


def uniform_model(P, d=4):
    return nn.Sequential(*[nn.Linear(d, d) for _ in range(P)])


def test_activation_sizes_are_operator_inputs():
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 5), nn.Linear(5, 2))
    part = partition_model(model, 2)                       # [Linear(6,4), Linear(4,5)], [Linear(5,2)]
    sizes = hardware.activation_sizes(model, part, torch.zeros(2, 6), microbatch_size=8)
    assert sizes == [((6 + 4) * 8 * 4, 6 * 8 * 4), (5 * 8 * 4, 5 * 8 * 4)]   # float32 bytes


def test_activation_memory_table_4_without_recompute():
    """PipeMare App. A.2 with P = L and equal operators: GPipe M N P (eq. 7), PipeMare M P^2 (eq. 6, 8)."""
    P, N, mb = 12, 5, 3
    model = uniform_model(P)
    M = 4 * mb * 4                                        # one operator's input: d=4 floats x mb samples
    x = torch.zeros(1, 4)
    gp = hardware.memory_report(model, "gpipe", P, N, microbatch_size=mb, example_input=x)
    pm = hardware.memory_report(model, "pipemare", P, N, microbatch_size=mb, example_input=x)
    assert gp.activation_bytes == M * N * P
    assert pm.activation_bytes == M * P ** 2


def test_activation_memory_with_recompute_hand_count():
    """Segments of S=2 over dataflow counts c = [7, 5, 3, 1]: (7 + 3 + 1) M + (3 + 3 + 1) M = 18 M."""
    sizes = [(10, 10)] * 4
    plain, rec, S = hardware.activation_memory(sizes, [7, 5, 3, 1], segment=2)
    assert (plain, rec, S) == (160, 180, 2)
    # GPipe-style, S=1: each stage keeps its input for N microbatches and one recompute (M (N P + L))
    plain, rec, _ = hardware.activation_memory(sizes, [4] * 4, segment=1)
    assert rec == 4 * 10 * 4 + 4 * 10


@pytest.mark.parametrize("P", [64, 256])
def test_recompute_scaling_table_4(P):
    """Table 4 with recompute: PipeMare M P^{3/2} at S ~ sqrt(P); GPipe M P N^{1/2} at S ~ sqrt(N)."""
    sizes = [(1, 1)] * P
    plain, rec, S = hardware.activation_memory(sizes, [2 * (P - 1 - i) + 1 for i in range(P)])
    assert plain == P ** 2
    assert 1.5 * P ** 1.5 <= rec <= 2.5 * P ** 1.5 and abs(S - math.sqrt(P)) <= 2
    N = 64
    plain, rec, S = hardware.activation_memory(sizes, [N] * P)
    assert plain == N * P
    assert 1.5 * P * math.sqrt(N) <= rec <= 2.5 * P * math.sqrt(N) and abs(S - math.sqrt(N)) <= 2


def test_errors():
    model = uniform_model(3)
    with pytest.raises(ConfigError, match="optimizer"):
        hardware.memory_report(model, "gpipe", 3, 1, optimizer="rmsprop")
    with pytest.raises(ConfigError, match="both"):
        hardware.memory_report(model, "gpipe", 3, 1, microbatch_size=4)
    with pytest.raises(ConfigError, match="stages"):
        hardware.pipeline_utilization("gpipe", 0, 1)
    with pytest.raises(ScheduleError, match="custom"):
        hardware.pipeline_utilization(__import__("staleopt").schedules.get("custom", tau_fwd=[1, 0]), 2, 1)


# ------------------------------------------------------------------------ CLI

def test_cli_hardware_table_and_sweep(tmp_path, capsys):
    assert main(["hardware", "--model", "mlp", "--compare", "gpipe,pipedream,pipemare", "--stages", "3",
                 "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "| utilization" in out and "50.0%" in out and "100.0%" in out and "1.333x" in out
    assert [c.strip() for c in out.splitlines()[1].split("|")[2:5]] == ["gpipe", "pipedream", "pipemare"]
    assert main(["hardware", "--model", "mlp", "--compare", "gpipe,pipemare", "--stages", "1,2,3",
                 "--microbatches", "2", "--microbatch-size", "4", "--out", str(tmp_path)]) == 0
    import csv
    rows = list(csv.DictReader(open(tmp_path / "hardware.csv")))
    assert [(r["method"], int(r["stages"])) for r in rows] == [("gpipe", 1), ("pipemare", 1), ("gpipe", 2),
                                                               ("pipemare", 2), ("gpipe", 3), ("pipemare", 3)]
    assert float(rows[4]["utilization"]) == pytest.approx(0.5)
    assert int(rows[5]["activation_bytes"]) > 0
    assert (tmp_path / "hardware.png").stat().st_size > 0
    sweep = [[c.strip() for c in line.split("|")[1:4]] for line in capsys.readouterr().out.splitlines()[3:9]]
    assert sweep[-1] == ["pipemare", "3", "100.0%"] and sweep[-2] == ["gpipe", "3", "50.0%"]


def test_cli_timeline(tmp_path, capsys):
    assert main(["timeline", "--method", "1f1b", "--stages", "4", "--microbatches", "4", "--minibatches", "3",
                 "--out", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(simulate("1f1b", 4, 4, 3).ascii())
    assert "tau_fwd  = [1, 1, 1, 0]" in out and "steady state 1.0000" in out
    assert (tmp_path / "t.png").stat().st_size > 0


def test_total_memory_with_activations_reverses_the_weights_only_order():
    """PipeMare keeps fewer weight copies than PipeDream but more activations in flight (its dataflow delays):
    the total, relative to GPipe's total at the same microbatch size, says so; the weights-only ratio does not."""
    from staleopt import models
    model = models.get("resnet1d", seed=0)
    x = torch.zeros(2, 1, 40)
    rep = {m: hardware.memory_report(model, m, 39, 8, microbatch_size=8, example_input=x)
           for m in ("gpipe", "pipedream", "pipemare")}
    assert rep["pipemare"].ratio_to_gpipe < rep["pipedream"].ratio_to_gpipe
    assert rep["pipemare"].total_ratio_to_gpipe > 1.5 * rep["pipedream"].total_ratio_to_gpipe
    assert rep["gpipe"].total_ratio_to_gpipe == 1.0 and rep["gpipe"].gpipe_total_bytes == rep["gpipe"].total_bytes
    assert hardware.memory_report(model, "pipemare", 39, 8).total_ratio_to_gpipe is None  # no activations given


def test_command_line_output_and_argument_mistakes_are_one_line_errors(tmp_path, capsys):
    """Each was a traceback (FileExistsError, NotADirectoryError, matplotlib's ValueError after the diagram was
    printed, ZeroDivisionError) or silently dropped --method."""
    from staleopt.cli import main
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["hardware", "--model", "mlp", "--method", "pipemare", "--compare", "gpipe", "--stages", "2"], "not both"),
        (["hardware", "--model", "mlp", "--compare", ",", "--stages", "2"], "--compare names no method"),
        (["hardware", "--model", "mlp", "--compare", "gpipe,gpipe", "--stages", "2"], "more than once \\(gpipe, gpipe"),
        (["hardware", "--model", "mlp", "--compare", "pipedream-flush,1f1b-flush", "--stages", "2"],
         "more than once \\(pipedream-flush, 1f1b-flush"),  # (an alias: the same column twice)
        (["hardware", "--model", "mlp", "--compare", "gpipe,sync", "--stages", "2"],  # (the schedule gpipe runs)
         "more than once \\(gpipe, sync"),
        (["hardware", "--model", "mlp", "--method", "pipemare-w", "--stages", "2", "--total-steps", "90"],
         "default warmup of 1000 steps is longer than total_steps = 90: pass warmup_steps"),
        (["hardware", "--model", "mlp", "--compare", "gpipe,pipemare", "--stages", "2", "--total-steps", "100"],
         "--total-steps would change nothing"),
        (["hardware", "--model", "mlp", "--method", " ", "--stages", "2"], "--method: empty"),
        (["hardware", "--model", "mlp", "--method", "pipemare", "--stages", "2", "--out", str(a_file)], "is a file"),
        (["hardware", "--model", "mlp", "--method", "pb-hybrid", "--stages", "2", "--total-steps", "0",
          "--pipelined-steps", "0"], "positive and finite"),
        (["timeline", "--method", "dataflow", "--out", str(a_file / "x.png")], "does not exist"),
        (["timeline", "--method", "dataflow", "--out", str(tmp_path / "x.unknownext")], "suffix names the image"),
        (["timeline", "--method", "custom"], "tau_fwd=\\[...\\]"),
        (["theory", "--out", str(a_file)], "is a file"),
        (["theory", "--out", str(tmp_path / "th"), "--dpi", "0"], "--dpi = 0"),
        (["theory", "--out", str(tmp_path / "th"), "--dpi", "100000"], "--dpi = 100000"),  # (was a MemoryError)
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err) and "Traceback" not in err, (argv, err)


def test_an_unknown_method_is_named_before_the_default_stage_count_is_priced(capsys):
    """A misspelt --method or --compare name on a small model (--stages left at its default, 107) was reported as
    "stages=107 is out of range", a value the user never gave; now the name is the error, with the known names,
    and the default stage count, where it is the error, is named as --stages' default."""
    from staleopt.cli import main
    for flag, names in (("--method", "pipemrae"), ("--compare", "gpipe,pipemrae")):
        assert main(["hardware", "--model", "mlp", flag, names]) == 2
        err = capsys.readouterr().err
        assert f"{flag}: unknown schedule or method 'pipemrae'" in err and "pipemare" in err and "107" not in err
    assert main(["hardware", "--model", "mlp", "--method", "pipemare"]) == 2
    err = capsys.readouterr().err
    assert "--stages defaults to 107" in err and "has 3: pass --stages P with 1 <= P <= 3" in err
    assert main(["hardware", "--model", "mlp", "--method", "pipemare", "--stages", "5"]) == 2
    assert "stages=5 is out of range" in capsys.readouterr().err
    assert main(["hardware", "--model", "mlp", "--method", "pipemare", "--stages", "3"]) == 0


def test_a_repeated_stage_count_is_refused(tmp_path, capsys):
    """--stages 2,2,3 priced P = 2 twice (two identical rows in the table and hardware.csv); sweep files and
    compare refuse a repeated value."""
    from staleopt.cli import main
    out = tmp_path / "hw"
    assert main(["hardware", "--model", "mlp", "--method", "pipemare", "--stages", "2,2,3", "--out", str(out)]) == 2
    assert "--stages 2,2,3: 2 is already in the list; give each value once" in capsys.readouterr().err
    assert not (out / "hardware.csv").exists()
    assert main(["hardware", "--model", "mlp", "--method", "pipemare", "--stages", "2,3", "--out", str(out)]) == 0


def test_time_to_accuracy_cuts_a_default_phase_at_the_run():
    """A run shorter than the method's default warmup (1000 steps) was refused with an error about that default;
    now as speedup.pipeline_time: the warmup covers the whole run."""
    from staleopt import speedup
    for method in ("pipemare-w", "pb-hybrid"):
        assert hardware.time_to_accuracy(100, method, 4, 1) == speedup.pipeline_time(100, method, 4, 1)
    assert hardware.time_to_accuracy(100, "pipemare-w", 4, 1) == pytest.approx(100 * 4)  # all synchronous, N = 1


@pytest.mark.parametrize("method, accumulator", [("pipemare-recompute", "causal"), ("pipemare-recompute", "current"),
                                                 ("pipemare", "causal")])
def test_t2_bytes_are_the_engines_accumulator_rows(method, accumulator):
    """The hardware model prices T2 as the engine keeps it: ``M_i`` accumulator rows per corrected stage (the
    causal accumulator reads ``delta_{t - tau_recomp}``; docs/engine.md), not one (3x too low for
    pipemare-recompute at P = 9)."""
    import staleopt
    from staleopt.corrections import DiscrepancyCorrection

    P = 9
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(P)])
    schedule, corrections = methods.resolve(method)
    for c in corrections:
        if isinstance(c, DiscrepancyCorrection):
            c.accumulator = accumulator
    pipeline = methods.Pipeline(method, schedule, corrections, P, 1)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=P, schedule=schedule,
                                     corrections=corrections)
    t2 = next(c for c in opt.corrections if isinstance(c, DiscrepancyCorrection))
    ring = sum(r.numel() * r.element_size() for _, r, _ in t2._ring.values())
    assert hardware.memory_report(model, pipeline, P, 1, optimizer="sgd").t2_bytes == ring
    if method == "pipemare-recompute" and accumulator == "causal":
        assert ring == 27 * (8 * 8 + 8) * 4


def test_impossible_numbers_are_refused():
    """Public helpers refuse what no run has instead of returning a number (or a bare ZeroDivisionError)."""
    from staleopt import schedules
    with pytest.raises(ConfigError, match="stages"):
        hardware.hybrid_speedup(100, 50, stages=0)
    with pytest.raises(ConfigError, match="stages"):
        hardware.hybrid_speedup(100, 50, stages=-3)
    with pytest.raises(ConfigError, match="steps_to_target"):
        hardware.time_to_accuracy(-100, "gpipe", 4, 2)
    assert hardware.time_to_accuracy(0, "pipemare-w", 4, 1) == 0.0
    for phases in ([(10, -0.5), (10, 1.0)], [(10, 0.0)], [(-5, 1.0), (10, 1.0)], [(math.nan, 1.0)]):
        with pytest.raises(ConfigError, match="length, utilization"):
            hardware.amortized_utilization(phases)
    with pytest.raises(ConfigError, match="total_steps"):
        hardware.pipeline_utilization("pipemare-w", 4, 1, total_steps=-10, warmup_steps=0)
    for bad in (dict(tau_max=0, means=[3.0, 3.0]), dict(means=[math.nan, 1.0]), dict(means=[math.inf, 1.0])):
        with pytest.raises(ScheduleError, match="hogwild means"):
            schedules.get("hogwild", **bad).check(2)


def test_hardware_command_refuses_a_class_count_below_one(capsys):
    """--num-classes 0 priced a model with an empty output layer, -1 crashed in torch: a typed error."""
    for bad in ("0", "-1"):
        assert main(["hardware", "--model", "mlp", "--method", "pipemare", "--num-classes", bad]) == 2
        assert "--num-classes = " + bad + " must be an int >= 1" in capsys.readouterr().err


def test_stashing_on_2bw_stores_nothing_more_and_on_1f1b_its_delays():
    """2BW's double buffer already gives each backward its forward's version: Stashing() added to it changes no
    read and stores nothing (it was priced at tau_fwd |w| more, twice what the engine and the timeline keep);
    on 1F1B (pipedream) stashing stores tau_fwd_i versions (PipeMare App. A.1)."""
    from staleopt.corrections import Stashing
    from staleopt.timeline import Timeline
    P, N = 3, 3
    model = uniform_model(P)
    w = sum(p.numel() * p.element_size() for p in model.parameters())
    schedule, corrections = methods.resolve("pipedream-2bw")
    both = methods.Pipeline("2bw+stash", schedule, [*corrections, Stashing()], P, N)
    plain = methods.build("pipedream-2bw", P, N)
    assert both.extra_versions() == plain.extra_versions() == [v - 1 for v in Timeline(both, 20).peak_versions]
    rep = hardware.memory_report(model, both, P, N, optimizer="sgd")
    assert rep.stash_bytes == 0 and rep.second_version_bytes == w
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=P, microbatches=N,
                                     schedule="pipedream-2bw", corrections=[Stashing()])
    assert opt.memory_bytes() == w
    pipedream = methods.build("pipedream", P, N)
    assert pipedream.extra_versions() == pipedream.delays[0] and max(pipedream.delays[0]) > 0


def test_a_phase_length_for_a_method_without_that_phase_is_refused():
    """warmup_steps for a method without a synchronous warmup (pipelined_steps without a hybrid phase) changed
    nothing, silently (pipemare read 100% with --warmup-steps 30): refused; in a comparison it goes to the
    methods that have the phase."""
    with pytest.raises(ConfigError, match="warmup_steps = 30 would change nothing: pipemare has no synchronous "
                                          "warmup"):
        methods.build("pipemare", 4, 1).utilization(90, warmup_steps=30)
    with pytest.raises(ConfigError, match="pipelined_steps = 10 would change nothing: gpipe has no hybrid phase"):
        hardware.pipeline_utilization("gpipe", 4, 1, 90, pipelined_steps=10)
    assert main(["hardware", "--model", "mlp", "--stages", "3", "--method", "pipemare", "--total-steps", "90",
                 "--warmup-steps", "30"]) == 2
    assert main(["hardware", "--model", "mlp", "--stages", "3", "--compare", "gpipe,pipemare-w", "--total-steps",
                 "100", "--warmup-steps", "30"]) == 0


class HeadFirst(nn.Module):
    """Registers its classifier before the body it runs after (the tutorial's case for unit_order="execution")."""

    def __init__(self, num_classes, input_shape, width=32):
        super().__init__()
        self.head = nn.Linear(width, num_classes)
        self.body = nn.Linear(math.prod(input_shape), width)

    def forward(self, x):
        return self.head(torch.relu(self.body(x.flatten(1))))


def test_run_memory_splits_the_stages_as_the_run_did():
    """run_memory rebuilt every run's stages in registration order, so with unit_order="execution" the report's
    memory (figures, LessMemory(total=True), compare's memory.csv) priced a split the run did not use."""
    import pandas as pd
    from staleopt import data as datasets
    staleopt.register_model("head_first_memory", HeadFirst)
    d = datasets.load("synthetic")
    rows = [{"run": f"{m}-{order}", "method": m, "stages": 2, "microbatches": 1, "batch_size": 8, "optimizer": "sgd",
             "partition": "ops", "model": "head_first_memory", "model_kwargs": "{}", "data": "synthetic",
             "data_kwargs": "{}", "unit_order": order, "seed": 0, "epoch": 1, "test_acc": 0.5}
            for m in ("gpipe", "pipedream") for order in ("registration", "execution")]
    got = hardware.run_memory(pd.DataFrame(rows)).set_index(["method", "unit_order"])["memory_ratio_gpipe"]
    model = HeadFirst(d.num_classes, d.input_shape)
    x = torch.stack([d.train[i][0] for i in range(2)])
    for order, example in (("registration", None), ("execution", x)):
        split = staleopt.partition_model(model, 2, example_input=example)
        assert got.loc[("pipedream", order)] == hardware.memory_report(model, "pipedream", 2, optimizer="sgd",
                                                                        partition=split).ratio_to_gpipe
    assert got.loc[("pipedream", "execution")] != got.loc[("pipedream", "registration")]


def test_run_memory_prices_hogwild_without_activations_and_keeps_the_others_totals():
    """hogwild has no fixed pipeline (no activation count): run_memory raised ScheduleError, so compare and demo
    --sweep lost their whole report after training and staleopt plot dropped every method's total-memory panel."""
    import pandas as pd
    rows = [{"run": f"{m}-{P}", "method": m, "stages": P, "microbatches": 4, "batch_size": 8, "optimizer": "sgd",
             "partition": "ops", "model": "mlp", "model_kwargs": "{}", "data": "synthetic", "data_kwargs": "{}",
             "seed": 0, "epoch": 1, "test_acc": 0.5} for m in ("gpipe", "hogwild-t1") for P in (1, 3)]
    got = hardware.run_memory(pd.DataFrame(rows)).set_index(["method", "stages"])
    model = staleopt.models.get("mlp", seed=0)
    assert got.loc[("hogwild-t1", 3), "memory_ratio_gpipe"] == hardware.memory_report(
        model, "hogwild-t1", 3, 4, optimizer="sgd").ratio_to_gpipe
    assert got.loc["hogwild-t1", "total_ratio_gpipe"].isna().all()
    assert got.loc["gpipe", "total_ratio_gpipe"].notna().all()


def test_hardware_builds_a_users_model_from_data_and_says_so_without(tmp_path, capsys):
    """A model of the user's (file.py:function) needs num_classes and input_shape, which the command had no way
    to give: a bare TypeError (or, with defaults and --microbatch-size, an IndexError on a (1,)-shaped input)."""
    path = tmp_path / "mine.py"
    path.write_text("from torch import nn\nimport math\n\n"
                    "def net(num_classes, input_shape):\n"
                    "    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 8), nn.ReLU(),\n"
                    "                         nn.Linear(8, num_classes))\n\n"
                    "def net_defaults(num_classes=3, input_shape=(5,)):\n"
                    "    return net(num_classes, input_shape)\n")
    common = ["hardware", "--compare", "gpipe,pipemare", "--stages", "2", "--microbatch-size", "4"]
    for model in (f"{path}:net", f"{path}:net_defaults"):
        assert main([*common, "--model", model]) == 2
        assert "pass --data NAME" in capsys.readouterr().err
        assert main([*common, "--model", model, "--data", "synthetic"]) == 0
        assert "pipemare" in capsys.readouterr().out
    assert main(["hardware", "--compare", "gpipe,pipemare", "--stages", "2", "--model", "mlp", "--data",
                 "synthetic", "--microbatch-size", "4"]) == 0


def test_the_hardware_model_prices_what_each_method_keeps():
    """A read-only review's findings, each against the engine or the method's own numbers: pipemare-recompute's
    total held the activations it recomputes (priced above plain pipemare's); vertical sync's last stage stores
    tau_0 versions (left out); xpipe over AdamW reads AdamW's moments (priced 3x); sizes of another partition gave
    a silently wrong activation total or a raw IndexError."""
    from staleopt import models
    from staleopt.errors import ConfigError
    resnet, x = models.get("resnet20"), torch.zeros(1, 3, 32, 32)
    rc = hardware.memory_report(resnet, "pipemare-recompute", 16, 2, microbatch_size=8, example_input=x)
    pm = hardware.memory_report(resnet, "pipemare", 16, 2, microbatch_size=8, example_input=x)
    assert rc.recomputes and not pm.recomputes
    assert rc.total_bytes == rc.weight_optimizer_bytes + rc.activation_recompute_bytes < pm.total_bytes
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                        nn.Linear(8, 3))
    for N in (1, 4):
        opt = staleopt.PipelineOptimizer(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), stages=4,
                                         schedule="pipedream-vs", microbatches=N)
        rep = hardware.memory_report(mlp, "pipedream-vs", 4, N)
        assert rep.stash_bytes == opt.history_bytes(), N
        opt.remove_hooks()
    for optimizer in ("adam", "adamw"):
        base = (torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW)(mlp.parameters(), lr=1e-3)
        opt = staleopt.PipelineOptimizer(mlp, base, stages=4, schedule="xpipe")
        mlp(torch.randn(2, 6)).sum().backward()
        opt.step()
        kept = sum(c.extra_bytes() for c in opt.corrections)
        assert hardware.memory_report(mlp, "xpipe", 4, 1, optimizer=optimizer).prediction_bytes == kept, optimizer
        opt.remove_hooks()
    sizes = hardware.activation_sizes(mlp, staleopt.partition_model(mlp, 2), torch.randn(2, 6), 2)
    with pytest.raises(ConfigError, match="sizes has 2 entries.*4 stages"):
        hardware.memory_report(mlp, "pipemare", 4, 1, microbatch_size=2, sizes=sizes)


def test_activation_memory_takes_one_count_per_stage():
    """A list shorter than sizes was cut short by zip (2 stages, 1 cached count: 25 bytes, stage 1 left out);
    negative counts gave negative bytes; empty or short lists were raw IndexError / ValueError."""
    sizes = [(10, 5), (10, 5)]
    assert hardware.recompute_activation_memory(sizes, [1, 2], [3, 0]) == 10 + 15 + 20
    for call, says in ((lambda: hardware.recompute_activation_memory(sizes, [1, 2], [3]), "cached must hold one "
                        "count per stage \\(2"),
                       (lambda: hardware.activation_memory(sizes, [-1, 2]), r"counts\[0\] = -1 must be an int >= 0"),
                       (lambda: hardware.activation_memory(sizes, [1]), "counts must hold one count per stage"),
                       (lambda: hardware.activation_memory([], []), "sizes must be a non-empty list"),
                       (lambda: hardware.activation_memory([(10, 5, 1)], [1]), r"sizes\[0\] = .* must be a pair")):
        with pytest.raises(ConfigError, match=says):
            call()


def test_phase_lengths_are_numbers_and_named():
    """A misspelled phase argument, a string length and a bool (taken as 1) were raw TypeErrors or accepted."""
    with pytest.raises(ConfigError, match=r"unknown phase argument\(s\) \['warmup_step'\]"):
        hardware.time_to_accuracy(100, "pipemare-w", 4, 1, warmup_step=30)
    for kwargs, name in (({"total_steps": "90", "warmup_steps": 30}, "total_steps"),
                         ({"total_steps": 10, "warmup_steps": True}, "warmup_steps"),
                         ({"total_steps": True, "warmup_steps": 0.5}, "total_steps")):
        with pytest.raises(ConfigError, match=f"{name} must be a number of optimizer steps"):
            hardware.pipeline_utilization("pipemare-w", 4, 1, **kwargs)
    with pytest.raises(ConfigError, match="total_steps must be a number"):
        hardware.hybrid_speedup("10", 5, 4)
    assert hardware.pipeline_utilization("pipemare-w", 4, 1, total_steps=90, warmup_steps=30) == \
        hardware.pipeline_utilization("pipemare-w", 4, 1, total_steps=90.0, warmup_steps=30.0)
