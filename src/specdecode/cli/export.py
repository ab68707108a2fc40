"""`specdecode export`: the distilled draft as a GGUF for llama.cpp (drafters.distilled_gguf).

`--drafter distilled --backend llama.cpp` exports it on first use into the cache; this command
does the same ahead of time, or writes it where `--out` says (e.g. a full-vocabulary GGUF for
llama.cpp's own tools), and prints the path.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    """Add `export` to the CLI's subparsers (the choices are checked by the exporter, which
    imports torch: not at parser build time)."""
    e = sub.add_parser("export", help="write the distilled draft as a GGUF for llama.cpp")
    e.add_argument("--distilled", default=None,
                   help="the distilled draft's folder (default: the one shipped for SmolLM2)")
    e.add_argument("--model", default=None,
                   help="the target .gguf the draft was trained for (default: SmolLM2's)")
    e.add_argument("--type", default="q8_0",
                   help="the draft blocks' weight type: f32 | f16 | q8_0 | q4_0 (default q8_0)")
    e.add_argument("--head", default="subset",
                   help="subset (default): the draft's reduced vocabulary, a GGUF plus an "
                        ".embed.safetensors sidecar, for this package's llama.cpp backend; "
                        "full: one plain GGUF with the target's vocabulary")
    e.add_argument("--out", type=Path, default=None,
                   help="the .gguf to write (default: the cache, as --drafter distilled uses)")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from specdecode.drafters.distilled import DEFAULT_DIR
    from specdecode.drafters.distilled_gguf import cached_export, export_distilled_gguf
    from specdecode.errors import SpecDecodeError
    from specdecode.models.loading import default_model_path

    folder = Path(args.distilled).expanduser() if args.distilled else DEFAULT_DIR
    target = Path(args.model).expanduser() if args.model else default_model_path()
    if target.suffix != ".gguf":
        raise SpecDecodeError(f"{target}: --model must be the target's .gguf file")
    if args.out is None:
        path = cached_export(folder, target, weight_type=args.type, head=args.head)
    else:
        if args.out.suffix != ".gguf":
            raise SpecDecodeError(f"{args.out}: --out must end in .gguf")
        path = export_distilled_gguf(folder, target, args.out, weight_type=args.type,
                                     head=args.head)
    print(path)
    return 0
