"""The `bench`, `compare` and `tune` subcommands (`register` adds them to the CLI's parser).

Configurations are written `--configs "plain;int8:k=3;ngram:k=4,ngram_max=3"`: items separated
by ";", each a drafter name ("plain" for plain decoding) optionally followed by ":" and
comma-separated key=value pairs. Keys: `k` (draft length: an integer, or "auto" for the
controller, which drafts at most `kmax` tokens, default 8), `temperature` (overrides every
prompt's), `name` (default: the drafter and k, e.g. "int8-k3"); any other key is a drafter option
passed to `drafters.registry.drafter_factory` (`model=PATH` for draft-model, `ngram_max=3`,
`layers=0+1+2` for a list). Every speculative configuration is measured against the plain one at
its temperature, so the list needs one (it is added when missing).

Every check that can fail on the user's input (configurations, batch sizes, workload file,
category filter, output folder) runs before the model is loaded; drafters are built and checked
before the first measurement. Errors are SpecDecodeError: the CLI prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TextIO

from specdecode.bench.peers import is_peer
from specdecode.bench.records import ConfigSpec
from specdecode.bench.workloads import Prompt, Workload, load_default_workload, load_workload
from specdecode.cli_args import add_constraint_args, constraint_spec
from specdecode.errors import SpecDecodeError

DEFAULT_LIMIT_PER_CATEGORY = 1  # built-in workload: one prompt of each of its 6 categories
DEFAULT_MAX_TOKENS_CAP = 64  # built-in workload: cap on every prompt's max_tokens
DEFAULT_RUNNER_MAX_TOKENS = 128  # prompts that set no max_tokens
DEFAULT_AUDIT_SAMPLES = 60  # sampled audit: generations per side (2 tokens each)
TUNE_K_VALUES = "1,2,3,4,6,8"
TUNE_PROMPTS = 3
TUNE_MAX_TOKENS = 32
RESERVED_KEYS = ("k", "temperature", "name")
PEER_DEFAULT_K = {"llamacpp-generate": "1", "llamacpp-lookup": "10"}  # its own default
# On the llama.cpp backend: plain and prompt lookup under the controller (it verifies only the
# draft prefix expected to pay at the measured t(B, T)), a fixed k for comparison, and
# llama-cpp-python's own plain decoding and prompt-lookup speculation as peers.
LLAMACPP_CONFIGS = "plain;ngram:k=auto;ngram:k=4;llamacpp-generate;llamacpp-lookup:k=10"
BENCH_DESCRIPTION = """\
Measure plain and speculative decoding side by side on a workload (interleaved, same prompts),
write results.jsonl, report.json and a self-contained report.html, and print a summary with a
recommendation. Results are saved as they are measured: after Ctrl-C, --resume continues.

--configs "plain;int8:k=3;ngram:k=4,ngram_max=3": configurations separated by ";", each a
drafter ("plain" for plain decoding) with optional key=value pairs after ":". Keys: k (an
integer, or "auto": the controller, drafting at most kmax tokens, default 8), temperature
(overrides the prompts'), name; other keys are drafter options (model=PATH for draft-model,
ngram_max=N, layers=0+1+2). A plain baseline is added where one is missing.

