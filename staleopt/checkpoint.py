"""A run's files: its checkpoint (one file, replaced atomically, from which the run continues bit-for-bit),
its records and its completion marker.

:func:`staleopt.train.run` saves its whole state at every epoch end (and every
``every`` optimizer steps when asked) and resumes from it::

    state = {"run_id", "config",                       # whose checkpoint this is
             "model", "optimizer", "scheduler",        # state_dicts; the optimizer's holds its weight history
             "rng",                                    # torch's global RNG (CPU and CUDA), Python's random and
                                                       # numpy's global RNG, the data-order and augmentation
                                                       # generators
             "epoch", "batch", "losses",               # position: batches done in the epoch, their losses
             "records", "elapsed",                     # per-epoch records so far, training seconds so far
             "finished",                               # True in the final state: the run is over
             "threads"}                                # torch's thread count the run trains under

Python's ``random`` and numpy's global RNG are in the state because a user's
dataset or model may draw from them (a transform's ``np.random.normal``
noise, a ``random.random() < 0.5`` flip): a run resumed in the middle of an
epoch draws what the uninterrupted run would. A checkpoint saved before they
were (it lacks them) still loads: its run resumes as it did then, bit-for-bit
unless the data or model draws from ``random`` or numpy. The same holds for
``finished`` and ``threads``: without them a run resumes as it did before they
were saved.

**Atomic.** Every file is written under a temporary name next to it, flushed
to disk and renamed over the old one (``os.replace``): a process killed at any
instant leaves the previous complete file or the new one, never a torn file.
A write that fails (read-only folder, disk full) removes its temporary file
and raises :class:`~staleopt.errors.OutputError` naming the file.

**Verified.** A checkpoint file is the line ``staleopt-checkpoint 1 sha256
<hex>`` followed by the bytes of ``torch.save(state)``; :func:`read` checks
the SHA-256 of those bytes before loading them, so a damaged file (a flipped
byte in a tensor) is a :class:`~staleopt.errors.CheckpointError` naming it,
not a resumed run on wrong weights. It then loads them with
``torch.load(weights_only=True)``: tensors (the RNG states are byte tensors),
numbers, strings and plain containers only, which is all a state holds; a
file holding any other object (a crafted pickle that would run code) is
refused with :class:`~staleopt.errors.UnsafeCheckpointError`. A bare
``torch.save`` file (no header: written before checksums) loads the same way,
unverified.

**Completion.** A checkpoint given a ``done`` path keeps its file after the
run's last epoch: the run's owner calls :meth:`Checkpoint.complete`, which
writes the final records, then the ``done`` marker (JSON: the run's status,
the number of record rows and their SHA-256), and only then deletes the
checkpoint (unless ``keep``). A process killed at any instant leaves either a
checkpoint to resume from or a finished run. :func:`read_done` and
:func:`read_records` read these files back, verified.

**Records in flight.** With ``records`` set, :meth:`Checkpoint.write_records`
replaces that CSV (atomically too) with the records so far after every epoch,
so a run can be followed while it trains.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import random
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

from .errors import CheckpointError, OutputError, RunFileError, UnsafeCheckpointError
from .validate import check_int

__all__ = ["Checkpoint", "check_every", "rng_state", "set_rng_state", "atomic_write_bytes", "atomic_write_text",
           "check_writable", "read", "read_done", "read_records", "records_digest", "EXACT_FLOATS"]

PathLike = Union[str, os.PathLike]
_MAGIC = b"staleopt-checkpoint 1 sha256 "
# pandas < 3 parses floats to within an ulp unless asked to round-trip; pandas 3 always round-trips.
EXACT_FLOATS = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}


def _output_error(path: Path, e: OSError) -> OutputError:
    """The error of a failed write, with the fix its cause calls for (no space, no permission, or a path
    whose folders are not folders)."""
    why = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
           errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied"}.get(e.errno, e.strerror or str(e))
    if e.errno in (errno.ENOTDIR, errno.EEXIST, errno.ENOENT, errno.EISDIR):
        fix = ("a file stands where a folder must be, a folder where the file must be, or a folder is missing: "
               "choose another path")
    else:
        fix = "free space or choose a writable folder"
    return OutputError(f"cannot write {path}: {why}. The fix: {fix}, then run the same command again (what was "
                       "already written, finished runs and the last checkpoint, is kept)")


def _replace(path: Path, write: Callable[[Any], None], mode: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError) and not isinstance(e, OutputError):
            raise _output_error(path, e) from e
        raise


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    _replace(Path(path), lambda f: f.write(text), "w")


def atomic_write_bytes(path: PathLike, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file and ``os.replace``, with its SHA-256 header."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    header = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    _replace(Path(path), lambda f: (f.write(header), f.write(payload)), "wb")


def check_writable(folder: PathLike) -> None:
    """Create ``folder`` if needed and write and delete a file in it; :class:`~staleopt.errors.OutputError`
    when that fails, so a run stops before training rather than at its first save."""
    folder = Path(folder)
    probe = folder / f".staleopt-write-test.{uuid.uuid4().hex}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        probe.unlink()
    except OSError as e:
        raise _output_error(folder, e) from e


def read(path: PathLike) -> Dict[str, Any]:
    """A checkpoint file's state, verified (module docstring); :class:`~staleopt.errors.CheckpointError`
    naming the file when it is damaged or not a checkpoint, :class:`~staleopt.errors.UnsafeCheckpointError`
    when it holds objects that could run code."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e}); delete it to start the run over") from e
    if blob.startswith(_MAGIC):
        line, _, payload = blob.partition(b"\n")
        digest = line[len(_MAGIC):].decode("ascii", "replace")
        if hashlib.sha256(payload).hexdigest() != digest:
            raise CheckpointError(f"{path} is damaged: its contents do not match the checksum it was saved with "
                                  "(a disk or copy error, or an edit); delete it to start the run over from "
                                  "step 0")
    else:
        payload = blob
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():  # torch names the global it refused ("unsupported GLOBAL x.y")
            raise CheckpointError(f"{path} is not a readable checkpoint (it does not unpickle); "
                                  "delete it to start the run over") from e
        found = str(e).lower().partition("global ")[2].split()[:1]
        raise UnsafeCheckpointError(
            f"{path} holds an object of type {found[0] if found else '?'}: a staleopt checkpoint holds only "
            "tensors, numbers, strings and plain containers, and loading anything else could run code: "
            "refused. Delete the file (and do not trust where it came from) to start the run over") from None
    except Exception as e:  # a file that is not a checkpoint: say which and what to do
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e}); "
                              "delete it to start the run over") from e
    return state


