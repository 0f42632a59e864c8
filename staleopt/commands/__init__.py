"""One module per ``staleopt`` subcommand; each defines ``register(subparsers)``.

``register`` adds its parser(s) with ``help``, a description with examples,
and ``set_defaults(func=run)`` where ``run(args) -> int`` is the exit code.

``staleopt --help`` imports every command module to build its parser, so a
command imports torch, pandas and the modules that pull them in inside its
``run``, not at module top; light modules (errors, validate) are imported at the top.
"""
