"""What `bench` and `tune` run, checked before any model loads: their configurations, workload
and output folder (a `BenchPlan`), the runner and the measured run, from one checked
`bench.options.BenchOptions`: the command line (`cli.bench`, `cli.tune`) and the Python API
(`Specdecode.bench`) each build one and run it here.

Configurations are written `--configs "plain;int8:k=3;ngram:k=4,ngram_max=3"`: items separated
by ";", each a drafter name ("plain" for plain decoding) optionally followed by ":" and
comma-separated key=value pairs. Keys: `k` (draft length: an integer, or "auto" for the
controller, which drafts at most `kmax` tokens, default 8), `temperature` (overrides every
prompt's), `name` (default: the drafter and k, e.g. "int8-k3"); any other key is a drafter option
(a field of `drafters.options.DrafterOptions`: `model=PATH` for draft-model, `ngram_max=3`,
`layers=0+1+2` for a list, `max_step_cost=1.5`), refused when the drafter does not read it.
Every speculative configuration is measured against the plain one at its temperature, so the
list needs one (it is added when missing).

Every check that can fail on the user's input (configurations, batch sizes, workload file,
category filter, output folder) runs before the model is loaded; drafters are built and checked
before the first measurement. Errors are SpecDecodeError: the CLI prints one line and exits 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TextIO

from specdecode.bench.arrivals import Arrivals, offsets, parse_arrivals
from specdecode.bench.openloop import REPLAY_WINDOW_S
from specdecode.bench.options import TUNE_MAX_TOKENS, BenchOptions, TuneOptions
from specdecode.bench.peers import is_peer
from specdecode.bench.records import ConfigSpec, drafter_options
from specdecode.bench.workloads import (
    BUILTIN_WORKLOADS,
    REPETITIVE_WORKLOAD,
    Prompt,
    Workload,
    load_builtin_workload,
    load_default_workload,
    load_repetitive_workload,
    load_workload,
)
from specdecode.errors import SpecDecodeError
from specdecode.limits import K_RANGE, valid_k
from specdecode.report.traffic import Slo, parse_slo

DEFAULT_LIMIT_PER_CATEGORY = 1  # built-in workload: one prompt of each of its 6 categories
DEFAULT_MAX_TOKENS_CAP = 64  # built-in workload: cap on every prompt's max_tokens
DEFAULT_RUNNER_MAX_TOKENS = 128  # prompts that set no max_tokens
RESERVED_KEYS = ("k", "temperature", "name")
PEER_DEFAULT_K = {"llamacpp-generate": "1", "llamacpp-lookup": "10"}  # its own default
# On the llama.cpp backend: plain and prompt lookup under the controller (it verifies only the
# draft prefix expected to pay at the measured t(B, T)), a fixed k for comparison, and
# llama-cpp-python's own plain decoding and prompt-lookup speculation as peers.
LLAMACPP_CONFIGS = "plain;ngram:k=auto;ngram:k=4;llamacpp-generate;llamacpp-lookup:k=10"
FAST_TARGET_CONFIGS = "plain;ngram:k=auto;ngram+auto:k=auto"

# ------------------------------------------------------------------------------ configurations


def known_drafters() -> tuple[str, ...]:
    """Drafter names the registry knows ("none" is plain decoding)."""
    from specdecode.bench.peers import PEERS
    from specdecode.drafters.options import DRAFTERS

    return (*DRAFTERS, *PEERS)


def _parse_k(value: str, item: str) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise SpecDecodeError(f"config {item!r}: k must be an integer or 'auto', got "
                              f"{value!r}") from None
    if not valid_k(k):
        raise SpecDecodeError(f"config {item!r}: k must be in {K_RANGE}, got {k}")
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
    name = pairs.get("name") or default_name(drafter, k, temperature)
    spec = ConfigSpec(name=name, drafter=drafter, k=k, temperature=temperature,
                      precision=precision, options=options)
    if drafter != "none" and not is_peer(drafter):
        drafter_options(spec)  # an option the drafter does not read is refused now
    return spec


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


def default_configs_text(backend: str = "auto", precision: str = "fp32",
                         model: str | None = None) -> str:
    """The configurations `bench` measures when --configs is not given.

    On the fp32 target: plain; prompt lookup then the w4a16 copy at k=3 (the drafter that paid
    most in benchmarks/drafters.py, on every built-in and Spec-Bench category at batch 1, greedy:
    docs/measurements/code-figures.md); each of its two parts alone, the w4a16 copy at k=3 and
    ngram k=4, so the report shows what the combination adds. On a fast target (checkpoint, the
    default where the kernels build, or bf16/w4a16) a w4a16 copy drafts at about the target's
    own cost, so: plain, the lookup under the controller, and ngram+auto (the lookup, then the
    model draft that measures cheapest for this target at load, or none). A model installed as
    the target of a pair (models.catalog, e.g. qwen2.5-coder-1.5b) also drafts with its pair's
    draft under the controller."""
    from specdecode.models import backends
    from specdecode.models.catalog import pair_draft
    from specdecode.models.precision import is_reference

    draft = pair_draft(model) if model else None
    pair = f";draft-model:k=auto,model={draft.name}" if draft else ""
    if not backends.is_auto(backend) and backends.get(backend).peer is not None:
        return LLAMACPP_CONFIGS + pair  # a backend with a peer: its library's own decoding
    if not is_reference(backends.target_precision(backend, precision)):
        return FAST_TARGET_CONFIGS + pair
    items = ["plain", "ngram+w4a16:k=3", "w4a16:k=3"]
    if "ngram" in known_drafters():
        items.append("ngram:k=4")
    return ";".join(items) + pair


def check_invariant_target(precision: str, configs: Sequence[ConfigSpec]) -> None:
    """Refuse speculative configurations on a precision that is row-coupled by construction
    (int8) before anything is measured (models.exactness.check_precision)."""
    from specdecode.models.exactness import check_precision

    if any(not c.is_plain for c in configs):
        check_precision(precision)


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


def select_workload(workload: str | None, categories: Sequence[str] | None, limit: int | None,
                    strict: bool, specbench: str | None = None, seed: int = 0) -> Workload:
    """The --workload file; the built-in default one (None or `default`: one prompt per
    category unless --limit...); another built-in one by name (`structured`: every prompt); or
    the repetitive one (from --specbench when given; its order drawn with --seed); of
    `categories` only (None: every one)."""
    cats = None if categories is None else list(categories)
    if specbench is not None and workload != REPETITIVE_WORKLOAD:
        raise SpecDecodeError(f"--specbench builds --workload {REPETITIVE_WORKLOAD}; to run a "
                              "Spec-Bench file as it is, pass it as --workload FILE")
    if workload == REPETITIVE_WORKLOAD:
        return load_repetitive_workload(specbench, cats, limit, seed=seed, strict=strict)
    if workload in (None, "default"):
        return load_default_workload(cats, limit or DEFAULT_LIMIT_PER_CATEGORY)
    if workload in BUILTIN_WORKLOADS:
        return load_builtin_workload(workload, cats, limit)
    return load_workload(workload, categories=cats, limit_per_category=limit, strict=strict)


def report_skipped(workload: Workload, err: TextIO) -> None:
    """One warning line per malformed workload line that was skipped."""
    for line in workload.skipped:
        print(f"specdecode: warning: skipped malformed line {line}", file=err)


def default_out_dir(prefix: str = "") -> Path:
    """runs/<prefix><UTC timestamp>."""
    return Path("runs") / f"{prefix}{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


# --------------------------------------------------------------------------------- running


def endpoint_configs_from(options: BenchOptions) -> list[ConfigSpec]:
    """The configurations of the `--endpoint` values (BenchOptions.check refuses --configs
    beside them)."""
    from specdecode.bench.http_runner import endpoint_configs, parse_endpoints

    return endpoint_configs(parse_endpoints(list(options.endpoints)))


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
    # `--targets` (bench.targets): configurations left out per target and why, and why there
    # is no llama-cpp-python reference (None: there is one)
    targets: bool = False
    fidelity: str | None = None  # --fidelity (a resumed run is recommended under the new one)
    skipped: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    no_reference: str | None = None
    # how requests arrive (closed loop, or an open-loop replay: bench.arrivals, bench.openloop),
    # the replay's window, and --slo (report.traffic)
    arrivals: Arrivals = dataclasses.field(default_factory=Arrivals)
    replay_window_s: float = REPLAY_WINDOW_S
    slo: Slo | None = None


def plan_bench(options: BenchOptions, err: TextIO) -> BenchPlan:
    """Check the options, then configurations, workload and output folder, in that order."""
    from specdecode.bench.harness import config_grid, validate_configs
    from specdecode.bench.store import preflight

    options.check()
    skipped: dict[str, dict[str, str]] = {}
    no_reference = None
    if options.targets:
        from specdecode.bench.targets import DEFAULT_TARGET_CONFIGS, REFERENCE, plan_targets

        grid, skipped, no_reference = plan_targets(
            options, options.batch_sizes,
            parse_configs(options.configs or DEFAULT_TARGET_CONFIGS, REFERENCE))
    else:
        if options.endpoints:
            configs = endpoint_configs_from(options)
        else:
            configs = parse_configs(options.configs or default_configs_text(
                options.backend, options.precision, options.model), options.precision)
            check_invariant_target(options.precision, configs)
        grid = config_grid(configs, sorted(set(options.batch_sizes)))
    validate_configs(grid)
    workload = select_workload(options.workload, options.categories, options.limit_per_category,
                               options.strict, options.specbench, options.seed)
    workload = constrain_workload(workload, options.constraint)
    report_skipped(workload, err)
    arrivals, window, slo = traffic_options(options, workload, err)
    cap = options.max_tokens if options.max_tokens is not None else (
        DEFAULT_MAX_TOKENS_CAP if options.workload in (None, "default") else None)
    out_dir = preflight(options.out or default_out_dir(), options.resume)
    return BenchPlan(workload, grid, out_dir, options.resume, options.seed, cap,
                     progress=options.progress, n_resamples=options.resamples,
                     targets=bool(options.targets), skipped=skipped,
                     fidelity=options.fidelity,
                     no_reference=no_reference, arrivals=arrivals, replay_window_s=window,
                     slo=slo)


def traffic_options(options: BenchOptions, workload: Workload, err: TextIO
                    ) -> tuple[Arrivals, float, Slo | None]:
    """--arrivals, --speed, --replay-window and --slo, checked against the workload (recorded
    arrivals need arrival times; --targets replays nothing); the workload's notes (sessions,
    lines out of order) printed."""
    arrivals = parse_arrivals(options.arrivals, options.speed)
    window = REPLAY_WINDOW_S if options.replay_window is None else options.replay_window
    if not window > 0:
        raise SpecDecodeError(f"--replay-window must be > 0 seconds (inf: one window), got "
                              f"{window}")
    if arrivals.open_loop:
        if options.targets:
            raise SpecDecodeError("--arrivals recorded|poisson replays one target; --targets "
                                  "measures closed loop")
        offsets(workload.prompts, arrivals, options.seed)  # recorded: every prompt has a time
    slo = parse_slo(options.slo)
    for note in workload.notes:
        print(f"specdecode: note: {workload.path}: {note}", file=err)
    return arrivals, window, slo


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
    constraint's own cost (mask time against the request time) and the tokens it forced
    ("unknown" where not recorded: an endpoint's)."""
    from specdecode.bench.store import read_results
    from specdecode.report.analysis import structured_summary

    by_config: dict[tuple[str, int], list[Any]] = {}
    for s in read_results(results_path).samples:
        by_config.setdefault((s.config, s.batch_size), []).append(s)
    lines = []
    for (name, batch), samples in sorted(by_config.items()):
        st = structured_summary(samples)
        if st is None:
            continue
        masks = "masks unknown" if st.mask_s is None else \
            f"masks {st.mask_s:.2f} s = {st.mask_share:.1%} of request time"
        forced = "tokens forced unknown" if st.forced_tokens is None else \
            f"{st.forced_tokens}/{st.output_tokens} tokens forced (unscored)"
        lines.append(f"structured output, {name} at batch {batch}: {st.n_valid}/"
                     f"{st.n_constrained} outputs valid; {masks}; {forced}")
    return lines


