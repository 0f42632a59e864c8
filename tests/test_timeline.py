"""The executed schedules reproduce the closed-form delays of staleopt.schedules (docs/design.md §2, §4)."""
import math
import re

import pytest

from staleopt import schedules
from staleopt.errors import ConfigError, ScheduleError
from staleopt.plot import plot_timeline
from staleopt.timeline import simulate

PS, NS = range(1, 9), range(1, 5)

# timeline -> (schedule in schedules.py, stashing)
COVERED = {"gpipe": ("sync", False), "pipedream-flush": ("sync", False), "1f1b": ("1f1b", False),
           "pipedream": ("1f1b", True), "dataflow": ("dataflow", False), "pipemare-stash": ("dataflow", True),
           "pb": ("pb", False), "2bw": ("2bw", False)}


def exact_fwd(kind, P, N, i, j):
    """Hand-derived delay of the forward of microbatch j (0-based in its minibatch) at stage i.

    A pass at stage i whose forward and backward are D slots apart, with one
    microbatch entering per slot, reads w_{t - ceil((D - j)/N)}:
    1F1B D = P-1-i (in F/B pairs), dataflow D = 2(P-1-i)+1, pipelined backprop D = 2(P-1-i).
    """
    D = {"1f1b": P - 1 - i, "pipedream": P - 1 - i, "dataflow": 2 * (P - 1 - i) + 1,
         "pipemare-stash": 2 * (P - 1 - i) + 1, "pb": 2 * (P - 1 - i)}.get(kind)
    if D is None:                       # synchronous: 0; 2BW: w_{t-1} for every microbatch
        return {"gpipe": 0, "pipedream-flush": 0, "2bw": 0 if P == 1 else 1}[kind]
    return max(0, math.ceil((D - j) / N))


def cases():
    for kind in COVERED:
        for P in PS:
            for N in NS:
                if kind == "2bw" and P > 1 and N < P:
                    continue                       # 2BW requires N >= P (test below)
                yield kind, P, N


@pytest.mark.parametrize("kind", list(COVERED))
def test_per_microbatch_delays_match_hand_derivation(kind):
    for k, P, N in cases():
        if k != kind:
            continue
        tl = simulate(kind, P, N, minibatches=2)
        stash = COVERED[kind][1] or kind == "2bw"
        for i in range(P):
            fwd = [exact_fwd(kind, P, N, i, j) for j in range(N)]
            assert list(tl.tau_fwd_microbatch[i]) == fwd, (kind, P, N, i)
            assert list(tl.tau_bkwd_microbatch[i]) == (fwd if stash else [0] * N), (kind, P, N, i)


@pytest.mark.parametrize("kind", list(COVERED))
def test_delays_equal_closed_forms(kind):
    """``tau_fwd`` (the oldest read of a minibatch, its first microbatch) equals schedules.py.

    The closed forms give one delay per stage; where microbatches of one
    minibatch read different versions (1F1B and dataflow with N > 1) they are
    exact for the first microbatch and an upper bound for the rest — checked
    exactly per microbatch above, and flagged by ``Timeline.uniform``.
    """
    sched_name, stash = COVERED[kind]
    for k, P, N in cases():
        if k != kind:
            continue
        tl = simulate(kind, P, N, minibatches=2)
        fwd, bwd = schedules.get(sched_name).delays(P, N)
        assert tl.tau_fwd == fwd, (kind, P, N)
        assert tl.tau_bkwd == (fwd if stash else bwd), (kind, P, N)
        varies = any(exact_fwd(kind, P, N, i, 0) != exact_fwd(kind, P, N, i, N - 1) for i in range(P))
        assert tl.uniform == (not varies), (kind, P, N)


def test_pb_closed_form_counts_minibatches():
    """With N microbatches per minibatch, pipelined backprop's delay is ceil(2(P-1-i)/N) minibatch steps."""
    tl = simulate("pb", 4, 2, minibatches=2)
    assert tl.tau_fwd == [3, 2, 1, 0]
    assert tl.tau_fwd == schedules.get("pb").delays(4, 2)[0]


