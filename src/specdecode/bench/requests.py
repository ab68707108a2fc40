"""Workload lines that are OpenAI requests: a `serve --record` recording, or any log of request
bodies (a proxy's, a gateway's), read as prompts a benchmark replays.

A line is a request when it holds one of:

- `{"request": BODY, ...}`: a recorded request (server.record) or a proxy's wrapper, with
  optional `route` ("/v1/chat/completions" or "/v1/completions"), `arrival_s` (seconds after
  the first request of its `session`), or `timestamp` (unix seconds, or ISO 8601 text), `id`,
  `label`, `finish_reason`, `output_tokens`...;
- a bare body: `{"messages": [...], ...}` (chat), or `{"model": ..., "prompt": ...}` (a
  completion; a line with "prompt" and no "model" is the plain workload format).

The body is checked exactly as `specdecode serve` checks it (its pydantic schemas, the fields it
refuses, its structured-output constraint): a line the server would refuse is malformed, named
with the field (skipped, or refused with --strict). Its `model` is not checked: a replay sends
each body to the model it measures. A recording's header lines (`{"specdecode_recording": 1,
"session", "model": {...}}`) are not prompts: they say which model a session was recorded with.

RecordedArrival times: a recording's offsets are per session (a server process); sessions are placed
one after another in the order they first appear, each starting SESSION_GAP_S after the last
arrival of the one before (the downtime between two server runs is not replayed). Timestamps
are relative to the earliest. Lines are written as requests end, so they are out of arrival
order: `arrange` sorts them (stable) and says how many were out of order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from specdecode.errors import SpecDecodeError
from specdecode.server.record import HEADER_KEY

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RECORDED_CATEGORY = "recorded"  # a request's category without metadata.category or a label
SESSION_GAP_S = 1.0
TIMESTAMPS = "(timestamps)"  # the session of lines placed by a timestamp


class RequestLineError(ValueError):
    """A request line that cannot be replayed (the message names the field)."""


@dataclass
class RecordedArrival:
    """Where a request line says it arrived: its session and its offset in it (absolute unix
    seconds for the TIMESTAMPS session)."""

    session: str
    seconds: float


@dataclass
class Recording:
    """What a file's header lines and arrival fields said, for `arrange` and the report."""

    sessions: list[str] = field(default_factory=list)  # in order of first appearance
    models: list[dict[str, Any]] = field(default_factory=list)  # distinct recorded models

    def header(self, obj: dict[str, Any]) -> None:
        """Take one header line in (its session's order, its model)."""
        session = str(obj.get("session", ""))
        if session and session not in self.sessions:
            self.sessions.append(session)
        model = obj.get("model")
        if isinstance(model, dict) and model not in self.models:
            self.models.append(model)

    def seen(self, arrival: RecordedArrival | None) -> None:
        if arrival is not None and arrival.session not in self.sessions:
            self.sessions.append(arrival.session)


def is_header(obj: object) -> bool:
    return isinstance(obj, dict) and HEADER_KEY in obj


def is_request(obj: object) -> bool:
    """Whether a decoded line is an OpenAI request (see the module docstring)."""
    if not isinstance(obj, dict):
        return False
    return "request" in obj or "messages" in obj or ("prompt" in obj and "model" in obj)


@dataclass(frozen=True)
class ParsedRequest:
    """A request line, checked: what the Prompt built from it holds."""

    id: str | None
    route: str
    body: dict[str, Any]
    category: str
    text: str  # the last user message or the prompt, for the report
    max_tokens: int | None
    temperature: float
    constraint: dict[str, str] | None
    arrival: RecordedArrival | None


