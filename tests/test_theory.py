"""staleopt.theory against PipeMare §3 and App. B, B.2, B.4, D.1 (characteristic polynomials, Lemmas 1-3)."""
import math

import numpy as np
import pytest

from staleopt import theory as T
from staleopt.errors import ConfigError

POINTS = np.array([1.1 + 0.3j, -0.7 + 0.9j, 0.2 - 1.2j, 1.3j, -1.05 - 0.1j])


def paper_polynomial(w, lr, lam, tf, tb=None, delta=0.0, beta=0.0, gamma=None, tr=None, phi=0.0):
    """The characteristic polynomials as printed in PipeMare (eq. 3, eq. 13, eq. 5, App. B.4, App. D.1)."""
    a = lr
    if tr is not None:                                                      # App. D.1
        g = 0.0 if gamma is None else gamma
        p = (w - 1) * (w - g) * w ** tf + a * (lam + delta) * (w - g)
        p -= a * (delta - phi) * w ** (tf - tb) * (w - g)
        p -= a * phi * w ** (tf - tr) * (w - g)
        if gamma is not None:
            p += a * (delta - phi) * w ** (tf - tb) * (tf - tb) * (1 - g) * (w - 1)
            p += a * phi * w ** (tf - tr) * (tf - tr) * (1 - g) * (w - 1)
        return p
    if gamma is not None:                                                   # App. B.4
        return ((w - 1) * (w - gamma) * w ** tf + a * (lam + delta) * (w - gamma)
                - a * delta * w ** (tf - tb) * (w - gamma)
                + a * delta * w ** (tf - tb) * (tf - tb) * (1 - gamma) * (w - 1))
    if tb is not None:                                                      # eq. 5
        return w ** (tf + 1) - w ** tf + a * (lam + delta) - a * delta * w ** (tf - tb)
    if beta:                                                                # eq. 13
        return w ** (tf + 1) - (1 + beta) * w ** tf + beta * w ** (tf - 1) + a * lam
    return w ** (tf + 1) - w ** tf + a * lam                                # eq. 3


def char_poly_matches(c, p_of_w):
    """det(wI - C) == w**k p(w) at several complex points, for some integer k (eq. 13 has w**-1 at tau=0)."""
    dets = np.array([np.linalg.det(w * np.eye(len(c)) - c) for w in POINTS])
    ps = np.array([p_of_w(w) for w in POINTS])
    return any(np.allclose(dets, POINTS ** k * ps, rtol=1e-9, atol=0) for k in range(-1, len(c) + 1))


CASES = [
    # (companion kwargs, paper polynomial kwargs)
    (dict(lr=0.1, curvature=2.0, tau_fwd=0), dict(tf=0)),
    (dict(lr=0.1, curvature=2.0, tau_fwd=1), dict(tf=1)),
    (dict(lr=0.03, curvature=1.5, tau_fwd=7), dict(tf=7)),
    (dict(lr=0.07, curvature=1.5, tau_fwd=5, momentum=0.9), dict(tf=5, beta=0.9)),
    (dict(lr=0.07, curvature=1.5, tau_fwd=1, momentum=0.5), dict(tf=1, beta=0.5)),
    (dict(lr=0.07, curvature=1.5, tau_fwd=0, momentum=0.5), dict(tf=0, beta=0.5)),
    (dict(lr=0.05, curvature=1.0, tau_fwd=6, tau_bkwd=2, delta=3.0), dict(tf=6, tb=2, delta=3.0)),
    (dict(lr=0.05, curvature=1.0, tau_fwd=6, tau_bkwd=0, delta=-4.0), dict(tf=6, tb=0, delta=-4.0)),
    (dict(lr=0.05, curvature=1.0, tau_fwd=6, tau_bkwd=2, delta=3.0, correction_decay=0.1),
     dict(tf=6, tb=2, delta=3.0, gamma=0.1 ** (1 / 4))),
    (dict(lr=0.05, curvature=1.0, tau_fwd=5, tau_bkwd=0, delta=2.0, correction_decay=0.3),
     dict(tf=5, tb=0, delta=2.0, gamma=0.3 ** (1 / 5))),
    (dict(lr=0.04, curvature=1.0, tau_fwd=10, tau_bkwd=1, delta=10.0, tau_recomp=4, phi=-5.0),
     dict(tf=10, tb=1, delta=10.0, tr=4, phi=-5.0)),
    (dict(lr=0.04, curvature=1.0, tau_fwd=10, tau_bkwd=1, delta=10.0, tau_recomp=4, phi=-5.0,
          correction_decay=0.1), dict(tf=10, tb=1, delta=10.0, tr=4, phi=-5.0, gamma=0.1 ** (1 / 9))),
]


