"""The quadratic model of fixed-delay pipeline-parallel SGD (PipeMare §3, App. B, App. D.1).

PipeMare analyses asynchronous pipeline-parallel SGD on the one-dimensional
quadratic ``f(w) = curvature * w**2 / 2`` with gradient samples

    g_t = (lam + Delta) u_fwd - (Delta - Phi) u_bkwd - Phi u_recomp - eta_t     (§3.2 eq. 5, App. D.1)
    u_fwd = w_{t-tau_fwd},  u_bkwd = w_{t-tau_bkwd},  u_recomp = w_{t-tau_recomp}

and the heavy-ball update ``w_{t+1} - w_t = beta (w_t - w_{t-1}) - alpha g_t``
(App. B.2; ``beta = 0`` is plain SGD, eq. 1). ``Delta`` is the gradient's
sensitivity to forward/backward delay discrepancy, ``Phi`` its sensitivity to
the recompute delay. With ``u_fwd == u_bkwd`` the sample is ``lam * w`` whatever
``Delta`` is.

T2 (PipeMare §3.2, App. B.4, D.1) replaces the stale backward (and recompute)
weights by an extrapolation along the accumulator ``delta_t``::

    u_bkwd = w_{t-tau_bkwd}   - (tau_fwd - tau_bkwd)   delta_{t-tau_bkwd}
    u_recomp = w_{t-tau_recomp} - (tau_fwd - tau_recomp) delta_{t-tau_recomp}
    delta_{t+1} = gamma delta_t + (1 - gamma)(w_{t+1} - w_t),   gamma = D**(1/(tau_fwd - tau_bkwd))

Which accumulator a view reads is a named choice, ``t2_accumulator``:

* ``"causal"`` (default): the backward pass of the gradient applied at step
  ``t`` runs at step ``t - tau_bkwd`` and reads the accumulator as it is then,
  ``delta_{t-tau_bkwd}`` (the recomputation: ``delta_{t-tau_recomp}``). This is
  the convention whose characteristic polynomial App. B.4 prints,

      p(w) = (w-1)(w-gamma) w^tau_fwd + alpha(lam+Delta)(w-gamma)
             - alpha Delta w^(tau_fwd-tau_bkwd) (w-gamma)
             + alpha Delta w^(tau_fwd-tau_bkwd) (tau_fwd-tau_bkwd)(1-gamma)(w-1);

* ``"current"``: every view reads ``delta_t``, the accumulator at the step
  that applies the gradient (what :class:`staleopt.corrections.DiscrepancyCorrection`
  does today); the last term's power becomes ``w^tau_fwd``. It uses updates a
  real pipeline does not have yet when its backward pass runs.

The two agree when ``tau_bkwd = 0`` (and ``tau_recomp = 0``). ``gamma`` is
``D**(1/(tau_fwd - tau_bkwd))`` for a decay ``D`` or, with
``correction_decay="invariant"``, App. B.4's ``gamma = 1 - 2/(k+1)``,
``k = tau_fwd - tau_bkwd``, which makes the polynomial's second derivative at
``w = 1`` independent of ``Delta`` (eq. 14). The correction acts only where
``tau_fwd > tau_bkwd``.

Everything is numpy float64. The recurrence is linear, so it is stable for
every bounded noise exactly when the spectral radius of its companion matrix is
below 1 (PipeMare §3.1).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Union

import numpy as np

from .errors import ConfigError
from .validate import check_fraction, check_int

__all__ = ["ACCUMULATORS", "check_accumulator", "companion_matrix", "spectral_radius", "max_stable_lr",
           "lemma1_bound", "lemma2_bound", "lemma3_bound", "t2_gamma", "invariant_decay", "simulate_quadratic",
           "regression_curvature", "delayed_sgd_regression"]


def _delay(name: str, value) -> int:
    return check_int(name, value, 0, why="a delay in optimizer steps")


def _number(name: str, value) -> float:
    """``float(value)`` if ``value`` is a finite real number (a Python or NumPy int or float, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name} = {value!r} must be a finite number (a Python or NumPy int or float)")
    return float(value)


