"""Binding the listening socket, and running a server in a background thread.

`bind_socket` binds before uvicorn starts, so a taken port is one clear error. `BackgroundServer`
runs an app on a free loopback port in a daemon thread (tests, notebooks, a bench that measures
its own server) and stops it on exit.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from types import FrameType, TracebackType
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from specdecode.errors import SpecDecodeError
from specdecode.server.connections import limits_of, protocol_class

GRACEFUL_SHUTDOWN_S = 5
Drain = Callable[[], Coroutine[Any, Any, None]]  # run on the first SIGTERM (server.shutdown)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), ready for uvicorn; port 0 picks a free one."""
    if not 0 <= port <= 65535:
        raise SpecDecodeError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SpecDecodeError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from exc
    return sock


def uvicorn_server(app: ASGIApp, log_level: str = "warning",
                   drain: Drain | None = None) -> uvicorn.Server:
    """A uvicorn server for `app` (address given by the socket passed to run/serve), with the
    header deadline `create_app` recorded on the app (see specdecode.server.connections); with
    `drain`, a DrainingServer that runs it on the first SIGTERM or SIGINT."""
    config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            http=protocol_class(limits_of(app)))
    return uvicorn.Server(config) if drain is None else DrainingServer(config, drain)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT runs `drain()` (see server.shutdown) while
    it keeps serving, and exits when that ends; a second signal exits at once, as uvicorn."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self._drain_requested
        super().handle_exit(sig, frame)  # records the signal (re-raised once the server ends)
        if first:
            self._drain_requested = True
            self.should_exit = False  # on_tick sets it once the drain has ended

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        if self._drain_task is not None and self._drain_task.done():
            self.should_exit = True
        return await super().on_tick(counter)


class BackgroundServer:
    """`with BackgroundServer(app) as srv:` serves `app` at `srv.url` until the block ends."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", start_timeout: float = 60.0) -> None:
        self.app, self.host, self.start_timeout = app, host, start_timeout
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Bind a free port, start serving in a daemon thread, return once it accepts."""
        sock = bind_socket(self.host, 0)
        self.port = int(sock.getsockname()[1])
        self._server = uvicorn_server(self.app)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="specdecode-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise SpecDecodeError(f"the server did not start on {self.url}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Ask the server to exit (open streams get the graceful-shutdown time) and wait."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(GRACEFUL_SHUTDOWN_S + 30)

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
