"""The HTTP server with real clients: the official `openai` package against a server started on a
free loopback port, streaming and not, concurrent load, disconnects, limits and the API key.

Most tests serve a tiny random checkpoint (word-level tokens t0..t95) with the int8 drafter under
the controller (--k auto); one serves SmolLM2. Every request loop is bounded in count and time,
and every address is loopback.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from specdecode.control import CostModel
from specdecode.drafters.options import DrafterOptions
from specdecode.engine import Generation
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from specdecode.sampling import SamplingParams
from specdecode.server.app import create_app
from specdecode.server.background import BackgroundServer
from specdecode.server.middleware import ApiKey
from specdecode.server.state import ServeOptions, ServerState, build_state
from tests.conftest import make_checkpoint
from tests.identity import assert_identical_outputs

NO_EOS = {"1": -100, "2": -100}  # the tiny model's EOS ids: keep generations full length
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny checkpoint, with a chat template that joins the messages' contents."""
    folder = make_checkpoint(tmp_path_factory.mktemp("server") / "tiny")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return load_model(str(folder))


@contextmanager
def serving(loaded: LoadedModel, **options: Any) -> Iterator[tuple[BackgroundServer, ServerState]]:
    """Serve `loaded` on a free loopback port (int8 drafter, k auto up to 4 by default)."""
    settings = {"drafter": "int8", "k": 4, "auto": True, "max_batch": 4, "max_seq_len": 256,
                "max_queue": 16, **options}
    state = build_state(loaded, serve_options(settings), costs=CostModel())
    with BackgroundServer(create_app(state)) as srv:
        yield srv, state


def serve_options(settings: dict[str, Any]) -> ServeOptions:
    """ServeOptions from flat settings: `drafter` (a name), `k` with `auto` (k the most the
    controller drafts), the other DrafterOptions fields, `api_key` (one unlabelled key), and
    ServeOptions' own."""
    drafter_fields = {f.name for f in dataclasses.fields(DrafterOptions)}
    if "api_key" in settings:  # one unlabelled key, as $SPECDECODE_API_KEY gives
        settings["api_keys"] = (ApiKey(settings.pop("api_key")),)
    mine = {key: settings.pop(key) for key in list(settings) if key in drafter_fields}
    k, auto = mine.pop("k", 8), settings.pop("auto", True)
    drafter = DrafterOptions(settings.pop("drafter", "none"), k="auto" if auto else k,
                             kmax=k if auto else 8, **mine)
    return ServeOptions(drafter=drafter, **settings)


@pytest.fixture(scope="module")
def tiny_server(tiny: LoadedModel) -> Iterator[tuple[BackgroundServer, ServerState]]:
    # fixed k: on this tiny model drafting costs more than a target step, so the controller
    # would rightly keep speculation off; the metrics tests need drafted tokens
    with serving(tiny, auto=False) as served:
        yield served


