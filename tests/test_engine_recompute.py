"""opt.checkpoint: the three-view contract (docs/design.md §1, PipeMare App. A.3, App. D.1) in float64.

A checkpointed segment recomputes its activations during the backward pass with
``u_recomp_i = w_{t - tau_recomp_i}`` (T2: ``- (tau_fwd_i - tau_recomp_i) delta``) from the input its
forward stored; the weight gradients use the recomputed activations (``dW = dz x_recomp^T``) and the
error products ``W^T delta`` read ``u_bkwd``. Checked against a hand-derived gradient of a tanh MLP, the
reference engine, the event-by-event execution of the dataflow pipeline with recompute, and the two
limits (``tau_recomp = tau_fwd``: no checkpointing; ``tau_recomp = tau_bkwd``: torch's checkpoint).
"""
import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from staleopt import PipelineOptimizer, schedules
from staleopt.corrections import DiscrepancyCorrection
from staleopt.errors import ConfigError, LoopError, SegmentError
from staleopt.reference import ReferencePipelineOptimizer
from staleopt.timeline import simulate

WIDTHS = [5, 4, 6, 3]                                     # 3 stages of Linear + tanh
LR = 0.1


class Net(nn.Module):
    """Linear + tanh stages; ``segments`` = ``[(first, last, how)]``, how: "opt" (opt.checkpoint), "torch"
    (torch.utils.checkpoint) or None (activations kept)."""

    def __init__(self, widths, segments, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])).double()
        self.segments, self.opt = segments, None

    def run(self, first, last, x):
        for i in range(first, last + 1):
            x = torch.tanh(self.layers[i](x))
        return x

    def forward(self, x):
        for first, last, how in self.segments:
            if how == "opt":
                x = self.opt.checkpoint(self.run, first, last, x)
            elif how == "torch":
                x = torch.utils.checkpoint.checkpoint(self.run, first, last, x, use_reentrant=False)
            else:
                x = self.run(first, last, x)
        return x


def data(steps, widths=WIDTHS, seed=1, rows=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, widths[0], generator=g, dtype=torch.float64),
             torch.randn(rows, widths[-1], generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(segments, schedule, steps=12, engine=PipelineOptimizer, corrections=(), each_step=None, **kw):
    model = Net(WIDTHS, segments)
    opt = engine(model, torch.optim.SGD(model.parameters(), lr=LR), stages=len(WIDTHS) - 1, schedule=schedule,
                 corrections=list(corrections), **kw)
    model.opt = opt
    for x, y in data(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        if each_step is not None:
            each_step(model, opt)
    return [p.detach().clone() for p in model.parameters()], opt


def hand_reference(segments, tf, tb, tr, steps=12, decay=None, accumulator="causal"):
    """Every weight version kept; the three views of each stage built from the formulas; the gradient derived by
    hand: forward with u_fwd, recomputation of each checkpointed segment with u_recomp from the forward's
    segment input, dz = delta (1 - out^2) and dW = dz^T in with the recomputed in/out, error dz W_bkwd."""
    model = Net(WIDTHS, segments)
    P = len(WIDTHS) - 1
    hist = [[(model.layers[i].weight.detach().clone(), model.layers[i].bias.detach().clone()) for i in range(P)]]
    zero = [(torch.zeros_like(W), torch.zeros_like(b)) for W, b in hist[0]]
    deltas = [zero]                                       # deltas[v] = delta_v
    corrected = [decay is not None and tf[i] > tb[i] for i in range(P)]
    gamma = [decay ** (1.0 / (tf[i] - tb[i])) if corrected[i] else None for i in range(P)]
    for t, (x, y) in enumerate(data(steps)):
        def view(i, tau):
            W, b = hist[max(t - tau, 0)][i]
            if not corrected[i] or tau >= tf[i]:
                return W, b
            v = t - tau if accumulator == "causal" else t
            dW, db = deltas[v][i] if v >= 0 else zero[i]
            return W - (tf[i] - tau) * dW, b - (tf[i] - tau) * db
        Wf = [hist[max(t - tf[i], 0)][i] for i in range(P)]
        Wb = [view(i, tb[i]) for i in range(P)]
        Wr = [view(i, tr[i]) for i in range(P)]
        acts = [x]
        for i in range(P):
            acts.append(torch.tanh(acts[-1] @ Wf[i][0].T + Wf[i][1]))
        ins, outs = acts[:-1], acts[1:]
        for first, last, how in segments:
            if how is not None:                           # torch's checkpoint is tau_recomp = tau_bkwd
                r = acts[first]
                for i in range(first, last + 1):
                    W, b = Wr[i] if how == "opt" else Wb[i]
                    ins[i], r = r, torch.tanh(r @ W.T + b)
                    outs[i] = r
        d = 2 * (acts[-1] - y) / y.numel()
        grads = [None] * P
        for i in reversed(range(P)):
            dz = d * (1 - outs[i] ** 2)
            grads[i] = (dz.T @ ins[i], dz.sum(0))
            d = dz @ Wb[i][0]
        new = [(W - LR * gW, b - LR * gb) for (W, b), (gW, gb) in zip(hist[-1], grads)]
        deltas.append([(gamma[i] * dW + (1 - gamma[i]) * (W1 - W0), gamma[i] * db + (1 - gamma[i]) * (b1 - b0))
                       if corrected[i] else zero[i]
                       for i, ((dW, db), (W1, b1), (W0, b0)) in enumerate(zip(deltas[-1], new, hist[-1]))])
        hist.append(new)
    return [p for W, b in hist[-1] for p in (W, b)]


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b))