def parse_request(obj: dict[str, Any]) -> ParsedRequest:
    """Check one request line as the server would; RequestLineError naming the field."""
    body = obj.get("request", obj)
    if not isinstance(body, dict):
        raise RequestLineError(f'"request" must be a JSON object, got {type(body).__name__}')
    route = _route(obj, body)
    req = validate(body, route)
    label = obj.get("label")
    metadata = body.get("metadata") or {}
    category = metadata.get("category") or (label if isinstance(label, str) and label else
                                            RECORDED_CATEGORY)
    raw_id = obj.get("id") if "request" in obj else None
    return ParsedRequest(
        id=raw_id if isinstance(raw_id, str) and raw_id else None, route=route, body=body,
        category=str(category), text=_text(req, route),
        max_tokens=(getattr(req, "max_completion_tokens", None) or req.max_tokens),
        temperature=_temperature(req.temperature),
        constraint=_constraint(req), arrival=arrival_of(obj))


def _route(obj: dict[str, Any], body: dict[str, Any]) -> str:
    route = obj.get("route")
    guessed = CHAT if "messages" in body else COMPLETIONS if "prompt" in body else None
    if route is None:
        if guessed is None:
            raise RequestLineError('the request has neither "messages" nor "prompt"')
        return guessed
    if route not in (CHAT, COMPLETIONS):
        raise RequestLineError(f'"route" must be {CHAT} or {COMPLETIONS}, got {route!r}')
    return str(route)


def validate(body: dict[str, Any], route: str) -> Any:
    """The body as `specdecode serve` reads it (its pydantic request), checked as it checks
    it; RequestLineError naming the first problem. `model` is any: the replay sets it."""
    schemas = _server()
    model = schemas.ChatCompletionRequest if route == CHAT else schemas.CompletionRequest
    try:
        req = model.model_validate({**body, "model": "replay"})
        schemas.check_refused(req)
        schemas.constraint_spec(req)
    except schemas.ValidationError as exc:
        raise RequestLineError(_first_problem(exc.errors())) from None
    except schemas.APIError as exc:
        where = f"{exc.param}: " if exc.param and not exc.message.startswith(exc.param) else ""
        raise RequestLineError(f"{where}{exc.message}") from None
    return req


class _Server:
    """The server's request checks, imported on first use (the `server` extra)."""

    def __init__(self) -> None:
        try:
            from pydantic import ValidationError

            from specdecode.server import prepare, protocol
            from specdecode.server.openai_errors import APIError
        except ImportError as exc:
            raise SpecDecodeError(f"reading OpenAI request lines needs the server's packages "
                                  f"({exc.name}): pip install 'specdecode[server]'") from None
        self.ValidationError, self.APIError = ValidationError, APIError
        self.ChatCompletionRequest = protocol.ChatCompletionRequest
        self.CompletionRequest = protocol.CompletionRequest
        self.check_refused, self.constraint_spec = prepare.check_refused, prepare.constraint_spec


_SERVER: _Server | None = None


def _server() -> _Server:
    global _SERVER
    if _SERVER is None:
        _SERVER = _Server()
    return _SERVER


def _first_problem(errors: list[Any]) -> str:
    """The first pydantic problem as the server words it: 'field: message'."""
    from specdecode.server.openai_errors import param_path

    if not errors:
        return "invalid request"
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return f"unknown field '{'.'.join(map(str, loc))}' (the server refuses it)"
    if first.get("type") == "missing":
        return f"missing required field '{param_path(loc)}'"
    return f"{param_path(loc) or 'request'}: {first.get('msg', 'invalid value')}"


def _text(req: Any, route: str) -> str:
    """The request's last user message (chat) or its prompt, as text, for the report."""
    if route == CHAT:
        users = [m for m in req.messages if m.role == "user"] or req.messages
        content = users[-1].content
        return content if isinstance(content, str) else "".join(p.text for p in content)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"


def _temperature(value: float | None) -> float:
    """The temperature the server samples at: OpenAI's default 1, below 1e-5 greedy (0)."""
    from specdecode.server.prepare import MIN_TEMPERATURE

    t = 1.0 if value is None else float(value)
    return t if t >= MIN_TEMPERATURE else 0.0


def _constraint(req: Any) -> dict[str, str] | None:
    spec = _server().constraint_spec(req)
    return None if spec is None else dict(spec.to_dict())


