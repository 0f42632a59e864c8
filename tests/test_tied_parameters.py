"""Tied parameters held as pipelines hold them (docs/design.md §1, staleopt.replicas): each use reads its own
stage's view, the gradients of all uses are summed into one update. Checked in float64 against hand-derived
gradients, the reference engine, Hugging Face GPT-2 with stale per-stage weights, and the executed timeline."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import staleopt
from staleopt import schedules
from staleopt.reference import ReferencePipelineOptimizer

from test_silent_round3 import Twice

V, D, B = 7, 5, 6


class TiedNet(nn.Module):
    """``logits = tanh(tanh(E[x] W1^T + b1) W2^T + b2) E^T``: E is the token embedding (stage 0) and the output
    layer ``head`` (registered after ``l2``, so in the last stage), tied."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok, self.l1, self.l2 = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.tok.weight
        self.double()

    def forward(self, x):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(self.tok(x))))))


def _data(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (B,), generator=g), torch.randn(B, V, generator=g, dtype=torch.float64))
            for _ in range(steps)]


def _mse(out, y):
    return ((out - y) ** 2).mean()


def test_each_use_reads_its_stage_view_and_the_gradients_are_summed():
    """Hand-derived: tau_fwd = (4, 2, 1), tau_bkwd = (1, 0, 0), SGD with momentum, 20 steps, to 1e-12. The embedding
    reads E_{t-4}, the output layer E_{t-1} forward and E_t in W^T delta; E takes one update from both gradients."""
    model = TiedNet()
    tf, tb, lr, mom = (4, 2, 1), (1, 0, 0), 0.05, 0.9
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=mom), stages=3,
                                     schedule=schedules.get("custom", tau_fwd=list(tf), tau_bkwd=list(tb)))
    assert [(r.name, r.owner_stage, r.stage) for r in opt.replicas] == [("tok.weight", 0, 2)]
    names = ["E", "W1", "b1", "W2", "b2"]
    stage = {"E": 0, "W1": 1, "b1": 1, "W2": 2, "b2": 2}
    w = dict(zip(names, [p.detach().clone() for p in (model.tok.weight, model.l1.weight, model.l1.bias,
                                                        model.l2.weight, model.l2.bias)]))
    history, buf = [w], None
    for t, (x, y) in enumerate(_data(20)):
        def at(name, tau, use_stage=None):
            return history[max(t - tau, 0)][name]
        f = {n: at(n, tf[stage[n]]) for n in names}
        b = {n: at(n, tb[stage[n]]) for n in names}
        E_f2, E_b2 = at("E", tf[2]), at("E", tb[2])  # the output layer's use: stage 2's views
        e = f["E"][x]
        h1 = torch.tanh(e @ f["W1"].T + f["b1"])
        h2 = torch.tanh(h1 @ f["W2"].T + f["b2"])
        out = h2 @ E_f2.T
        dlog = 2 * (out - y) / out.numel()
        g_head = dlog.T @ h2
        dz2 = (dlog @ E_b2) * (1 - h2 ** 2)
        dz1 = (dz2 @ b["W2"]) * (1 - h1 ** 2)
        g_emb = torch.zeros_like(w["E"]).index_add_(0, x, dz1 @ b["W1"])
        g = {"E": g_head + g_emb, "W1": dz1.T @ e, "b1": dz1.sum(0), "W2": dz2.T @ h1, "b2": dz2.sum(0)}
        buf = dict(g) if buf is None else {n: mom * buf[n] + g[n] for n in names}
        history.append({n: history[-1][n] - lr * buf[n] for n in names})

        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()
        for n, p in zip(names, (model.tok.weight, model.l1.weight, model.l1.bias, model.l2.weight, model.l2.bias)):
            torch.testing.assert_close(p.detach(), history[-1][n], atol=1e-12, rtol=0)
    assert model.head.weight is model.tok.weight  # the tie is intact at rest
    # the owner's delay at every use (first-owner) trains differently: the replica's view matters
    other = TiedNet()
    first = staleopt.PipelineOptimizer(other, torch.optim.SGD(other.parameters(), lr=lr, momentum=mom), stages=3,
                                       schedule=schedules.get("custom", tau_fwd=list(tf), tau_bkwd=list(tb)),
                                       shared_parameters="first-owner")
    for x, y in _data(20):
        first.zero_grad()
        _mse(other(x), y).backward()
        first.step()
    assert (other.tok.weight - model.tok.weight).abs().max() > 1e-4


