"""Integer counters per request; every rate is derived when read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Counters:
    steps: int = 0  # target forward passes after prefill (one per emitted group of tokens)
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # steps where a draft token was rejected (accepted < drafted)
    emitted: int = 0
    prompt_tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    # sum over verified draft positions of sum_x min(p, q), in millionths (kept as an integer)
    alpha_micro: int = 0
    alpha_positions: int = 0
    prefill_ns: int = 0
    draft_ns: int = 0
    target_ns: int = 0
    verify_ns: int = 0
    other_ns: int = 0
    # structured output: tokens a constraint forced (the only one allowed: emitted unscored)
    # and the time spent computing its masks (the constraint's own cost)
    forced: int = 0
    mask_ns: int = 0

    def record_step(self, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.emitted += emitted
        while len(self.drafted_per_pos) < drafted:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(drafted):
            self.drafted_per_pos[i] += 1
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def record_alpha(self, values: list[float]) -> None:
        self.alpha_micro += sum(round(v * 1_000_000) for v in values)
        self.alpha_positions += len(values)

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (not alpha when k > 1: later positions need earlier acceptances)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def alpha(self) -> float | None:
        """Estimated alpha = E[sum_x min(p(x), q(x))] over the verified draft positions."""
        return self.alpha_micro / 1e6 / self.alpha_positions if self.alpha_positions else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per target forward pass, the bonus or recovered token included."""
        return (self.accepted + self.steps) / self.steps if self.steps else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            alpha=self.alpha,
            mean_acceptance_length=self.mean_acceptance_length,
        )
        return out
