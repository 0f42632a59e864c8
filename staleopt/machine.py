"""The machine a result was recorded on, named the same way by every record: the demo's ``run.json``, the
ledger's launches and the benchmarks' ``meta.json`` (docs/performance.md: an entry names its CPU model)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["cpu_name", "describe"]


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