def _train(cls, method, memory="minimal", steps=12, base="sgd", **kw):
    model = TiedNet()
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if base == "sgd" else \
        torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = cls(model, base, stages=3, schedule=method, memory=memory, **kw)
    views = []
    for x, y in _data(steps):
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()
        views.append([t.clone() for v in opt.chunks for t in v.data])
    return model, opt, views


@pytest.mark.parametrize("method,base,kw", [
    ("dataflow", "sgd", {}), ("pipedream", "sgd", {}), ("1f1b", "adam", {}), ("pipedream-2bw", "sgd",
                                                                            {"microbatches": 3}),
    ("pipemare", "sgd", {"method_args": {"anneal_steps": 5}}), ("pipeoptim", "adam", {}),
    ("spectrain", "sgd", {}), ("pipemare-w", "sgd", {"method_args": {"warmup_steps": 3}})])
@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_replica_histories_match_the_reference_engine_bit_for_bit(method, base, kw, memory):
    """The replica's versions move through the fast history (swaps or copies) exactly as through the
    store-everything reference, with every correction (T1, T2, prediction, warmup) acting on its view."""
    ref_model, ref, ref_views = _train(ReferencePipelineOptimizer, method, base=base, **kw)
    model, opt, views = _train(staleopt.PipelineOptimizer, method, memory, base=base, **kw)
    assert opt.replicas and len(ref_views) == len(views)
    for va, vb in zip(ref_views, views):
        assert all(torch.equal(a, b) for a, b in zip(va, vb))
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("from_step", [0, 3])
def test_a_tied_module_in_eval_mode_still_reads_its_replica(from_step):
    """The model's mode makes a forward a training forward, not the using module's own: a tied head put in eval
    mode (to turn its dropout off) while the model trains sits in its own stage and reads its replica; an
    ``nn.Linear`` computes the same in either mode, so the run is the train-mode run bit for bit (it read the
    owner stage's view of the tied matrix)."""
    def run(head_eval):
        model = TiedNet()
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         stages=3, schedule="pipedream")
        for t, (x, y) in enumerate(_data(8)):
            if head_eval and t == from_step:
                model.head.eval()
            opt.zero_grad()
            _mse(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


class _Dec(nn.Module):
    """A decoder that applies the tied matrix itself after its submodules (``own=True``), or through a last
    submodule of its own whose weight is the tied one (the fix the error names)."""

    def __init__(self, own):
        super().__init__()
        self.fc1, self.fc2, self.own = nn.Linear(D, D), nn.Linear(D, D), own
        if not own:
            self.out = nn.Linear(D, V, bias=False)

    def forward(self, h):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(h))))
        return F.linear(h, self.out_weight) if self.own else self.out(h)


class _ContainerTied(nn.Module):
    def __init__(self, own):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.enc, self.dec = nn.Embedding(V, D), nn.Linear(D, D), _Dec(own)
        if own:
            self.dec.out_weight = self.tok.weight
        else:
            self.dec.out.weight = self.tok.weight
        self.double()

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(self.tok(x))))


def test_a_module_that_applies_a_tied_weight_after_its_submodules_is_told_how_to_move_it():
    """A container that registers the tied matrix and applies it after its own submodules: its replica sits where
    the container is registered, before them. The error said to order units by execution, which then failed with
    advice to register the weight on a later module (it was): it names the cause and the fix, which trains."""
    model = _ContainerTied(own=True)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4,
                                     schedule="pipedream")
    with pytest.raises(staleopt.errors.StageOrderError, match="'dec' registers a tied weight .*'dec.fc2'.*self.out"):
        model(_data(1)[0][0])
    opt.remove_hooks()
    model = _ContainerTied(own=False)
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), stages=4,
                                     schedule="pipedream")
    assert [(r.module_name, r.stage) for r in opt.replicas] == [("dec.out", 3)]
    for x, y in _data(3):
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()


