"""`specdecode train <what>`: the training commands, one entry per trainer (train.heads,
train.distill). The trainers know nothing of the command line: their flags, and the commands
that turn flags into a trainer's config and run it, are here.

To add a trainer, write `add_<what>_args(parser)` and `cmd_<what>(args) -> int` here and add one
entry to SUBCOMMANDS. The trainers' modules (and torch) are imported only when a parser is built
or a command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.models.precision import REFERENCE, speculative_names

if TYPE_CHECKING:
    from specdecode.train.distill import DistillConfig


def add_train_args(p: argparse.ArgumentParser, default_out: str) -> None:
    """Options every trainer takes: target, corpus, steps, output folder, resume, seed, threads."""
    p.add_argument("--model", default=None,
                   help="target checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", action="append", default=None, metavar="PATH",
                   help="training text: a file or folder (.html stripped, .py, .txt, ...); "
                        "repeatable (default: python3.11-doc HTML if installed, else the "
                        "standard-library source)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--out", default=default_out, help=f"output folder (default {default_out})")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice; 1 on a shared machine)")


def add_heads_args(p: argparse.ArgumentParser) -> None:
    from specdecode.train.heads import HeadsTrainConfig

    add_train_args(p, "runs/heads")
    d = HeadsTrainConfig()
    p.add_argument("--tokens", type=int, default=d.train_tokens,
                   help=f"training tokens (target features extracted once; default "
                        f"{d.train_tokens})")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="size of the draft's vocabulary: the most frequent corpus tokens")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--precision", default=REFERENCE.name,
                   help="the target's precision the heads draft for "
                        f"({', '.join(speculative_names())}: its features and its head; heads "
                        "are refused on any other)")


def cmd_train_heads(args: argparse.Namespace) -> int:
    import torch

    from specdecode.models.backends import NATIVE, load_model
    from specdecode.train.heads import HeadsTrainConfig, train_heads

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    d = HeadsTrainConfig()
    cfg = dataclasses.replace(
        d, steps=args.steps or d.steps, train_tokens=args.tokens, seq_len=args.seq_len,
        batch=args.batch, lr=args.lr, draft_vocab=args.draft_vocab,
        checkpoint_every=args.checkpoint_every, seed=args.seed)
    loaded = load_model(args.model, args.precision, NATIVE.name)
    recipe = "specdecode " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["train"] else \
        "specdecode train heads " + shlex.join(_argv_of(args))
    result = train_heads(loaded, args.corpus, cfg, Path(args.out), args.resume, True, recipe)
    alpha = ", ".join(f"{a:.3f}" for a in result.alpha["agreement"])
    before = ", ".join(f"{a:.3f}" for a in result.alpha_untrained["agreement"])
    print(f"heads written to {result.out_dir}: {result.steps} steps in {result.seconds:.0f} s; "
          f"held-out alpha per position {alpha} (untrained {before})")
    return 0


def _argv_of(args: argparse.Namespace) -> list[str]:
    out = [f"--steps={args.steps}", f"--out={args.out}", f"--seed={args.seed}",
           f"--precision={args.precision}"]
    return out + [f"--corpus={c}" for c in args.corpus or []]


def add_draft_args(p: argparse.ArgumentParser) -> None:
    from specdecode.train.distill import DEFAULT_OUT, DistillConfig

    add_train_args(p, DEFAULT_OUT)
    d = DistillConfig()
    p.add_argument("--layers", type=int, default=d.layers,
                   help=f"draft blocks (default {d.layers})")
    p.add_argument("--init", default=d.init,
                   help="spaced | first: start from evenly spaced blocks of the target (first and "
                        f"last included) or its first blocks (default {d.init})")
    p.add_argument("--vocab", type=int, default=d.vocab,
                   help="tokens the draft's head scores, the lowest ids; 0 = all "
                        f"(default {d.vocab})")
    p.add_argument("--loss", default=d.loss, help=f"fkl | tvd (default {d.loss})")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--corpus-tokens", type=int, default=d.corpus_tokens,
                   help=f"training tokens read from the corpus (default {d.corpus_tokens})")


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    from specdecode.train.distill import DistillConfig

    d = DistillConfig()
    return DistillConfig(
        layers=args.layers, init=args.init, vocab=args.vocab, loss=args.loss,
        steps=args.steps if args.steps is not None else d.steps, batch=args.batch,
        seq_len=args.seq_len, lr=args.lr, seed=args.seed, corpus_tokens=args.corpus_tokens,
    )


def cmd_train_draft(args: argparse.Namespace) -> int:
    import torch

    from specdecode.models.backends import load_model
    from specdecode.train.distill import distill

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    cfg.check()
    loaded = load_model(args.model)
    out = Path(args.out)
    recipe = shlex.join(["specdecode", *sys.argv[1:]])
    card = distill(loaded.model, loaded.tokenizer, args.corpus, cfg, out, resume=args.resume,
                   target_name=loaded.name, recipe=recipe)
    print(f"held-out alpha {card['heldout_alpha_before']:.3f} -> {card['heldout_alpha']:.3f}, "
          f"agreement {card['heldout_agreement_before']:.3f} -> {card['heldout_agreement']:.3f} "
          f"({card['train_seconds']:.0f} s); draft written to {out}")
    return 0


# name -> (help, function adding the arguments, function running the command)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {
    "heads": ("train an EAGLE-style feature drafter on the frozen target", add_heads_args,
              cmd_train_heads),
    "draft": ("distil a small draft model from the frozen target (DistillSpec)", add_draft_args,
              cmd_train_draft),
}


def register(sub: Any) -> None:
    """Add `train` and its subcommands to the top-level subparsers `sub`."""
    p = sub.add_parser("train", help="train drafters on the target (heads, ...)")
    inner = p.add_subparsers(dest="train_command", required=True)
    for name, (help_text, add_args, command) in SUBCOMMANDS.items():
        q = inner.add_parser(name, help=help_text)
        add_args(q)
        q.set_defaults(func=command)