--endpoint [NAME=]URL (repeatable) measures OpenAI-compatible servers instead (this package's
`specdecode serve`, vLLM, SGLang, llama.cpp...) over streaming HTTP: TTFT and inter-token latency
are timed on this side per streamed event, acceptance is read from each server's /metrics
(this server's or vLLM's spec_decode counters; unknown, not zero, where absent). Speculation is
the server's own setting, so each endpoint is one configuration named NAME (default: host:port)
and --configs does not apply: the FIRST endpoint is the baseline, the others are measured
against it as speculative configurations, interleaved over the same prompts (to compare a
speculative server with a plain one, list the plain one first). --batch-sizes are then the
numbers of concurrent requests. --model is the model id to request (default: the first of GET
/v1/models); --api-key (or $SPECDECODE_API_KEY) is sent as a Bearer token; --precision,
--backend, --threads and --audit-samples do not apply; --no-chat-template sends raw text to
/v1/completions instead of messages to /v1/chat/completions.
"""


# ------------------------------------------------------------------------------ configurations


def known_drafters() -> tuple[str, ...]:
    """Drafter names the registry knows ("none" is plain decoding)."""
    from specdecode.bench.peers import PEERS
    from specdecode.drafters.registry import DRAFTERS

    return (*DRAFTERS, *PEERS)


def _parse_k(value: str, item: str) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise SpecDecodeError(f"config {item!r}: k must be an integer or 'auto', got "
                              f"{value!r}") from None
    if not 1 <= k <= 64:
        raise SpecDecodeError(f"config {item!r}: k must be in 1..64, got {k}")
    return k


def _parse_temperature(value: str, item: str) -> float:
    try:
        t = float(value)
    except ValueError:
        t = math.nan
    if not (math.isfinite(t) and t >= 0):
        raise SpecDecodeError(f"config {item!r}: temperature must be a number >= 0, got "
                              f"{value!r}")
    return t


def _pairs(body: str, item: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in body.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise SpecDecodeError(f"config {item!r}: expected key=value, got {pair!r}")
        if key.strip() in out:
            raise SpecDecodeError(f"config {item!r}: {key.strip()!r} given twice")
        out[key.strip()] = value.strip()
    return out


def option_value(text: str) -> Any:
    """A drafter option's value: a list for "a+b+c" (e.g. layers=0+1+2), an integer or a
    number when it reads as one, else the text."""
    if "+" in text.strip("+-"):
        return [option_value(part) for part in text.split("+")]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _valid_kmax(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64


def default_name(drafter: str, k: int | Literal["auto"], temperature: float | None) -> str:
    """"plain" or "<drafter>-k<k>", with "-t<temperature>" when it overrides the prompts'."""
    name = "plain" if drafter == "none" else drafter if drafter == "llamacpp-generate" else \
        f"{drafter}-k{k}"
    return name if temperature is None else f"{name}-t{temperature:g}"


def parse_config(item: str, precision: str) -> ConfigSpec:
    """One `drafter[:key=value,...]` item as a ConfigSpec (see the module docstring)."""
    head, _, body = item.strip().partition(":")
    drafter = "none" if head.strip() in ("plain", "none") else head.strip()
    known = known_drafters()
    if drafter not in known:
        names = ", ".join(["plain", *(d for d in known if d != "none")])
        raise SpecDecodeError(f"config {item!r}: unknown drafter {drafter!r} (known: {names})")
    pairs = _pairs(body, item)
    if drafter == "none":
        k: int | Literal["auto"] = 0
        if "k" in pairs:
            raise SpecDecodeError(f"config {item!r}: plain decoding takes no k")
    else:
        k = _parse_k(pairs.get("k", PEER_DEFAULT_K.get(drafter, "4")), item)
    temperature = _parse_temperature(pairs["temperature"], item) if "temperature" in pairs \
        else None
    options: dict[str, Any] = {key: option_value(v) for key, v in pairs.items()
                               if key not in RESERVED_KEYS}
    if drafter == "none" and options:
        raise SpecDecodeError(f"config {item!r}: plain decoding takes no drafter options")
    if k == "auto" and not _valid_kmax(options.get("kmax", 8)):
        raise SpecDecodeError(f"config {item!r}: kmax must be an integer in 1..64")
    name = pairs.get("name") or default_name(drafter, k, temperature)
    return ConfigSpec(name=name, drafter=drafter, k=k, temperature=temperature,
                      precision=precision, options=options)


