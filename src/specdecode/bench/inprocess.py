"""The in-process runner: the benchmark's measurements from this package's own engine.

`InProcessRunner` wraps one loaded target and implements `bench.runner.Runner`. For each
configuration it builds the drafter factory once (draft weights loaded or quantized once and
shared) and makes a fresh drafter for every request.

One request is one turn of one prompt:

- text: the checkpoint's chat template applied to the conversation so far (the earlier user
  turns with the assistant replies generated for them, then this turn); a checkpoint without a
  chat template (or `chat=False`) gets the turns and replies joined by blank lines;
- sampling: temperature `effective_temperature(prompt, config)`, seed `request_seed(prompt,
  turn, seed)`, at most the prompt's `max_tokens` (else `default_max_tokens`), capped at
  `max_tokens_cap`;
- times: the clock starts when the token ids are handed to the engine (templating and
  tokenization, identical for every configuration, are left out). TTFT and ITL come from the
  engine's StepOutputs as `records` documents: a step emitting m tokens adds its time since the
  previous emission, then m - 1 zeros. Phase times and counters come from `metrics.Counters`;
  `rejections` (steps that drafted more tokens than they accepted) comes from the Counters.

Batch size 1 with a fixed k runs each request alone (`Generation.step`, the batch-1 path). Batch
size > 1 runs each group's turn on an `engine.BatchEngine` (one shared KV cache, one target pass
for all rows per step), and so does k = "auto" at any batch size, with one `control.Controller`
per configuration that keeps learning over the run, as a server's would.

A prompt that is a recorded OpenAI request (`Prompt.request`, bench.requests) runs as the
server runs it: its messages rendered with the chat template, contents as text (or its
completion prompt), its sampling parameters, max_tokens (none: all the room the context
leaves, as `serve` for chat; 16 for a completion) and constraint, checked by the server's own
functions (server.prepare); a seed drawn as for any request where it has none, so every
configuration samples alike.

`replay` runs a window of an open-loop replay (bench.openloop) on one BatchEngine of
`batch_size` rows: each request is submitted at the first step boundary after it is due
(templated and tokenized before the clock starts), a conversation's next turn when the reply
before it has ended; times run from the scheduled start, and the steps are counted by how
many requests they decoded.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdecode import engine
from specdecode.audit import POWER, TV_REAL, audit_sampled, samples_to_detect
from specdecode.bench.costcurves import cost_curve, repeating_context, target_rows
from specdecode.bench.openloop import Scheduled
from specdecode.bench.peers import LlamaCppPeers, is_peer
from specdecode.bench.records import (
    AuditVerdict,
    ConfigSpec,
    CostCurve,
    MemoryRecord,
    ReplayRecord,
    RequestSample,
    drafter_options,
)
from specdecode.bench.runner import RunnerDescription, effective_temperature, request_seed
from specdecode.bench.workloads import Prompt
from specdecode.control import Controller, auto_controller
from specdecode.counters import Counters
from specdecode.drafters.base import Drafter
from specdecode.drafters.options import model_part
from specdecode.drafters.registry import DrafterFactory, drafter_factory
from specdecode.engine import Generation, StepOutput
from specdecode.errors import SpecDecodeError
from specdecode.memory import peak_rss_bytes, weight_bytes
from specdecode.models.llamacpp import LlamaCppModel, llamacpp_target
from specdecode.models.loading import LoadedModel, file_digest
from specdecode.models.target import Cache, Target
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams
from specdecode.server.record import tokenizer_digest
from specdecode.version import __version__

DEFAULT_CAPACITY = 2048  # tokens of one request's context when `fit_capacity` was not called
TURN_MARGIN = 16  # tokens per turn allowed for a reply re-tokenizing longer than generated
AUDIT_TOKENS = 2  # tokens per outcome of the sampled audit
DEFAULT_AUDIT = 60  # generations per side of the sampled audit (the CLI default too)


# ------------------------------------------------------------------------------ one request


@dataclass(frozen=True)
class TurnRequest:
    """One turn of one prompt, ready for the engine."""

    prompt: Prompt
    turn: int
    prompt_ids: list[int]
    params: SamplingParams
    constraint: Any = None  # constraints.Constraint: the prompt's structured output, or None


@dataclass
class RequestTrace:
    """Emission times and text of one request, fed with each StepOutput as it arrives."""

    start: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    last: float = 0.0
    done: float | None = None
    text: list[str] = field(default_factory=list)

    def observe(self, out: StepOutput, now: float) -> None:
        """Attribute a step's m tokens: time since the previous emission, then m - 1 zeros."""
        n = len(out.tokens)
        if n:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.itl.extend([0.0] * (n - 1))
            self.last = now
        self.text.append(out.text)
        if out.finish_reason is not None and self.done is None:
            self.done = now


