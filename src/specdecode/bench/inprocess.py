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
  `rejections` (steps that drafted more tokens than they accepted) is counted step by step.

Batch size > 1 runs the group through `specdecode.engine.run_batch` when the engine has it, and
is refused otherwise: running the prompts one after another is not a batch.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specdecode import __version__, engine
from specdecode.bench.costcurves import cost_curve, repeating_context, target_rows
from specdecode.bench.records import (
    AuditVerdict,
    ConfigSpec,
    CostCurve,
    MemoryRecord,
    RequestSample,
)
from specdecode.bench.runner import RunnerDescription, effective_temperature, request_seed
from specdecode.bench.workloads import Prompt
from specdecode.drafters.registry import DrafterFactory, drafter_factory
from specdecode.engine import Generation, StepOutput
from specdecode.errors import SpecDecodeError
from specdecode.metrics import Counters
from specdecode.models.loading import LoadedModel, file_digest
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams

DEFAULT_CAPACITY = 2048  # tokens of one request's context when `fit_capacity` was not called
TURN_MARGIN = 16  # tokens per turn allowed for a reply re-tokenizing longer than generated


# ------------------------------------------------------------------------------ one request


@dataclass(frozen=True)
class TurnRequest:
    """One turn of one prompt, ready for the engine."""

    prompt: Prompt
    turn: int
    prompt_ids: list[int]
    params: SamplingParams


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


def kv_bytes(cache: object) -> int:
    """`cache.nbytes()`, or 0 for no cache."""
    nbytes = getattr(cache, "nbytes", None)
    return int(nbytes()) if callable(nbytes) else 0


def generate_one(
    model: Any, tokenizer: Tokenizer, request: TurnRequest, drafter: Any, k: int,
    eos_ids: tuple[int, ...],
) -> Finished:
    """Run one request to completion on the engine, timing every step's emission."""
    trace = RequestTrace(time.perf_counter())
    gen = Generation(model, tokenizer, request.prompt_ids, request.params, drafter, k, eos_ids)
    rejections = 0
    while gen.finish_reason is None:
        drafted, accepted = gen.counters.drafted, gen.counters.accepted
        out = gen.step()
        trace.observe(out, time.perf_counter())
        rejections += gen.counters.accepted - accepted < gen.counters.drafted - drafted
    if trace.done is None:
        trace.done = time.perf_counter()
    target_kv, draft_kv = kv_bytes(gen.cache), kv_bytes(getattr(drafter, "cache", None))
    gen.release()
    return Finished(list(gen.output), trace, gen.counters, rejections, target_kv, draft_kv)


def generate_batch(
    model: Any, tokenizer: Tokenizer, requests: Sequence[TurnRequest],
    factory: DrafterFactory | None, k: int, eos_ids: tuple[int, ...],
) -> list[Finished]:
    """Run requests as one batch through `engine.run_batch` (see `check_batching`).

    Assumes `run_batch(model, tokenizer, [BatchRequest(prompt_ids, params)], factory, k,
    eos_ids, on_step=on_step)` calling `on_step(index, StepOutput)` after each step of request
    `index` and returning objects with `.output`, `.counters` (with `rejections`) and `.cache`.
    """
    run_batch = check_batching(len(requests))
    batch_request = engine.BatchRequest  # type: ignore[attr-defined]
    start = time.perf_counter()
    traces = [RequestTrace(start) for _ in requests]

    def on_step(index: int, out: StepOutput) -> None:
        traces[index].observe(out, time.perf_counter())

    gens = run_batch(model, tokenizer, [batch_request(r.prompt_ids, r.params) for r in requests],
                     factory, k, eos_ids, on_step=on_step)
    end = time.perf_counter()
    out: list[Finished] = []
    for gen, trace in zip(gens, traces, strict=True):
        trace.done = trace.done if trace.done is not None else end
        out.append(Finished(list(gen.output), trace, gen.counters, int(gen.counters.rejections),
                            kv_bytes(getattr(gen, "cache", None)), 0))
    return out


def check_batching(batch_size: int) -> Any:
    """`engine.run_batch` when batch_size > 1 can run as a real batch, else SpecDecodeError."""
    run_batch = getattr(engine, "run_batch", None)
    if run_batch is None:
        raise SpecDecodeError(
            f"batch size {batch_size} needs the batched engine (specdecode.engine.run_batch), "
            "which this version does not have; measure batch size 1 (--batch-sizes 1)"
        )
    return run_batch


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
    )


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


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor of a module's state, packed (int8) weights unpacked."""
    out: list[torch.Tensor] = []
    for value in module.state_dict().values():
        items = value if isinstance(value, tuple) else (value,)
        out += [t for t in items if isinstance(t, torch.Tensor)]
    return out


def _pointer(t: torch.Tensor) -> int:
    return id(t) if t.is_quantized else t.data_ptr()  # unpacked copies: one each