def parse_configs(text: str, precision: str) -> list[ConfigSpec]:
    """`--configs` as ConfigSpecs, with a plain baseline added for every temperature lacking
    one; duplicate names are refused."""
    configs = [parse_config(item, precision) for item in text.split(";") if item.strip()]
    if not configs:
        raise SpecDecodeError("--configs is empty")
    plain_temps = {c.temperature for c in configs if c.is_plain}
    missing = sorted({c.temperature for c in configs if not c.is_plain} - plain_temps,
                     key=lambda t: -1.0 if t is None else t)
    configs = [ConfigSpec(default_name("none", 0, t), temperature=t, precision=precision)
               for t in missing] + configs
    names = [c.name for c in configs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecDecodeError(f"configuration name(s) used twice: {', '.join(dupes)} (set "
                              "name=... to tell them apart)")
    return configs


def default_configs_text(backend: str = "auto") -> str:
    """plain; prompt lookup then the w4a16 copy at k=3 (the drafter that paid most in
    benchmarks/drafters.py: best of those measured on every built-in and Spec-Bench category at
    batch 1, greedy, 1.4-2.3x plain); each of its two parts alone, the w4a16 copy at k=3 (1.2-1.5x
    everywhere) and ngram k=4, so the report shows what the combination adds."""
    if backend in ("llama.cpp", "llamacpp"):
        return LLAMACPP_CONFIGS
    items = ["plain", "ngram+w4a16:k=3", "w4a16:k=3"]
    if "ngram" in known_drafters():
        items.append("ngram:k=4")
    return ";".join(items)


def check_invariant_target(precision: str, configs: Sequence[ConfigSpec]) -> None:
    """Refuse speculative configurations on a target that is not batch invariant (int8, w8a16,
    w4a16) before anything is measured (see drafters.registry.check_batch_invariant)."""
    from specdecode.drafters.registry import NOT_BATCH_INVARIANT, check_batch_invariant

    if precision in NOT_BATCH_INVARIANT and any(not c.is_plain for c in configs):
        check_batch_invariant(precision)


def parse_int_list(text: str, what: str, low: int = 1) -> list[int]:
    """A comma-separated list of integers >= `low`, sorted and without repeats."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SpecDecodeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < low:
        raise SpecDecodeError(f"{what} must be integers >= {low}, got {text!r}")
    return values


# ------------------------------------------------------------------------------------ workload


def parse_categories(text: str | None) -> list[str] | None:
    """`--categories a,b` as a list (None: every category)."""
    if text is None:
        return None
    cats = [c.strip() for c in text.split(",") if c.strip()]
    if not cats:
        raise SpecDecodeError("--categories is empty")
    return cats


def select_workload(workload: str | None, categories: str | None, limit: int | None,
                    strict: bool) -> Workload:
    """The --workload file, or the built-in one (one prompt per category unless --limit...)."""
    cats = parse_categories(categories)
    if workload is None:
        return load_default_workload(cats, limit or DEFAULT_LIMIT_PER_CATEGORY)
    return load_workload(workload, categories=cats, limit_per_category=limit, strict=strict)


def report_skipped(workload: Workload, err: TextIO) -> None:
    """One warning line per malformed workload line that was skipped."""
    for line in workload.skipped:
        print(f"specdecode: warning: skipped malformed line {line}", file=err)


def default_out_dir(prefix: str = "") -> Path:
    """runs/<prefix><UTC timestamp>."""
    return Path("runs") / f"{prefix}{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


# --------------------------------------------------------------------------------- running


def endpoint_configs_from(args: argparse.Namespace) -> list[ConfigSpec]:
    """The configurations of `--endpoint` values (refusing --configs beside them)."""
    from specdecode.bench.http_runner import endpoint_configs, parse_endpoints

    if args.configs:
        raise SpecDecodeError("--configs selects in-process drafters; with --endpoint each "
                              "server's own setting is measured: list several --endpoint "
                              "NAME=URL to compare servers (the first is the baseline)")
    return endpoint_configs(parse_endpoints(args.endpoint))


@dataclass
class BenchPlan:
    """Everything checked before the model is loaded."""

    workload: Workload
    configs: list[ConfigSpec]  # every configuration at every batch size
    out_dir: Path
    resume: bool
    seed: int
    max_tokens_cap: int | None
    progress: bool = True
    n_resamples: int | None = None


def check_numbers(args: argparse.Namespace) -> None:
    """--threads, --max-tokens and --audit-samples, where given, are in range."""
    for flag, low in (("threads", 1), ("max_tokens", 1), ("audit_samples", 0)):
        value = getattr(args, flag, None)
        if value is not None and value < low:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be >= {low}, got {value}")


def plan_bench(args: argparse.Namespace, err: TextIO) -> BenchPlan:
    """Check numbers, configurations, batch sizes, workload and output folder, in that order."""
    from specdecode.bench.harness import config_grid, validate_configs
    from specdecode.bench.store import preflight

    check_numbers(args)
    if args.resume and args.out is None:
        raise SpecDecodeError("--resume needs --out DIR (the folder of the run to continue)")
    if getattr(args, "endpoint", None):
        configs = endpoint_configs_from(args)
    else:
        configs = parse_configs(args.configs or default_configs_text(args.backend), args.precision)
        check_invariant_target(args.precision, configs)
    batch_sizes = parse_int_list(args.batch_sizes, "--batch-sizes")
    grid = config_grid(configs, batch_sizes)
    validate_configs(grid)
    workload = select_workload(args.workload, args.categories, args.limit_per_category,
                               args.strict)
    workload = constrain_workload(workload, constraint_spec(args))
    report_skipped(workload, err)
    cap = args.max_tokens if args.max_tokens is not None else (
        DEFAULT_MAX_TOKENS_CAP if args.workload is None else None)
    out_dir = preflight(args.out or default_out_dir(), args.resume)
    return BenchPlan(workload, grid, out_dir, args.resume, args.seed, cap,
                     progress=not args.quiet, n_resamples=args.resamples)


def constrain_workload(workload: Workload, spec: Any) -> Workload:
    """The workload with `spec` (--json-schema / --regex / --grammar) as the constraint of
    every prompt that names none of its own."""
    if spec is None:
        return workload
    prompts = [p if p.constraint is not None else dataclasses.replace(p, constraint=spec.to_dict())
               for p in workload.prompts]
    return dataclasses.replace(workload, prompts=prompts)


def structured_lines(results_path: Path) -> list[str]:
    """Per configuration with constrained requests: outputs valid under their constraint, the
    constraint's own cost (mask time against the request time) and the tokens it forced."""
    from specdecode.bench.store import read_results

    by_config: dict[tuple[str, int], list[Any]] = {}
    for s in read_results(results_path).samples:
        if s.valid is not None:
            by_config.setdefault((s.config, s.batch_size), []).append(s)
    lines = []
    for (name, batch), samples in sorted(by_config.items()):
        valid = sum(1 for s in samples if s.valid)
        mask = sum(s.mask_s for s in samples)
        total = sum(s.latency_s for s in samples)
        tokens = sum(s.output_tokens for s in samples)
        forced = sum(s.forced for s in samples)
        lines.append(f"structured output, {name} at batch {batch}: {valid}/{len(samples)} "
                     f"outputs valid; masks {mask:.2f} s = {mask / total if total else 0:.1%} "
                     f"of request time; {forced}/{tokens} tokens forced (unscored)")
    return lines


def make_runner(args: argparse.Namespace, plan: BenchPlan, default_max_tokens: int,
                loaded: Any = None) -> Any:
    """Load the model (unless `loaded`, a LoadedModel, is given: the Python API's) and build the
    in-process runner; build and check every drafter."""
    import torch

    from specdecode.bench.inprocess import InProcessRunner, config_k
    from specdecode.models.loading import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if loaded is None:
        loaded = load_model(args.model, args.precision, args.backend,
                            max_batch=max(c.batch_size for c in plan.configs))
    runner = InProcessRunner(loaded, seed=plan.seed, default_max_tokens=default_max_tokens,
                             max_tokens_cap=plan.max_tokens_cap, chat=not args.no_chat_template,
                             audit_samples=getattr(args, "audit_samples", 0),
                             progress=plan.progress)
    runner.fit_capacity(plan.workload.prompts, max(config_k(c) for c in plan.configs))
    runner.check(plan.configs)
    return runner


def make_http_runner(args: argparse.Namespace, plan: BenchPlan,
                     default_max_tokens: int) -> Any:
    """The HTTP runner over the plan's endpoints, every endpoint probed (SpecDecodeError naming
    the URL when one cannot be used)."""
    import os

    from specdecode.bench.http_runner import API_KEY_ENV, HttpRunner, parse_endpoints

    if not args.request_timeout > 0:
        raise SpecDecodeError(f"--request-timeout must be > 0, got {args.request_timeout}")
    runner = HttpRunner(parse_endpoints(args.endpoint), model=args.model,
                        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        seed=plan.seed, default_max_tokens=default_max_tokens,
                        max_tokens_cap=plan.max_tokens_cap, chat=not args.no_chat_template,
                        timeout=args.request_timeout)
    try:
        runner.check(plan.configs)
    except BaseException:
        runner.close()
        raise
    return runner


def endpoint_lines(outcome: Any) -> list[str]:
    """Per endpoint and concurrency: acceptance read from /metrics (or unknown), and failures."""
    from specdecode.bench.stats import acceptance

    results = outcome.analysis.results
    lines = ["acceptance read from the endpoints' /metrics (per batch; other clients' traffic "
             "would pollute it):"]
    for s in outcome.analysis.configs:
        mine = results.samples_of(s.key)
        a = acceptance(mine)
        if a.steps == 0:
            text = "unknown (no speculation counters, or none attributable)"
        elif a.drafted == 0:
            text = "no draft tokens (speculation off)"
        else:
            text = (f"accepted/drafted {a.accepted}/{a.drafted} = {a.rate:.2f}, mean acceptance "
                    f"length {a.mean_acceptance_length:.2f}, alpha (i.i.d. estimate) "
                    f"{a.alpha:.2f}")
        lines.append(f"  {s.spec.name:<18} concurrency {s.spec.batch_size}: {text}")
    done = results.done_units()
    failed = [f for f in results.failures if f.unit not in done]  # not measured again since
    if failed:
        lines.append(f"{len(failed)} request(s) failed (kept in results.jsonl, left out of "
                     f"every statistic; --resume runs them again); first: {failed[0].error}")
    return lines


def execute(runner: Any, plan: BenchPlan, out: TextIO) -> Any:
    """run_bench with the plan's options; returns its BenchOutcome."""
    from specdecode.bench.harness import BenchOptions, run_bench
    from specdecode.bench.stats import DEFAULT_RESAMPLES

    options = BenchOptions(plan.out_dir, resume=plan.resume, seed=plan.seed,
                           n_resamples=plan.n_resamples or DEFAULT_RESAMPLES,
                           progress=plan.progress)
    return run_bench(runner, plan.workload, plan.configs, options, out=out)


def default_max_tokens(args: argparse.Namespace) -> int:
    """The new-token limit of prompts that set none: --max-tokens where given (a Spec-Bench file
    run with --max-tokens 1024 generates up to 1,024 tokens, as Spec-Bench's own scripts do),
    else DEFAULT_RUNNER_MAX_TOKENS."""
    return args.max_tokens if args.max_tokens is not None else DEFAULT_RUNNER_MAX_TOKENS


def cmd_bench(args: argparse.Namespace, out: TextIO | None = None,
              err: TextIO | None = None) -> int:
    """`specdecode bench`: measure, write report.json / report.html, print the summary."""
    out, err = out or sys.stdout, err or sys.stderr
    start = time.perf_counter()
    plan = plan_bench(args, err)
    if args.endpoint:
        runner = make_http_runner(args, plan, default_max_tokens(args))
        try:
            outcome = execute(runner, plan, out)
        finally:
            runner.close()
        print("\n".join(endpoint_lines(outcome)), file=out)
    else:
        runner = make_runner(args, plan, default_max_tokens(args))
        outcome = execute(runner, plan, out)
    for line in structured_lines(outcome.results_path):
        print(line, file=out)
    print(f"{outcome.measured} requests measured ({outcome.resumed} resumed) in "
          f"{time.perf_counter() - start:.0f} s; results in {outcome.results_path.parent}",
          file=out)
    return 0


def resolve_report(path: str) -> Path:
    """A report path as given, or the report.json (else results.jsonl) of a run folder."""
    p = Path(path)
    if p.is_dir():
        for name in ("report.json", "results.jsonl"):
            if (p / name).exists():
                return p / name
        raise SpecDecodeError(f"{p} holds no report.json or results.jsonl")
    return p


def cmd_compare(args: argparse.Namespace, out: TextIO | None = None,
                err: TextIO | None = None) -> int:
    """`specdecode compare OLD NEW`: the changes beyond noise and whether tuning is stale."""
    import json

    from specdecode.bench.compare import compare
    from specdecode.bench.stats import DEFAULT_RESAMPLES

    out = out or sys.stdout
    result = compare(resolve_report(args.old), resolve_report(args.new),
                     n_resamples=args.resamples or DEFAULT_RESAMPLES, seed=args.seed)
    print(result.render(), file=out)
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1), encoding="utf-8")
    return 0


