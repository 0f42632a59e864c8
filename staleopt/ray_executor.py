"""Run sweep jobs as Ray tasks: on the cluster at ``RAY_ADDRESS``, or on a Ray started locally.

Optional: ``pip install 'staleopt[ray]'``. A *job* is the argument tuple of the
sweep runner's per-run function, ``execute(train_fn, config, run_dir, progress,
options)`` (:func:`staleopt.sweep._execute`), which claims the run directory,
writes ``run_dir/config.json``, checkpoints and records while training, then the
``done`` marker by atomic rename. Ray only decides where and when each job runs,
so the run directories and the resume rules are the sweep runner's own: a
relaunch skips runs with ``done`` and resumes the rest from their checkpoints.

* **Where.** ``address`` (else ``$RAY_ADDRESS``) names a running cluster; with
  neither, a local Ray is started with ``workers`` CPUs and stopped at the end.
  If Ray is already initialized in this process (``ray.init`` called by the
  user), that instance is used as it is.
* **Files.** Each task writes its run directory itself: on a multi-machine
  cluster the sweep directory must be on a filesystem every node mounts at the
  same path, and ``staleopt`` and the train function must be importable on every
  node. A local Ray gets the driver's ``sys.path``, as a process pool would.
* **Threads.** Each task takes one Ray CPU and sets ``threads`` torch threads.
* **Crashes.** A task whose worker process dies is retried by Ray (up to
  ``RETRIES`` times); the retry takes over the dead worker's claim and resumes
  from its checkpoint (:mod:`staleopt.lease`: at once on the same node, after
  the claim timeout on another). A task whose worker still dies after the
  retries fails only its own run (the sweep runner's ``on_crash`` writes its
  ``error.txt``; the checkpoint is kept) and the other tasks go on. A task
  that raises is not retried: the runner already recorded the failure in
  ``error.txt``.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Tuple

from .errors import ConfigError
from .validate import check_int

__all__ = ["run_jobs", "is_available"]

Job = Tuple[Any, dict, str, bool, dict]  # (train_fn, config dict, run_dir, progress, options)
#: Times Ray re-runs a task whose worker process died (system failures; exceptions are not retried).
RETRIES = 2


def is_available() -> bool:
    """Whether ``import ray`` works."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install 'staleopt[ray]' (or pip install ray), "
                          "or use the default local executor (--workers N)") from None
    return ray


def _task(execute: Callable, threads: Optional[int], job: Sequence) -> Any:
    """Body of one Ray task: set the torch threads, then run the job."""
    if threads:
        import torch
        torch.set_num_threads(threads)
    return execute(*job)


def run_jobs(execute: Callable, jobs: Iterable[Job], *, address: Optional[str] = None,
             workers: Optional[int] = None, threads: Optional[int] = 1,
             on_crash: Optional[Callable[[Job, Exception], Any]] = None) -> Iterator[Any]:
    """Run ``execute(*job)`` for every job as a Ray task; yield each result as it finishes.

    ``address`` (default ``$RAY_ADDRESS``) connects to a running cluster; without
    one a local Ray with ``workers`` CPUs (default: all cores) is started and shut
    down when the iteration ends. Interrupting the iteration cancels the tasks not
    yet finished (their run directories stay unfinished, so a relaunch resumes them).
    A task that still fails after ``RETRIES`` (its worker died, or ``execute``
    raised) yields ``on_crash(job, error)``, or raises without ``on_crash``.
    """
    ray = _import_ray()
    jobs = list(jobs)
    check_int("workers", workers, 1, optional=True)
    if not jobs:
        return
    started = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(num_cpus=workers or os.cpu_count(), include_dashboard=False, log_to_driver=True,
                     object_store_memory=128 * 2**20,
                     runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
        started = True
    remote = ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=False)(_task)
    job_of = {}
    for job in jobs:
        job_of[remote.remote(execute, threads, tuple(job))] = job
    pending = list(job_of)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                result = ray.get(done[0])
            except ray.exceptions.RayError as e:
                if on_crash is None:
                    raise
                result = on_crash(job_of[done[0]], e)
            yield result
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()