@dataclass
class Finished:
    """What one finished request leaves for its sample."""

    tokens: list[int]
    trace: RequestTrace
    counters: Counters
    rejections: int
    target_kv: int  # bytes of the target's KV cache allocated for the request
    draft_kv: int  # bytes of the drafter's KV cache (0 without one)
    valid: bool | None = None  # the output satisfies its constraint (None: no constraint)


def kv_bytes(cache: Cache | None) -> int:
    """`cache.nbytes()`, or 0 for no cache."""
    return 0 if cache is None else cache.nbytes()


def generate_one(
    model: Target, tokenizer: Tokenizer, request: TurnRequest, drafter: Drafter | None, k: int,
    eos_ids: tuple[int, ...],
) -> Finished:
    """Run one request alone (`Generation.step`, its own cache), timing every emission."""
    trace = RequestTrace(time.perf_counter())
    gen = Generation(model, tokenizer, request.prompt_ids, request.params, drafter, k, eos_ids,
                     category=request.prompt.category, constraint=request.constraint)
    while gen.finish_reason is None:
        out = gen.step()
        trace.observe(out, time.perf_counter())
    if trace.done is None:
        trace.done = time.perf_counter()
    target_kv = kv_bytes(gen.cache)
    draft_kv = drafter.kv_bytes() if drafter is not None else 0
    gen.release()
    return Finished(list(gen.output), trace, gen.counters, gen.counters.rejections, target_kv,
                    draft_kv, constraint_valid(gen))


def constraint_valid(gen: Generation) -> bool | None:
    """Whether a finished request's output satisfies its constraint (None: it has none)."""
    return None if gen.matcher is None else gen.matcher.accepting()


def generate_batch(
    model: Target, tokenizer: Tokenizer, requests: Sequence[TurnRequest],
    drafters: Sequence[Drafter | None],
    k: int, eos_ids: tuple[int, ...], controller: Controller | None = None,
) -> list[Finished]:
    """Run requests together on a `BatchEngine` with one cache row each, timing every emission.

    All are submitted at once (the clock starts then); the engine prefills joining requests one
    chunk per step while the others decode, and scores every active row in one target pass.
    `k` is each request's draft length, or its maximum when `controller` chooses per step.
    """
    gens = [Generation(model, tokenizer, r.prompt_ids, r.params, d, k, eos_ids,
                       category=r.prompt.category, constraint=r.constraint)
            for r, d in zip(requests, drafters, strict=True)]
    batch = engine.BatchEngine(model, len(gens), max(g.capacity for g in gens), controller)
    start = time.perf_counter()
    traces = {id(g): RequestTrace(start) for g in gens}
    draft_kv = dict.fromkeys(traces, 0)
    for gen in gens:
        batch.submit(gen)
    while batch.busy:
        for gen, drafter in zip(gens, drafters, strict=True):  # read before a finish frees it
            if drafter is not None:
                draft_kv[id(gen)] = max(draft_kv[id(gen)], drafter.kv_bytes())
        outputs = batch.step()
        now = time.perf_counter()
        for gen, out in outputs:
            traces[id(gen)].observe(out, now)
    target_kv = kv_bytes(batch.cache)
    return [Finished(list(g.output), traces[id(g)], g.counters, g.counters.rejections,
                     target_kv, draft_kv[id(g)], constraint_valid(g)) for g in gens]


def to_sample(config: ConfigSpec, request: TurnRequest, done: Finished) -> RequestSample:
    """The RequestSample of a finished request, attributed as `records` documents."""
    c, trace = done.counters, done.trace
    latency = (trace.done or trace.start) - trace.start
    return RequestSample(
        config=config.name, batch_size=config.batch_size, prompt_id=request.prompt.id,
        category=request.prompt.category, turn=request.turn,
        prompt_tokens=len(request.prompt_ids), output_tokens=len(done.tokens),
        ttft_s=trace.ttft if trace.ttft is not None else latency, itl_s=list(trace.itl),
        latency_s=latency, drafted=c.drafted, accepted=c.accepted,
        accepted_per_pos=list(c.accepted_per_pos), drafted_per_pos=list(c.drafted_per_pos),
        rejections=done.rejections, steps=c.steps, draft_s=c.draft_ns / 1e9,
        target_s=c.target_ns / 1e9, verify_s=c.verify_ns / 1e9,
        output_token_ids=list(done.tokens), text="".join(trace.text),
        temperature=request.params.temperature, prefill_s=c.prefill_ns / 1e9,
        alpha_micro=c.alpha_micro, alpha_positions=c.alpha_positions,
        seed=request.params.seed,
        # a peer samples with its own sampler: no rule of ours, so never paired for identity
        rule="" if request.params.greedy or is_peer(config.drafter) else request.params.rule,
        valid=done.valid, forced=c.forced, mask_s=c.mask_ns / 1e9,
    )