# ------------------------------------------------------------------------------------- tune


def tune_drafters(text: str | None) -> list[str]:
    """--drafters as names; default: every registered drafter that needs no extra argument."""
    known = known_drafters()
    if text is None:
        return [d for d in known if d not in ("none", "draft-model") and not is_peer(d)]
    names = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in names if d not in known or d == "none"]
    if unknown or not names:
        raise SpecDecodeError(f"--drafters: unknown drafter(s) {', '.join(unknown) or '(none)'}"
                              f" (known: {', '.join(d for d in known if d != 'none')})")
    return names


def tune_configs(drafters: Sequence[str], k_values: Sequence[int], precision: str,
                 draft_model: str | None) -> list[ConfigSpec]:
    """plain, then every drafter at every k (greedy: the prompts' own temperatures are kept)."""
    configs = [ConfigSpec("plain", precision=precision)]
    for d in drafters:
        options = {"model": draft_model} if d == "draft-model" and draft_model else {}
        configs += [ConfigSpec(f"{d}-k{k}", d, k, precision=precision, options=options)
                    for k in k_values]
    return configs


def round_robin(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """Up to n prompts taking one of each category in turn (categories in order of appearance)."""
    queues: dict[str, list[Prompt]] = {}
    for p in prompts:
        queues.setdefault(p.category, []).append(p)
    picked: list[Prompt] = []
    while len(picked) < n and any(queues.values()):
        for queue in queues.values():
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


def tune_workload(args: argparse.Namespace) -> Workload:
    """--prompts greedy prompts, spread over the categories (default: the built-in workload)."""
    cats = parse_categories(args.categories)
    workload = load_default_workload(cats) if args.workload is None else load_workload(
        args.workload, categories=cats, strict=args.strict)
    greedy = [p for p in workload.prompts if p.temperature is None] or workload.prompts
    return Workload(f"{workload.name}-tune", workload.path, round_robin(greedy, args.prompts),
                    workload.skipped, workload.categories)


def plan_tune(args: argparse.Namespace, err: TextIO) -> BenchPlan:
    """The calibration run's plan, checked before the model is loaded."""
    from specdecode.bench.store import preflight

    check_numbers(args)
    if args.prompts < 1:
        raise SpecDecodeError(f"--prompts must be >= 1, got {args.prompts}")
    k_values = parse_int_list(args.k_values, "--k-values")
    if k_values[-1] > 64:
        raise SpecDecodeError(f"--k-values must be in 1..64, got {args.k_values!r}")
    drafters = tune_drafters(args.drafters)
    if "draft-model" in drafters and not args.draft_model:
        raise SpecDecodeError("tuning draft-model needs --draft-model PATH")
    configs = tune_configs(drafters, k_values, args.precision, args.draft_model)
    check_invariant_target(args.precision, configs)
    workload = tune_workload(args)
    report_skipped(workload, err)
    out_dir = preflight(args.out or default_out_dir("tune-"), False)
    return BenchPlan(workload, configs, out_dir, False, args.seed, args.max_tokens,
                     progress=not args.quiet, n_resamples=args.resamples)


def _x(value: float) -> str:
    return f"{value:.2f}x" if math.isfinite(value) else "-"


def tune_lines(analysis: Any) -> tuple[list[str], Any]:
    """The table of (drafter, k) candidates and the one with the best measured speedup."""
    lines = [f"{'drafter':<14}{'k':>3}{'alpha':>7}{'c':>7}{'v':>7}{'predicted':>11}"
             f"{'measured [95% CI]':>26}  audit"]
    best, best_value = None, -math.inf
    for s in analysis.configs:
        if s.spec.is_plain:
            continue
        ratio = s.speedup.total_ratio if s.speedup is not None else None
        measured = f"{_x(ratio.estimate)} [{ratio.low:.2f}, {ratio.high:.2f}]" if ratio else "-"
        audit = analysis.audit_passed(s.spec.name, s.spec.batch_size)
        verdict = {True: "pass", False: "FAIL", None: "-"}[audit]
        lines.append(f"{s.spec.drafter:<14}{s.spec.k!s:>3}{s.acceptance.alpha:>7.2f}"
                     f"{s.c:>7.2f}{s.v:>7.2f}{_x(s.predicted_speedup):>11}{measured:>26}  "
                     f"{verdict}")
        value = ratio.estimate if ratio is not None else math.nan
        if audit is not False and math.isfinite(value) and value > best_value:
            best, best_value = s, value
    return lines, best


def tune_verdict(best: Any) -> list[str]:
    """The pick and its vLLM equivalent, or why speculation should stay off."""
    from specdecode.bench.recommend import vllm_speculative_config

    if best is None:
        return ["pick: none (no candidate was measured against plain decoding)"]
    ratio = best.speedup.total_ratio
    head = (f"pick: {best.spec.drafter} k={best.spec.k}: measured {_x(ratio.estimate)} "
            f"(95% CI {ratio.low:.2f}-{ratio.high:.2f}), predicted "
            f"{_x(best.predicted_speedup)}, alpha {best.acceptance.alpha:.2f}")
    lines = [head]
    if not ratio.low > 1.0:
        lines.append("note: its interval does not lie above 1 on this short calibration; "
                     "confirm with `specdecode bench` before enabling speculation")
    vllm, note = vllm_speculative_config(best.spec, int(best.spec.k))
    if vllm is not None:
        import json

        lines.append(f"vLLM: --speculative-config '{json.dumps(vllm)}'")
    if note:
        lines.append(f"note: {note}")
    return lines


def cmd_tune(args: argparse.Namespace, out: TextIO | None = None,
             err: TextIO | None = None) -> int:
    """`specdecode tune`: a short calibration run over drafters and k; prints the pick."""
    import io

    from specdecode.bench.hardware import describe_hardware

    out, err = out or sys.stdout, err or sys.stderr
    start = time.perf_counter()
    plan = plan_tune(args, err)
    runner = make_runner(args, plan, args.max_tokens)
    outcome = execute(runner, plan, io.StringIO())
    header = outcome.analysis.results.header
    print(f"specdecode tune: {header.model.name} ({header.model.precision}) on "
          f"{describe_hardware(header.hardware)}; {len(plan.workload.prompts)} prompts, "
          f"<= {args.max_tokens} tokens each, batch size 1", file=out)
    lines, best = tune_lines(outcome.analysis)
    print("\n".join([*lines, *tune_verdict(best)]), file=out)
    print(f"calibrated in {time.perf_counter() - start:.0f} s; report: {outcome.report_html}",
          file=out)
    return 0


# ---------------------------------------------------------------------------------- parsers


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--precision", default="fp32",
                   help="fp32 | bf16 | int8 | w8a16 | w4a16 (default fp32)")
    p.add_argument("--backend", default="auto",
                   help="auto | native | transformers | llama.cpp (docs/llamacpp.md)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice; stated in the report)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="send the raw turns instead of the model's chat template")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=None,
                   help="JSONL file, Spec-Bench or plain format (default: the built-in one)")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--strict", action="store_true",
                   help="refuse a workload with a malformed line instead of skipping it")