@pytest.mark.parametrize("kw,paper", CASES)
def test_companion_matrix_has_the_papers_characteristic_polynomial(kw, paper):
    c = T.companion_matrix(**kw)
    assert c.dtype == np.float64
    assert char_poly_matches(c, lambda w: paper_polynomial(w, kw["lr"], kw["curvature"], **paper))
    # and a wrong polynomial (other step size) does not match: the check can fail
    assert not char_poly_matches(c, lambda w: paper_polynomial(w, 1.3 * kw["lr"], kw["curvature"], **paper))


def test_plain_companion_is_the_papers_matrix():
    """§3.1: first row [1, 0, ..., 0, -alpha lam], ones on the subdiagonal."""
    c = T.companion_matrix(0.2, 3.0, 3)
    want = np.array([[1, 0, 0, -0.6], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]], dtype=float)
    np.testing.assert_allclose(c, want, rtol=1e-15, atol=0)


def test_no_discrepancy_means_delta_is_irrelevant():
    a = T.companion_matrix(0.1, 1.0, 4, delta=0.0)
    np.testing.assert_allclose(T.companion_matrix(0.1, 1.0, 4, tau_bkwd=4, delta=7.0), a, atol=1e-15)


@pytest.mark.parametrize("lam", [0.1, 1.0, 13.0])
def test_lemma1_is_tight(lam):
    for tau in range(41):
        got, bound = T.max_stable_lr(lam, tau), float(T.lemma1_bound(lam, tau))
        assert abs(got - bound) <= 1e-6 * bound, (tau, got, bound)


@pytest.mark.parametrize("tau", [0, 1, 4, 17, 40])
def test_lemma1_root_on_unit_circle(tau):
    """App. B: at the bound a root sits at exp(i pi/(2 tau + 1))."""
    eig = np.linalg.eigvals(T.companion_matrix(float(T.lemma1_bound(2.0, tau)), 2.0, tau))
    assert np.min(np.abs(eig - np.exp(1j * np.pi / (2 * tau + 1)))) < 1e-8
    assert T.spectral_radius(0.999 * T.lemma1_bound(2.0, tau), 2.0, tau) < 1
    assert T.spectral_radius(1.001 * T.lemma1_bound(2.0, tau), 2.0, tau) > 1


@pytest.mark.parametrize("tf,tb", [(10, 6), (40, 10), (3, 0)])
def test_lemma2_crossing_from_the_proof(tf, tb):
    """App. B.3: for theta in (0, pi/(2 tf + 1)) the proof's alpha(theta), Delta(theta) put a root at exp(i theta)."""
    lam = 1.0
    for frac in (0.2, 0.5, 0.9):
        th = frac * np.pi / (2 * tf + 1)
        s, d = (tf + tb + 1) * th / 2, (tf - tb) * th / 2
        alpha = 2 * np.sin(s) * np.sin(th / 2) / (lam * np.cos(d))
        delta = lam / 2 * (1 / (np.tan(d) * np.tan(s)) - 1)
        assert delta > 0
        eig = np.linalg.eigvals(T.companion_matrix(alpha, lam, tf, tb, delta=delta))
        assert np.min(np.abs(eig - np.exp(1j * th))) < 1e-8
        assert T.max_stable_lr(lam, tf, tb, delta=delta) <= alpha * (1 + 1e-9)
        assert alpha <= T.lemma2_bound(lam, tf, tb, delta) * (1 + 1e-12)