# ------------------------------------------------------------------------ open-loop replay


@dataclass
class _Live:
    """A turn the open loop has submitted: its request, trace, generation and drafter."""

    request: TurnRequest
    replies: list[str]
    trace: RequestTrace
    gen: Generation
    drafter: Drafter | None
    at: float  # due, seconds from the window's start
    sent: float  # submitted, the same clock
    draft_kv: int = 0


@dataclass
class _OpenLoop:
    """One window's open loop on a BatchEngine (InProcessRunner.replay)."""

    runner: InProcessRunner
    config: ConfigSpec
    batch: engine.BatchEngine
    emit: Callable[[RequestSample], None]
    # (due, order, request, replies so far): kept sorted by (due, order)
    due: list[tuple[float, int, TurnRequest, list[str]]] = field(default_factory=list)
    live: dict[int, _Live] = field(default_factory=dict)
    sent_first: list[tuple[float, float]] = field(default_factory=list)  # (due, sent), turn 0
    steps_by_batch: list[int] = field(default_factory=list)
    start: float = 0.0

    def run(self) -> None:
        self.due.sort(key=lambda d: (d[0], d[1]))
        self.steps_by_batch = [0] * self.batch.max_batch
        self.start = time.perf_counter()
        while self.due or self.batch.busy:
            self._submit_due()
            if self.batch.busy:
                self._step()
            elif self.due:  # idle until the next arrival
                time.sleep(max(0.0, min(self.due[0][0] - self._now(), 0.05)))

    def _now(self) -> float:
        return time.perf_counter() - self.start

    def _submit_due(self) -> None:
        now = self._now()
        while self.due and self.due[0][0] <= now:
            at, _, request, replies = self.due.pop(0)
            factory = self.runner.factory(self.config)
            drafter = factory() if factory else None
            gen = Generation(self.runner.loaded.model, self.runner.loaded.tokenizer,
                             request.prompt_ids, request.params, drafter,
                             config_k(self.config), self.runner.eos_ids,
                             category=request.prompt.category, constraint=request.constraint)
            self.batch.submit(gen)
            trace = RequestTrace(self.start + at)  # times run from when it was due
            self.live[id(gen)] = _Live(request, replies, trace, gen, drafter, at, self._now())
            if request.turn == 0:
                self.sent_first.append((at, self._now()))

    def _step(self) -> None:
        for item in self.live.values():  # read before a finish frees it
            if item.drafter is not None:
                item.draft_kv = max(item.draft_kv, item.drafter.kv_bytes())
        outputs = self.batch.step()
        now = time.perf_counter()
        if outputs:
            self.steps_by_batch[len(outputs) - 1] += 1
        for gen, out in outputs:
            item = self.live[id(gen)]
            item.trace.observe(out, now)
            if out.finish_reason is not None:
                self._finish(self.live.pop(id(gen)))

    def _finish(self, item: _Live) -> None:
        """Emit a finished turn's sample; queue its conversation's next turn, due now."""
        gen, request = item.gen, item.request
        done = Finished(list(gen.output), item.trace, gen.counters, gen.counters.rejections,
                        kv_bytes(self.batch.cache), item.draft_kv, constraint_valid(gen))
        self.runner._observe(self.config, request, done)
        self.emit(replace(to_sample(self.config, request, done), scheduled_s=item.at,
                          sent_s=item.sent))
        prompt, turn = request.prompt, request.turn + 1
        if turn < len(prompt.turns):
            replies = [*item.replies, "".join(item.trace.text)]
            nxt = self.runner.request(prompt, turn, replies, self.config)
            bisect.insort(self.due, (self._now(), -1, nxt, replies), key=lambda d: d[:2])


# ---------------------------------------------------------------------------- conversations