def test_replica_memory_is_counted():
    """A replica is one weight copy plus its stage's H stored versions: the memory a pipeline stage holds."""
    model = TiedNet()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                     schedule="dataflow")
    untied = TiedNet()
    untied.head.weight = nn.Parameter(untied.tok.weight.detach().clone())
    plain = staleopt.PipelineOptimizer(untied, torch.optim.SGD(untied.parameters(), lr=0.1),
                                       stages=staleopt.partition_model(untied, [1, 2]), schedule="dataflow")
    size = V * D * 8
    assert opt.memory_bytes() == opt.history_bytes() + size
    assert opt.history_bytes() == plain.history_bytes()  # stage 2 keeps the same H_2 versions as an untied head's
    assert opt.chunks[-1].ring.shape[1] == plain.chunks[-1].ring.shape[1] == D * D + D + V * D


def test_a_change_at_rest_reaches_the_replicas():
    """Weights loaded into the model between steps (a checkpoint) are w_t at every use."""
    model, opt, _ = _train(staleopt.PipelineOptimizer, "dataflow", steps=3)
    new = TiedNet(seed=5)
    model.load_state_dict(new.state_dict())
    x, y = _data(1, seed=9)[0]
    with opt.passes_with_delays([0, 0, 0], [0, 0, 0]):
        opt.zero_grad()
        _mse(model(x), y).backward()
        got = model.tok.weight.grad.clone()
    new.zero_grad()
    _mse(new(x), y).backward()
    torch.testing.assert_close(got, new.tok.weight.grad, atol=1e-15, rtol=0)


class RawUse(TiedNet):
    """The embedding matrix read directly (``h @ tok.weight.T``) by the last stage: no module to hold a replica."""

    def forward(self, x):
        return torch.tanh(self.l2(torch.tanh(self.l1(self.tok(x))))) @ self.tok.weight.T


@pytest.mark.parametrize("cls", [Twice, RawUse])
def test_uses_no_replica_can_serve_are_refused(cls):
    model = cls()
    x = torch.randn(2, 4) if cls is Twice else torch.randint(0, V, (B,))
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3)
    with pytest.raises(staleopt.errors.SharedParameterError, match="Register a separate module per use"):
        model(x)
    opt.remove_hooks()


@pytest.mark.parametrize("wrap", ["compiled", "original"])
def test_a_compiled_whole_model_hides_the_replica_and_is_refused(wrap):
    """torch.compile over the whole model puts the forward in one graph node: the replica's read is not visible,
    so the first training forward refuses instead of training with unknown views (the message says what to do)."""
    torch._dynamo.reset()
    model = TiedNet()
    call = torch.compile(model, backend="aot_eager")
    opt = staleopt.PipelineOptimizer(call if wrap == "compiled" else model,
                                     torch.optim.SGD(model.parameters(), lr=0.1), stages=3)
    x, y = _data(1)[0]
    with pytest.raises(staleopt.errors.SharedParameterError, match=r"torch.compile on each block"):
        _mse(call(x), y).backward()
    opt.remove_hooks()
    torch._dynamo.reset()


def test_compiled_blocks_between_the_tied_modules_train_as_eager():
    """The fix the refusal names: compile the blocks, keep the tied modules eager; bit for bit."""
    weights = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = TiedNet()
        if compiled:
            model.l1, model.l2 = (torch.compile(m, backend="aot_eager") for m in (model.l1, model.l2))
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         stages=3, schedule="dataflow")
        assert len(opt.replicas) == 1
        for x, y in _data(8):
            opt.zero_grad()
            _mse(model(x), y).backward()
            opt.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(*weights))


@pytest.mark.parametrize("correction", ["DelayCompensation", "GapAware", "NesterovLookahead"])
def test_corrections_that_rewrite_gradients_are_refused_with_replicas(correction):
    model = TiedNet()
    with pytest.raises(staleopt.errors.CorrectionError, match="tie_word_embeddings=False"):
        staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                   corrections=[getattr(staleopt.corrections, correction)()])


