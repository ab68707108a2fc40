"""The machine this process runs on, as timings depend on it: the CPU model and the cores this
process may use. Imports nothing of the package, so that the calibration cache (its key) and the
bench reports (bench.hardware) describe a machine alike."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU model name from /proc/cpuinfo, else `platform.processor()`, else "unknown"."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
            return value.strip()
    return platform.processor() or "unknown"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), falling back to os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
