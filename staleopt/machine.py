"""The machine a result was recorded on, named the same way by every record: the demo's ``run.json``, the
ledger's launches and the benchmarks' ``meta.json`` (docs/performance.md: an entry names its CPU model); and
the code it was recorded with (:func:`source_commit`, in the overhead benchmark's ``meta.json``)."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

__all__ = ["cpu_name", "describe", "source_commit", "load_average"]


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s ``model name``), else what :mod:`platform` knows of the processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """``<n>-core <CPU model>, <OS> <release>, Python <v>, torch <v>``."""
    import torch
    return (f"{os.cpu_count()}-core {cpu_name()}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def load_average() -> Optional[float]:
    """The machine's 1-minute load average (2 decimals), recorded beside a timing because other jobs slow a run
    down; ``None`` where the OS has none (Windows)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def source_commit() -> Optional[str]:
    """The short hash of the git commit this package was imported from, with ``+changes`` where a tracked file
    differs from it; ``None`` where the package is not in a git checkout (installed from a wheel) or git is
    missing."""
    root = Path(__file__).resolve().parent.parent
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None  # (the package sits inside some other repository)
        commit = git("rev-parse", "--short=7", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if changed else "")
