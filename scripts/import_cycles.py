"""Report import cycles between the modules of the specdecode package.

Builds the module import graph from the source with `ast`, counting every import: at module
level, inside functions (the lazy imports that hide a cycle from Python's import machinery) and
under `if TYPE_CHECKING:`. `from package import name` counts as an import of the submodule
`package.name` when there is one, else of the package. Importing a module also runs its
package's __init__, but an edge to a parent package is not followed here (specdecode's
__init__ files import lazily or not at all), so a cycle reported is a cycle between modules.

Prints each strongly connected component of more than one module (every cycle lies inside one)
with one shortest cycle through it, and each edge of that cycle with the line that makes it.
Exit status 1 when a cycle exists, 0 otherwise.

    python scripts/import_cycles.py [src/specdecode]
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections import deque
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(current: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) import in module `current`."""
    if level == 0:
        return target or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def graph(root: Path) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """module -> {imported module: first line}, and module -> file, for modules under root."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    edges: dict[str, dict[str, int]] = {m: {} for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(mod, is_package, node.level, node.module)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                         for a in node.names]
            for name in names:
                while name and name not in files:  # `import a.b.c` of a name inside a module
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    edges[mod].setdefault(name, node.lineno)
    return edges, files


def components(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    out.append(sorted(members))
    return out


def shortest_cycle(edges: dict[str, dict[str, int]], members: list[str]) -> list[str]:
    """A shortest cycle through the component's members (breadth first from each)."""
    inside = set(members)
    best: list[str] = []
    for start in members:
        previous: dict[str, str] = {}
        queue = deque([start])
        found = False
        while queue and not found:
            node = queue.popleft()
            for child in edges[node]:
                if child not in inside:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    cycle = [*reversed(path), start]
                    if not best or len(cycle) < len(best):
                        best = cycle
                    found = True
                    break
                if child not in previous:
                    previous[child] = node
                    queue.append(child)
    return best


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "src" / \
        "specdecode"
    edges, files = graph(root)
    cycles = components(edges)
    count = sum(len(e) for e in edges.values())
    print(f"{len(files)} modules, {count} import edges (module level and inside functions)")
    if not cycles:
        print("no import cycles")
        return 0
    for members in cycles:
        print(f"\ncycle among {len(members)} modules: {', '.join(members)}")
        cycle = shortest_cycle(edges, members)
        for a, b in itertools.pairwise(cycle):
            line = edges[a][b]
            text = files[a].read_text(encoding="utf-8").splitlines()[line - 1].strip()
            print(f"  {a} -> {b}   ({files[a].relative_to(root.parent)}:{line}: {text})")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
