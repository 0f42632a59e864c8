"""The ``staleopt`` command line: ``staleopt <command> --help`` for each command.

Subcommands live in :mod:`staleopt.commands`, one module each; this module
only discovers them, parses the arguments and sets the torch thread count.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import warnings
from typing import Optional

from . import commands
from .errors import ConfigError, StaleoptError

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
        from .sweep import MAX_THREADS  # (torch cannot start many more: it crashes)
        if not 1 <= args.threads <= MAX_THREADS:
            parser.error(f"argument --threads: torch's intra-op threads, an int in [1, {MAX_THREADS}], got "
                         f"{args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    shown = warnings.formatwarning
    warnings.formatwarning = _one_line(args.command, shown)
    try:
        blank = _blank_argument(parser, args)
        if blank:
            raise ConfigError(f"argument {blank}: empty (an unset shell variable?), which would read as not given "
                              "and run on the default: give a value, or leave the argument out")
        return int(args.func(args) or 0)
    except StaleoptError as e:
        print(f"staleopt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line that says how to go on, no traceback
        print(f"\nstaleopt {args.command}: interrupted. {resume_hint(args)}", file=sys.stderr, flush=True)
        return 130
    finally:
        warnings.formatwarning = shown


def _one_line(command: str, other):
    """A ``warnings`` formatter: staleopt's own warnings as ``staleopt COMMAND: warning: ...`` lines, as its errors
    are (not a file:line and a source line); others' (torch's) as ``other`` shows them."""
    package = os.path.dirname(os.path.abspath(__file__))

    def show(message, category, filename, lineno, line=None):
        if os.path.abspath(filename).startswith(package + os.sep):
            return f"staleopt {command}: warning: {message}\n"
        return other(message, category, filename, lineno, line)
    return show


def _blank_argument(parser: argparse.ArgumentParser, args) -> Optional[str]:
    """The first argument given as an empty or blank string (its flag, or its name if positional), else None:
    every command reads a missing value as "not given" (``--config ''`` trained on the defaults, ``demo --sweep ''``
    ran the full demo, ``timeline --out ''`` wrote nothing), so a blank one is refused before any work."""
    chosen = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    for action in parser._actions + chosen._actions:
        value = getattr(args, action.dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and not v.strip():
                return "/".join(action.option_strings) or action.dest
    return None


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
