"""The interface of a backend: a `Target` (the model whose output speculation keeps) and the
`Cache` of keys and values it scores against. The engine, the drafters, the server and the
benchmark use a model and a cache only through these two; what a backend can and cannot do is
declared here as attributes, never found out by asking for its name.

Implemented by the native runner (models.llama.LlamaModel, models.cache.KVCache), the llama.cpp
backend (models.llamacpp) and the transformers adapter (models.hf_adapter). A new backend (a GPU
runner, another library) implements both protocols and adds its record to `models.backends` (how
it loads, the precisions it takes, its names in bench and the report); nothing outside `models/`
needs to know its name.

The scoring contract (`Target.__call__`): row b of `tokens` (B, T) holds its num_new[b] new tokens
(all T by default) at positions cache.lengths[b]..., or at `positions` (B, T) when given; their
keys and values are written into the cache at the row's length, which then advances by
num_new[b]; the logits (B, T', V) are returned for the positions asked (`logits_for`: "all",
"last", "none", or indices into T; models.logits_for decodes it for every backend). Rolling
back a rejected draft is `Cache.rollback` (moving a length, never a copy); keeping a token
tree's accepted path is `Cache.keep`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdecode.models.config import ModelConfig
from specdecode.models.invariance import Invariance


class Cache(Protocol):
    """The keys and values of B rows of committed tokens; row b holds lengths[b] positions."""

    lengths: list[int]
    capacity: int  # the most positions a row can hold

    @property
    def copies_rows(self) -> bool:
        """Whether rows can be copied, moved and viewed (copy_row, move_row, view): batching
        and sharing a prefilled prompt need it (the transformers adapter's one row cannot)."""
        ...

    @property
    def holds_tensors(self) -> bool:
        """Whether the keys and values are tensors in this process that a drafter's model can
        draft in (drafters.base.Drafter.rounds): the native cache."""
        ...

    @property
    def batch(self) -> int: ...

    def nbytes(self) -> int:
        """Bytes of keys and values this cache holds."""
        ...

    def check_room(self, new_tokens: int, rows: list[int] | None = None) -> None:
        """Raise SpecDecodeError when `new_tokens` more positions overflow any of `rows`."""
        ...

    def rollback(self, row: int, length: int) -> None:
        """Forget the positions of `row` from `length` on."""
        ...

    def keep(self, row: int, start: int, indices: torch.Tensor) -> None:
        """Keep positions start + indices (ascending) of `row`, compacted to start..; drop the
        rest (a token tree's accepted path). Raises SpecDecodeError where trees are not
        supported (Target.supports_trees)."""
        ...

    def reset_row(self, row: int) -> None: ...

    def copy_row(self, dst: int, src_cache: Cache, src: int, n: int) -> None:
        """Make row `dst` hold the first `n` positions of `src_cache`'s row `src` (a cache of
        the same target)."""
        ...

    def move_row(self, src: int, dst: int) -> None:
        """Row `src` becomes row `dst` (whose contents are dropped); `src` is left empty."""
        ...

    def view(self, first: int, n: int) -> Cache:
        """Rows first..first+n-1 of the same storage, with a copy of their lengths."""
        ...


class Target(Protocol):
    """A model the engine verifies drafts with (and a draft model runs as)."""

    @property
    def cfg(self) -> ModelConfig:
        """Vocabulary, context length, EOS ids and the shapes of the checkpoint."""
        ...

    @property
    def backend(self) -> str:
        """The path that runs it, as reports name it ("native", "llama.cpp", "transformers")."""
        ...

    @property
    def precision(self) -> str:
        """The precision it runs at: a record's name (models.precision; "gguf" on llama.cpp)."""
        ...

    @property
    def supports_trees(self) -> bool:
        """Whether it scores token trees (explicit positions and tree masks, Cache.keep);
        without, the engine verifies a tree's most likely path as a chain."""
        ...

    @property
    def rows_independent(self) -> bool:
        """Whether a row's outputs are independent of the other rows of its forward pass: then
        a batch's rows draft together (engine.draft_rows)."""
        ...

    @property
    def invariance(self) -> Invariance | None:
        """The load-time batch-invariance check's result, or None where none was run."""
        ...

    def check_invariance(self, width: int) -> Invariance:
        """Measure the batch invariance (models.invariance) up to calls of `width` positions,
        with the cause of any difference found; record it as `invariance` and return it."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and of the cache."""
        ...

    def new_cache(self, batch: int, capacity: int) -> Cache:
        """An empty cache of `batch` rows of up to `capacity` positions."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of weights held (memory reports)."""
        ...

    def version(self) -> str:
        """The library behind the backend and its version, for reports."""
        ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fp32 logits of hidden states returned by a `return_hidden` call: the same
        operations as the call's own logits, so identical bit for bit. Raises SpecDecodeError
        where hidden states are not available (only the native runner returns them)."""
        ...

    def __call__(
        self,
        tokens: torch.Tensor,
        cache: Cache,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        num_new: Sequence[int] | None = None,
        logits_for: str | torch.Tensor = "all",
        layers: Sequence[int] | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Score new positions per row (see the module docstring): logits (B, T', V), or with
        `return_hidden` the hidden states after the final norm (B, T, H). `layers` runs a
        subset of blocks (the native runner's layer skipping)."""
        ...
