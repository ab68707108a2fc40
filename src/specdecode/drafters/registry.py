"""Drafters by name, as the CLI, the benchmark and the server ask for them.

`drafter_factory` loads whatever weights a drafter needs once and returns a function that makes
a fresh per-request drafter sharing them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from specdecode.drafters.base import Drafter
from specdecode.errors import SpecDecodeError

DRAFTERS = ("none", "draft-model", "int8")

DrafterFactory = Callable[[], Drafter]


def drafter_factory(
    name: str, target: Any, draft_model: str | None = None, capacity: int = 4096
) -> DrafterFactory | None:
    """A maker of per-request drafters for `target` (a runner); None for 'none'."""
    from specdecode.drafters.draft_model import DraftModelDrafter, check_vocab
    from specdecode.models.precision import quantize_int8

    if name == "none":
        return None
    if name == "int8":
        if getattr(target, "backend", "") != "native":
            raise SpecDecodeError("the int8 drafter needs a target on the native runner")
        weights = quantize_int8(copy.deepcopy(target))
        return lambda: DraftModelDrafter(weights, "int8", capacity)
    if name == "draft-model":
        if not draft_model:
            raise SpecDecodeError("--drafter draft-model needs --draft-model PATH")
        from specdecode.models.loading import load_model

        draft = load_model(draft_model).model
        check_vocab(target, draft, draft_model)
        return lambda: DraftModelDrafter(draft, "draft-model", capacity)
    raise SpecDecodeError(f"unknown drafter '{name}' (known: {', '.join(DRAFTERS)})")
