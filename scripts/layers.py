"""The layers of the specdecode package: the one picture of the code. tests/test_layering.py checks
the package against it (every module in exactly one layer; no import, lazy or under
TYPE_CHECKING, reaches a layer above its own), and docs/design.md's "Where the code is" list is
rendered from it (`python scripts/layers.py --write`; `--check` exits 1 where they differ or an
import crosses upward). There are no exceptions: a module that needs one belongs elsewhere.

    python scripts/layers.py [--check | --write] [src/specdecode]
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
BEGIN = "<!-- layers: rendered from scripts/layers.py (python scripts/layers.py --write) -->"
END = "<!-- /layers -->"


@dataclass(frozen=True)
class Layer:
    """A layer: its name, why it sits where it does, and its parts (a module or a subpackage of
    specdecode, with what it is; "" is the package's own __init__)."""

    name: str
    why: str
    parts: tuple[tuple[str, str], ...]


# From the bottom up: a module may import its own layer and those below, never one above.
LAYERS: tuple[Layer, ...] = (
    Layer("foundations", "plain values and arithmetic that import nothing of the package", (
        ("errors", "SpecDecodeError, the one error a user sees"),
        ("limits", "MAX_K and the other shared bounds"),
        ("counters", "the engine's integer counters"),
        ("acceptance", "expected accepted tokens of a draft with confidences"),
        ("audit_stats", "the audits' statistics"),
        ("stopping", "stop strings"),
        ("machine", "the machine's description"),
        ("version", "the package's version"),
        ("files", "writing a file atomically"),
    )),
    Layer("targets", "the models whose output is kept; they know nothing of speculation", (
        ("models", "the Target and Cache protocols, one record per precision and per backend, "
                   "the runners, KV caches, checkpoints and their loading, the identity of a "
                   "target and the cards of weights made for it"),
        ("memory", "bytes of weights and caches"),
    )),
    Layer("figures of a target", "what is measured of a target before anything speculates", (
        ("calibration", "t(B, T) measured at run time"),
        ("calibration_cache", "those figures cached per model, precision, backend and machine"),
        ("agreement", "a target's top-1 agreement and KL with another"),
    )),
    Layer("speculation arithmetic", "distributions, verification and lookups, without a model", (
        ("sampling", "the one pipeline from logits to p and q, and the position-keyed noise"),
        ("verify", "the verifiers: greedy, invariant, residual, chains and trees"),
        ("constraints", "structured output's masks"),
        ("suffix", "the suffix store of earlier requests"),
    )),
    Layer("drafters", "what proposes tokens; below the controller and the loop that run them", (
        ("drafters", "DrafterOptions, the Drafter interface, every drafter, the registry"),
    )),
    Layer("control", "the controller: how much to draft, from the figures measured below", (
        ("control", "the Controller, pure Python"),
    )),
    Layer("the loop", "a speculative step: propose, score, verify, commit, observe", (
        ("engine", "Generation and BatchEngine"),
        ("trees", "token trees' layouts and budgets"),
        ("verification", "which verifier a step runs"),
        ("audit", "the losslessness audit"),
    )),
    Layer("training", "trainers of heads and drafts: below everything that measures or serves", (
        ("train", "heads and distilled drafts, their corpora and checkpoints"),
    )),
    Layer("measuring and serving", "what runs the loop for a user's workload or traffic", (
        ("bench", "the benchmark's measuring: options, plans, workloads, runners in process "
                  "and over HTTP, the harness, the results file"),
        ("report", "the benchmark's reporting: analysis, recommendation, summary, the HTML "
                   "report and its figures"),
        ("server", "the OpenAI-compatible server"),
        ("integrations", "this project's drafters inside vLLM"),
    )),
    Layer("the Python API", "specdecode.load, on everything below", (
        ("api", "Specdecode: load, generate, stream, bench"),
        ("", "the package itself: `import specdecode` gives `specdecode.load`"),
    )),
    Layer("the command line", "one module per subcommand, on the API", (
        ("cli", "the subcommands and the argument groups they share"),
    )),
)


def part_name(module: str, package: str) -> str:
    """The part of `package` a module belongs to: its first name below the package."""
    rest = module.removeprefix(package).lstrip(".")
    return rest.split(".", 1)[0]


def placements(modules: list[str], package: str, layers: tuple[Layer, ...] = LAYERS
               ) -> tuple[dict[str, int], list[str]]:
    """Each module's layer (index into `layers`), and the modules in no layer or in several."""
    where: dict[str, int] = {}
    problems = []
    for module in modules:
        found = [i for i, layer in enumerate(layers)
                 if part_name(module, package) in (p for p, _ in layer.parts)]
        if len(found) == 1:
            where[module] = found[0]
        else:
            named = ", ".join(layers[i].name for i in found) or "none"
            problems.append(f"{module}: in {len(found)} layers ({named})")
    return where, problems


def violations(edges: dict[str, dict[str, int]], package: str,
               layers: tuple[Layer, ...] = LAYERS) -> list[str]:
    """Every module in no layer or several, and every import of a module of a higher layer
    (with its line): one upward import is enough to break the picture, so direct imports are
    the whole check."""
    where, problems = placements(sorted(edges), package, layers)
    for module, imported in sorted(edges.items()):
        for target, line in sorted(imported.items()):
            if module in where and target in where and where[target] > where[module]:
                problems.append(f"{module} ({layers[where[module]].name}) imports {target} "
                                f"({layers[where[target]].name}, above) at line {line}")
    return problems


def render(layers: tuple[Layer, ...] = LAYERS) -> str:
    """docs/design.md's list of the layers, from the bottom up."""
    lines = [BEGIN, ""]
    for n, layer in enumerate(layers, 1):
        parts = "; ".join(f"`{p or 'specdecode'}{'/' if (PACKAGE / p).is_dir() and p else ''}`"
                          f" ({what})" for p, what in layer.parts)
        lines += textwrap.wrap(f"{n}. **{layer.name}**: {layer.why}. {parts}.", width=96,
                               subsequent_indent="   ", break_on_hyphens=False)
    return "\n".join([*lines, "", END])


PACKAGE = ROOT / "src" / "specdecode"


def design_section(text: str) -> str:
    """The rendered section of design.md's text (empty where it has none)."""
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN): text.index(END) + len(END)]


def import_cycles() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_cycles",
                                                  Path(__file__).with_name("import_cycles.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 and argv[1].startswith("--") else "--check"
    root = Path(argv[-1]) if len(argv) > 1 and not argv[-1].startswith("--") else PACKAGE
    text = DESIGN.read_text(encoding="utf-8")
    if mode == "--write":
        if not design_section(text):
            print(f"{DESIGN}: no section between {BEGIN!r} and {END!r}", file=sys.stderr)
            return 1
        DESIGN.write_text(text.replace(design_section(text), render()), encoding="utf-8")
        return 0
    edges, _ = import_cycles().graph(root)
    problems = violations(edges, root.name)
    if design_section(text) != render():
        problems.append(f"{DESIGN}: the layers section differs from scripts/layers.py "
                        "(python scripts/layers.py --write)")
    print("\n".join(problems) or f"{len(edges)} modules in {len(LAYERS)} layers; no import "
          "crosses upward")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