def test_hugging_face_gpt2_with_stale_stage_weights_matches_a_functional_reference():
    """GPT-2 from a config (tied lm_head), 4 stages, pipedream (stashing: each stage's forward and backward read
    w_{t - tau_i}, so the step's gradient is the plain gradient at those weights), float64: after every step the
    weights equal a reference that evaluates an untied copy with wte = E_{t - tau_0} and lm_head = E_{t - tau_3}
    and sums the two gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=11, n_positions=8,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).double()
    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config.to_dict(), "tie_word_embeddings":
                                                                   False})).double()
    lr = 0.05
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr), stages=4,
                                     schedule="pipedream")
    tau = opt.max_delays[0]
    assert [(r.name, r.stage) for r in opt.replicas] == [("transformer.wte.weight", 3)] and tau[0] > tau[3]
    stage_of = {n: opt.partition.stages.index(next(s for s in opt.partition if any(p is q for q in s.params)))
                for n, p in model.named_parameters()}
    names = [n for n, _ in model.named_parameters()]
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    g = torch.Generator().manual_seed(3)
    for t in range(8):
        x = torch.randint(0, 11, (2, 6), generator=g)
        params = {n: history[max(t - tau[stage_of[n]], 0)][n].clone().requires_grad_(True) for n in names}
        head = history[max(t - tau[3], 0)]["transformer.wte.weight"].clone().requires_grad_(True)
        loss = torch.func.functional_call(ref, {**params, "lm_head.weight": head}, (x,), {"labels": x}).loss
        grads = dict(zip(names + ["head"], torch.autograd.grad(loss, [params[n] for n in names] + [head])))
        grads["transformer.wte.weight"] = grads["transformer.wte.weight"] + grads["head"]
        history.append({n: history[-1][n] - lr * grads[n] for n in names})

        opt.zero_grad()
        model(x, labels=x).loss.backward()
        opt.step()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), history[-1][n], atol=1e-12, rtol=0)
    assert model.lm_head.weight is model.transformer.wte.weight


class TiedRecompute(TiedNet):
    """The last stage (``l2`` and the tied ``head``) in one ``opt.checkpoint`` segment."""

    def tail(self, h):
        return self.head(torch.tanh(self.l2(h)))

    def forward(self, x):
        return self.opt.checkpoint(self.tail, torch.tanh(self.l1(self.tok(x))))


@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_a_recomputed_segment_reads_the_replica_recompute_view(memory):
    """tau_fwd = (4, 3, 2), tau_bkwd = (1, 0, 0), tau_recomp = (1, 0, 1): the last stage's activations are
    recomputed with E_{t-1} and W2_{t-1}, its W^T delta reads E_t (hand-derived, SGD, 12 steps, 1e-12)."""
    tf, tb, tr, lr = (4, 3, 2), (1, 0, 0), (1, 0, 1), 0.1
    model = TiedRecompute()
    model.opt = staleopt.PipelineOptimizer(
        model, torch.optim.SGD(model.parameters(), lr=lr), stages=3, memory=memory,
        schedule=schedules.get("custom", tau_fwd=list(tf), tau_bkwd=list(tb), tau_recomp=list(tr)))
    names = ["E", "W1", "b1", "W2", "b2"]
    history = [dict(zip(names, [p.detach().clone() for p in (model.tok.weight, model.l1.weight, model.l1.bias,
                                                               model.l2.weight, model.l2.bias)]))]
    for t, (x, y) in enumerate(_data(12)):
        def at(name, tau):
            return history[max(t - tau, 0)][name]
        e = at("E", tf[0])[x]
        h1 = torch.tanh(e @ at("W1", tf[1]).T + at("b1", tf[1]))
        out = torch.tanh(h1 @ at("W2", tf[2]).T + at("b2", tf[2])) @ at("E", tf[2]).T
        h2r = torch.tanh(h1 @ at("W2", tr[2]).T + at("b2", tr[2]))  # the recomputation
        dlog = 2 * (out - y) / out.numel()
        dz2 = (dlog @ at("E", tb[2])) * (1 - h2r ** 2)
        dz1 = (dz2 @ at("W2", tb[2])) * (1 - h1 ** 2)
        g = {"E": dlog.T @ h2r + torch.zeros(V, D, dtype=torch.float64).index_add_(0, x, dz1 @ at("W1", tb[1])),
             "W1": dz1.T @ e, "b1": dz1.sum(0), "W2": dz2.T @ h1, "b2": dz2.sum(0)}
        history.append({n: history[-1][n] - lr * g[n] for n in names})

        model.opt.zero_grad()
        _mse(model(x), y).backward()
        model.opt.step()
        for n, p in zip(names, (model.tok.weight, model.l1.weight, model.l1.bias, model.l2.weight, model.l2.bias)):
            torch.testing.assert_close(p.detach(), history[-1][n], atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- the executed timeline
WIDTHS = [6, 5, 4, 5, 6]  # 4 stages of Linear + tanh; stage 3 applies stage 0's weight transposed (tied)
MB, LR, MOMENTUM = 3, 0.05, 0.9


class TransposedTied(nn.Module):
    """``x W^T + b`` with ``W`` another module's ``weight`` (registered here: tied) and a bias of its own."""

    def __init__(self, weight, out):
        super().__init__()
        self.weight, self.bias = weight, nn.Parameter(torch.zeros(out, dtype=torch.float64))

    def forward(self, x):
        return x @ self.weight + self.bias


