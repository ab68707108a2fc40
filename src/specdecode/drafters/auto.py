"""`ngram+auto` and `suffix+auto`: the hybrid (drafters.hybrid) whose model part is chosen at load
by measurement instead of by its name.

Why: which model drafter pays depends on the target's precision and the machine. The w4a16 copy
was the best model part of an fp32 target (it drafts for about half a step), costs nearly a
whole step of a bf16 target, and of a w4a16 target it is the target itself: drafting a token
then costs a full step and no model part can pay. A name fixed in a configuration cannot follow
that; a measurement at load can.

How (`measure`): every candidate (`candidates`: the w4a16 copy with its whole head and with the
lowest half or third of the vocabulary in its head, drafters.draft_head; the int8 copy; the
shipped distilled draft where it was made for this target) is measured in this process against
the target itself:

- alpha: the candidate's greedy agreement with the target over a calibration chat
  (drafters.layerskip.CALIBRATION_CHAT): the probability that a first draft token is accepted,
  taken as the per-token acceptance (the i.i.d. model the controller uses). A copy drafts as it
  does in the engine, in the target's cache, one position at a time (POSITIONS of them: the
  int8 copy quantizes a whole call's activations with one scale, so teacher-forcing it over the
  whole chat at once would understate it badly, 0.48 against its drafting's ~0.8 on SmolLM2); a
  separate draft is teacher-forced over the whole chat;
- c: the time of the candidate's forward over one draft token (its argmax included; for a copy,
  in the target's cache, as it drafts) over the time of the target's plain step, and v(T): the
  target's forward over T positions over its plain step; both medians of rounds that
  interleave the target and every candidate after a warm-up round;
- the predicted speedup of drafting k tokens a step, S = E(alpha, k) / (k c + v(k + 1))
  (docs/design.md), at the best k.

The candidate with the highest S is the model part if S beats plain decoding by
acceptance.PAY_MARGIN; otherwise there is none and the lookup drafts alone. Under `--k auto` the
controller then still measures both as they run and turns the model part off where it stops
paying. Measuring costs about 80 forwards of a token per candidate and a pass of the target
over the calibration chat (a few hundred tokens): seconds.

Lossless whatever is chosen: the choice is made once, before any request, from nothing a
request draws; each model part is lossless on its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from specdecode.acceptance import PAY_MARGIN, expected_tokens
from specdecode.drafters.base import Drafter, DrafterFactory, native
from specdecode.drafters.options import INT8_COPY, W4A16_COPY
from specdecode.errors import SpecDecodeError

MAX_K = 4  # the longest draft the prediction considers (v is measured up to width MAX_K + 1)
ROUNDS = 5  # timed rounds after the warm-up round
POSITIONS = 48  # calibration positions a copy drafts at to measure its alpha
VOCAB_FRACTIONS = (2, 3)  # draft heads over the lowest 1/2 and 1/3 of the vocabulary


@dataclass(frozen=True)
class Candidate:
    """One candidate model part and what was measured of it (None: not measured, `note` says
    why)."""

    name: str  # as a configuration spells it: "w4a16", "w4a16:draft_vocab=24576"
    c: float | None = None  # its draft token's forward / the target's plain step
    alpha: float | None = None  # greedy agreement with the target, teacher-forced
    k: int = 0  # the draft length of the best prediction
    predicted: float | None = None  # predicted speedup at that k
    note: str = ""


@dataclass(frozen=True)
class Selection:
    """What `measure` found: every candidate, the target's v(T) for T = 1.., the pick."""

    candidates: tuple[Candidate, ...]
    v: tuple[float, ...]
    chosen: str | None  # None: no model part pays, the lookup drafts alone
    tokens: int  # calibration tokens (a copy's alpha: at up to POSITIONS of them)
    plain_step_s: float

    def describe(self) -> str:
        rows = [f"{c.name}: " + (c.note if c.c is None else
                                 f"c {c.c:.2f}, alpha {c.alpha:.2f}, predicted "
                                 f"{c.predicted:.2f}x at k={c.k}") for c in self.candidates]
        pick = self.chosen or "none (the lookup alone)"
        return f"model part {pick}; " + "; ".join(rows)

    def as_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "v": list(self.v), "tokens": self.tokens,
                "plain_step_s": self.plain_step_s,
                "candidates": [asdict(c) for c in self.candidates]}