def _numbers(name: str, value, integral: bool = False, bools: bool = False) -> np.ndarray:
    """``value`` (a number or an array of them, not bools unless ``bools``) as a float64 array; with
    ``integral``, of ints only."""
    try:
        a = np.asarray(value)
    except (TypeError, ValueError):                               # e.g. a ragged list
        a = np.asarray(None)
    if a.dtype.kind not in ("iu" if integral else "iuf") + ("b" if bools else ""):
        what = "a delay in optimizer steps: an int >= 0 (Python or NumPy, not a bool) or an array of them" \
            if integral else "a number or an array of numbers" + ("" if bools else " (not bools)")
        raise ConfigError(f"{name} = {value!r} must be {what}")
    return a.astype(float)


#: T2's accumulator conventions (module docstring): the views read ``delta_{t - tau}`` or ``delta_t``.
ACCUMULATORS = ("causal", "current")


def check_accumulator(value: str, what: str = "t2_accumulator", error: type = ConfigError) -> str:
    """``value`` if it names one of :data:`ACCUMULATORS`, else ``error`` saying the choices (the one check of
    the convention's name, for theory and for :class:`~staleopt.corrections.DiscrepancyCorrection`)."""
    if value not in ACCUMULATORS:
        raise error(f"{what} must be one of {ACCUMULATORS} ('causal': a view reads delta_(t - tau), PipeMare "
                    f"App. B.4; 'current': delta_t), got {value!r}")
    return value


def t2_gamma(correction_decay: Union[float, str], tau_fwd: int, tau_bkwd: int) -> float:
    """T2's per-stage decay rate for ``tau_fwd > tau_bkwd``: ``gamma = D**(1/(tau_fwd - tau_bkwd))`` (PipeMare
    §3.2), or App. B.4's ``1 - 2/(tau_fwd - tau_bkwd + 1)`` for ``correction_decay="invariant"``."""
    if tau_fwd <= tau_bkwd:
        raise ConfigError(f"T2 needs tau_fwd > tau_bkwd, got tau_fwd={tau_fwd}, tau_bkwd={tau_bkwd}")
    d = _decay(correction_decay)
    if d == "invariant":
        return 1.0 - 2.0 / (tau_fwd - tau_bkwd + 1)
    return d ** (1.0 / (tau_fwd - tau_bkwd))


def _decay(correction_decay) -> Union[float, str]:
    """T2's decay ``D`` as a float in [0, 1) (a Python or NumPy number, not a bool), or ``"invariant"``."""
    if isinstance(correction_decay, str) and correction_decay == "invariant":
        return correction_decay
    if isinstance(correction_decay, bool) or not isinstance(correction_decay, numbers.Real):
        raise ConfigError(f"correction_decay must be a number D in [0, 1) or 'invariant' (App. B.4's "
                          f"gamma = 1 - 2/(k+1)), got {correction_decay!r}")
    d = float(correction_decay)
    if not 0.0 <= d < 1.0:
        raise ConfigError(f"correction_decay D must lie in [0, 1), got {correction_decay!r} "
                          "(D = 1 never updates the accumulator; PipeMare uses D near 0.1)")
    return d


def invariant_decay(tau_fwd: int, tau_bkwd: int) -> float:
    """T2's decay ``D = gamma**(tau_fwd - tau_bkwd)`` for ``gamma = 1 - 2/(tau_fwd - tau_bkwd + 1)`` (App. B.4 eq. 14).

    With this ``gamma`` the second derivative at ``w = 1`` of the T2 characteristic
    polynomial does not depend on ``Delta``; as the delay gap grows, ``D -> exp(-2) ~ 0.135``.
    """
    k = _delay("tau_fwd", tau_fwd) - _delay("tau_bkwd", tau_bkwd)
    if k < 1:
        raise ConfigError(f"invariant_decay needs tau_fwd > tau_bkwd, got {tau_fwd} and {tau_bkwd}")
    return (1.0 - 2.0 / (k + 1)) ** k