TF, TB, TR = [5, 3, 2], [1, 1, 0], [3, 2, 2]              # stage 2: tau_recomp = tau_fwd
CUSTOM = schedules.get("custom", tau_fwd=TF, tau_bkwd=TB, tau_recomp=TR)
SEGMENTS = {"two segments": [(0, 1, "opt"), (2, 2, "opt")],
            "first stage only": [(0, 0, "opt"), (1, 2, None)],
            "middle only": [(0, 0, None), (1, 1, "opt"), (2, 2, None)]}


@pytest.mark.parametrize("segments", list(SEGMENTS))
@pytest.mark.parametrize("t2", [None, "causal", "current"])
@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_three_views_equal_the_hand_derived_gradient(segments, t2, memory):
    seg = SEGMENTS[segments]
    corrections = [] if t2 is None else [DiscrepancyCorrection(0.3, accumulator=t2)]
    got, _ = train(seg, CUSTOM, corrections=corrections, memory=memory)
    want = hand_reference(seg, TF, TB, TR, decay=None if t2 is None else 0.3, accumulator=t2 or "causal")
    assert max_diff(got, want) <= 1e-12
    # not vacuous: recomputing with u_bkwd instead (torch's checkpoint) gives other weights
    other = hand_reference([(a, b, "torch" if h else None) for a, b, h in seg], TF, TB, TR,
                           decay=None if t2 is None else 0.3, accumulator=t2 or "causal")
    assert max_diff(other, want) > 1e-6