def weight_bytes(module: torch.nn.Module, shared: torch.nn.Module | None = None) -> int:
    """Bytes of a module's distinct weights, leaving out what it shares with `shared` (e.g. a
    drafter's model that reuses the target's tensors or blocks).

    Packed weights count too: those a state dict unpacks (torch.ao dynamic quantization) and
    those of submodules that state their size as an integer `nbytes` (models.precision).
    """
    seen: set[int] = set()
    skip: set[int] = set()
    if shared is not None:
        seen = {t.data_ptr() for t in _tensors(shared) if not t.is_quantized}
        skip = {id(m) for m in shared.modules()}
    total = 0
    for t in _tensors(module):
        if _pointer(t) not in seen:
            seen.add(_pointer(t))
            total += t.numel() * t.element_size()
    for sub in module.modules():
        packed = getattr(sub, "nbytes", None)
        if id(sub) not in skip and isinstance(packed, int) and not isinstance(packed, bool):
            total += packed
    return total


def drafter_module(drafter: Any) -> torch.nn.Module | None:
    """The torch module a drafter runs (`.model`, or `.model.model` for a wrapper), if any."""
    obj = getattr(drafter, "model", None)
    for _ in range(3):
        if isinstance(obj, torch.nn.Module):
            return obj
        obj = getattr(obj, "model", None)
    return None


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ----------------------------------------------------------------------------------- runner


def factory_key(config: ConfigSpec) -> str:
    """What identifies a drafter factory: its name and options (k and sampling excluded)."""
    return json.dumps([config.drafter, config.options], sort_keys=True, default=str)


