"""The reproduction ledger: one experiment per checkable claim of the papers, verdicts computed from the runs.

``experiments/ledger/*.toml`` hold the experiments (:mod:`.spec`), one shared
resumable sweep trains their runs (:mod:`.run`), :mod:`.verdict` turns the
finished runs into rows with a verdict, :mod:`.analytic` adds the rows that
need no training, and :mod:`.report` writes ``docs/reproductions.md``.
``staleopt reproduce`` (``make reproduce``) drives it; ``python -m
staleopt.ledger run NAME`` runs one experiment or check.
"""
from .analytic import analytic_rows
from .report import markdown, table
from .spec import Check, Experiment, Recipe, find, load_all, load_experiment, load_recipes
from .verdict import NOT, NOT_RUN, PARTLY, REPRODUCED, Row, evaluate, scores

__all__ = ["Check", "Experiment", "Recipe", "Row", "load_all", "load_experiment", "load_recipes", "find",
           "evaluate", "scores", "analytic_rows", "markdown", "table", "REPRODUCED", "PARTLY", "NOT", "NOT_RUN"]
