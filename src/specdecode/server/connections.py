"""A deadline for each request's headers: the slow-client limit uvicorn lacks.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but any byte received
resets that timer, and a new connection has no timer at all: a client that opens connections
and sends its headers a byte at a time (slowloris) holds them open forever. Here a connection
must deliver a request's complete headers within `header_timeout` seconds of opening, or of its
previous response ending; otherwise it is closed. Only a request that began, whose first bytes
arrived but not its complete headers, is counted (`header_timeout`, by the observer): a
connection that sent nothing since it opened or since its last response (an idle keep-alive
connection, a client's spare connection) asked for nothing, and is closed without a count.
The body has its own limit (`BodyLimitMiddleware`'s body timeout: a 408).

`create_app` records the app's `ConnectionLimits` on `app.state.connection_limits`, where
`background.uvicorn_server` finds them, so every server of the app applies them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("specdecode.server")

HEADER_TIMEOUT_S = 10.0
HEADER_TIMEOUT = "header_timeout"  # the reason requests_refused_total counts them under


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = HEADER_TIMEOUT_S
    # told of each request closed before its headers arrived (not of idle connections)
    on_header_timeout: Callable[[], None] | None = None


def limits_of(app: Any) -> ConnectionLimits:
    """The limits `create_app` recorded on `app`, or the defaults (any other ASGI app)."""
    limits = getattr(getattr(app, "state", None), "connection_limits", None)
    return limits if isinstance(limits, ConnectionLimits) else ConnectionLimits()


def protocol_class(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the header deadline of `limits`."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_after: Any = None  # the cycle current when the deadline was set

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._waiting_after:
                self._disarm()  # a new request's headers arrived

        def on_response_complete(self) -> None:
            done = self.cycle
            super().on_response_complete()  # may start a pipelined request at once
            if self.cycle is done and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle
            self._deadline = self.loop.call_later(limits.header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.cycle is not self._waiting_after or self.transport.is_closing():
                return
            if request_began(self.conn):
                log.info("closing a connection from %s: no complete request headers within "
                         "%g s", self.client, limits.header_timeout)
                if limits.on_header_timeout is not None:
                    limits.on_header_timeout()
            else:
                log.debug("closing a connection from %s: idle for %g s", self.client,
                          limits.header_timeout)
            self.transport.close()

    return HeaderDeadlineProtocol


def request_began(conn: h11.Connection) -> bool:
    """Whether a new request's first bytes are waiting for the rest of its headers: the client
    is between requests (IDLE) and h11 holds bytes it could not yet parse. (h11 refuses a
    leading empty line with a 400, so held bytes are always the start of a request line; bytes
    of an earlier request's unread body leave the client in SEND_BODY, not IDLE.)"""
    return conn.their_state is h11.IDLE and bool(conn.trailing_data[0])