def _model(lr, curvature, tau_fwd, tau_bkwd, delta, momentum, correction_decay, tau_recomp, phi, t2_accumulator,
           nesterov):
    """The one check of the quadratic model's arguments, for :func:`companion_matrix` (``_system``) and
    :func:`simulate_quadratic` alike: ``(alpha, lam, Delta, Phi, beta, tau_fwd, tau_bkwd, tau_recomp, causal,
    gamma, nesterov)`` as floats, ints and bools; ``gamma`` is None without T2 (no ``correction_decay``, or
    ``tau_fwd <= tau_bkwd``)."""
    tf = _delay("tau_fwd", tau_fwd)
    tb = tf if tau_bkwd is None else _delay("tau_bkwd", tau_bkwd)
    alpha, lam, dlt, phi, beta = (_number(name, value) for name, value in (
        ("lr", lr), ("curvature", curvature), ("delta", delta), ("phi", phi), ("momentum", momentum)))
    if tau_recomp is None:
        if phi != 0.0:
            raise ConfigError(f"phi={phi!r} is the sensitivity to the recompute delay: also pass tau_recomp")
        tr = tb
    else:
        tr = _delay("tau_recomp", tau_recomp)
        if not (tr == tb or min(tb, tf) <= tr <= max(tb, tf)):
            raise ConfigError(f"tau_recomp={tr} must lie between tau_bkwd={tb} and tau_fwd={tf} (a recomputation "
                              "happens after the forward pass and before the backward pass, PipeMare App. D.1)")
    if not isinstance(nesterov, (bool, np.bool_)):
        raise ConfigError(f"nesterov = {nesterov!r} must be True or False (True: Nesterov's look-ahead momentum)")
    causal = check_accumulator(t2_accumulator) == "causal"
    if correction_decay is not None:
        _decay(correction_decay)   # checked even where T2 does not act (tau_fwd <= tau_bkwd)
    gamma = t2_gamma(correction_decay, tf, tb) if correction_decay is not None and tf > tb else None
    return alpha, lam, dlt, phi, beta, tf, tb, tr, causal, gamma, bool(nesterov)


def _system(lr, curvature, tau_fwd, tau_bkwd, delta, momentum, correction_decay, tau_recomp, phi,
            t2_accumulator="causal", nesterov=False):
    """Coefficients of ``w_{t+1} = sum_k a[k] w_{t-k} + sum_k b[k] d_{t-k}``, and ``gamma`` (None without T2).
    ``nesterov``: the momentum is Nesterov's look-ahead in the update (Sutskever et al. 2013; ``torch.optim.SGD(
    nesterov=True)`` and :class:`~staleopt.corrections.NesterovLookahead`): the step ``-alpha g_t`` becomes
    ``-alpha ((1 + beta) g_t - beta g_{t-1})``, with the heavy-ball term ``beta (w_t - w_{t-1})`` as before."""
    alpha, lam, dlt, phi, beta, tf, tb, tr, causal, gamma, nesterov = _model(
        lr, curvature, tau_fwd, tau_bkwd, delta, momentum, correction_decay, tau_recomp, phi, t2_accumulator, nesterov)
    corrected = gamma is not None
    jb, jr = (tb, tr) if causal else (0, 0)  # the views read delta_{t-jb}, delta_{t-jr}
    look = nesterov and beta != 0.0          # the gradient also enters one step later: one more w (and delta)
    a = np.zeros(max(tf, tb, tr, 1 if beta else 0) + 1 + look)
    b = np.zeros(max(jb, jr) + 1 + look) if corrected else None
    a[0] += 1.0 + beta                       # w_t + beta (w_t - w_{t-1})
    if beta:
        a[1] -= beta
    for k, shift in ((1.0 + beta, 0), (-beta, 1)) if look else ((1.0, 0),):  # Nesterov: (1+beta) g_t - beta g_{t-1}
        a[tf + shift] -= k * alpha * (lam + dlt)     # - alpha (lam + Delta) u_fwd
        a[tb + shift] += k * alpha * (dlt - phi)     # + alpha (Delta - Phi) u_bkwd
        a[tr + shift] += k * alpha * phi             # + alpha Phi u_recomp
        if corrected:                                # u_bkwd, u_recomp extrapolated with delta (T2)
            b[jb + shift] -= k * alpha * (dlt - phi) * (tf - tb)
            b[jr + shift] -= k * alpha * phi * (tf - tr)
    return a, b, gamma


