"""A submitted request as the event loop sees it, and its replies: SSE chunks or one JSON body.

`Submission` receives the engine thread's events through an asyncio.Queue (filled with
`loop.call_soon_threadsafe`), times them for the latency histograms, and on `close()` cancels the
generation if it has not finished, which frees its cache row before the engine's next step.
`EventStream` guarantees that `close()` runs however the stream ends: completed, failed, or the
client gone (Starlette cancels the stream when it sees the disconnect).

Streams follow OpenAI: `data: {json}` events, a final chunk with `finish_reason`, a usage chunk
(empty `choices`) when `stream_options.include_usage`, then `data: [DONE]`. An engine failure
mid-stream is sent as `data: {"error": {...}}` before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specdecode.engine import Generation, StepOutput
from specdecode.server.openai_errors import APIError
from specdecode.server.prometheus import ServerMetrics
from specdecode.server.worker import EngineFailure, EngineWorker, Event

POLL_S = 0.25  # how often a waiting request checks for a gone client or a dead engine
RETRY_AFTER_S = 5  # Retry-After of a 503 (the server shutting down): another instance, or later


class ClientGone(Exception):
    """The client of a non-streaming request disconnected while it was generating."""


class Submission:
    """One request handed to the engine thread; iterate `outputs()` for its StepOutputs."""

    def __init__(self, worker: EngineWorker, gen: Generation, metrics: ServerMetrics,
                 on_close: Callable[[], None], label: str | None = None,
                 keep_text: bool = False) -> None:
        self.worker, self.gen, self.metrics = worker, gen, metrics
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.text: list[str] | None = [] if keep_text else None  # the reply, for --record
        self.started = time.perf_counter()
        self._last: float | None = None  # when the last token-carrying output arrived
        self._checked = self.started  # when the client was last checked for a disconnect
        self._on_close: Callable[[], None] | None = on_close
        loop = asyncio.get_running_loop()

        def deliver(event: Event) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(self.events.put_nowait, event)

        worker.submit(gen, deliver, label)

    @property
    def prompt_tokens(self) -> int:
        return self.gen.prompt_len

    async def outputs(self, disconnected: Callable[[], Awaitable[bool]] | None = None
                      ) -> AsyncIterator[StepOutput]:
        """StepOutputs until the last one; APIError on an engine failure, ClientGone when
        `disconnected` (polled while waiting) says the client left."""
        while self.finish_reason is None:
            event = await self._next(disconnected)
            if isinstance(event, EngineFailure):
                self.finish_reason = "error"
                retry = {"Retry-After": str(RETRY_AFTER_S)} if event.status == 503 else None
                raise APIError(event.status, event.message, code=event.code, headers=retry)
            self._observe(event)
            yield event

    async def _next(self, disconnected: Callable[[], Awaitable[bool]] | None) -> Event:
        """The next event; every POLL_S, check for a gone client and a dead engine thread."""
        while True:
            now = time.perf_counter()
            if disconnected is not None and now - self._checked >= POLL_S:
                self._checked = now
                if await disconnected():
                    raise ClientGone
            try:
                return await asyncio.wait_for(self.events.get(), POLL_S)
            except TimeoutError:
                if not self.worker.alive and self.events.empty():
                    return EngineFailure("the engine thread stopped", 503)

    def _observe(self, out: StepOutput) -> None:
        now = time.perf_counter()
        if out.tokens:
            if self._last is None:
                self.metrics.observe_first_token(now - self.started)
            else:
                self.metrics.observe_inter_token(now - self._last)
            self._last = now
        self.completion_tokens += len(out.tokens)
        if self.text is not None:
            self.text.append(out.text)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.metrics.observe_finished(out.finish_reason, self.prompt_tokens,
                                          self.completion_tokens, now - self.started)

    def close(self) -> None:
        """End the request: cancel it in the engine if unfinished, release its slot (once)."""
        if self._on_close is None:
            return
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            self.worker.cancel(self.gen)
            self.metrics.observe_finished("cancelled", self.prompt_tokens,
                                          self.completion_tokens,
                                          time.perf_counter() - self.started)
        on_close, self._on_close = self._on_close, None
        on_close()

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass(frozen=True)
class Shape:
    """How one endpoint shapes its replies: completions (`chat` False) or chat completions."""

    chat: bool
    rid: str
    created: int
    model: str
    # a sampled request's seed (given, or drawn): sent back (an extension field) so that any
    # reply can be reproduced by sending it, whatever the traffic and drafting (rule invariant)
    seed: int | None = None

    def _envelope(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + \
            (".chunk" if stream and self.chat else "")
        body = {"id": self.rid, "object": kind, "created": self.created, "model": self.model}
        return body | ({} if self.seed is None else {"seed": self.seed})

    def _choice(self, text: str, finish: str | None, stream: bool,
                role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if not self.chat:
            choice["text"] = text
        elif stream:
            choice["delta"] = ({"role": "assistant"} if role else {}) | \
                ({"content": text} if text or role else {})
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice | {"logprobs": None, "finish_reason": finish}

    def opening(self, with_usage: bool) -> list[dict[str, Any]]:
        """Chunks sent before any text: the assistant role, for chat."""
        if not self.chat:
            return []
        return [self.chunk("", None, with_usage, role=True)]

    def chunk(self, text: str, finish: str | None, with_usage: bool,
              role: bool = False) -> dict[str, Any]:
        body = self._envelope(True) | {"choices": [self._choice(text, finish, True, role)]}
        return body | ({"usage": None} if with_usage else {})

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return self._envelope(True) | {"choices": [], "usage": usage}

    def whole(self, text: str, finish: str | None, usage: dict[str, int]) -> dict[str, Any]:
        return self._envelope(False) | {"choices": [self._choice(text, finish, False)],
                                        "usage": usage}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying `data` (JSON unless it is already a string)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def stream_events(sub: Submission, shape: Shape, with_usage: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed request, ending with `data: [DONE]`."""
    try:
        for chunk in shape.opening(with_usage):
            yield sse(chunk)
        async for out in sub.outputs():
            if out.text or out.finish_reason is not None:
                yield sse(shape.chunk(out.text, out.finish_reason, with_usage))
        if with_usage:
            yield sse(shape.usage_chunk(sub.usage()))
    except APIError as exc:
        yield sse(exc.body())
    yield sse("[DONE]")


async def collect(sub: Submission, disconnected: Callable[[], Awaitable[bool]]) -> str | None:
    """The whole text of a non-streamed request; None if the client left before the end."""
    pieces: list[str] = []
    try:
        async for out in sub.outputs(disconnected):
            pieces.append(out.text)
    except ClientGone:
        return None
    return "".join(pieces)


class EventStream(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