@pytest.mark.parametrize("microbatch_passes", [True, False])
@pytest.mark.parametrize("t2", [None, "causal", "current"])
def test_fast_engine_equals_the_reference_engine_after_every_step(t2, microbatch_passes):
    """Bit-equal weights and T2 accumulators after every step, both memory modes, with microbatch passes or
    two passes of plain accumulation (``"minimal"`` drops ``w_(t-H)`` at the second from step 1 on, where the
    recompute views do not read it)."""
    sched = schedules.get("dataflow-recompute", segment=2)
    runs = {}
    for name, engine, memory in [("ref", ReferencePipelineOptimizer, "minimal"), ("minimal", PipelineOptimizer,
                                                                                  "minimal"),
                                 ("fast", PipelineOptimizer, "fast")]:
        seen = []

        def record(model, opt):
            seen.append([p.detach().clone() for p in model.parameters()]
                        + ([opt.corrections[0].delta(i) for i in range(2)] if t2 else []))
        corrections = [] if t2 is None else [DiscrepancyCorrection(0.2, accumulator=t2)]
        model = Net(WIDTHS, [(0, 1, "opt"), (2, 2, "opt")])
        opt = engine(model, torch.optim.Adam(model.parameters(), lr=1e-2), stages=3, schedule=sched,
                     corrections=corrections, memory=memory, microbatches=2, microbatch_passes=microbatch_passes)
        model.opt = opt
        for x, y in data(10, rows=4):
            opt.zero_grad()
            for j in range(2):
                (((model(x[2 * j:2 * j + 2]) - y[2 * j:2 * j + 2]) ** 2).mean() / 2).backward()
            opt.step()
            record(model, opt)
        runs[name] = seen
    for name in ("minimal", "fast"):
        for a, b in zip(runs["ref"], runs[name]):
            assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_tau_recomp_equal_tau_fwd_is_no_checkpointing_bit_for_bit():
    sched = schedules.get("custom", tau_fwd=TF, tau_bkwd=TB, tau_recomp=TF)
    for corrections in ([], [DiscrepancyCorrection(0.3)]):
        plain, _ = train([(0, 2, None)], sched, corrections=[type(c)(c.decay) for c in corrections])
        ck, _ = train([(0, 1, "opt"), (2, 2, "opt")], sched, corrections=[type(c)(c.decay) for c in corrections])
        assert all(torch.equal(p, q) for p, q in zip(plain, ck))


def test_tau_recomp_equal_tau_bkwd_is_torchs_checkpoint_bit_for_bit():
    """Also with T2 on (the recompute view is the corrected backward view), and no window opens."""
    for sched in (schedules.get("custom", tau_fwd=TF, tau_bkwd=TB), "pipemare", "1f1b"):
        for corrections in ([], [DiscrepancyCorrection(0.3)]):
            theirs, _ = train([(0, 1, "torch"), (2, 2, "torch")], sched,
                              corrections=[DiscrepancyCorrection(0.3) for _ in corrections])
            ours, opt = train([(0, 1, "opt"), (2, 2, "opt")], sched,
                              corrections=[DiscrepancyCorrection(0.3) for _ in corrections])
            assert all(torch.equal(p, q) for p, q in zip(theirs, ours))
            assert opt.tau_recomp == opt.tau_bkwd


def test_early_stop_and_a_second_backward_recompute_the_same():
    """torch stops a recomputation once the tensors it needs exist; the window closes either way, and the
    parameters hold w_t at rest after every backward."""
    def at_rest(model, opt):
        with torch.no_grad():
            now = [p.clone() for p in model.parameters()]
        with opt.current_weights():
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), now))
    runs = []
    for early in (True, False):
        with torch.utils.checkpoint.set_checkpoint_early_stop(early):
            runs.append(train(SEGMENTS["two segments"], CUSTOM, corrections=[DiscrepancyCorrection(0.3)],
                              each_step=at_rest)[0])
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_memory_is_the_history_alone():
    """The recompute view moves versions the history holds: no extra copy of the model is kept."""
    _, with_recompute = train(SEGMENTS["two segments"], CUSTOM, steps=2)
    _, without = train([(0, 2, None)], schedules.get("custom", tau_fwd=TF, tau_bkwd=TB), steps=2)
    assert with_recompute.memory_bytes() == without.memory_bytes() == with_recompute.history_bytes()


def test_eval_and_no_grad_run_the_function_with_w_t():
    model = Net(WIDTHS, SEGMENTS["two segments"])
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=3, schedule=CUSTOM)
    model.opt = opt
    x, y = data(1)[0]
    with torch.no_grad():
        before = model(x)
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    model.eval()
    plain = Net(WIDTHS, [(0, 2, None)])
    plain.load_state_dict(model.state_dict())
    assert torch.equal(model(x), plain(x)) and not torch.equal(model(x), before)


