"""`specdecode tune`: pick the drafter and k from a short calibration run (the plan:
`bench.plan.plan_tune`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from specdecode.bench import plan as bench_plan
from specdecode.bench.options import (
    TUNE_K_VALUES,
    TUNE_MAX_TOKENS,
    TUNE_PROMPTS,
    BenchOptions,
    TuneOptions,
)
from specdecode.bench.plan import parse_int_list, plan_tune
from specdecode.cli.args import (
    add_measurement_args,
    add_model_args,
    add_run_args,
    add_workload_args,
    bench_options,
)


def register(sub: Any) -> None:
    """Add `tune` to the CLI's subparsers."""
    t = sub.add_parser("tune", help="pick the drafter and k from a short calibration run")
    add_model_args(t)
    add_measurement_args(t)
    add_workload_args(t)
    t.add_argument("--drafters", default=None,
                   help="comma-separated (default: every drafter needing no extra argument)")
    t.add_argument("--draft-model", default=None, help="draft checkpoint for draft-model")
    k_values = ",".join(map(str, TUNE_K_VALUES))
    t.add_argument("--k-values", default=k_values, help=f"default {k_values}")
    t.add_argument("--prompts", type=int, default=TUNE_PROMPTS,
                   help=f"calibration prompts, spread over the categories (default "
                        f"{TUNE_PROMPTS})")
    t.add_argument("--max-tokens", type=int, default=TUNE_MAX_TOKENS,
                   help=f"tokens per calibration request (default {TUNE_MAX_TOKENS})")
    add_run_args(t, "output folder (default: runs/tune-<UTC timestamp>)")
    t.set_defaults(func=cmd_tune)


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
    from specdecode.report.recommend import vllm_speculative_config

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
        lines.append(f"vLLM: --speculative-config '{json.dumps(vllm)}'")
    if note:
        lines.append(f"note: {note}")
    return lines


def options_of(args: argparse.Namespace) -> BenchOptions:
    """The BenchOptions of `tune`'s flags, its own in TuneOptions."""
    drafters = None if args.drafters is None else tuple(args.drafters.split(","))
    tune = TuneOptions(drafters=drafters, draft_model=args.draft_model,
                       k_values=tuple(parse_int_list(args.k_values, "--k-values")),
                       prompts=args.prompts)
    return bench_options(args, tune=tune)


def cmd_tune(args: argparse.Namespace) -> int:
    """A short calibration run over drafters and k; prints the table and the pick."""
    import io

    from specdecode.bench.hardware import describe_hardware

    out, err = sys.stdout, sys.stderr
    start = time.perf_counter()
    options = options_of(args)
    plan = plan_tune(options, err)
    runner = bench_plan.make_runner(options, plan, bench_plan.default_max_tokens(options))
    outcome = bench_plan.execute(runner, plan, io.StringIO())
    header = outcome.analysis.results.header
    print(f"specdecode tune: {header.model.name} ({header.model.precision}) on "
          f"{describe_hardware(header.hardware)}; {len(plan.workload.prompts)} prompts, "
          f"<= {args.max_tokens} tokens each, batch size 1", file=out)
    lines, best = tune_lines(outcome.analysis)
    print("\n".join([*lines, *tune_verdict(best)]), file=out)
    print(f"calibrated in {time.perf_counter() - start:.0f} s; report: {outcome.report_html}",
          file=out)
    return 0