def records_digest(text: str) -> str:
    """SHA-256 of a records CSV's text (what the ``done`` marker stores)."""
    return hashlib.sha256(text.encode()).hexdigest()


def read_done(path: PathLike, fix: str = "delete the run's folder (or marker) to run it again") -> Dict[str, Any]:
    """A run's ``done`` marker as a dict (``status`` and, when written by this version, ``rows`` and
    ``records_sha256``); :class:`~staleopt.errors.RunFileError` naming the file and ``fix`` when it is empty or
    damaged."""
    path = Path(path)
    try:
        done = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunFileError(f"{path} is not a readable completion marker ({type(e).__name__}: {e}); the run's "
                           f"results cannot be trusted: {fix}") from None
    if not isinstance(done, dict) or not isinstance(done.get("status"), str):
        raise RunFileError(f"{path} is not a completion marker (a JSON object with a 'status'); {fix}")
    if not isinstance(done.get("train_fn", ""), str):
        raise RunFileError(f"{path} is not a completion marker: its 'train_fn' is not a 'module:function' "
                           f"string; {fix}")
    return done


def read_records(path: PathLike, done: Optional[Dict[str, Any]] = None,
                 columns: Sequence[str] = ("epoch", "status"), fix: Optional[str] = None) -> pd.DataFrame:
    """A records CSV, checked: it parses, has ``columns`` and a status in every row, and matches ``done``
    (its ``rows`` and ``records_sha256``) when given; else :class:`~staleopt.errors.RunFileError` naming it
    and ``fix`` (default: a run's, by whether it finished).

    Floats read back exactly (``repr`` written, round-trip parsed).
    """
    path = Path(path)
    if fix is None:
        fix = "delete the run's folder to run it again" if done is not None else \
            "it is rewritten at the next epoch end"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RunFileError(f"{path} is missing; {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunFileError(f"{path} is not a readable records file ({type(e).__name__}: {e}); {fix}") from None
    if done is not None and "records_sha256" in done and records_digest(text) != done["records_sha256"]:
        raise RunFileError(f"{path} does not match the run's completion marker (it recorded {done.get('rows')} "
                           f"rows with another checksum): the file was changed or damaged after the run "
                           f"finished; {fix}")
    try:
        records = pd.read_csv(io.StringIO(text), **EXACT_FLOATS)
    except (ValueError, pd.errors.ParserError) as e:  # EmptyDataError is a ValueError
        raise RunFileError(f"{path} is not a readable records file ({type(e).__name__}: {e}); {fix}") from None
    missing = [c for c in columns if c not in records.columns]
    if missing or len(records) == 0 or records["status"].isna().any():
        what = f"lacks the columns {missing}" if missing else (
            "has no rows" if len(records) == 0 else "has a row without a status (a row cut short)")
        raise RunFileError(f"{path} {what}; {fix}")
    return records


def rng_state(device: torch.device, **generators) -> Dict[str, Any]:
    """States of torch's global RNG (CPU, and the GPU's when ``device`` is one), of Python's ``random`` and
    numpy's global RNG, and of each named generator.

    A generator may be given as a :class:`torch.Generator` or as a state it had earlier. The states are
    tensors, numbers and tuples only, as :func:`read` loads them.
    """
    state = {name: g if isinstance(g, torch.Tensor) else g.get_state() for name, g in generators.items()}
    state["torch"] = torch.get_rng_state()
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    state["python"] = random.getstate()  # (version, 625 ints, gauss_next)
    kind, key, pos, has_gauss, gauss = np.random.get_state()  # (a numpy array is no tensor: saved as one)
    state["numpy"] = (kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    return state


def set_rng_state(state: Dict[str, Any], device: torch.device, **generators: torch.Generator) -> None:
    """Put back what :func:`rng_state` saved into torch's global RNG, Python's ``random``, numpy's global RNG
    and the named generators.

    A state saved by an earlier version lacks ``random``'s and numpy's: those two are left as they are.
    """
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in state:
        kind, key, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
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
      longer write (a sweep passes its claim's check, :mod:`staleopt.lease`);
    * ``done``: the run's completion marker. With it, the checkpoint outlives
      the run's last epoch and :meth:`complete` writes the final records, then
      the marker, then deletes the checkpoint.
    """

    def __init__(self, path: PathLike, every: Optional[int] = None, keep: bool = False,
                 records: Optional[PathLike] = None, guard: Optional[Callable[[], None]] = None,
                 done: Optional[PathLike] = None):
        self.path = Path(path)
        self.every = check_every(every)
        self.keep = keep
        self.records = None if records is None else Path(records)
        self.guard = guard
        self.done = None if done is None else Path(done)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, every={self.every}, keep={self.keep})"

    def due(self, step: int) -> bool:
        """Whether to save after optimizer step ``step`` (besides epoch ends)."""
        return self.every is not None and step % self.every == 0

    def load(self, run_id: str) -> Optional[Dict[str, Any]]:
        """The saved state, or ``None`` when there is none; a checkpoint of another run is an error."""
        if not self.path.is_file():
            return None
        state = read(self.path)
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
        """Training is over: delete a temporary file a killed save left and, without a ``done`` marker to write
        first (:meth:`complete`), the checkpoint (unless ``keep``)."""
        leftover = self.path.with_name(f".{self.path.name}.tmp")
        leftover.unlink(missing_ok=True)
        if self.done is None and not self.keep:
            self.path.unlink(missing_ok=True)

    def complete(self, records: pd.DataFrame, info: Dict[str, Any]) -> Dict[str, Any]:
        """The run is done: write ``records``, then the ``done`` marker (``info`` with the records' ``rows`` and
        ``records_sha256``), then delete the checkpoint unless ``keep``; returns the marker's contents."""
        if self.done is None:
            raise CheckpointError("Checkpoint.complete needs the done marker's path: Checkpoint(..., done=PATH)")
        if self.guard is not None:
            self.guard()
        text = records.to_csv(index=False)
        if self.records is not None:
            atomic_write_text(self.records, text)
        marker = {**info, "rows": len(records), "records_sha256": records_digest(text)}
        atomic_write_text(self.done, json.dumps(marker) + "\n")
        self.path.with_name(f".{self.path.name}.tmp").unlink(missing_ok=True)
        if not self.keep:
            self.path.unlink(missing_ok=True)
        return marker
