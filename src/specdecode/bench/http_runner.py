"""The HTTP runner: the benchmark's measurements from any OpenAI-compatible server.

`HttpRunner` implements `bench.runner.Runner` over one or more endpoints. Each endpoint is one
configuration: what the server does (speculation on or off, its drafter and k) is its own
setting, which the runner cannot change. The first endpoint is the baseline (a "plain"
configuration); the others are measured against it as speculative configurations (drafter
"server", k "auto": the server decides), interleaved over the same prompts. To compare a
speculative server with a plain one, list the plain one first.

A configuration's batch size is the number of concurrent requests: a batch is one turn of up to
`batch_size` prompts, sent at once as separate streaming requests (stream=true, usage included),
and the next batch starts when all of them have ended.

One request (one turn of one prompt):

- POST /v1/chat/completions with the conversation as messages (earlier turns with the replies
  generated for them; the server applies its chat template), or, with `chat=False`, POST
  /v1/completions with the turns and replies joined by blank lines. Temperature
  `effective_temperature`, seed `request_seed`, max_tokens the prompt's (else
  `default_max_tokens`) capped at `max_tokens_cap`.
- Times are taken on this side, per streamed event: the clock starts when the request is sent;
  TTFT is the arrival of the first event carrying text; each later text event adds its time since
  the previous one to ITL. The server's usage gives the token count; an event carrying m tokens
  adds its gap, then m - 1 zeros (the `records` attribution). How many tokens each event carried
  is not streamed: every event gets one, and the usage's extra tokens go to events in proportion
  to their text's length. The ITL values (the gaps and the number of zeros) are exact; only which
  token a zero belongs to is estimated, and no statistic depends on that.
- Token ids are not streamed: `output_token_ids` holds the output's token count copies of a CRC
  of its text (`records.text_ids`), and comparisons and loop searches use the text's pieces
  (`RequestSample.output_units`): two servers' token counts for one text may differ.
- Acceptance: read from the endpoint's /metrics before and after each batch (see
  `bench.http_metrics`: this server's names and vLLM's); the whole batch's counts go on its first
  request (the others get none), so totals per configuration are exact but per-category
  acceptance at batch size > 1 mixes the batch's categories. Concurrent traffic from other
  clients during a batch pollutes these counts. Without speculation counters on /metrics
  (or when a batch's counts cannot be its own) acceptance is unknown: every counter, steps
  included, is 0, so the report shows no rate rather than a false zero.
- Structured output (`bench.http_constraints`): a prompt's constraint is sent as OpenAI's chat
  `response_format` (a JSON schema) or vLLM's `guided_json` (completions), `guided_regex`,
  `guided_grammar`, and each output is judged on this side from its text (`valid`): a server
  that ignores the field shows up as invalid outputs, not as an error. Forced tokens and mask
  time are the server's and not visible: `forced` and `mask_s` are None (unknown) on every
  sample. `prepare` builds the judges before anything is sent (SpecDecodeError naming the
  constraint when one cannot be judged).
- A request that fails mid-run (HTTP error, broken or malformed stream, timeout) becomes a failed
  sample (`error` set) with whatever it measured; later turns of its prompt fail as not run.

`check` probes every endpoint before anything is measured (GET /v1/models, GET /metrics, one
two-token streamed request) and raises SpecDecodeError naming the URL when one cannot be used.

A prompt that is a recorded OpenAI request (`Prompt.request`, bench.requests) is sent as it was,
to its own route, with the endpoint's model id, streaming with usage, its max_tokens capped at
`max_tokens_cap` and a seed where it has none (so every endpoint samples alike).

`replay` runs a window of an open-loop replay (bench.openloop): every request is sent when it
is due (a conversation's next turn when the reply before it has ended), each sample handed on
as it ends, its TTFT and latency from when it was due. Before and after the window the
endpoint's /metrics gives its speculation counters (the window's, on its ReplayRecord) and, for
this project's server, its engine steps by batch size; for a server without them, the record
holds the seconds during which 1, 2, ... requests were in flight, as the client saw them.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import httpx

from specdecode.bench.hardware import detect_hardware
from specdecode.bench.http_constraints import Judges, request_fields
from specdecode.bench.http_metrics import (
    BatchCounters,
    SpecCounters,
    batch_counters,
    counter_delta,
    read_counters,
    read_steps,
    steps_delta,
)
from specdecode.bench.openloop import Scheduled
from specdecode.bench.records import (
    AuditVerdict,
    ConfigSpec,
    CostCurve,
    MemoryRecord,
    ReplayRecord,
    RequestSample,
    text_ids,
)
from specdecode.bench.requests import CHAT
from specdecode.bench.runner import RunnerDescription, effective_temperature, request_seed
from specdecode.bench.workloads import Prompt
from specdecode.errors import SpecDecodeError
from specdecode.server.record import REPLAY_HEADER
from specdecode.version import __version__

API_KEY_ENV = "SPECDECODE_API_KEY"
SERVER_DRAFTER = "server"  # the drafter of a speculative endpoint configuration
DEFAULT_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0
PROBE_TOKENS = 2
PROBE_PROMPT = "Say hello."
ERROR_CHARS = 300


# ------------------------------------------------------------------------------- endpoints


@dataclass(frozen=True)
class Endpoint:
    """A named server: `url` is its base (scheme, host, port, path prefix) without "/v1"."""

    name: str
    url: str

    @property
    def api(self) -> str:
        return f"{self.url}/v1"


def base_url(text: str) -> str:
    """A server's base URL from "http://host:port", ".../v1" or ".../v1/"; SpecDecodeError
    unless it is http(s) with a host."""
    url = text.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecDecodeError(f"--endpoint {text!r}: expected an http(s) URL such as "
                              "http://127.0.0.1:8000/v1")
    return url.removesuffix("/v1")


def parse_endpoints(values: Sequence[str]) -> list[Endpoint]:
    """`--endpoint [NAME=]URL` values as Endpoints; a name defaults to the URL's host:port."""
    out: list[Endpoint] = []
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            name, url = "", value
        url = base_url(url)
        name = name.strip() or (urlsplit(url).netloc or url)
        if any(e.name == name for e in out):
            raise SpecDecodeError(f"--endpoint: the name {name!r} is used twice (write "
                                  "NAME=URL to tell endpoints apart)")
        out.append(Endpoint(name, url))
    if not out:
        raise SpecDecodeError("--endpoint: no endpoint given")
    return out


