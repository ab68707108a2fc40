"""`specdecode bench`: measure plain and speculative decoding on a workload, in process or
against OpenAI-compatible endpoints, and write the report (the plan and the run: `bench.plan`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from specdecode.bench import plan as bench_plan
from specdecode.bench.options import DEFAULT_AUDIT_SAMPLES, BenchOptions
from specdecode.bench.plan import (
    DEFAULT_LIMIT_PER_CATEGORY,
    DEFAULT_MAX_TOKENS_CAP,
    DEFAULT_RUNNER_MAX_TOKENS,
)
from specdecode.bench.targets import DEFAULT_TARGET_CONFIGS
from specdecode.bench.workloads import DEFAULT_REPETITIVE_DOCUMENTS
from specdecode.cli.args import (
    add_constraint_args,
    add_measurement_args,
    add_model_args,
    add_run_args,
    add_workload_args,
    bench_options,
    constraint_spec,
)
from specdecode.models.backends import bench_targets

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
/v1/completions instead of messages to /v1/chat/completions. A constraint (--json-schema,
--regex, --grammar, or a workload line's own) is sent as chat response_format json_schema
(completions: guided_json), guided_regex or guided_grammar, and each output is judged valid
or not here, from its text; forced tokens and mask time are unknown over HTTP.
"""


def register(sub: Any) -> None:
    """Add `bench` to the CLI's subparsers."""
    b = sub.add_parser("bench", help="measure speculative decoding on a workload; report it",
                       description=BENCH_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(b)
    add_measurement_args(b)
    add_workload_args(b)
    add_constraint_args(b)
    b.add_argument("--limit-per-category", type=int, default=None,
                   help=f"first N prompts of each category (built-in default workload: "
                        f"{DEFAULT_LIMIT_PER_CATEGORY}; a file or --workload structured: all; "
                        f"--workload repetitive: documents per category, default "
                        f"{DEFAULT_REPETITIVE_DOCUMENTS} from --specbench, all built-in ones)")
    b.add_argument("--configs", default=None,
                   help='e.g. "plain;int8:k=3;ngram:k=4" (default on the fp32 target: '
                        'plain;ngram+w4a16:k=3;w4a16:k=3;ngram:k=4; on a fast one, the '
                        'default checkpoint included: plain;ngram:k=auto;ngram+auto:k=auto)')
    b.add_argument("--targets", default=None, metavar="T1,T2,...",
                   help="measure several targets of the model in one interleaved run: "
                        f"{', '.join(t.name for t in bench_targets())} (the native runner's "
                        "precisions, and the GGUF on llama.cpp); each runs every --configs "
                        "item (default "
                        f"{DEFAULT_TARGET_CONFIGS!r}), llama-cpp-python's Llama.generate "
                        "is measured beside them where installed; the report shows speed "
                        "against fidelity (agreement with fp32) and recommends the fastest "
                        "lossless configuration (--precision and --backend do not apply)")
    b.add_argument("--fidelity", default=None,
                   help="--targets: the fidelity the recommendation must keep: fp32 (the fp32 "
                        "target's output), any (default), kl=X (mean KL from fp32 at most X "
                        "nats) or top1=X (top-1 agreement with fp32 at least X, 0-1)")
    b.add_argument("--batch-sizes", default=",".join(map(str, BenchOptions.batch_sizes)),
                   help="comma-separated (default 1)")
    b.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per prompt: the limit of prompts that set no max_tokens "
                        "and a cap on those that do (default: prompts without one get "
                        f"{DEFAULT_RUNNER_MAX_TOKENS}; the built-in workload is capped at "
                        f"{DEFAULT_MAX_TOKENS_CAP})")
    b.add_argument("--audit-samples", type=int, default=DEFAULT_AUDIT_SAMPLES,
                   help="generations per side of the sampled losslessness audit of each "
                        f"speculative config at temperature > 0 (default "
                        f"{DEFAULT_AUDIT_SAMPLES}; 0: none)")
    b.add_argument("--arrivals", default=BenchOptions.arrivals,
                   metavar="closed|recorded|poisson:RATE",
                   help="closed (default): batches of --batch-sizes requests, the next when all "
                        "have ended; recorded: open loop at the workload's arrival times (a "
                        "serve --record recording, or a log with timestamps); poisson:RATE: "
                        "open loop, RATE requests/s drawn from --seed. Open loop, --batch-sizes "
                        "is the engine's rows (a server's --max-batch) and the report shows the "
                        "batch sizes the traffic produced, its tails and goodput")
    b.add_argument("--speed", type=float, default=BenchOptions.speed,
                   help="open loop: compress time by this factor (2: arrivals twice as fast)")
    b.add_argument("--replay-window", type=float, default=None, metavar="SECONDS",
                   help="open loop: seconds of arrivals replayed per window, every "
                        "configuration in turn (default 60; inf: the whole schedule at once)")
    b.add_argument("--slo", default=None, metavar="ttft=S,tpot=S[,latency=S]",
                   help="report the goodput: requests meeting every bound (seconds), and "
                        "those per second, e.g. --slo ttft=0.5,tpot=0.05")
    b.add_argument("--resume", action="store_true",
                   help="continue the run in --out (failed requests and those measured under "
                        "interference are measured again)")
    b.add_argument("--endpoint", action="append", default=None, metavar="[NAME=]URL",
                   help="measure this OpenAI-compatible server over HTTP instead of the "
                        "in-process engine (repeatable: the first is the baseline; see above)")
    b.add_argument("--api-key", default=None,
                   help="--endpoint: Bearer token (default: $SPECDECODE_API_KEY if set)")
    b.add_argument("--request-timeout", type=float, default=BenchOptions.request_timeout,
                   help="--endpoint: seconds a request may wait for its next byte (default 300)")
    add_run_args(b, "output folder (default: runs/<UTC timestamp>)")
    b.set_defaults(func=cmd_bench)


