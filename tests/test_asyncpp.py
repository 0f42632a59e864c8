"""The AsyncPP method (Ajanthan et al., ICML 2025) against a float64 reference of the authors' update.

The reference follows their code's structure (PluralisResearch/AsyncPP, read, not copied): per stage a
queue of ``P - i`` weight versions, initialised with ``w_0``; the backward loads the oldest version (the
one the forward read), the step updates the newest with NAdam written out from its formula (decoupled
weight decay, ``mu_k = beta1 (1 - 0.5 * 0.96^(k psi))``; the product of the ``mu_j`` in float32, as
``torch.optim.NAdam`` keeps it), and the new weights join the queue. The
gradient is hand-derived (``helpers.oracle_grads``) with every stage at its queued version.
"""
import collections
import math
import warnings

import pytest
import torch

import staleopt
from staleopt import config, hardware, methods, train as train_mod
from staleopt.corrections import RequireNAdam, Stashing
from staleopt.errors import ConfigError, ScheduleError

from helpers import batches, linears, mlp, oracle_grads, snapshot, train

SIZES, LR, WD, BETAS, PSI, EPS = (5, 7, 6, 6, 3), 0.01, 0.01, (0.99, 0.999), 0.004, 1e-8


def nadamw(params):
    return torch.optim.NAdam(params, lr=LR, betas=BETAS, momentum_decay=PSI, weight_decay=WD,
                             decoupled_weight_decay=True)


def reference(data, P):
    """The iterates ``w_1, w_2, ...`` of the authors' update, float64, as lists of (weight, bias) per stage."""
    w = snapshot(mlp(SIZES, seed=4))
    queues = [collections.deque([[x.clone() for x in w[i]] for _ in range(P - i)], maxlen=P - i) for i in range(P)]
    m = [[torch.zeros_like(x) for x in layer] for layer in w]
    v = [[torch.zeros_like(x) for x in layer] for layer in w]
    mu_prod, out = torch.tensor(1.0), []                     # torch keeps prod mu_j as a float32 tensor
    for k, (x, y) in enumerate(data, start=1):
        stashed = [q[0] for q in queues]                     # load_old_params: the version the forward read
        grads = oracle_grads(x, y, stashed, stashed)
        mu = BETAS[0] * (1 - 0.5 * 0.96 ** (k * PSI))
        mu_next = BETAS[0] * (1 - 0.5 * 0.96 ** ((k + 1) * PSI))
        mu_prod *= mu
        prod, prod_next = mu_prod.item(), mu_prod.item() * mu_next
        for i in range(P):
            for j in range(2):
                g = grads[i][j]
                m[i][j] = BETAS[0] * m[i][j] + (1 - BETAS[0]) * g
                v[i][j] = BETAS[1] * v[i][j] + (1 - BETAS[1]) * g * g
                denom = (v[i][j] / (1 - BETAS[1] ** k)).sqrt() + EPS
                decayed = w[i][j] * (1 - LR * WD)
                w[i][j] = decayed - LR * ((1 - mu) / (1 - prod) * g + mu_next / (1 - prod_next) * m[i][j]) / denom
            queues[i].append([x.clone() for x in w[i]])      # the new version joins the stash
        out.append([[x.clone() for x in layer] for layer in w])
    return out


@pytest.mark.parametrize("memory", ["minimal", "fast"])
def test_asyncpp_is_the_authors_nadam_with_stashing_on_1f1b(memory):
    P, data = 4, batches(14, in_dim=SIZES[0], batch=6, seed=8)
    model = mlp(SIZES, seed=4)
    opt = staleopt.PipelineOptimizer(model, nadamw(model.parameters()), stages=P, schedule="asyncpp", memory=memory)
    assert opt.tau_fwd == opt.tau_bkwd == [3, 2, 1, 0]                   # P - 1 - i, forward and backward
    for t, ((x, y), want) in enumerate(zip(data, reference(data, P))):
        train(model, opt, [(x, y)])
        for i, (got, ref) in enumerate(zip(snapshot(model), want)):
            for a, b in zip(got, ref):
                assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), f"step {t}, stage {i}"


