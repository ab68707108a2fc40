"""Drained shutdown: on SIGTERM (or Ctrl-C) finish what runs, refuse what comes, end the rest.

`drain(state, timeout)` is what `background.DrainingServer` runs on the first signal, before
uvicorn's own shutdown:

1. stop admitting: new generation requests get 503 `shutting_down` with Retry-After, and
   /health answers 503 `draining`, so a load balancer stops sending here;
2. wait up to `timeout` seconds (`--shutdown-timeout`) for the requests in flight to finish;
3. end those still running, explicitly: a stream gets an error event (code `shutting_down`)
   and `data: [DONE]`, a non-streamed request a 503 body; then wait (up to ABORT_GRACE_S) for
   those replies to be written.

Then uvicorn closes the listening socket and the idle connections and the process exits. A
second signal skips what is left of the drain (uvicorn's own shutdown: open connections get its
graceful-shutdown time, then are cut).
"""

from __future__ import annotations

import asyncio
import logging

from specdecode.server.openai_errors import APIError
from specdecode.server.state import SHUTDOWN_TIMEOUT_S, ServerState
from specdecode.server.streaming import RETRY_AFTER_S
from specdecode.server.worker import EngineFailure

log = logging.getLogger("specdecode.server")

__all__ = ["SHUTDOWN_TIMEOUT_S", "drain", "refusal"]

SHUTTING_DOWN = "shutting_down"
ABORT_GRACE_S = 5.0  # for the ended requests' replies to be written
POLL_S = 0.05


def refusal() -> APIError:
    """The 503 a request gets while the server drains."""
    return APIError(503, "the server is shutting down: retry on another instance or later",
                    code=SHUTTING_DOWN, headers={"Retry-After": str(RETRY_AFTER_S)})


async def drain(state: ServerState, timeout: float) -> None:
    """Stop admitting, let the requests in flight finish for `timeout` s, end the rest."""
    state.draining = True
    loop = asyncio.get_running_loop()
    log.warning("shutting down: %d requests in flight, up to %g s to finish", state.inflight,
                timeout)
    deadline = loop.time() + timeout
    while state.inflight > 0 and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    if state.inflight == 0:
        return
    log.warning("shutting down: ending %d requests still running after %g s", state.inflight,
                timeout)
    state.worker.fail_all(EngineFailure(
        f"the server is shutting down (requests still running after {timeout:g} s are ended)",
        503, SHUTTING_DOWN))
    deadline = loop.time() + ABORT_GRACE_S
    while state.inflight > 0 and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
