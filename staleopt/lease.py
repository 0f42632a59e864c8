"""Claims on a run directory, so that concurrent launches of one sweep train every run exactly once.

A process that trains a run first *claims* it: it creates ``RUN_DIR/claim.<n>``
(``n = 0, 1, ...``, the claim's generation) holding its owner as JSON::

    {"host": "node7", "pid": 4242, "started": 123456789, "launch": "5f0c9e2ab1d3", "claimed": "2025-...",
     "timeout": 600.0}

Creation is atomic: the file is written under a private name and hard-linked
to ``claim.<n>``, which fails when ``claim.<n>`` exists, so of two processes
racing for one generation exactly one wins and the loser backs off. The claim
with the largest ``n`` is the current one. Its owner keeps it alive by
touching it (the *heartbeat*: the file's modification time) every
``timeout / 10`` seconds from a background thread (:meth:`Lease.beating`).
``claimed`` holds microseconds, so no two claims name the same owner. A ``prefix``
other than ``claim.`` names claims of another kind in a shared folder
(``staleopt train --out OUT`` claims ``OUT.claim.<n>`` beside OUT).

A claim is **stale** when its owner is gone:

* its heartbeat is older than ``timeout`` seconds (any host): the owner's own ``timeout``, which its claim
  records (it beats every tenth of it), so a launch or a status query with another ``--claim-timeout`` judges
  the claim as its owner does; the caller's ``timeout`` only for a claim that records none (written before
  claims recorded it), or
* it was taken on this host and process ``pid`` no longer runs (or ``pid`` now
  belongs to a process started at another time, ``started`` being the
  process's start time in clock ticks from ``/proc/<pid>/stat``, on Linux).

A claim file that does not hold an owner (damaged, or written by something
else: claims are created whole, so never a claim being written) is stale too.

A stale claim is taken over by creating the next generation ``claim.<n+1>``,
again atomically, so two launches cannot both take over one dead owner's run.
An owner whose claim was taken over (a heartbeat that stalled past
``timeout``, e.g. a suspended process) finds a newer generation when it checks
(:meth:`Lease.check`, called before each write) and stops with
:class:`~staleopt.errors.ClaimLostError` instead of writing. The check compares
the current claim's owner with its own, not only the file name: a number reused
after the run was released and claimed again is another launch's claim.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple, Union

from .errors import ClaimLostError, ConfigError, OutputError

__all__ = ["Owner", "Lease", "acquire", "holder", "claims", "new_launch_id", "check_timeout", "read_owner",
           "DEFAULT_TIMEOUT"]

#: Seconds without a heartbeat after which a claim from another host is stale.
DEFAULT_TIMEOUT = 600.0
_PREFIX = "claim."


def check_timeout(timeout) -> float:
    """``timeout`` if it is a finite number of seconds > 0, else :class:`~staleopt.errors.ConfigError`."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ConfigError(f"claim timeout must be > 0 seconds and finite, got {timeout!r} (the owner "
                          f"touches its claim every timeout / 10 s; default {DEFAULT_TIMEOUT:g})")
    return float(timeout)


def new_launch_id() -> str:
    """A random id naming one launch of a sweep (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def _start_time(pid: int) -> Optional[int]:
    """Start time of process ``pid`` in clock ticks after boot (Linux ``/proc``), else ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22; the name in (...) may hold spaces


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


@dataclass(frozen=True)
class Owner:
    """Who holds a claim: host name, process id and start time, the launch's id, when it claimed, and the
    seconds without a heartbeat after which its claim is stale (``None`` in a claim that does not record it)."""

    host: str
    pid: int
    started: Optional[int]
    launch: str
    claimed: str
    timeout: Optional[float] = None

    @classmethod
    def me(cls, launch: str, timeout: float) -> "Owner":
        pid = os.getpid()
        claimed = datetime.datetime.now().astimezone().isoformat(timespec="microseconds")
        return cls(socket.gethostname(), pid, _start_time(pid), launch, claimed, timeout)

    def stale_after(self, timeout: float) -> float:
        """Seconds without a heartbeat after which this owner's claim is stale: its own :attr:`timeout`, else
        (a claim that records none) ``timeout``."""
        return self.timeout if self.timeout is not None else timeout

    def alive_here(self) -> Optional[bool]:
        """Whether the owner process still runs, when it ran on this host; ``None`` for another host."""
        if self.host != socket.gethostname():
            return None
        if not _pid_runs(self.pid):
            return False
        return self.started is None or _start_time(self.pid) in (None, self.started)

    def __str__(self) -> str:
        return f"{self.host}:{self.pid} (launch {self.launch})"


def _generation(path: Path, prefix: str = _PREFIX) -> Optional[int]:
    suffix = path.name[len(prefix):]
    return int(suffix) if path.name.startswith(prefix) and suffix.isdigit() else None


