"""The one sampling pipeline: the single place where the target's p and the draft's q are computed.

(Functions below SamplingParams are being written; see the module docstring of each.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; prompt + output tokens (HF / vLLM convention)
    presence_penalty: float = 0.0  # OpenAI convention; output tokens only
    frequency_penalty: float = 0.0  # OpenAI convention; output tokens only
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SpecDecodeError naming the first invalid field and its value."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecDecodeError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecDecodeError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise SpecDecodeError(f"min_p must be in [0, 1), got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SpecDecodeError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not (-2.0 <= value <= 2.0):
                raise SpecDecodeError(f"{name} must be in [-2, 2], got {value}")
        if self.max_tokens < 1:
            raise SpecDecodeError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(s == "" for s in self.stop):
            raise SpecDecodeError("stop strings must be non-empty")
        for token, bias in self.logit_bias:
            if vocab_size is not None and not (0 <= token < vocab_size):
                raise SpecDecodeError(
                    f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})"
                )
            if not math.isfinite(bias):
                raise SpecDecodeError(f"logit_bias for token {token} must be finite, got {bias}")