def conversation_text(tokenizer: Tokenizer, turns: Sequence[str], replies: Sequence[str],
                      chat: bool) -> str:
    """The text for the last of `turns`, the earlier ones followed by their `replies`."""
    if chat and tokenizer.chat_template is not None:
        messages: list[dict[str, str]] = []
        for i, user in enumerate(turns):
            messages.append({"role": "user", "content": user})
            if i < len(replies):
                messages.append({"role": "assistant", "content": replies[i]})
        return tokenizer.apply_chat_template(messages)
    parts: list[str] = []
    for i, user in enumerate(turns):
        parts.append(user)
        if i < len(replies):
            parts.append(replies[i])
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------ model facts


def weights_digest(source: Path) -> str:
    """sha256 of a weight file, or of a folder's *.safetensors files in name order."""
    if source.is_file():
        return file_digest(source)
    digest = hashlib.sha256()
    for path in sorted(source.glob("*.safetensors")):
        digest.update(file_digest(path).encode())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------- runner


def factory_key(config: ConfigSpec) -> str:
    """What identifies a drafter factory: its name and options (k and sampling excluded)."""
    return json.dumps([config.drafter, config.options], sort_keys=True, default=str)


def config_k(config: ConfigSpec) -> int:
    """The draft length of a config: 0 for plain, k, or for k = "auto" the most the controller
    may choose (option "kmax", DrafterOptions' default)."""
    if config.is_plain:
        return 0
    if is_peer(config.drafter):
        if isinstance(config.k, bool) or not isinstance(config.k, int) or \
                not 1 <= config.k <= engine.MAX_K:
            raise SpecDecodeError(f"config {config.name}: k must be in 1..{engine.MAX_K}")
        return config.k
    return drafter_options(config).draft_length