def client(srv: BackgroundServer, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def metric(srv: BackgroundServer, name: str, **labels: str) -> float:
    """The value of one series from /metrics (0 when absent)."""
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def stream_completion(c: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    """(text, finish_reason) of a greedy streamed completion."""
    pieces: list[str] = []
    finish = None
    for chunk in c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, stream=True, logit_bias=NO_EOS):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return "".join(pieces), finish


def test_completions_streamed_equals_plain(tiny_server: tuple[BackgroundServer, Any]) -> None:
    srv, _ = tiny_server
    c = client(srv)
    plain = c.completions.create(model="tiny", prompt="t3 t4 t5", max_tokens=12, temperature=0,
                                 logit_bias=NO_EOS)
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens == 3
    chunks = list(c.completions.create(model="tiny", prompt="t3 t4 t5", max_tokens=12,
                                       temperature=0, logit_bias=NO_EOS, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 15
    assert len(plain.choices[0].text.split()) == 12


def test_completions_token_ids_seed_and_stop(tiny: LoadedModel) -> None:
    """Same seed, same text, at a fixed k."""
    with serving(tiny, k=3, auto=False) as (srv, _):
        _check_seed_and_stop(client(srv))


def test_a_seed_reproduces_a_reply_whatever_the_traffic_and_drafting(tiny: LoadedModel) -> None:
    """Rule invariant: a seeded sampled request gets plain decoding's reply for its seed, from a
    server without a drafter, from one drafting at a fixed k, and from one under --k auto, alone
    or among 8 concurrent unseeded requests; an unseeded reply names the seed that repeats it."""
    seeded: dict[str, Any] = {"model": "tiny", "prompt": [3, 4, 5, 3, 4, 5, 3], "max_tokens": 16,
                              "temperature": 0.9, "top_p": 0.95, "seed": 1236,
                              "logit_bias": NO_EOS}
    noise = [{**seeded, "prompt": [7 + i, 8, 9 + i], "seed": None} for i in range(8)]
    with serving(tiny, drafter="none") as (srv, _):
        reply = client(srv).completions.create(**seeded)
        expected = reply.choices[0].text
        assert reply.to_dict()["seed"] == 1236
    for options in ({"auto": False}, {"auto": True}):
        with serving(tiny, **options) as (srv, _):
            c = client(srv)
            with ThreadPoolExecutor(12) as pool:
                replies = list(pool.map(functools.partial(_create, c), [seeded] * 4 + noise,
                                        timeout=120))
            assert [r.choices[0].text for r in replies[:4]] == [expected] * 4
            assert c.completions.create(**seeded).choices[0].text == expected
            drawn = replies[4].to_dict()["seed"]
            again = c.completions.create(**{**noise[0], "seed": drawn}).choices[0].text
            assert isinstance(drawn, int) and again == replies[4].choices[0].text


def _create(c: openai.OpenAI, args: dict[str, Any]) -> Any:
    return c.completions.create(**args)


def _check_seed_and_stop(c: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 10,
                            "temperature": 1.0, "top_p": 0.9, "seed": 7, "logit_bias": NO_EOS}
    first = c.completions.create(**args).choices[0].text
    assert c.completions.create(**args).choices[0].text == first  # seeded: reproducible
    words = first.split()
    cut = c.completions.create(**args, stop=[words[3]]).choices[0]
    assert cut.finish_reason == "stop" and words[3] not in cut.text.split()


def test_chat_streamed_equals_plain(tiny_server: tuple[BackgroundServer, Any]) -> None:
    srv, _ = tiny_server
    c = client(srv)
    messages: Any = [{"role": "system", "content": "t7 t8"}, {"role": "user", "content": "t9"}]
    plain = c.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                      temperature=0, logit_bias=NO_EOS)
    assert plain.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                       temperature=0, logit_bias=NO_EOS, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_models_health_and_metrics(tiny_server: tuple[BackgroundServer, Any],
                                   tiny: LoadedModel) -> None:
    srv, state = tiny_server
    c = client(srv)
    assert [m.id for m in c.models.list()] == ["tiny"]
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    c.completions.create(model="tiny", prompt="t5 t5 t5 t5", max_tokens=16, temperature=0,
                         logit_bias=NO_EOS)
    assert metric(srv, "spec_decode_num_drafts_total") > 0
    drafted = metric(srv, "spec_decode_num_draft_tokens_total")
    accepted = metric(srv, "spec_decode_num_accepted_tokens_total")
    assert 0 <= accepted <= drafted and drafted > 0
    assert metric(srv, "spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert metric(srv, "time_to_first_token_seconds_count") > 0
    assert metric(srv, "inter_token_latency_seconds_count") > 0
    assert metric(srv, "kv_cache_rows") == 4
    exact = tiny.exactness()  # the words every report uses, measured at load
    assert exact.startswith("exact: batch-invariant (max |logit difference|: 0 across draft "
                            "widths up to 9, 0 across batch rows"), exact
    assert metric(srv, "backend_info", backend="native", exactness=exact) == 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(srv, name) == 0
    model = state.served.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert params <= metric(srv, "memory_bytes", component="target_weights") <= 2 * params
    # the int8 drafter holds its own quantized copy: > 0, and smaller than the fp32 target
    assert 0 < metric(srv, "memory_bytes", component="draft_weights") < params
    assert metric(srv, "memory_bytes", component="target_kv") == \
        state.worker.engine.cache.nbytes()
    assert metric(srv, "memory_bytes", component="peak_rss") > params


def test_concurrent_streams_complete_and_equal_sequential(
        tiny_server: tuple[BackgroundServer, Any]) -> None:
    """12 streaming clients at once over 4 cache rows (8 queue): every request completes and
    each greedy text equals the same request sent alone."""
    srv, state = tiny_server
    c = client(srv)
    prompts = [" ".join(f"t{(7 * i + j) % 90 + 3}" for j in range(2 + i % 5)) for i in range(12)]
    start = time.perf_counter()
    alone = [stream_completion(c, p, 24) for p in prompts]
    sequential_s = time.perf_counter() - start
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: stream_completion(c, p, 24), prompts, timeout=120))
    concurrent_s = time.perf_counter() - start
    assert together == alone
    assert all(finish == "length" and len(text.split()) == 24 for text, finish in together)
    assert wait_for(lambda: metric(srv, "num_requests_running") == 0, 5)
    assert not state.worker.engine.busy and state.inflight == 0
    print(f"\nload test: {len(prompts)} streaming requests, concurrency {len(prompts)} over "
          f"{state.worker.engine.max_batch} rows, all complete; wall {concurrent_s:.2f} s "
          f"(one at a time {sequential_s:.2f} s)")


def slow_down(engine: Any, monkeypatch: pytest.MonkeyPatch, seconds: float = 0.02) -> None:
    """Make every engine step last `seconds` more: 200 tokens then take seconds, so a client
    that leaves early leaves long before its generation would have ended."""
    step = engine.step

    def slow_step() -> Any:
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def test_disconnect_mid_stream_frees_the_row(tiny: LoadedModel,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(tiny, max_batch=2) as (srv, state):
        engine = state.worker.engine
        slow_down(engine, monkeypatch)
        with httpx.Client(timeout=30) as http, http.stream(
                "POST", f"{srv.url}/v1/completions",
                json={"model": "tiny", "prompt": "t3 t4", "max_tokens": 200, "temperature": 0,
                      "stream": True, "logit_bias": NO_EOS}) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if events == 2:
                    assert metric(srv, "num_requests_running") == 1
                    break  # abandoning the body closes the connection: the client is gone
        assert wait_for(lambda: metric(srv, "num_requests_running") == 0, 3)
        assert engine.active == [] and engine.cache.lengths == [0, 0] and not engine.busy
        assert metric(srv, "request_success_total", finished_reason="abort") == 1
        assert metric(srv, "generation_tokens_total") < 200
        assert wait_for(lambda: state.inflight == 0, 3)


def test_metrics_expose_the_controllers_guard(tiny: LoadedModel) -> None:
    """Under --k auto, /metrics reads the guard's count of holds at each scrape; with a fixed k
    (no controller) the series is absent."""
    with serving(tiny, max_batch=2) as (srv, state):
        controller = state.worker.engine.controller
        assert controller is not None and controller.guard is not None
        assert "spec_decode_guard_holds{" in httpx.get(f"{srv.url}/metrics").text
        controller.guard.holds = 3
        assert metric(srv, "spec_decode_guard_holds") == 3
    with serving(tiny, auto=False) as (srv, _):
        assert "spec_decode_guard_holds" not in httpx.get(f"{srv.url}/metrics").text


def test_client_gone_before_a_whole_reply_cancels(tiny: LoadedModel,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(tiny, max_batch=2) as (srv, state):
        engine = state.worker.engine
        slow_down(engine, monkeypatch)
        body = {"model": "tiny", "prompt": "t3 t4", "max_tokens": 200, "temperature": 0,
                "logit_bias": NO_EOS}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(f"{srv.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        assert wait_for(lambda: metric(srv, "request_success_total",
                                       finished_reason="abort") == 1, 3)
        assert wait_for(lambda: not engine.busy and state.inflight == 0, 3)
        assert engine.cache.lengths == [0, 0]


def test_queue_full_is_429_and_the_rest_complete(tiny: LoadedModel,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(tiny, max_batch=1, max_queue=1) as (srv, state):
        gate = threading.Event()
        step = state.worker.engine.step

        def gated_step() -> Any:
            gate.wait(30)
            return step()

        monkeypatch.setattr(state.worker.engine, "step", gated_step)
        c = client(srv)
        streams = [c.completions.create(model="tiny", prompt="t3 t4", max_tokens=4, stream=True,
                                        temperature=0) for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as refused:
            c.completions.create(model="tiny", prompt="t3 t4", max_tokens=4)
        assert refused.value.status_code == 429
        body: Any = refused.value.body
        assert body["type"] == "rate_limit_error" and "full" in body["message"]
        assert refused.value.response.headers["Retry-After"] == "1"
        assert metric(srv, "requests_refused_total", reason="server_busy") == 1
        gate.set()
        for stream in streams:
            finishes = [ch.choices[0].finish_reason for ch in stream if ch.choices]
            assert finishes[-1] in ("stop", "length")
        assert c.completions.create(model="tiny", prompt="t3 t4", max_tokens=4).choices


def test_one_token_prompt(tiny_server: tuple[BackgroundServer, Any]) -> None:
    """A prompt of one token has nothing to prefill: it still joins a row and completes."""
    srv, _ = tiny_server
    done = client(srv).completions.create(model="tiny", prompt="t3", max_tokens=5,
                                          temperature=0, logit_bias=NO_EOS)
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 5


def test_api_key_required_when_set(tiny: LoadedModel) -> None:
    with serving(tiny, drafter="none", api_key="s3cret") as (srv, _):
        with pytest.raises(openai.AuthenticationError) as denied:
            client(srv, "wrong").models.list()
        assert denied.value.status_code == 401
        body: Any = denied.value.body
        assert body["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/metrics").status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes stay open
        ok = client(srv, "s3cret").completions.create(model="tiny", prompt="t3 t4", max_tokens=3)
        assert ok.choices[0].finish_reason in ("stop", "length")


def test_smollm_chat_through_the_server_equals_plain_decoding(smollm: LoadedModel) -> None:
    """SmolLM2 with the int8 drafter at a fixed k = 3: greedy text over HTTP (streamed and not)
    equals plain decoding in-process, token for token. (Fixed k: under the controller, whether
    anything is drafted depends on this machine's measured timings, and the accepted-tokens
    check needs drafts; the controller's losslessness is tested in test_batch.)"""
    question = "Name three colours."
    tok = smollm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
    eos = tuple(sorted(set(tok.eos_ids) | set(smollm.model.cfg.eos_token_ids)))
    gen = Generation(smollm.model, tok, ids, SamplingParams(max_tokens=24), None, 0, eos)
    expected = "".join(out.text for out in gen.run())
    with serving(smollm, max_batch=2, max_seq_len=512, k=3, auto=False) as (srv, _):
        c = client(srv)
        name = c.models.list().data[0].id
        messages: Any = [{"role": "user", "content": question}]
        plain = c.chat.completions.create(model=name, messages=messages, max_tokens=24,
                                          temperature=0)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=name, messages=messages, max_tokens=24, temperature=0, stream=True)
            if ch.choices)
        assert_identical_outputs(
            [plain.choices[0].message.content, streamed], [expected, expected],
            int(metric(srv, "spec_decode_num_draft_tokens_total")),
            int(metric(srv, "spec_decode_num_accepted_tokens_total")), "int8 k=3 over HTTP")


def test_serve_caps_each_step_at_1_5_plain_steps_unless_told_otherwise(tmp_path: Path) -> None:
    import argparse

    from specdecode.cli.serve import options_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for argv, cap in (([], 1.5), (["--max-step-cost", "2"], 2.0),
                      (["--max-step-cost", "inf"], float("inf"))):
        args = parser.parse_args(["serve", "--model", str(tmp_path), *argv])
        assert options_from_args(args).drafter.max_step_cost == cap


def test_serve_cli_refuses_bad_options(tmp_path: Path) -> None:
    import argparse

    from specdecode.cli.serve import register
    from specdecode.errors import SpecDecodeError

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for argv, needle in ((["--max-batch", "0"], "--max-batch"), (["--k", "x"], "--k"),
                         (["--port", "70000"], "--port"),
                         (["--max-step-cost", "0.9"], "--max-step-cost"),
                         (["--header-timeout", "0"], "--header-timeout"),
                         (["--body-timeout", "-1"], "--body-timeout"),
                         (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
                         (["--max-prompt-bytes", "0"], "--max-prompt-bytes")):
        args = parser.parse_args(["serve", "--model", str(tmp_path), *argv])
        with pytest.raises(SpecDecodeError, match=needle):
            args.func(args)
