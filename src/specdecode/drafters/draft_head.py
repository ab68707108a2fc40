"""A cheaper LM head for the drafters that run the target's blocks or a copy of them (the quantized
copies, layer skipping): the rows of the lowest `draft_vocab` token ids of the model's own head.

Why: a draft token of a copy costs its blocks and its head, and the head (49,152 x 576 on
SmolLM2) is a large part of a small model's step while its drafts almost never need the rare
tokens. A BPE vocabulary is numbered roughly by merge order, so the lowest ids are the frequent
ones (the distilled draft's head uses the same subset, drafters.distilled) and no data is needed
to pick them. Measured coverage and costs: docs/measurements/2026-12-04-fast-target-drafters.md.

The rows are the head's own: where the head runs on the row-invariant kernels (every native
precision but int8) the draft head is a view of the first rows of its panels, whatever their kind
(fp32, bf16, int8 per group), held once and computed by the same kernel, so on the subset the
draft's logits are its full head's bit for bit; elsewhere (the int8 copy's fbgemm head) they are
copied in bf16. Lossless whatever the subset: the draft's logits are -inf outside it, so q is
zero there (a token outside is never drafted, the target still emits it), and q comes from the
same sampling pipeline as the target's p.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specdecode.drafters.distilled import SubsetHead
from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.models.logits_for import is_none, logit_positions

if TYPE_CHECKING:
    from specdecode.models.config import ModelConfig
    from specdecode.models.invariance import Invariance
    from specdecode.models.target import Cache, Target


def first_rows(p: kernels.Panels, n: int) -> kernels.Panels:
    """The first `n` output rows of panels `p`, as a view of the same storage."""
    panels = -(-n // kernels.PANEL)

    def cut(t: torch.Tensor | None, per_row: bool = False) -> torch.Tensor | None:
        return None if t is None else t[: panels * kernels.PANEL] if per_row else t[:panels]

    return dataclasses.replace(
        p, w=p.w[:panels], n=n, zero=cut(p.zero), bias=None if p.bias is None else p.bias[:n],
        scale=cut(p.scale, per_row=p.kind == kernels.KIND_I8))  # int8: one scale per row


def draft_head(model: Target, vocab: int) -> SubsetHead:
    """The lowest `vocab` token ids of `model`'s LM head (a native runner, or a LayerSubset of
    one), scoring a vocabulary of the model's size."""
    from specdecode.models.linears import float_weight

    size = int(model.cfg.vocab_size)
    if not 1 <= vocab <= size:
        raise SpecDecodeError(f"draft_vocab must be 1..{size} (the target's vocabulary), "
                              f"got {vocab}")
    runner: Any = getattr(model, "model", model)  # a LayerSubset's target
    head = runner.lm_head
    ids = torch.arange(vocab)
    panels = head.exact_panels() if hasattr(head, "exact_panels") else None
    if panels is not None and panels.n == size:
        return SubsetHead(None, ids, size, panels=first_rows(panels, vocab))
    return SubsetHead(float_weight(head)[0], ids, size, torch.bfloat16)


class WithHead(nn.Module):
    """`model` (a native runner, or drafters.layerskip.LayerSubset) drafting through `head`
    instead of its own LM head: a models.target.Target for DraftModelDrafter and
    engine.draft_in_cache. A module holding both, so that memory reports count the model
    where it is a copy and nothing where it is the target's."""

    supports_trees = False  # a draft model: it drafts chains
    invariance: Invariance | None = None

    def __init__(self, model: Target, head: SubsetHead) -> None:
        super().__init__()
        self.model = model  # a submodule where it is one
        self.head_rows = head
        self.backend, self.precision = model.backend, model.precision

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def rows_independent(self) -> bool:
        return self.model.rows_independent

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, batch: int, capacity: int) -> Cache:
        return self.model.new_cache(batch, capacity)

    def weight_bytes(self) -> int:
        from specdecode.memory import weight_bytes

        return weight_bytes(self)

    def version(self) -> str:
        return self.model.version()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_rows(hidden)  # type: ignore[no-any-return]

    def check_invariance(self, width: int) -> Invariance:
        """As any target's (a draft model is never verified against; the interface asks)."""
        from specdecode.models.invariance import measure

        self.invariance = measure(self, width)
        return self.invariance

    def forward(self, tokens: torch.Tensor, cache: Cache,
                positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                num_new: Sequence[int] | None = None, logits_for: str | torch.Tensor = "all",
                layers: Sequence[int] | None = None, return_hidden: bool = False
                ) -> torch.Tensor:
        """The model's forward with the draft head for its LM head: logits (B, T', V), -inf
        outside the head's tokens (or the hidden states, with `return_hidden`)."""
        hidden = self.model(tokens, cache, positions, tree_mask, num_new, "all", layers, True)
        if return_hidden:
            return hidden
        wanted = logit_positions(logits_for)
        if is_none(wanted):
            return hidden[:, :0, :0]
        return self.head(hidden[:, wanted])


def with_draft_head(model: Target, vocab: int | None) -> Target:
    """`model` drafting through the lowest `vocab` ids of its head; `model` itself for None."""
    return model if vocab is None else WithHead(model, draft_head(model, vocab))