def test_bad_calls():
    model = Net(WIDTHS, SEGMENTS["two segments"])
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=3, schedule=CUSTOM)
    x = data(1)[0][0]
    with pytest.raises(ConfigError, match="use_reentrant"):
        opt.checkpoint(model.run, 0, 1, x, use_reentrant=True)
    with pytest.raises(ConfigError, match="context_fn"):
        opt.checkpoint(model.run, 0, 1, x, context_fn=None)
    with pytest.raises(ConfigError, match="inside model.forward"):
        opt.checkpoint(model, x)


def test_a_recompute_schedule_refuses_a_step_without_opt_checkpoint():
    with pytest.raises(LoopError, match="no opt.checkpoint call ran"):
        train([(0, 1, None), (2, 2, None)], CUSTOM, steps=1)


@pytest.mark.parametrize("first", ["opt", None])
def test_every_forward_of_an_accumulated_step_must_checkpoint(first):
    """Two forwards accumulated into one step, one of them without opt.checkpoint (in either order): that pass kept
    its forward activations while tau_recomp reported the recomputation (silent: the step saw a call)."""
    model = Net(WIDTHS, [])
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=len(WIDTHS) - 1,
                            schedule=CUSTOM)
    model.opt = opt
    (x, y), = data(1)
    with pytest.raises(SegmentError, match="some called opt.checkpoint and some did not"):
        for how in (first, "opt" if first is None else None):
            model.segments = [(0, 1, how), (2, 2, how)]
            ((model(x) - y) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("segments", [[(0, 1, "torch"), (2, 2, "torch")], [(0, 1, "opt"), (2, 2, "torch")],
                                      [(0, 0, "torch"), (1, 2, "opt")]])
def test_torchs_checkpoint_under_a_recompute_schedule_is_caught(segments):
    """torch.utils.checkpoint would recompute with u_bkwd: a stage module running inside the backward pass
    outside opt.checkpoint raises (also mixed with opt.checkpoint, also torch's reentrant variant)."""
    with pytest.raises(LoopError, match=r"\(stage \d\) ran .*outside opt.checkpoint.*all stages: \[3, 2, 2\]"):
        train(segments, CUSTOM, steps=1)

    class Reentrant(Net):
        def forward(self, x):
            x = torch.utils.checkpoint.checkpoint(self.run, 0, 1, x, use_reentrant=True)
            return self.run(2, 2, x)
    model = Reentrant(WIDTHS, [])
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=3, schedule=CUSTOM)
    x = data(1)[0][0].requires_grad_()
    with pytest.raises(LoopError, match="outside opt.checkpoint"):
        model(x).sum().backward()
    # without recompute delays torch's checkpoint is the contract's recomputation (tau_recomp = tau_bkwd)
    train(segments, schedules.get("custom", tau_fwd=TF, tau_bkwd=TB), steps=1)


@pytest.mark.parametrize("t2", [None, "causal"])
def test_torchs_checkpoint_is_exact_where_a_stage_recomputes_with_its_backward_view(t2):
    """A schedule that recomputes ahead at some stages only (tau_recomp = [3, 2, 0], tau_bkwd = [1, 1, 0]): torch's
    checkpoint around stage 2, where tau_recomp = tau_bkwd, reads the contract's recompute view, and trains as the
    hand-derived gradient says (it was refused, naming no stage)."""
    tr = [3, 2, 0]
    seg = [(0, 1, "opt"), (2, 2, "torch")]
    corrections = [] if t2 is None else [DiscrepancyCorrection(0.3, accumulator=t2)]
    got, _ = train(seg, schedules.get("custom", tau_fwd=TF, tau_bkwd=TB, tau_recomp=tr), corrections=corrections)
    assert max_diff(got, hand_reference(seg, TF, TB, tr, decay=None if t2 is None else 0.3)) <= 1e-12