def _tied_mlp(seed=0):
    torch.manual_seed(seed)
    first, l1, l2 = (nn.Linear(a, b).double() for a, b in zip(WIDTHS[:3], WIDTHS[1:4]))
    last = TransposedTied(first.weight, WIDTHS[4])
    with torch.no_grad():
        last.bias.normal_()
    return nn.Sequential(first, nn.Tanh(), l1, nn.Tanh(), l2, nn.Tanh(), last, nn.Tanh())


def execute_tied(method, model, xs, ys, minibatches, microbatches):
    """Run ``simulate(method, ...)`` event by event, each stage with its own weights; stages 0 and 3 each hold a
    copy of the tied matrix (stage 3 reads it transposed). Version ``v`` of the tied matrix is the one after the
    summed updates of minibatches ``0..v-1``, applied once both stages' gradients of a minibatch exist. A pass
    that reads a version not yet made raises: the pipeline cannot provide it causally."""
    from staleopt.timeline import simulate
    mods = [m for m in model if not isinstance(m, nn.Tanh)]
    P, N = 4, microbatches
    tl = simulate(method, stages=P, microbatches=N, minibatches=minibatches)
    E = mods[0].weight.detach().clone()
    own = [[mods[0].bias.detach().clone()]] + [[m.weight.detach().clone(), m.bias.detach().clone()]
                                               for m in mods[1:3]] + [[mods[3].bias.detach().clone()]]
    opts = [torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM) for ps in own]
    tied_opt = torch.optim.SGD([E], lr=LR, momentum=MOMENTUM)
    versions = [[[p.clone() for p in ps]] for ps in own]
    tied = [E.clone()]  # tied[v]: the tied matrix after v summed updates
    grads = [[torch.zeros_like(p) for p in ps] for ps in own]
    pending, tied_grads = {0: torch.zeros_like(E), 3: torch.zeros_like(E)}, {}
    acts, deltas, updates, by_slot = {}, {}, {}, {}
    for stage, slot, t in tl.updates:
        updates.setdefault(slot, []).append((stage, t))
    for e in tl.events:
        by_slot.setdefault(e.slot, []).append(e)
    for slot in range(tl.slots):
        for e in by_slot.get(slot, []):
            i, m = e.stage, e.microbatch
            if i in (0, 3):
                if e.version >= len(tied):
                    raise RuntimeError(f"stage {i} reads version {e.version} of the tied matrix in slot {slot}, "
                                       f"before the summed update of minibatch {e.version - 1} exists")
                W, b = (tied[e.version] if i == 0 else tied[e.version].T), versions[i][e.version][0]
            else:
                W, b = versions[i][e.version]
            if e.kind == "F":
                x_in = xs[m] if i == 0 else acts[(i - 1, m)][1]
                acts[(i, m)] = (x_in, torch.tanh(x_in @ W.T + b))
                continue
            x_in, x_out = acts[(i, m)]
            delta = 2 * (x_out - ys[m]) / (x_out.numel() * N) if i == P - 1 else deltas.pop((i, m))
            dz = delta * (1 - x_out ** 2)
            if i in (0, 3):
                pending[i] += dz.T @ x_in if i == 0 else x_in.T @ dz
            else:
                grads[i][0] += dz.T @ x_in
            grads[i][-1] += dz.sum(0)
            if i > 0:
                deltas[(i - 1, m)] = dz @ W
        for stage, t in updates.get(slot, []):
            for p, g in zip(own[stage], grads[stage]):
                p.grad = g.clone()
                g.zero_()
            opts[stage].step()
            versions[stage].append([p.clone() for p in own[stage]])
            if stage in (0, 3):
                tied_grads.setdefault(t, {})[stage] = pending[stage].clone()
                pending[stage].zero_()
                if len(tied_grads[t]) == 2:  # both copies' gradients: the summed update
                    E.grad = tied_grads[t][0] + tied_grads[t][3]
                    tied_opt.step()
                    tied.append(E.clone())
    return [tied[-1]] + [p for v in versions for p in v[-1]]


