"""What the load-time invariance check costs (models.invariance; docs/measurements/
2026-12-07-invariance-check.md): per target and backend, at the load's width (--kmax 8 + 1) and
at a suffix tree's (24 nodes + 1), at 1 and 2 threads, and where its time goes at the load's
width.

    python benchmarks/invariance_cost.py [--targets checkpoint,fp32,llama.cpp,transformers]
        [--widths 9,25] [--threads 1,2] [--repeats 3] [--model qwen2.5-coder-1.5b]

Each figure is the median of --repeats checks of one loaded target (the first, which also warms
the kernels' caches, left out); the load itself is timed once, check included. SmolLM2-135M-
Instruct, the default model, unless --model names another.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from specdecode.models import invariance
from specdecode.models.backends import load_model

TARGETS = {"checkpoint": ("native", "checkpoint"), "checkpoint-a8": ("native", "checkpoint-a8"),
           "fp32": ("native", "fp32"),
           "llama.cpp": ("llama.cpp", "auto"), "transformers": ("transformers", "auto")}
SHAPES = ("_rows", "_trees", "_threads")


def timed_check(model: Any, width: int, repeats: int) -> float:
    """The median seconds of `repeats` checks at `width` (after one unmeasured)."""
    model.check_invariance(width)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.check_invariance(width)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shares(model: Any, width: int) -> dict[str, float]:
    """Seconds of one check at `width` by shape: the positions one at a time, the widths and
    chunkings, the batches, the tree, the other thread count."""
    spent: dict[str, float] = {}
    inside: list[str] = []  # a shape's own scoring is counted under the shape, not twice

    def wrap(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if inside:
                return f(*args, **kwargs)
            inside.append(name)
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
                inside.pop()
        return run

    saved = {name: getattr(invariance, name) for name in SHAPES}
    probe = {name: getattr(invariance._Probe, name) for name in ("scored", "chunked")}
    try:
        for name, f in saved.items():
            setattr(invariance, name, wrap(name.strip("_"), f))
        invariance._Probe.scored = wrap("widths", probe["scored"])  # type: ignore[method-assign]
        invariance._Probe.chunked = wrap("one at a time + chunks",  # type: ignore[method-assign]
                                         probe["chunked"])
        start = time.perf_counter()
        model.check_invariance(width)
        spent["total"] = time.perf_counter() - start
    finally:
        for name, f in saved.items():
            setattr(invariance, name, f)
        for name, f in probe.items():
            setattr(invariance._Probe, name, f)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--widths", default="9,25")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="a catalog name or a folder/GGUF path")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    print("| target | threads | load s (check included) | "
          + " | ".join(f"check at width {w}, s" for w in widths) + " | exact |")
    print("|---|---|---|" + "---|" * len(widths) + "---|")
    splits = []
    for name in args.targets.split(","):
        backend, precision = TARGETS[name]
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            start = time.perf_counter()
            loaded = load_model(args.model, precision=precision, backend=backend)
            load_s = time.perf_counter() - start
            model: Any = loaded.model
            if hasattr(model, "threads"):  # llama.cpp: its own thread count
                model.L.llama_set_n_threads(model._ctx, threads, threads)
                model.threads = threads
            cells = [f"{timed_check(model, w, args.repeats):.2f}" for w in widths]
            exact = model.invariance is not None and model.invariance.exact
            print(f"| {name} | {threads} | {load_s:.1f} | " + " | ".join(cells)
                  + f" | {exact} |", flush=True)
            splits.append((name, threads, shares(model, widths[0])))
            del loaded, model
    print(f"\nWhere a check at width {widths[0]} goes (seconds, one run):")
    for name, threads, spent in splits:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in spent.items() if k != "total")
        print(f"- {name}, {threads} thread(s): {spent['total']:.2f} in all: {parts}")


if __name__ == "__main__":
    main()
