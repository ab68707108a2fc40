"""Speculation counters read from a server's Prometheus /metrics, and their attribution to a batch.

Names (Prometheus counters; the exposition's "_total" suffix and a "namespace:" prefix such as
vLLM's "vllm:" are ignored, so this server's names and vLLM's read the same):

- spec_decode_num_drafts: verification steps that drafted at least one token;
- spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens;
- spec_decode_num_accepted_tokens_per_pos{position="i"}: accepted draft tokens at position i;
- generation_tokens: tokens generated (used only to detect traffic from other clients).

Series labelled with another `model_name` than the measured model are left out; the others are
summed (e.g. vLLM's per-engine series). Without drafts, draft tokens and accepted tokens the
server's acceptance is unknown (None), never zero.

Attribution (`batch_counters`): the runner reads the counters before and after each batch (one
turn of up to `batch_size` concurrent requests); the difference is the batch's. Another client's
traffic during the batch would pollute it: the difference is refused (acceptance unknown for that
batch) when it is more than the batch could have produced (more generated tokens than the batch
received, or more accepted tokens than its requests' tokens after the first plus, for each
request that stopped at an end-of-sequence token, a full draft: a step that accepts EOS counts
the draft tokens accepted with it, though none of them reaches the client), but smaller
pollution cannot be detected. From the difference, as the `records` schema wants them:

- accepted_per_pos: the per-position counters; when the server exports none, the accepted tokens
  are placed at the first positions (an estimate);
- drafted_per_pos[i] (steps drafting at least i + 1 tokens): not exported by any server. Position
  0 is every draft step; the draft tokens left are spread so that draft lengths are as even as
  possible, never below what was accepted at each position. Exact for a fixed k;
- rejections (steps that rejected a draft token): draft steps minus the steps estimated to have
  accepted their whole draft, sum_i (steps of length i + 1) * accepted_per_pos[i] /
  drafted_per_pos[i]. Exact for a fixed k;
- steps (target passes after prefill): tokens after the first, summed over the batch's requests,
  plus one per request that stopped (its EOS, not streamed), minus accepted tokens (each step
  emits its accepted tokens plus one); at least the draft steps. An estimate when a step accepted
  tokens after an EOS.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.limits import MAX_K as MAX_DRAFT  # the most draft tokens one step may propose

DRAFTS = "spec_decode_num_drafts"
DRAFT_TOKENS = "spec_decode_num_draft_tokens"
ACCEPTED = "spec_decode_num_accepted_tokens"
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "generation_tokens"
SERIES = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    """One series of an exposition: base name (prefix and "_total" removed), labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def base_name(name: str) -> str:
    """"vllm:spec_decode_num_drafts_total" -> "spec_decode_num_drafts"."""
    name = name.rsplit(":", 1)[-1]
    return name.removesuffix("_total")


