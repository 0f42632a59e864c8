"""staleopt.advise on models whose Hessian is known in closed form."""
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

import staleopt
from staleopt import theory
from staleopt.advisor import Advice, advise, hessian_top_eigenvalue, stage_curvatures
from staleopt.errors import ConfigError
from staleopt.partition import partition_model


class Blocks(nn.Module):
    """``y_hat = sum_i X_i w_i``: one bias-free linear block per stage, each reading its own input columns."""

    def __init__(self, widths):
        super().__init__()
        self.widths = list(widths)
        self.blocks = nn.ModuleList(nn.Linear(w, 1, bias=False) for w in widths)

    def forward(self, x):
        parts = torch.split(x, self.widths, dim=1)
        return sum(b(p) for b, p in zip(self.blocks, parts)).squeeze(1)


def half_mse(out, y):
    return 0.5 * ((out - y) ** 2).mean()


def block_problem(widths, tops, n=64, seed=0, ratio=0.6):
    """X = Q B, Q with orthonormal columns and B block diagonal, so H = X^T X / n = diag(B_i^T B_i / n).

    Block i's spectrum is ``tops[i] * [1, ratio, ratio^2 ...]``: top eigenvalue ``tops[i]``.
    """
    rng = np.random.default_rng(seed)
    D = sum(widths)
    q, _ = np.linalg.qr(rng.normal(size=(n, D)))
    b = np.zeros((D, D))
    off = 0
    for w, top in zip(widths, tops):
        u, _ = np.linalg.qr(rng.normal(size=(w, w)))
        eig = top * ratio ** np.arange(w)
        b[off:off + w, off:off + w] = np.diag(np.sqrt(n * eig)) @ u.T   # B_i^T B_i / n = u diag(eig) u^T
        off += w
    X = q @ b
    y = X @ rng.normal(size=D) + 0.1 * rng.normal(size=n)
    H = X.T @ X / n
    truth, off = [], 0
    for w in widths:
        truth.append(np.linalg.eigvalsh(H[off:off + w, off:off + w])[-1])
        off += w
    return torch.tensor(X), torch.tensor(y), H, truth


def make_model(widths):
    torch.manual_seed(0)
    return Blocks(widths).double()


def test_stage_curvature_within_1_percent_of_closed_form():
    widths, tops = [5, 3, 4], [2.0, 7.5, 0.3]
    X, y, H, truth = block_problem(widths, tops)
    assert np.allclose(truth, tops)
    model = make_model(widths)
    got = stage_curvatures(model, half_mse, (X, y), partition_model(model, 3), iters=50, tol=1e-6)
    for g, t in zip(got, truth):
        assert g.converged and abs(g.value - t) <= 0.01 * t
    # the Hessian really is block diagonal (the stages decouple)
    assert np.abs(H[:5, 5:]).max() < 1e-10


def test_curvature_with_cross_stage_coupling_is_the_diagonal_block():
    """Stage 0 of a coupled problem: the top eigenvalue of H_00, not of H."""
    rng = np.random.default_rng(1)
    X = torch.tensor(rng.normal(size=(50, 6)) @ rng.normal(size=(6, 6)))
    y = torch.tensor(rng.normal(size=50))
    model = make_model([2, 4])
    H = (X.T @ X / 50).numpy()
    got = stage_curvatures(model, half_mse, (X, y), partition_model(model, 2), iters=200, tol=1e-9)
    assert got[0].value == pytest.approx(np.linalg.eigvalsh(H[:2, :2])[-1], rel=1e-4)
    assert got[1].value == pytest.approx(np.linalg.eigvalsh(H[2:, 2:])[-1], rel=1e-4)


def test_negative_dominant_eigenvalue_is_shifted_away():
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    a = torch.diag(torch.tensor([-5.0, 1.0, 2.0], dtype=torch.float64))
    loss = 0.5 * w @ a @ w + w.sum()
    assert hessian_top_eigenvalue(loss, [w], iters=500, tol=1e-10).value == pytest.approx(2.0, rel=1e-5)


