"""`logits_for` of `Target.__call__` (models.target), decoded here once for every backend: which of
a call's new positions get logits. Not in models/target.py, whose interface admits no Any: a
slice and an isinstance on torch.Tensor are Any to mypy."""

from __future__ import annotations

import torch

EVERY, LAST, NO_LOGITS = slice(None), slice(-1, None), slice(0, 0)
_NAMED = {"all": EVERY, "last": LAST, "none": NO_LOGITS}


def logit_positions(logits_for: str | torch.Tensor) -> slice | torch.Tensor:
    """EVERY ("all"), LAST ("last": each row's last new position), NO_LOGITS ("none"), or the
    index tensor given; ValueError naming any other value."""
    if isinstance(logits_for, torch.Tensor):
        return logits_for
    found = _NAMED.get(logits_for)
    if found is None:
        raise ValueError(f"logits_for={logits_for!r} (all, last, none or a tensor of indices)")
    return found


def is_none(positions: slice | torch.Tensor) -> bool:
    """Whether `positions` (logit_positions') asks for no logits at all."""
    return isinstance(positions, slice) and positions == NO_LOGITS


def is_last(positions: slice | torch.Tensor) -> bool:
    """Whether `positions` asks for each row's last position only."""
    return isinstance(positions, slice) and positions == LAST
