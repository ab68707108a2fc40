"""`specdecode audit`: the losslessness audit of a configuration (exit status 1 on FAIL)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.cli.args import (
    add_constraint_args,
    add_drafter_args,
    add_model_args,
    add_sampling_args,
    bind_constraint,
    constraint_spec,
    drafter_options,
    sampling_params,
)
from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.drafters.options import DrafterOptions

AUDIT_PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)
FAULTS = ["q-without-temperature", "top-p-one-side", "sampler-one-side", "q-from-other-model"]


def register(sub: Any) -> None:
    """Add `audit` to the CLI's subparsers."""
    a = sub.add_parser("audit", help="losslessness audit of a configuration (exit 1 on FAIL)")
    a.add_argument("--prompt", default=None, help="prompt (default: a few built-in ones)")
    a.add_argument("--samples", type=int, default=300,
                   help="sampled mode: generations per side (default 300)")
    a.add_argument("--tokens", type=int, default=2, help="sampled mode: tokens per outcome")
    a.add_argument("--false-alarm", type=float, default=1e-3,
                   help="p-value below which the audit fails (its false-alarm rate)")
    a.add_argument("--inject-fault", default=None, choices=FAULTS,
                   help="deliberately break the drafter to see the audit catch it")
    a.add_argument("--json", action="store_true")
    add_model_args(a)
    add_sampling_args(a)
    add_drafter_args(a)
    add_constraint_args(a)
    add_endpoint_args(a)
    a.set_defaults(func=cmd_audit, max_tokens=32)


