"""``staleopt models``: the model zoo with parameter counts and maximum stage counts."""
from __future__ import annotations

import argparse

from .. import models

__all__ = ["register", "run"]

EXAMPLES = """\
units = parametrized operators (modules owning trainable parameters) = the
largest number of pipeline stages the model can be split into.

examples:
  staleopt models
  staleopt models --markdown          # the table in docs/experiments.md (generated: python -m staleopt.docgen)
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="list models: parameters, units (max stages), input shape",
                              description="List the models staleopt builds by name.\n\n" + EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=run)


def run(args) -> int:
    rows = [[r["name"], f"{r['params']:,}", str(r["units"]), "x".join(map(str, r["input_shape"])),
             r["description"]] for r in models.table()]
    head = ["model", "parameters", "units (max stages)", "input", "description"]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("| " + " | ".join("---" for _ in head) + " |")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return 0
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for row in [head] + rows:
        cells = (c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        print("  ".join(cells).rstrip())
    return 0