def _add_run_args(p: argparse.ArgumentParser, out_help: str) -> None:
    p.add_argument("--out", type=Path, default=None, help=out_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=None, help="bootstrap resamples")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_bench_parser(sub: Any) -> None:
    """`specdecode bench`."""
    b = sub.add_parser("bench", help="measure speculative decoding on a workload; report it",
                       description=BENCH_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(b)
    _add_workload_args(b)
    add_constraint_args(b)
    b.add_argument("--limit-per-category", type=int, default=None,
                   help=f"first N prompts of each category (built-in workload default: "
                        f"{DEFAULT_LIMIT_PER_CATEGORY}; a file: all)")
    b.add_argument("--configs", default=None,
                   help='e.g. "plain;int8:k=3;ngram:k=4" (default: '
                        'plain;ngram+w4a16:k=3;w4a16:k=3;ngram:k=4)')
    b.add_argument("--batch-sizes", default="1", help="comma-separated (default 1)")
    b.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per prompt: the limit of prompts that set no max_tokens "
                        "and a cap on those that do (default: prompts without one get "
                        f"{DEFAULT_RUNNER_MAX_TOKENS}; the built-in workload is capped at "
                        f"{DEFAULT_MAX_TOKENS_CAP})")
    b.add_argument("--audit-samples", type=int, default=DEFAULT_AUDIT_SAMPLES,
                   help="generations per side of the sampled losslessness audit of each "
                        f"speculative config at temperature > 0 (default "
                        f"{DEFAULT_AUDIT_SAMPLES}; 0: none)")
    b.add_argument("--resume", action="store_true", help="continue the run in --out")
    b.add_argument("--endpoint", action="append", default=None, metavar="[NAME=]URL",
                   help="measure this OpenAI-compatible server over HTTP instead of the "
                        "in-process engine (repeatable: the first is the baseline; see above)")
    b.add_argument("--api-key", default=None,
                   help="--endpoint: Bearer token (default: $SPECDECODE_API_KEY if set)")
    b.add_argument("--request-timeout", type=float, default=300.0,
                   help="--endpoint: seconds a request may wait for its next byte (default 300)")
    _add_run_args(b, "output folder (default: runs/<UTC timestamp>)")
    b.set_defaults(func=cmd_bench)


