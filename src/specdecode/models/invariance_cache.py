"""The load-time invariance check (models.invariance), remembered: a native target loaded again
with the same kernels, weights, precision, thread count and width reads the verdict it got last
time instead of measuring it again (4-7 s of a 1.5B model's 10 s load on 2 cores,
docs/measurements/2026-12-07-invariance-check.md).

Why this keeps the guarantee: the check measures what the row-invariant kernels and the runner's
Python code compute on this model's weights at this thread count. Each of those is in the key:
the kernels library actually loaded (its file name carries the hash of its source, flags,
compiler and this CPU's flags, models.kernels.compile_path), a digest of this package's model
code, torch's version, the weights file or folder (resolved path, size and modification time of
every file), the precision, the width checked, torch's and OpenMP's thread counts. A change to
any of them is another key, so the check runs again. Only exact verdicts are kept: a failing
check is measured (and explained) every time. `SPECDECODE_INVARIANCE_CACHE=0` turns the memory
off; the cached record says that it was read from the cache and when it was measured.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from specdecode.files import atomic_write_text
from specdecode.models import kernels
from specdecode.models.invariance import Invariance
from specdecode.models.paths import cache_root

ENV = "SPECDECODE_INVARIANCE_CACHE"
FORMAT = 1  # bump when the key or the record changes


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@functools.cache
def code_digest() -> str:
    """sha256 of this package's model code (what the runner computes around the kernels)."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def weights_identity(source: Path) -> list[tuple[str, int, int]]:
    """(resolved path, size, mtime_ns) of the weights file, or of every file in the folder."""
    source = source.resolve()
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    out = []
    for f in files:
        st = f.stat()
        out.append((str(f), st.st_size, st.st_mtime_ns))
    return out


def key(model: Any, source: Path, width: int) -> str | None:
    """The cache key of `model` (a native runner loaded from `source`) checked at `width`, or
    None where there is nothing to key on (no kernels loaded: nothing exact to remember)."""
    if kernels.library() is None:
        return None
    parts = {"format": FORMAT, "kernels": kernels.library_name(), "path": kernels.path_name(),
             "code": code_digest(), "torch": torch.__version__,
             "weights": weights_identity(source), "precision": model.precision,
             "width": width, "threads": torch.get_num_threads(),
             "omp": os.environ.get("OMP_NUM_THREADS", "")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _file(k: str) -> Path:
    return cache_root() / "invariance" / f"{k}.json"


def read(k: str) -> Invariance | None:
    """The exact verdict stored under `k`, or None (missing, unreadable, or not exact)."""
    try:
        data = json.loads(_file(k).read_text(encoding="utf-8"))
        fields = {f.name for f in dataclasses.fields(Invariance)}
        found = Invariance(**{n: v for n, v in data["invariance"].items() if n in fields})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if found.exact and found.cached else None


def write(k: str, measured: Invariance) -> None:
    """Keep an exact verdict under `k` (best effort: a cache that cannot be written is skipped)."""
    if not measured.exact:
        return
    record = dataclasses.asdict(dataclasses.replace(measured, cached_at=time.time()))
    try:
        _file(k).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(_file(k), json.dumps({"format": FORMAT, "invariance": record}))
    except OSError:
        pass


def checked(model: Any, source: Path, width: int) -> Invariance:
    """`model.check_invariance(width)`, or the verdict an earlier identical load measured (set
    on the model as check_invariance would; its `cached` is True)."""
    k = key(model, source, width) if enabled() else None
    if k is not None:
        found = read(k)
        if found is not None:
            model.invariance = found
            return found
    measured: Invariance = model.check_invariance(width)
    if k is not None:
        write(k, measured)
    return measured
