"""`specdecode bench --endpoint`: the HTTP runner against this package's own server (started on a
free loopback port with a tiny random checkpoint) and against small fake servers (Starlette apps
on loopback) that stream on a known schedule, export vLLM's metric names, export none, fail with
a 500 or send a broken stream. Every address is loopback; every request loop is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from specdecode.bench.http_metrics import (
    SpecCounters,
    batch_counters,
    drafted_positions,
    read_counters,
)
from specdecode.bench.http_runner import (
    HttpRunner,
    endpoint_configs,
    parse_endpoints,
    tokens_per_event,
)
from specdecode.bench.records import ConfigSpec
from specdecode.bench.store import read_results
from specdecode.bench.workloads import Prompt, load_workload
from specdecode.control import CostModel
from specdecode.errors import SpecDecodeError
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from specdecode.server.app import create_app
from specdecode.server.background import BackgroundServer
from specdecode.server.state import ServerState, build_state
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint
from tests.test_server import serve_options

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPTS = [
    '{"prompt": "t5 t6 t7 t5 t6", "category": "code", "id": "a"}',
    '{"prompt": "t9 t10 t11", "category": "qa", "id": "b"}',
    '{"prompt": ["t20 t21", "t22 t23"], "category": "chat", "id": "c"}',
    '{"prompt": "t30 t31 t30 t31 t30", "category": "code", "id": "d"}',
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices, a shared machine: one thread
    yield
    torch.set_num_threads(before)


def workload_file(tmp_path: Path, lines: list[str] = PROMPTS) -> Path:
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------- this package's server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = make_checkpoint(tmp_path_factory.mktemp("endpoint") / "tiny")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return load_model(str(folder))


@dataclass
class EngineTally:
    """What the server's engine fed to its metrics (the engine's own per-request counters)."""

    drafted: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.drafted, self.accepted, self.per_pos = 0, 0, []

    def add(self, drafted: int, accepted: int, per_pos: list[int]) -> None:
        self.drafted += max(drafted, 0)
        self.accepted += accepted if drafted > 0 else 0
        if drafted > 0:
            self.per_pos += [0] * (len(per_pos) - len(self.per_pos))
            for i, n in enumerate(per_pos):
                self.per_pos[i] += n


@contextmanager
def serving(loaded: LoadedModel, tally: EngineTally | None = None,
            **options: Any) -> Iterator[tuple[BackgroundServer, ServerState]]:
    # fixed k: on this tiny model drafting costs more than a target step, so the controller
    # (auto) would rightly keep speculation off, and these tests need drafted tokens
    settings = {"drafter": "int8", "k": 4, "auto": False, "max_batch": 4, "max_seq_len": 256,
                "max_queue": 16, **options}
    state = build_state(loaded, serve_options(settings), costs=CostModel())
    if tally is not None:
        observe = state.metrics.observe_step

        def spy(drafted: int, accepted: int, per_pos: list[int]) -> None:
            tally.add(drafted, accepted, per_pos)
            observe(drafted, accepted, per_pos)

        state.metrics.observe_step = spy  # type: ignore[method-assign]
    with BackgroundServer(create_app(state)) as srv:
        yield srv, state


def test_bench_endpoint_end_to_end(tiny: LoadedModel, tmp_path: Path) -> None:
    """A plain and a speculative server side by side at concurrency 1 and 2: every unit
    measured, real TTFT / ITL, acceptance from /metrics, the reports written."""
    with serving(tiny, drafter="none") as (plain, _), serving(tiny) as (spec, _):
        out = tmp_path / "run"
        code, stdout, err = run_cli([
            "bench", "--endpoint", f"plain={plain.url}", "--endpoint", f"spec={spec.url}/v1",
            "--workload", str(workload_file(tmp_path)), "--batch-sizes", "1,2",
            "--max-tokens", "10", "--out", str(out), "--quiet", "--resamples", "200"])
    assert code == 0, err
    results = read_results(out / "results.jsonl")
    assert results.header.runner["runner"] == "http"
    assert results.header.model.name == "tiny"
    assert not results.failures
    units = {s.unit for s in results.samples}
    assert len(units) == len(results.samples) == 2 * 2 * 5  # 2 endpoints, 2 sizes, 5 turns
    for s in results.samples:
        assert s.output_tokens > 0 and s.ttft_s > 0 and s.latency_s >= s.ttft_s
        assert len(s.itl_s) == s.output_tokens - 1 and not s.problems()
        assert abs(s.ttft_s + sum(s.itl_s) - s.latency_s) < 0.25
        assert s.prompt_tokens > 0
    spec_samples = [s for s in results.samples if s.config == "spec"]
    assert sum(s.drafted for s in spec_samples) > 0
    assert all(s.drafted == 0 for s in results.samples if s.config == "plain")
    assert any(x > 0 for s in spec_samples for x in s.itl_s)
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert {c["spec"]["name"] for c in report["analysis"]["configs"]} == {"plain", "spec"}
    html = (out / "report.html").read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "batch size = concurrent streaming" in html
    assert "speedup" in stdout and "spec" in stdout and "accepted/drafted" in stdout
    assert "concurrency 2" in stdout


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_acceptance_matches_the_engine(tiny: LoadedModel, tmp_path: Path, chat: bool) -> None:
    """Summed over the run, the samples' drafted, accepted and per-position counts are exactly
    what the server's engine counted (at concurrency 1 and 2), through either API."""
    tally = EngineTally()
    prompts = load_workload(workload_file(tmp_path)).prompts
    with serving(tiny, tally) as (srv, _):
        configs = [ConfigSpec("spec", batch_size=b, options={"url": srv.url}) for b in (1, 2)]
        with HttpRunner(parse_endpoints([f"spec={srv.url}"]), default_max_tokens=12,
                        chat=chat) as runner:
            runner.check(configs)
            tally.reset()  # the probe's request does not count
            samples = [s for b in (1, 2) for i in range(0, len(prompts), b)
                       for s in runner.run(prompts[i:i + b], configs[b - 1])]
    assert tally.drafted > 0 and not any(s.failed for s in samples)
    assert sum(s.drafted for s in samples) == tally.drafted
    assert sum(s.accepted for s in samples) == tally.accepted
    width = max(len(s.accepted_per_pos) for s in samples)
    per_pos = [sum(s.accepted_per_pos[i] for s in samples if i < len(s.accepted_per_pos))
               for i in range(width)]
    assert per_pos == tally.per_pos[:width] and not any(tally.per_pos[width:])
    assert all(not s.problems() and s.output_tokens > 0 and s.text for s in samples)


