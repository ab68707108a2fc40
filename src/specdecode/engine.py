"""The engine: one speculative step is five moves, always in this order.

1. propose  - the drafter proposes up to k tokens (and the q they were drawn from, if any);
              a quantized copy of the target drafts in the target's own cache, a batch's rows
              together (draft_rows, draft_in_cache);
2. score    - the target scores [pending token, draft...] in ONE forward pass: k+1 rows of p;
3. verify   - a pure function keeps a prefix and draws the recovered or bonus token;
4. commit   - the target cache rolls back to the kept prefix by moving its length (no copy);
              the drafter re-syncs on the next propose from the committed context;
5. observe  - integer counters and per-phase times are updated.

k = 0 (or no drafter) is plain autoregressive decoding through the same loop, so plain and
speculative decoding share every line except the proposal.

Cache invariant: the target cache holds every committed token except the last one (the pending
token), whose logits the next step computes together with the draft.

Drafters: the engine uses only what drafters.base.Drafter declares. Each step it asks for a
proposal with a DraftRequest and, after verification, tells the drafter what was accepted
(`observe_result`).

Feature hook: a drafter with `wants_hidden` (the EAGLE-style heads drafter) also gets the
target's hidden states through its `observe(hidden, start)`. The score move (and prefill)
then run the target with return_hidden=True and apply its LM head here, which gives the same
logits bit for bit, and commit hands the drafter the hidden rows of the positions it kept
(the pending token and the accepted drafts). Other drafters are untouched.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specdecode.constraints import Constraint, constrain_draft
from specdecode.control import AlphaEstimate, Controller, CostModel, StepObservation, best_width
from specdecode.counters import Counters
from specdecode.drafters.base import CacheModel, Draft, Drafter, DraftRequest, Rounds, ids_tensor
from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_K
from specdecode.models.target import Cache, Target
from specdecode.models.tokenizer import IncrementalDecoder, Tokenizer
from specdecode.sampling import (
    PositionNoise,
    SamplingParams,
    argmax_rows,
    greedy_tokens,
    probs_from_logits,
    process_logits,
    uses_history,
)
from specdecode.stopping import StopChecker
from specdecode.trees import (
    best_path,
    chain_confidences,
    check_tree_draft,
    cut_depth,
    keep_best,
    kept_slots,
    layout,
)
from specdecode.verify import (
    TreeVerifyResult,
    VerifyResult,
    acceptance_probability,
    tree_path,
    verify_chain,
    verify_greedy,
    verify_invariant,
    verify_tree,
    verify_tree_greedy,
    verify_tree_invariant,
)

PREFILL_CHUNK = 256
_EMPTY = torch.zeros(0, dtype=torch.long)
DEAD_END = "constraint_dead_end"  # finish reason: the constraint allows no next token


@dataclass(frozen=True)
class StepOutput:
    tokens: list[int]  # tokens emitted by this step (after EOS / max_tokens truncation)
    text: str  # text safe to show now
    finish_reason: str | None  # None while running; "stop" (EOS or stop string) or "length"
    # (or DEAD_END: a constraint allows no next token)


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request generator: seeded when asked, otherwise from fresh OS entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


class Generation:
    """One request's generation, advanced by `step()` until `finish_reason` is set.

    Alone, it owns a batch-1 cache. In a BatchEngine, the engine adopts its prefilled cache into
    a row of the shared batch cache and runs the score move for all rows at once; the other moves
    (propose, verify, commit, observe) stay here, per request.
    """

    def __init__(
        self,
        model: Target,
        tokenizer: Tokenizer | None,
        prompt_ids: list[int],
        params: SamplingParams,
        drafter: Drafter | None = None,
        k: int = 0,
        eos_ids: tuple[int, ...] = (),
        category: str | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        params.validate(model.cfg.vocab_size)
        if not 0 <= k <= MAX_K:
            raise SpecDecodeError(f"k must be in 0..{MAX_K}, got {k}")
        _check_prompt(prompt_ids, params, model.cfg.max_position, k)
        self.model, self.params, self.drafter = model, params, drafter
        self.k = k if drafter is not None else 0
        # token trees (Draft.parents): scored as trees on a target that can (the native
        # runner's tree masks), else verified as their most likely path (trees.best_path)
        self.max_nodes = drafter.tree_nodes(self.k) if drafter is not None and self.k else 0
        if self.max_nodes and drafter is not None and drafter.wants_hidden:
            raise SpecDecodeError(f"the {drafter.name} drafter drafts token trees and observes "
                                  "hidden states: the engine supports one or the other")
        self.trees = self.max_nodes > 0 and model.supports_trees
        self.next_k = self.k  # draft length of the next step; a controller may change it
        self.model_k: int | None = None  # the controller's k for a fits_width drafter's model
        self.category = category
        # structured output: the request's grammar state (constraints.Matcher), or None
        self.matcher = constraint.matcher() if constraint is not None else None
        self.eos_ids = frozenset(eos_ids) | frozenset(constraint.eos_ids if constraint else ())
        self.unfed = 1  # trailing context tokens not in the cache: pending + forced ones
        # a request without a seed gets one, recorded, so that any output can be reproduced
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = make_generator(self.seed)
        self.noise = None if params.greedy or params.rule != "invariant" else \
            PositionNoise(self.seed)
        self.prompt_len = len(prompt_ids)
        self.context = list(prompt_ids)
        self.output: list[int] = []
        self.capacity = len(prompt_ids) + params.max_tokens + max(self.k, self.max_nodes) + 1
        self.cache: Cache | None = None
        self.row = 0
        self.counters = Counters(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._stops = StopChecker(params.stop)
        self._prefilled = 0  # prompt tokens (all but the last) already in the cache
        # the drafter observes the target's features
        self.wants_hidden = drafter is not None and drafter.wants_hidden
        self.last_alphas: list[float] = []  # alpha samples of the last verified step
        self.last_committed = 0  # tokens the last step committed (EOS included)
        self.catch_up_ns = 0  # drafter time this step spent catching up (see Controller)

    @property
    def kv(self) -> Cache:
        """The cache this request decodes in (its own, or its batch's), once allocated."""
        if self.cache is None:
            raise SpecDecodeError("the request has no cache: it was released")
        return self.cache

    @property
    def prefilled(self) -> bool:
        return self._prefilled >= self.prompt_len - 1

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens (all but the last) already in the cache."""
        return self._prefilled

    def prefill(self, max_tokens: int | None = None) -> bool:
        """Feed up to `max_tokens` more prompt tokens (all but the last); True when done."""
        start = time.perf_counter_ns()
        if self.cache is None:
            self.cache = self.model.new_cache(1, self.capacity)
        end = self.prompt_len - 1
        if max_tokens is not None:
            end = min(end, self._prefilled + max_tokens)
        with torch.inference_mode():
            for i in range(self._prefilled, end, PREFILL_CHUNK):
                chunk = torch.tensor([self.context[i : min(end, i + PREFILL_CHUNK)]])
                if self.wants_hidden:
                    hidden = self.model(chunk, self.cache, return_hidden=True)[0]  # (T, H)
                    self.drafter.observe(hidden, i)  # type: ignore[union-attr]
                else:
                    self.model(chunk, self.cache, logits_for="none")
        self._prefilled = end
        self.counters.prefill_ns += time.perf_counter_ns() - start
        return self.prefilled

    def adopt_prefill(self, template: Generation) -> None:
        """Start from `template`'s prefilled cache (same prompt) instead of prefilling again."""
        if template.context[: self.prompt_len] != self.context or not template.prefilled or \
                template.cache is None or not template.cache.copies_rows or self.wants_hidden:
            self.prefill()
            return
        n = self.prompt_len - 1
        self.cache = self.model.new_cache(1, self.capacity)
        self.cache.copy_row(0, template.kv, template.row, n)
        self._prefilled = n

    def step(self) -> StepOutput:
        """One whole speculative step on this request's own cache."""
        if self.finish_reason is not None:
            return StepOutput([], "", self.finish_reason)
        if not self.prefilled:
            self.prefill()
        draft = self.propose()  # 1. propose
        t1 = time.perf_counter_ns()
        fed = self.fed(draft)[None]
        logits, hidden = score(self.model, fed, self.kv, self.wants_hidden,
                               tree=tree_inputs([self], [draft], fed.shape[1]))  # 2. score
        self.counters.target_ns += time.perf_counter_ns() - t1
        return self.finish_step(logits[0], draft, None if hidden is None else hidden[0])

    def fed(self, draft: Draft) -> torch.Tensor:
        """The tokens the target scores this step: the pending token (after it any tokens a
        constraint forced since the last step: unscored), then the draft."""
        return torch.cat([torch.tensor(self.context[-self.unfed:]), draft.tokens])

    def propose(self) -> Draft:
        """This request's draft for its next step (timed into its counters)."""
        return draft_rows([self])[0]

    def begin_draft(self) -> Draft | Rounds:
        """Start proposing: the draft, or, for a drafter that drafts in the target's cache
        (Drafter.cache_model), its rounds for draft_in_cache to run."""
        self.catch_up_ns = 0  # a drafter's one-off catching up with the context, this step
        k = self._draft_budget()
        if self.drafter is None or k <= 0:
            return Draft(_EMPTY, None)
        request = DraftRequest(ids_tensor(self.context), k, self.params, self.prompt_len,
                               self.generator, self.model_k, self.noise, self.position,
                               self.matcher, self.unfed, self.max_nodes)
        if self.drafter.cache_model is not None and self.cache is not None and \
                self.cache.holds_tensors:
            return self.drafter.rounds(request)
        with torch.inference_mode():
            draft = self.drafter.propose(request)
        self.catch_up_ns = self.drafter.catch_up_ns
        return draft

    def end_draft(self, draft: Draft) -> Draft:
        """The draft cut to this step's budget, as the verifier takes it: a tree is checked
        (a malformed one is refused), cut to the budget's depth, and taken as its most likely
        path where it cannot be scored as a tree (a target without tree masks, or a
        constraint, whose matcher follows one path)."""
        draft = dataclasses.replace(draft, tokens=draft.tokens.to(torch.long))
        if draft.parents is not None:
            name = self.drafter.name if self.drafter is not None else "?"
            check_tree_draft(draft, self.model.cfg.vocab_size, self.max_nodes, name)
            if not self.trees or self.matcher is not None:
                draft = best_path(draft)
        draft = cut(draft, self._draft_budget())
        return draft if self.matcher is None else constrain_draft(draft, self.matcher)

    @property
    def position(self) -> int:
        """The output position of the next token (the first draft token, or the one sampled):
        what the position-keyed noise is keyed by."""
        return len(self.context) - self.prompt_len

    def _draft_budget(self) -> int:
        return min(self.next_k, self.params.max_tokens - len(self.output) - 1)

    def finish_step(self, logits: torch.Tensor, draft: Draft,
                    hidden: torch.Tensor | None = None) -> StepOutput:
        """Moves 3-5 for this request, given the target's (unfed + k, V) logits of this step
        (and its hidden states when the drafter observes them): rows for the unfed tokens
        before the pending one (forced by a constraint) are not scored."""
        c = self.counters
        forced_fed = self.unfed - 1
        logits = logits[forced_fed:]
        t2 = time.perf_counter_ns()
        result, alphas = self._verify(logits, draft)  # 3. verify
        t3 = time.perf_counter_ns()
        base = len(self.context) - 1
        if isinstance(result, TreeVerifyResult):  # 4. commit: the path's KV, compacted
            self.kv.keep(self.row, base + 1 - self.unfed, kept_slots(self.unfed, result.path))
        else:  # a chain: move the length back
            self.kv.rollback(self.row, base + 1 + result.num_accepted)
        committed = result.tokens.tolist()
        if self.drafter is not None:
            if hidden is not None and self.wants_hidden:  # features of the kept positions
                self.drafter.observe(hidden[: forced_fed + result.num_accepted + 1],
                                     base - forced_fed)
            self.drafter.observe_result(draft, result.num_accepted, committed)
        end = None
        if self.matcher is not None:
            committed, forced, end = self._constrain_commit(committed)
            c.forced += len(forced)
            c.mask_ns = self.matcher.mask_ns
            committed = committed + forced
            self.unfed = 1 + len(forced)
        out = self._emit(committed, end)
        c.record_step(len(draft.tokens), result.num_accepted, len(out.tokens))  # 5. observe
        self.last_committed = result.num_accepted + 1
        c.record_alpha(alphas)
        self.last_alphas = alphas
        c.verify_ns += t3 - t2
        c.other_ns += time.perf_counter_ns() - t3
        return out

    def _constrain_commit(self, committed: list[int]) -> tuple[list[int], list[int], str | None]:
        """Structured output: advance the matcher by the committed tokens (rolling back the
        rest of the draft), then take the tokens it forces (the only one allowed: the
        target's constrained distribution is that token with probability 1, so it is emitted
        without being scored). Returns (committed, forced, DEAD_END or None)."""
        assert self.matcher is not None
        taken = self.matcher.commit(committed)
        forced: list[int] = []
        if taken == len(committed) and not self.eos_ids.intersection(committed):
            room = self.params.max_tokens - len(self.output) - len(committed)
            while len(forced) < room and (tok := self.matcher.forced()) is not None:
                self.matcher.commit([tok])
                forced.append(tok)
                if tok in self.eos_ids:
                    break
        ended = self.eos_ids.intersection(committed + forced)
        dead = taken < len(committed) or (not ended and self.matcher.dead())
        return committed[:taken], forced, DEAD_END if dead else None

    def _row_masks(self, draft: Draft) -> torch.Tensor | None:
        """The constraint's (k+1, V) masks of this step's rows (after context ++ draft[:t])."""
        return None if self.matcher is None else self.matcher.masks(draft.tokens.tolist())

    def _verify(self, logits: torch.Tensor, draft: Draft
                ) -> tuple[VerifyResult | TreeVerifyResult, list[float]]:
        """Verification plus the per-position alpha samples sum_x min(p, q) it evaluated."""
        if draft.parents is not None:
            return self._verify_tree(logits, draft)
        k = len(draft.tokens)
        allowed = self._row_masks(draft)
        if self.params.greedy:  # the context only where penalties read it (uses_history)
            history = ids_tensor(self.context) if uses_history(self.params) else _EMPTY
            target = greedy_tokens(logits, self.params, history, min(self.prompt_len,
                                   len(history)), draft.tokens, allowed)
            result = verify_greedy(target, draft.tokens)
            seen = min(result.num_accepted + 1, k)
            return result, [float(target[i] == draft.tokens[i]) for i in range(seen)]
        ctx = ids_tensor(self.context)
        if self.noise is not None:  # rule "invariant": the target's Gumbel-max tokens
            x = process_logits(logits, self.params, ctx, self.prompt_len, draft.tokens, allowed)
            noise, first, vocab = self.noise, self.position, x.shape[-1]
            result = verify_invariant(x, draft.tokens, lambda i: noise.gumbel(first + i, vocab))
            seen = min(result.num_accepted + 1, k)
            return result, [float(result.tokens[i] == draft.tokens[i]) for i in range(seen)]
        p = probs_from_logits(logits, self.params, ctx, self.prompt_len, draft.tokens, allowed)
        result = verify_chain(p, draft.q, draft.tokens, self.generator)
        seen = min(result.num_accepted + 1, k)
        if draft.q is None:
            rows = torch.arange(seen)
            return result, p[rows, draft.tokens[:seen]].tolist()
        return result, acceptance_probability(p[:seen], draft.q[:seen]).tolist()

    def _verify_tree(self, logits: torch.Tensor, draft: Draft
                     ) -> tuple[TreeVerifyResult, list[float]]:
        """A tree's verification (greedy, rule "invariant" or rule "residual": verify_tree*), on
        the (n + 1, V) logits of its root and nodes, each processed after its own path (the
        penalties count the path's tokens, not the siblings'). Alpha samples: 1 per accepted
        node, then 0 where the path ended with nodes left below it."""
        parents, tokens = draft.parents, draft.tokens
        assert parents is not None
        x = tree_logits(logits, self.params, ids_tensor(self.context), self.prompt_len, draft)
        result: TreeVerifyResult
        if self.params.greedy:
            result = verify_tree_greedy(argmax_rows(x), parents, tokens)
        elif self.noise is not None:
            noise, first, vocab = self.noise, self.position, x.shape[-1]
            result = verify_tree_invariant(x, parents, tokens,
                                           lambda d: noise.gumbel(first + d, vocab))
        else:
            result = verify_tree(torch.softmax(x, dim=-1), parents, tokens, draft.q,
                                 self.generator)
        m = result.num_accepted
        last = int(result.path[-1]) if m else -1
        rejected = any(int(p) == last for p in parents.tolist())
        return result, [1.0] * m + ([0.0] if rejected else [])

    def _emit(self, tokens: list[int], end: str | None = None) -> StepOutput:
        """Commit tokens to the context; stop at EOS, max_tokens or a stop string, else with
        `end` if given."""
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
        reason = reason if reason is not None else end
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


class BatchEngine:
    """Continuous batching of Generations over one shared KV cache of `max_batch` rows.

    Active requests occupy rows 0..n-1 (compacted when one leaves, by one row copy), so each
    step's single target forward runs over a prefix view of the cache. Every request has its own
    draft length (ragged rows, padded to the widest), its own KV length and its own generator.
    Requests join between steps: joining prompts are prefilled, at most `prefill_chunk` tokens
    per step, each in its own small cache, then adopted into a row, so a long prompt never
    stalls the running requests for more than one chunk of work per step.
    """

    def __init__(self, model: Target, max_batch: int, max_seq_len: int,
                 controller: Controller | None = None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.model, self.max_batch, self.max_seq_len = model, max_batch, max_seq_len
        self.cache = model.new_cache(max_batch, max_seq_len)
        self.controller = controller
        self.prefill_chunk = prefill_chunk
        self.active: list[Generation] = []  # active[i] decodes in cache row i
        self.joining: deque[Generation] = deque()  # prefilling in their own caches
        self.waiting: deque[Generation] = deque()  # queued until a row is free
        self.alphas: dict[int, AlphaEstimate] = {}

    def submit(self, gen: Generation) -> None:
        """Queue a request; refused with a clear message if it can never fit a cache row."""
        if gen.capacity > self.max_seq_len:
            raise SpecDecodeError(
                f"request needs {gen.capacity} tokens of cache (prompt {gen.prompt_len} + "
                f"max_tokens {gen.params.max_tokens} + draft room) but each row of this engine "
                f"holds {self.max_seq_len}"
            )
        self.waiting.append(gen)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.joining or self.waiting)

    def cancel(self, gen: Generation) -> None:
        """Stop a request now and free its cache row at once."""
        if gen in self.active:
            self._leave(gen)
        elif gen in self.joining:
            self.joining.remove(gen)
        elif gen in self.waiting:
            self.waiting.remove(gen)
        gen.finish_reason = gen.finish_reason or "cancelled"
        gen.release()
        self.alphas.pop(id(gen), None)

    def step(self) -> list[tuple[Generation, StepOutput]]:
        """Admit and prefill one chunk, then one speculative step for every active request."""
        self._admit()
        if not self.active:
            return []
        began = time.perf_counter_ns()
        ks = self._choose_k()
        proposing = time.perf_counter_ns()
        drafts = self._propose(ks)
        start = time.perf_counter_ns()
        logits, hidden = self._score(drafts)
        outputs = []
        for i, (gen, draft) in enumerate(zip(list(self.active), drafts, strict=True)):
            rows = len(draft.tokens) + gen.unfed
            features = None if hidden is None else hidden[i, :rows]
            outputs.append((gen, gen.finish_step(logits[i, :rows], draft, features)))
        if self.controller is not None:
            self.controller.learn(self._observation(ks, drafts, logits.shape[1],
                                                    (began, proposing, start,
                                                     time.perf_counter_ns())))
        for gen, out in outputs:
            if out.finish_reason is not None:
                self._leave(gen)
                gen.release()
                self.alphas.pop(id(gen), None)
        return outputs

    def _admit(self) -> None:
        """Queue -> joining while rows are free; then at most `prefill_chunk` prompt tokens of
        prefill this step, adopting every joining request whose prompt is done."""
        while self.waiting and len(self.active) + len(self.joining) < self.max_batch:
            self.joining.append(self.waiting.popleft())
        budget = self.prefill_chunk
        while self.joining:
            gen = self.joining[0]
            if gen.cache is None or not gen.prefilled:  # a 1-token prompt still needs a cache
                if budget <= 0:
                    break
                before = gen.prefilled_tokens
                gen.prefill(budget)
                budget -= gen.prefilled_tokens - before
            if not gen.prefilled:
                break
            self._adopt(self.joining.popleft())

    def _adopt(self, gen: Generation) -> None:
        """Copy a prefilled request's KV into the next free row; it decodes from there on."""
        row = len(self.active)
        self.cache.copy_row(row, gen.kv, 0, gen.kv.lengths[0])
        gen.cache, gen.row = self.cache, row
        self.active.append(gen)
        if self.controller is not None:  # seeded now, not when queued: the category's
            # estimate has learned from every step run while this request waited
            self.alphas[id(gen)] = self.controller.new_estimate(gen.category)

    def _leave(self, gen: Generation) -> None:
        """Free gen's row, moving the last active row into it to keep rows 0..n-1 dense."""
        row, last = gen.row, len(self.active) - 1
        if row != last:
            mover = self.active[last]
            self.cache.move_row(last, row)
            mover.row = row
            self.active[row] = mover
        else:
            self.cache.reset_row(last)
        self.active.pop()
        gen.cache = None

    def _choose_k(self) -> list[int]:
        """Draft budgets: a fixed k, or the controller's choice, except for drafters whose drafts
        carry confidences (`fits_width`): under the controller they propose up to their k for
        free and fit_width keeps what pays, from their per-token confidences, which predict
        acceptance better than a running alpha."""
        if self.controller is None:
            return [g.k for g in self.active]
        ks = self.controller.choose([self.alphas[id(g)] for g in self.active])
        if not self.controller.allows(len(self.active)):  # held off: no drafter drafts
            return [0] * len(ks)
        for k, g in zip(ks, self.active, strict=True):
            g.model_k = min(k, g.k)  # a hybrid: its lookup always, its model per k
        return [g.k if g.drafter is not None and g.drafter.fits_width else min(k, g.k)
                for k, g in zip(ks, self.active, strict=True)]

    def _propose(self, ks: list[int]) -> list[Draft]:
        for gen, k in zip(self.active, ks, strict=True):
            gen.next_k = k
        drafts = draft_rows(self.active)
        if self.controller is not None:  # --k auto: verify what pays; a fixed k is kept
            drafts = fit_width(drafts, self.controller.costs,
                               self.controller.max_width(len(drafts)))
        return drafts

    def _observation(self, ks: list[int], drafts: list[Draft], width: int,
                     times: tuple[int, int, int, int]) -> StepObservation:
        """What the step just run measured, for the controller: `times` are the nanosecond
        clocks at its start, before proposing, before scoring, and after every row's commit."""
        began, proposing, scoring, end = times
        catch_up = sum(g.catch_up_ns for g in self.active)  # one-off: not a cost per token
        # the cost per draft token and the alphas are a model drafter's: drafts with
        # confidences (prompt lookup, alone or in a hybrid) cost next to nothing and are fitted
        # by their confidences, and would make it look cheaper
        model_rows = [(g, d) for g, d in zip(self.active, drafts, strict=True)
                      if d.confidence is None]
        return StepObservation(
            batch=len(drafts), width=width,
            proposed=any(k > 0 and g.drafter is not None
                         for k, g in zip(ks, self.active, strict=True)),
            committed=sum(g.last_committed for g in self.active),
            draft_tokens=sum(len(d.tokens) for _, d in model_rows),
            draft_s=(scoring - proposing - catch_up) / 1e9,
            # what a step of this width costs: the forward pass and every row's verification
            # and commit (per-row work grows with the width)
            target_s=(end - scoring) / 1e9,
            step_s=(end - began - catch_up) / 1e9,
            alphas=tuple((self.alphas[id(g)], g.category, g.last_alphas)
                         for g, _ in model_rows))

    def _score(self, drafts: list[Draft]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over the active rows: (n, T, V) logits, rows padded to T, and the
        (n, T, H) hidden states when some request's drafter observes them (else None)."""
        n = len(self.active)
        fed = [g.fed(d) for g, d in zip(self.active, drafts, strict=True)]
        width = max(len(f) for f in fed)
        tokens = torch.zeros(n, width, dtype=torch.long)
        for i, f in enumerate(fed):
            tokens[i, : len(f)] = f
        view = rows_view(self.cache, 0, n)
        start = time.perf_counter_ns()
        want = any(g.wants_hidden for g in self.active)
        logits, hidden = score(self.model, tokens, view, want, num_new=[len(f) for f in fed],
                               tree=tree_inputs(self.active, drafts, width))
        elapsed = time.perf_counter_ns() - start
        self.cache.lengths[:n] = view.lengths
        for gen in self.active:
            gen.counters.target_ns += elapsed
        return logits, hidden


def draft_rows(gens: list[Generation]) -> list[Draft]:
    """Each request's draft for its next step. Requests whose drafters draft in the target's
    cache (Drafter.cache_model) draft together where they share a cache and a draft
    model (a batch's rows) and its rows do not move each other's results (rows_independent:
    not an int8 copy): one forward of it per draft position (draft_in_cache). The others
    propose one by one. Each request's drafting time goes to its counters, a shared forward's
    split evenly among the rows it fed."""
    drafts: list[Draft | None] = [None] * len(gens)
    groups: dict[tuple[int, int, int], list[tuple[int, Rounds]]] = {}
    runs: dict[tuple[int, int, int], tuple[CacheModel, Cache]] = {}
    for i, gen in enumerate(gens):
        t0 = time.perf_counter_ns()
        begun = gen.begin_draft()
        gen.counters.draft_ns += time.perf_counter_ns() - t0
        if isinstance(begun, Draft):
            drafts[i] = begun
        else:  # rounds: the drafter has a cache_model (Generation.begin_draft)
            assert gen.drafter is not None and gen.drafter.cache_model is not None
            model = gen.drafter.cache_model
            key = (id(gen.cache), id(model), -1 if model.rows_independent else i)
            groups.setdefault(key, []).append((i, begun))
            runs[key] = (model, gen.kv)
    for key, members in groups.items():
        made, spent = draft_in_cache(*runs[key], [gens[i].row for i, _ in members],
                                     [rounds for _, rounds in members])
        for (i, _), draft, ns in zip(members, made, spent, strict=True):
            drafts[i] = draft
            gens[i].counters.draft_ns += ns
    return [g.end_draft(d) for g, d in zip(gens, drafts, strict=True)]  # type: ignore[arg-type]


def draft_in_cache(model: CacheModel, cache: Cache, rows: list[int], steps: list[Rounds]
                   ) -> tuple[list[Draft], list[int]]:
    """Run drafters' `rounds` (drafters.base.Drafter.rounds) in the target's `cache`, request i in
    row rows[i]. Each round, one forward of `model` over the rows from the first to the last of
    them feeds every row's next token at the slot after its length (rows between with nothing to
    feed this round get a placeholder and do not advance) and sends each its logits. The rounds
    run on a view whose lengths are a copy: the cache's own lengths never move, the slots written
    lie past every row's committed tokens, and the target's verification overwrites them.
    Returns the drafts and the nanoseconds each request spent."""
    drafts: list[Draft] = [Draft(_EMPTY, None)] * len(steps)
    spent = [0] * len(steps)
    feeds: dict[int, int] = {}  # request -> the token it feeds this round
    with torch.inference_mode():
        for i, rounds in enumerate(steps):
            t0 = time.perf_counter_ns()
            try:
                feeds[i] = next(rounds)
            except StopIteration as done:
                drafts[i] = done.value
            spent[i] += time.perf_counter_ns() - t0
        first = min((rows[i] for i in feeds), default=0)
        n = max((rows[i] - first for i in feeds), default=-1) + 1
        view = rows_view(cache, first, n)
        while feeds:
            t0 = time.perf_counter_ns()
            tokens = torch.zeros(n, 1, dtype=torch.long)
            fed = [0] * n
            for i, tok in feeds.items():
                tokens[rows[i] - first, 0], fed[rows[i] - first] = tok, 1
            logits = model(tokens, view, num_new=fed, logits_for="last")  # (n, 1, V)
            share = (time.perf_counter_ns() - t0) // len(feeds)
            following: dict[int, int] = {}
            for i in feeds:
                t1 = time.perf_counter_ns()
                try:
                    following[i] = steps[i].send(logits[rows[i] - first, 0])
                except StopIteration as done:
                    drafts[i] = done.value
                spent[i] += share + time.perf_counter_ns() - t1
            feeds = following
    return drafts, spent


def rows_view(cache: Cache, first: int, n: int) -> Cache:
    """The cache's rows first..first+n-1: views of the same storage, with a copy of their
    lengths."""
    return cache.view(first, n)


def fit_width(drafts: list[Draft], costs: CostModel, max_width: int | None = None
              ) -> list[Draft]:
    """Cut a batch step's drafts to the verification width that pays (control.best_width, from
    the measured t(B, T)), and to `max_width` (the controller's tail-latency cap); drafts without
    confidences are kept whole, setting the least width."""
    if max_width is not None:
        drafts = [shrink(d, max_width - 1) if d.confidence is not None else d for d in drafts]
    if all(d.confidence is None for d in drafts):
        return drafts
    kept = [len(d.tokens) for d in drafts if d.confidence is None]
    width = best_width([chain_confidences(d) if d.parents is not None else d.confidence
                        for d in drafts if d.confidence is not None],
                       lambda t: costs.step(len(drafts), t, True),
                       floor=max(kept, default=0) + 1,
                       fixed_tokens=float(sum(k + 1 for k in kept)))
    return [d if d.confidence is None else shrink(d, width - 1) for d in drafts]


def shrink(draft: Draft, nodes: int) -> Draft:
    """The draft's `nodes` tokens that pay first: a chain's first ones, a tree's most likely
    accepted ones (trees.keep_best: the same expected gain best_width weighed)."""
    if draft.parents is not None:
        return keep_best(draft, nodes) if len(draft.tokens) > nodes else draft
    return cut(draft, nodes)


def tree_inputs(gens: list[Generation], drafts: list[Draft], width: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The runner's `positions` (B, width) and `tree_mask` (B, width, width) for a forward
    in which some row scores a tree (trees.layout; the other rows causal), or None if none
    does."""
    if all(d.parents is None for d in drafts):
        return None
    positions, masks = [], []
    for gen, draft in zip(gens, drafts, strict=True):
        parents = draft.parents if draft.parents is not None else _EMPTY
        offsets, block = layout(parents, gen.unfed, width)
        positions.append(offsets + gen.kv.lengths[gen.row])
        masks.append(block)
    return torch.stack(positions), torch.stack(masks)


def tree_logits(logits: torch.Tensor, params: SamplingParams, context: torch.Tensor,
                prompt_len: int, draft: Draft) -> torch.Tensor:
    """The processed logits (n + 1, V) of a tree's root and nodes: row i + 1 after node i's
    path. Where penalties read the history, each row is processed after its own path;
    otherwise all at once."""
    assert draft.parents is not None
    n = int(draft.tokens.numel())
    if not uses_history(params):
        return process_logits(logits, params, context, prompt_len, draft.tokens)
    rows = [process_logits(logits[:1], params, context, prompt_len, _EMPTY)]
    for i in range(n):
        path = draft.tokens[tree_path(draft.parents, i)]
        rows.append(process_logits(logits[i + 1:i + 2], params, torch.cat([context, path]),
                                   prompt_len, _EMPTY))
    return torch.cat(rows)


def cut(draft: Draft, k: int) -> Draft:
    """The draft's first k tokens (with their q and confidences); a tree's nodes of depth at
    most k."""
    if draft.parents is not None:
        return cut_depth(draft, k)
    if len(draft.tokens) <= k:
        return draft
    return Draft(draft.tokens[:k], None if draft.q is None else draft.q[:k],
                 None if draft.confidence is None else draft.confidence[:k])


def score(model: Target, tokens: torch.Tensor, cache: Cache, want_hidden: bool,
          num_new: Sequence[int] | None = None,
          tree: tuple[torch.Tensor, torch.Tensor] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's logits (B, T, V) of `tokens` (row b: its first num_new[b]; `tree`: the
    positions and tree masks of tree_inputs), and its hidden states (B, T, H) if asked.

    With hidden states, the LM head is applied here to the runner's return_hidden output
    (Target.head): the same operations as its own logits path, so the logits are identical.
    """
    positions, tree_mask = tree if tree is not None else (None, None)
    with torch.inference_mode():
        if not want_hidden:
            return model(tokens, cache, positions=positions, tree_mask=tree_mask,
                         num_new=num_new), None
        hidden = model(tokens, cache, positions=positions, tree_mask=tree_mask,
                       num_new=num_new, return_hidden=True)  # (B, T, H)
        return model.head(hidden), hidden


def run_batch(engine: BatchEngine, gens: list[Generation]) -> list[Generation]:
    """Submit every request and step until all have finished."""
    for gen in gens:
        engine.submit(gen)
    while engine.busy:
        engine.step()
    return gens


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
