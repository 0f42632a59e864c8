"""``staleopt timeline``: execute a pipeline schedule slot by slot and print its diagram and delays."""
from __future__ import annotations

import argparse

from ..plot import plot_timeline
from ..timeline import simulate
from ..validate import output_image

__all__ = ["register", "run"]

DESCRIPTION = """\
Execute a pipeline schedule event by event (staleopt.timeline) and print the
space-time diagram (rows: stages or workers, columns: slots; F/B and the
microbatch id; '.' is a bubble), the delays derived from it, the utilization
and the in-flight microbatches per stage.

Timelines: the pipeline schedules sync (gpipe), 1f1b, 2bw, dataflow, pb and
every method built on them: pipedream-flush, pipedream (1f1b + stashing),
pipedream-2bw, pipemare-stash, pipemare (-> dataflow), pipeoptim (-> 1f1b), ...

examples:
  staleopt timeline --method 1f1b --stages 4 --microbatches 4 --minibatches 3
  staleopt timeline --method dataflow --stages 4 --microbatches 2 --versions
  staleopt timeline --method gpipe --stages 4 --microbatches 4 --minibatches 2 --out gpipe.png
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("timeline", help="execute a pipeline schedule and print its diagram and delays",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True, help="timeline, schedule or method name (e.g. 1f1b, gpipe, dataflow)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages P (default: 4)")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per minibatch N (default: 1)")
    p.add_argument("--minibatches", type=int, default=3, help="minibatches to run (default: 3)")
    p.add_argument("--versions", action="store_true", help="show the weight version each pass reads (F3@1)")
    p.add_argument("--out", default=None, help="also draw the diagram to this image file (e.g. fig.png)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.out:
        output_image(args.out)
    tl = simulate(args.method, args.stages, args.microbatches, args.minibatches)
    print(tl.ascii(versions=args.versions))
    print()
    print(tl.summary())
    if args.out:
        ax = plot_timeline(tl, versions=args.versions)
        ax.figure.savefig(args.out, dpi=130, bbox_inches="tight")
        print(f"wrote {args.out}")
    return 0