def endpoint_configs(endpoints: Sequence[Endpoint]) -> list[ConfigSpec]:
    """One configuration per endpoint: the first is the plain baseline, the others speculative
    (drafter "server", k "auto"); options hold the URL."""
    configs = [ConfigSpec(name=endpoints[0].name, precision="server",
                          options={"url": endpoints[0].url})]
    configs += [ConfigSpec(name=e.name, drafter=SERVER_DRAFTER, k="auto", precision="server",
                           options={"url": e.url}) for e in endpoints[1:]]
    return configs


# -------------------------------------------------------------------------------- streaming


@dataclass
class Stream:
    """What one streamed request brought: text events with arrival times, usage, the end."""

    start: float  # perf_counter when the request was sent
    started_at: float  # unix time of the same moment
    events: list[tuple[float, str]] = field(default_factory=list)  # (arrival, text)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    end: float = 0.0
    error: str = ""
    done: bool = False


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:ERROR_CHARS]
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", ""))[:ERROR_CHARS]
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])[:ERROR_CHARS]
    return text.strip()[:ERROR_CHARS]


def chunk_text(chunk: dict[str, Any], chat: bool) -> tuple[str, str | None]:
    """(text, finish_reason) of the first choice of a streamed chunk ("" / None when absent)."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "", None
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = choice.get("text")
    return (text if isinstance(text, str) else ""), choice.get("finish_reason")


def read_event(stream: Stream, line: str, now: float, chat: bool) -> None:
    """Take one line of the event stream into `stream` (sets `done` or `error` when it ends)."""
    if not line.startswith("data:"):
        return  # blank separators, comments, "event:" / "id:" fields
    payload = line[5:].strip()
    if payload == "[DONE]":
        stream.done = True
        return
    try:
        chunk = json.loads(payload)
    except ValueError:
        stream.error = f"malformed event (not JSON): {payload[:80]!r}"
        return
    if not isinstance(chunk, dict):
        stream.error = f"malformed event (not a JSON object): {payload[:80]!r}"
        return
    if "error" in chunk:
        err = chunk["error"]
        message = err.get("message") if isinstance(err, dict) else err
        stream.error = f"error event: {str(message)[:ERROR_CHARS]}"
        return
    text, finish = chunk_text(chunk, chat)
    if text:
        stream.events.append((now, text))
    stream.finish_reason = finish or stream.finish_reason
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        stream.completion_tokens = _int_or_none(usage.get("completion_tokens"))
        stream.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


async def read_events(stream: Stream, response: httpx.Response, chat: bool) -> None:
    """Read the event stream until [DONE], an error, or its end, timing each line."""
    lines = response.aiter_lines()
    try:
        async for line in lines:
            read_event(stream, line, time.perf_counter(), chat)
            if stream.done or stream.error:
                break
    finally:
        close = getattr(lines, "aclose", None)  # stopping early: close the generator now
        if close is not None:
            await close()


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         chat: bool) -> Stream:
    """POST `body` to `url` with stream=true and time every event; failures go to `error`."""
    stream = Stream(time.perf_counter(), time.time())
    kind = ""
    try:
        async with client.stream("POST", url, json=body) as response:
            kind = response.headers.get("content-type", "")
            if response.status_code >= 400:
                message = error_message(await response.aread())
                stream.error = f"HTTP {response.status_code}: {message}"
            else:
                await read_events(stream, response, chat)
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    stream.end = time.perf_counter()
    if not stream.error and not stream.done and stream.finish_reason is None:
        stream.error = (f"the stream ended before its last event (content-type {kind!r}; "
                        "expected text/event-stream)")
    if stream.error:
        stream.error = f"{url}: {stream.error}"
    return stream


# ---------------------------------------------------------------------------- to a sample


def tokens_per_event(texts: Sequence[str], total: int) -> list[int]:
    """Split `total` tokens over text events: one each, the rest in proportion to text length
    (largest remainder). With fewer tokens than events, the first and the last events and those
    right after the first get one (the first and last arrivals stay where they were seen)."""
    n = len(texts)
    if total < n:
        counts = [1 if 0 < i < total - 1 else 0 for i in range(n)]
        if total >= 1:
            counts[0] = 1
        if total >= 2:
            counts[-1] = 1
        return counts
    extra = total - n
    weights = [max(len(t), 1) for t in texts]
    quotas = [extra * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    order = sorted(range(n), key=lambda i: (counts[i] - quotas[i], i))
    for i in order[:extra - sum(counts)]:
        counts[i] += 1
    return [1 + c for c in counts]


def emissions(stream: Stream) -> list[tuple[float, int]]:
    """(arrival, tokens) per emission: text events, with the usage's token count (else one a
    event) spread over them; tokens without any text event arrive at the end of the stream."""
    texts = [text for _, text in stream.events]
    total = stream.completion_tokens if stream.completion_tokens is not None else len(texts)
    if not texts:
        return [(stream.end, total)] if total else []
    counts = tokens_per_event(texts, total)
    return [(t, n) for (t, _), n in zip(stream.events, counts, strict=True) if n]


def timings(stream: Stream) -> tuple[float, list[float], int]:
    """(ttft, itl, output tokens) attributed as `records` documents."""
    ttft, itl, last, tokens = None, [], stream.start, 0
    for arrival, n in emissions(stream):
        if ttft is None:
            ttft = arrival - stream.start
        else:
            itl.append(arrival - last)
        itl.extend([0.0] * (n - 1))
        last, tokens = arrival, tokens + n
    latency = stream.end - stream.start
    return (ttft if ttft is not None else latency), itl, tokens


@dataclass(frozen=True)
class HttpTurn:
    """One turn of one prompt, as sent."""

    prompt: Prompt
    turn: int
    body: dict[str, Any]


def make_sample(config: ConfigSpec, request: HttpTurn, stream: Stream,
                judges: Judges | None = None) -> RequestSample:
    """The sample of one streamed request (counters 0: see `with_counters`); `valid` judged
    from its text by `judges` when its prompt has a constraint, `forced` and `mask_s` unknown
    (None)."""
    ttft, itl, tokens = timings(stream)
    text = "".join(t for _, t in stream.events)
    valid = (judges or Judges()).valid(request.prompt.constraint, text)
    return RequestSample(
        config=config.name, batch_size=config.batch_size, prompt_id=request.prompt.id,
        category=request.prompt.category, turn=request.turn,
        prompt_tokens=stream.prompt_tokens or 0, output_tokens=tokens, ttft_s=ttft, itl_s=itl,
        latency_s=stream.end - stream.start, drafted=0, accepted=0, accepted_per_pos=[],
        drafted_per_pos=[], rejections=0, steps=0, draft_s=0.0, target_s=0.0, verify_s=0.0,
        output_token_ids=text_ids(text, tokens), text=text,
        temperature=float(request.body.get("temperature", request.prompt.temperature or 0.0)),
        started_at=stream.started_at, error=stream.error, valid=valid, forced=None,
        mask_s=None,
    )


def not_run(config: ConfigSpec, prompt: Prompt, turn: int, why: str) -> RequestSample:
    """A failed sample for a turn that was not sent (an earlier turn of its prompt failed)."""
    return RequestSample(
        config=config.name, batch_size=config.batch_size, prompt_id=prompt.id,
        category=prompt.category, turn=turn, prompt_tokens=0, output_tokens=0, ttft_s=0.0,
        itl_s=[], latency_s=0.0, drafted=0, accepted=0, accepted_per_pos=[],
        drafted_per_pos=[], rejections=0, steps=0, draft_s=0.0, target_s=0.0, verify_s=0.0,
        output_token_ids=[], text="", started_at=time.time(), error=why, forced=None,
        mask_s=None,
    )


def with_counters(samples: list[RequestSample], counters: BatchCounters | None) -> None:
    """Put a batch's counters on its first request (see the module docstring)."""
    if counters is None or not samples:
        return
    first = samples[0]
    first.drafted, first.accepted = counters.drafted, counters.accepted
    first.drafted_per_pos = list(counters.drafted_per_pos)
    first.accepted_per_pos = list(counters.accepted_per_pos)
    first.rejections, first.steps = counters.rejections, counters.steps