def companion_matrix(lr: float, curvature: float, tau_fwd: int, tau_bkwd: Optional[int] = None,
                     delta: float = 0.0, momentum: float = 0.0,
                     correction_decay: Optional[Union[float, str]] = None, tau_recomp: Optional[int] = None,
                     phi: float = 0.0, t2_accumulator: str = "causal", nesterov: bool = False) -> np.ndarray:
    """Companion matrix ``C`` of the quadratic model: ``X_{t+1} = C X_t`` (+ noise), float64.

    The state is ``X_t = [w_t, w_{t-1}, ..., w_{t-L}]`` and, with T2, also
    ``[delta_t, ..., delta_{t-M}]`` (``L`` the largest delay, at least 1 with
    momentum; ``M = max(tau_bkwd, tau_recomp)`` with ``t2_accumulator="causal"``,
    0 with ``"current"``; module docstring). ``tau_bkwd=None`` means
    ``tau_bkwd = tau_fwd`` (no discrepancy). Its characteristic polynomial is,
    up to a factor ``w**k``:

    * plain delayed SGD: ``w^(tau+1) - w^tau + alpha lam`` (PipeMare eq. 3);
    * momentum: ``w^(tau+1) - (1+beta) w^tau + beta w^(tau-1) + alpha lam`` (App. B.2 eq. 13);
    * discrepancy: ``w^(tf+1) - w^tf + alpha (lam+Delta) - alpha Delta w^(tf-tb)`` (§3.2 eq. 5);
    * T2 with ``correction_decay=D`` (or ``"invariant"``): App. B.4's polynomial, or with
      ``t2_accumulator="current"`` its last term times ``w^tau_bkwd`` (module docstring);
    * recompute (``tau_recomp``, ``phi``), with or without T2: App. D.1's polynomial;
    * ``nesterov=True`` with ``momentum=beta``: the look-ahead in the update, ``w^(tau+2) - (1+beta) w^(tau+1) +
      beta w^tau + alpha lam ((1+beta) w - beta)`` for plain delays (:class:`~staleopt.corrections.NesterovLookahead`,
      ``torch.optim.SGD(nesterov=True)``; not in PipeMare, which analyses heavy-ball momentum only).
    """
    a, b, gamma = _system(lr, curvature, tau_fwd, tau_bkwd, delta, momentum, correction_decay, tau_recomp, phi,
                          t2_accumulator, nesterov)
    nw = len(a)
    nd = 0 if b is None else len(b)
    c = np.zeros((nw + nd, nw + nd))
    c[0, :nw] = a
    c[1:nw, :nw - 1] += np.eye(nw - 1)       # shift the w history
    if nd:
        c[0, nw:] = b
        # delta_{t+1} = gamma delta_t + (1 - gamma)(w_{t+1} - w_t)
        c[nw, :nw] = (1.0 - gamma) * a
        c[nw, 0] -= 1.0 - gamma
        c[nw, nw:] = (1.0 - gamma) * b
        c[nw, nw] += gamma
        c[nw + 1:, nw:nw + nd - 1] += np.eye(nd - 1)
    return c


def spectral_radius(lr: float, curvature: float, tau_fwd: int, tau_bkwd: Optional[int] = None,
                    delta: float = 0.0, momentum: float = 0.0, correction_decay: Optional[Union[float, str]] = None,
                    tau_recomp: Optional[int] = None, phi: float = 0.0, t2_accumulator: str = "causal",
                    nesterov: bool = False) -> float:
    """Largest eigenvalue magnitude of :func:`companion_matrix` (same arguments); < 1 means stable."""
    c = companion_matrix(lr, curvature, tau_fwd, tau_bkwd, delta, momentum, correction_decay, tau_recomp, phi,
                         t2_accumulator, nesterov)
    return float(np.max(np.abs(np.linalg.eigvals(c))))