# -------------------------------------------------------------------------------- fake servers


@dataclass
class Fake:
    """How a fake server behaves. Each reply is `events` text events of `tokens_per_event`
    tokens; the first is sent at once, the others `gap_s` apart."""

    events: int = 4
    tokens_per_event: int = 2
    gap_s: float = 0.0
    metrics: str = "vllm"  # "vllm" | "none"
    fail_on: str = ""  # a 500 for requests whose text contains this
    error_after: int = 0  # > 0: an error event after this many text events
    malformed: bool = False
    api_key: str | None = None
    drafts: int = 0  # vLLM counters, increased per finished request as below
    counts: dict[str, float] = field(default_factory=dict)
    # structured output: a request carrying one of CONSTRAINT_FIELDS gets `honour` (streamed in
    # `events` pieces, one token each) when set; else the usual "w0 w0 ..." text, as a server
    # that ignores the constraint would send
    honour: str | None = None
    received: list[dict[str, Any]] = field(default_factory=list)  # every POSTed body


CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar")


def vllm_counters(fake: Fake) -> str:
    c = fake.counts
    lines = ["# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts counter"]
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        lines.append(f'vllm:spec_decode_{name}_total{{engine="0",model_name="fake"}} '
                     f"{c.get(name, 0.0)}")
        lines.append(f'vllm:spec_decode_{name}_total{{engine="0",model_name="other"}} 999.0')
    for pos in range(3):
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
                     f'model_name="fake",position="{pos}"}} {c.get(f"pos{pos}", 0.0)}')
    lines.append(f'vllm:generation_tokens_total{{model_name="fake"}} {c.get("gen", 0.0)}')
    return "\n".join(lines) + "\n"


def count_request(fake: Fake, tokens: int) -> None:
    """Per request: 2 drafts of 3 tokens, accepted 2 then 1 (positions 0, 1 / 0)."""
    c = fake.counts
    for key, add in (("num_drafts", 2), ("num_draft_tokens", 6), ("num_accepted_tokens", 3),
                     ("pos0", 2), ("pos1", 1), ("gen", tokens)):
        c[key] = c.get(key, 0.0) + add