def conversation(turns: Sequence[str], replies: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages for the last of `turns`, earlier ones followed by their replies."""
    messages: list[dict[str, str]] = []
    for i, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def joined_text(turns: Sequence[str], replies: Sequence[str]) -> str:
    """The raw text for the last of `turns` (as the in-process runner joins them)."""
    return "\n\n".join(m["content"] for m in conversation(turns, replies))


# ---------------------------------------------------------------------------------- runner


@dataclass
class EndpointInfo:
    """What the probe learned about one endpoint."""

    model: str
    metrics: str  # "speculation counters", "no speculation counters", "unavailable (...)"
    counters: bool  # /metrics exports speculation counters


class HttpRunner:
    """The Runner protocol over OpenAI-compatible endpoints (see the module docstring).

    `model`: the model id to request (default: each endpoint's first in GET /v1/models);
    `api_key`: sent as `Authorization: Bearer` to every endpoint; `timeout`: seconds a request
    may wait for its next byte (connecting: at most 10 s).
    """

    def __init__(
        self, endpoints: Sequence[Endpoint], *, model: str | None = None,
        api_key: str | None = None, seed: int = 0, default_max_tokens: int = 128,
        max_tokens_cap: int | None = None, chat: bool = True,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.endpoints = {e.name: e for e in endpoints}
        self.model = model
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.max_tokens_cap = max_tokens_cap
        self.chat = chat
        self.timeout = timeout
        self.info: dict[str, EndpointInfo] = {}
        self.judges = Judges()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        headers[REPLAY_HEADER] = "1"  # a `serve --record` server does not record what we send
        self._loop = asyncio.new_event_loop()
        self._client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout,
                                                                        CONNECT_TIMEOUT_S)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=not all(_is_local(e.url) for e in endpoints))  # proxies: remote only

    def close(self) -> None:
        """Close the connections and the event loop."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.aclose())
            self._loop.close()

    def __enter__(self) -> HttpRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- probing

    def _get(self, endpoint: Endpoint, path: str) -> httpx.Response:
        url = f"{endpoint.url}{path}"
        try:
            return self._loop.run_until_complete(self._client.get(url))
        except httpx.HTTPError as exc:
            raise SpecDecodeError(f"cannot reach {url}: {exc or type(exc).__name__}") from None

    def _models(self, endpoint: Endpoint) -> list[str]:
        """The model ids GET /v1/models lists; SpecDecodeError on anything else."""
        url = f"{endpoint.api}/models"
        response = self._get(endpoint, "/v1/models")
        if response.status_code in (401, 403):
            raise SpecDecodeError(f"{url} answered HTTP {response.status_code} "
                                  f"({error_message(response.content)}): set --api-key or "
                                  f"${API_KEY_ENV}")
        if response.status_code >= 400:
            raise SpecDecodeError(f"{url} answered HTTP {response.status_code}: "
                                  f"{error_message(response.content)}")
        try:
            data = response.json()["data"]
            ids = [str(m["id"]) for m in data]
        except (ValueError, KeyError, TypeError):
            raise SpecDecodeError(f"{url} did not answer with an OpenAI model list: is this "
                                  "an OpenAI-compatible server?") from None
        return ids

    def _choose_model(self, endpoint: Endpoint, ids: list[str]) -> str:
        if self.model is None:
            if not ids:
                raise SpecDecodeError(f"{endpoint.api}/models lists no model")
            return ids[0]
        if ids and self.model not in ids:
            raise SpecDecodeError(f"{endpoint.api}/models does not list --model "
                                  f"{self.model!r} (it lists: {', '.join(ids[:10])})")
        return self.model

    def _scrape(self, endpoint: Endpoint) -> tuple[str, SpecCounters | None]:
        """(what /metrics offers, the counters) for the probe."""
        try:
            response = self._get(endpoint, "/metrics")
        except SpecDecodeError:
            return "unavailable (no answer)", None
        if response.status_code != 200:
            return f"unavailable (HTTP {response.status_code})", None
        model = self.info[endpoint.name].model if endpoint.name in self.info else None
        counters = read_counters(response.text, model)
        return ("speculation counters" if counters else "no speculation counters"), counters

    def probe(self, endpoint: Endpoint) -> EndpointInfo:
        """Models, /metrics and one short streamed request; SpecDecodeError naming the URL."""
        model = self._choose_model(endpoint, self._models(endpoint))
        self.info[endpoint.name] = EndpointInfo(model, "", False)
        metrics, counters = self._scrape(endpoint)
        self.info[endpoint.name] = EndpointInfo(model, metrics, counters is not None)
        prompt = Prompt("probe", "probe", [PROBE_PROMPT], max_tokens=PROBE_TOKENS)
        body = self.body(endpoint.name, prompt, 0, [], 0.0)
        stream = self._loop.run_until_complete(
            stream_request(self._client, self.url(endpoint), body, self.chat))
        if stream.error:
            raise SpecDecodeError(f"test request failed: {stream.error}")
        return self.info[endpoint.name]

    def prepare(self, prompts: Sequence[Prompt]) -> None:
        """Build the judge of every prompt's constraint (bench.http_constraints) before anything
        is sent: SpecDecodeError naming the constraint when one cannot be judged here."""
        for prompt in prompts:
            if prompt.constraint is not None:
                self.judges.judge(prompt.constraint)

    def check(self, configs: Sequence[ConfigSpec]) -> None:
        """Probe every endpoint the configurations name, before anything is measured."""
        for name in dict.fromkeys(c.name for c in configs):
            self.probe(self.endpoint(name))

    # ------------------------------------------------------------------------ description

    def describe(self) -> RunnerDescription:
        """The model(s), no weight hash (the server's), the servers' hardware as far as it is
        known (`server_hardware`); endpoints, API and attribution rules under details."""
        models = sorted({i.model for i in self.info.values()}) or [self.model or "unknown"]
        description: RunnerDescription = {
            "runner": "http", "model_name": " | ".join(models), "precision": "server",
            "weight_hash": "unknown (HTTP)",
            "details": {
                "specdecode": __version__, "httpx": httpx.__version__,
                "endpoints": {n: e.url for n, e in self.endpoints.items()},
                "models": {n: i.model for n, i in self.info.items()},
                "metrics": {n: i.metrics for n, i in self.info.items()},
                "api": "/v1/chat/completions" if self.chat else "/v1/completions",
                "batch_size": "concurrent streaming requests (one batch = one turn of up to "
                              "batch_size prompts, sent at once)",
                "timing": "client side, per streamed event (see bench.http_runner)",
                "acceptance": "per batch from /metrics deltas; traffic from other clients "
                              "during a batch pollutes it; unknown where not exported",
                "structured": "constraints sent as response_format (chat JSON schema), "
                              "guided_json, guided_regex, guided_grammar; outputs judged on "
                              "this side; forced tokens and mask time unknown",
                "baseline": next(iter(self.endpoints)),
                "default_max_tokens": self.default_max_tokens,
                "max_tokens_cap": self.max_tokens_cap, "request_timeout_s": self.timeout,
            },
        }
        description["hardware"] = server_hardware(list(self.endpoints.values()))
        return description

    # ------------------------------------------------------------------------------ run

    def endpoint(self, name: str) -> Endpoint:
        if name not in self.endpoints:
            raise SpecDecodeError(f"config {name}: no endpoint of that name")
        return self.endpoints[name]

    def url(self, endpoint: Endpoint, prompt: Prompt | None = None) -> str:
        """The route a prompt goes to: a recorded request's own, else by `chat`."""
        if prompt is not None and prompt.request is not None:
            return f"{endpoint.url}{prompt.route}"
        return f"{endpoint.api}/{'chat/completions' if self.chat else 'completions'}"

    def is_chat(self, prompt: Prompt) -> bool:
        return prompt.route == CHAT if prompt.request is not None else self.chat

    def max_tokens(self, prompt: Prompt) -> int:
        """The prompt's max_tokens (else the default), capped at `max_tokens_cap`."""
        n = prompt.max_tokens or self.default_max_tokens
        return min(n, self.max_tokens_cap) if self.max_tokens_cap else n

    def body(self, name: str, prompt: Prompt, turn: int, replies: Sequence[str],
             temperature: float) -> dict[str, Any]:
        """The JSON body of one streamed request."""
        if prompt.request is not None:
            return self.recorded_body(name, prompt, turn)
        turns = prompt.turns[:turn + 1]
        body: dict[str, Any] = {
            "model": self.info[name].model, "max_tokens": self.max_tokens(prompt),
            "temperature": temperature, "seed": request_seed(prompt, turn, self.seed),
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.chat:
            body["messages"] = conversation(turns, replies)
        else:
            body["prompt"] = joined_text(turns, replies)
        body.update(request_fields(prompt.constraint, self.chat, prompt.id))
        return body

    def recorded_body(self, name: str, prompt: Prompt, turn: int) -> dict[str, Any]:
        """A recorded request's body as it was, for this endpoint (see the module docstring)."""
        assert prompt.request is not None
        body = {**prompt.request, "model": self.info[name].model, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.max_tokens_cap:
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            body[key] = min(body.get(key) or self.max_tokens_cap, self.max_tokens_cap)
        if body.get("seed") is None:
            body["seed"] = request_seed(prompt, turn, self.seed)
        return body

    def _counters(self, endpoint: Endpoint) -> SpecCounters | None:
        """The endpoint's counters now (None when it exports none or /metrics fails)."""
        if not self.info[endpoint.name].counters:
            return None
        try:
            response = self._loop.run_until_complete(
                self._client.get(f"{endpoint.url}/metrics"))
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return read_counters(response.text, self.info[endpoint.name].model)

    def _batch(self, endpoint: Endpoint, requests: Sequence[HttpTurn]) -> list[Stream]:
        async def run_all() -> list[Stream]:
            return list(await asyncio.gather(*(
                stream_request(self._client, self.url(endpoint, r.prompt), r.body,
                               self.is_chat(r.prompt))
                for r in requests)))
        return self._loop.run_until_complete(run_all())

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        """Run `prompts` as one batch of concurrent requests, turn by turn."""
        if not 1 <= len(prompts) <= config.batch_size:
            raise SpecDecodeError(f"batch size {config.batch_size} takes 1 to "
                                  f"{config.batch_size} prompts, got {len(prompts)}")
        endpoint = self.endpoint(config.name)
        if endpoint.name not in self.info:
            self.probe(endpoint)
        replies: dict[str, list[str]] = {p.id: [] for p in prompts}
        failed: dict[str, str] = {}
        samples: list[RequestSample] = []
        for turn in range(max(len(p.turns) for p in prompts)):
            active = [p for p in prompts if turn < len(p.turns)]
            samples += [not_run(config, p, turn, f"not run: turn {turn - 1} failed "
                                f"({failed[p.id]})") for p in active if p.id in failed]
            requests = [HttpTurn(p, turn, self.body(
                endpoint.name, p, turn, replies[p.id], effective_temperature(p, config)))
                for p in active if p.id not in failed]
            if not requests:
                continue
            batch = self._measure(config, endpoint, requests)
            for request, sample in zip(requests, batch, strict=True):
                replies[request.prompt.id].append(sample.text)
                if sample.failed:
                    failed[request.prompt.id] = sample.error
            samples += batch
        return samples

    def _measure(self, config: ConfigSpec, endpoint: Endpoint,
                 requests: Sequence[HttpTurn]) -> list[RequestSample]:
        """One batch: counters before, the concurrent streams, counters after."""
        before = self._counters(endpoint)
        streams = self._batch(endpoint, requests)
        after = self._counters(endpoint)
        samples = [make_sample(config, r, s, self.judges)
                   for r, s in zip(requests, streams, strict=True)]
        if not any(s.failed for s in samples):  # a failed request's work is in the delta too
            stopped = sum(s.finish_reason == "stop" for s in streams)
            with_counters(samples, batch_counters(counter_delta(before, after),
                                                  [s.output_tokens for s in samples], stopped))
        return samples

    # ------------------------------------------------------------------ open-loop replay

    def replay(self, requests: Sequence[Scheduled], config: ConfigSpec,
               emit: Callable[[RequestSample], None]) -> ReplayRecord:
        """One window of an open-loop replay (see the module docstring)."""
        endpoint = self.endpoint(config.name)
        if endpoint.name not in self.info:
            self.probe(endpoint)
        before, steps_before = self._scrape_window(endpoint)
        window = _Window(self, config, endpoint, emit)
        self._loop.run_until_complete(window.run(requests))
        after, steps_after = self._scrape_window(endpoint)
        steps = steps_delta(steps_before, steps_after)
        counters = batch_counters(counter_delta(before, after), window.tokens, window.stopped) \
            if not window.failed else None
        sends = [sent for _, sent in window.sent_first]
        firsts = [at for at, _ in window.sent_first]
        record = ReplayRecord(
            config=config.name, batch_size=config.batch_size, window=0, start_s=0.0,
            requests=len(requests), span_s=max(firsts) - min(firsts) if firsts else 0.0,
            sent_span_s=max(sends) - min(sends) if sends else 0.0,
            late_max_s=max((sent - at for at, sent in window.sent_first), default=0.0),
            steps_by_batch=steps if steps is not None else window.in_flight,
            batch_source="server engine_steps_total" if steps is not None else "in flight")
        if counters is None:
            return record
        return replace(record, drafted=counters.drafted, accepted=counters.accepted,
                       drafted_per_pos=list(counters.drafted_per_pos),
                       accepted_per_pos=list(counters.accepted_per_pos),
                       rejections=counters.rejections, steps=counters.steps)

    def _scrape_window(self, endpoint: Endpoint
                       ) -> tuple[SpecCounters | None, dict[int, int] | None]:
        """The endpoint's speculation counters and engine steps by batch size, now."""
        try:
            response = self._loop.run_until_complete(
                self._client.get(f"{endpoint.url}/metrics"))
        except httpx.HTTPError:
            return None, None
        if response.status_code != 200:
            return None, None
        model = self.info[endpoint.name].model
        counters = read_counters(response.text, model) if self.info[endpoint.name].counters \
            else None
        return counters, read_steps(response.text, model)

    # ------------------------------------------------------- protocol: what HTTP cannot see

    def cost_curves(self, configs: Sequence[ConfigSpec]) -> list[CostCurve]:
        """Not measurable over HTTP: []."""
        return []

    def memory(self, config: ConfigSpec) -> MemoryRecord | None:
        """Not measurable over HTTP: None."""
        return None

    def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
        """None beyond the harness's greedy check (texts compared): []."""
        return []


@dataclass
class _Window:
    """One window's open loop over HTTP (HttpRunner.replay): the requests in flight, what
    they produced, and the seconds spent at each number of requests in flight."""

    runner: HttpRunner
    config: ConfigSpec
    endpoint: Endpoint
    emit: Callable[[RequestSample], None]
    start: float = 0.0
    sent_first: list[tuple[float, float]] = field(default_factory=list)  # (due, sent), turn 0
    tokens: list[int] = field(default_factory=list)
    stopped: int = 0
    failed: bool = False
    in_flight: list[float] = field(default_factory=list)  # [n - 1]: seconds at n in flight
    _flying: int = 0
    _since: float = 0.0

    async def run(self, requests: Sequence[Scheduled]) -> None:
        self.start = self._since = time.perf_counter()
        await asyncio.gather(*(self._conversation(r) for r in requests))

    def _fly(self, change: int) -> None:
        """Count the time spent at the current number in flight, then change it."""
        now = time.perf_counter()
        if self._flying > 0:
            while len(self.in_flight) < self._flying:
                self.in_flight.append(0.0)
            self.in_flight[self._flying - 1] += now - self._since
        self._flying, self._since = self._flying + change, now

    async def _conversation(self, item: Scheduled) -> None:
        """A prompt's turns: the first when due, each next one when the reply before ends."""
        await asyncio.sleep(max(0.0, item.at - (time.perf_counter() - self.start)))
        prompt, due, runner = item.prompt, item.at, self.runner
        replies: list[str] = []
        for turn in range(len(prompt.turns)):
            body = runner.body(self.endpoint.name, prompt, turn, replies,
                               effective_temperature(prompt, self.config))
            request = HttpTurn(prompt, turn, body)
            sent = time.perf_counter() - self.start
            if turn == 0:
                self.sent_first.append((due, sent))
            self._fly(+1)
            stream = await stream_request(runner._client, runner.url(self.endpoint, prompt),
                                          body, runner.is_chat(prompt))
            self._fly(-1)
            sample = make_sample(self.config, request, stream, runner.judges)
            late = sent - due  # times from when it was due, not when it was sent
            sample = replace(sample, ttft_s=sample.ttft_s + late,
                             latency_s=sample.latency_s + late, scheduled_s=due, sent_s=sent)
            self.tokens.append(sample.output_tokens)
            self.stopped += stream.finish_reason == "stop"
            self.emit(sample)
            if sample.failed:
                self.failed = True
                for later in range(turn + 1, len(prompt.turns)):
                    self.emit(not_run(self.config, prompt, later, f"not run: turn {turn} "
                                      f"failed ({sample.error})"))
                return
            replies.append(sample.text)
            due = time.perf_counter() - self.start


def server_hardware(endpoints: Sequence[Endpoint]) -> dict[str, object]:
    """`HardwareInfo` fields of the servers: this machine's CPU when every endpoint is on it
    (loopback), else unknown. Torch threads and accelerator are the servers' own: unknown."""
    if all(_is_local(e.url) for e in endpoints):
        local = detect_hardware(None, None)
        return {**local.to_dict(), "torch_threads": None}
    hosts = ", ".join(sorted({urlsplit(e.url).netloc for e in endpoints}))
    return {"cpu_model": f"unknown (remote server: {hosts})", "cpu_cores": 0,
            "torch_threads": None, "accelerator": None, "platform": "unknown",
            "python": "unknown"}


def _is_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")
