"""`specdecode train <what>`: the training commands, one entry per trainer.

To add a trainer, write `add_<what>_args(parser)` and `cmd_<what>(args) -> int` and add one
entry to SUBCOMMANDS: (help text, module path, argument-adder name, command name). Modules are
imported only when their command runs or its parser is built, so an entry costs nothing at start.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# name -> (help, module, function adding the arguments, function running the command)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "heads": ("train an EAGLE-style feature drafter on the frozen target",
              "specdecode.train.heads", "add_heads_args", "cmd_train_heads"),
    "draft": ("distil a small draft model from the frozen target (DistillSpec)",
              "specdecode.train.distill", "add_draft_args", "cmd_train_draft"),
}


def _entry(name: str, attr: int) -> Callable[..., Any]:
    module = importlib.import_module(SUBCOMMANDS[name][1])
    fn: Callable[..., Any] = getattr(module, SUBCOMMANDS[name][attr])
    return fn


def register(sub: Any) -> None:
    """Add `train` and its subcommands to the top-level subparsers `sub`."""
    p = sub.add_parser("train", help="train drafters on the target (heads, ...)")
    inner = p.add_subparsers(dest="train_command", required=True)
    for name, (help_text, _, _, _) in SUBCOMMANDS.items():
        q = inner.add_parser(name, help=help_text)
        _entry(name, 2)(q)
        q.set_defaults(func=_entry(name, 3))