def fake_app(fake: Fake) -> Starlette:
    def authorized(request: Request) -> bool:
        return fake.api_key is None or \
            request.headers.get("authorization") == f"Bearer {fake.api_key}"

    async def models(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def metrics(request: Request) -> Response:
        if fake.metrics == "none":
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(vllm_counters(fake))

    async def chat(request: Request) -> Response:
        return await answer(request, chat=True)

    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    async def answer(request: Request, chat: bool) -> Response:
        body = await request.json()
        fake.received.append(body)
        text = json.dumps(body.get("messages" if chat else "prompt"))
        if fake.fail_on and fake.fail_on in text:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        honour = fake.honour is not None and any(f in body for f in CONSTRAINT_FIELDS)
        return StreamingResponse(events(body["max_tokens"], chat, honour),
                                 media_type="text/event-stream")

    def pieces(max_tokens: int, honour: bool) -> list[tuple[str, int]]:
        """(text, tokens) of each text event."""
        if honour:
            assert fake.honour is not None
            size = -(-len(fake.honour) // fake.events)
            return [(fake.honour[i:i + size], 1) for i in range(0, len(fake.honour), size)]
        n = min(fake.events, max(1, max_tokens // fake.tokens_per_event))
        return [(" ".join(f"w{i}" for _ in range(fake.tokens_per_event)), fake.tokens_per_event)
                for i in range(n)]

    def event(text: str | None, chat: bool, finish: str | None = None) -> str:
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {} if text is None else
                                      {"content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
        return "data: " + json.dumps({"choices": [choice]}) + "\n\n"

    async def events(max_tokens: int, chat: bool, honour: bool) -> AsyncIterator[str]:
        if fake.malformed:
            yield "data: {not json\n\n"
            return
        if chat:
            yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
        tokens = 0
        for i, (text, n) in enumerate(pieces(max_tokens, honour)):
            if i:
                await asyncio.sleep(fake.gap_s)
            yield event(text, chat)
            tokens += n
            if fake.error_after and i + 1 == fake.error_after:
                yield 'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n'
                return
        count_request(fake, tokens)
        usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": tokens + 5}
        yield event(None, chat, "stop" if honour else "length")
        yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    return Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"])])


@contextmanager
def fake_server(fake: Fake) -> Iterator[str]:
    with BackgroundServer(fake_app(fake)) as srv:
        yield srv.url


def one_prompt_run(url: str, fake_prompts: list[Prompt], batch: int = 1,
                   **runner: Any) -> list[Any]:
    config = ConfigSpec("fake", batch_size=batch, options={"url": url})
    with HttpRunner(parse_endpoints([f"fake={url}"]), **runner) as r:
        r.check([config])
        return r.run(fake_prompts, config)


def test_ttft_and_itl_are_timed_per_streamed_event() -> None:
    """The first event comes at once, three more 0.6 s apart, 2 tokens each: TTFT is small
    (not the end of the stream), ITL holds three ~0.6 s gaps and four zeros. (Bounds are loose:
    server and client share a possibly loaded machine.)"""
    with fake_server(Fake(events=4, tokens_per_event=2, gap_s=0.6)) as url:
        (s,) = one_prompt_run(url, [Prompt("p", "qa", ["hi"], max_tokens=8)])
    assert s.output_tokens == 8 and not s.failed
    assert 0 < s.ttft_s < 0.5, s.ttft_s
    assert s.latency_s > 1.75
    gaps = sorted(s.itl_s)
    assert len(gaps) == 7 and gaps[:4] == [0.0] * 4
    assert all(0.4 < g < 1.5 for g in gaps[4:]), gaps
    assert abs(s.ttft_s + sum(s.itl_s) - s.latency_s) < 0.1


def test_vllm_metric_names_are_read_and_attributed() -> None:
    """vLLM's counters (another model's series ignored) become the batch's counters: at
    concurrency 2 the whole batch's counts go on its first request."""
    prompts = [Prompt("p", "qa", ["hi"], max_tokens=8), Prompt("q", "qa", ["yo"], max_tokens=8)]
    with fake_server(Fake()) as url:
        first, second = one_prompt_run(url, prompts, batch=2)
    assert (first.drafted, first.accepted) == (12, 6)
    assert first.accepted_per_pos == [4, 2] and first.drafted_per_pos == [4, 4, 4]
    assert first.steps == 2 * 7 - 6 and first.rejections == 4
    assert (second.drafted, second.accepted, second.steps) == (0, 0, 0)
    assert not first.problems() and not second.problems()


def test_no_metrics_means_acceptance_unknown(tmp_path: Path) -> None:
    lines = ['{"prompt": "hello", "id": "a"}', '{"prompt": "again", "id": "b"}']
    with fake_server(Fake(metrics="none")) as base, fake_server(Fake(metrics="none")) as other:
        out = tmp_path / "run"
        code, stdout, err = run_cli([
            "bench", "--endpoint", f"off={base}", "--endpoint", f"on={other}", "--workload",
            str(workload_file(tmp_path, lines)), "--out", str(out), "--quiet",
            "--resamples", "100"])
    assert code == 0, err
    results = read_results(out / "results.jsonl")
    assert all((s.drafted, s.accepted, s.steps) == (0, 0, 0) for s in results.samples)
    (line,) = [x for x in stdout.splitlines() if x.split()[:2] == ["on", "concurrency"]]
    assert "concurrency 1: unknown" in line
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    on = next(c for c in report["analysis"]["configs"] if c["spec"]["name"] == "on")
    assert on["acceptance"]["rate"] is None and on["acceptance"]["alpha"] is None
    assert on["acceptance"]["mean_acceptance_length"] is None
    assert report["header"]["runner"]["details"]["metrics"]["on"].startswith("unavailable")


def test_failure_mid_run_is_recorded(tmp_path: Path) -> None:
    """A 500 for one prompt: its sample is kept as failed (with the error), the others are
    measured and reported; --resume measures the failed unit again."""
    lines = ['{"prompt": "fine", "id": "a"}', '{"prompt": "FAIL here", "id": "b"}',
             '{"prompt": "fine too", "id": "c"}']
    fake = Fake(fail_on="FAIL")
    out = tmp_path / "run"
    argv = ["bench", "--endpoint", "x=http://127.0.0.1:1", "--workload",
            str(workload_file(tmp_path, lines)), "--out", str(out), "--quiet",
            "--resamples", "100"]
    with fake_server(fake) as url:
        argv[2] = f"x={url}"
        code, stdout, err = run_cli(argv)
        assert code == 0, err
        fake.fail_on = ""
        code, resumed, err = run_cli([*argv, "--resume"])
        assert code == 0, err
    results = read_results(out / "results.jsonl")
    assert [s.prompt_id for s in results.samples] == ["a", "c", "b"]  # b: resumed
    (failed,) = results.failures
    assert failed.prompt_id == "b" and "HTTP 500" in failed.error and "boom" in failed.error
    assert url in failed.error
    assert "1 request(s) failed" in stdout
    assert "1 requests measured (2 resumed)" in resumed and "failed" not in resumed
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert [f["prompt_id"] for f in report["failures"]] == ["b"]
    assert sorted(s["prompt_id"] for s in report["samples"]) == ["a", "b", "c"]


def test_error_event_mid_stream_keeps_what_was_measured() -> None:
    with fake_server(Fake(events=4, gap_s=0.3, error_after=2)) as url:
        (s,) = one_prompt_run(url, [Prompt("p", "qa", ["hi"], max_tokens=8)])
    assert s.failed and "engine died" in s.error and url in s.error
    assert s.output_tokens == 2 and s.text == "w0 w0w1 w1" and 0 < s.ttft_s < s.latency_s
    assert len(s.itl_s) == 1 and s.itl_s[0] > 0.1 and not s.problems()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_endpoint_is_one_clear_error(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = run_cli(["bench", "--endpoint", url, "--out", str(tmp_path / "run"),
                                 "--quiet"])
    assert code == 2
    assert err.startswith("specdecode: error: cannot reach") and url in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "results.jsonl").exists()


def test_malformed_stream_and_bad_key_fail_before_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_server(Fake(malformed=True)) as url:
        code, _, err = run_cli(["bench", "--endpoint", url, "--out", str(tmp_path / "a"),
                                "--quiet"])
    assert code == 2 and "malformed" in err and url in err
    assert not (tmp_path / "a" / "results.jsonl").exists()
    with fake_server(Fake(api_key="sekret")) as url:
        code, _, err = run_cli(["bench", "--endpoint", url, "--out", str(tmp_path / "b"),
                                "--quiet"])
        assert code == 2 and "401" in err and "--api-key" in err and url in err
        monkeypatch.setenv("SPECDECODE_API_KEY", "sekret")
        (s,) = one_prompt_run(url, [Prompt("p", "qa", ["hi"], max_tokens=4)],
                              api_key="sekret")
        assert not s.failed
        code, _, err = run_cli(["bench", "--endpoint", url, "--out", str(tmp_path / "c"),
                                "--quiet", "--max-tokens", "4", "--categories", "qa"])
        assert code == 0, err


def test_endpoint_arguments_are_checked() -> None:
    assert [e.name for e in parse_endpoints(["http://127.0.0.1:9/v1", "b=http://h:1"])] == \
        ["127.0.0.1:9", "b"]
    assert parse_endpoints(["x=http://h:1/v1/"])[0].url == "http://h:1"
    configs = endpoint_configs(parse_endpoints(["a=http://h:1", "b=http://h:2"]))
    assert configs[0].is_plain and not configs[1].is_plain and configs[1].k == "auto"
    for bad in (["ftp://h"], ["a=http://h:1", "a=http://h:2"], ["nohost"]):
        with pytest.raises(SpecDecodeError):
            parse_endpoints(bad)
    code, _, err = run_cli(["bench", "--endpoint", "http://127.0.0.1:9", "--configs", "plain"])
    assert code == 2 and "--configs" in err


# --------------------------------------------------------------------------- structured output


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
GRAMMAR = 'root ::= "n" [0-9]+'

# kind, the prompt's constraint line, the API, the field expected in the body, a reply that
# satisfies it, one that parses but does not
CONSTRAINED = [
    ("json-chat", {"json_schema": SCHEMA}, True, "response_format",
     {"type": "json_schema", "json_schema": {"name": "p_1", "schema": SCHEMA}},
     '{"name": "Ada", "age": 36}', '{"name": "Ada"}'),
    ("json-completions", {"json_schema": SCHEMA}, False, "guided_json", SCHEMA,
     '{"name":"Ada","age":36}', '{"name": "Ada", "age": -1}'),
    ("regex", {"regex": "(yes|no)"}, True, "guided_regex", "(yes|no)", "yes", "yes!"),
    ("grammar", {"grammar": GRAMMAR}, False, "guided_grammar", GRAMMAR, "n42", "n"),
]


def constrained_prompt(line: dict[str, Any]) -> Prompt:
    """The prompt of a workload line carrying `line`'s constraint (checked as bench checks)."""
    path_line = json.dumps({"prompt": "Tell me.", "id": "p 1", "category": "qa",
                            "max_tokens": 16, **line})
    return Prompt("p 1", "qa", ["Tell me."], max_tokens=16,
                  constraint=_line_constraint(path_line))


def _line_constraint(text: str) -> dict[str, str] | None:
    from specdecode.bench.workloads import _constraint

    return _constraint(json.loads(text))


@pytest.mark.parametrize(("kind", "line", "chat", "field_name", "value", "good", "bad"),
                         CONSTRAINED, ids=[c[0] for c in CONSTRAINED])
def test_constraint_is_sent_and_the_output_judged_here(
        kind: str, line: dict[str, Any], chat: bool, field_name: str, value: Any, good: str,
        bad: str) -> None:
    """The constraint reaches the server in the field OpenAI / vLLM name (and no other
    constraint field); a reply that satisfies it is valid, one that does not (the server's
    own claim of finishing notwithstanding) is not; forced tokens and mask time are unknown
    (None), never 0; the probe carries no constraint."""
    prompt = constrained_prompt(line)
    for reply, expected in ((good, True), (bad, False)):
        fake = Fake(honour=reply, events=3)
        with fake_server(fake) as url:
            (s,) = one_prompt_run(url, [prompt], chat=chat)
        probe, sent = fake.received
        assert not any(f in probe for f in CONSTRAINT_FIELDS)
        assert sent[field_name] == value
        assert [f for f in CONSTRAINT_FIELDS if f in sent] == [field_name]
        assert ("messages" in sent) == chat and ("prompt" in sent) != chat
        assert not s.failed and s.text == reply and s.valid is expected, (reply, s)
        assert s.forced is None and s.mask_s is None and not s.problems()


def test_a_server_that_ignores_the_constraint_gives_invalid_outputs_not_errors() -> None:
    prompts = [constrained_prompt({"regex": "(yes|no)"}),
               dataclasses.replace(constrained_prompt({"json_schema": SCHEMA}), id="q")]
    fake = Fake()  # answers "w0 w0 w1 w1 ..." whatever it is asked
    with fake_server(fake) as url:
        samples = one_prompt_run(url, prompts, batch=2)
    assert [s.valid for s in samples] == [False, False]
    assert not any(s.failed for s in samples)
    assert all(s.forced is None and s.mask_s is None for s in samples)
    assert "guided_regex" in fake.received[1] and "response_format" in fake.received[2]


def test_unconstrained_endpoint_samples_have_no_validity() -> None:
    with fake_server(Fake()) as url:
        (s,) = one_prompt_run(url, [Prompt("p", "qa", ["hi"], max_tokens=8)])
    assert s.valid is None and s.forced is None and s.mask_s is None


def test_bench_endpoint_structured_summary_and_report(tmp_path: Path) -> None:
    """`bench --endpoint --regex`: an honouring and an ignoring server side by side; the flag's
    constraint reaches both, validity is judged per output, the summary and both reports say
    unknown (not 0) for forced tokens and mask time."""
    lines = ['{"prompt": "Is it raining?", "id": "a"}', '{"prompt": "Is it cold?", "id": "b"}']
    good, bad = Fake(honour="no", events=1), Fake()
    with fake_server(good) as honours, fake_server(bad) as ignores:
        out = tmp_path / "run"
        code, stdout, err = run_cli([
            "bench", "--endpoint", f"good={honours}", "--endpoint", f"bad={ignores}",
            "--workload", str(workload_file(tmp_path, lines)), "--regex", "(yes|no)",
            "--max-tokens", "8", "--out", str(out), "--quiet", "--resamples", "100"])
    assert code == 0, err
    for fake in (good, bad):  # the probe, the warm-up batch, the two measured requests
        assert len(fake.received) == 4 and "guided_regex" not in fake.received[0]
        assert all(b["guided_regex"] == "(yes|no)" for b in fake.received[1:])
    results = read_results(out / "results.jsonl")
    assert {(s.config, s.valid) for s in results.samples} == {("good", True), ("bad", False)}
    summary = [x for x in stdout.splitlines() if x.startswith("structured output")]
    assert summary == [
        "structured output, bad at batch 1: 0/2 outputs valid; masks unknown; tokens forced "
        "unknown",
        "structured output, good at batch 1: 2/2 outputs valid; masks unknown; tokens forced "
        "unknown"]
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    by_name = {c["spec"]["name"]: c["structured"] for c in report["analysis"]["configs"]}
    assert by_name["good"]["n_valid"] == 2 and by_name["bad"]["n_valid"] == 0
    for st in by_name.values():
        assert st["n_constrained"] == 2
        assert st["forced_tokens"] is None and st["mask_s"] is None
        assert st["forced_share"] is None and st["mask_share"] is None
    assert all(s["forced"] is None and s["mask_s"] is None for s in report["samples"])
    html = (out / "report.html").read_text(encoding="utf-8")
    section = html[html.index('id="structured"'):html.index('id="load"')]
    assert "<td>unknown</td>" in section and "2/2" in section and "0/2" in section


def test_bad_constraint_with_endpoint_fails_before_anything_is_sent(tmp_path: Path) -> None:
    fake = Fake()
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "object", "properties": 3}', encoding="utf-8")
    with fake_server(fake) as url:
        for flags in (["--regex", "("], ["--json-schema", str(schema)],
                      ["--regex", "a", "--grammar", str(schema)]):
            code, _, err = run_cli(["bench", "--endpoint", url, *flags, "--out",
                                    str(tmp_path / "run"), "--quiet"])
            assert code == 2 and err.startswith("specdecode: error: "), err
            assert err.count("specdecode: error:") == 1  # (llguidance's regex message spans lines)
    assert fake.received == [] and not (tmp_path / "run" / "results.jsonl").exists()


def test_a_schema_that_cannot_be_judged_here_fails_before_anything_is_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the JSON-schema validator the outputs could not be judged: one error naming the
    flag and what to install, before the endpoint is asked anything."""
    import sys

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA), encoding="utf-8")
    monkeypatch.setitem(sys.modules, "jsonschema_rs", None)  # import fails
    fake = Fake()
    with fake_server(fake) as url:
        code, _, err = run_cli(["bench", "--endpoint", url, "--json-schema", str(schema),
                                "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--json-schema {schema}" in err and "jsonschema-rs" in err
    assert fake.received == [] and not (tmp_path / "run" / "results.jsonl").exists()


@pytest.fixture(scope="module")
def tiny_letters(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny checkpoint with a tokenizer llguidance can read (a token per printable ASCII
    character, a byte-level decoder), so its server can constrain output."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    folder = make_checkpoint(tmp_path_factory.mktemp("endpoint") / "letters")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    chars = [chr(c) for c in range(33, 127)]  # 94 characters: ids 0 and 2..94
    vocab = {c: i + (i >= 1) for i, c in enumerate(chars)}
    vocab["<eos>"] = 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    return load_model(str(folder))


def test_this_server_honours_the_constraint_over_http(tiny_letters: LoadedModel) -> None:
    """This package's own server, asked through the HTTP runner at concurrency 2 (a lookup
    drafter, k = 4): its outputs satisfy the regex, judged here."""
    prompts = [Prompt(i, "qa", [text], max_tokens=8, constraint=_line_constraint(
        json.dumps({"prompt": text, "regex": "(yes|no)!"}))) for i, text in
               (("a", "yes?"), ("b", "no?"))]
    with serving(tiny_letters, drafter="ngram") as (srv, _):
        samples = one_prompt_run(srv.url, prompts, batch=2)
    assert all(not s.failed and s.valid is True for s in samples), [s.error for s in samples]
    assert all(s.text in ("yes!", "no!") and s.forced is None for s in samples)


# ------------------------------------------------------------------------------ pure functions


def test_tokens_per_event() -> None:
    assert tokens_per_event(["a", "b", "c"], 3) == [1, 1, 1]
    assert tokens_per_event(["a", "bbbbbbb", "c"], 9) == [2, 6, 1]
    assert tokens_per_event(["a", "b", "c", "d"], 2) == [1, 0, 0, 1]
    assert tokens_per_event(["a", "b"], 1) == [1, 0]
    assert sum(tokens_per_event(["ab", "c", "def"], 17)) == 17


def test_read_counters_this_server_and_vllm() -> None:
    ours = ('spec_decode_num_drafts_total{model_name="m"} 3.0\n'
            'spec_decode_num_drafts_created{model_name="m"} 1.7e9\n'
            'spec_decode_num_draft_tokens_total{model_name="m"} 9.0\n'
            'spec_decode_num_accepted_tokens_total{model_name="m"} 5.0\n'
            'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0\n'
            'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0\n')
    assert read_counters(ours, "m") == SpecCounters(3, 9, 5, (3, 2), None)
    assert read_counters(ours, "other-model") is None
    assert read_counters("# nothing here\nprocess_cpu_seconds_total 1.0\n") is None
    fake = Fake()
    count_request(fake, 8)
    assert read_counters(vllm_counters(fake), "fake") == SpecCounters(2, 6, 3, (2, 1, 0), 8)


def test_position_estimates_exact_for_fixed_k_and_refuse_pollution() -> None:
    assert drafted_positions(4, 12, [4, 3, 1]) == [4, 4, 4]  # k = 3, 4 steps
    assert drafted_positions(4, 10, [3, 1]) == [4, 4, 2]  # lengths as even as possible
    assert drafted_positions(4, 3, []) is None  # fewer draft tokens than drafts
    delta = SpecCounters(drafts=2, draft_tokens=6, accepted=3, per_pos=(2, 1, 0),
                         generation_tokens=8)
    counters = batch_counters(delta, [8])
    assert counters is not None and counters.steps == 4 and counters.rejections == 2
    assert batch_counters(delta, [4]) is None  # more generated than this batch received
    assert batch_counters(SpecCounters(2, 6, 9, None, None), [8]) is None
    assert batch_counters(None, [8]) is None
    # a step that accepted EOS and tokens after it: none of them streamed (finish "stop")
    eos = SpecCounters(drafts=2, draft_tokens=8, accepted=6, per_pos=(2, 2, 1, 1),
                       generation_tokens=4)
    assert batch_counters(eos, [4]) is None  # without the stop, more accepted than received
    counters = batch_counters(eos, [4], stopped=1)
    assert counters is not None and counters.accepted == 6 and counters.steps == 2
