"""The `--k auto` calibration of `generate` (and the Python API's `generate`), cached on disk so
that only the first run on a model, precision, backend and machine waits for it.

A file per key under `<cache>/calibration/` (`<cache>`: $SPECDECODE_CACHE, else
~/.cache/specdecode, as for converted models), named by a hash of the key and holding the key
itself, which is compared in full on reading. The key: the model (name, path, and its weight
files' sizes and modification times), precision, backend and its library's version, the machine
(CPU model, usable cores, torch threads, platform), the torch and specdecode versions, and the
calibration's shape (batch sizes, kmax, context, repeats). A change of any of these misses the
cache and measures again; an unreadable or foreign file is measured over. The controller refines
these figures at every step it runs, so a stale file costs the first steps' choices, not
correctness (the output never depends on them).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

from specdecode.calibration import CONTEXT, REPEATS, CostTable, calibrated_costs
from specdecode.machine import cpu_model, usable_cores
from specdecode.models.loading import LoadedModel
from specdecode.models.paths import cache_root
from specdecode.version import __version__

CACHE_FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".json")


def weights_fingerprint(source: Path) -> list[list[Any]]:
    """[name, size, mtime_ns] of the weight file, or of each weight and config file of a folder."""
    files = [source] if source.is_file() else sorted(
        p for p in source.glob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    out: list[list[Any]] = []
    for path in files:
        st = path.stat()
        out.append([path.name, st.st_size, st.st_mtime_ns])
    return out


def machine() -> dict[str, Any]:
    """What the timings depend on besides the model: CPU, cores, threads, platform, versions."""
    import torch

    return {"cpu": cpu_model(), "cores": usable_cores(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "torch": torch.__version__,
            "specdecode": __version__}


def cache_key(loaded: LoadedModel, batches: list[int], kmax: int) -> dict[str, Any]:
    """Everything a calibration's figures depend on (see the module docstring)."""
    source = Path(loaded.source)
    return {
        "format": CACHE_FORMAT,
        "model": {"name": loaded.name, "source": str(source.resolve()),
                  "weights": weights_fingerprint(source) if source.exists() else []},
        "precision": loaded.precision, "backend": loaded.backend,
        "backend_version": loaded.backend_version(), "machine": machine(),
        "batches": sorted(batches), "kmax": kmax, "context": CONTEXT, "repeats": REPEATS,
    }


def cache_path(key: dict[str, Any]) -> Path:
    """<cache>/calibration/<hash of the key>.json."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "calibration" / f"{digest}.json"


def read_costs(path: Path, key: dict[str, Any]) -> CostTable | None:
    """The t(B, T) table stored at `path` under exactly `key`, else None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        return {(int(batch), int(width)): float(seconds)
                for batch, width, seconds in data["target_s"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_costs(path: Path, key: dict[str, Any], costs: CostTable) -> None:
    """Store `costs` under `key` (atomically: a temporary file renamed); a cache that cannot be
    written is skipped, the run goes on."""
    rows = [[b, t, s] for (b, t), s in sorted(costs.items())]
    text = json.dumps({"key": key, "target_s": rows}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass


def cached_costs(loaded: LoadedModel, batches: list[int], kmax: int) -> CostTable:
    """calibration.calibrated_costs for this model, read from the cache when its key matches,
    else measured now and stored."""
    key = cache_key(loaded, batches, kmax)
    path = cache_path(key)
    costs = read_costs(path, key)
    if costs is None:
        costs = calibrated_costs(loaded.model, batches, kmax)
        write_costs(path, key, costs)
    return costs