def simulate_tied(method, model, xs, ys, minibatches, microbatches):
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                     stages=4, schedule=method, microbatches=microbatches)
    assert [(r.stage, r.owner_stage) for r in opt.replicas] == [(3, 0)]
    N = microbatches
    for t in range(minibatches):
        opt.zero_grad()
        x, y = xs[t * N:(t + 1) * N].reshape(-1, WIDTHS[0]), ys[t * N:(t + 1) * N].reshape(-1, WIDTHS[-1])
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    mods = [m for m in model if not isinstance(m, nn.Tanh)]
    return [mods[0].weight.detach(), mods[0].bias.detach()] + [p.detach() for m in mods[1:3]
                                                                  for p in (m.weight, m.bias)] + [mods[3].bias.detach()]


def _tied_data(K, N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(K * N, MB, WIDTHS[0], generator=g, dtype=torch.float64),
            torch.randn(K * N, MB, WIDTHS[-1], generator=g, dtype=torch.float64))


@pytest.mark.parametrize("method,microbatches", [("gpipe", 3), ("pipedream-flush", 2), ("pipedream-2bw", 4),
                                                 ("pipedream-2bw", 5)])
def test_executed_timeline_with_a_tied_matrix_equals_the_replicas(method, microbatches):
    """Where a pipeline can hold the contract causally (every stage reads the same version: flushes, 2BW), the
    executed pipeline with a copy per stage and summed updates reaches the simulator's weights."""
    K = 25
    xs, ys = _tied_data(K, microbatches)
    executed = execute_tied(method, _tied_mlp(), xs, ys, K, microbatches)
    model = _tied_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    simulated = simulate_tied(method, model, xs, ys, K, microbatches)
    assert max((a - b).abs().max().item() for a, b in zip(executed, simulated)) <= 1e-10
    assert max((p.detach() - q).abs().max().item() for p, q in zip(model.parameters(), before)) > 1e-2


@pytest.mark.parametrize("method", ["dataflow", "pipedream", "1f1b"])
def test_per_stage_delays_ask_the_later_copy_for_a_version_no_causal_pipeline_has(method):
    """With per-stage delays the later stage reads w_{t - tau_3}, newer than any summed update its copy can have
    received (the owner's gradient of that minibatch comes later): docs/design.md §1 states this idealization."""
    xs, ys = _tied_data(12, 1)
    with pytest.raises(RuntimeError, match="stage 3 reads version"):
        execute_tied(method, _tied_mlp(), xs, ys, 12, 1)


def test_the_memory_report_counts_a_replica_in_its_stage():
    """staleopt.hardware prices a tied weight once per stage that holds it, as the wrapper allocates it."""
    from staleopt import hardware
    model = TiedNet()
    tied = hardware.memory_report(model, "gpipe", 3, optimizer="sgd")
    untied = TiedNet()
    untied.head.weight = nn.Parameter(untied.tok.weight.detach().clone())
    plain = hardware.memory_report(untied, "gpipe", 3, optimizer="sgd",
                                   partition=staleopt.partition_model(untied, [1, 2]))
    assert tied.stage_weight_bytes == plain.stage_weight_bytes
    assert tied.stage_weight_bytes[2] - staleopt.partition_model(model, 3)[2].nbytes == V * D * 8