def max_stable_lr(curvature: float, tau_fwd: int, tau_bkwd: Optional[int] = None, delta: float = 0.0,
                  momentum: float = 0.0, correction_decay: Optional[Union[float, str]] = None,
                  tau_recomp: Optional[int] = None, phi: float = 0.0, *, grid: int = 96,
                  rtol: float = 1e-12, t2_accumulator: str = "causal", nesterov: bool = False) -> float:
    """The first step size at which the quadratic model stops being stable (spectral radius < 1).

    Returns ``sup{a : spectral_radius(x) < 1 for all 0 < x < a}``: the end of the
    stable interval that starts at ``lr -> 0+``. Found by scanning ``grid``
    geometrically spaced step sizes from ``~1e-6/(curvature (tau+1))`` up to the
    first unstable one (doubling from ``4/curvature`` to bracket it) and then
    bisecting to relative width ``rtol``. For plain delayed SGD this is Lemma 1's
    bound exactly (the stable set is an interval, App. B).

    Edge cases of the non-monotone stable set (``Delta < 0``, recompute):
    stable islands above the first unstable step size are ignored, and an
    unstable gap narrower than the grid spacing (a ratio ``(hi/lo)**(1/(grid-1))``
    between neighbours: about 17-23% at the default) can be missed. Returns
    ``0.0`` when the system is unstable for arbitrarily small step sizes (e.g.
    ``momentum=1``), and ``inf`` when no unstable step size exists below
    ``2**64 * 4/curvature``.
    """
    lam = _number("curvature", curvature)
    if not lam > 0.0:
        raise ConfigError(f"curvature must be a finite number > 0, got {curvature!r} "
                          "(a direction with curvature <= 0 puts no bound on the step size)")
    check_int("grid", grid, 2)
    check_fraction("rtol", rtol)
    args = (curvature, tau_fwd, tau_bkwd, delta, momentum, correction_decay, tau_recomp, phi)
    _system(1.0, *args, t2_accumulator=t2_accumulator, nesterov=nesterov)  # (checks the arguments first)

    def stable(lr):
        return spectral_radius(lr, *args, t2_accumulator=t2_accumulator, nesterov=nesterov) < 1.0

    taus = [t for t in (tau_fwd, tau_bkwd, tau_recomp) if t is not None]
    lo = 1e-6 / ((lam + abs(float(delta)) + abs(float(phi))) * (max(taus) + 1))
    if not stable(lo):
        return 0.0
    hi = 4.0 / lam
    for _ in range(64):
        if not stable(hi):
            break
        hi *= 2.0
    else:
        return math.inf
    lrs = np.geomspace(lo, hi, grid)
    for x in lrs[1:]:
        if not stable(x):
            hi = float(x)
            break
        lo = float(x)
    while hi - lo > rtol * lo:
        mid = 0.5 * (lo + hi)
        if stable(mid):
            lo = mid
        else:
            hi = mid
    return lo


def lemma1_bound(curvature, tau):
    """PipeMare Lemma 1 (§3.1): delayed SGD is stable iff ``0 < alpha < (2/lam) sin(pi/(4 tau + 2))``.

    Tight: at this step size a root of eq. 3 reaches the unit circle at
    ``exp(i pi/(2 tau + 1))`` (App. B). Accepts numpy arrays (curvatures > 0, delays >= 0).
    A delay is a whole number of optimizer steps: an int (Python or NumPy, not a
    bool), or a sequence or integer array of them. A float array (ndim >= 1) is
    read as real ``tau``, to draw the bound as a curve in ``tau`` (Fig. 5b).
    """
    lam = _numbers("curvature", curvature)
    if isinstance(tau, np.ndarray) and tau.ndim and tau.dtype.kind == "f":
        taus = tau.astype(float)                                   # real tau: the bound as a curve
    else:
        taus = _numbers("tau", tau, integral=True)
    if not (np.all(lam > 0) and np.all(np.isfinite(lam))) or not (np.all(taus >= 0) and np.all(np.isfinite(taus))):
        raise ConfigError(f"the bound needs curvature > 0 (finite) and delays tau >= 0, got curvature={curvature!r}, "
                          f"tau={taus.tolist()!r}")
    try:
        np.broadcast_shapes(lam.shape, taus.shape)
    except ValueError:
        raise ConfigError(f"curvature (shape {lam.shape}) and tau (shape {taus.shape}) do not broadcast: give one "
                          "of them as a number, or both with the same shape") from None
    return 2.0 / lam * np.sin(np.pi / (4.0 * taus + 2.0))


def lemma2_bound(curvature: float, tau_fwd: int, tau_bkwd: int, delta: float) -> float:
    """PipeMare Lemma 2 (§3.2): for ``Delta > 0`` some step size at or below this bound is unstable.

    ``min(2/(Delta (tau_fwd - tau_bkwd)), (2/lam) sin(pi/(4 tau_fwd + 2)))``, with
    ``tau_fwd > tau_bkwd``; it is an upper bound on :func:`max_stable_lr`, not tight.
    """
    tf, tb = _delay("tau_fwd", tau_fwd), _delay("tau_bkwd", tau_bkwd)
    lam, dlt = _number("curvature", curvature), _number("delta", delta)   # (delta = inf: no bound, not 0)
    if tf <= tb or not dlt > 0.0:
        raise ConfigError(f"Lemma 2 needs tau_fwd > tau_bkwd and delta > 0, got tau_fwd={tau_fwd}, "
                          f"tau_bkwd={tau_bkwd}, delta={delta!r}")
    return float(min(2.0 / (dlt * (tf - tb)), lemma1_bound(lam, tf)))


