"""The private torch APIs staleopt relies on, in one place (each with what it is for).

* :func:`queue_callback` — run a function once the current backward pass has finished
  (``torch.autograd.Variable._execution_engine.queue_callback``; what DDP uses too);
* :func:`flatten` — the tensors inside a nested output (``torch.utils._pytree.tree_flatten``);
* :func:`sequence_nr` — the order in which autograd created a graph node during the forward pass
  (``Node._sequence_nr``).
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["queue_callback", "flatten", "sequence_nr"]


def queue_callback(fn: Callable[[], None]) -> None:
    """Call ``fn`` at the end of the backward pass that is running now."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def flatten(tree: Any) -> List[Any]:
    """The leaves of a nested structure of tuples, lists and dicts (tensors among them)."""
    return tree_flatten(tree)[0]


def sequence_nr(node) -> int:
    """Creation order of an autograd node: larger means created later in the forward pass."""
    return node._sequence_nr()