def add_endpoint_args(a: argparse.ArgumentParser) -> None:
    """`audit --endpoint URL --reference URL`: a server's speculation against a plain server."""
    g = a.add_argument_group("a server's speculation (bench.http_audit)")
    g.add_argument("--endpoint", default=None, metavar="URL",
                   help="audit this OpenAI-compatible server (speculative) against --reference")
    g.add_argument("--reference", default=None, metavar="URL",
                   help="the same model served plainly (no speculation)")
    g.add_argument("--served-model", default=None, metavar="ID",
                   help="the model id to request (default: each server's first listed)")
    g.add_argument("--workload", default=None,
                   help="greedy: a JSONL workload (Spec-Bench or plain format; default: the "
                        "built-in one); each prompt's first turn is sent")
    g.add_argument("--categories", default=None, help="comma-separated categories to keep")
    g.add_argument("--limit-per-category", type=int, default=None,
                   help="first N prompts of each category")
    g.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight to each server (default 1)")
    g.add_argument("--api-key", default=None, help="Bearer token for both servers "
                                                   "(default: $SPECDECODE_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=300.0)
    g.add_argument("--no-chat-template", action="store_true",
                   help="send raw text to /v1/completions instead of chat messages")
    g.add_argument("--out", type=Path, default=None,
                   help="append every reply to this JSONL file as it arrives")


def _audit_drafter(args: argparse.Namespace, options: DrafterOptions, loaded: Any) -> Any:
    """The per-request drafter maker the audit runs, with --inject-fault applied if asked."""
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.drafters.faults import FaultyDrafter
    from specdecode.drafters.layerskip import LayerSkipDrafter
    from specdecode.drafters.registry import drafter_factory

    factory = drafter_factory(options, loaded.model, tokenizer=loaded.tokenizer)
    if factory is None:
        raise SpecDecodeError("the audit needs a drafter (--drafter int8, ngram, ...)")
    if args.inject_fault is None:
        return factory
    drafter = factory()  # the faults draw from a draft model of its own, in its own cache
    if not isinstance(drafter, DraftModelDrafter) or isinstance(drafter, LayerSkipDrafter):
        raise SpecDecodeError(f"--inject-fault needs a model-based drafter, not {args.drafter}")
    draft_model = drafter.model
    other = loaded.model if args.inject_fault == "q-from-other-model" else None
    return lambda: FaultyDrafter(draft_model, args.inject_fault, other)


def cmd_audit(args: argparse.Namespace) -> int:
    if args.endpoint is not None or args.reference is not None:
        return cmd_audit_endpoint(args)
    from tqdm import tqdm

    from specdecode.audit import audit_greedy, audit_sampled
    from specdecode.models.backends import load_model

    params = sampling_params(args)
    options = drafter_options(args)
    k = options.draft_length  # the audit verifies fixed drafts of this length
    if args.inject_fault is not None and params.rule != "residual" and not params.greedy:
        # the faults corrupt the q a drafter reports, which only the residual rule reads: under
        # the invariant rule they cannot change the output (the audit would rightly pass)
        print("# --inject-fault: the faults corrupt q, which only --rule residual reads: "
              "auditing with --rule residual", file=sys.stderr)
        params = dataclasses.replace(params, rule="residual")
    if args.samples < 10:
        raise SpecDecodeError(f"--samples must be >= 10, got {args.samples}")
    spec = constraint_spec(args)
    loaded = load_model(args.model, args.precision, args.backend)
    tok = loaded.tokenizer
    make = _audit_drafter(args, options, loaded)
    eos = loaded.eos_ids
    constraint = bind_constraint(spec, loaded, eos)
    texts = [args.prompt] if args.prompt else list(AUDIT_PROMPTS)
    prompts = [tok.encode_prompt(tok.apply_chat_template([{"role": "user", "content": t}])
                          if tok.chat_template else t) for t in texts]
    print(f"# audit: {loaded.name} ({loaded.backend}, {loaded.precision}), drafter "
          f"{args.drafter}{' with fault ' + args.inject_fault if args.inject_fault else ''}, "
          f"k={k}, temperature {params.temperature}"
          f"{'' if params.greedy else ', rule ' + params.rule}"
          f"{', constraint ' + spec.origin if spec else ''}", file=sys.stderr)
    if params.greedy:
        result = audit_greedy(loaded.model, prompts, params, make, k, eos, constraint)
    else:
        bar = tqdm(total=args.samples, desc="audit samples", file=sys.stderr)
        result = audit_sampled(loaded.model, prompts[0], params, make, k, args.samples,
                               args.tokens, args.false_alarm, seed=args.seed or 0, eos=eos,
                               progress=lambda n: bar.update(n - bar.n), constraint=constraint)
        bar.close()
    print(json.dumps(result.to_dict()) if args.json else result.render())
    return 0 if result.passed else 1


def cmd_audit_endpoint(args: argparse.Namespace) -> int:
    """`audit --endpoint URL --reference URL` (bench.http_audit): exit 1 unless PASS."""
    from specdecode.bench.http_audit import Client, audit_greedy, audit_sampled
    from specdecode.bench.http_runner import API_KEY_ENV, parse_endpoints
    from specdecode.bench.workloads import Prompt, load_default_workload, load_workload

    if args.endpoint is None or args.reference is None:
        raise SpecDecodeError("--endpoint and --reference go together: the server audited and "
                              "a plain server of the same model")
    endpoint, reference = parse_endpoints([f"endpoint={args.endpoint}",
                                           f"reference={args.reference}"])
    if args.concurrency < 1:
        raise SpecDecodeError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.max_tokens < 1:
        raise SpecDecodeError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise SpecDecodeError(f"--temperature must be >= 0, got {args.temperature}")
    if args.temperature > 0 and args.samples < 10:
        raise SpecDecodeError(f"--samples must be >= 10, got {args.samples}")
    categories = args.categories.split(",") if args.categories else None
    if args.prompt:
        prompts = [Prompt("prompt", "prompt", [args.prompt])]
    elif args.workload:
        prompts = load_workload(args.workload, categories=categories,
                                limit_per_category=args.limit_per_category).prompts
    else:
        prompts = load_default_workload(categories, args.limit_per_category).prompts
    for p in prompts:
        p.max_tokens = args.max_tokens
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    log = args.out.open("a", encoding="utf-8") if args.out else None
    try:
        with Client(api_key, args.request_timeout, not args.no_chat_template, log) as client:
            ep = client.target(endpoint, args.served_model)
            ref = client.target(reference, args.served_model)
            ids = "compared" if ep.token_ids and ref.token_ids else "not returned: texts compared"
            print(f"# audit: {endpoint.url} ({ep.model}) against {reference.url} ({ref.model}),"
                  f" {len(prompts)} prompts, concurrency {args.concurrency}, temperature "
                  f"{args.temperature}, token ids {ids}", file=sys.stderr)
            if args.temperature > 0:
                result = audit_sampled(client, ep, ref, prompts[0], args.concurrency,
                                       args.temperature, args.samples, args.tokens,
                                       args.false_alarm)
            else:
                result = audit_greedy(client, ep, ref, prompts, args.concurrency)
    finally:
        if log is not None:
            log.close()
    print(json.dumps(result.to_dict()) if args.json else result.render())
    return 0 if result.verdict == "PASS" else 1