def options_of(args: argparse.Namespace) -> BenchOptions:
    """The BenchOptions of `bench`'s flags."""
    return bench_options(
        args, limit_per_category=args.limit_per_category, configs=args.configs,
        targets=args.targets, fidelity=args.fidelity,
        batch_sizes=tuple(bench_plan.parse_int_list(args.batch_sizes, "--batch-sizes")),
        audit_samples=args.audit_samples, arrivals=args.arrivals, speed=args.speed,
        replay_window=args.replay_window, slo=args.slo, resume=args.resume,
        endpoints=tuple(args.endpoint or ()), api_key=args.api_key,
        request_timeout=args.request_timeout, constraint=constraint_spec(args))


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure, write report.json / report.html, print the summary."""
    out, err = sys.stdout, sys.stderr
    start = time.perf_counter()
    options = options_of(args)
    plan = bench_plan.plan_bench(options, err)
    if options.endpoints:
        runner = bench_plan.make_http_runner(options, plan,
                                             bench_plan.default_max_tokens(options))
        try:
            outcome = bench_plan.execute(runner, plan, out)
        finally:
            runner.close()
        print("\n".join(endpoint_lines(outcome)), file=out)
    else:
        runner = bench_plan.make_runner(options, plan, bench_plan.default_max_tokens(options))
        outcome = bench_plan.execute(runner, plan, out)
    for line in bench_plan.structured_lines(outcome.results_path):
        print(line, file=out)
    print(f"{outcome.measured} requests measured ({outcome.resumed} resumed) in "
          f"{time.perf_counter() - start:.0f} s; results in {outcome.results_path.parent}",
          file=out)
    return 0


def endpoint_lines(outcome: Any) -> list[str]:
    """Per endpoint and concurrency: acceptance read from /metrics (or unknown), and failures."""
    results = outcome.analysis.results
    lines = ["acceptance read from the endpoints' /metrics (per batch or replay window; other "
             "clients' traffic would pollute it):"]
    for s in outcome.analysis.configs:
        a = s.acceptance
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