def test_a_refused_recomputation_leaves_the_torch_checkpoint_guard_armed():
    """A recomputation refused as it starts (a backward after the next step) left the engine counting it as
    running, so torch.utils.checkpoint trained silently with u_bkwd for the rest of the run once the user caught
    the first error (a notebook running its loop again)."""
    model = Net(WIDTHS, [(0, 1, "opt"), (2, 2, "opt")])
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=3, schedule=CUSTOM)
    model.opt = opt
    (x, y), = data(1)
    ((model(x) - y) ** 2).mean().backward()
    late = ((model(x) - y) ** 2).mean()
    opt.step()
    with pytest.raises(LoopError):
        late.backward()
    model.segments = [(0, 1, "opt"), (2, 2, "torch")]
    opt.zero_grad()
    with pytest.raises(LoopError, match="outside opt.checkpoint"):
        ((model(x) - y) ** 2).mean().backward()


# ----------------------------------------------------------------------------- the executed timeline
EXEC_WIDTHS = [6, 5, 4, 5, 3]                             # 4 stages
MB = 3


def execute_dataflow_recompute(model, segments, xs, ys, K, N):
    """Run simulate(DataflowRecompute) event by event: F stores (x_in, x_out) with the version it reads; R
    recomputes x_out with its own version from the segment input the forward stored (or the previous stage's
    recomputation); B uses the recomputed (x_in, x_out) for dz and dW = dz^T x_in and the error dz W with its
    version; each stage applies SGD with momentum when its update lands."""
    P = len(model.layers)
    tl = simulate(schedules.DataflowRecompute(segment=segments[0][1] - segments[0][0] + 1), P, N, K)
    firsts = {a for a, _ in segments}
    params = [[l.weight.detach().clone(), l.bias.detach().clone()] for l in model.layers]
    opts = [torch.optim.SGD(ps, lr=LR, momentum=0.9) for ps in params]
    versions = [[(W.clone(), b.clone())] for W, b in params]
    grads = [[torch.zeros_like(W), torch.zeros_like(b)] for W, b in params]
    acts, rec, errs, updates, by_slot = {}, {}, {}, {}, {}
    for stage, slot, t in tl.updates:
        updates.setdefault(slot, []).append((stage, t))
    for e in tl.events:
        by_slot.setdefault(e.slot, []).append(e)
    kinds = set()
    for slot in range(tl.slots):
        for e in by_slot.get(slot, []):
            i, m = e.stage, e.microbatch
            W, b = versions[i][e.version]
            kinds.add(e.kind)
            if e.kind == "F":
                x_in = xs[m] if i == 0 else acts[(i - 1, m)][1]
                acts[(i, m)] = (x_in, torch.tanh(x_in @ W.T + b))
            elif e.kind == "R":
                x_in = acts[(i, m)][0] if i in firsts else rec[(i - 1, m)][1]
                rec[(i, m)] = (x_in, torch.tanh(x_in @ W.T + b))
            else:
                x_in, x_out = rec[(i, m)]
                if i == P - 1:                            # the loss reads the forward's output
                    delta_out = 2 * (acts[(i, m)][1] - ys[m]) / (x_out.numel() * N)
                else:
                    delta_out = errs.pop((i, m))
                dz = delta_out * (1 - x_out ** 2)
                grads[i][0] += dz.T @ x_in
                grads[i][1] += dz.sum(0)
                if i > 0:
                    errs[(i - 1, m)] = dz @ W
        for stage, t in updates.get(slot, []):
            for p, g in zip(params[stage], grads[stage]):
                p.grad = g.clone()
                g.zero_()
            opts[stage].step()
            versions[stage].append(tuple(p.clone() for p in params[stage]))
    assert kinds == {"F", "R", "B"}
    return [p for ps in params for p in ps]


