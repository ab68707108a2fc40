"""docs/serving.md matches the server: its table of request fields lists exactly the fields each
route accepts (the request schemas) and refuses (protocol.REFUSED_FIELDS, with the values still
accepted); the reasons `requests_refused_total` counts (every error code) are the ones the page
lists, and every code the server's source can raise is one of them. Each comparison is also run
on a deliberately broken copy (a row dropped or moved, a code invented), which it must catch.
Pure parsing: no server, no model."""

from __future__ import annotations

import ast
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from specdecode.server import openai_errors
from specdecode.server.openai_errors import ERROR_CODES, APIError
from specdecode.server.prometheus import REFUSED_REASONS
from specdecode.server.protocol import (
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)

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


ROUTES: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                      "/v1/chat/completions": ChatCompletionRequest}


def schema_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field of a request schema, nested ones as "stream_options.include_usage" and, in
    lists, "messages[].role"."""
    names = set()
    for name, info in model.model_fields.items():
        names.add(prefix + name)
        for sub, in_list in _submodels(info.annotation):
            names |= schema_fields(sub, f"{prefix}{name}{'[]' if in_list else ''}.")
    return names


def _submodels(annotation: Any, in_list: bool = False) -> list[tuple[type[BaseModel], bool]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, in_list)]
    origin = typing.get_origin(annotation)
    inner = in_list or origin is list
    if origin is typing.Annotated:
        return _submodels(typing.get_args(annotation)[0], in_list)
    if origin in (list, typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _submodels(arg, inner)]
    return []


def documented_fields(text: str) -> dict[str, dict[str, Any]]:
    """Per route: {"accepted": {field, ...}, "refused": {field: {neutral JSON value, ...}}},
    from the table of request fields (columns: field, /v1/completions, /v1/chat/completions)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| field |"))
    routes = re.findall(r"`([^`]+)`", lines[start])
    out: dict[str, dict[str, Any]] = {r: {"accepted": set(), "refused": {}} for r in routes}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            for route, cell in zip(routes, cells[1:1 + len(routes)], strict=True):
                if cell.startswith("accepted"):
                    out[route]["accepted"].add(name)
                elif cell.startswith("refused"):
                    values = {json.dumps(json.loads(v)) for v in re.findall(r"`([^`]+)`", cell)}
                    out[route]["refused"][name] = values
                else:
                    assert cell == "", f"{name} {route}: {cell!r}"
    return out


def server_fields() -> dict[str, dict[str, Any]]:
    """The same, from the code: the schemas' fields, REFUSED_FIELDS and their neutral values."""
    out = {}
    for route, model in ROUTES.items():
        refused = {f.name: {json.dumps(v) for v in f.neutral} for f in REFUSED_FIELDS[route]}
        out[route] = {"accepted": schema_fields(model) - set(refused), "refused": refused}
    return out


def test_documented_fields_are_the_servers() -> None:
    """Each route's accepted fields, refused fields and the values a refused field may still
    take are what the page's table says (issue 37: the page called response_format refused
    while json_object and json_schema worked, and chat took echo and best_of silently)."""
    documented = documented_fields(SERVING.read_text(encoding="utf-8"))
    assert documented == server_fields()
    chat = documented["/v1/chat/completions"]
    assert {"echo", "best_of", "messages[].name"} <= set(chat["refused"])
    assert "response_format" in chat["accepted"]


def test_a_field_documented_wrongly_is_caught() -> None:
    """Broken variants of the page: response_format called refused (the old text), the echo
    row dropped, a refused field's accepted value changed."""
    text = SERVING.read_text(encoding="utf-8")
    fields = server_fields()
    variants = {
        "response_format refused": text.replace("| `response_format` | | accepted |",
                                                "| `response_format` | | refused unless `null` |"),
        "echo dropped": "\n".join(line for line in text.splitlines()
                                  if not line.startswith("| `echo` |")),
        "n unless 2": text.replace("| `n` | refused unless `1` or `null` |",
                                   "| `n` | refused unless `2` or `null` |"),
    }
    for name, variant in variants.items():
        assert variant != text, name
        assert documented_fields(variant) != fields, name


def test_refused_fields_are_in_the_schemas() -> None:
    """A refused field is declared (so the OpenAPI schema and the fuzz run know it), and its
    neutral values are what an absent field defaults to, or null."""
    for route, model in ROUTES.items():
        for field in REFUSED_FIELDS[route]:
            assert field.name in schema_fields(model), (route, field.name)
            assert None in field.neutral, (route, field.name)