def test_the_reference_is_not_pipedream_over_adamw():
    """The look-ahead matters: AdamW with the same settings and stashing moves elsewhere."""
    data = batches(6, in_dim=SIZES[0], batch=6, seed=8)
    model = mlp(SIZES, seed=4)
    opt = staleopt.PipelineOptimizer(model, torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS,
                                                              weight_decay=WD), stages=4, schedule="pipedream")
    train(model, opt, data)
    ref = reference(data, 4)[-1]
    assert not torch.allclose(snapshot(model)[0][0], ref[0][0], rtol=1e-6)


def test_the_method_and_its_optimizer_choice():
    assert [type(c) for c in methods.get("asyncpp").corrections] == [Stashing, RequireNAdam]
    p = methods.build("asyncpp", 8)
    assert p.delays == ([7, 6, 5, 4, 3, 2, 1, 0], [7, 6, 5, 4, 3, 2, 1, 0]) and p.stashes
    assert p.timeline_name == methods.build("pipedream", 8).timeline_name
    cfg = config.RunConfig(method="asyncpp", stages=4, optimizer="nadamw", momentum=0.99, weight_decay=0.01)
    base = train_mod.build_optimizer(cfg, mlp(SIZES).parameters())
    assert type(base) is torch.optim.NAdam
    g = base.param_groups[0]
    assert (g["betas"], g["momentum_decay"], g["decoupled_weight_decay"], g["weight_decay"]) == \
        ((0.99, 0.999), 0.004, True, 0.01)
    assert hardware.OPTIMIZER_SLOTS["nadamw"] == 2


@pytest.mark.parametrize("make, match", [
    (lambda ps: torch.optim.AdamW(ps, lr=LR), "base optimizer is AdamW"),
    (lambda ps: torch.optim.NAdam(ps, lr=LR, betas=BETAS, decoupled_weight_decay=False),
     "decoupled_weight_decay = False"),
    (lambda ps: torch.optim.NAdam(ps, lr=LR, decoupled_weight_decay=True), r"betas\[0\] = 0.9 \(the recipe: 0.99\)"),
])
def test_asyncpp_warns_off_the_authors_optimizer(make, match):
    model = mlp(SIZES)
    with pytest.warns(UserWarning, match=match):
        staleopt.PipelineOptimizer(model, make(model.parameters()), stages=4, schedule="asyncpp")


def test_asyncpp_over_its_optimizer_is_silent():
    model = mlp(SIZES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        staleopt.PipelineOptimizer(model, nadamw(model.parameters()), stages=4, schedule="asyncpp")


def test_the_old_name_says_what_replaced_it():
    for call in (lambda: methods.get("async-nag"), lambda: methods.build("async-nag", 4),
                 lambda: config.RunConfig(method="async-nag", stages=4)):
        with pytest.raises(ScheduleError, match="now 'pipemare-stash-nesterov'.*'asyncpp'"):
            call()
    assert issubclass(ScheduleError, ConfigError)
    assert "async-nag" not in methods.names()


def test_the_nesterov_sgd_variant_is_nesterov_sgd_at_every_delay():
    """pipemare-stash-nesterov over plain SGD = pipemare-stash over SGD(momentum, nesterov=True), bit for bit."""
    data = batches(12, in_dim=SIZES[0], seed=2)
    runs = []
    for method, make in (("pipemare-stash-nesterov", lambda ps: torch.optim.SGD(ps, lr=0.05)),
                         ("pipemare-stash", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True))):
        model = mlp(SIZES, seed=4)
        train(model, staleopt.PipelineOptimizer(model, make(model.parameters()), stages=4, schedule=method), data)
        runs.append(snapshot(model))
    assert max(methods.build("pipemare-stash", 4).delays[0]) == 7
    assert all(torch.equal(a, b) for la, lb in zip(*runs) for a, b in zip(la, lb))
