"""T2's two accumulator conventions and App. B.4's gamma rule in staleopt.theory, against hand-derived
polynomials in float64.

Derivation (z-transform of the update): ``delta_{t+1} = gamma delta_t + (1-gamma)(w_{t+1} - w_t)`` gives
``delta(w) = (1-gamma)(w-1)/(w-gamma) W(w)``; a view ``w_{t-tau} - k delta_{t-s}`` contributes
``w^-tau - k w^-s (1-gamma)(w-1)/(w-gamma)``. Multiplying the update by ``w^tau_fwd (w-gamma)``:
``s = tau_bkwd`` (causal) leaves App. B.4's ``w^(tau_fwd - tau_bkwd)`` on the correction term, ``s = 0``
(current) ``w^tau_fwd``.
"""
import numpy as np
import pytest

from staleopt import theory as T
from staleopt.errors import ConfigError

POINTS = np.array([1.1 + 0.3j, -0.7 + 0.9j, 0.2 - 1.2j, 1.3j, -1.05 - 0.1j])


def hand_polynomial(w, lr, lam, tf, tb, delta, gamma, accumulator, tr=None, phi=0.0):
    """App. B.4 / D.1's T2 polynomial with the correction terms' power ``w^(tf - s)``, ``s`` the accumulator's lag."""
    a = lr
    sb = tb if accumulator == "causal" else 0
    p = (w - 1) * (w - gamma) * w ** tf + a * (lam + delta) * (w - gamma)
    p -= a * (delta - phi) * w ** (tf - tb) * (w - gamma)
    p += a * (delta - phi) * w ** (tf - sb) * (tf - tb) * (1 - gamma) * (w - 1)
    if tr is not None:
        sr = tr if accumulator == "causal" else 0
        p -= a * phi * w ** (tf - tr) * (w - gamma)
        p += a * phi * w ** (tf - sr) * (tf - tr) * (1 - gamma) * (w - 1)
    return p


def matches(c, p_of_w):
    dets = np.array([np.linalg.det(w * np.eye(len(c)) - c) for w in POINTS])
    ps = np.array([p_of_w(w) for w in POINTS])
    return any(np.allclose(dets, POINTS ** k * ps, rtol=1e-9, atol=0) for k in range(-1, len(c) + 1))


CASES = [  # (lr, lam, tf, tb, delta, tr, phi)
    (0.05, 1.0, 6, 2, 3.0, None, 0.0),
    (0.03, 1.5, 9, 4, -2.0, None, 0.0),
    (0.04, 1.0, 10, 1, 10.0, 4, -5.0),      # PipeMare Fig. 16's system
    (0.02, 0.7, 8, 3, 4.0, 5, 2.0),
]


@pytest.mark.parametrize("accumulator", T.ACCUMULATORS)
@pytest.mark.parametrize("rule", [0.1, 0.4, "invariant"])
@pytest.mark.parametrize("lr,lam,tf,tb,delta,tr,phi", CASES)
def test_companion_has_the_hand_derived_polynomial(lr, lam, tf, tb, delta, tr, phi, rule, accumulator):
    gamma = 1 - 2 / (tf - tb + 1) if rule == "invariant" else rule ** (1 / (tf - tb))
    c = T.companion_matrix(lr, lam, tf, tb, delta=delta, correction_decay=rule, tau_recomp=tr, phi=phi,
                           t2_accumulator=accumulator)
    assert c.dtype == np.float64
    assert matches(c, lambda w: hand_polynomial(w, lr, lam, tf, tb, delta, gamma, accumulator, tr, phi))
    other = "current" if accumulator == "causal" else "causal"     # the two conventions differ (tb > 0)
    assert not matches(c, lambda w: hand_polynomial(w, lr, lam, tf, tb, delta, gamma, other, tr, phi))


def test_causal_is_the_default_and_both_agree_without_backward_delay():
    kw = dict(lr=0.05, curvature=1.0, tau_fwd=6, tau_bkwd=2, delta=3.0, correction_decay=0.1)
    assert np.array_equal(T.companion_matrix(**kw), T.companion_matrix(**kw, t2_accumulator="causal"))
    assert not np.allclose(T.spectral_radius(**kw), T.spectral_radius(**kw, t2_accumulator="current"))
    kw.update(tau_bkwd=0)
    assert np.array_equal(T.companion_matrix(**kw), T.companion_matrix(**kw, t2_accumulator="current"))
    a = T.simulate_quadratic(0.05, 1.0, 6, 0, delta=3.0, correction_decay=0.1, steps=80)
    b = T.simulate_quadratic(0.05, 1.0, 6, 0, delta=3.0, correction_decay=0.1, steps=80, t2_accumulator="current")
    assert np.array_equal(a, b)


