"""docs/serving.md matches the server: the reasons `requests_refused_total` counts (every error
code) are the ones the page lists, and every code the server's source can raise is one of them.
Each comparison is also run on a deliberately broken copy (a row dropped, a code invented), which
it must catch. Pure parsing: no server, no model."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from specdecode.server import openai_errors
from specdecode.server.openai_errors import ERROR_CODES, APIError
from specdecode.server.prometheus import REFUSED_REASONS

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "docs" / "serving.md"
SERVER = ROOT / "src" / "specdecode" / "server"


def table_names(text: str, header: str) -> list[str]:
    """The backticked names in the first column of the table whose header row starts with
    `header` (e.g. "| reason |")."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def documented_reasons(text: str) -> list[str]:
    return table_names(text, "| reason |")


def mismatch(documented: list[str], actual: set[str] | frozenset[str]) -> dict[str, set[str]]:
    """What the docs list that the code lacks, what the code has that the docs lack, and
    names listed twice ({} when they agree)."""
    out = {"only documented": set(documented) - actual,
           "undocumented": set(actual) - set(documented),
           "listed twice": {n for n in documented if documented.count(n) > 1}}
    return {k: v for k, v in out.items() if v}


def test_documented_reasons_are_the_servers() -> None:
    assert mismatch(documented_reasons(SERVING.read_text(encoding="utf-8")),
                    REFUSED_REASONS) == {}


def test_a_reason_missing_from_the_docs_is_caught() -> None:
    """Broken variants: the page without its `invalid_json` row (as before issue 37, when the
    page listed no reason at all), and the code with a reason the page does not list."""
    text = SERVING.read_text(encoding="utf-8")
    dropped = "\n".join(line for line in text.splitlines()
                        if not line.startswith("| `invalid_json` |"))
    assert mismatch(documented_reasons(dropped), REFUSED_REASONS) == {
        "undocumented": {"invalid_json"}}
    assert mismatch(documented_reasons(text), REFUSED_REASONS | {"http_400"}) == {
        "undocumented": {"http_400"}}


def raised_codes() -> dict[str, list[str]]:
    """Every error code written at a call of APIError or EngineFailure in the server's source
    (a string, or a module constant naming one; an attribute forwards a code made elsewhere),
    with where: APIError(status, message, param, code), EngineFailure(message, status, code)."""
    found: dict[str, list[str]] = {}
    for path in sorted(SERVER.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            position = {"APIError": 3, "EngineFailure": 2}.get(node.func.id)
            if position is None:
                continue
            args = [k.value for k in node.keywords if k.arg == "code"]
            args += node.args[position:position + 1]
            for arg in args:
                if isinstance(arg, ast.Attribute):  # forwarded (event.code): built elsewhere
                    continue
                code = arg.value if isinstance(arg, ast.Constant) else \
                    constants.get(arg.id) if isinstance(arg, ast.Name) else None
                assert isinstance(code, str), f"{path.name}:{node.lineno}: a code not " \
                                              "written as a string or a module constant"
                found.setdefault(code, []).append(f"{path.name}:{node.lineno}")
    return found


def test_every_raised_code_is_a_documented_reason() -> None:
    """The source's codes and the statuses' defaults are exactly ERROR_CODES: none raised that
    /metrics would count under an unlisted reason, none listed that nothing raises."""
    raised = raised_codes()
    defaults = {code for _, code in openai_errors._TYPES.values()}
    assert set(raised) - ERROR_CODES == set(), raised
    assert ERROR_CODES - set(raised) - defaults == set()
    assert {"invalid_json", "shutting_down", "model_not_found"} <= set(raised)  # found at all


def test_every_status_gets_a_listed_code() -> None:
    """An error built from a status alone (a routing 404, an engine failure's 503) carries a
    listed code: no reason such as http_400 (issue 37: the body parser's 400 had code null)."""
    assert {APIError(status, "x").code for status in range(400, 600)} <= ERROR_CODES


def test_an_unlisted_code_cannot_be_raised() -> None:
    with pytest.raises(ValueError, match="not in ERROR_CODES"):
        APIError(400, "x", code="something_new")
