"""`specdecode costs`: the forward cost against positions scored, v(k), per batch size."""

from __future__ import annotations

import argparse
import json
from typing import Any

from specdecode.cli.args import add_model_args


def register(sub: Any) -> None:
    """Add `costs` to the CLI's subparsers."""
    c = sub.add_parser("costs", help="benchmark: forward cost vs positions scored, v(k)")
    add_model_args(c)
    c.add_argument("--context", type=int, default=512)
    c.add_argument("--kmax", type=int, default=16)
    c.add_argument("--batches", default="1,2,4,8")
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--no-peer", action="store_true", help="skip the transformers comparison")
    c.add_argument("--json", default=None, help="also write the results to this JSON file")
    c.set_defaults(func=cmd_costs)


def cmd_costs(args: argparse.Namespace) -> int:
    from specdecode.bench.costs import print_costs, run_costs

    batches = [int(b) for b in args.batches.split(",")]
    result = run_costs(args.model, args.precision, args.backend, args.context, args.kmax,
                       batches, args.repeats, compare_transformers=not args.no_peer)
    print_costs(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0