def lemma3_bound(curvature, tau):
    """PipeMare Lemma 3 (App. B.2): for momentum ``0 < beta <= 1`` some ``alpha <= (4/lam) sin(pi/(4 tau + 2))``
    is unstable.

    An upper bound on :func:`max_stable_lr` with momentum, for every ``beta``.
    """
    return 2.0 * lemma1_bound(curvature, tau)


def simulate_quadratic(lr: float, curvature: float, tau_fwd: int, tau_bkwd: Optional[int] = None,
                       delta: float = 0.0, steps: int = 200, noise_std: float = 1.0, seed: int = 0,
                       correction_decay: Optional[Union[float, str]] = None, momentum: float = 0.0,
                       tau_recomp: Optional[int] = None, phi: float = 0.0, w0: float = 1.0,
                       t2_accumulator: str = "causal") -> np.ndarray:
    """Run the quadratic model for ``steps`` steps; returns ``[w_0, ..., w_steps]`` (PipeMare Fig. 5a, 6a).

    Written from the update rule, independently of :func:`companion_matrix`::

        g_t = (lam + Delta) u_fwd - (Delta - Phi) u_bkwd - Phi u_recomp - eta_t,  eta_t ~ N(0, noise_std^2)
        w_{t+1} = w_t + beta (w_t - w_{t-1}) - alpha g_t

    with ``w_{t-k} = w_0`` and ``delta_{t-k} = 0`` before step 0 and T2's views
    as in the module docstring (``t2_accumulator``: which ``delta`` they read).
    A diverging run overflows to ``inf``/``nan``. The arguments are checked as
    :func:`companion_matrix` checks them (one check), ``noise_std`` finite ``>= 0``
    and ``w0`` finite.
    """
    lr, curvature, delta, phi, momentum, tf, tb, tr, causal, gamma, _ = _model(
        lr, curvature, tau_fwd, tau_bkwd, delta, momentum, correction_decay, tau_recomp, phi, t2_accumulator, False)
    check_int("steps", steps, 0)
    noise_std, w0 = _number("noise_std", noise_std), _number("w0", w0)
    if noise_std < 0.0:
        raise ConfigError(f"noise_std = {noise_std!r} must be >= 0 (the standard deviation of the gradient noise)")
    corrected = gamma is not None
    gamma = gamma if corrected else 0.0
    rng = np.random.default_rng(seed)
    noise = rng.normal(0.0, noise_std, size=steps) if noise_std else np.zeros(steps)
    w = np.empty(steps + 1)
    d = np.zeros(steps + 1)
    w[0] = w0

    def w_at(t):  # w_{t}, and w_0 before step 0
        return w[max(t, 0)]

    def d_at(t):  # delta_t, and 0 before step 0
        return d[t] if t >= 0 else 0.0

    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(steps):
            u_fwd = w_at(t - tf)
            u_bkwd = w_at(t - tb) - ((tf - tb) * d_at(t - tb if causal else t) if corrected else 0.0)
            u_rec = w_at(t - tr) - ((tf - tr) * d_at(t - tr if causal else t) if corrected else 0.0)
            g = (curvature + delta) * u_fwd - (delta - phi) * u_bkwd - phi * u_rec - noise[t]
            w[t + 1] = w[t] + momentum * (w[t] - w_at(t - 1)) - lr * g
            d[t + 1] = gamma * d[t] + (1.0 - gamma) * (w[t + 1] - w[t])
    return w


def regression_curvature(X: np.ndarray) -> float:
    """Largest curvature of the least-squares loss ``(1/2n) ||X w - y||^2``: top eigenvalue of ``X^T X / n``."""
    X = np.asarray(X, dtype=float)
    return float(np.linalg.eigvalsh(X.T @ X / X.shape[0])[-1])


