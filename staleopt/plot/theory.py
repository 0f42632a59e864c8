"""Figures of the quadratic-model theory (PipeMare Fig. 5a, 5b, 6a, 6b, 10, 16), from :mod:`staleopt.theory`.

Each function takes an optional matplotlib ``ax`` and returns the figure;
defaults are the paper's settings. ``FIGURES`` maps the paper's figure
number to its function.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .. import theory as T
from ..errors import ConfigError, DataError

__all__ = ["plot_delay_trajectories", "plot_lr_delay_heatmap", "plot_discrepancy_trajectories",
           "plot_correction_spectrum", "plot_stable_lr_vs_sensitivity", "plot_recompute_spectrum",
           "diabetes_regression", "FIGURES", "write_figures"]


def _axes(ax, figsize=(5.0, 3.6)):
    """A new figure (no pyplot, so no GUI backend; ``savefig`` renders with Agg) or ``ax``'s figure."""
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _loss_curves(ax, runs, curvature, title):
    """Plot f(w_t) = lam w_t^2 / 2 per run on a log axis; a diverged run is drawn until it overflows."""
    for label, w in runs:
        with np.errstate(over="ignore", invalid="ignore"):
            loss = 0.5 * curvature * w ** 2
        ax.plot(np.arange(len(w)), np.where(np.isfinite(loss), loss, np.nan), lw=1.0, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("iteration t")
    ax.set_ylabel(r"loss $\lambda w_t^2/2$")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


def plot_delay_trajectories(taus: Sequence[int] = (0, 5, 10), lr: float = 0.2, curvature: float = 1.0,
                            steps: int = 500, noise_std: float = 1.0, seed: int = 0, ax=None):
    """Fig. 5(a): for fixed ``alpha``, a larger delay ``tau`` makes the quadratic model diverge (§3.1)."""
    fig, ax = _axes(ax)
    runs = [(rf"$\tau={t}$", T.simulate_quadratic(lr, curvature, t, steps=steps, noise_std=noise_std, seed=seed))
            for t in taus]
    _loss_curves(ax, runs, curvature, rf"delayed SGD, $\lambda={curvature:g}$, $\alpha={lr:g}$, "
                                      r"$\eta_t\sim N(0,1)$")
    return fig


def diabetes_regression() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's diabetes data (442 x 10, shipped with the package), columns and target standardized."""
    try:
        from sklearn.datasets import load_diabetes
    except ImportError:  # pragma: no cover - scikit-learn is a test extra
        raise DataError("Fig. 5b uses scikit-learn's diabetes data: pip install scikit-learn "
                        "(or pass your own X, y)") from None
    X, y = load_diabetes(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    return X, (y - y.mean()) / y.std()


def plot_lr_delay_heatmap(X: Optional[np.ndarray] = None, y: Optional[np.ndarray] = None,
                          lrs: Optional[Sequence[float]] = None, taus: Sequence[int] = tuple(range(0, 41, 2)),
                          steps: int = 3000, batch_size: int = 32, seed: int = 0, ax=None):
    """Fig. 5(b): final loss of delayed minibatch SGD on linear regression over (tau, alpha); red = diverged.

    Default data: :func:`diabetes_regression` (the paper used cpusmall). The
    black curve is Lemma 1's bound with the objective's largest curvature.
    """
    import matplotlib
    from matplotlib import colors

    if X is None or y is None:
        X, y = diabetes_regression()
    lam = T.regression_curvature(X)
    if lrs is None:
        lrs = np.geomspace(1e-3, 1.0, 31)
    lrs, taus = np.asarray(lrs, dtype=float), np.asarray(taus)
    loss = T.delayed_sgd_regression(X, y, lrs, taus, steps=steps, batch_size=batch_size, seed=seed)
    fig, ax = _axes(ax, (5.4, 3.8))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="tab:red")
    finite = loss[np.isfinite(loss)]
    norm = colors.LogNorm(vmin=finite.min(), vmax=finite.max()) if finite.size else None
    dt = (taus[1] - taus[0]) / 2 if len(taus) > 1 else 0.5
    ratio = np.sqrt(lrs[1] / lrs[0]) if len(lrs) > 1 else 2.0
    mesh = ax.pcolormesh(np.append(taus - dt, taus[-1] + dt), np.append(lrs / ratio, lrs[-1] * ratio),
                         np.ma.masked_invalid(loss), cmap=cmap, norm=norm, shading="flat")
    fig.colorbar(mesh, ax=ax, label="final loss (red: diverged)")
    tt = np.linspace(max(taus[0], 0), taus[-1], 200)
    ax.plot(tt, T.lemma1_bound(lam, tt), color="black", lw=1.5,
            label=rf"Lemma 1, $\lambda_{{max}}={lam:.2f}$")
    ax.set_yscale("log")
    ax.set_ylim(lrs[0] / ratio, lrs[-1] * ratio)
    ax.set_xlabel(r"delay $\tau$")
    ax.set_ylabel(r"step size $\alpha$")
    ax.set_title(f"delayed SGD, linear regression (n={len(y)}, d={X.shape[1]}), T={steps}", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    return fig


def plot_discrepancy_trajectories(deltas: Sequence[float] = (0.0, 3.0, 5.0), lr: float = 0.1,
                                  curvature: float = 1.0, tau_fwd: int = 10, tau_bkwd: int = 6,
                                  steps: int = 500, noise_std: float = 1.0, seed: int = 0, ax=None):
    """Fig. 6(a): a larger discrepancy sensitivity ``Delta`` diverges at fixed ``alpha``, ``tau`` (§3.2 eq. 5)."""
    fig, ax = _axes(ax)
    runs = [(rf"$\Delta={d:g}$", T.simulate_quadratic(lr, curvature, tau_fwd, tau_bkwd, delta=d, steps=steps,
                                                      noise_std=noise_std, seed=seed)) for d in deltas]
    _loss_curves(ax, runs, curvature, rf"$\tau_{{fwd}}={tau_fwd}$, $\tau_{{bkwd}}={tau_bkwd}$, "
                                      rf"$\lambda={curvature:g}$, $\alpha={lr:g}$")
    return fig


def _spectrum(ax, curves, lrs, title):
    for label, color, kw in curves:
        ax.plot(lrs, [T.spectral_radius(a, **kw) for a in lrs], lw=1.2, color=color, label=label)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel(r"step size $\alpha$")
    ax.set_ylabel("largest |eigenvalue|")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


def plot_correction_spectrum(delta: float = 5.0, correction_decay: float = 0.1, curvature: float = 1.0,
                             tau_fwd: int = 10, tau_bkwd: int = 6,
                             lrs: Sequence[float] = tuple(np.linspace(0.0, 0.3, 121)), ax=None,
                             t2_accumulator: str = "causal"):
    """Fig. 6(b): largest eigenvalue magnitude vs ``alpha``: discrepancy raises it, T2 brings it back down
    (``t2_accumulator``: which accumulator T2 reads, :mod:`staleopt.theory`)."""
    fig, ax = _axes(ax)
    base = dict(curvature=curvature, tau_fwd=tau_fwd, tau_bkwd=tau_bkwd)
    _spectrum(ax, [(rf"discrepancy $\Delta={delta:g}$", "tab:blue", dict(base, delta=delta)),
                   (rf"T2, $D={correction_decay:g}$", "tab:orange",
                    dict(base, delta=delta, correction_decay=correction_decay, t2_accumulator=t2_accumulator)),
                   ("no discrepancy", "tab:green", dict(curvature=curvature, tau_fwd=tau_fwd))], np.asarray(lrs),
              rf"$\tau_{{fwd}}={tau_fwd}$, $\tau_{{bkwd}}={tau_bkwd}$, $\lambda={curvature:g}$")
    return fig


def plot_stable_lr_vs_sensitivity(tau_fwd: int = 40, tau_bkwd: int = 10, curvature: float = 1.0,
                                  deltas: Sequence[float] = tuple(np.linspace(-100, 100, 101)), ax=None):
    """Fig. 10: largest stable ``alpha`` vs ``Delta``, original vs T2 with ``gamma`` of App. B.4 eq. 14."""
    fig, ax = _axes(ax)
    deltas = np.asarray(deltas, dtype=float)
    decay = T.invariant_decay(tau_fwd, tau_bkwd)
    for label, kw in (("original", {}), (f"T2 corrected (D={decay:.3f})", dict(correction_decay=decay))):
        best = np.array([T.max_stable_lr(curvature, tau_fwd, tau_bkwd, delta=d, grid=48, rtol=1e-6, **kw)
                         for d in deltas])
        ax.plot(deltas, np.where(best > 0, best, np.nan), lw=1.2, label=label)
    ax.set_yscale("log")
    ax.set_xlabel(r"discrepancy sensitivity $\Delta$")
    ax.set_ylabel(r"largest stable step size $\alpha$")
    ax.set_title(rf"$\tau_{{fwd}}={tau_fwd}$, $\tau_{{bkwd}}={tau_bkwd}$, $\lambda={curvature:g}$", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def plot_recompute_spectrum(delta: float = 10.0, phi: float = -5.0, correction_decay: float = 0.1,
                            curvature: float = 1.0, tau_fwd: int = 10, tau_bkwd: int = 1, tau_recomp: int = 4,
                            lrs: Sequence[float] = tuple(np.linspace(0.0, 0.2, 101)), ax=None,
                            t2_accumulator: str = "causal"):
    """Fig. 16: the recompute model of App. D.1; T2 (also applied to recompute) lowers the largest eigenvalue
    (``t2_accumulator``: which accumulator T2 reads, :mod:`staleopt.theory`)."""
    fig, ax = _axes(ax)
    base = dict(curvature=curvature, tau_fwd=tau_fwd, tau_bkwd=tau_bkwd, delta=delta)
    rec = dict(base, tau_recomp=tau_recomp, phi=phi)
    _spectrum(ax, [(rf"recompute, $\Delta={delta:g}$, $\Phi={phi:g}$", "tab:blue", rec),
                   (rf"no recompute, $\Delta={delta:g}$", "tab:green", base),
                   (rf"recompute + T2, $D={correction_decay:g}$", "tab:red",
                    dict(rec, correction_decay=correction_decay, t2_accumulator=t2_accumulator)),
                   ("no discrepancy", "tab:orange", dict(curvature=curvature, tau_fwd=tau_fwd))], np.asarray(lrs),
              rf"$\tau_{{fwd}}={tau_fwd}$, $\tau_{{bkwd}}={tau_bkwd}$, $\tau_{{recomp}}={tau_recomp}$, "
              rf"$\lambda={curvature:g}$")
    return fig


FIGURES: Dict[str, Callable] = {
    "5a": plot_delay_trajectories,
    "5b": plot_lr_delay_heatmap,
    "6a": plot_discrepancy_trajectories,
    "6b": plot_correction_spectrum,
    "10": plot_stable_lr_vs_sensitivity,
    "16": plot_recompute_spectrum,
}


def write_figures(figures: Iterable[str], out: str, dpi: int = 120) -> List[str]:
    """Render the named figures (keys of ``FIGURES``, or ``"all"``) to ``out/fig<name>.png``; returns the paths."""
    names = list(figures)
    if "all" in names:
        names = list(FIGURES)
    bad = [n for n in names if n not in FIGURES]
    if bad:
        raise ConfigError(f"unknown theory figure(s) {bad}: choose from {', '.join(FIGURES)} or 'all'")
    os.makedirs(out, exist_ok=True)
    paths = []
    for name in names:
        path = os.path.join(out, f"fig{name}.png")
        FIGURES[name]().savefig(path, dpi=dpi)
        paths.append(path)
    return paths
