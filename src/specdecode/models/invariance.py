"""Batch invariance, measured: does a position's logits depend on what else is scored with it?

Greedy speculative decoding is token-identical to plain decoding only if the target gives a
position the same logits alone (a plain step), inside a draft of any width, as a node of a
token tree, and beside other requests' rows of a batch; sampled decoding with a seed likewise.
`measure` scores the same positions in each of those shapes at load time and reports the
largest logit difference per shape; `exact` means every one is 0.0, bit for bit. The drafter
registry refuses speculation on a target that is not exact (drafters.registry
.check_measured_invariance), so the guarantee rests on a measurement of the kernels actually in
use, not on a belief about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

WIDTHS = (2, 3, 4, 8, 16)  # draft widths a position is compared across (first of each)


@dataclass(frozen=True)
class Invariance:
    """How far a position's logits move with what else is scored with it (max |difference|)."""

    widths: float  # alone against the first position of a 2..16-position call
    rows: float  # alone against the same tokens scored beside other sequences' rows
    chunks: float  # 8 positions scored 1 at a time against 4 and 8 at a time
    trees: float | None = None  # a path's positions as a chain against inside a tree (None: n/a)

    @property
    def exact(self) -> bool:
        return self.widths == 0.0 and self.rows == 0.0 and self.chunks == 0.0 and \
            self.trees in (None, 0.0)

    @property
    def worst(self) -> float:
        return max(self.widths, self.rows, self.chunks, self.trees or 0.0)

    def describe(self) -> str:
        trees = "" if self.trees is None else f", {self.trees:.3g} inside token trees"
        return (f"max |logit difference|: {self.widths:.3g} across draft widths, "
                f"{self.rows:.3g} across batch rows, {self.chunks:.3g} across chunkings{trees}")

    def as_dict(self) -> dict[str, float | bool | None]:
        return {"widths": self.widths, "rows": self.rows, "chunks": self.chunks,
                "trees": self.trees, "exact": self.exact}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def measure(model: Any, context: int = 48, seed: int = 0) -> Invariance:
    """Score positions after `context` random tokens alone and in every other shape the engine
    uses (see Invariance); about 30 forward passes of at most 16 positions."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.cfg.vocab_size)
    low = 100 if vocab > 1000 else 2  # past the special tokens of a real vocabulary
    prefix = torch.randint(low, vocab, (1, context + 16), generator=gen)
    other = torch.randint(low, vocab, (1, context), generator=gen)
    nxt = prefix[:, context:]  # (1, 16): the positions compared
    cap = context + 24
    with torch.inference_mode():
        solo = model.new_cache(1, cap)
        model(prefix[:, :context], solo, logits_for="none")

        def scored(tokens: torch.Tensor, keep: bool = False) -> torch.Tensor:
            out = model(tokens, solo)[0].clone()
            if not keep:
                solo.rollback(0, context)
            return out

        ones = torch.cat([scored(nxt[:, t:t + 1], keep=True) for t in range(8)])  # (8, V)
        solo.rollback(0, context)
        alone = ones[0]
        widths = max(_diff(scored(nxt[:, :w])[0], alone) for w in WIDTHS)
        fours = torch.cat([scored(nxt[:, s:s + 4], keep=True) for s in (0, 4)])
        solo.rollback(0, context)
        chunks = max(_diff(fours, ones), _diff(scored(nxt[:, :8]), ones))
        rows = _rows(model, solo, context, cap, nxt, other, ones)
        trees = _trees(model, solo, context, nxt, ones) if model.supports_trees else None
    return Invariance(widths, rows, chunks, trees)


def _rows(model: Any, solo: Any, context: int, cap: int, nxt: torch.Tensor,
          other: torch.Tensor, ones: torch.Tensor) -> float:
    """The compared sequence as row 0 and as row 1 of batches whose other rows hold another
    sequence at another length, scored ragged (1 and 3 new positions) and level."""
    worst = 0.0
    short = context // 2 + 3
    for rows, at in ((2, 0), (2, 1), (3, 1)):
        batch = model.new_cache(rows, cap)
        others = [r for r in range(rows) if r != at]
        batch.copy_row(at, solo, 0, context)
        for i, r in enumerate(others):  # other sequences, other lengths
            view = batch.view(r, 1)
            model(other[:, : short + 5 * i], view, logits_for="none")
            batch.lengths[r] = view.lengths[0]
        tokens = torch.zeros(rows, 3, dtype=torch.long)
        tokens[at] = nxt[0, :3]
        for r in others:
            tokens[r] = other[0, :3]
        new = [3] * rows
        new[at] = 1 if rows == 2 else 3  # ragged: the compared row scores 1 position of 3
        out = model(tokens, batch, num_new=new)
        worst = max(worst, _diff(out[at, : new[at]], ones[: new[at]]))
    return worst


def _trees(model: Any, solo: Any, context: int, nxt: torch.Tensor, ones: torch.Tensor) -> float:
    """A chain of 3 positions against the same path inside a 5-node tree with a sibling branch
    (nodes: 0 root, 1 and 2 its children, 3 child of 1, 4 child of 2; the path is 0, 1, 3)."""
    tokens = torch.stack([nxt[0, 0], nxt[0, 1], nxt[0, 5], nxt[0, 2], nxt[0, 6]])[None]
    parents = [-1, 0, 0, 1, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    depth = [0] * 5
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    positions = torch.tensor([[context + d for d in depth]])
    out = model(tokens, solo, positions=positions, tree_mask=mask)[0]
    solo.rollback(0, context)
    return _diff(out[[0, 1, 3]], ones[:3])