def add_compare_parser(sub: Any) -> None:
    """`specdecode compare`."""
    c = sub.add_parser("compare", help="what changed between two bench reports (beyond noise)")
    c.add_argument("old", help="OLD report.json, results.jsonl or run folder")
    c.add_argument("new", help="NEW report.json, results.jsonl or run folder")
    c.add_argument("--json", default=None, help="also write the comparison to this file")
    c.add_argument("--resamples", type=int, default=None, help="bootstrap resamples")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_compare)


def add_tune_parser(sub: Any) -> None:
    """`specdecode tune`."""
    t = sub.add_parser("tune", help="pick the drafter and k from a short calibration run")
    _add_model_args(t)
    _add_workload_args(t)
    t.add_argument("--drafters", default=None,
                   help="comma-separated (default: every drafter needing no extra argument)")
    t.add_argument("--draft-model", default=None, help="draft checkpoint for draft-model")
    t.add_argument("--k-values", default=TUNE_K_VALUES, help=f"default {TUNE_K_VALUES}")
    t.add_argument("--prompts", type=int, default=TUNE_PROMPTS,
                   help=f"calibration prompts, spread over the categories (default "
                        f"{TUNE_PROMPTS})")
    t.add_argument("--max-tokens", type=int, default=TUNE_MAX_TOKENS,
                   help=f"tokens per calibration request (default {TUNE_MAX_TOKENS})")
    _add_run_args(t, "output folder (default: runs/tune-<UTC timestamp>)")
    t.set_defaults(func=cmd_tune)


def register(subparsers: Any) -> None:
    """Add `bench`, `compare` and `tune` to the CLI's subparsers (each sets `func`)."""
    add_bench_parser(subparsers)
    add_compare_parser(subparsers)
    add_tune_parser(subparsers)


def main_for_tests(argv: Sequence[str], out: TextIO | None = None,
                   err: TextIO | None = None) -> int:
    """Run one of these subcommands as the CLI would: a SpecDecodeError is one line on `err`
    and exit status 2."""
    parser = argparse.ArgumentParser(prog="specdecode")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    err = err or sys.stderr
    try:
        return int(args.func(args, out=out, err=err))
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=err)
        return 2
