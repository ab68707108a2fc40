"""The routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/speculation, /health,
/metrics.

A generation request goes: schema validation (pydantic, strict) -> model name and unsupported
fields -> prompt size in bytes (a prompt that cannot fit is refused before any tokenizing) ->
admission (429 when running + queued + still-tokenizing requests are at the limit) -> prompt
tokenized and sampling parameters checked (in a worker thread, the tokenizer releasing the GIL:
a long prompt never stalls the event loop; long prompts one at a time on a thread of their
own, the allocator's freed memory given back after each: see `allocator`) -> submitted to the
engine thread -> streamed as SSE or collected into one JSON body. Every refusal before
submission is a 4xx with an OpenAI error body; once submitted, the request's
`Submission.close()` runs however it ends, cancelling an unfinished generation at once, and
with `--record` the request is then queued for the recording (server.record).

A request's label, for the live speculation metrics and the recording: the presented API key's
label (server.middleware) and the request's `metadata.label`, joined "KEY/META" when both.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from specdecode.sampling import SamplingParams
from specdecode.server import allocator, prepare, shutdown
from specdecode.server.connections import HEADER_TIMEOUT, ConnectionLimits
from specdecode.server.isolation import credential
from specdecode.server.middleware import (
    ARRIVAL,
    KEY_LABEL,
    ApiKeyMiddleware,
    ArrivalMiddleware,
    BodyLimitMiddleware,
)
from specdecode.server.openai_errors import APIError, UnexpectedErrorMiddleware, install_handlers
from specdecode.server.prometheus import CONTENT_TYPE
from specdecode.server.protocol import ChatCompletionRequest, CompletionRequest
from specdecode.server.record import REPLAY_HEADER, Recorder
from specdecode.server.state import LONG_PROMPT_BYTES, ServerState
from specdecode.server.streaming import EventStream, Shape, Submission, collect, stream_events
from specdecode.version import __version__


def create_app(state: ServerState) -> FastAPI:
    """The ASGI app over `state`; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.recorder is not None:
            state.recorder.start()
        state.worker.start()
        yield
        state.worker.stop()
        state.long_prompts.shutdown(wait=False, cancel_futures=True)
        if state.recorder is not None:  # after the worker: the requests it ended are recorded
            await asyncio.get_running_loop().run_in_executor(None, state.recorder.close)

    app = FastAPI(title="specdecode", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)

    def observe(error: APIError) -> None:
        state.metrics.observe_refused(error.reason)

    install_handlers(app, observe)
    app.state.connection_limits = ConnectionLimits(
        state.header_timeout, lambda: state.metrics.observe_refused(HEADER_TIMEOUT))
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.max_body_bytes,
                       timeout=state.body_timeout, observe=observe)
    if state.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=state.api_keys, observe=observe)
    app.add_middleware(UnexpectedErrorMiddleware, observe=observe)  # outermost: runs first
    if state.recorder is not None:  # outermost: a request's arrival is when its headers came
        app.add_middleware(ArrivalMiddleware, recorder=state.recorder)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Complete one prompt (text or token ids); stream=true for server-sent events."""
        return await _generate(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Answer messages rendered with the model's chat template; stream=true for SSE."""
        return await _generate(state, body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The one model this server serves."""
        s = state.served
        return {"object": "list", "data": [{
            "id": s.name, "object": "model", "created": s.created, "owned_by": "specdecode",
            "root": s.loaded_name, "max_model_len": s.window,
        }]}

    @app.get("/v1/speculation")
    async def speculation() -> dict[str, Any]:
        """Is speculation paying: per request label, tokens per step, the share of steps that
        drafted nothing, the step cost against the calibrated plain step, the realised speedup
        estimate, and the warnings in force (server.speculation)."""
        return {"object": "speculation", "model": state.served.name,
                **state.monitor.summary()}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread runs and the server is not shutting down, else 503."""
        ok = state.worker.alive and not state.draining
        status = "ok" if ok else "draining" if state.draining else "engine stopped"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition (see specdecode.server.prometheus for the names)."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _generate(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                    request: Request) -> Response:
    """Validate, admit and run one generation request; stream it or answer with one body."""
    served = state.served
    if state.draining:
        raise shutdown.refusal()
    prepare.check_model(served, req.model)
    chat = isinstance(req, ChatCompletionRequest)
    prepare.check_refused(req)
    spec = prepare.constraint_spec(req)
    size = prepare.check_prompt_size(served, req)
    state.admit()  # before tokenizing: pending tokenization counts against the queue
    arrival = getattr(request.state, ARRIVAL, 0.0)
    label = request_label(request, req)
    try:
        if size > LONG_PROMPT_BYTES:  # one at a time, behind no short prompt (see state)
            prompt_ids, params = await asyncio.get_running_loop().run_in_executor(
                state.long_prompts, allocator.trimming(
                    functools.partial(_prompt_and_params, served, req)))
        else:
            prompt_ids, params = await run_in_threadpool(_prompt_and_params, served, req)
        scope = served.isolation.key(credential(request.headers), req.user)
        gen = prepare.new_generation(served, prompt_ids, params, spec, scope)
        if state.draining:  # began while this prompt was being tokenized
            raise shutdown.refusal()
        recorder = state.recorder
        keep = recorder is not None and recorder.options.outputs
        sub = Submission(state.worker, gen, state.metrics, state.release, label, keep)
    except BaseException:
        state.release()
        raise
    shape = Shape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                  int(time.time()), served.name, None if params.greedy else gen.seed)
    close = sub.close
    if recorder is not None and REPLAY_HEADER not in request.headers:
        body = await request.json()  # the body as received (parsed once already: cached)
        close = functools.partial(_close_and_record, recorder, sub, body, request.url.path,
                                  arrival, shape.rid, label)
    if req.stream:
        with_usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(stream_events(sub, shape, with_usage), close)
    try:
        text = await collect(sub, request.is_disconnected)
    finally:
        close()
    if text is None:  # the client left: nobody reads this reply
        return Response(status_code=499)
    return JSONResponse(shape.whole(text, sub.finish_reason, sub.usage()))


