"""Regenerate PipeMare's quadratic-model figures (Fig. 5a, 5b, 6a, 6b, 10, 16) as PNG files.

    python experiments/theory_figures.py --out runs/theory            # all figures
    python experiments/theory_figures.py --out runs/theory --figure 5b 10

Same as ``staleopt theory --figure all --out DIR``. Takes about 10 s on a 2-core machine.
"""
import argparse
import sys
import time

from staleopt.plot.theory import FIGURES, write_figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for fig<name>.png")
    parser.add_argument("--figure", nargs="+", default=["all"], choices=list(FIGURES) + ["all"],
                        help="which figures (default: all)")
    parser.add_argument("--dpi", type=int, default=120)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    for path in write_figures(args.figure, args.out, dpi=args.dpi):
        print(path)
    print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