def delayed_sgd_regression(X: np.ndarray, y: np.ndarray, lrs: Sequence[float], taus: Sequence[int],
                           steps: int = 3000, batch_size: int = 32, seed: int = 0,
                           diverged_above: float = 1e6) -> np.ndarray:
    """Final loss of fixed-delay minibatch SGD on least squares, for every ``(lr, tau)`` (PipeMare Fig. 5b).

    Runs ``w_{t+1} = w_t - alpha grad f_{B_t}(w_{t-tau})`` from ``w_0 = 0`` with
    ``f(w) = (1/2n) ||X w - y||^2`` and the same seeded minibatches ``B_t`` for
    every cell (all cells at once, vectorized). Returns an array of shape
    ``(len(lrs), len(taus))`` holding the final full-data loss, ``inf`` where the
    loss exceeded ``diverged_above`` times the initial loss.

    ``X`` is ``(n, d)`` and ``y`` ``(n,)``, finite; ``lrs`` finite ``>= 0`` and
    ``taus`` ints ``>= 0``, neither empty; ``batch_size >= 1`` (drawn with
    replacement), ``steps >= 0``, ``diverged_above >= 1``. A run that ends at or
    below ``diverged_above`` times the initial loss is not diverged, so with
    ``y = 0`` (``w_0 = 0`` optimal) every run keeps loss 0.
    """
    X, y = _numbers("X", X, bools=True), _numbers("y", y, bools=True)
    if X.ndim != 2 or X.size == 0 or y.ndim != 1 or len(y) != len(X):
        raise ConfigError(f"X must be an (n, d) array and y an (n,) array, n, d >= 1, got shapes {X.shape} and "
                          f"{y.shape}: one row of X per target")
    if not (np.isfinite(X).all() and np.isfinite(y).all()):
        raise ConfigError("X and y must be finite (they hold nan or inf): drop or impute those rows")
    n, dim = X.shape
    lrs = _numbers("lrs", lrs)
    if lrs.ndim != 1 or not lrs.size or not (np.isfinite(lrs).all() and (lrs >= 0).all()):
        raise ConfigError(f"lrs must be a non-empty sequence of finite step sizes >= 0, got {lrs.tolist()!r}")
    try:
        tau = np.array([_delay("tau", t) for t in taus], dtype=np.int64)
    except TypeError:                                      # not iterable (a single number)
        tau = np.array([], dtype=np.int64)
    if isinstance(taus, (str, bytes)) or not tau.size:
        raise ConfigError(f"taus must be a non-empty sequence of delays (ints >= 0), got {taus!r}")
    check_int("steps", steps, 0)
    check_int("batch_size", batch_size, 1, why="samples per minibatch")
    diverged_above = _number("diverged_above", diverged_above)
    if not diverged_above >= 1.0:
        raise ConfigError(f"diverged_above = {diverged_above!r} must be >= 1 (a factor on the initial loss: below "
                          "1 a run that does not move would count as diverged)")
    # the runs are linear in y (w_0 = 0): run on y / 2**e, exactly, so that y @ y neither under- nor overflows
    e = int(np.frexp(np.abs(y).max())[1])
    y = np.ldexp(y, -e)
    grid_lr = np.repeat(lrs, len(tau))                    # run r = (i_lr, i_tau), row-major
    grid_tau = np.tile(tau, len(lrs))
    runs, slots = len(grid_lr), int(tau.max()) + 1
    hist = np.zeros((slots, runs, dim))                   # ring buffer of w_{t-k}; w_{t<0} = w_0 = 0
    w = np.zeros((runs, dim))
    alive = np.ones(runs, dtype=bool)
    rng = np.random.default_rng(seed)
    rows = np.arange(runs)
    # a residual r of the stale weights on one sample means a full loss >= r^2 / (2n): past this limit the loss is
    # over 1e6 times what counts as diverged, which only divergence reaches; freezing such runs avoids float overflow.
    # (With y = 0 the limit and every residual are 0: nothing is frozen.)
    limit = 1e3 * math.sqrt(diverged_above * float(y @ y))
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(steps):
            hist[t % slots] = w
            stale = hist[(t - grid_tau) % slots, rows]
            idx = rng.integers(0, n, size=batch_size)
            xb, yb = X[idx], y[idx]
            resid = stale @ xb.T - yb
            w = w - grid_lr[:, None] * (resid @ xb / batch_size)
            blown = ~(np.abs(resid).max(axis=1) <= limit) | ~np.isfinite(w).all(axis=1)
            if blown.any():                                # freeze diverged runs at 0, mark them
                alive &= ~blown
                w[blown] = 0.0
                hist[:, blown] = 0.0
        loss = 0.5 * np.mean((w @ X.T - y) ** 2, axis=1)
    loss0 = 0.5 * float(y @ y) / n
    loss[~alive | ~(loss <= diverged_above * loss0)] = np.inf
    with np.errstate(over="ignore"):                     # (a loss beyond float64's range: inf)
        return np.ldexp(loss, 2 * e).reshape(len(lrs), len(tau))
