"""Batch invariance, measured: does a position's logits depend on what else is scored with it?

Greedy speculative decoding is token-identical to plain decoding only if the target gives a
position the same logits alone (a plain step), inside a draft of any width, as a node of a
token tree, beside other requests' rows of a batch, and whatever the thread count; sampled
decoding with a seed likewise. `measure` scores the same positions in each of those shapes and
reports the largest logit difference per shape; `exact` means every one is 0.0, bit for bit.
Every backend runs the same check at load time (the llama.cpp backend adds one shape of its
own, models.llamacpp.batch_invariance); the decision it feeds, whether a target may speculate,
is models.exactness, so the guarantee rests on a measurement of the kernels actually in use,
not on a belief about them.

What is compared, for a check of width W (default: --kmax's default + 1, the widest chain a
step scores; the drafter registry measures again, wider, for a drafter that scores more):
- widths: every position of a call of w positions (w = 2..16, then the chunk edges 32, 33, 64,
  65 and W itself, up to W) against the same positions scored one call at a time;
- chunks: the W positions in calls of 4, and in two halves, against one at a time (keys and
  values written by a wide call, read by a later one);
- rows: the sequence as row 0 and row 1 of batches of 2 and 3 ragged rows, and as the second row
  of a batch whose first row scores 64 - W / 2 positions, so that its positions straddle the
  native kernels' 64-row chunk (None where the backend runs batch 1 only);
- trees: a path of (W + 1) / 2 nodes inside a tree of W nodes with a sibling at every depth,
  against the path as a chain (None where the backend scores chains only);
- threads: a plain step and a width-W call at another thread count (1, or 2 where the target
  runs on one) against the same positions at the target's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdecode.errors import SpecDecodeError
from specdecode.limits import DEFAULT_KMAX

DEFAULT_WIDTH = DEFAULT_KMAX + 1  # the widest chain a step scores at --kmax's default
ALL_WIDTHS = 16  # every width up to this is compared; beyond it the chunk edges and the widest
CHUNK_EDGES = (32, 33, 64, 65)  # kernels.c processes rows in chunks of 64
CHUNK_ROWS = 64


@dataclass(frozen=True)
class Invariance:
    """How far a position's logits move with what else is scored with it (max |difference|);
    None: the shape does not apply to the backend."""

    widths: float  # alone against inside calls of 2..width positions
    rows: float | None  # alone against beside other sequences' rows (None: batch 1 only)
    chunks: float  # one at a time against calls of 4 and two halves
    trees: float | None = None  # a path as a chain against inside a tree (None: chains only)
    threads: float | None = None  # at the target's thread count against another one
    width: int = DEFAULT_WIDTH  # the widest call compared
    seconds: float = 0.0  # what the check took
    cause: str = ""  # where not exact: the known cause, in words a user can act on
    cached_at: float = 0.0  # a verdict read from models.invariance_cache: when it was stored

    @property
    def cached(self) -> bool:
        """Read from models.invariance_cache, not measured by this load."""
        return self.cached_at > 0

    @property
    def exact(self) -> bool:
        return all(v in (None, 0.0) for v in
                   (self.widths, self.rows, self.chunks, self.trees, self.threads))

    @property
    def worst(self) -> float:
        return max(v or 0.0 for v in
                   (self.widths, self.rows, self.chunks, self.trees, self.threads))

    def describe(self) -> str:
        parts = [f"{self.widths:.3g} across draft widths up to {self.width}"]
        if self.rows is not None:
            parts.append(f"{self.rows:.3g} across batch rows (crossing {CHUNK_ROWS} rows)")
        parts.append(f"{self.chunks:.3g} across chunkings")
        if self.trees is not None:
            parts.append(f"{self.trees:.3g} inside token trees")
        if self.threads is not None:
            parts.append(f"{self.threads:.3g} across thread counts")
        checked = f"checked in {self.seconds:.2f} s"
        if self.cached:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.cached_at))
            checked += f" on {when}, with these kernels, weights and threads (cached)"
        return f"max |logit difference|: {', '.join(parts)}; {checked}"

    def as_dict(self) -> dict[str, float | bool | int | None]:
        return {"widths": self.widths, "rows": self.rows, "chunks": self.chunks,
                "trees": self.trees, "threads": self.threads, "width": self.width,
                "seconds": self.seconds, "exact": self.exact, "cached": self.cached}


@dataclass(frozen=True)
class Threads:
    """How a backend reads and sets its thread count (default: torch's, which also governs
    the native kernels' OpenMP threads)."""

    get: Callable[[], int] = torch.get_num_threads
    set: Callable[[int], None] = torch.set_num_threads


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def widths_compared(width: int) -> list[int]:
    """The call widths whose every position is compared: 2..16, the chunk edges, `width`."""
    small = range(2, min(width, ALL_WIDTHS) + 1)
    return sorted({*small, *(w for w in CHUNK_EDGES if w <= width), max(width, 2)})


def batched(model: Any) -> bool:
    """Whether the target scores more than one row per call (the transformers adapter does
    not: its caches hold one row, and asking for two is an error)."""
    try:
        model.new_cache(2, 8)
    except SpecDecodeError:
        return False
    return True


def measure(model: Any, width: int = DEFAULT_WIDTH, context: int = 48, seed: int = 0,
            threads: Threads | None = None) -> Invariance:
    """Score positions after `context` random tokens alone and in every other shape the engine
    uses, up to calls of `width` positions (see the module docstring)."""
    start = time.perf_counter()
    width = max(int(width), 2)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.cfg.vocab_size)
    low = 100 if vocab > 1000 else 2  # past the special tokens of a real vocabulary
    prefix = torch.randint(low, vocab, (1, context + width), generator=gen)
    other = torch.randint(low, vocab, (1, context + CHUNK_ROWS + width), generator=gen)
    nxt = prefix[:, context:]  # (1, width): the positions compared
    with torch.inference_mode():
        solo = model.new_cache(1, context + CHUNK_ROWS + width)
        model(prefix[:, :context], solo, logits_for="none")
        probe = _Probe(model, solo, context)
        ones = probe.one_at_a_time(nxt)  # (width, V)
        widths = max(_diff(probe.scored(nxt[:, :w]), ones[:w]) for w in widths_compared(width))
        chunks = max(_diff(probe.chunked(nxt, 4), ones),
                     _diff(probe.chunked(nxt, (width + 1) // 2), ones))
        rows = _rows(model, probe, nxt, other, ones) if batched(model) else None
        trees = _trees(model, probe, nxt, other, ones) if model.supports_trees else None
        moved = _threads(probe, nxt, ones, threads or Threads())
    return Invariance(widths, rows, chunks, trees, moved, width,
                      round(time.perf_counter() - start, 3))


class _Probe:
    """A prefilled one-row cache and the ways of scoring the compared positions after it."""

    def __init__(self, model: Any, solo: Any, context: int) -> None:
        self.model, self.solo, self.context = model, solo, context

    def scored(self, tokens: torch.Tensor) -> torch.Tensor:
        """The positions of `tokens` (1, w) in one call: (w, V); the cache rolled back."""
        out = self.model(tokens, self.solo)[0].clone()
        self.solo.rollback(0, self.context)
        return out

    def chunked(self, tokens: torch.Tensor, size: int) -> torch.Tensor:
        """The positions of `tokens` in consecutive calls of `size`, the cache kept between
        them (what a step writes, a later step reads): (w, V); rolled back at the end."""
        out = torch.cat([self.model(tokens[:, s:s + size], self.solo)[0].clone()
                         for s in range(0, tokens.shape[1], size)])
        self.solo.rollback(0, self.context)
        return out

    def one_at_a_time(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.chunked(tokens, 1)


def _rows(model: Any, probe: _Probe, nxt: torch.Tensor, other: torch.Tensor,
          ones: torch.Tensor) -> float:
    """The compared sequence as row `at` of batches whose other rows hold other lengths of its
    prefix (copied, not scored again) and score other tokens, ragged: (rows, at, its new
    positions, the others' new positions)."""
    width, context = nxt.shape[1], probe.context
    shapes = [(2, 0, 1, 3), (2, 1, min(3, width), 3), (3, 1, min(3, width), 2),
              (2, 1, width, CHUNK_ROWS - width // 2)]  # the last straddles the 64-row chunk
    worst = 0.0
    for rows, at, mine, theirs in shapes:
        batch = model.new_cache(rows, context + CHUNK_ROWS + width)
        batch.copy_row(at, probe.solo, 0, context)
        others = [r for r in range(rows) if r != at]
        for i, r in enumerate(others):  # another length each, and other tokens below
            batch.copy_row(r, probe.solo, 0, context // 2 + 3 + 5 * i)
        T = max(mine, theirs)
        tokens = torch.zeros(rows, T, dtype=torch.long)
        tokens[at, :mine] = nxt[0, :mine]
        new = [theirs] * rows
        new[at] = mine
        for r in others:
            tokens[r] = other[0, context: context + T]
        out = model(tokens, batch, num_new=new)
        worst = max(worst, _diff(out[at, :mine], ones[:mine]))
        del batch  # a llama.cpp cache hands its sequences back
    return worst


def tree_shape(nodes: int) -> tuple[list[int], list[int]]:
    """(parents, path): a path of (nodes + 1) / 2 nodes from the root with a sibling leaf at
    every depth below it, in the order a drafter lists them (a sibling before the path node)."""
    length = (max(nodes, 1) + 1) // 2
    parents, path = [-1], [0]
    for _ in range(1, length):
        parent = path[-1]
        parents.append(parent)  # the sibling leaf
        parents.append(parent)  # the path node
        path.append(len(parents) - 1)
    return parents, path


def _trees(model: Any, probe: _Probe, nxt: torch.Tensor, other: torch.Tensor,
           ones: torch.Tensor) -> float:
    parents, path = tree_shape(nxt.shape[1])
    context = probe.context
    tokens = other[0, context: context + len(parents)].clone()
    depth = [0] * len(parents)
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    for d, node in enumerate(path):
        tokens[node] = nxt[0, d]
    positions = torch.tensor([[context + d for d in depth]])
    out = model(tokens[None], probe.solo, positions=positions, tree_mask=mask)[0]
    probe.solo.rollback(0, context)
    return _diff(out[path], ones[: len(path)])


def _threads(probe: _Probe, nxt: torch.Tensor, ones: torch.Tensor, threads: Threads) -> float:
    """A plain step and the widest call at another thread count than the target's own."""
    own = threads.get()
    threads.set(1 if own > 1 else 2)
    try:
        return max(_diff(probe.scored(nxt[:, :1]), ones[:1]), _diff(probe.scored(nxt), ones))
    finally:
        threads.set(own)
