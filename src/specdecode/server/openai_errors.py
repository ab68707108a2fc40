"""OpenAI-style errors: every failure a client sees is {"error": {message, type, param, code}}.

Handlers installed by `install_handlers` turn request-validation failures into 400s and routing
failures (unknown path, wrong method) into their 4xx; `UnexpectedErrorMiddleware` turns anything
unexpected into a 500 with the same body shape, logged once (a handler registered for Exception
would let Starlette re-raise it, and uvicorn would log a second traceback), so no client ever
sees a traceback or an empty reply. Every error answered is passed to an observer (the server
counts them by code in /metrics: requests_refused_total{reason}).

Every error carries a code from `ERROR_CODES` (a status without a code of its own gets its
status's default), so the reasons /metrics counts are a closed set, the one docs/serving.md
lists (tests/test_server_docs.py compares them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("specdecode.server")

_TYPES = {
    400: ("invalid_request_error", "invalid_value"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "server_busy"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "unavailable"),
}


# every code an error body can carry: the reasons requests_refused_total counts, with
# server.connections' header_timeout (prometheus.REFUSED_REASONS)
ERROR_CODES = frozenset({
    "invalid_json", "invalid_body", "missing_field", "unknown_field", "invalid_value",
    "unsupported_value", "context_length_exceeded", "no_chat_template", "model_not_found",
    "invalid_api_key", "not_found", "method_not_allowed", "request_timeout",
    "request_too_large", "server_busy", "shutting_down", "unavailable", "internal_error",
})

_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "typed-dict"})


class APIError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        default_type, default_code = _TYPES.get(status, _TYPES[500 if status >= 500 else 400])
        self.status = status
        self.message = message
        self.param = param
        self.code: str = code or default_code
        if self.code not in ERROR_CODES:  # a programming error: each code is documented
            raise ValueError(f"error code {self.code!r} is not in ERROR_CODES")
        self.error_type = error_type or default_type
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429 or a 503

    @property
    def reason(self) -> str:
        """The label this error is counted under in /metrics: its code."""
        return self.code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status,
                            headers={**self.headers, **(headers or {})})


Observer = Callable[[APIError], None]  # told of every error answered (metrics)


def ignore_error(error: APIError) -> None:
    return None


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def param_path(loc: Sequence[Any]) -> str | None:
    """'messages[0].content' for a pydantic location ('body', 'messages', 0, 'content')."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


def _is_union_tag(part: str) -> bool:
    """Pydantic names the member of a union it tried ('str', 'list[...]', 'constrained-str')."""
    return "[" in part or "-" in part or part in _TAGS


def validation_api_error(exc: RequestValidationError) -> APIError:
    """One 400 describing the first problem pydantic found in the body."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    # a union reports one error per member: prefer one that is not a mere type mismatch
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    kind, loc = str(first.get("type", "")), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")
    if kind == "extra_forbidden":  # named as sent: param_path would drop "a-b" or "str"
        name = ".".join(filter(None, (param_path(loc[:-1]), str(loc[-1]))))[:100]
        return APIError(400, f"unknown field '{name}': this server takes only the fields "
                             "docs/serving.md lists", name, "unknown_field")
    param = param_path(loc)
    if param is None:
        return APIError(400, "the request body must be a JSON object, sent with "
                             "Content-Type: application/json", code="invalid_body")
    if kind == "missing":
        return APIError(400, f"missing required field '{param}'", param, "missing_field")
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param, "invalid_value")


def unreadable_body_error(cause: BaseException) -> APIError:
    """The 400 for a JSON body FastAPI's parser raised on with something other than a JSON
    syntax error (that one is `json_invalid`): bytes that are not UTF-8, or nesting deeper
    than Python's parser recurses."""
    if isinstance(cause, UnicodeDecodeError):
        detail = f"it is not UTF-8: {cause.reason} at byte {cause.start}"
    elif isinstance(cause, RecursionError):
        detail = "its arrays or objects are nested too deeply"
    else:
        detail = f"{type(cause).__name__}"
    return APIError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")


def install_handlers(app: FastAPI, observe: Observer = ignore_error) -> None:
    """Register the handlers that give every error the OpenAI body shape (add
    UnexpectedErrorMiddleware for the rest); `observe` is told of each error answered."""

    def answer(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
        observe(error)
        return error.response(headers)

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return answer(exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return answer(validation_api_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code if 400 <= exc.status_code < 600 else 400
        if status == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
            return answer(unreadable_body_error(exc.__cause__), dict(exc.headers or {}))
        message = str(exc.detail) if exc.detail else "request refused"
        if status == 404:
            message = f"no route {request.method} {request.url.path}"
        return answer(APIError(status, message), dict(exc.headers or {}))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)


class UnexpectedErrorMiddleware:
    """An exception no handler took: logged once with its traceback, answered with a 500 body
    (when the response has not started; a started one ends where it was)."""

    def __init__(self, app: ASGIApp, observe: Observer = ignore_error) -> None:
        self.app = app
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unexpected error serving %s %s", scope.get("method"),
                          scope.get("path"))
            error = APIError(500, "internal server error (logged on the server)")
            self.observe(error)
            if not started:
                await error.response()(scope, receive, send)