def predicted_speedup(alpha: float, c: float, v: Sequence[float]) -> tuple[float, int]:
    """(the best predicted speedup, its k) of drafting k = 1..len(v) - 1 tokens a step at
    per-token acceptance alpha and cost c per draft token, where v[T - 1] is the cost of the
    target's forward over T positions relative to one (v[0] = 1)."""
    best, best_k = 0.0, 0
    for k in range(1, len(v)):
        s = expected_tokens(alpha, k) / (k * c + v[k])
        if s > best:
            best, best_k = s, k
    return best, best_k


def choose(candidates: Sequence[Candidate], margin: float = PAY_MARGIN) -> Candidate | None:
    """The measured candidate with the highest predicted speedup, if it beats plain decoding by
    `margin`; else None."""
    measured = [c for c in candidates if c.predicted is not None]
    best = max(measured, key=lambda c: c.predicted or 0.0, default=None)
    return best if best is not None and (best.predicted or 0.0) > 1.0 + margin else None


@dataclass
class _Part:
    """A candidate's draft model and how to make its per-request drafters."""

    model: Any
    in_cache: bool  # drafts in the target's KV cache (a copy) or in its own (a separate draft)
    make: Callable[[], Drafter]


def candidates(target: Any, capacity: int) -> dict[str, _Part | str]:
    """The model parts `measure` compares, by name: a part, or why it cannot run here."""
    from specdecode.drafters.distilled import DEFAULT_DIR, load_distilled
    from specdecode.drafters.draft_head import with_draft_head
    from specdecode.drafters.draft_model import DraftModelDrafter, quantized_copy

    def in_cache(model: Any, name: str) -> _Part:
        return _Part(model, True, lambda: DraftModelDrafter(model, name, capacity, in_cache=True))

    def separate(model: Any, name: str) -> _Part:
        return _Part(model, False, lambda: DraftModelDrafter(model, name, capacity))

    w4a16 = W4A16_COPY  # the quantized-copy drafters (drafters.options), not precisions
    out: dict[str, _Part | str] = {}
    try:
        copy = quantized_copy(w4a16, target)
    except SpecDecodeError as exc:
        out[w4a16] = f"not measured: {exc}"
    else:
        out[w4a16] = "the target itself: a draft token would cost a whole step" \
            if copy is target else in_cache(copy, w4a16)
        for fraction in VOCAB_FRACTIONS:
            size = max(1, int(target.cfg.vocab_size) // fraction)
            out[f"{w4a16}:draft_vocab={size}"] = in_cache(with_draft_head(copy, size), w4a16)
    others: tuple[tuple[str, Callable[[], Any], Callable[[Any, str], _Part]], ...] = (
        (INT8_COPY, lambda: quantized_copy(INT8_COPY, target), in_cache),
        ("distilled", lambda: load_distilled(DEFAULT_DIR, target), separate))
    for name, load, part in others:
        try:
            model = load()
        except SpecDecodeError as exc:
            out[name] = f"not measured: {exc}"
        else:
            out[name] = part(model, name)
    return out


def _agreement(part: _Part, ids: torch.Tensor, want: torch.Tensor, cache: Any,
               positions: int) -> float:
    """Share of positions of `ids` (1, T) where `part`'s greedy first draft token is the target's
    (`want`: its argmax at each position). A copy drafts as it does in the engine: in the
    target's `cache` (holding the target's keys and values of `ids`), one position at a time,
    at `positions` positions spread over the text, the last first (a draft writes its own key
    and value at the slot it feeds, which only later positions read). A separate draft is
    teacher-forced over the whole text in a cache of its own."""
    n = ids.shape[1]
    with torch.inference_mode():
        if not part.in_cache:
            got = part.model(ids, part.model.new_cache(1, n))[0].argmax(dim=-1)
            return float((got == want).float().mean())
        stride = max(1, (n - 1) // positions)
        at = range(n - 1, max(0, n - 1 - stride * positions), -stride)
        hits = 0
        for j in at:
            cache.lengths[0] = j
            hits += int(part.model(ids[:, j : j + 1], cache, logits_for="last")[0, -1].argmax()
                        == want[j])
        cache.lengths[0] = n
    return hits / len(at)


def calibration(tokenizer: Any) -> list[int]:
    """The token ids alpha and the costs are measured over: the calibration chat of layer
    skipping (drafters.layerskip.CALIBRATION_CHAT), code, a summary and an explanation."""
    from specdecode.drafters.layerskip import CALIBRATION_CHAT, calibration_ids

    return calibration_ids(tokenizer, CALIBRATION_CHAT)


def measure(target: Any, calibration_ids: Sequence[int], parts: dict[str, _Part | str],
            rounds: int = ROUNDS, max_k: int = MAX_K, positions: int = POSITIONS) -> Selection:
    """Measure every part against `target` over `calibration_ids` (see the module's docstring)
    and choose."""
    room = int(target.cfg.max_position) - max_k - 2
    ids = torch.tensor([list(calibration_ids)[:room]], dtype=torch.long)  # (1, T)
    n = ids.shape[1]
    if n < 2:
        raise SpecDecodeError("ngram+auto: the calibration text is too short for this model")
    cache = target.new_cache(1, n + max_k + 2)
    with torch.inference_mode():
        want = target(ids, cache)[0].argmax(dim=-1)  # (T,)
    live = {name: p for name, p in parts.items() if isinstance(p, _Part)}
    alpha = {name: _agreement(p, ids, want, cache, positions)
             for name, p in live.items()}
    times = _time(target, ids, cache, live, rounds, max_k)
    plain = times["target:1"]
    v = tuple(times[f"target:{t}"] / plain for t in range(1, max_k + 2))
    rows = []
    for name, part in parts.items():
        if not isinstance(part, _Part):
            rows.append(Candidate(name, note=part))
            continue
        c = times[name] / plain
        s, k = predicted_speedup(alpha[name], c, v)
        rows.append(Candidate(name, c, alpha[name], k, s))
    best = choose(rows)
    return Selection(tuple(rows), v, None if best is None else best.name, n, plain)


def _time(target: Any, ids: torch.Tensor, cache: Any, parts: dict[str, _Part], rounds: int,
          max_k: int) -> dict[str, float]:
    """Median seconds of the target's forward over T = 1..max_k + 1 positions ("target:T") and
    of each part's forward over one draft token, its argmax included (by name), after the
    context `ids` (whose keys and values the target's `cache` holds): a warm-up round, then
    `rounds` rounds interleaving them all."""
    n = ids.shape[1]
    own: dict[str, Any] = {}
    with torch.inference_mode():
        for name, part in parts.items():
            if not part.in_cache:
                own[name] = part.model.new_cache(1, n + 2)
                part.model(ids, own[name], logits_for="none")
    calls: dict[str, Callable[[], object]] = {}
    for t in range(1, max_k + 2):
        calls[f"target:{t}"] = _call(target, ids[:, -t:], cache, n, "all")
    for name, part in parts.items():
        calls[name] = _call(part.model, ids[:, -1:], own.get(name, cache), n, "last")
    samples: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                if r:  # round 0 warms up
                    samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(xs) for name, xs in samples.items()}


def _call(model: Any, tokens: torch.Tensor, cache: Any, length: int, logits_for: str
          ) -> Callable[[], object]:
    def call() -> object:
        cache.lengths[0] = length  # score the same positions every time
        return model(tokens, cache, logits_for=logits_for).argmax(dim=-1)
    return call


def auto_factory(lookup: DrafterFactory, target: Any, tokenizer: Any, capacity: int,
                 name: str) -> DrafterFactory:
    """The `ngram+auto` (`suffix+auto`, by `name`) factory: the hybrid of `lookup` and the
    measured best model part, or `lookup` alone where none pays; its `selection` says what was
    measured and chosen."""
    from specdecode.drafters.hybrid import HybridFactory

    model = native(target, name)
    if tokenizer is None:
        raise SpecDecodeError(f"the {name} drafter measures its model part on a calibration "
                              "chat and needs the model's tokenizer")
    parts = candidates(model, capacity)
    selection = measure(model, calibration(tokenizer), parts)
    chosen = parts.get(selection.chosen or "")
    factory = lookup if not isinstance(chosen, _Part) else HybridFactory(
        lookup, DrafterFactory(chosen.make), name)
    factory.selection = selection
    return factory