def test_lemma2_bounds_max_stable_lr():
    for tf, tb in [(2, 0), (10, 6), (25, 3), (40, 10)]:
        for delta in (0.1, 1.0, 5.0, 50.0):
            assert T.max_stable_lr(0.7, tf, tb, delta=delta) <= T.lemma2_bound(0.7, tf, tb, delta)
    with pytest.raises(ConfigError):
        T.lemma2_bound(1.0, 3, 3, 1.0)


def _lemma3_crossing(lam, tau, beta):
    """App. B.2's construction: theta from beta, then alpha with a root (1-iy)/(1+iy) on the unit circle."""
    m = 2 * tau + 1

    def h(th):  # (1-beta)/(1+beta) as a function of theta, decreasing from 1 (theta=0) to 0 (theta=pi/2)
        a = np.cos(th - 2 * th / m)
        return (a - np.cos(th)) / (a + np.cos(th)) - (1 - beta) / (1 + beta)

    lo, hi = 1e-12, np.pi / 2 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if h(mid) < 0 else (lo, mid)
    th = lo
    y = np.tan(th / m)
    alpha = 2 * abs(1 - beta * (1 + 1j * y) / (1 - 1j * y)) * np.sin(th / m) / lam
    return alpha, (1 - 1j * y) / (1 + 1j * y)


@pytest.mark.parametrize("tau", [1, 3, 10, 30])
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9, 0.99])
def test_lemma3_some_lr_below_the_bound_is_unstable(tau, beta):
    lam = 2.5
    alpha, w = _lemma3_crossing(lam, tau, beta)
    c = T.companion_matrix(alpha, lam, tau, momentum=beta)
    assert np.min(np.abs(np.linalg.eigvals(c) - w)) < 1e-7         # the proof's root is an eigenvalue
    assert abs(abs(w) - 1) < 1e-12
    bound = T.lemma3_bound(lam, tau)
    assert alpha <= bound
    first = T.max_stable_lr(lam, tau, momentum=beta)
    assert first <= alpha * (1 + 1e-9)
    assert T.spectral_radius(first * (1 + 1e-6), lam, tau, momentum=beta) >= 1.0


def test_momentum_one_is_never_stable():
    assert T.max_stable_lr(1.0, 5, momentum=1.0) == 0.0