def make_runner(options: BenchOptions, plan: BenchPlan, default_max_tokens: int,
                loaded: Any = None) -> Any:
    """Load the model (unless `loaded`, a LoadedModel, is given: the Python API's) and build the
    in-process runner; build and check every drafter."""
    import torch

    from specdecode.models.backends import load_model

    if options.threads is not None:
        torch.set_num_threads(options.threads)
    if plan.targets:
        from specdecode.bench.targets import make_targets_runner

        return make_targets_runner(
            options, plan, plan.skipped, plan.no_reference,
            lambda model: in_process_runner(options, plan, default_max_tokens, model))
    if loaded is None:
        loaded = load_model(options.model, options.precision, options.backend,
                            max_batch=max(c.batch_size for c in plan.configs))
    runner = in_process_runner(options, plan, default_max_tokens, loaded)
    runner.check(plan.configs)
    return runner


def in_process_runner(options: BenchOptions, plan: BenchPlan, default_max_tokens: int,
                      loaded: Any) -> Any:
    """The in-process runner over a loaded model, its capacity fitted to the workload (tune
    audits nothing: its configurations are greedy)."""
    from specdecode.bench.inprocess import InProcessRunner, config_k

    audit_samples = 0 if options.tune is not None else options.audit_samples
    runner = InProcessRunner(loaded, seed=plan.seed, default_max_tokens=default_max_tokens,
                             max_tokens_cap=plan.max_tokens_cap, chat=options.chat_template,
                             audit_samples=audit_samples, progress=plan.progress)
    runner.fit_capacity(plan.workload.prompts, max(config_k(c) for c in plan.configs))
    return runner


