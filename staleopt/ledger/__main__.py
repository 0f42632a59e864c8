"""``python -m staleopt.ledger run NAME [options]`` is ``staleopt reproduce --claim NAME [options]``.

``python -m staleopt.ledger`` with no arguments (or ``all``, or ``run`` alone) runs every experiment.
"""
import sys
from typing import List

from ..cli import main


def reproduce_argv(argv: List[str]) -> List[str]:
    """The ``staleopt`` arguments for ``python -m staleopt.ledger`` ``argv``."""
    if argv[:1] == ["run"] and len(argv) > 1 and not argv[1].startswith("-"):
        return ["reproduce", "--claim", argv[1]] + argv[2:]
    if argv[:1] in (["run"], ["all"]):
        return ["reproduce"] + argv[1:]
    return ["reproduce"] + argv


if __name__ == "__main__":
    sys.exit(main(reproduce_argv(sys.argv[1:])))