def claims(run_dir: Union[str, os.PathLike], prefix: str = _PREFIX) -> List[Tuple[int, Path]]:
    """The claim files of ``run_dir`` (named ``prefix<n>``) as ``(generation, path)``, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = ((_generation(p, prefix), p) for p in run_dir.iterdir())
    return sorted((n, p) for n, p in found if n is not None)


_FIELDS = {"host": (str,), "pid": (int,), "started": (int, type(None)), "launch": (str,), "claimed": (str,)}
#: Fields a claim may lack (written before they were recorded): read as ``None``.
_OPTIONAL = {"timeout": (int, float)}


def read_owner(path: Union[str, os.PathLike]) -> Optional[Owner]:
    """The owner a claim file names, or ``None`` when it has gone or does not hold one (damaged)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or not set(_FIELDS) <= set(data) <= set(_FIELDS) | set(_OPTIONAL) or any(
            not isinstance(data[k], kinds) or isinstance(data[k], bool)
            for k, kinds in {**_FIELDS, **_OPTIONAL}.items() if k in data):
        return None
    if "timeout" in data and not 0 < data["timeout"] < math.inf:
        return None
    return Owner(**data)


def _read(path: Path) -> Tuple[Optional[Owner], Optional[float]]:
    """``(owner, heartbeat age in seconds)``; ``(None, None)`` when the file has gone or holds no owner."""
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return None, None
    owner = read_owner(path)
    return (owner, age) if owner is not None else (None, None)


def holder(run_dir: Union[str, os.PathLike], timeout: float = DEFAULT_TIMEOUT,
           prefix: str = _PREFIX) -> Optional[Tuple[Owner, float]]:
    """The live owner of ``run_dir``'s current claim and its heartbeat age, or ``None`` (free or stale).
    ``timeout``: for a claim that does not record its owner's (:meth:`Owner.stale_after`)."""
    found = claims(run_dir, prefix)
    if not found:
        return None
    owner, age = _read(found[-1][1])
    if owner is None or age > owner.stale_after(timeout) or owner.alive_here() is False:
        return None
    return owner, age


class Lease:
    """A claim this process holds: :meth:`check` it before writing, :meth:`release` it when done."""

    def __init__(self, path: Path, owner: Owner, timeout: float, prefix: str = _PREFIX):
        self.path, self.owner, self.timeout, self.prefix = path, owner, timeout, prefix
        self.generation = _generation(path, prefix)
        self._stop = threading.Event()
        self._lost = False

    def __repr__(self) -> str:
        return f"Lease({str(self.path)!r}, owner={self.owner})"

    def held(self) -> bool:
        """Whether this claim is still the current one and names this owner (no launch took it over)."""
        found = claims(self.path.parent, self.prefix)
        return (not self._lost and bool(found) and found[-1][1] == self.path
                and read_owner(self.path) == self.owner)

    def check(self) -> None:
        """Raise :class:`~staleopt.errors.ClaimLostError` when another launch took this run over."""
        if not self.held():
            self._lost = True
            raise ClaimLostError(f"{self.path.parent.name}: another launch took over this run's claim "
                                 f"(heartbeat older than {self.timeout:g} s?); this launch leaves the run to it")

    def heartbeat(self) -> None:
        """Touch the claim file: its modification time says the owner is alive."""
        if self.held():
            os.utime(self.path)
        else:
            self._lost = True

    def beating(self) -> "Lease":
        """Start touching the claim every ``timeout / 10`` seconds from a daemon thread; stop at release."""
        def beat():
            while not self._stop.wait(self.timeout / 10):
                self.heartbeat()
        threading.Thread(target=beat, name=f"heartbeat {self.path}", daemon=True).start()
        return self

    def release(self) -> None:
        """Stop the heartbeat and delete the claim file (if it still names this owner)."""
        self._stop.set()
        if self.held():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "Lease":
        return self.beating()

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(run_dir: Union[str, os.PathLike], launch: str, timeout: float = DEFAULT_TIMEOUT,
            prefix: str = _PREFIX) -> Optional[Lease]:
    """Claim ``run_dir`` for this process, taking over a stale claim; ``None`` when a live owner holds it.

    ``timeout``: seconds without a heartbeat after which this claim is stale (recorded in it; this process's
    heartbeat beats every tenth of it), and another claim that records none (:meth:`Owner.stale_after`).
    The directory is created if needed. ``prefix``: the claim files' names (``prefix<n>``).
    """
    check_timeout(timeout)
    if not isinstance(launch, str) or not launch:
        raise ConfigError(f"launch must be a non-empty str naming this launch (lease.new_launch_id()), got "
                          f"{launch!r}: a claim by another type reads back as damaged, so any launch would take "
                          "the run over")
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"the run folder {run_dir} is a file: claim a folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    found = claims(run_dir, prefix)
    if found:
        owner, age = _read(found[-1][1])
        if owner is not None and age <= owner.stale_after(timeout) and owner.alive_here() is not False:
            return None
    generation = found[-1][0] + 1 if found else 0
    me = Owner.me(launch, float(timeout))
    path = run_dir / f"{prefix}{generation}"
    private = run_dir / f".{prefix}{generation}.{uuid.uuid4().hex}"
    try:
        private.write_text(json.dumps(asdict(me), sort_keys=True) + "\n")
        os.link(private, path)  # atomic: fails if another process created this generation first
    except FileExistsError:
        return None
    except OSError as e:  # a full disk, a read-only folder
        raise OutputError(f"cannot write the claim {path}: {e.strerror or e}; free space or choose a writable "
                          "folder") from e
    finally:
        private.unlink(missing_ok=True)
    for _, older in found:  # the dead owners' claims
        try:
            older.unlink(missing_ok=True)
        except OSError:  # a folder by that name (not a claim): older than ours, so it no longer counts
            pass
    return Lease(path, me, timeout, prefix)
