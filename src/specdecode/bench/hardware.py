"""Describe the machine measurements ran on (stated on every report): the one description the
bench reports, `specdecode costs`, the benchmarks/ scripts and the calibration cache's key use."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from specdecode.bench.records import HardwareInfo
from specdecode.machine import cpu_model, usable_cores


def torch_threads_if_loaded() -> int | None:
    """torch's intra-op thread count when torch is already imported (never imports it)."""
    torch = sys.modules.get("torch")
    get = getattr(torch, "get_num_threads", None)
    return int(get()) if callable(get) else None


def detect_hardware(
    torch_threads: int | None = None, accelerator: str | None = None
) -> HardwareInfo:
    """This machine's description; `torch_threads` defaults to torch's setting if loaded."""
    return HardwareInfo(
        cpu_model=cpu_model(),
        cpu_cores=usable_cores(),
        torch_threads=torch_threads if torch_threads is not None else torch_threads_if_loaded(),
        accelerator=accelerator,
        platform=platform.platform(),
        python=platform.python_version(),
    )


def describe_hardware(hw: HardwareInfo) -> str:
    """One line for reports: CPU model, cores, torch threads, accelerator."""
    threads = f", {hw.torch_threads} torch threads" if hw.torch_threads is not None else ""
    accel = f", {hw.accelerator}" if hw.accelerator else ", no accelerator"
    return f"{hw.cpu_model} ({hw.cpu_cores} cores{threads}){accel}"


def load_average() -> float | None:
    """The 1-minute load average, where the platform has one."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_summary() -> dict[str, Any]:
    """The machine as the JSON of `specdecode costs` and the benchmarks/ scripts states it: CPU
    model, usable cores, torch threads and version (importing torch), the load average now."""
    import torch

    return {"cpu": cpu_model(), "cores": usable_cores(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "load_avg_1m": load_average()}
