"""The engine: one speculative step is five moves, always in this order.

1. propose  - the drafter proposes up to k tokens (and the q they were drawn from, if any), a
              chain or a token tree (Draft.parents); a quantized copy of the target drafts in
              the target's own cache, a batch's rows together (draft_rows, draft_in_cache);
2. score    - the target scores [pending token, draft...] in ONE forward pass (a tree's nodes
              under a tree mask: trees.layout): k+1 rows of p;
3. verify   - a pure function keeps a prefix (a tree: its longest accepted path) and draws the
              recovered or bonus token (verification.Verifier picks it);
4. commit   - the target cache rolls back to the kept prefix by moving its length (no copy; a
              tree's path is compacted, Cache.keep); the drafter re-syncs on its next proposal
              from the committed context;
5. observe  - integer counters and per-phase times are updated; under --k auto the controller
              learns from the step (control.Controller, its per-request state on the request).

k = 0 (or no drafter) is plain autoregressive decoding through the same loop, so plain and
speculative decoding share every line except the proposal.

Cache invariant: the target cache holds every committed token except the last one (the pending
token), whose logits the next step computes together with the draft; tokens a structured-output
constraint forced since are fed unscored before it (`unfed`).

The engine uses a model and a cache only through models.target (Target, Cache) and a drafter
only through drafters.base.Drafter: each step it asks for a proposal with a DraftRequest and,
after verification, tells the drafter what was accepted (`observe_result`). A drafter with
`wants_hidden` (the EAGLE-style heads) also gets the target's hidden states (`observe`): the
score move then runs the target with return_hidden=True and applies its head here
(Target.head), the same logits bit for bit.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.constraints import Constraint, constrain_draft
from specdecode.control import AlphaEstimate, Controller, CostModel, StepObservation, best_width
from specdecode.counters import Counters
from specdecode.drafters.base import CacheModel, Draft, Drafter, DraftRequest, Rounds, ids_tensor
from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_K
from specdecode.models.target import Cache, Target
from specdecode.models.tokenizer import IncrementalDecoder, Tokenizer
from specdecode.sampling import SamplingParams
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
from specdecode.verification import Verifier
from specdecode.verify import TreeVerifyResult

PREFILL_CHUNK = 256
_EMPTY = torch.zeros(0, dtype=torch.long)
DEAD_END = "constraint_dead_end"  # finish reason: the constraint allows no next token


@dataclass(frozen=True)
class StepOutput:
    tokens: list[int]  # tokens emitted by this step (after EOS / max_tokens truncation)
    text: str  # text safe to show now
    finish_reason: str | None  # None while running; "stop" (EOS or stop string) or "length"
    # (or DEAD_END: a constraint allows no next token)


@dataclass
class RequestControl:
    """The controller's per-request state, kept on the request: its running acceptance
    estimate (from when it joins a controlled batch) and what its last step measured."""

    estimate: AlphaEstimate | None = None
    alphas: list[float] = field(default_factory=list)  # alpha samples of the last step
    committed: int = 0  # tokens the last step committed (EOS included)
    catch_up_ns: int = 0  # drafter time the last proposal spent catching up (see Controller)


class Generation:
    """One request's generation, advanced by `step()` until `finish_reason` is set.

    Alone, it owns a batch-1 cache. In a BatchEngine, the engine adopts its prefilled cache into
    a row of the shared batch cache and runs the score move for all rows at once; the other moves
    (propose: draft_rows; verify, commit, observe: finish_step) stay per request.
    """

    def __init__(self, model: Target, tokenizer: Tokenizer | None, prompt_ids: list[int],
                 params: SamplingParams, drafter: Drafter | None = None, k: int = 0,
                 eos_ids: Sequence[int] = (), category: str | None = None,
                 constraint: Constraint | None = None) -> None:
        params.validate(model.cfg.vocab_size)
        if not 0 <= k <= MAX_K:
            raise SpecDecodeError(f"k must be in 0..{MAX_K}, got {k}")
        _check_prompt(prompt_ids, params, model.cfg.max_position, k)
        self.model, self.params, self.drafter, self.category = model, params, drafter, category
        self.k = self.next_k = k if drafter is not None else 0  # next_k: a controller's choice
        self.model_k: int | None = None  # the controller's k for a fits_width drafter's model
        # token trees: at most max_nodes; as trees where the target can, else trees.best_path
        self.max_nodes = drafter.tree_nodes(self.k) if drafter is not None and self.k else 0
        self.wants_hidden = drafter is not None and drafter.wants_hidden  # observe features
        if self.max_nodes and drafter is not None and self.wants_hidden:
            raise SpecDecodeError(f"the {drafter.name} drafter drafts token trees and observes "
                                  "hidden states: the engine supports one or the other")
        self.trees = self.max_nodes > 0 and model.supports_trees
        self.matcher = constraint.matcher() if constraint is not None else None  # its grammar
        self.eos_ids = frozenset(eos_ids) | frozenset(constraint.eos_ids if constraint else ())
        self.verifier = Verifier.for_request(params, len(prompt_ids))  # seed, noise, generator
        self.prompt_len, self.context = len(prompt_ids), list(prompt_ids)
        self.output: list[int] = []
        self.unfed = 1  # trailing context tokens not in the cache: pending + forced ones
        self.capacity = len(prompt_ids) + params.max_tokens + max(self.k, self.max_nodes) + 1
        self.cache: Cache | None = None
        self.row = 0
        self.prefilled_tokens = 0  # prompt tokens (all but the last) in the cache
        self.counters = Counters(prompt_tokens=len(prompt_ids))
        self.control = RequestControl()
        self.text = TextOut(tokenizer, params.stop)
        self.finish_reason: str | None = None

    @property
    def seed(self) -> int:
        """The sampling seed (given, or drawn): passing it reproduces this output."""
        return self.verifier.seed

    @property
    def kv(self) -> Cache:
        """The cache this request decodes in (its own, or its batch's), once allocated."""
        if self.cache is None:
            raise SpecDecodeError("the request has no cache: it was released")
        return self.cache

    @property
    def prefilled(self) -> bool:
        """Its cache exists and holds the prompt but its last token (a 1-token prompt still
        needs the cache: prefill allocates it)."""
        return self.cache is not None and self.prefilled_tokens >= self.prompt_len - 1

    def prefill(self, max_tokens: int | None = None) -> bool:
        """Feed up to `max_tokens` more prompt tokens (all but the last); True when done."""
        start = time.perf_counter_ns()
        if self.cache is None:
            self.cache = self.model.new_cache(1, self.capacity)
        end = self.prompt_len - 1 if max_tokens is None else \
            min(self.prompt_len - 1, self.prefilled_tokens + max_tokens)
        with torch.inference_mode():
            for i in range(self.prefilled_tokens, end, PREFILL_CHUNK):
                chunk = torch.tensor([self.context[i : min(end, i + PREFILL_CHUNK)]])
                if self.drafter is not None and self.wants_hidden:
                    self.drafter.observe(self.model(chunk, self.cache, return_hidden=True)[0], i)
                else:
                    self.model(chunk, self.cache, logits_for="none")
        self.prefilled_tokens = end
        self.counters.prefill_ns += time.perf_counter_ns() - start
        return self.prefilled

    def step(self) -> StepOutput:
        """One whole speculative step on this request's own cache."""
        if self.finish_reason is not None:
            return StepOutput([], "", self.finish_reason)
        if not self.prefilled:
            self.prefill()
        draft = draft_rows([self])[0]  # 1. propose (timed into the counters)
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

    def finish_step(self, logits: torch.Tensor, draft: Draft,
                    hidden: torch.Tensor | None = None) -> StepOutput:
        """Moves 3-5 for this request, given the target's (unfed + k, V) logits of this step
        (and its hidden states when the drafter observes them): rows for the unfed tokens
        before the pending one (forced by a constraint) are not scored."""
        c, forced_fed, base = self.counters, self.unfed - 1, len(self.context) - 1
        t2 = time.perf_counter_ns()
        result, alphas = self.verifier.verify(logits[forced_fed:], draft, self.context,
                                              output_position(self), self.matcher)  # 3. verify
        t3 = time.perf_counter_ns()
        accepted, committed = result.num_accepted, result.tokens.tolist()
        if isinstance(result, TreeVerifyResult):  # 4. commit: the path's KV, compacted
            self.kv.keep(self.row, base + 1 - self.unfed, kept_slots(self.unfed, result.path))
        else:  # a chain: move the length back
            self.kv.rollback(self.row, base + 1 + accepted)
        if self.drafter is not None:
            if hidden is not None and self.wants_hidden:  # features of the kept positions
                self.drafter.observe(hidden[: forced_fed + accepted + 1], base - forced_fed)
            self.drafter.observe_result(draft, accepted, committed)
        dead = False
        if self.matcher is not None:  # structured output: the tokens the grammar forces next
            room = self.params.max_tokens - len(self.output) - len(committed)
            committed, forced, dead = self.matcher.take_step(committed, self.eos_ids, room)
            c.forced, c.mask_ns = c.forced + len(forced), self.matcher.mask_ns
            committed, self.unfed = committed + forced, 1 + len(forced)
        out = self._emit(committed, DEAD_END if dead else None)
        c.record_step(len(draft.tokens), accepted, len(out.tokens))  # 5. observe
        c.record_alpha(alphas)
        self.control.alphas, self.control.committed = alphas, accepted + 1
        c.verify_ns += t3 - t2
        c.other_ns += time.perf_counter_ns() - t3
        return out

    def _emit(self, tokens: list[int], end: str | None = None) -> StepOutput:
        """Commit tokens to the context; stop at EOS, max_tokens or a stop string, else with
        `end` if given."""
        room = self.params.max_tokens - len(self.output)
        emitted, reason = until_stop(tokens, self.eos_ids, room)
        reason = reason if reason is not None else end
        self.context.extend(tokens)
        self.output.extend(emitted)
        text, stopped = self.text.push(emitted, ending=reason is not None)
        self.finish_reason = "stop" if stopped else reason
        return StepOutput(emitted, text, self.finish_reason)

    def run(self) -> Iterator[StepOutput]:
        while self.finish_reason is None:
            yield self.step()

    def release(self) -> None:
        """Free the caches at once (cancellation or completion)."""
        self.cache = None
        if self.drafter is not None:
            self.drafter.reset()


def until_stop(tokens: list[int], eos_ids: frozenset[int], room: int
               ) -> tuple[list[int], str | None]:
    """The tokens of `tokens` emitted before an EOS or after `room` of them, and why it stopped
    there ("stop", "length"; None: it did not)."""
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[:i], "stop"
        if i + 1 >= room:
            return tokens[: i + 1], "length"
    return list(tokens), None


class TextOut:
    """The text of a request's emitted tokens as it may be shown: decoded incrementally, with
    any text that could begin a stop string held back until it cannot (no text without a
    tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.stops = StopChecker(stop)

    def push(self, tokens: list[int], ending: bool) -> tuple[str, bool]:
        """The text to show after `tokens` (all of it when the request is `ending`), and
        whether a stop string ended the request."""
        if self.decoder is None:
            return "", False
        update = self.stops.feed(self.decoder.push(tokens))
        if update.stopped:
            return update.text, True
        return update.text + (self.stops.flush() if ending else ""), False


def adopt_prefill(gen: Generation, template: Generation) -> None:
    """Start `gen` from `template`'s prefilled cache (the same prompt) instead of prefilling
    it again, where the cache copies rows; else prefill it."""
    if template.context[: gen.prompt_len] != gen.context or not template.prefilled or \
            template.cache is None or not template.cache.copies_rows or gen.wants_hidden:
        gen.prefill()
        return
    n = gen.prompt_len - 1
    gen.cache = gen.model.new_cache(1, gen.capacity)
    gen.cache.copy_row(0, template.kv, template.row, n)
    gen.prefilled_tokens = n


def begin_draft(gen: Generation) -> Draft | Rounds:
    """Start `gen`'s proposal: the draft, or, for a drafter that drafts in the target's cache
    (Drafter.cache_model), its rounds for draft_in_cache to run."""
    gen.control.catch_up_ns = 0  # a drafter's one-off catching up with the context, this step
    k = draft_budget(gen)
    if gen.drafter is None or k <= 0:
        return Draft(_EMPTY, None)
    verifier = gen.verifier
    request = DraftRequest(ids_tensor(gen.context), k, gen.params, gen.prompt_len,
                           verifier.generator, gen.model_k, verifier.noise,
                           output_position(gen), gen.matcher, gen.unfed, gen.max_nodes)
    if gen.drafter.cache_model is not None and gen.kv.holds_tensors:
        return gen.drafter.rounds(request)
    with torch.inference_mode():
        draft = gen.drafter.propose(request)
    gen.control.catch_up_ns = gen.drafter.catch_up_ns
    return draft


def end_draft(gen: Generation, draft: Draft) -> Draft:
    """The draft cut to this step's budget, as the verifier takes it: a tree is checked (a
    malformed one is refused), cut to the budget's depth, and taken as its most likely path
    where it cannot be scored as a tree (a target without tree masks, or a constraint, whose
    matcher follows one path)."""
    draft = dataclasses.replace(draft, tokens=draft.tokens.to(torch.long))
    if draft.parents is not None:
        name = gen.drafter.name if gen.drafter is not None else "?"
        check_tree_draft(draft, gen.model.cfg.vocab_size, gen.max_nodes, name)
        if not gen.trees or gen.matcher is not None:
            draft = best_path(draft)
    draft = cut(draft, draft_budget(gen))
    return draft if gen.matcher is None else constrain_draft(draft, gen.matcher)


def output_position(gen: Generation) -> int:
    """The output position of `gen`'s next token (the first draft token, or the one sampled):
    what the position-keyed noise of rule "invariant" is keyed by, for drafter and verifier."""
    return len(gen.context) - gen.prompt_len


def draft_budget(gen: Generation) -> int:
    """The most tokens `gen`'s next step may draft: its k for the step, within max_tokens."""
    return min(gen.next_k, gen.params.max_tokens - len(gen.output) - 1)


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
        # nanoseconds of the last step's speculative move (choose, propose, score, verify,
        # commit), admission and prefill left out: what a server's live metrics time it by
        self.last_step_ns = 0

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
        self.last_step_ns = time.perf_counter_ns() - began
        for gen, out in outputs:
            if out.finish_reason is not None:
                self._leave(gen)
                gen.release()
        return outputs

    def _admit(self) -> None:
        """Queue -> joining while rows are free; then at most `prefill_chunk` prompt tokens of
        prefill this step, adopting every joining request whose prompt is done."""
        while self.waiting and len(self.active) + len(self.joining) < self.max_batch:
            self.joining.append(self.waiting.popleft())
        budget = self.prefill_chunk
        while self.joining:
            gen = self.joining[0]
            if not gen.prefilled:
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
            gen.control.estimate = self.controller.new_estimate(gen.category)

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
        ks = self.controller.choose([_estimate(g) for g in self.active])
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
        catch_up = sum(g.control.catch_up_ns for g in self.active)  # one-off: not a cost per token
        # the cost per draft token and the alphas are a model drafter's: drafts with
        # confidences (prompt lookup, alone or in a hybrid) cost next to nothing and are fitted
        # by their confidences, and would make it look cheaper
        model_rows = [(g, d) for g, d in zip(self.active, drafts, strict=True)
                      if d.confidence is None]
        return StepObservation(
            batch=len(drafts), width=width,
            proposed=any(k > 0 and g.drafter is not None
                         for k, g in zip(ks, self.active, strict=True)),
            committed=sum(g.control.committed for g in self.active),
            draft_tokens=sum(len(d.tokens) for _, d in model_rows),
            draft_s=(scoring - proposing - catch_up) / 1e9,
            # what a step of this width costs: the forward pass and every row's verification
            # and commit (per-row work grows with the width)
            target_s=(end - scoring) / 1e9,
            step_s=(end - began - catch_up) / 1e9,
            alphas=tuple((_estimate(g), g.category, g.control.alphas)
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
        begun = begin_draft(gen)
        gen.counters.draft_ns += time.perf_counter_ns() - t0
        if isinstance(begun, Draft):
            drafts[i] = begun
        else:  # rounds: the drafter has a cache_model (begin_draft)
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
    return [end_draft(g, d) for g, d in zip(gens, drafts, strict=True)]  # type: ignore[arg-type]


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


def _estimate(gen: Generation) -> AlphaEstimate:
    """The controller's acceptance estimate of a request of its batch (set on adoption)."""
    assert gen.control.estimate is not None, "a request joined the batch unadopted"
    return gen.control.estimate


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
