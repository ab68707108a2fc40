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
