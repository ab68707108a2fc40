"""The `specdecode` command line. Every user error is one line on stderr and exit status 2.

One module per subcommand, each with `register(subparsers)` and its `cmd_*` function:
`generate`, `audit`, `costs`, `bench`, `compare`, `tune`, `serve`, `train`, `export`,
`models`. `args`
holds the argument groups and checks they share (the draft-length range is `limits.MAX_K`). The
subcommand modules are imported when the parser is built, and each imports its heavy
dependencies (torch, the server's packages) only when its command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdecode.cli.args import apply_threads
from specdecode.errors import SpecDecodeError

DESCRIPTION = "The `specdecode` command line. Every user error is one line on stderr and exit " \
    "status 2."


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (each sets `func`, the function that runs it)."""
    from specdecode.cli import (
        audit,
        bench,
        compare,
        costs,
        export,
        generate,
        models,
        serve,
        train,
        tune,
    )

    parser = argparse.ArgumentParser(prog="specdecode", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (generate, audit, costs, bench, compare, tune, serve, train, export,
                   models):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on `argv` (default: sys.argv); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        apply_threads(args)
        return int(args.func(args))
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130