def test_indefinite_hessian_with_opposite_dominant_eigenvalues():
    """+-3 dominate: plain power iteration stalls at a mixture; the shifted run finds the top eigenvalue 3."""
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    a = torch.diag(torch.tensor([-3.0, 3.0, 1.0], dtype=torch.float64))
    loss = 0.5 * w @ a @ w
    for seed in range(4):
        got = hessian_top_eigenvalue(loss, [w], iters=300, tol=1e-10, seed=seed)
        assert got.converged and got.value == pytest.approx(3.0, rel=1e-6)
    unconverged = hessian_top_eigenvalue(loss, [w], iters=2, tol=1e-10)
    assert not unconverged.converged and unconverged.value <= 3.0 and unconverged.products == 4


def test_power_iteration_is_seeded():
    X, y, _, _ = block_problem([6], [1.0], ratio=0.95)
    model = make_model([6])
    part = partition_model(model, 1)
    a = stage_curvatures(model, half_mse, (X, y), part, iters=5, seed=3)
    assert a == stage_curvatures(model, half_mse, (X, y), part, iters=5, seed=3)
    assert a != stage_curvatures(model, half_mse, (X, y), part, iters=5, seed=4)


def test_table_combines_curvature_delay_and_t1_factor():
    widths, tops = [3, 3, 3], [1.0, 2.0, 4.0]
    X, y, _, truth = block_problem(widths, tops)
    model = make_model(widths)
    adv = advise(model, half_mse, (X, y), "pipemare-t1", stages=3, lr=0.05, tol=1e-8)
    t = adv.table
    assert list(t.columns) == ["stage", "params", "tau_fwd", "tau_bkwd", "curvature", "max_stable_lr",
                               "lr_factor", "effective_lr", "headroom", "exceeds", "converged"]
    assert t["converged"].all()
    assert list(t["tau_fwd"]) == [5, 3, 1]                      # dataflow, P=3, N=1
    np.testing.assert_allclose(t["lr_factor"], [1 / 5, 1 / 3, 1.0])   # T1 at k=0: 1/tau
    np.testing.assert_allclose(t["curvature"], truth, rtol=1e-6)
    np.testing.assert_allclose(t["max_stable_lr"], theory.lemma1_bound(np.array(truth), [5, 3, 1]), rtol=1e-6)
    np.testing.assert_allclose(t["effective_lr"], 0.05 * t["lr_factor"])
    assert list(t["exceeds"]) == list(t["effective_lr"] >= t["max_stable_lr"])
    assert adv.max_lr == pytest.approx(min(t["max_stable_lr"] / t["lr_factor"]))
    # after annealing (k >= K) T1's factor is 1
    late = advise(model, half_mse, (X, y), "pipemare-t1", stages=3, lr=0.05, step=10 ** 6,
                  method_args={"anneal_steps": 100})
    np.testing.assert_allclose(late.table["lr_factor"], 1.0)
    text = str(adv)
    assert "max_stable_lr" in text and "largest stable lr" in text and "pipemare-t1" in text


def test_momentum_uses_the_momentum_companion_matrix():
    X, y, _, truth = block_problem([3, 3], [1.0, 1.0])
    model = make_model([3, 3])
    adv = advise(model, half_mse, (X, y), "pb", stages=2, lr=0.01, momentum=0.9, tol=1e-8)
    want = theory.max_stable_lr(truth[0], 2, momentum=0.9)
    assert adv.table["max_stable_lr"][0] == pytest.approx(want, rel=1e-5)
    assert adv.table["max_stable_lr"][0] < theory.lemma3_bound(truth[0], 2)


def run_pipeline(model, X, y, lr, steps, method):
    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=lr), stages=2, schedule=method)
    first = None
    for _ in range(steps):
        opt.zero_grad()
        loss = half_mse(model(X), y)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    with torch.no_grad():
        return first, float(half_mse(model(X), y))