def make_http_runner(options: BenchOptions, plan: BenchPlan,
                     default_max_tokens: int) -> Any:
    """The HTTP runner over the plan's endpoints, every endpoint probed (SpecDecodeError naming
    the URL when one cannot be used)."""
    import os

    from specdecode.bench.http_runner import API_KEY_ENV, HttpRunner, parse_endpoints

    runner = HttpRunner(parse_endpoints(list(options.endpoints)), model=options.model,
                        api_key=options.api_key or os.environ.get(API_KEY_ENV) or None,
                        seed=plan.seed, default_max_tokens=default_max_tokens,
                        max_tokens_cap=plan.max_tokens_cap, chat=options.chat_template,
                        timeout=options.request_timeout)
    try:
        runner.prepare(plan.workload.prompts)  # judges of the constraints, before any request
        runner.check(plan.configs)
    except BaseException:
        runner.close()
        raise
    return runner


def execute(runner: Any, plan: BenchPlan, out: TextIO) -> Any:
    """run_bench with the plan's options; returns its BenchOutcome."""
    from specdecode.bench.harness import RunOptions, run_bench
    from specdecode.report.analysis import DEFAULT_RESAMPLES

    options = RunOptions(plan.out_dir, resume=plan.resume, seed=plan.seed,
                           n_resamples=plan.n_resamples or DEFAULT_RESAMPLES,
                           progress=plan.progress, fidelity=plan.fidelity,
                           arrivals=plan.arrivals, replay_window_s=plan.replay_window_s,
                           slo=plan.slo)
    return run_bench(runner, plan.workload, plan.configs, options, out=out)