@pytest.mark.parametrize("N", [1, 2, 3])
@pytest.mark.parametrize("segment", [1, 2])
def test_opt_checkpoint_reproduces_the_executed_recompute_events(N, segment):
    """PipeMare App. A.3's pipeline with recompute, executed event by event, equals PipelineOptimizer with one
    opt.checkpoint per segment and one pass per microbatch (microbatch j reads tau_recomp[i][j])."""
    K = 24
    schedule = schedules.DataflowRecompute(segment=segment)
    segments = schedule.segments(4)
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(K * N, MB, EXEC_WIDTHS[0], generator=g, dtype=torch.float64)
    ys = torch.randn(K * N, MB, EXEC_WIDTHS[-1], generator=g, dtype=torch.float64)
    executed = execute_dataflow_recompute(Net(EXEC_WIDTHS, []), segments, xs, ys, K, N)
    model = Net(EXEC_WIDTHS, [(a, b, "opt") for a, b in segments])
    initial = [p.detach().clone() for p in model.parameters()]
    opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), stages=4,
                            schedule=schedule, microbatches=N, microbatch_passes=True)
    model.opt = opt
    rows = schedule.microbatch_recompute_delays(4, N)
    for t in range(K):
        opt.zero_grad()
        for j in range(N):
            m = t * N + j
            (((model(xs[m]) - ys[m]) ** 2).mean() / N).backward()
            assert opt.tau_recomp == [row[j] for row in rows]
        opt.step()
    simulated = [p.detach() for p in model.parameters()]
    assert max_diff(executed, simulated) <= 1e-10
    assert max_diff(simulated, initial) > 1e-2
    # recomputing with u_bkwd (torch's checkpoint) is another pipeline
    if segment > 1:
        other = Net(EXEC_WIDTHS, [(a, b, "torch") for a, b in segments])
        base = PipelineOptimizer(other, torch.optim.SGD(other.parameters(), lr=LR, momentum=0.9), stages=4,
                                 schedule=schedule.without_recompute(), microbatches=N, microbatch_passes=True)
        for t in range(K):
            base.zero_grad()
            for j in range(N):
                m = t * N + j
                (((other(xs[m]) - ys[m]) ** 2).mean() / N).backward()
            base.step()
        assert max_diff([p.detach() for p in other.parameters()], simulated) > 1e-8


def test_a_checkpoint_taken_mid_step_keeps_the_recompute_delays():
    """state_dict() between microbatch passes saves each pass's tau_recomp; resuming there is bit-identical.
    An entry from before tau_recomp (no "recompute" key) loads with tau_recomp = tau_bkwd."""
    sched = schedules.get("dataflow-recompute", segment=2)
    batches = data(6, rows=4)

    def make():
        model = Net(WIDTHS, [(0, 1, "opt"), (2, 2, "opt")])
        opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), stages=3,
                                schedule=sched, corrections=[DiscrepancyCorrection(0.3)], microbatches=2,
                                microbatch_passes=True)
        model.opt = opt
        return model, opt

    def passes(model, opt, steps, first_pass=0):
        for t, (x, y) in steps:
            if first_pass == 0:
                opt.zero_grad()
            for j in range(first_pass, 2):
                (((model(x[2 * j:2 * j + 2]) - y[2 * j:2 * j + 2]) ** 2).mean() / 2).backward()
            first_pass = 0
            opt.step()

    model, opt = make()
    passes(model, opt, enumerate(batches))
    whole = [p.detach().clone() for p in model.parameters()]
    model, opt = make()
    passes(model, opt, enumerate(batches[:3]))
    x, y = batches[3]
    opt.zero_grad()
    (((model(x[:2]) - y[:2]) ** 2).mean() / 2).backward()
    state, weights = opt.state_dict(), model.state_dict()
    grads = [p.grad.clone() for p in model.parameters()]
    assert state["staleopt"]["recompute"] == [[2, 1, 1], [1, 0, 0]] == \
        [[row[j] for row in sched.microbatch_recompute_delays(3, 2)] for j in range(2)]
    model2, opt2 = make()
    model2.load_state_dict(weights)
    opt2.load_state_dict(state)
    for p, g in zip(model2.parameters(), grads):
        p.grad = g.clone()
    passes(model2, opt2, [(3, batches[3])], first_pass=1)
    passes(model2, opt2, enumerate(batches[4:], 4))
    assert all(torch.equal(p, q) for p, q in zip(model2.parameters(), whole))
    old = {**state, "staleopt": {k: v for k, v in state["staleopt"].items() if k != "recompute"}}
    _, opt3 = make()
    opt3.load_state_dict(old)
    assert opt3.tau_recomp == opt3.tau_bkwd