@pytest.mark.parametrize("method,taus", [("pb", [2, 0]), ("dataflow", [3, 1])])
def test_advised_lr_separates_divergence_from_convergence(method, taus):
    """Full-batch gradients on decoupled blocks: the advice is exact. Stage 0 binds (stage 1 is flat)."""
    widths, tops = [3, 3], [1.0, 0.2]
    X, y, _, truth = block_problem(widths, tops)
    opt_loss = float(half_mse(X @ torch.linalg.lstsq(X, y).solution, y))
    adv = advise(make_model(widths), half_mse, (X, y), method, stages=2, lr=0.1, tol=1e-8)
    assert list(adv.table["tau_fwd"]) == taus
    assert adv.max_lr == pytest.approx(float(theory.lemma1_bound(truth[0], taus[0])), rel=1e-6)
    first, below = run_pipeline(make_model(widths), X, y, 0.97 * adv.max_lr, 1000, method)
    assert below - opt_loss < 1e-3 * (first - opt_loss)
    first, above = run_pipeline(make_model(widths), X, y, 1.03 * adv.max_lr, 1000, method)
    assert above > 1e3 * first
    assert not advise(make_model(widths), half_mse, (X, y), method, 2, lr=0.97 * adv.max_lr).table["exceeds"].any()
    assert advise(make_model(widths), half_mse, (X, y), method, 2, lr=1.03 * adv.max_lr).table["exceeds"][0]


def test_a_method_holding_nesterov_momentum_gets_the_look_ahead_bound():
    """pipemare-stash-nesterov holds momentum 0.9 in its correction (over SGD without momentum): the bound is the
    look-ahead's companion matrix at the stage's gamma (about 2.5x below Lemma 1's here, which the advisor used to
    print), exact on decoupled blocks; heavy-ball momentum on top is refused."""
    widths, tops = [3, 3], [1.0, 0.2]
    X, y, _, truth = block_problem(widths, tops)
    opt_loss = float(half_mse(X @ torch.linalg.lstsq(X, y).solution, y))
    method = "pipemare-stash-nesterov"
    adv = advise(make_model(widths), half_mse, (X, y), method, stages=2, lr=0.01, tol=1e-8)
    assert list(adv.table["tau_fwd"]) == [3, 1] and list(adv.table["momentum"]) == [0.9, 0.9] and adv.nesterov
    want = theory.max_stable_lr(truth[0], 3, momentum=0.9, nesterov=True)
    assert adv.max_lr == pytest.approx(want, rel=1e-6) and want < 0.5 * float(theory.lemma1_bound(truth[0], 3))
    assert "Nesterov look-ahead companion matrix" in str(adv)
    first, below = run_pipeline(make_model(widths), X, y, 0.97 * adv.max_lr, 2000, method)
    assert below - opt_loss < 1e-3 * (first - opt_loss)
    first, above = run_pipeline(make_model(widths), X, y, 1.1 * adv.max_lr, 2000, method)
    assert above > 1e3 * first
    with pytest.raises(ConfigError, match="holds Nesterov momentum in its correction.*leave momentum=0"):
        advise(make_model(widths), half_mse, (X, y), method, stages=2, lr=0.01, momentum=0.9)


def test_nesterov_bound_is_where_the_delayed_recursion_diverges():
    """theory.max_stable_lr(nesterov=True) against the look-ahead recursion iterated directly (m = gamma m + g,
    w -= lr (g + gamma m), g = lam w_(t - tau)), and at tau = 0 the classic 2 (1 + beta) / ((1 + 2 beta) lam)."""
    def blows_up(lr, lam, tau, gamma, steps=4000):
        w, m = [1.0] * (tau + 1), 0.0
        for _ in range(steps):
            g = lam * w[-1 - tau]
            m = gamma * m + g
            w = (w + [w[-1] - lr * (g + gamma * m)])[-(tau + 1):]
        return abs(w[-1]) > 1.0
    for lam, tau, gamma in ((8.0, 3, 0.9), (2.0, 5, 0.9), (0.5, 1, 0.5)):
        bound = theory.max_stable_lr(lam, tau, momentum=gamma, nesterov=True)
        assert not blows_up(0.97 * bound, lam, tau, gamma) and blows_up(1.03 * bound, lam, tau, gamma)
    assert theory.max_stable_lr(1.0, 0, momentum=0.9, nesterov=True) == pytest.approx(2 * 1.9 / 2.8, rel=1e-9)