def default_max_tokens(options: BenchOptions) -> int:
    """The new-token limit of prompts that set none: --max-tokens where given (a Spec-Bench file
    run with --max-tokens 1024 generates up to 1,024 tokens, as Spec-Bench's own scripts do),
    tune's TUNE_MAX_TOKENS, else DEFAULT_RUNNER_MAX_TOKENS."""
    if options.max_tokens is not None:
        return options.max_tokens
    return TUNE_MAX_TOKENS if options.tune is not None else DEFAULT_RUNNER_MAX_TOKENS


# ------------------------------------------------------------------------------------- tune


def tune_drafters(given: Sequence[str] | None, draft_model: bool = False) -> list[str]:
    """--drafters, checked; default: every registered drafter that needs no option it lacks
    (with --draft-model, those that draft with it too)."""
    from specdecode.drafters.options import needs

    known = known_drafters()
    if given is None:
        return [d for d in known if d != "none" and not is_peer(d)
                and (draft_model or not needs(d))]
    names = [d.strip() for d in given if d.strip()]
    unknown = [d for d in names if d not in known or d == "none"]
    if unknown or not names:
        raise SpecDecodeError(f"--drafters: unknown drafter(s) {', '.join(unknown) or '(none)'}"
                              f" (known: {', '.join(d for d in known if d != 'none')})")
    return names