def test_reads_before_the_first_update_are_w0():
    """Every event reads ``w_{max(0, t - tau_j)}`` (docs/design.md §1: ``t - tau < 0`` means ``w_0``), from the start."""
    for kind in COVERED:
        for P, N in [(3, 1), (4, 2), (5, 3)]:
            if kind == "2bw" and N < P:
                N = P
            tl = simulate(kind, P, N, minibatches=12)
            for e in tl.events:
                table = tl.tau_fwd_microbatch if e.kind == "F" else tl.tau_bkwd_microbatch
                assert e.version == max(0, e.minibatch - table[e.stage][e.microbatch % N]), (kind, e)


def test_steady_state_utilization():
    for P in PS:
        for N in NS:
            for kind in ("gpipe", "pipedream-flush"):
                assert simulate(kind, P, N, 1).steady_state_utilization == pytest.approx(N / (N + P - 1), abs=1e-15)
            for kind in ("1f1b", "pipedream", "dataflow", "pb"):
                assert simulate(kind, P, N, 1).steady_state_utilization == 1.0
    tl = simulate("gpipe", 4, 2, 3)                  # finite runs equal steady state for flushed schedules
    assert tl.utilization == pytest.approx(0.4)
    tl = simulate("1f1b", 4, 1, 4)                   # 32 passes on 4 stages in 14 slots (fill and drain)
    assert tl.slots == 14 and tl.utilization == pytest.approx(32 / 56)


def test_peak_in_flight_and_versions():
    P, N = 5, 2
    long = 6 * P
    assert simulate("gpipe", P, N, long).peak_in_flight == [N] * P
    assert simulate("pipedream-flush", P, N, long).peak_in_flight == [min(P - i, N) for i in range(P)]
    assert simulate("1f1b", P, N, long).peak_in_flight == [P - i for i in range(P)]
    # PipeMare App. A.2: stage i of the dataflow pipeline caches 2(P-1-i)+1 activations
    assert simulate("dataflow", P, N, long).peak_in_flight == [2 * (P - 1 - i) + 1 for i in range(P)]
    # stale-weights §3: 2(P-1-i) cycles; the last stage holds the microbatch whose F and B share its cycle
    assert simulate("pb", P, N, long).peak_in_flight == [2 * (P - 1 - i) for i in range(P - 1)] + [1]
    # versions held: PipeDream stashes tau_fwd extra versions (PipeMare App. A.1); 2BW at most 2; others 1
    pd = simulate("pipedream", P, 1, long)
    assert [v - 1 for v in pd.peak_versions] == pd.tau_fwd == [P - 1 - i for i in range(P)]
    assert simulate("2bw", P, P, long).peak_versions == [2] * P
    assert simulate("1f1b", P, N, long).peak_versions == [1] * P
    assert simulate("dataflow", P, N, long).peak_versions == [1] * P


GPIPE_4 = """\
slot       0   1   2   3   4   5   6   7   8   9  10  11  12  13
stage 0   F0  F1  F2  F3   .   .   .   .   .   .  B3  B2  B1  B0
stage 1    .  F0  F1  F2  F3   .   .   .   .  B3  B2  B1  B0   .
stage 2    .   .  F0  F1  F2  F3   .   .  B3  B2  B1  B0   .   .
stage 3    .   .   .  F0  F1  F2  F3  B3  B2  B1  B0   .   .   ."""

ONE_F_ONE_B_4 = """\
slot        0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15   16   17   18   19   20   21   22   23   24   25   26   27   28   29
stage 0    F0   F1   F2   F3    .    .    .   B0   F4   B1   F5   B2   F6   B3   F7   B4   F8   B5   F9   B6  F10   B7  F11   B8    .   B9    .  B10    .  B11
stage 1     .   F0   F1   F2    .    .   B0   F3   B1   F4   B2   F5   B3   F6   B4   F7   B5   F8   B6   F9   B7  F10   B8  F11   B9    .  B10    .  B11    .
stage 2     .    .   F0   F1    .   B0   F2   B1   F3   B2   F4   B3   F5   B4   F6   B5   F7   B6   F8   B7   F9   B8  F10   B9  F11  B10    .  B11    .    .
stage 3     .    .    .   F0   B0   F1   B1   F2   B2   F3   B3   F4   B4   F5   B5   F6   B6   F7   B7   F8   B8   F9   B9  F10  B10  F11  B11    .    .    ."""