def test_zero_curvature_stage_has_no_bound():
    model = make_model([2, 2])
    X = torch.zeros(8, 4, dtype=torch.float64)
    X[:, :2] = torch.randn(8, 2, dtype=torch.float64)
    adv = advise(model, half_mse, (X, torch.zeros(8, dtype=torch.float64)), "dataflow", stages=2, lr=0.1)
    assert adv.table["curvature"][1] == 0.0 and math.isinf(adv.table["max_stable_lr"][1])
    assert not adv.table["exceeds"][1]
    assert isinstance(adv, Advice)


def test_bad_arguments():
    model = make_model([2])
    X, y = torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ConfigError, match="lr"):
        advise(model, half_mse, (X, y), "sync", 1, lr=0.0)
    with pytest.raises(ConfigError, match="inputs, targets"):
        advise(model, half_mse, X, "sync", 1)
    with pytest.raises(ConfigError, match="scalar"):
        advise(model, lambda o, t: (o - t) ** 2, (X, y), "sync", 1)


def test_advise_cli(capsys):
    from staleopt.cli import main

    args = ["advise", "--model", "mlp", "--data", "synthetic", "--method", "pipemare", "--stages", "3",
            "--lr", "0.1", "--iters", "5", "--batch-size", "32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "method=pipemare" in out and "largest stable lr" in out
    assert main(args + ["--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| stage | params | tau_fwd") and len([x for x in lines if x.startswith("| ")]) == 5
    assert main(["advise", "--model", "mlp", "--data", "synthetic", "--method", "nope", "--stages", "3",
                 "--lr", "0.1"]) == 2
    capsys.readouterr()
    assert main(args + ["--warmup-steps", "3"]) == 0   # trained weights: a different curvature
    warm = capsys.readouterr().out
    assert "largest stable lr" in warm and warm != out
    for bad in ("100000", "0"):  # (100000 measured on the whole training set without a word)
        assert main(args[:-1] + [bad]) == 2
        assert f"--batch-size = {bad} must be an int in 1..800" in capsys.readouterr().err
    # accepted, where train refuses them: an infinite lr ("expect divergence"), a negative seed, a T1 step for a
    # method without T1 (ignored)
    for bad, says in ((["--lr", "inf"], "lr must be a finite number > 0"), (["--seed", "-1"], "--seed = -1"),
                      (["--method", "gpipe", "--step", "10"], "method 'gpipe' does not\\s+have")):
        assert main(args + bad) == 2
        assert re.search(says, capsys.readouterr().err)
    assert main(args + ["--method", "pipemare-t1", "--step", "10"]) == 0


def test_curvature_is_the_larger_of_the_two_runs_lower_bounds_and_bad_settings_are_refused():
    """Both power-iteration runs end on a Rayleigh quotient of H, a lower bound of lam_max: when the first run does
    not converge, the shifted run's estimate replaces it only where larger (it can end lower, which made the
    advisor's stable lr too optimistic). iters < 1, tol outside (0, 1) and a NaN rtol are typed errors (before: an
    'inf' stable lr, a bare TypeError, an endless bisection)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(64, 12), torch.randint(0, 4, (64,))
    params = list(model.parameters())
    runs, orig = [], staleopt.advisor._power

    def spy(*args):
        runs.append(orig(*args))
        return runs[-1]
    staleopt.advisor._power = spy
    try:
        for iters in (2, 3, 5, 8):
            runs.clear()
            got = hessian_top_eigenvalue(nn.functional.cross_entropy(model(x), y), params, iters, 1e-10, seed=1)
            if len(runs) == 2:
                assert got.value == max(runs[0][0], runs[1][0] - 1.05 * max(runs[0][2], abs(runs[0][0])))
            assert got.value >= runs[0][0]
    finally:
        staleopt.advisor._power = orig
    for bad in ({"iters": 0}, {"iters": -3}, {"tol": -1.0}, {"tol": float("nan")}, {"tol": 1.5}):
        with pytest.raises(ConfigError, match="iters|tol"):
            hessian_top_eigenvalue(nn.functional.cross_entropy(model(x), y), params, **{"iters": 5, **bad})
        with pytest.raises(ConfigError, match="iters|tol"):
            advise(model, nn.functional.cross_entropy, (x, y), "pipemare", 2, **bad)
    for rtol in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="rtol"):
            theory.max_stable_lr(1.0, 3, rtol=rtol)


def test_advise_on_a_language_model_takes_the_trainers_cross_entropy(capsys):
    """advise used the mean squared error on anything but classification: a language model's logits against token
    ids crashed with torch's size mismatch (or broadcast silently); and a model for another task was not refused."""
    from staleopt.cli import main
    common = ["--method", "pipemare", "--stages", "3", "--lr", "0.01", "--batch-size", "8", "--iters", "3"]
    assert main(["advise", "--model", "gpt", "--data", "text-markov", *common]) == 0
    assert "largest stable lr" in capsys.readouterr().out
    assert main(["advise", "--model", "mlp", "--data", "text-markov", *common]) == 2
    assert "text-markov" in capsys.readouterr().err


def test_a_partition_in_execution_order_gets_each_stages_own_curvature():
    """advise rebuilt the partition on its copy from the cut points, in registration order: with a partition made in
    execution order (the head registered first, run last) stage 0's row showed the head's curvature."""
    from staleopt import advisor, partition

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.body = nn.Linear(16, 4), nn.Linear(8, 16)

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))

    torch.manual_seed(0)
    m = M()
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    part = partition.partition_model(m, 2, example_input=x)
    assert part[0].params[0] is m.body.weight
    advice = advisor.advise(m, nn.functional.cross_entropy, (x, y), "1f1b", part, lr=0.1, iters=200, tol=1e-6)
    direct = advisor.stage_curvatures(m, nn.functional.cross_entropy, (x, y), part, iters=200, tol=1e-6)
    assert list(advice.table["curvature"]) == pytest.approx([c.value for c in direct], rel=1e-4)