def arrival_of(obj: dict[str, Any]) -> RecordedArrival | None:
    """The line's arrival: `arrival_s` in its session, or a `timestamp`; None without either."""
    if "arrival_s" in obj:
        value = obj["arrival_s"]
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not math.isfinite(value):
            raise RequestLineError(f'"arrival_s" must be a number of seconds, got {value!r}')
        if value < 0:
            raise RequestLineError(f'"arrival_s" is negative ({value}): an arrival is seconds '
                                   "after the first request")
        return RecordedArrival(str(obj.get("session", "")), float(value))
    if "timestamp" in obj:
        return RecordedArrival(TIMESTAMPS, _timestamp(obj["timestamp"]))
    return None


def _timestamp(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise RequestLineError(f'"timestamp" must be unix seconds or ISO 8601 text, got {value!r}')


def arrange(items: list[tuple[Any, RecordedArrival | None]], recording: Recording
            ) -> tuple[list[Any], list[float | None], list[str]]:
    """The items in arrival order, each one's offset from the first arrival (None where a line
    had none: those keep their place at the end), and notes for the report: sessions replayed
    back to back, lines that were out of arrival order."""
    placed = [(i, a) for i, (_, a) in enumerate(items) if a is not None]
    if not placed:
        return [item for item, _ in items], [None] * len(items), []
    start: dict[str, float] = {}
    offset = 0.0
    for session in recording.sessions:
        times = [a.seconds for _, a in placed if a.session == session]
        if times:
            start[session] = offset - min(times)
            offset += max(times) - min(times) + SESSION_GAP_S
    at = {i: a.seconds + start[a.session] for i, a in placed}
    order = sorted(at, key=lambda i: (at[i], i))
    late = sum(1 for n, i in enumerate(order) if n and i < order[n - 1])
    order += [i for i in range(len(items)) if i not in at]
    notes = []
    if len(start) > 1:
        notes.append(f"{len(start)} recording sessions (server runs) replayed one after "
                     f"another, {SESSION_GAP_S:g} s apart")
    if late:
        notes.append(f"{_lines(late)} out of arrival order (a recording is written as "
                     "requests end): replayed in arrival order")
    missing = len(items) - len(at)
    if missing:
        notes.append(f"{_lines(missing)} without an arrival time (no arrival_s or "
                     "timestamp)")
    return ([items[i][0] for i in order], [at.get(i) for i in order], notes)


def _lines(n: int) -> str:
    return "1 line was" if n == 1 else f"{n} lines were"


def recording_notes(models: list[dict[str, Any]], name: str, weights: str | None,
                    tokenizer: str | None) -> list[str]:
    """Where the model a recording was made with differs from the one measured: its weights'
    or its tokenizer's sha256 (when both are known), else its name."""
    notes = []
    for model in models:
        said = f"recorded with {model.get('id') or model.get('name')}"
        theirs_w, theirs_t = model.get("weights"), model.get("tokenizer")
        if tokenizer and theirs_t and theirs_t != tokenizer:
            notes.append(f"{said}, whose tokenizer or chat template differs from {name}'s: "
                         "prompt and output lengths in tokens are not the recording's")
        elif weights and theirs_w and theirs_w != weights:
            notes.append(f"{said} ({str(theirs_w)[:16]}), not with the weights measured here "
                         f"({weights[:16]}): outputs and acceptance may differ from the "
                         "recorded traffic's")
        elif not (weights and theirs_w) and model.get("id") not in (None, name) and \
                model.get("name") != name:
            notes.append(f"{said}, measured on {name}")
    return notes


def notes_for(recorded_with: list[dict[str, Any]], description: dict[str, Any]) -> list[str]:
    """`recording_notes` for a run's target, from its runner's description (in process: the
    weights' and the tokenizer's sha256; over HTTP: the served model ids)."""
    weights = str(description.get("weight_hash", ""))
    details = description.get("details") or {}
    tokenizer = details.get("tokenizer_sha256") if isinstance(details, dict) else None
    names = str(description.get("model_name", "")).split(" | ")
    if not recorded_with:
        return []
    return [note for name in names for note in recording_notes(
        recorded_with, name, weights if len(weights) == 64 else None,
        tokenizer if isinstance(tokenizer, str) else None)]