def factory_kwargs(config: ConfigSpec, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """`drafter_factory` keyword arguments from a config's options ("model" -> draft_model),
    plus `tokenizer` where the factory takes one (layerskip calibrates with it).

    An option `drafter_factory` does not take raises SpecDecodeError naming it.
    """
    import inspect

    accepted = set(inspect.signature(drafter_factory).parameters)
    own = {"name", "target", "capacity", "tokenizer"}
    kwargs: dict[str, Any] = {}
    for key, value in config.options.items():
        arg = "draft_model" if key == "model" else key
        if arg not in accepted or arg in own:
            raise SpecDecodeError(f"config {config.name}: drafter {config.drafter!r} takes no "
                                  f"option {key!r}")
        kwargs[arg] = value
    if "tokenizer" in accepted and tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    return kwargs


def config_k(config: ConfigSpec) -> int:
    """The config's fixed draft length (0 for plain); k = "auto" needs a controller."""
    if config.is_plain:
        return 0
    if not isinstance(config.k, int):
        raise SpecDecodeError(f"config {config.name}: k={config.k!r} needs the draft-length "
                              "controller, which the in-process runner does not have yet")
    if not 1 <= config.k <= engine.MAX_K:
        raise SpecDecodeError(f"config {config.name}: k must be in 1..{engine.MAX_K}")
    return config.k


class InProcessRunner:
    """The Runner protocol on this package's engine, for one loaded target model.

    `capacity` bounds one request's context (prompt + output + k + 1 tokens) for drafters with
    their own KV cache; `fit_capacity` sets it from a workload. `cost_context` / `cost_repeats`
    size the c(k), v(k) measurement.
    """

    def __init__(
        self, loaded: LoadedModel, *, seed: int = 0, default_max_tokens: int = 128,
        max_tokens_cap: int | None = None, chat: bool = True, capacity: int | None = None,
        cost_context: int = 128, cost_repeats: int = 3,
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
        self.eos_ids = tuple(sorted(set(loaded.tokenizer.eos_ids) | set(cfg.eos_token_ids)))
        self._factories: dict[str, DrafterFactory | None] = {}
        self._kv: dict[tuple[str, int], tuple[int, int]] = {}
        self._temperatures: dict[tuple[str, int], set[float]] = {}
        self._hash: str | None = None

    # ---------------------------------------------------------------- protocol: description

    def describe(self) -> RunnerDescription:
        """Model, precision, weight hash and threads; backend and versions under details."""
        if self._hash is None:
            self._hash = weights_digest(self.loaded.source)
        return {
            "runner": "in-process", "model_name": self.loaded.name,
            "precision": self.loaded.precision, "weight_hash": self._hash,
            "torch_threads": torch.get_num_threads(), "accelerator": None,
            "details": {"backend": self.loaded.backend, "source": str(self.loaded.source),
                        "torch": torch.__version__, "specdecode": __version__,
                        "chat_template": self.chat and
                        self.loaded.tokenizer.chat_template is not None},
        }

    # ------------------------------------------------------------------ preparing configs

    def max_tokens(self, prompt: Prompt) -> int:
        """The prompt's max_tokens (else the default), capped at `max_tokens_cap`."""
        n = prompt.max_tokens or self.default_max_tokens
        return min(n, self.max_tokens_cap) if self.max_tokens_cap else n

    def fit_capacity(self, prompts: Sequence[Prompt], kmax: int) -> int:
        """Set `capacity` to a bound on any request of `prompts` (whole conversation, every
        turn's max_tokens, a margin per turn for re-tokenized replies) and return it.

        Call it before `check` / `run`: a changed capacity drops the drafter factories built.
        """
        need = 1
        for p in prompts:
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
        if config.is_plain:
            return None
        key = factory_key(config)
        if key not in self._factories:
            kwargs = factory_kwargs(config, self.loaded.tokenizer)
            try:
                self._factories[key] = drafter_factory(
                    config.drafter, self.loaded.model, capacity=self.capacity, **kwargs)
            except (TypeError, ValueError) as exc:
                raise SpecDecodeError(f"config {config.name}: invalid drafter options "
                                      f"{config.options} ({exc})") from None
        return self._factories[key]

    def check(self, configs: Sequence[ConfigSpec]) -> None:
        """Refuse what cannot run before anything is measured; builds every drafter factory."""
        for config in configs:
            config_k(config)
            if config.batch_size > 1:
                check_batching(config.batch_size)
            self.factory(config)

    # ------------------------------------------------------------------- protocol: run

    def request(self, prompt: Prompt, turn: int, replies: Sequence[str],
                config: ConfigSpec) -> TurnRequest:
        """Template and tokenize one turn; refuse a request beyond the drafter's capacity."""
        tok = self.loaded.tokenizer
        text = conversation_text(tok, prompt.turns[:turn + 1], replies, self.chat)
        params = SamplingParams(temperature=effective_temperature(prompt, config),
                                seed=request_seed(prompt, turn, self.seed),
                                max_tokens=self.max_tokens(prompt))
        ids = tok.encode(text)
        k = config_k(config)
        if k and len(ids) + params.max_tokens + k + 1 > self.capacity:
            raise SpecDecodeError(
                f"prompt {prompt.id} turn {turn}: {len(ids)} prompt tokens + max_tokens "
                f"{params.max_tokens} + k {k} exceed the drafter's capacity of {self.capacity} "
                "tokens (fit_capacity sets it from the workload)")
        return TurnRequest(prompt, turn, ids, params)

    def _generate(self, requests: Sequence[TurnRequest], config: ConfigSpec) -> list[Finished]:
        factory, k = self.factory(config), config_k(config)
        model, tok = self.loaded.model, self.loaded.tokenizer
        if config.batch_size > 1:
            return generate_batch(model, tok, requests, factory, k, self.eos_ids)
        return [generate_one(model, tok, r, factory() if factory else None, k, self.eos_ids)
                for r in requests]

    def _observe(self, config: ConfigSpec, request: TurnRequest, done: Finished) -> None:
        """Keep the largest KV caches and the temperatures seen, for memory() and audit()."""
        kv = self._kv.get(config.key, (0, 0))
        self._kv[config.key] = (max(kv[0], done.target_kv), max(kv[1], done.draft_kv))
        self._temperatures.setdefault(config.key, set()).add(request.params.temperature)

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        """Run `prompts` as one batch under `config`, turn by turn; one sample per turn."""
        if config.batch_size == 1 and len(prompts) != 1:
            raise SpecDecodeError(f"batch size 1 takes one prompt at a time, got {len(prompts)}")
        if config.batch_size > 1:
            check_batching(config.batch_size)
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

    # ---------------------------------------------------------- protocol: costs and memory

    def cost_curves(self, configs: Sequence[ConfigSpec]) -> list[CostCurve]:
        """c(k), v(k) at batch 1 for k = 1..max k, once per drafter (and options).

        One curve per drafter (config "") when it is measured with one set of options, else one
        per configuration (named). The context is `cost_context` tokens, or less to fit the
        drafters' capacity. Batch sizes > 1 are not measured yet.
        """
        groups: dict[str, list[ConfigSpec]] = {}
        for c in configs:
            if not c.is_plain and c.batch_size == 1:
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
        if config.key not in self._kv:
            return None
        target = self.loaded.model
        draft = 0
        factory = self.factory(config)
        if factory is not None:
            module = drafter_module(factory())
            if module is not None:
                draft = weight_bytes(module, shared=target)
        target_kv, draft_kv = self._kv[config.key]
        return MemoryRecord(config=config.name, batch_size=config.batch_size,
                            target_weights=weight_bytes(target), draft_weights=draft,
                            target_kv=target_kv, draft_kv=draft_kv, peak_rss=peak_rss_bytes())

    def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
        """A statistical losslessness audit of `config` at each sampled temperature it ran.

        Greedy requests need none here: the harness compares their tokens with plain decoding.
        """
        temps = sorted(t for t in self._temperatures.get(config.key, ()) if t > 0)
        factory = self.factory(config)
        if not temps or factory is None:
            return []
        audit_config = _audit_function()
        if audit_config is None:
            # TODO(audit): specdecode.audit.audit_config does not exist yet; until it does,
            # sampled configurations get no verdict (the report says "no audit verdict").
            return []
        return [replace(audit_config(self.loaded.model, self.loaded.tokenizer, factory,
                                     k=config_k(config), temperature=t, seed=self.seed),
                        config=config.name, batch_size=config.batch_size) for t in temps]


def _audit_function() -> Any:
    """`specdecode.audit.audit_config` when that module exists, else None."""
    if importlib.util.find_spec("specdecode.audit") is None:
        return None
    module = importlib.import_module("specdecode.audit")
    return getattr(module, "audit_config", None)
