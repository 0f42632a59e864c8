"""One module per ``staleopt`` subcommand; each defines ``register(subparsers)``.

``register`` adds its parser(s) with ``help``, a description with examples,
and ``set_defaults(func=run)`` where ``run(args) -> int`` is the exit code.
"""
