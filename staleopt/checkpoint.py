"""Checkpoints of one training run: one file, replaced atomically, from which the run continues bit-for-bit.

:func:`staleopt.train.run` saves its whole state at every epoch end (and every
``every`` optimizer steps when asked) and resumes from it::

    state = {"run_id", "config",                       # whose checkpoint this is
             "model", "optimizer", "scheduler",        # state_dicts; the optimizer's holds its weight history
             "rng",                                    # torch's global RNG (CPU and CUDA), the data-order and
                                                       # augmentation generators
             "epoch", "batch", "losses",               # position: batches done in the epoch, their losses
             "records", "elapsed"}                     # per-epoch records so far, training seconds so far

Python's ``random`` and numpy's global RNG are not used by the training loop
(MNIST-1D generation restores them), so they are not part of the state.

**Atomic.** :meth:`Checkpoint.save` writes a temporary file next to the
checkpoint, flushes it to disk and renames it over the old one
(``os.replace``): a process killed at any instant leaves the previous complete
checkpoint or the new one, never a torn file. Only the last checkpoint of a
run is kept, and :meth:`Checkpoint.finish` deletes it once the run is done
(unless ``keep``).

**Records in flight.** With ``records`` set, :meth:`Checkpoint.write_records`
replaces that CSV (atomically too) with the records so far after every epoch,
so a run can be followed while it trains.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import torch

from .errors import CheckpointError
from .validate import check_int

__all__ = ["Checkpoint", "check_every", "rng_state", "set_rng_state", "atomic_write_bytes", "atomic_write_text"]

PathLike = Union[str, os.PathLike]


def _replace(path: Path, write: Callable[[Any], None], mode: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    _replace(Path(path), lambda f: f.write(text), "w")


def atomic_write_bytes(path: PathLike, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file and ``os.replace``."""
    _replace(Path(path), lambda f: torch.save(obj, f), "wb")


def rng_state(device: torch.device, **generators) -> Dict[str, torch.Tensor]:
    """States of torch's global RNG (CPU, and the GPU's when ``device`` is one) and of each named generator.

    A generator may be given as a :class:`torch.Generator` or as a state it had earlier.
    """
    state = {name: g if isinstance(g, torch.Tensor) else g.get_state() for name, g in generators.items()}
    state["torch"] = torch.get_rng_state()
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Dict[str, torch.Tensor], device: torch.device, **generators: torch.Generator) -> None:
    """Put back what :func:`rng_state` saved into torch's global RNG and the named generators."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    for name, g in generators.items():
        g.set_state(state[name])


def check_every(every: Optional[int]) -> Optional[int]:
    """``every`` if it is ``None`` or a number of steps >= 1, else :class:`~staleopt.errors.CheckpointError`."""
    return check_int("checkpoint every", every, 1, optional=True, error=CheckpointError,
                     why="optimizer steps between checkpoints; None saves at epoch ends only")


class Checkpoint:
    """Where a run saves itself, and how often.

    * ``path``: the checkpoint file (its folder is created on the first save);
    * ``every``: also save every ``every`` optimizer steps (``None``: at epoch
      ends only);
    * ``keep``: keep the file when the run is done (default: delete it);
    * ``records``: a CSV file rewritten with the records so far after each epoch;
    * ``guard``: called before every write; it raises to stop a run that may no
      longer write (a sweep passes its claim's check, :mod:`staleopt.lease`).
    """

    def __init__(self, path: PathLike, every: Optional[int] = None, keep: bool = False,
                 records: Optional[PathLike] = None, guard: Optional[Callable[[], None]] = None):
        self.path = Path(path)
        self.every = check_every(every)
        self.keep = keep
        self.records = None if records is None else Path(records)
        self.guard = guard

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, every={self.every}, keep={self.keep})"

    def due(self, step: int) -> bool:
        """Whether to save after optimizer step ``step`` (besides epoch ends)."""
        return self.every is not None and step % self.every == 0

    def load(self, run_id: str) -> Optional[Dict[str, Any]]:
        """The saved state, or ``None`` when there is none; a checkpoint of another run is an error."""
        if not self.path.is_file():
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as e:  # a file that is not a checkpoint: say which and what to do
            raise CheckpointError(f"{self.path} is not a readable checkpoint ({type(e).__name__}: {e}); "
                                  "delete it to start the run over") from e
        if not isinstance(state, dict) or state.get("run_id") != run_id:
            other = state.get("run_id") if isinstance(state, dict) else None
            raise CheckpointError(f"{self.path} holds run {other}, not run {run_id}: the configuration changed "
                                  "since it was saved. Delete the file to start over, or write this run "
                                  "elsewhere")
        return state

    def save(self, state: Dict[str, Any]) -> None:
        """Replace the checkpoint with ``state`` (atomically)."""
        if self.guard is not None:
            self.guard()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, state)

    def write_records(self, records) -> None:
        """Replace the ``records`` CSV with ``records`` (a DataFrame), when a records file was given."""
        if self.records is None:
            return
        if self.guard is not None:
            self.guard()
        self.records.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.records, records.to_csv(index=False))

    def finish(self) -> None:
        """The run is done: delete the checkpoint (and a temporary file a killed save left), unless ``keep``."""
        leftover = self.path.with_name(f".{self.path.name}.tmp")
        leftover.unlink(missing_ok=True)
        if not self.keep:
            self.path.unlink(missing_ok=True)
