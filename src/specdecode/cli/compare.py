"""`specdecode compare OLD NEW`: what changed between two bench reports, beyond noise, and
whether a tuning is stale (`report.compare`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdecode.errors import SpecDecodeError


def register(sub: Any) -> None:
    """Add `compare` to the CLI's subparsers."""
    c = sub.add_parser("compare", help="what changed between two bench reports (beyond noise)")
    c.add_argument("old", help="OLD report.json, results.jsonl or run folder")
    c.add_argument("new", help="NEW report.json, results.jsonl or run folder")
    c.add_argument("--json", default=None, help="also write the comparison to this file")
    c.add_argument("--resamples", type=int, default=None, help="bootstrap resamples")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_compare)


def resolve_report(path: str) -> Path:
    """A report path as given, or the report.json (else results.jsonl) of a run folder."""
    p = Path(path)
    if p.is_dir():
        for name in ("report.json", "results.jsonl"):
            if (p / name).exists():
                return p / name
        raise SpecDecodeError(f"{p} holds no report.json or results.jsonl")
    return p


def cmd_compare(args: argparse.Namespace) -> int:
    """Print the changes beyond noise (and write them to --json)."""
    from specdecode.report.analysis import DEFAULT_RESAMPLES
    from specdecode.report.compare import compare

    result = compare(resolve_report(args.old), resolve_report(args.new),
                     n_resamples=args.resamples or DEFAULT_RESAMPLES, seed=args.seed)
    print(result.render(), file=sys.stdout)
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1), encoding="utf-8")
    return 0