def parse_exposition(text: str) -> list[Sample]:
    """The series of a Prometheus text exposition; comments and unreadable lines are skipped."""
    out: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = SERIES.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = {k: v for k, v in LABEL.findall(match.group(2) or "")}
        out.append(Sample(base_name(match.group(1)), labels, value))
    return out


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative speculation counters of a server (or the difference over a batch)."""

    drafts: int
    draft_tokens: int
    accepted: int
    per_pos: tuple[int, ...] | None  # None: the server exports no per-position counter
    generation_tokens: int | None  # None: not exported


def _total(samples: Sequence[Sample], name: str) -> int | None:
    values = [s.value for s in samples if s.name == name]
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return round(sum(values))


def _per_position(samples: Sequence[Sample]) -> tuple[int, ...] | None:
    by_pos: dict[int, float] = {}
    for s in samples:
        pos = s.labels.get("position", "")
        if s.name == PER_POS and pos.isdigit() and math.isfinite(s.value):
            by_pos[int(pos)] = by_pos.get(int(pos), 0.0) + s.value
    if not by_pos:
        return None
    return tuple(round(by_pos.get(i, 0.0)) for i in range(max(by_pos) + 1))


def read_counters(text: str, model: str | None = None) -> SpecCounters | None:
    """The speculation counters in a /metrics text, for `model` (series labelled with another
    model_name are left out); None when drafts, draft tokens or accepted tokens are missing."""
    samples = [s for s in parse_exposition(text)
               if model is None or s.labels.get("model_name", model) == model]
    drafts, tokens, accepted = (_total(samples, n) for n in (DRAFTS, DRAFT_TOKENS, ACCEPTED))
    if drafts is None or tokens is None or accepted is None:
        return None
    return SpecCounters(drafts, tokens, accepted, _per_position(samples),
                        _total(samples, GENERATION_TOKENS))


def counter_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecCounters | None:
    """after - before; None when either is unknown or a counter went down (a restart)."""
    if before is None or after is None:
        return None
    per_pos = None
    if before.per_pos is not None and after.per_pos is not None:
        width = max(len(before.per_pos), len(after.per_pos))
        a = list(after.per_pos) + [0] * (width - len(after.per_pos))
        b = list(before.per_pos) + [0] * (width - len(before.per_pos))
        per_pos = tuple(x - y for x, y in zip(a, b, strict=True))
    gen = None
    if before.generation_tokens is not None and after.generation_tokens is not None:
        gen = after.generation_tokens - before.generation_tokens
    delta = SpecCounters(after.drafts - before.drafts, after.draft_tokens - before.draft_tokens,
                         after.accepted - before.accepted, per_pos, gen)
    values = [delta.drafts, delta.draft_tokens, delta.accepted, *(per_pos or ()), gen or 0]
    return delta if min(values) >= 0 else None


STEPS = "engine_steps"  # this server's steps by batch size (bench.openloop's replays read it)


def read_steps(text: str, model: str | None = None) -> dict[int, int] | None:
    """Engine steps by batch size in a /metrics text (`engine_steps_total{batch_size}`, this
    project's server), for `model`; None when the server exports none."""
    out: dict[int, int] = {}
    for s in parse_exposition(text):
        size = s.labels.get("batch_size", "")
        if s.name == STEPS and size.isdigit() and math.isfinite(s.value) and \
                (model is None or s.labels.get("model_name", model) == model):
            out[int(size)] = out.get(int(size), 0) + round(s.value)
    return out or None


def steps_delta(before: dict[int, int] | None, after: dict[int, int] | None
                ) -> list[float] | None:
    """after - before as a list by batch size ([b - 1]); None when unknown or gone down."""
    if before is None or after is None:
        return None
    delta = {b: n - before.get(b, 0) for b, n in after.items()}
    if any(n < 0 for n in delta.values()):
        return None
    width = max(delta, default=0)
    return [float(delta.get(b, 0)) for b in range(1, width + 1)]


# ----------------------------------------------------------------------------- attribution


@dataclass(frozen=True)
class BatchCounters:
    """One batch's counters, shaped as `records.RequestSample` wants them."""

    drafted: int
    accepted: int
    drafted_per_pos: list[int]
    accepted_per_pos: list[int]
    rejections: int
    steps: int


def front_loaded(accepted: int, drafted_per_pos: Sequence[int]) -> list[int]:
    """Accepted tokens placed at the first positions, at most drafted_per_pos[i] at each."""
    out: list[int] = []
    for d in drafted_per_pos:
        take = min(accepted, d)
        out.append(take)
        accepted -= take
    return out


def drafted_positions(drafts: int, draft_tokens: int, accepted_per_pos: Sequence[int]
                      ) -> list[int] | None:
    """Steps drafting at least i + 1 tokens, as even as the counts allow (see the module
    docstring); None when the counts contradict each other."""
    if drafts == 0:
        return [] if draft_tokens == 0 and not any(accepted_per_pos) else None
    if accepted_per_pos and accepted_per_pos[0] > drafts:
        return None
    out = [drafts, *accepted_per_pos[1:]]
    rest = draft_tokens - sum(out)
    if rest < 0:
        return None
    i = 1
    while rest > 0:
        if i == len(out):
            out.append(0)
        add = min(rest, drafts - out[i])
        out[i] += add
        rest -= add
        i += 1
    return out


def estimated_rejections(drafted_per_pos: Sequence[int], accepted_per_pos: Sequence[int]) -> int:
    """Draft steps minus those estimated to have accepted their whole draft."""
    full = 0.0
    for i, d in enumerate(drafted_per_pos):
        ending_here = d - (drafted_per_pos[i + 1] if i + 1 < len(drafted_per_pos) else 0)
        if d > 0 and i < len(accepted_per_pos):
            full += ending_here * accepted_per_pos[i] / d
    drafts = drafted_per_pos[0] if drafted_per_pos else 0
    return min(drafts, max(0, drafts - round(full)))


def batch_counters(delta: SpecCounters | None, output_tokens: Sequence[int], stopped: int = 0
                   ) -> BatchCounters | None:
    """The counters of a batch whose requests received `output_tokens` (`stopped` of them ended
    with finish_reason "stop"), or None (unknown) when `delta` is unknown, inconsistent or more
    than the batch could have produced (other traffic)."""
    if delta is None:
        return None
    after_first = sum(max(n - 1, 0) for n in output_tokens)
    if delta.generation_tokens is not None and \
            delta.generation_tokens > sum(output_tokens) + stopped:
        return None
    if delta.accepted > after_first + stopped * MAX_DRAFT or delta.accepted > delta.draft_tokens:
        return None
    per_pos = list(delta.per_pos) if delta.per_pos is not None else []
    while per_pos and per_pos[-1] == 0:
        per_pos.pop()
    if per_pos and sum(per_pos) != delta.accepted:
        return None
    dpp = drafted_positions(delta.drafts, delta.draft_tokens, per_pos)
    if dpp is None:
        return None
    app = per_pos if delta.per_pos is not None else front_loaded(delta.accepted, dpp)
    if len(app) > len(dpp) or any(a > d for a, d in zip(app, dpp, strict=False)):
        return None
    steps = max(after_first + stopped - delta.accepted, delta.drafts)
    return BatchCounters(delta.draft_tokens, delta.accepted, dpp, app,
                         estimated_rejections(dpp, app), steps)
