"""`specdecode generate`: one prompt, plain or speculative, streamed (or one JSON object): the
Python API's `Specdecode.start` on the flags."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specdecode.cli.args import (
    add_constraint_args,
    add_drafter_args,
    add_model_args,
    add_sampling_args,
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
    """Stream the text (or print one JSON object): the Python API's generate, on the flags'
    model, drafter and sampling options."""
    import torch

    from specdecode.api import Specdecode

    params = sampling_params(args)
    options = drafter_options(args)
    spec = constraint_spec(args)
    sd = Specdecode(args.model, precision=args.precision, drafter=options, backend=args.backend)
    stream = sd.start(args.prompt, params, chat=args.chat, constraint=spec)
    for piece in stream:
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    result = stream.result
    assert result is not None
    if not args.json:
        sys.stdout.write("\n")
        return 0
    record = {
        "text": result.text, "token_ids": result.tokens, "finish_reason": result.finish_reason,
        "seed": result.seed, "rule": params.rule, "model": sd.loaded.describe(),
        "exactness": sd.loaded.verdict().as_dict(),  # passed its check, or allowed inexact
        "drafter": options.name, "k": "auto" if options.auto else sd.k,
        "drafter_choice": sd.drafter_choice,  # ngram+auto: what it measured and chose
        "threads": torch.get_num_threads(),
        "timings": {"load_s": sd.loaded.load_seconds, "ttft_s": result.ttft_s,
                    "total_s": result.total_s, "tokens_per_s": result.tokens_per_s},
        "counters": result.counters.to_dict(),
    }
    print(json.dumps(record))
    return 0
