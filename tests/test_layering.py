"""No import cycles between specdecode's modules (scripts/import_cycles.py, which counts the
imports inside functions too), and the checker finds a cycle where there is one."""

from __future__ import annotations

import importlib.util
import sys
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


def layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layers", ROOT / "scripts" / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["layers"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# The picture of the code is scripts/layers.py's LAYERS, from which docs/design.md's list is
# rendered: a module may import, lazily or not, under TYPE_CHECKING or not, only modules of its
# own layer or of those below; every module sits in exactly one layer; no exceptions.


def test_every_module_sits_in_one_layer_and_imports_none_above_it() -> None:
    edges, files = checker().graph(ROOT / "src" / "specdecode")
    assert len(files) > 100
    assert layers().violations(edges, "specdecode") == []


def test_design_md_shows_the_layers_of_scripts_layers_py() -> None:
    ly = layers()
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert ly.design_section(text) == ly.render()
    assert all(f"**{layer.name}**" in text for layer in ly.LAYERS)


def test_an_import_across_a_layer_and_an_unplaced_module_are_found(tmp_path: Path) -> None:
    """Broken variants: the runner reaching the suffix store through a helper (models/llama.py
    -> memory.py -> suffix.py, as it did before issue 33: memory, beside the models, imports a
    layer above), a drafter importing the controller, a drafter reading the trainers' cards
    (the exception the rules had before issue 43), and a module the picture does not place,
    are each reported."""
    pkg = tmp_path / "pkg"
    for folder in (pkg, pkg / "models", pkg / "drafters", pkg / "train"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    (pkg / "models" / "llama.py").write_text("def f():\n    from pkg.memory import g\n")
    (pkg / "memory.py").write_text("from pkg.suffix import Store\n")
    (pkg / "suffix.py").write_text("class Store: ...\n")
    (pkg / "control.py").write_text("")
    (pkg / "train" / "checkpoint.py").write_text("")
    (pkg / "drafters" / "hybrid.py").write_text("from pkg.control import x\n")
    (pkg / "drafters" / "heads.py").write_text(
        "def f():\n    from pkg.train.checkpoint import read_card\n")
    (pkg / "stray.py").write_text("")
    edges, _ = checker().graph(pkg)
    assert layers().violations(edges, "pkg") == [
        "pkg.stray: in 0 layers (none)",
        "pkg.drafters.heads (drafters) imports pkg.train.checkpoint (training, above) at line 2",
        "pkg.drafters.hybrid (drafters) imports pkg.control (control, above) at line 1",
        "pkg.memory (targets) imports pkg.suffix (speculation arithmetic, above) at line 1"]
