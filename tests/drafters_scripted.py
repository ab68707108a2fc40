"""Scripted drafters (tests only): always right, always wrong, or right for a prefix."""

from __future__ import annotations

import torch

from specdecode.drafters.base import Draft, Drafter, DraftRequest


class ScriptedDrafter(Drafter):
    """Proposes from a known continuation: always right, always wrong, or right for a prefix."""

    def __init__(self, script: list[int], prompt_len: int, mode: str, right_for: int = 0,
                 vocab: int = 49152) -> None:
        self.name, self.script, self.prompt_len = f"scripted-{mode}", script, prompt_len
        self.mode, self.right_for, self.vocab = mode, right_for, vocab

    def reset(self) -> None:
        pass

    def _token(self, i: int, j: int) -> int:
        right = self.script[i] if i < len(self.script) else 0
        if self.mode == "perfect" or (self.mode == "partial" and j < self.right_for):
            return right
        return (right + 1) % self.vocab

    def propose(self, request: DraftRequest) -> Draft:
        context, k = request.context, request.k
        done = len(context) - self.prompt_len
        return Draft(torch.tensor([self._token(done + j, j) for j in range(k)]), None)