class InProcessRunner:
    """The Runner protocol on this package's engine, for one loaded target model.

    `capacity` bounds one request's context (prompt + output + k + 1 tokens) for drafters with
    their own KV cache; `fit_capacity` sets it from a workload. `cost_context` / `cost_repeats`
    size the c(k), v(k) measurement, `audit_samples` the sampled audit (0: none); `progress`
    shows a bar on stderr while auditing.
    """

    def __init__(
        self, loaded: LoadedModel, *, seed: int = 0, default_max_tokens: int = 128,
        max_tokens_cap: int | None = None, chat: bool = True, capacity: int | None = None,
        cost_context: int = 128, cost_repeats: int = 3, audit_samples: int = DEFAULT_AUDIT,
        progress: bool = False,
    ) -> None:
        self.loaded = loaded
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.max_tokens_cap = max_tokens_cap
        self.chat = chat
        cfg = loaded.model.cfg
        self.capacity = capacity or min(cfg.max_position, DEFAULT_CAPACITY)
        self.cost_context = min(cost_context, cfg.max_position // 2)
        self.cost_repeats = cost_repeats
        self.audit_samples = audit_samples
        self.progress = progress
        self.eos_ids = loaded.eos_ids
        self._factories: dict[str, DrafterFactory | None] = {}
        self._kv: dict[tuple[str, int], tuple[int, int]] = {}
        self._sampled: dict[tuple[str, int], dict[float, TurnRequest]] = {}
        self._controllers: dict[tuple[str, int], Controller] = {}
        self._audits: dict[tuple[str, int, float], AuditVerdict] = {}
        self._hash: str | None = None
        self._peers: LlamaCppPeers | None = None
        self._constraints: dict[tuple[str, str], Any] = {}
        self._prompt_encoder: Any = None

    # ---------------------------------------------------------------- protocol: description

    def describe(self) -> RunnerDescription:
        """Model, precision, weight hash and threads; backend, versions, chat templating and
        the max_tokens default and cap under details."""
        if self._hash is None:
            self._hash = weights_digest(self.loaded.source)
        return {
            "runner": "in-process", "model_name": self.loaded.name,
            "precision": self.loaded.precision, "weight_hash": self._hash,
            "torch_threads": torch.get_num_threads(), "accelerator": None,
            "details": {"backend": self.loaded.backend, "source": str(self.loaded.source),
                        "backend_version": self.loaded.backend_version(),
                        "exactness": self.loaded.exactness(),
                        "torch": torch.__version__, "specdecode": __version__,
                        "chat": self.chat,  # False: --no-chat-template
                        "chat_template": self.chat and
                        self.loaded.tokenizer.chat_template is not None,
                        "default_max_tokens": self.default_max_tokens,
                        "max_tokens_cap": self.max_tokens_cap,
                        # a recording made with another tokenizer is noted (bench.requests)
                        "tokenizer_sha256": tokenizer_digest(self.loaded.tokenizer)},
        }

    # ------------------------------------------------------------------ preparing configs

    def max_tokens(self, prompt: Prompt) -> int:
        """The prompt's max_tokens (else the default), capped at `max_tokens_cap`."""
        n = prompt.max_tokens or self.default_max_tokens
        return min(n, self.max_tokens_cap) if self.max_tokens_cap else n

    def _encoder(self) -> Any:
        """The server's prompt encoder over this tokenizer (message contents as text)."""
        if self._prompt_encoder is None:
            from specdecode.server.tokens import PromptEncoder

            self._prompt_encoder = PromptEncoder(self.loaded.tokenizer)
        return self._prompt_encoder

    def _request_ids(self, prompt: Prompt) -> tuple[Any, list[int]]:
        """A recorded request, checked as the server checks it, and its prompt's token ids."""
        from specdecode.bench.requests import CHAT, validate
        from specdecode.server import prepare
        from specdecode.server.openai_errors import APIError

        assert prompt.request is not None
        req = validate(prompt.request, prompt.route)
        try:
            if prompt.route == CHAT:
                return req, prepare.chat_prompt(req, self._encoder())
            return req, prepare.completion_prompt(req, self._encoder(),
                                                  int(self.loaded.model.cfg.vocab_size))
        except APIError as exc:
            raise SpecDecodeError(f"prompt {prompt.id} ({prompt.source}): {exc.message}") \
                from None

    def _request_bound(self, prompt: Prompt) -> int:
        """Tokens a recorded request may take: its prompt and max_tokens (chat without one:
        all the room, as the server gives it, in a context of DEFAULT_CAPACITY tokens, serve's
        default --max-seq-len; a completion: 16)."""
        from specdecode.bench.requests import CHAT
        from specdecode.server.prepare import DEFAULT_COMPLETION_TOKENS

        context = min(int(self.loaded.model.cfg.max_position), DEFAULT_CAPACITY)
        default = context if prompt.route == CHAT else DEFAULT_COMPLETION_TOKENS
        ids = self._request_ids(prompt)[1]
        return min(len(ids) + self.max_tokens_of(prompt, default), context)

    def max_tokens_of(self, prompt: Prompt, default: int) -> int:
        """A recorded request's max_tokens (else `default`), capped at `max_tokens_cap`."""
        n = prompt.max_tokens or default
        return min(n, self.max_tokens_cap) if self.max_tokens_cap else n

    def _replayed(self, prompt: Prompt, turn: int, config: ConfigSpec) -> TurnRequest:
        """A recorded request as the server would run it (see the module docstring)."""
        from specdecode.bench.requests import CHAT
        from specdecode.server import prepare
        from specdecode.server.openai_errors import APIError

        req, ids = self._request_ids(prompt)
        k = config_k(config)
        window = min(int(self.loaded.model.cfg.max_position), self.capacity - k - 1)
        requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
        try:
            limit = prepare.max_tokens(requested, len(ids), window, None if prompt.route == CHAT
                                       else prepare.DEFAULT_COMPLETION_TOKENS)
            params = prepare.sampling_params(req, limit, int(self.loaded.model.cfg.vocab_size))
        except APIError as exc:
            raise SpecDecodeError(f"prompt {prompt.id} ({prompt.source}): {exc.message}") \
                from None
        if self.max_tokens_cap:
            params = replace(params, max_tokens=min(params.max_tokens, self.max_tokens_cap))
        if params.seed is None:
            params = replace(params, seed=request_seed(prompt, turn, self.seed))
        if config.temperature is not None:
            params = replace(params, temperature=config.temperature)
        return TurnRequest(prompt, turn, ids, params, self._constraint(prompt))

    def fit_capacity(self, prompts: Sequence[Prompt], kmax: int) -> int:
        """Set `capacity` to a bound on any request of `prompts` (whole conversation, every
        turn's max_tokens, a margin per turn for re-tokenized replies) and return it.

        Call it before `check` / `run`: a changed capacity drops the drafter factories built.
        """
        need = 1
        for p in prompts:
            if p.request is not None:
                need = max(need, self._request_bound(p) + kmax + 1)
                continue
            text = conversation_text(self.loaded.tokenizer, p.turns, [""] * len(p.turns),
                                     self.chat)
            bound = len(self.loaded.tokenizer.encode(text)) + len(p.turns) * (
                self.max_tokens(p) + TURN_MARGIN)
            need = max(need, bound + kmax + 1)
        capacity = min(need, self.loaded.model.cfg.max_position + kmax + 1)
        if capacity != self.capacity:
            self.capacity, self._factories = capacity, {}
        return self.capacity

    def factory(self, config: ConfigSpec) -> DrafterFactory | None:
        """The config's drafter factory, built on first use (weights loaded once)."""
        if config.is_plain or is_peer(config.drafter):
            return None
        key = factory_key(config)
        if key not in self._factories:
            options = drafter_options(config)
            try:
                self._factories[key] = drafter_factory(
                    options, self.loaded.model, capacity=self.capacity,
                    tokenizer=self.loaded.tokenizer)
            except (TypeError, ValueError) as exc:
                raise SpecDecodeError(f"config {config.name}: invalid drafter options "
                                      f"{config.options} ({exc})") from None
        return self._factories[key]

    def check(self, configs: Sequence[ConfigSpec]) -> None:
        """Refuse what cannot run before anything is measured; builds every drafter factory."""
        for config in configs:
            config_k(config)
            if is_peer(config.drafter):
                self._peer_target(config)
            self.factory(config)

    # ------------------------------------------------------------------- protocol: run

    def request(self, prompt: Prompt, turn: int, replies: Sequence[str],
                config: ConfigSpec) -> TurnRequest:
        """Template and tokenize one turn; refuse a request beyond the drafter's capacity."""
        if prompt.request is not None:
            return self._replayed(prompt, turn, config)
        tok = self.loaded.tokenizer
        text = conversation_text(tok, prompt.turns[:turn + 1], replies, self.chat)
        params = SamplingParams(temperature=effective_temperature(prompt, config),
                                seed=request_seed(prompt, turn, self.seed),
                                max_tokens=self.max_tokens(prompt))
        ids = tok.encode_prompt(text)
        k = config_k(config)
        if k and len(ids) + params.max_tokens + k + 1 > self.capacity:
            raise SpecDecodeError(
                f"prompt {prompt.id} turn {turn}: {len(ids)} prompt tokens + max_tokens "
                f"{params.max_tokens} + k {k} exceed the drafter's capacity of {self.capacity} "
                "tokens (fit_capacity sets it from the workload)")
        return TurnRequest(prompt, turn, ids, params, self._constraint(prompt))

    def _constraint(self, prompt: Prompt) -> Any:
        """The prompt's constraint bound to the model's tokenizer (compiled once per text)."""
        if prompt.constraint is None:
            return None
        from specdecode.constraints import ConstraintSpec, compile_constraint

        key = (prompt.constraint["kind"], prompt.constraint["text"])
        if key not in self._constraints:
            self._constraints[key] = compile_constraint(
                ConstraintSpec(**prompt.constraint), self.loaded.tokenizer,
                self.loaded.model.cfg.vocab_size, self.eos_ids)
        return self._constraints[key]

    def _generate(self, requests: Sequence[TurnRequest], config: ConfigSpec) -> list[Finished]:
        factory, k = self.factory(config), config_k(config)
        model, tok = self.loaded.model, self.loaded.tokenizer
        if is_peer(config.drafter):
            return [self._peer(config, r) for r in requests]
        drafters = [factory() if factory else None for _ in requests]
        if config.batch_size == 1 and config.k != "auto":
            return [generate_one(model, tok, r, d, k, self.eos_ids)
                    for r, d in zip(requests, drafters, strict=True)]
        controller = None
        if config.k == "auto":
            controller = self._controller(config, k)
        return generate_batch(model, tok, requests, drafters, k, self.eos_ids, controller)

    def _controller(self, config: ConfigSpec, k: int) -> Controller:
        """The configuration's controller, kept over the run, starting from the forward costs
        measured at batch 1 and its batch size (cached per model and machine), as `generate` and
        `serve` start: from an uninformed prior it misjudged wide steps until it had learned
        them (docs/measurements/code-figures.md)."""
        from specdecode.calibration_cache import cached_costs

        if config.key not in self._controllers:
            costs = cached_costs(self.loaded, sorted({1, config.batch_size}), k)
            self._controllers[config.key] = auto_controller(
                k, costs, drafter_options(config).max_step_cost)
        return self._controllers[config.key]

    def _peer_target(self, config: ConfigSpec) -> LlamaCppModel:
        """The llama.cpp target the llama-cpp-python peers run beside (they load its GGUF)."""
        target = llamacpp_target(self.loaded.model)
        if target is None:
            raise SpecDecodeError(f"config {config.name}: the llama-cpp-python peers run "
                                  "beside the llama.cpp backend (--backend llama.cpp)")
        return target

    def _peer(self, config: ConfigSpec, request: TurnRequest) -> Finished:
        """One request through a llama-cpp-python peer (bench.peers); batch 1 only."""
        if config.batch_size != 1:
            raise SpecDecodeError(f"config {config.name}: peers run at batch size 1")
        if request.constraint is not None:
            raise SpecDecodeError(f"config {config.name}: the llama-cpp-python peers do not "
                                  "take structured-output constraints")
        if self._peers is None:
            threads = self._peer_target(config).threads
            self._peers = LlamaCppPeers(self.loaded.source, threads, self.capacity + 64)
        trace = RequestTrace(time.perf_counter())
        tokens, counters = self._peers.generate(config.drafter, config_k(config),
                                                request.prompt_ids, request.params,
                                                self.loaded.tokenizer, self.eos_ids, trace)
        if trace.done is None:
            trace.done = time.perf_counter()
        return Finished(tokens, trace, counters, 0, 0, 0)

    def _observe(self, config: ConfigSpec, request: TurnRequest, done: Finished) -> None:
        """Keep the largest KV caches, for memory(), and the latest request at each sampled
        temperature, for audit()."""
        kv = self._kv.get(config.key, (0, 0))
        self._kv[config.key] = (max(kv[0], done.target_kv), max(kv[1], done.draft_kv))
        if request.params.temperature > 0:
            self._sampled.setdefault(config.key, {})[request.params.temperature] = request

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        """Run `prompts` as one batch under `config`, turn by turn; one sample per turn."""
        if not 1 <= len(prompts) <= config.batch_size:
            raise SpecDecodeError(f"batch size {config.batch_size} takes 1 to "
                                  f"{config.batch_size} prompts, got {len(prompts)}")
        replies: dict[str, list[str]] = {p.id: [] for p in prompts}
        samples: list[RequestSample] = []
        for turn in range(max(len(p.turns) for p in prompts)):
            active = [p for p in prompts if turn < len(p.turns)]
            requests = [self.request(p, turn, replies[p.id], config) for p in active]
            for request, done in zip(requests, self._generate(requests, config), strict=True):
                self._observe(config, request, done)
                replies[request.prompt.id].append("".join(done.trace.text))
                samples.append(to_sample(config, request, done))
        return samples

    # ------------------------------------------------------------------ open-loop replay

    def replay(self, requests: Sequence[Scheduled], config: ConfigSpec,
               emit: Callable[[RequestSample], None]) -> ReplayRecord:
        """One window of an open-loop replay (see the module docstring)."""
        if is_peer(config.drafter):
            raise SpecDecodeError(f"config {config.name}: the llama-cpp-python peers do not "
                                  "replay open loop")
        k = config_k(config)
        controller = self._controller(config, k) if config.k == "auto" else None
        loop = _OpenLoop(self, config, engine.BatchEngine(
            self.loaded.model, config.batch_size, self.capacity, controller), emit)
        for n, item in enumerate(requests):  # templated and tokenized before the clock
            loop.due.append((item.at, n, self.request(item.prompt, 0, [], config), []))
        loop.run()
        firsts = [at for at, _ in loop.sent_first]
        sends = [sent for _, sent in loop.sent_first]
        return ReplayRecord(
            config=config.name, batch_size=config.batch_size, window=0, start_s=0.0,
            requests=len(requests),
            span_s=max(firsts) - min(firsts) if firsts else 0.0,
            sent_span_s=max(sends) - min(sends) if sends else 0.0,
            late_max_s=max((sent - at for at, sent in loop.sent_first), default=0.0),
            steps_by_batch=[float(n) for n in loop.steps_by_batch], batch_source="engine")

    # ---------------------------------------------------------- protocol: costs and memory

    def cost_curves(self, configs: Sequence[ConfigSpec]) -> list[CostCurve]:
        """c(k), v(k) at batch 1 for k = 1..max k, once per drafter (and options).

        One curve per drafter (config "") when it is measured with one set of options, else one
        per configuration (named). The context is `cost_context` tokens, or less to fit the
        drafters' capacity. Batch sizes > 1 are not measured yet. Not for a hybrid (ngram+X):
        what its drafting costs depends on how often the lookup pays on the traffic, which the
        synthetic repeating context cannot stand for (there the lookup always matches, c ~0);
        its c and v come from the run's own timings.
        """
        groups: dict[str, list[ConfigSpec]] = {}
        for c in configs:
            if not c.is_plain and c.batch_size == 1 and model_part(c.drafter) is None \
                    and not is_peer(c.drafter):
                groups.setdefault(factory_key(c), []).append(c)
        if not groups:
            return []
        kmax = max(config_k(c) for group in groups.values() for c in group)
        model = self.loaded.model
        length = max(1, min(self.cost_context, self.capacity - kmax - 2))
        rows = target_rows(model, length, kmax, self.cost_repeats)
        context = repeating_context(model.cfg.vocab_size, length, self.seed)
        drafters = [g[0].drafter for g in groups.values()]
        curves: list[CostCurve] = []
        for group in groups.values():
            first = group[0]
            factory = self.factory(first)
            assert factory is not None  # speculative configs have one
            ks = list(range(1, max(config_k(c) for c in group) + 1))
            curve = cost_curve(factory, first.drafter, ks, rows, context, self.cost_repeats)
            unique = drafters.count(first.drafter) == 1
            curves += [curve] if unique else [replace(curve, config=c.name) for c in group]
        return curves

    def memory(self, config: ConfigSpec) -> MemoryRecord | None:
        """Weights, the largest KV caches this process allocated for `config`, peak RSS.

        None when no request of `config` ran in this process (e.g. all of it was resumed).
        """
        if config.key not in self._kv or is_peer(config.drafter):
            return None
        target = self.loaded.model
        draft = store = 0
        factory = self.factory(config)
        if factory is not None:
            store = factory.store.nbytes() if factory.store is not None else 0
            module = factory().weights()
            if module is not None:
                draft = weight_bytes(module, shared=target)
        target_kv, draft_kv = self._kv[config.key]
        # a suffix store is the factory's, shared by the configurations that share the factory
        # (one store per bench run and drafter options): its size after this one's requests
        return MemoryRecord(config=config.name, batch_size=config.batch_size,
                            target_weights=weight_bytes(target), draft_weights=draft,
                            target_kv=target_kv, draft_kv=draft_kv, peak_rss=peak_rss_bytes(),
                            draft_store=store)

    def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
        """A sampled losslessness audit (`audit.audit_sampled`) of `config` at each temperature
        > 0 it ran, on the last prompt it ran there; none when `audit_samples` is 0.

        Greedy requests need none here: the harness compares their tokens with plain decoding.
        The audit runs requests alone (batch 1); its verdict is reused for every batch size.
        """
        factory = self.factory(config)
        if factory is None or self.audit_samples <= 0:
            return []
        verdicts = []
        for t, request in sorted(self._sampled.get(config.key, {}).items()):
            key = (factory_key(config), config_k(config), t)
            if key not in self._audits:
                self._audits[key] = self._sampled_audit(config, factory, request)
            verdicts.append(replace(self._audits[key], config=config.name,
                                    batch_size=config.batch_size))
        return verdicts

    def _sampled_audit(self, config: ConfigSpec, factory: DrafterFactory,
                       request: TurnRequest) -> AuditVerdict:
        with tqdm(total=self.audit_samples, unit="sample", desc=f"audit {config.name}",
                  disable=not self.progress, file=sys.stderr, leave=False) as bar:
            r = audit_sampled(self.loaded.model, request.prompt_ids, request.params, factory,
                              config_k(config), self.audit_samples, AUDIT_TOKENS, seed=self.seed,
                              eos=self.eos_ids, progress=lambda i: bar.update(i - bar.n),
                              constraint=request.constraint)
        details = (f"temperature {request.params.temperature:g}, prompt {request.prompt.id}: "
                   f"first {r.tokens} tokens, {r.samples} plain vs {r.samples} speculative "
                   f"samples at batch size 1; TV estimate {r.tv_estimate:.3f} (upper bound "
                   f"{r.tv_upper:.3f}); detects TV >= {r.detectable_tv:.2f} with power {POWER:g}; "
                   f"fails when p < {r.false_alarm:g}")
        return AuditVerdict(config=config.name, passed=r.passed, method="sampled-chi-square",
                            n_compared=r.samples, n_failed=0 if r.passed else 1,
                            details=details, p_value=r.p_value, detectable_tv=r.detectable_tv,
                            samples_needed=samples_to_detect(TV_REAL, r.false_alarm),
                            false_alarm=r.false_alarm, temperature=request.params.temperature,
                            prompt_id=request.prompt.id, turn=request.turn)
