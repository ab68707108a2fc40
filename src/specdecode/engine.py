"""The engine: one speculative step is five moves, always in this order.

1. propose  - the drafter proposes up to k tokens (and the q they were drawn from, if any);
2. score    - the target scores [pending token, draft...] in ONE forward pass: k+1 rows of p;
3. verify   - a pure function keeps a prefix and draws the recovered or bonus token;
4. commit   - the target cache rolls back to the kept prefix by moving its length (no copy);
              the drafter re-syncs on the next propose from the committed context;
5. observe  - integer counters and per-phase times are updated.

k = 0 (or no drafter) is plain autoregressive decoding through the same loop, so plain and
speculative decoding share every line except the proposal.

Cache invariant: the target cache holds every committed token except the last one (the pending
token), whose logits the next step computes together with the draft.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specdecode.drafters.base import Draft, Drafter
from specdecode.errors import SpecDecodeError
from specdecode.metrics import Counters
from specdecode.models.tokenizer import IncrementalDecoder, Tokenizer
from specdecode.sampling import SamplingParams, greedy_tokens, probs_from_logits
from specdecode.stopping import StopChecker
from specdecode.verify import VerifyResult, acceptance_probability, verify_chain, verify_greedy

PREFILL_CHUNK = 256
MAX_K = 64
_EMPTY = torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class StepOutput:
    tokens: list[int]  # tokens emitted by this step (after EOS / max_tokens truncation)
    text: str  # text safe to show now
    finish_reason: str | None  # None while running; "stop" (EOS or stop string) or "length"


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request generator: seeded when asked, otherwise from fresh OS entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


class Generation:
    """One request's generation, advanced by `step()` until `finish_reason` is set."""

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer | None,
        prompt_ids: list[int],
        params: SamplingParams,
        drafter: Drafter | None = None,
        k: int = 0,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        params.validate(model.cfg.vocab_size)
        if not 0 <= k <= MAX_K:
            raise SpecDecodeError(f"k must be in 0..{MAX_K}, got {k}")
        _check_prompt(prompt_ids, params, model.cfg.max_position, k)
        self.model, self.params, self.drafter = model, params, drafter
        self.k = k if drafter is not None else 0
        self.eos_ids = frozenset(eos_ids)
        self.generator = make_generator(params.seed)
        self.prompt_len = len(prompt_ids)
        self.context = list(prompt_ids)
        self.output: list[int] = []
        self.cache = model.new_cache(1, len(prompt_ids) + params.max_tokens + self.k + 1)
        self.counters = Counters(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._stops = StopChecker(params.stop)
        self._prefilled = False

    def prefill(self) -> None:
        """Feed the prompt except its last token (the first pending token), in chunks."""
        start = time.perf_counter_ns()
        prompt = self.context[:-1]
        with torch.inference_mode():
            for i in range(0, len(prompt), PREFILL_CHUNK):
                chunk = torch.tensor([prompt[i : i + PREFILL_CHUNK]])
                self.model(chunk, self.cache, logits_for="none")
        self._prefilled = True
        self.counters.prefill_ns += time.perf_counter_ns() - start

    def step(self) -> StepOutput:
        if self.finish_reason is not None:
            return StepOutput([], "", self.finish_reason)
        if not self._prefilled:
            self.prefill()
        c = self.counters
        t0 = time.perf_counter_ns()
        draft = self._propose()  # 1. propose
        t1 = time.perf_counter_ns()
        base = len(self.context) - 1
        fed = torch.cat([torch.tensor(self.context[-1:]), draft.tokens])[None]  # (1, k+1)
        with torch.inference_mode():
            logits = self.model(fed, self.cache)[0]  # 2. score: (k+1, V)
        t2 = time.perf_counter_ns()
        result, alphas = self._verify(logits, draft)  # 3. verify
        t3 = time.perf_counter_ns()
        self.cache.rollback(0, base + 1 + result.num_accepted)  # 4. commit
        out = self._emit(result.tokens.tolist())
        c.record_step(len(draft.tokens), result.num_accepted, len(out.tokens))  # 5. observe
        c.record_alpha(alphas)
        t4 = time.perf_counter_ns()
        c.draft_ns += t1 - t0
        c.target_ns += t2 - t1
        c.verify_ns += t3 - t2
        c.other_ns += t4 - t3
        return out

    def _propose(self) -> Draft:
        room = self.params.max_tokens - len(self.output) - 1
        k = min(self.k, room)
        if self.drafter is None or k <= 0:
            return Draft(_EMPTY, None)
        ctx = torch.tensor(self.context)
        with torch.inference_mode():
            draft = self.drafter.propose(ctx, k, self.params, self.prompt_len, self.generator)
        return Draft(draft.tokens[:k].to(torch.long), None if draft.q is None else draft.q[:k])

    def _verify(self, logits: torch.Tensor, draft: Draft) -> tuple[VerifyResult, list[float]]:
        """Verification plus the per-position alpha samples sum_x min(p, q) it evaluated."""
        ctx = torch.tensor(self.context)
        k = len(draft.tokens)
        if self.params.greedy:
            target = greedy_tokens(logits, self.params, ctx, self.prompt_len, draft.tokens)
            result = verify_greedy(target, draft.tokens)
            seen = min(result.num_accepted + 1, k)
            return result, [float(target[i] == draft.tokens[i]) for i in range(seen)]
        p = probs_from_logits(logits, self.params, ctx, self.prompt_len, draft.tokens)
        result = verify_chain(p, draft.q, draft.tokens, self.generator)
        seen = min(result.num_accepted + 1, k)
        if draft.q is None:
            rows = torch.arange(seen)
            return result, p[rows, draft.tokens[:seen]].tolist()
        return result, acceptance_probability(p[:seen], draft.q[:seen]).tolist()

    def _emit(self, tokens: list[int]) -> StepOutput:
        """Commit tokens to the context; stop at EOS, max_tokens or a stop string."""
        emitted: list[int] = []
        reason: str | None = None
        for tok in tokens:
            if tok in self.eos_ids:
                reason = "stop"
                break
            emitted.append(tok)
            if len(self.output) + len(emitted) >= self.params.max_tokens:
                reason = "length"
                break
        self.context.extend(tokens)
        self.output.extend(emitted)
        text = ""
        if self._decoder is not None:
            update = self._stops.feed(self._decoder.push(emitted))
            text = update.text
            if update.stopped:
                reason = "stop"
            elif reason is not None:
                text += self._stops.flush()
        self.finish_reason = reason
        return StepOutput(emitted, text, reason)

    def run(self) -> Iterator[StepOutput]:
        while self.finish_reason is None:
            yield self.step()

    def release(self) -> None:
        """Free the caches at once (cancellation or completion)."""
        self.cache = None
        if self.drafter is not None:
            self.drafter.reset()


def _check_prompt(prompt_ids: list[int], params: SamplingParams, context: int, k: int) -> None:
    if not prompt_ids:
        raise SpecDecodeError("the prompt is empty: give at least one token of text")
    need = len(prompt_ids) + params.max_tokens + k + 1
    if len(prompt_ids) >= context:
        raise SpecDecodeError(
            f"the prompt is {len(prompt_ids)} tokens, longer than the model's context of "
            f"{context} tokens"
        )
    if need > context + k + 1:
        raise SpecDecodeError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's context of {context} tokens"
        )
