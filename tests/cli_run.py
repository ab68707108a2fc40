"""Run the `specdecode` command line in this process, as a subprocess would see it: the exit
status (argparse's usage errors included) and what it printed to stdout and stderr."""

from __future__ import annotations

import io
from collections.abc import Sequence
from contextlib import redirect_stderr, redirect_stdout

from specdecode.cli import main


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `specdecode *argv`."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()
