"""The ``staleopt`` command line: ``staleopt <command> --help`` for each command.

Subcommands live in :mod:`staleopt.commands`, one module each; this module
only discovers them, parses the arguments and sets the torch thread count.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands
from .errors import StaleoptError

__all__ = ["main", "build_parser", "resume_hint"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="staleopt",
        description="Simulate asynchronous pipeline-parallel training (stale weights) on one process.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice; sweeps use 1 per worker)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"argument --threads: torch's intra-op threads, an int >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    try:
        return int(args.func(args) or 0)
    except StaleoptError as e:
        print(f"staleopt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line that says how to go on, no traceback
        print(f"\nstaleopt {args.command}: interrupted. {resume_hint(args)}", file=sys.stderr, flush=True)
        return 130


def resume_hint(args) -> str:
    """What to do after Ctrl-C: how the interrupted command resumes."""
    if args.command in ("sweep", "demo", "compare", "reproduce"):
        return ("Run the same command again to resume: finished runs are kept, the others continue from their "
                "last checkpoint.")
    if args.command == "train":
        if getattr(args, "out", None):
            return f"Run the same command again to resume from {args.out}.ckpt, its last checkpoint."
        return "Nothing was saved: pass --out FILE to checkpoint a run and resume it."
    return "Nothing to resume."


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