def test_t2_stable_range_at_least_uncorrected():
    """App. B.4: with gamma from eq. 14, T2 never shrinks the stable range for Delta > 0 (tau_fwd <= 40)."""
    for tf in (1, 2, 5, 12, 25, 40):
        for tb in sorted({0, tf // 2, tf - 1}):
            d = T.invariant_decay(tf, tb)
            for delta in (0.5, 3.0, 20.0, 100.0):
                orig = T.max_stable_lr(1.0, tf, tb, delta=delta)
                t2 = T.max_stable_lr(1.0, tf, tb, delta=delta, correction_decay=d)
                assert t2 >= orig * (1 - 1e-9), (tf, tb, delta, orig, t2)


def test_fig6b_t2_with_d_0p1_brings_the_threshold_toward_no_discrepancy():
    """Fig. 6(b): tau_fwd=10, tau_bkwd=6, Delta=5, D=0.1."""
    orig = T.max_stable_lr(1.0, 10, 6, delta=5.0)
    t2 = T.max_stable_lr(1.0, 10, 6, delta=5.0, correction_decay=0.1)
    assert orig < t2 < T.lemma1_bound(1.0, 10)


def test_invariant_decay_limit_is_exp_minus_2():
    for k in (10, 100, 1000, 10 ** 5):
        assert abs(T.invariant_decay(k, 0) / math.exp(-2) - 1) < 5.0 / k ** 2
    assert abs(T.invariant_decay(10 ** 5 + 7, 7) - 0.135) < 1e-3


def _derivatives_at_1(c, deg):
    """p(1), p'(1), p''(1) of the degree-deg polynomial p with det(wI - C) = w**k p(w)."""
    q = np.real(np.poly(c))
    p = np.poly1d(q[:deg + 1])                     # w**k p(w): drop the trailing zero coefficients
    assert np.allclose(q[deg + 1:], 0, atol=1e-9)
    return p(1.0), p.deriv(1)(1.0), p.deriv(2)(1.0)


def test_eq14_gamma_makes_second_derivative_independent_of_delta():
    """App. B.4: p(1) = a lam (1-g), p'(1) = a lam + 1 - g; p''(1) loses Delta iff g = 1 - 2/(tf - tb + 1)."""
    tf, tb, lr, lam = 7, 3, 0.05, 1.3
    gamma = 1 - 2 / (tf - tb + 1)
    got = []
    for delta in (0.0, 3.0, 40.0):
        c = T.companion_matrix(lr, lam, tf, tb, delta=delta, correction_decay=T.invariant_decay(tf, tb))
        p0, p1, p2 = _derivatives_at_1(c, tf + 2)
        assert p0 == pytest.approx(lr * lam * (1 - gamma), rel=1e-8)
        assert p1 == pytest.approx(lr * lam + 1 - gamma, rel=1e-8)
        got.append(p2)
    assert got == pytest.approx([2 * tf * (1 - gamma) + 2] * 3, rel=1e-7)
    other = [_derivatives_at_1(T.companion_matrix(lr, lam, tf, tb, delta=dl, correction_decay=0.5), tf + 2)[2]
             for dl in (0.0, 40.0)]
    assert abs(other[0] - other[1]) > 1e-3


@pytest.mark.parametrize("kw", [c[0] for c in CASES])
def test_simulation_equals_companion_iteration(kw):
    """simulate_quadratic (update rule) == X_{t+1} = C X_t + alpha eta_t (e_w + (1-gamma) e_delta)."""
    kw = dict(kw)
    lr = kw.pop("lr")
    c = T.companion_matrix(lr, **kw)
    steps, w0 = 60, 0.7
    traj = T.simulate_quadratic(lr, steps=steps, noise_std=0.5, seed=3, w0=w0, **kw)
    eta = np.random.default_rng(3).normal(0.0, 0.5, size=steps)
    tf = kw["tau_fwd"]
    tb = kw.get("tau_bkwd", tf)
    n_w = max(tf, tb, kw.get("tau_recomp") or 0, 1 if kw.get("momentum") else 0) + 1
    x = np.zeros(len(c))
    x[:n_w] = w0
    inject = np.zeros(len(c))
    inject[0] = lr
    if len(c) > n_w:
        inject[n_w] = (1 - T.t2_gamma(kw["correction_decay"], tf, tb)) * lr
    for t in range(steps):
        x = c @ x + eta[t] * inject
        assert traj[t + 1] == pytest.approx(x[0], rel=1e-9, abs=1e-12)


def test_fig5a_tau_10_diverges_at_alpha_0p2():
    """§3.1 Fig. 5(a): lam = 1, alpha = 0.2, eta ~ N(0, 1): tau = 5 stays bounded, tau = 10 diverges."""
    assert np.max(np.abs(T.simulate_quadratic(0.2, 1.0, 5, steps=1000))) < 20
    assert np.abs(T.simulate_quadratic(0.2, 1.0, 10, steps=1000)[-1]) > 1e6


def test_delayed_regression_diverges_at_the_lemma1_curve():
    """Fig. 5(b) on a small least-squares problem: below 0.8x the Lemma 1 bound finite, above 1.25x diverged."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 4)) * np.array([2.0, 1.0, 0.5, 0.3])
    y = X @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * rng.normal(size=300)
    lam = T.regression_curvature(X)
    assert lam == pytest.approx(np.linalg.eigvalsh(X.T @ X / 300)[-1])
    taus = [0, 3, 10]
    bound = T.lemma1_bound(lam, np.array(taus))
    losses = T.delayed_sgd_regression(X, y, lrs=[1.0], taus=taus, steps=1, batch_size=300)
    assert losses.shape == (1, 3)
    below = np.array([T.delayed_sgd_regression(X, y, [0.8 * b], [t], steps=1500, batch_size=300)[0, 0]
                      for b, t in zip(bound, taus)])
    above = np.array([T.delayed_sgd_regression(X, y, [1.25 * b], [t], steps=1500, batch_size=300)[0, 0]
                      for b, t in zip(bound, taus)])
    assert np.all(np.isfinite(below)) and np.all(below < 0.1)
    assert np.all(np.isinf(above))


def test_bad_arguments_raise_typed_errors():
    with pytest.raises(ConfigError, match="curvature"):
        T.max_stable_lr(0.0, 3)
    with pytest.raises(ConfigError, match="tau_recomp"):
        T.companion_matrix(0.1, 1.0, 3, 1, phi=2.0)
    with pytest.raises(ConfigError, match="tau_fwd"):
        T.companion_matrix(0.1, 1.0, -1)
    with pytest.raises(ConfigError, match="correction_decay"):
        T.companion_matrix(0.1, 1.0, 3, 1, correction_decay=1.0)


def test_every_figure_draws_on_a_given_axis():
    from matplotlib.figure import Figure

    from staleopt.plot.theory import FIGURES

    cheap = {"5a": dict(steps=50), "5b": dict(lrs=[0.01, 0.1, 1.0], taus=[0, 5], steps=20),
             "6a": dict(steps=50), "6b": dict(lrs=[0.05, 0.1]), "10": dict(deltas=[-5.0, 5.0]),
             "16": dict(lrs=[0.05, 0.1])}
    assert set(cheap) == set(FIGURES)
    for name, fn in FIGURES.items():
        fig = Figure()
        ax = fig.add_subplot()
        assert fn(ax=ax, **cheap[name]) is fig
        assert ax.lines or ax.collections, name


def test_theory_cli_writes_png(tmp_path):
    from staleopt.cli import main

    assert main(["theory", "--figure", "6b", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "fig6b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from staleopt.plot.theory import write_figures
    with pytest.raises(ConfigError, match="unknown theory figure"):
        write_figures(["7"], str(tmp_path))


def test_bad_theory_inputs_are_config_errors():
    """They were a ZeroDivisionError (a negative delay in max_stable_lr), negative 'bounds' (lemma 1 and 2 with a
    negative delay or curvature), a LinAlgError (a NaN step size) and an accepted tau_recomp > tau_fwd."""
    calls = [lambda: T.max_stable_lr(1.0, -1), lambda: T.lemma1_bound(1.0, -1),
             lambda: T.lemma1_bound(-1.0, 3), lambda: T.lemma2_bound(-1.0, 3, 1, 1.0),
             lambda: T.lemma3_bound([1.0, 2.0], [3, -2]),
             lambda: T.max_stable_lr(1, 3, 1, delta=2, tau_recomp=5, phi=1),
             lambda: T.spectral_radius(float("nan"), 1, 2)]
    for call in calls:
        with pytest.raises(ConfigError):
            call()
    assert T.lemma1_bound([1.0, 2.0], [0, 3]).shape == (2,)


def test_regression_with_zero_targets_is_not_diverged():
    """y = 0: w_0 = 0 is optimal and stays put, loss 0 (the divergence limit was 0 and the test ``loss < D * 0``:
    every run was reported diverged, inf)."""
    X = np.random.default_rng(0).normal(size=(50, 3))
    out = T.delayed_sgd_regression(X, np.zeros(50), [0.01, 0.5], [0, 3], steps=20)
    assert out.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_regression_divergence_does_not_depend_on_the_data_scale():
    """The runs are linear in y and the step sizes scale with 1/curvature: the same cells diverge whatever the scale
    of X or y (a weight limit from y alone called converging runs on X ~ 1e-8 diverged, and tiny y as well)."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 3))
    y = X @ np.array([1.0, -1.0, 2.0]) + 0.1 * rng.normal(size=200)
    lrs, taus = np.array([0.3, 0.8, 3.0]) / T.regression_curvature(X), [0, 2, 5]
    ref = T.delayed_sgd_regression(X, y, lrs, taus, steps=400, batch_size=200)
    assert np.isfinite(ref[0]).all() and np.isinf(ref[2]).all()
    for sx in (1e-8, 1e8):
        got = T.delayed_sgd_regression(sx * X, sx * y, lrs / sx ** 2, taus, steps=400, batch_size=200)
        assert np.array_equal(np.isfinite(got), np.isfinite(ref)), sx
    tiny = T.delayed_sgd_regression(X, 1e-170 * y, lrs, taus, steps=400, batch_size=200)
    assert np.array_equal(np.isfinite(tiny), np.isfinite(ref))
    half = T.delayed_sgd_regression(X, y * 2.0 ** -40, lrs, taus, steps=400, batch_size=200)
    assert np.array_equal(half, ref * 2.0 ** -80)                 # exactly: y / 2**k is the same run


@pytest.mark.parametrize("kw", [
    dict(batch_size=0), dict(batch_size=-1), dict(batch_size=True), dict(batch_size=2.0),
    dict(steps=-5), dict(steps=1.5),
    dict(taus=[]), dict(taus=3), dict(taus=[1.5]), dict(taus=[True]), dict(taus="12"),
    dict(lrs=[]), dict(lrs=[float("nan")]), dict(lrs=[-0.1]), dict(lrs="a"), dict(lrs=[[0.1]]),
    dict(y=np.ones(49)), dict(y=np.ones((50, 1))), dict(X=np.ones(50)), dict(X=np.full((50, 3), np.inf)),
    dict(X=np.zeros((0, 3)), y=np.zeros(0)), dict(diverged_above=0.5), dict(diverged_above=float("nan")),
])
def test_regression_bad_arguments_are_config_errors(kw):
    """Each was accepted silently (batch_size=0: every cell inf; steps=-5: the initial loss) or a raw numpy error."""
    args = dict(X=np.random.default_rng(0).normal(size=(50, 3)), y=np.ones(50), lrs=[0.01], taus=[1], steps=5)
    args.update(kw)
    with pytest.raises(ConfigError):
        T.delayed_sgd_regression(**args)


BAD_MODEL_ARGS = [  # what companion_matrix refuses, simulate_quadratic (the same model) refuses with the same words
    dict(tau_fwd=2, tau_bkwd=0, delta=1.0, tau_recomp=5, phi=0.5),       # tau_recomp outside [tau_bkwd, tau_fwd]
    dict(lr=float("nan")), dict(curvature=float("inf")), dict(momentum=float("nan")), dict(delta=float("-inf")),
    dict(curvature="1"), dict(lr=True), dict(phi=None, tau_recomp=2), dict(tau_fwd=2.0), dict(tau_bkwd=True),
    dict(correction_decay=2.0), dict(correction_decay="eq14", tau_bkwd=2),  # D checked where T2 does not act too
    dict(tau_bkwd=0, correction_decay=True), dict(t2_accumulator="now"),
]


@pytest.mark.parametrize("kw", BAD_MODEL_ARGS)
def test_simulation_checks_its_arguments_as_the_companion_matrix(kw):
    args = dict(lr=0.1, curvature=1.0, tau_fwd=2)
    args.update(kw)
    with pytest.raises(ConfigError) as matrix:
        T.companion_matrix(**args)
    with pytest.raises(ConfigError) as simulation:
        T.simulate_quadratic(steps=5, **args)
    assert str(simulation.value) == str(matrix.value)


@pytest.mark.parametrize("kw", [dict(noise_std=-1.0), dict(noise_std=float("inf")), dict(noise_std="1"),
                                dict(w0=float("nan")), dict(w0="1"), dict(steps=-1)])
def test_simulation_checks_noise_and_start(kw):
    """noise_std = -1 was numpy's raw ValueError, w0 = nan an all-nan trajectory."""
    with pytest.raises(ConfigError):
        T.simulate_quadratic(0.1, 1.0, 2, **kw)


def test_simulation_takes_numpy_numbers():
    a = T.simulate_quadratic(np.float32(0.25), np.int64(1), np.int64(3), delta=np.float64(0.0), steps=30)
    assert np.array_equal(a, T.simulate_quadratic(float(np.float32(0.25)), 1.0, 3, steps=30))


def test_lemma_bounds_take_whole_delays_and_finite_numbers():
    """A delay is a whole number of optimizer steps, as everywhere else (_delay); tau=2.5 and True gave bounds,
    delta=inf the 'bound' 0, strings raw ValueErrors."""
    calls = [lambda: T.lemma1_bound(1.0, 2.5), lambda: T.lemma1_bound(1.0, True), lambda: T.lemma1_bound(1.0, 3.0),
             lambda: T.lemma1_bound(1.0, np.float64(3)), lambda: T.lemma1_bound(1.0, [1, 2.5]),
             lambda: T.lemma1_bound(1.0, np.array([True])), lambda: T.lemma1_bound(1.0, [1, [2]]),
             lambda: T.lemma1_bound("a", 2), lambda: T.lemma1_bound(True, 2), lambda: T.lemma1_bound(None, 2),
             lambda: T.lemma1_bound([1.0, 2.0], [1, 2, 3]), lambda: T.lemma3_bound(1.0, 2.5),
             lambda: T.lemma2_bound(1.0, 4, 2, float("inf")), lambda: T.lemma2_bound(1.0, 4, 2, float("nan")),
             lambda: T.lemma2_bound(1.0, 4, 2, "x"), lambda: T.lemma2_bound("1", 4, 2, 1.0),
             lambda: T.lemma2_bound(1.0, 4.0, 2, 1.0), lambda: T.max_stable_lr("x", 3)]
    for i, call in enumerate(calls):
        with pytest.raises(ConfigError):
            call()
            pytest.fail(f"call {i} accepted")
    assert T.lemma1_bound(np.float32(2.0), np.int64(3)) == T.lemma1_bound(2.0, 3) == 2 / 2 * np.sin(np.pi / 14)
    assert T.lemma1_bound(1.0, np.arange(4, dtype=np.uint8)).shape == (4,)
    assert T.lemma2_bound(np.int64(1), np.int64(4), 2, np.int64(1)) == T.lemma2_bound(1.0, 4, 2, 1.0)
    # a float array is tau read as real, to draw the bound as a curve (Fig. 5b's line)
    tt = np.linspace(0.0, 5.0, 11)
    assert np.allclose(T.lemma1_bound(1.0, tt), 2 * np.sin(np.pi / (4 * tt + 2)))


def test_nesterov_is_a_bool():
    """nesterov="no" turned the look-ahead on (bool("no") is True)."""
    for bad in ("no", "False", 1, None, 0.0):
        with pytest.raises(ConfigError, match="nesterov"):
            T.companion_matrix(0.1, 1.0, 4, momentum=0.9, nesterov=bad)
        with pytest.raises(ConfigError, match="nesterov"):
            T.max_stable_lr(1.0, 4, momentum=0.9, nesterov=bad)
    on = T.companion_matrix(0.1, 1.0, 4, momentum=0.9, nesterov=True)
    assert np.array_equal(T.companion_matrix(0.1, 1.0, 4, momentum=0.9, nesterov=np.bool_(True)), on)
    assert on.shape != T.companion_matrix(0.1, 1.0, 4, momentum=0.9, nesterov=False).shape


def test_t2_decay_is_any_real_number_but_a_bool():
    """np.int64(0) was refused where 0 and np.float64(0) were taken."""
    assert T.t2_gamma(np.int64(0), 2, 0) == T.t2_gamma(0, 2, 0) == T.t2_gamma(np.float64(0), 2, 0) == 0.0
    assert T.t2_gamma(np.float32(0.25), 2, 0) == pytest.approx(0.5)
    c = T.companion_matrix(0.05, 1.0, 6, 2, delta=3.0, correction_decay=np.int64(0))
    assert np.array_equal(c, T.companion_matrix(0.05, 1.0, 6, 2, delta=3.0, correction_decay=0.0))
    for bad in (True, False, "0.1", float("nan"), 1, -0.1, None):
        with pytest.raises(ConfigError, match="correction_decay"):
            T.t2_gamma(bad, 2, 0)