def test_the_memory_report_of_the_engines_partition_counts_a_replica_once():
    """``opt.partition`` already holds a unit per replica (what ``staleopt train`` prices its records from): the
    report adds no second copy (the records of a tied GPT read one embedding matrix too many)."""
    from staleopt import hardware
    model = TiedNet()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3)
    assert opt.partition.replicas
    engine = hardware.memory_report(model, "gpipe", 3, optimizer="sgd", partition=opt.partition)
    assert engine.stage_weight_bytes == hardware.memory_report(model, "gpipe", 3, optimizer="sgd").stage_weight_bytes


@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_gpt2_under_pipemare_matches_the_reference_engine(memory):
    """T1 + T2 on GPT-2's replica (dataflow: its backward view is extrapolated along its own delta)."""
    transformers = pytest.importorskip("transformers")
    results = []
    for cls in (ReferencePipelineOptimizer, staleopt.PipelineOptimizer):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config).double()
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), stages=3, schedule="pipemare",
                  memory=memory, method_args={"anneal_steps": 4})
        g = torch.Generator().manual_seed(3)
        for _ in range(6):
            x = torch.randint(0, 11, (2, 6), generator=g)
            opt.zero_grad()
            model(x, labels=x).loss.backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
        assert len(opt.replicas) == 1
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_copy_or_pickle_of_the_model_carries_no_replica():
    """``copy.deepcopy(model)`` (an EMA or ``AveragedModel``) and ``torch.save(model)`` get inert hooks in place of
    the replica hooks: the copy holds no replica tensor, keeps its own tie, and runs as a plain module."""
    import copy
    import io

    model = TiedNet()
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stages=3,
                                     schedule="dataflow")
    for x, y in _data(3):
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()
    replica = opt.replicas[0].tensor
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        hooks = [h for hs in (twin.head._forward_pre_hooks, twin.head._forward_hooks) for h in hs.values()]
        assert hooks and all(type(h).__name__ == "_Inert" for h in hooks)
        storages = {t.untyped_storage().data_ptr() for t in twin.state_dict().values()}
        assert replica.untyped_storage().data_ptr() not in storages
        assert twin.head.weight is twin.tok.weight  # its own tie
        x = _data(1)[0][0]
        with torch.no_grad():  # (not a training forward: the model reads w_t, as the copy does its own weights)
            assert torch.equal(twin(x), model(x))
        before = model.tok.weight.grad.clone()
        _mse(twin(x), _data(1)[0][1]).backward()  # (a training forward of the copy: its own weights, no engine)
        assert twin.tok.weight.grad is not None and torch.equal(model.tok.weight.grad, before)


class HeadFirst(TiedNet):
    """:class:`TiedNet` with the tied output layer registered first (it owns E by registration) but run last."""

    def __init__(self, seed=0):
        super().__init__(seed)
        modules = dict(self._modules)
        self._modules.clear()
        for name in ("head", "tok", "l1", "l2"):
            self._modules[name] = modules[name]


