"""``staleopt theory``: regenerate the quadratic-model figures of PipeMare §3 and App. B, D."""
from __future__ import annotations

import argparse

from ..validate import MAX_DPI, check_int, output_dir

__all__ = ["register", "run"]

_FIGURES = ["5a", "5b", "6a", "6b", "10", "16", "all"]

DESCRIPTION = """\
Regenerate PipeMare's theory figures from the quadratic model (staleopt.theory):

  5a  trajectories of delayed SGD for several delays tau at a fixed step size
  5b  step size x delay heatmap of final loss, linear regression on scikit-learn's
      diabetes data, with Lemma 1's bound at the data's largest curvature
  6a  trajectories for several discrepancy sensitivities Delta
  6b  largest eigenvalue vs step size: discrepancy, T2 correction, no discrepancy
  10  largest stable step size vs Delta, original vs T2 (tau_fwd=40, tau_bkwd=10)
  16  the recompute model of App. D.1

examples:
  staleopt theory --figure 5b --out runs/theory
  staleopt theory --figure all --out runs/theory
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("theory", help="regenerate the quadratic-model figures (PipeMare Fig. 5, 6, 10, 16)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--figure", nargs="+", default=["all"], choices=_FIGURES, metavar="FIG",
                   help=f"figure(s) to write: {', '.join(_FIGURES)} (default: all)")
    p.add_argument("--out", required=True, help="output directory; writes fig<FIG>.png")
    p.add_argument("--dpi", type=int, default=120, help="resolution of the PNG files (default: 120)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..plot.theory import write_figures

    check_int("--dpi", args.dpi, 1, MAX_DPI, why="dots per inch of the PNG files")
    output_dir(args.out)
    for path in write_figures(args.figure, args.out, dpi=args.dpi):
        print(path)
    return 0
