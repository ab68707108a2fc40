"""The `specdecode` command line. Every user error is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from specdecode.cli_args import (
    add_constraint_args,
    add_drafter_args,
    add_model_args,
    add_sampling_args,
    check_k,
    constraint_spec,
    sampling_params,
)
from specdecode.errors import SpecDecodeError


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode.api import auto_steps
    from specdecode.drafters.registry import drafter_factory
    from specdecode.engine import Generation
    from specdecode.models.loading import load_model

    params = sampling_params(args)
    check_k(args)
    spec = constraint_spec(args)
    loaded = load_model(args.model, args.precision, args.backend)
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    factory = drafter_factory(args.drafter, loaded.model, args.draft_model, tokenizer=tok,
                              heads=args.heads, distilled=args.distilled)
    eos = tuple(sorted(set(tok.eos_ids) | set(loaded.model.cfg.eos_token_ids)))
    gen = Generation(loaded.model, tok, tok.encode_prompt(text), params,
                     factory() if factory else None, args.k, eos,
                     constraint=_bind(spec, loaded, eos))
    steps = auto_steps(loaded.model, gen, args.max_step_cost) if args.auto and factory else \
        gen.run()
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    for out in steps:
        if first is None:
            first = time.perf_counter() - start
        pieces.append(out.text)
        if not args.json:
            sys.stdout.write(out.text)
            sys.stdout.flush()
    total = time.perf_counter() - start
    gen.release()
    if args.json:
        record = {
            "text": "".join(pieces), "token_ids": gen.output, "finish_reason": gen.finish_reason,
            "model": loaded.describe(), "drafter": args.drafter,
            "k": "auto" if args.auto else gen.k,
            "timings": {"load_s": loaded.load_seconds, "ttft_s": first, "total_s": total,
                        "tokens_per_s": len(gen.output) / total if total else None},
            "counters": gen.counters.to_dict(),
        }
        print(json.dumps(record))
    else:
        sys.stdout.write("\n")
    return 0


def _bind(spec: Any, loaded: Any, eos: tuple[int, ...]) -> Any:
    """The checked constraint bound to the loaded model's tokenizer (None: none asked)."""
    from specdecode.constraints import compile_constraint

    return None if spec is None else compile_constraint(spec, loaded.tokenizer,
                                                        loaded.model.cfg.vocab_size, eos)


AUDIT_PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)


def _audit_drafter(args: argparse.Namespace, loaded: Any) -> Any:
    """The per-request drafter maker the audit runs, with --inject-fault applied if asked."""
    from specdecode.drafters.faults import FaultyDrafter
    from specdecode.drafters.registry import drafter_factory

    factory = drafter_factory(args.drafter, loaded.model, args.draft_model,
                              tokenizer=loaded.tokenizer, heads=args.heads,
                              distilled=args.distilled)
    if factory is None:
        raise SpecDecodeError("the audit needs a drafter (--drafter int8, ngram, ...)")
    if args.inject_fault is None:
        return factory
    draft_model = getattr(factory(), "model", None)
    if draft_model is None or not hasattr(draft_model, "cfg") or args.drafter == "layerskip":
        raise SpecDecodeError(f"--inject-fault needs a model-based drafter, not {args.drafter}")
    other = loaded.model if args.inject_fault == "q-from-other-model" else None
    return lambda: FaultyDrafter(draft_model, args.inject_fault, other)


def cmd_audit(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specdecode.audit import audit_greedy, audit_sampled
    from specdecode.models.loading import load_model

    params = sampling_params(args)
    check_k(args)
    if args.samples < 10:
        raise SpecDecodeError(f"--samples must be >= 10, got {args.samples}")
    spec = constraint_spec(args)
    loaded = load_model(args.model, args.precision, args.backend)
    tok = loaded.tokenizer
    make = _audit_drafter(args, loaded)
    eos = tuple(sorted(set(tok.eos_ids) | set(loaded.model.cfg.eos_token_ids)))
    constraint = _bind(spec, loaded, eos)
    texts = [args.prompt] if args.prompt else list(AUDIT_PROMPTS)
    prompts = [tok.encode_prompt(tok.apply_chat_template([{"role": "user", "content": t}])
                          if tok.chat_template else t) for t in texts]
    print(f"# audit: {loaded.name} ({loaded.backend}, {loaded.precision}), drafter "
          f"{args.drafter}{' with fault ' + args.inject_fault if args.inject_fault else ''}, "
          f"k={args.k}, temperature {params.temperature}"
          f"{', constraint ' + spec.origin if spec else ''}", file=sys.stderr)
    if params.greedy:
        result = audit_greedy(loaded.model, prompts, params, make, args.k, eos, constraint)
    else:
        bar = tqdm(total=args.samples, desc="audit samples", file=sys.stderr)
        result = audit_sampled(loaded.model, prompts[0], params, make, args.k, args.samples,
                               args.tokens, args.false_alarm, seed=args.seed or 0, eos=eos,
                               progress=lambda n: bar.update(n - bar.n), constraint=constraint)
        bar.close()
    print(json.dumps(result.to_dict()) if args.json else result.render())
    return 0 if result.passed else 1


def cmd_costs(args: argparse.Namespace) -> int:
    from specdecode.costs import print_costs, run_costs

    batches = [int(b) for b in args.batches.split(",")]
    result = run_costs(args.model, args.precision, args.backend, args.context, args.kmax,
                       batches, args.repeats, compare_transformers=not args.no_peer)
    print_costs(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text (plain or speculative), streamed")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_model_args(g)
    add_sampling_args(g)
    add_drafter_args(g)
    add_constraint_args(g)
    g.set_defaults(func=cmd_generate)
    a = sub.add_parser("audit", help="losslessness audit of a configuration (exit 1 on FAIL)")
    a.add_argument("--prompt", default=None, help="prompt (default: a few built-in ones)")
    a.add_argument("--samples", type=int, default=300,
                   help="sampled mode: generations per side (default 300)")
    a.add_argument("--tokens", type=int, default=2, help="sampled mode: tokens per outcome")
    a.add_argument("--false-alarm", type=float, default=1e-3,
                   help="p-value below which the audit fails (its false-alarm rate)")
    a.add_argument("--inject-fault", default=None,
                   choices=["q-without-temperature", "top-p-one-side", "sampler-one-side",
                            "q-from-other-model"],
                   help="deliberately break the drafter to see the audit catch it")
    a.add_argument("--json", action="store_true")
    add_model_args(a)
    add_sampling_args(a)
    add_drafter_args(a)
    add_constraint_args(a)
    a.set_defaults(func=cmd_audit, max_tokens=32)
    c = sub.add_parser("costs", help="benchmark: forward cost vs positions scored, v(k)")
    add_model_args(c)
    c.add_argument("--context", type=int, default=512)
    c.add_argument("--kmax", type=int, default=16)
    c.add_argument("--batches", default="1,2,4,8")
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--no-peer", action="store_true", help="skip the transformers comparison")
    c.add_argument("--json", default=None, help="also write the results to this JSON file")
    c.set_defaults(func=cmd_costs)
    from specdecode.bench.commands import register as register_bench

    register_bench(sub)
    from specdecode.server.cli import register as register_serve

    register_serve(sub)
    from specdecode.train.cli import register as register_train

    register_train(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
