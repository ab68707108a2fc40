"""A KV cache made for speculation.

Preallocated once per request batch: keys and values for every layer live in two tensors of shape
(layers, batch, kv_heads, capacity, head_dim). Each row has its own length. A forward pass writes
its new positions at [length, length + T) of each row and moves the length on; rolling back a
rejected draft is moving the length back (the stale slots are overwritten by the next write), and
accepting a path of a token tree is one compaction copy (`keep`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.models.target import Cache


def check_room(lengths: list[int], capacity: int, new_tokens: int,
               rows: list[int] | None = None) -> None:
    """Raise a clear error if writing `new_tokens` positions would overflow any of `rows` (all
    rows by default) of a cache holding `lengths` tokens per row, `capacity` at most."""
    for b in rows if rows is not None else range(len(lengths)):
        if lengths[b] + new_tokens > capacity:
            raise SpecDecodeError(
                f"context overflow: row {b} holds {lengths[b]} tokens, adding "
                f"{new_tokens} exceeds the cache capacity of {capacity} tokens"
            )


class KVCache:
    """The native runner's cache (the models.target.Cache protocol): keys and values as
    tensors, which a drafter's model can draft in."""

    copies_rows = True
    holds_tensors = True

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.lengths = [0] * batch

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def check_room(self, new_tokens: int, rows: list[int] | None = None) -> None:
        """Raise a clear error if writing `new_tokens` positions would overflow any row."""
        check_room(self.lengths, self.capacity, new_tokens, rows)

    def rollback(self, row: int, length: int) -> None:
        """Forget everything after `length` in `row` (no copy)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"rollback to {length} but row {row} holds {self.lengths[row]}")
        self.lengths[row] = length

    def keep(self, row: int, start: int, indices: torch.Tensor) -> None:
        """Keep positions start + indices (ascending) of `row`, compacted to start..; drop the rest.

        Used after scoring a token tree: the accepted path's entries move to contiguous slots.
        """
        src = start + indices.to(torch.long)  # (n,)
        n = int(indices.numel())
        dst = slice(start, start + n)
        self.k[:, row, :, dst] = self.k[:, row, :, src]
        self.v[:, row, :, dst] = self.v[:, row, :, src]
        self.lengths[row] = start + n

    def reset_row(self, row: int) -> None:
        self.lengths[row] = 0

    def copy_row(self, dst: int, src_cache: Cache, src: int, n: int) -> None:
        """Make row `dst` hold the first `n` positions of `src_cache`'s row `src`."""
        if not isinstance(src_cache, KVCache):
            raise SpecDecodeError("a native cache copies rows of another native cache only")
        self.k[:, dst, :, :n] = src_cache.k[:, src, :, :n]
        self.v[:, dst, :, :n] = src_cache.v[:, src, :, :n]
        self.lengths[dst] = n

    def move_row(self, src: int, dst: int) -> None:
        """Row `src` becomes row `dst` (whose contents are dropped); `src` is left empty."""
        self.copy_row(dst, self, src, self.lengths[src])
        self.lengths[src] = 0

    def view(self, first: int, n: int) -> KVCache:
        """Rows first..first+n-1: views of the same storage, with a copy of their lengths."""
        out = copy.copy(self)
        out.k, out.v = self.k[:, first:first + n], self.v[:, first:first + n]
        out.lengths = self.lengths[first:first + n]
        return out

