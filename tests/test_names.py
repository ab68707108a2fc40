"""Precisions and backends are records (models/precision.py, models/backends.py): no code outside
its module decides anything by a precision's or a backend's name. Outside models/precision.py no
comparison involves a precision name or a `precision` value (save two precisions compared with
each other), and no dict or subscript is keyed by a precision name; the same for backends outside
models/backends.py, and outside models/ no backend name is written at all. Drafters spelled like
precisions (`int8`, `w4a16`: the quantized copies) are compared through drafters.options's
constants, which say they are drafters.

The scanner finds each kind of use in a package made for the purpose (the broken variants), and
finds none in src/specdecode; a toy precision and a toy backend added in a test by their records
alone are loaded, listed, refused and named as the real ones are."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from specdecode.models import backends, precision

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "specdecode"
# Where precision names may be compared: their module, and the kernels, whose weight layouts
# ("f32", "bf16", "i8", ...) are kernel kinds, a few spelled like precisions (the precision
# records name which kernel paths run them, never the reverse).
PRECISION_MODULES = ("models/precision.py", "models/kernels.py")


def precision_names() -> set[str]:
    return {p.name for p in precision.PRECISIONS}


def backend_names() -> set[str]:
    return {n for b in backends.BACKENDS for n in (*b.names, *b.bench_aliases)} - \
        precision_names()


def _strings(node: ast.AST) -> list[str]:
    """The string constants `node` is, or holds as a tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _is_subject(node: ast.AST, word: str) -> bool:
    """A value named `word` (`precision`, `x.precision`, `target_precision`)."""
    if isinstance(node, ast.Name):
        return node.id == word or node.id.endswith(f"_{word}")
    return isinstance(node, ast.Attribute) and node.attr == word


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.body and isinstance(node.body[0], ast.Expr):
            found.add(id(node.body[0].value))
    return found


def uses(tree: ast.AST, names: set[str], word: str) -> Iterator[tuple[int, str]]:
    """(line, what) of every place in `tree` that decides by one of `names`: a comparison with
    one (or with a collection holding one), a comparison of a `word` value with anything but
    another `word` value, a dict key or a subscript that is one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            subjects = [o for o in operands if _is_subject(o, word)]
            if any(s in names for o in operands for s in _strings(o)) or \
                    0 < len(subjects) < len(operands):
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Dict):
            if any(s in names for k in node.keys if k is not None for s in _strings(k)):
                yield node.lineno, "a dict keyed by a name"
        elif isinstance(node, ast.Subscript) and any(s in names for s in _strings(node.slice)):
            yield node.lineno, ast.unparse(node)


def literals(tree: ast.AST, names: set[str]) -> Iterator[tuple[int, str]]:
    """(line, name) of every string constant that is one of `names`, docstrings aside."""
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value in names and id(node) not in skip:
            yield node.lineno, node.value


def violations(package: Path) -> list[str]:
    """Every use of a precision or backend name outside the module it belongs to."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        here: list[tuple[int, str]] = []
        if rel not in PRECISION_MODULES:
            here += [(n, f"precision: {what}")
                     for n, what in uses(tree, precision_names(), "precision")]
        if rel != "models/backends.py":
            here += [(n, f"backend: {what}") for n, what in uses(tree, backend_names(), "backend")]
        if not rel.startswith("models/"):
            here += [(n, f"backend name {what!r} outside models/")
                     for n, what in literals(tree, backend_names())]
        found += [f"{rel}:{n}: {what}" for n, what in sorted(here)]
    return found


def test_no_precision_or_backend_name_decides_anything_outside_its_module() -> None:
    assert violations(PACKAGE) == []


def test_each_kind_of_name_use_is_found(tmp_path: Path) -> None:
    """Broken variants: each way the code keyed on names before #43 (llama.py's
    `precision == "checkpoint"`, the registry's `{"int8": why}`, report_html's
    `spec.precision == "gguf"`, plan's `backend in ("auto", "native")`, targets' `load_model(...,
    "native")`, `args.precision != AUTO`), in a package made for the purpose, is reported; the
    same in its own module, two precisions compared, and a drafter constant are not."""
    (tmp_path / "models").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "models" / "llama.py").write_text(
        'def f(precision):\n    return precision == "checkpoint"\n')
    (tmp_path / "models" / "precision.py").write_text(
        'def f(precision):\n    return precision == "checkpoint"\n')
    (tmp_path / "models" / "backends.py").write_text('def f(b):\n    return b == "native"\n')
    (tmp_path / "bench" / "plan.py").write_text(
        'WHY = {"int8": "coupled"}\n'
        'def f(spec, backend, args, a, b):\n'
        '    x = spec.precision == "gguf"\n'
        '    y = backend in ("auto", "native")\n'
        '    z = args.precision != AUTO\n'
        '    same = a.precision == b.precision\n'
        '    copy = spec.drafter == INT8_COPY\n'
        '    return load_model(None, "fp32", "native")\n')
    assert violations(tmp_path) == [
        "bench/plan.py:1: precision: a dict keyed by a name",
        "bench/plan.py:3: precision: spec.precision == 'gguf'",
        "bench/plan.py:4: backend name 'native' outside models/",
        "bench/plan.py:4: backend: backend in ('auto', 'native')",
        "bench/plan.py:5: precision: args.precision != AUTO",
        "bench/plan.py:8: backend name 'native' outside models/",
        "models/llama.py:2: precision: precision == 'checkpoint'"]


def controller_builders(package: Path) -> list[str]:
    """Every module outside control.py that constructs a control.Controller itself."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = node.func if isinstance(node, ast.Call) else None
            name = getattr(func, "id", None) or getattr(func, "attr", None)
            if name == "Controller" and rel != "control.py":
                found.append(f"{rel}:{node.lineno}")
    return found


def test_one_place_builds_the_controller(tmp_path: Path) -> None:
    """control.auto_controller is the one way a front end gets a controller (the API, serve and
    bench built theirs by hand); a front end building its own is found."""
    assert controller_builders(PACKAGE) == []
    (tmp_path / "api.py").write_text("def f(c):\n    return c.Controller(kmax=3)\n")
    (tmp_path / "control.py").write_text("def g():\n    return Controller(kmax=3)\n")
    assert controller_builders(tmp_path) == ["api.py:2"]


def logits_for_decoders(package: Path) -> list[str]:
    """Every comparison of a `logits_for` value outside models/logits_for.py: a backend that
    decodes Target.__call__'s logits_for itself instead of calling logit_positions."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "models/logits_for.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(
                    _is_subject(o, "logits_for") for o in [node.left, *node.comparators]):
                found.append(f"{rel}:{node.lineno}")
    return found


def test_one_decoder_for_logits_for(tmp_path: Path) -> None:
    """models.logits_for decodes "all"/"last"/"none"/indices for every backend (four backends
    decoded it each, the llama.cpp one twice); a backend comparing it itself is found."""
    assert logits_for_decoders(PACKAGE) == []
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "llamacpp.py").write_text(
        'def f(logits_for):\n    return 1 if logits_for == "last" else 2\n')
    (tmp_path / "models" / "logits_for.py").write_text(
        'def g(logits_for):\n    return logits_for == "all"\n')
    assert logits_for_decoders(tmp_path) == ["models/llamacpp.py:2"]
