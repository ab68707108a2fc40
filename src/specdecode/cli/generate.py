"""`specdecode generate`: one prompt, plain or speculative, streamed (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

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


def register(sub: Any) -> None:
    """Add `generate` to the CLI's subparsers."""
    g = sub.add_parser("generate", help="generate text (plain or speculative), streamed")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_model_args(g)
    add_sampling_args(g)
    add_drafter_args(g)
    add_constraint_args(g)
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from specdecode.api import auto_steps
    from specdecode.drafters.registry import drafter_factory
    from specdecode.engine import Generation
    from specdecode.models.loading import load_model

    params = sampling_params(args)
    options = drafter_options(args)
    spec = constraint_spec(args)
    loaded = load_model(args.model, args.precision, args.backend)
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    factory = drafter_factory(options, loaded.model, tokenizer=tok)
    eos = tuple(sorted(set(tok.eos_ids) | set(loaded.model.cfg.eos_token_ids)))
    gen = Generation(loaded.model, tok, tok.encode_prompt(text), params,
                     factory() if factory else None, options.draft_length, eos,
                     constraint=bind_constraint(spec, loaded, eos))
    steps = auto_steps(loaded, gen, options.max_step_cost) if options.auto and factory else \
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
            "seed": gen.seed, "rule": params.rule, "model": loaded.describe(),
            "drafter": args.drafter,
            "k": "auto" if options.auto else gen.k,
            "threads": torch.get_num_threads(),
            "timings": {"load_s": loaded.load_seconds, "ttft_s": first, "total_s": total,
                        "tokens_per_s": len(gen.output) / total if total else None},
            "counters": gen.counters.to_dict(),
        }
        print(json.dumps(record))
    else:
        sys.stdout.write("\n")
    return 0