def test_advisor_during_training_record_renders_what_its_runs_did(tmp_path):
    """docs/performance.md's "advisor during training" section is rendered from the files of
    experiments/advisor_during_training.py (its numbers were retyped from a run not kept): a short run of the
    script, rendered, gives each run the outcome its losses show and each seed the bound its curvature rows give."""
    import importlib.util

    import pandas as pd

    from staleopt import docgen
    path = docgen.ROOT / "experiments" / "advisor_during_training.py"
    spec = importlib.util.spec_from_file_location("advisor_during_training", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path), "--seeds", "0", "--sync-steps", "0", "3", "--t1-lrs", "0.1", "8",
                        "--steps", "40"]) == 0
    text = docgen.advisor_during_training(tmp_path)
    losses, curv = pd.read_csv(tmp_path / "losses.csv"), pd.read_csv(tmp_path / "curvature.csv")
    big = losses[(losses["method"] == "pipemare-t1") & (losses["lr"] == 8)]
    assert not big["loss"].iloc[-1] <= 100 and big["loss"].iloc[:-1].le(100).all()
    row = next(line for line in text.splitlines() if line.startswith("| 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == f"diverged at step {big['step'].iloc[-1]}"
    small = losses[(losses["method"] == "pipemare-t1") & (losses["lr"] == 0.1)]
    assert len(small) == 40 and cells[-2] == f"40 steps, peak loss {small['loss'].max():.3g}"
    for k, cell in zip((0, 3), cells[1:3]):
        assert cell == f"{curv[curv['sync_steps'] == k]['max_stable_lr'].min():.3g}"
    assert "`pipemare-t1` at lr 8: inside the advisor's bound at initialization for 0 of 1 seeds, diverged within " \
           "40 steps in 1 of 1 runs." in text