def tune_configs(drafters: Sequence[str], k_values: Sequence[int], precision: str,
                 draft_model: str | None) -> list[ConfigSpec]:
    """plain, then every drafter at every k (greedy: the prompts' own temperatures are kept);
    --draft-model goes to each drafter that reads it, and is refused when none does."""
    from specdecode.drafters.options import reads

    configs = [ConfigSpec("plain", precision=precision)]
    readers = [d for d in drafters if not is_peer(d) and "draft_model" in reads(d)]
    if draft_model is not None and not readers:
        raise SpecDecodeError(f"--draft-model: none of the drafters tuned ({', '.join(drafters)})"
                              " drafts with a draft checkpoint")
    for d in drafters:
        options = {"model": draft_model} if d in readers and draft_model else {}
        configs += [ConfigSpec(f"{d}-k{k}", d, k, precision=precision, options=options)
                    for k in k_values]
    for config in configs[1:]:
        if not is_peer(config.drafter):
            drafter_options(config)  # e.g. draft-model without --draft-model: refused now
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


def tune_workload(options: BenchOptions, tune: TuneOptions) -> Workload:
    """--prompts greedy prompts, spread over the categories (default: the built-in workload)."""
    cats = None if options.categories is None else list(options.categories)
    if options.workload == REPETITIVE_WORKLOAD or options.specbench is not None:
        workload = select_workload(options.workload, cats, None, options.strict,
                                   options.specbench, options.seed)
    elif options.workload is None:
        workload = load_default_workload(cats)
    elif options.workload in BUILTIN_WORKLOADS:
        workload = load_builtin_workload(options.workload, cats)
    else:
        workload = load_workload(options.workload, categories=cats, strict=options.strict)
    greedy = [p for p in workload.prompts if p.temperature is None] or workload.prompts
    return Workload(f"{workload.name}-tune", workload.path, round_robin(greedy, tune.prompts),
                    workload.skipped, workload.categories)


def plan_tune(options: BenchOptions, err: TextIO) -> BenchPlan:
    """The calibration run's plan (options.tune: what is tried), checked before the model is
    loaded."""
    from specdecode.bench.store import preflight

    options.check()
    tune = options.tune or TuneOptions()
    drafters = tune_drafters(tune.drafters, tune.draft_model is not None)
    configs = tune_configs(drafters, sorted(set(tune.k_values)), options.precision,
                           tune.draft_model)
    check_invariant_target(options.precision, configs)
    workload = tune_workload(options, tune)
    report_skipped(workload, err)
    out_dir = preflight(options.out or default_out_dir("tune-"), False)
    return BenchPlan(workload, configs, out_dir, False, options.seed, default_max_tokens(options),
                     progress=options.progress, n_resamples=options.resamples)
