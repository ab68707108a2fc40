"""Plain ASGI middlewares that run before any route: the API keys, the body limits, and
with --record the arrival stamp.

The API key check runs first, so an unauthenticated client cannot make the server buffer a
body. A server may hold several keys (`--api-key` repeated), each with an optional label
(`--api-key team-a=KEY`): the label of the key a request presented is put in the ASGI scope's
state (`key_label`), where the live speculation metrics and `--record` read it; the key itself
is never kept anywhere else.

The body limit reads the whole body up front (refusing it with 413 as soon as it passes the
size limit, or at once when Content-Length says so; with 408 when it has not all arrived
within the body timeout, so a client sending a byte a second cannot hold a request open), then
replays it to the app; later receive() calls go to the client, so a disconnect is still seen.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.errors import SpecDecodeError
from specdecode.server.openai_errors import APIError, Observer, ignore_error
from specdecode.server.protocol import LABEL_PATTERN

if TYPE_CHECKING:
    from specdecode.server.record import Recorder

OPEN_PATHS = frozenset({"/health"})  # liveness probes; every other path needs the key
KEY_LABEL = "key_label"  # where the presented key's label goes in scope["state"]


@dataclass(frozen=True)
class ApiKey:
    """A key a client may present, and the label its traffic goes under (None: no label)."""

    key: str
    label: str | None = None

    def __repr__(self) -> str:  # never print the key (logs, tracebacks)
        return f"ApiKey(label={self.label!r})"

    @classmethod
    def parse(cls, value: str) -> ApiKey:
        """`--api-key` as given: `LABEL=KEY` when the part before the first "=" is a label
        (1-64 letters, digits or `_.:-`), `=KEY` for an unlabelled key that holds "=" itself,
        else the whole value is the key. SpecDecodeError for an empty key."""
        label, sep, key = value.partition("=")
        if not sep or not (label == "" or re.match(LABEL_PATTERN, label)):
            label, key = "", value
        if not key.strip():
            raise SpecDecodeError("--api-key must not be empty" + (
                f" (label {label!r} has no key)" if label else ""))
        return cls(key, label or None)


def check_keys(keys: Sequence[ApiKey]) -> None:
    """SpecDecodeError when one key is given twice (labels may repeat: a rotated key)."""
    values = [k.key for k in keys]
    if len(set(values)) != len(values):
        raise SpecDecodeError("--api-key: the same key is given twice")


class ApiKeyMiddleware:
    """Require `Authorization: Bearer <key>` (one of the keys) on every path but /health:
    /v1/*, /metrics, the OpenAPI schema (/openapi.json describes the whole API) and any path
    that would be a 404; put the presented key's label in the scope's state."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[ApiKey],
                 observe: Observer = ignore_error) -> None:
        self.app = app
        self._keys = [(k.key.encode("utf-8"), k.label) for k in api_keys]
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _protected(scope["path"]):
            allowed, label = self._match(scope)
            if not allowed:
                error = APIError(401, "missing or invalid API key (send Authorization: Bearer "
                                      "KEY)", headers={"WWW-Authenticate": "Bearer"})
                self.observe(error)
                await error.response()(scope, receive, send)
                return
            scope.setdefault("state", {})[KEY_LABEL] = label
        await self.app(scope, receive, send)

    def _match(self, scope: Scope) -> tuple[bool, str | None]:
        """(whether the bearer token is one of the keys, that key's label); every key is
        compared in constant time, none skipped, so the time taken does not say which."""
        value = _header(scope, b"authorization") or b""
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer":
            return False, None
        token = token.strip()
        found, label = False, None
        for key, key_label in self._keys:
            if hmac.compare_digest(token, key) and not found:
                found, label = True, key_label
        return found, label


ARRIVAL = "arrival"  # where ArrivalMiddleware puts a request's arrival, in scope["state"]


class ArrivalMiddleware:
    """Stamp each POST with its arrival in the recording's session (`Recorder.arrival`) as its
    headers come in, before anything else runs (body, key, validation): the first request
    stamped is the session's 0, and stamps never decrease."""

    def __init__(self, app: ASGIApp, recorder: Recorder) -> None:
        self.app, self.recorder = app, recorder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            scope.setdefault("state", {})[ARRIVAL] = self.recorder.arrival()
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413, before any parsing, and bodies not
    complete within `timeout` seconds with 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float = 60.0,
                 observe: Observer = ignore_error) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is None or declared > self.max_bytes:
            await self._refuse(_length_error(declared, self.max_bytes), scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout):
                body = await _read_body(receive, self.max_bytes)
        except _ClientGone:
            return
        except TimeoutError:
            error = APIError(408, f"the request body did not arrive within {self.timeout:g} s",
                             headers={"Connection": "close"})
            await self._refuse(error, scope, receive, send)
            return
        if body is None:
            await self._refuse(_length_error(self.max_bytes + 1, self.max_bytes), scope, receive,
                               send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _refuse(self, error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        self.observe(error)
        await error.response()(scope, receive, send)


class _ClientGone(Exception):
    """The client disconnected before its body arrived: nothing to answer."""


def _protected(path: str) -> bool:
    return path not in OPEN_PATHS


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


def _content_length(scope: Scope) -> int | None:
    """The declared length: 0 when absent, None when it is not a non-negative integer."""
    raw = _header(scope, b"content-length")
    if raw is None:
        return 0
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def _length_error(declared: int | None, limit: int) -> APIError:
    if declared is None:
        return APIError(400, "invalid Content-Length header", code="invalid_body")
    return APIError(413, f"request body over the limit of {limit} bytes")


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes; _ClientGone on a disconnect."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that returns the buffered body once, then defers to the client's."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
