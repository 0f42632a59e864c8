"""The private torch APIs staleopt relies on, in one place (each with what it is for).

* :func:`queue_callback` — run a function once the current backward pass has finished
  (``torch.autograd.Variable._execution_engine.queue_callback``; what DDP uses too);
* :func:`flatten` — the tensors inside a nested output (``torch.utils._pytree.tree_flatten``);
* :func:`sequence_nr` — the order in which autograd created a graph node during the forward pass
  (``Node._sequence_nr``);
* :func:`optimizer_state_dict_hooks`, :func:`optimizer_load_state_dict_hooks` — the hooks registered
  with ``Optimizer.register_(load_)state_dict_pre/post_hook`` (``Optimizer._optimizer_*_hooks``), so a
  wrapper that delegates its ``state_dict`` to another optimizer still runs them;
* :func:`current_autograd_node` — the autograd node running now, ``None`` outside a backward pass
  (``torch._C._current_autograd_node``; tells a recomputation inside the backward pass apart);
* :func:`disable_dynamo` — keep ``torch.compile`` out of a function (``torch._disable_dynamo``; what
  ``Optimizer.state_dict`` uses).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["queue_callback", "flatten", "sequence_nr", "current_autograd_node", "optimizer_state_dict_hooks",
           "optimizer_load_state_dict_hooks", "disable_dynamo"]

disable_dynamo = torch._disable_dynamo


def queue_callback(fn: Callable[[], None]) -> None:
    """Call ``fn`` at the end of the backward pass that is running now."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def current_autograd_node():
    """The autograd node whose backward is running now (``None`` outside a backward pass)."""
    return torch._C._current_autograd_node()


def flatten(tree: Any) -> List[Any]:
    """The leaves of a nested structure of tuples, lists and dicts (tensors among them)."""
    return tree_flatten(tree)[0]


def sequence_nr(node) -> int:
    """Creation order of an autograd node: larger means created later in the forward pass."""
    return node._sequence_nr()


def optimizer_state_dict_hooks(opt: torch.optim.Optimizer) -> Tuple[Dict[int, Callable], Dict[int, Callable]]:
    """(pre, post) hooks registered on ``opt`` for ``state_dict()``, in registration order."""
    return opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks


def optimizer_load_state_dict_hooks(opt: torch.optim.Optimizer) -> Tuple[Dict[int, Callable], Dict[int, Callable]]:
    """(pre, post) hooks registered on ``opt`` for ``load_state_dict()``, in registration order."""
    return opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks
