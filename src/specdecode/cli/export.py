"""`specdecode export`: the distilled draft as a GGUF for llama.cpp (drafters.distilled_gguf) or
as a Hugging Face folder for vLLM's `draft_model` and transformers (drafters.distilled_hf).

`--drafter distilled --backend llama.cpp` exports the GGUF on first use into the cache, and the
`distilled` vLLM configuration the HF folder; this command does the same ahead of time, or writes
it where `--out` says (e.g. a full-vocabulary GGUF for llama.cpp's own tools), and prints the
path.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

FORMATS = ("gguf", "hf")


def register(sub: Any) -> None:
    """Add `export` to the CLI's subparsers (the choices are checked by the exporter, which
    imports torch: not at parser build time)."""
    e = sub.add_parser("export", help="write the distilled draft as a GGUF for llama.cpp or as "
                                      "a Hugging Face folder for vLLM")
    e.add_argument("--distilled", default=None,
                   help="the distilled draft's folder (default: the one shipped for SmolLM2)")
    e.add_argument("--model", default=None,
                   help="the target .gguf the draft was trained for (default: SmolLM2's)")
    e.add_argument("--format", default="gguf",
                   help="gguf (default): for llama.cpp; hf: a Hugging Face folder "
                        "(LlamaForCausalLM, fp32, the target's tokenizer) for vLLM's "
                        "draft_model or transformers")
    e.add_argument("--type", default=None,
                   help="gguf: the draft blocks' weight type: f32 | f16 | q8_0 | q4_0 "
                        "(default q8_0)")
    e.add_argument("--head", default=None,
                   help="gguf: subset (default): the draft's reduced vocabulary, a GGUF plus an "
                        ".embed.safetensors sidecar, for this package's llama.cpp backend; "
                        "full: one plain GGUF with the target's vocabulary")
    e.add_argument("--out", type=Path, default=None,
                   help="the .gguf (or, with --format hf, the folder) to write (default: the "
                        "cache, as --drafter distilled and the vLLM configuration use)")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from specdecode.drafters.distilled import DEFAULT_DIR
    from specdecode.drafters.distilled_gguf import (
        DEFAULT_HEAD,
        DEFAULT_WEIGHT_TYPE,
        cached_export,
        export_distilled_gguf,
    )
    from specdecode.errors import SpecDecodeError
    from specdecode.models.paths import default_model_path

    folder = Path(args.distilled).expanduser() if args.distilled else DEFAULT_DIR
    target = Path(args.model).expanduser() if args.model else default_model_path()
    if target.suffix != ".gguf":
        raise SpecDecodeError(f"{target}: --model must be the target's .gguf file")
    if args.format not in FORMATS:
        raise SpecDecodeError(f"--format {args.format!r}: one of {', '.join(FORMATS)}")
    if args.format == "hf":
        return _export_hf(args, folder, target)
    weight_type = args.type or DEFAULT_WEIGHT_TYPE
    head = args.head or DEFAULT_HEAD
    if args.out is None:
        path = cached_export(folder, target, weight_type=weight_type, head=head)
    else:
        if args.out.suffix != ".gguf":
            raise SpecDecodeError(f"{args.out}: --out must end in .gguf")
        path = export_distilled_gguf(folder, target, args.out, weight_type=weight_type,
                                     head=head)
    print(path)
    return 0


def _export_hf(args: argparse.Namespace, folder: Path, target: Path) -> int:
    from specdecode.drafters.distilled_hf import cached_hf_export, export_distilled_hf
    from specdecode.errors import SpecDecodeError

    given = [flag for flag, value in (("--type", args.type), ("--head", args.head)) if value]
    if given:  # the HF folder is fp32 with the full head: nothing for these to choose
        raise SpecDecodeError(f"{' and '.join(given)}: GGUF options; --format hf writes fp32 "
                              "weights and the target's full-vocabulary head")
    if args.out is None:
        path = cached_hf_export(folder, target)
    else:
        if args.out.suffix or (args.out.exists() and not args.out.is_dir()):
            raise SpecDecodeError(f"{args.out}: --out must be a folder with --format hf")
        path = export_distilled_hf(folder, target, args.out)
    print(path)
    return 0