def test_ascii_gpipe_and_1f1b():
    assert simulate("gpipe", 4, 4, 1).ascii() == GPIPE_4
    assert simulate("1f1b", 4, 4, 3).ascii() == ONE_F_ONE_B_4


def test_ascii_versions():
    # PipeDream, P=2: stage 0's forward of microbatch 2 reads w_1 (tau_fwd = 1) and its backward
    # the stashed w_1, while the backward of microbatch 1 still reads the stashed w_0.
    assert simulate("pipedream", 2, 1, 3).ascii(versions=True) == """\
slot         0     1     2     3     4     5     6     7
stage 0   F0@0  F1@0     .  B0@0  F2@1  B1@0     .  B2@1
stage 1      .  F0@0  B0@0  F1@1  B1@1  F2@2  B2@2     ."""


@pytest.mark.parametrize("fn,args", [
    (schedules._gpipe, ("gpipe", 4, 2, 2, False)),
    (schedules._one_f_one_b_flush, ("pipedream-flush", 4, 2, 2, False)),
    (schedules._one_f_one_b, ("1f1b", 4, 2, 3, False)),
    (schedules._two_bw, ("2bw", 2, 2, 3, True)),
    (schedules._dataflow, ("dataflow", 4, 2, 2, False)),
    (schedules._pipelined_backprop, ("pb", 3, 1, 4, False)),
    (schedules._dataflow_recompute, (schedules.DataflowRecompute(segment=2), 4, 1, 4, False)),
])
def test_docstring_diagrams_are_the_rendered_timelines(fn, args):
    kind, P, N, K, versions = args
    rendered = simulate(kind, P, N, K).ascii(versions=versions)
    doc = "\n".join(line[8:] for line in fn.__doc__.splitlines() if line.startswith("        "))
    assert rendered in doc


def test_names_methods_and_errors():
    assert simulate("sync", 2, 1, 1).kind == "gpipe"
    assert simulate("pipedream-2bw", 2, 2, 1).kind == "2bw"
    assert simulate("pipedream", 2, 1, 1).kind == "pipedream"
    assert simulate(schedules.get("dataflow"), 2, 1, 1).kind == "dataflow"
    with pytest.raises(ScheduleError, match="N >= P|m >= d"):
        simulate("2bw", 4, 2, 2)
    with pytest.raises(ScheduleError, match="no timeline"):
        simulate("hogwild", 4, 1, 2)
    with pytest.raises(ScheduleError, match="unknown"):
        simulate("nope", 4, 1, 2)
    with pytest.raises(ConfigError, match="stages"):
        simulate("1f1b", 0, 1, 2)
    with pytest.raises(ConfigError, match="minibatches"):
        simulate("1f1b", 2, 1, 0)


def test_plot_draws_every_cell(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tl = simulate("pb", 3, 1, 4)
    ax = plot_timeline(tl)
    assert len(ax.patches) == len(tl.cells)
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(str(evs[0].microbatch) for evs in tl.cells.values())
    ax.figure.savefig(tmp_path / "pb.png")
    plt.close("all")


def test_summary_mentions_per_microbatch_delays():
    text = simulate("dataflow", 3, 2, 3).summary()
    assert "tau_fwd  = [3, 2, 1]" in text and "tau_fwd[i][j]" in text
    assert re.search(r"steady state 1\.0000", text)


def test_plot_draws_recompute_cells(tmp_path):
    tl = simulate(schedules.DataflowRecompute(segment=2), 4, 1, 4)
    ax = plot_timeline(tl)
    assert len(ax.patches) == len(tl.cells) == len(tl.events)
    assert "recompute" in [t.get_text() for t in ax.get_legend().get_texts()]
    ax.figure.savefig(tmp_path / "recompute.png")


def test_a_timeline_of_no_minibatch_is_refused():
    """Timeline(pipeline, 0) built, then failed with a raw TypeError at .utilization; -1 named 'steps'."""
    from staleopt import methods
    from staleopt.timeline import Timeline
    for bad in (0, -1, True):
        with pytest.raises(ConfigError, match=f"minibatches = {bad!r} must be an int >= 1"):
            Timeline(methods.build("1f1b", 3, 1), bad)