def request_label(request: Request, req: CompletionRequest | ChatCompletionRequest
                  ) -> str | None:
    """The request's label: its API key's and its metadata.label, "KEY/META" when both."""
    parts = [getattr(request.state, KEY_LABEL, None), (req.metadata or {}).get("label")]
    return "/".join(p for p in parts if p) or None


def _close_and_record(recorder: Recorder, sub: Submission, body: Any, route: str,
                      arrival: float, rid: str, label: str | None) -> None:
    """End the request (Submission.close), then queue its line for the recording."""
    sub.close()
    entry: dict[str, Any] = {
        "request": body, "route": route, "arrival_s": arrival, "id": rid, "label": label,
        "finish_reason": sub.finish_reason, "prompt_tokens": sub.prompt_tokens,
        "output_tokens": sub.completion_tokens,
        "latency_s": round(time.perf_counter() - sub.started, 6)}
    if sub.text is not None:
        entry["output"] = "".join(sub.text)
    recorder.record(entry)


def _prompt_and_params(served: prepare.ServedModel,
                       req: CompletionRequest | ChatCompletionRequest
                       ) -> tuple[list[int], SamplingParams]:
    """Token ids of the prompt and the sampling parameters, max_tokens fitted to the context."""
    if isinstance(req, ChatCompletionRequest):
        ids = prepare.chat_prompt(req, served.prompts)
        requested = req.max_completion_tokens or req.max_tokens
        limit = prepare.max_tokens(requested, len(ids), served.window, None, "messages")
    else:
        ids = prepare.completion_prompt(req, served.prompts, served.vocab_size)
        limit = prepare.max_tokens(req.max_tokens, len(ids), served.window,
                                   prepare.DEFAULT_COMPLETION_TOKENS, "prompt")
    return ids, prepare.sampling_params(req, limit, served.vocab_size, served.rule)