@pytest.mark.parametrize("method", ["pipedream", "pipemare"])
def test_a_tied_owner_that_runs_last_trains_as_the_registered_in_order_model_with_example_input(method):
    """Registration order puts the head's unit (the owner of E) in stage 0 though it runs last: the wrapper refuses
    (the head, in stage 0, reads E on stage 2's data) and suggests ``partition_model(..., example_input=x)``, which gives E to the module the forward calls first and
    a replica to the head in the last stage: the same stages, replica and steps as :class:`TiedNet`, bit for bit."""
    data = _data(6)
    with pytest.raises(staleopt.errors.SharedParameterError, match=r"partition_model\(model, 3, example_input=x\)"):
        m = HeadFirst()
        opt = staleopt.PipelineOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), stages=3, schedule=method)
        _mse(m(data[0][0]), data[0][1]).backward()
    runs = []
    for cls in (TiedNet, HeadFirst):
        model = cls()
        part = staleopt.partition_model(model, 3, example_input=data[0][0])
        assert [[u.name for u in s.units] for s in part] == [["tok"], ["l1"], ["l2"]]
        opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         stages=part, schedule=method)
        assert [(r.module_name, r.stage) for r in opt.replicas] == [("head", 2)]
        for x, y in data:
            opt.zero_grad()
            _mse(model(x), y).backward()
            opt.step()
        assert model.head.weight is model.tok.weight
        runs.append([p.detach().clone() for p in (model.tok.weight, model.l1.weight, model.l1.bias, model.l2.weight,
                                                 model.l2.bias, opt.replicas[0].tensor)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_per_stage_learning_rate_steps_a_tied_matrix_at_its_owners_factor():
    """PipeMare's T1 gives every stage its own lr factor; the tied matrix takes one update, at its owner's (stage 0)
    factor, not the replica stage's (docs/wrapper.md, Partitioning). Plain SGD: the update is -lr f_0 grad."""
    model = TiedNet()
    lr = 0.05
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr), stages=3, schedule="pipemare")
    (r,) = opt.replicas
    assert (r.owner_stage, r.stage) == (0, 2)
    for x, y in _data(4):
        opt.zero_grad()
        _mse(model(x), y).backward()
        before, grad = model.tok.weight.detach().clone(), model.tok.weight.grad.clone()
        opt.step()
        assert opt.lr_factor(0) != opt.lr_factor(2)
        torch.testing.assert_close(model.tok.weight.detach(), before - lr * opt.lr_factor(0) * grad, rtol=0, atol=1e-15)


def test_a_predicted_replica_steps_with_its_owners_lr_factor():
    """Weight prediction under T1 extrapolated a tied weight's replica with the using stage's factor, a step size
    the weight never takes (it steps once, with the owner's; 1.9e-4 off): a float64 oracle of the forward views
    ``w_v - lr f s dW_v``, ``dW_v`` the last update's gradient (plain SGD), ``f`` the owner's factor."""
    from staleopt.corrections import LRReschedule, WeightPrediction

    lr, K, TF = 0.1, 5, [3, 2, 1]

    class Tied3(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l0, self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.l2.weight = self.l0.weight
            self.double()

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))

    names, owner = ["E", "b0", "W1", "b1", "b2"], {"E": 0, "b0": 0, "W1": 1, "b1": 1, "b2": 2}
    uses = {0: ("E", "b0"), 1: ("W1", "b1"), 2: ("E", "b2")}

    def factors(t):  # T1: tau_i^-(1 - min(t / K, 1))
        return [1 / TF[i] ** (1 - min(t / K, 1)) for i in range(3)]

    m = Tied3()
    opt = staleopt.PipelineOptimizer(m, torch.optim.SGD(m.parameters(), lr=lr), stages=3,
                                     schedule=schedules.get("custom", tau_fwd=TF),
                                     corrections=[WeightPrediction("optimizer"), LRReschedule(K)])
    assert [(r.owner_stage, r.stage) for r in opt.replicas] == [(0, 2)]
    params = (m.l0.weight, m.l0.bias, m.l1.weight, m.l1.bias, m.l2.bias)
    hist, grads = [{n: p.detach().clone() for n, p in zip(names, params)}], [None]
    g = torch.Generator().manual_seed(1)
    for t in range(10):
        x, y = (torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(2))
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()

        def forward_view(i, k):
            v = max(t - TF[i], 0)
            return hist[v][k] if v == 0 else hist[v][k] - lr * factors(v)[owner[k]] * TF[i] * grads[v][k]
        F = [[forward_view(i, k) for k in uses[i]] for i in range(3)]
        h = [x]
        for i in range(3):
            z = h[-1] @ F[i][0].T + F[i][1]
            h.append(torch.tanh(z) if i < 2 else z)
        d, G = 2 * (h[-1] - y) / y.numel(), {k: 0 for k in names}
        for i in reversed(range(3)):
            dz = d * ((1 - h[i + 1] ** 2) if i < 2 else 1)
            G[uses[i][0]] = G[uses[i][0]] + dz.T @ h[i]
            G[uses[i][1]] = G[uses[i][1]] + dz.sum(0)
            d = dz @ hist[t][uses[i][0]]
        hist.append({k: hist[t][k] - lr * factors(t)[owner[k]] * G[k] for k in names})
        grads.append(G)
    assert max(float((p.detach() - hist[-1][k]).abs().max()) for k, p in zip(names, params)) < 1e-12