def test_under_torch_compile_the_segments_run_eagerly_with_the_same_results():
    """opt.checkpoint is kept out of the compiled graph (a graph break): the same weights as eager, bit for bit."""
    runs = []
    for compiled in (False, True):
        model = Net(WIDTHS, SEGMENTS["two segments"])
        run = torch.compile(model, backend="aot_eager") if compiled else model
        opt = PipelineOptimizer(run, torch.optim.SGD(model.parameters(), lr=LR), stages=3, schedule=CUSTOM,
                                corrections=[DiscrepancyCorrection(0.3)])
        model.opt = opt
        for x, y in data(6):
            opt.zero_grad()
            ((run(x) - y) ** 2).mean().backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_recompute_delays_go_through_the_corrections_as_the_pipeline_says():
    """The engine's largest tau_recomp equals methods.Pipeline.recompute_delays (stashing: the forward's
    version; vertical sync: stage 0's), and a synchronous warmup step needs no opt.checkpoint."""
    from staleopt import methods
    from staleopt.corrections import Stashing, VerticalSync, Warmup
    sched = schedules.get("dataflow-recompute", segment=2)
    for extra in ([], [Stashing()], [VerticalSync()], [Stashing(), VerticalSync()], [Warmup(2)]):
        model = Net(WIDTHS, [(0, 1, None), (2, 2, None)])
        opt = PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=3, schedule=sched,
                                corrections=extra)
        pipeline = methods.Pipeline("x", sched, extra, 3)
        assert opt.max_recompute_delays == pipeline.recompute_delays
        if extra and isinstance(extra[0], Warmup):
            for x, y in data(2):                          # synchronous: all delays 0, nothing to recompute
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                assert opt.tau_recomp == opt.tau_fwd == [0, 0, 0]
                opt.step()
            # after the warmup the pipeline refills (min(tau, t - W)): the first step whose delays put a
            # recomputation between the backward and the forward (tau_bkwd < tau_recomp < tau_fwd) needs it
            for t, (x, y) in enumerate(data(8), start=2):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                assert opt.tau_recomp == [min(r, t - 2) for r in opt.max_recompute_delays]
                if any(b < r < f for f, b, r in zip(opt.tau_fwd, opt.tau_bkwd, opt.tau_recomp)):
                    with pytest.raises(LoopError, match="no opt.checkpoint call ran"):
                        opt.step()
                    break
                opt.step()
            else:
                raise AssertionError("the refilled pipeline never recomputed ahead of the backward pass")


def test_weight_prediction_is_refused_where_the_schedule_recomputes_ahead():
    """The history holds the versions predicted for the forward's gap, so a recomputation from the stored
    w_(t - tau_recomp) read a prediction past w_t (5e-2 off the contract, silently)."""
    from staleopt.corrections import WeightPrediction
    from staleopt.errors import CorrectionError
    model = Net(WIDTHS, [])
    current = schedules.get("custom", tau_fwd=TF, tau_recomp=[3, 2, 1])  # (prediction: backward on w_t)
    with pytest.raises(CorrectionError, match="recomputes activations"):
        PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=3, schedule=current,
                          corrections=[WeightPrediction()])
    PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR), stages=3,
                      schedule=current.without_recompute(), corrections=[WeightPrediction()])
    assert CUSTOM.without_recompute().recompute_delays(3) == TB  # (it returned itself, recomputing)
