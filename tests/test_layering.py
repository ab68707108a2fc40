"""No import cycles between specdecode's modules (scripts/import_cycles.py, which counts the
imports inside functions too), and the checker finds a cycle where there is one."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_cycles",
                                                  ROOT / "scripts" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_cycles() -> None:
    ic = checker()
    edges, files = ic.graph(ROOT / "src" / "specdecode")
    assert "specdecode.engine" in files and edges["specdecode.engine"]
    assert ic.components(edges) == []


def test_a_cycle_through_a_lazy_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    ic = checker()
    edges, _ = ic.graph(pkg)
    assert ic.components(edges) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert ic.shortest_cycle(edges, ["pkg.a", "pkg.b", "pkg.c"]) == [
        "pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert ic.main(["import_cycles", str(pkg)]) == 1


# The picture of the code (docs/design.md, "Where the code is"): a module may not import, directly
# or through any chain of imports (lazy ones and those under TYPE_CHECKING included), a module
# the picture puts above it. (package, modules it may not reach, why)
RULES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("calibration", ("control", "engine", "drafters", "bench", "server", "cli", "api"),
     "calibration sits at the bottom: the controller is built from its figures"),
    ("calibration_cache", ("control", "engine", "drafters", "bench", "server", "cli", "api"),
     "the calibration cache stores calibration's figures, below the controller and the bench"),
    ("drafters", ("control", "trees", "engine", "calibration", "audit", "bench", "server",
                  "train.heads", "train.distill", "cli", "api"),
     "drafters sit below the engine and the trainers, whose checkpoint cards they read"),
    ("models", ("drafters", "engine", "control", "trees", "verify", "sampling", "suffix",
                "constraints", "calibration", "audit", "bench", "server", "train", "cli", "api"),
     "models know nothing of speculation"),
    ("train", ("cli", "api", "bench", "server"), "training sits below the command line"),
    ("api", ("cli",), "the command line builds on the API, not the reverse"),
    ("machine", ("bench",), "the machine's description is below the reports that state it"),
)


def violations(edges: dict[str, dict[str, int]], package: str,
               rules: tuple[tuple[str, tuple[str, ...], str], ...]) -> list[str]:
    """For each rule, every module of its package that reaches a forbidden one, with the chain."""

    def inside(module: str, name: str) -> bool:
        full = f"{package}.{name}"
        return module == full or module.startswith(full + ".")

    found = []
    for lower, upper, why in rules:
        for start in (m for m in edges if inside(m, lower)):
            chain = {start: [start]}
            todo = [start]
            while todo:
                here = todo.pop()
                for nxt in edges.get(here, {}):
                    if nxt not in chain:
                        chain[nxt] = [*chain[here], nxt]
                        todo.append(nxt)
            for reached, path in sorted(chain.items()):
                if any(inside(reached, name) for name in upper):
                    found.append(f"{' -> '.join(path)} ({why})")
    return found


def test_no_module_imports_across_the_layers_above_it() -> None:
    edges, _ = checker().graph(ROOT / "src" / "specdecode")
    assert violations(edges, "specdecode", RULES) == []


def test_an_import_across_a_layer_is_found_through_a_chain(tmp_path: Path) -> None:
    """Broken variant: the runner reaching the suffix store through a helper (models/llama.py
    -> memory.py -> suffix.py, as it did before issue 33), and a drafter importing the
    controller directly, are each reported with the chain that makes them."""
    pkg = tmp_path / "pkg"
    (pkg / "models").mkdir(parents=True)
    (pkg / "drafters").mkdir()
    for folder in (pkg, pkg / "models", pkg / "drafters"):
        (folder / "__init__.py").write_text("")
    (pkg / "models" / "llama.py").write_text("def f():\n    from pkg.memory import g\n")
    (pkg / "memory.py").write_text("from pkg.suffix import Store\n")
    (pkg / "suffix.py").write_text("class Store: ...\n")
    (pkg / "control.py").write_text("")
    (pkg / "drafters" / "hybrid.py").write_text("from pkg.control import x\n")
    edges, _ = checker().graph(pkg)
    assert violations(edges, "pkg", RULES) == [
        "pkg.drafters.hybrid -> pkg.control (drafters sit below the engine and the trainers, "
        "whose checkpoint cards they read)",
        "pkg.models.llama -> pkg.memory -> pkg.suffix (models know nothing of speculation)"]