def test_invariant_rule_is_eq14s_gamma():
    """``"invariant"``: gamma = 1 - 2/(k+1) exactly; the same system as D = invariant_decay(tf, tb) to rounding,
    and (App. B.4) the second derivative at 1 is independent of Delta."""
    assert T.t2_gamma("invariant", 7, 3) == 1 - 2 / 5
    c = T.companion_matrix(0.05, 1.3, 7, 3, delta=3.0, correction_decay="invariant")
    d = T.companion_matrix(0.05, 1.3, 7, 3, delta=3.0, correction_decay=T.invariant_decay(7, 3))
    assert np.allclose(c, d, rtol=1e-14, atol=1e-15)
    second = []
    for delta in (0.0, 3.0, 40.0):
        q = np.poly1d(np.real(np.poly(T.companion_matrix(0.05, 1.3, 7, 3, delta=delta,
                                                        correction_decay="invariant")))[:7 + 3])
        second.append(q.deriv(2)(1.0))
    assert second == pytest.approx([second[0]] * 3, rel=1e-7)


@pytest.mark.parametrize("accumulator", T.ACCUMULATORS)
@pytest.mark.parametrize("lr,lam,tf,tb,delta,tr,phi", CASES)
def test_simulation_follows_the_convention(lr, lam, tf, tb, delta, tr, phi, accumulator):
    """simulate_quadratic (the update rule) equals iterating the companion matrix of the same convention."""
    kw = dict(curvature=lam, tau_fwd=tf, tau_bkwd=tb, delta=delta, correction_decay=0.2, tau_recomp=tr, phi=phi,
              t2_accumulator=accumulator)
    c = T.companion_matrix(lr, **kw)
    steps, w0 = 50, 0.7
    traj = T.simulate_quadratic(lr, steps=steps, noise_std=0.5, seed=3, w0=w0, **kw)
    eta = np.random.default_rng(3).normal(0.0, 0.5, size=steps)
    n_w = max(tf, tb, tr or 0) + 1
    x = np.zeros(len(c))
    x[:n_w] = w0
    inject = np.zeros(len(c))
    inject[0], inject[n_w] = lr, (1 - T.t2_gamma(0.2, tf, tb)) * lr
    for t in range(steps):
        x = c @ x + eta[t] * inject
        assert traj[t + 1] == pytest.approx(x[0], rel=1e-9, abs=1e-12)


def test_bad_convention_and_rule_raise():
    with pytest.raises(ConfigError, match="t2_accumulator"):
        T.companion_matrix(0.1, 1.0, 4, 1, delta=1.0, correction_decay=0.1, t2_accumulator="delayed")
    with pytest.raises(ConfigError, match="invariant"):
        T.companion_matrix(0.1, 1.0, 4, 1, delta=1.0, correction_decay="eq14")
    with pytest.raises(ConfigError, match="t2_accumulator"):
        T.simulate_quadratic(0.1, 1.0, 4, 1, correction_decay=0.1, t2_accumulator="now")


def test_figures_take_the_convention():
    """Fig. 6b and 16 draw T2 with either accumulator; the causal curves are the default (the paper's)."""
    from staleopt.plot import theory as figs
    lrs = np.linspace(0.01, 0.2, 5)
    for fig in (figs.plot_correction_spectrum, figs.plot_recompute_spectrum):
        causal = fig(lrs=lrs).axes[0].lines
        default_t2 = [line.get_ydata() for line in causal if "T2" in line.get_label()][0]
        current = fig(lrs=lrs, t2_accumulator="current").axes[0].lines
        current_t2 = [line.get_ydata() for line in current if "T2" in line.get_label()][0]
        explicit = fig(lrs=lrs, t2_accumulator="causal").axes[0].lines
        assert np.array_equal(default_t2, [line.get_ydata() for line in explicit if "T2" in line.get_label()][0])
        assert not np.allclose(default_t2, current_t2)
