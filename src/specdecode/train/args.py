"""The options every trainer's command takes (`specdecode train heads`, `train draft`). Here, in
the trainers' package, so that training imports nothing of the command line (cli.train builds
the `train` parser from the trainers, not the reverse)."""

from __future__ import annotations

import argparse


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
