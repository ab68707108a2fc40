"""`serve --drafter suffix` (issue 24, item 4): one store of earlier requests per server, isolated
per user by default (server.isolation), capped, and reported by /metrics.

A tiny random checkpoint (word-level tokens t0..t95) at a fixed k: greedy, its drafts are
deterministic (the suffix drafter's tree depends on the text it reads, never on timing), so a
request that reads no stored text drafts and accepts exactly what the same request does on an
empty store, and one that reads its earlier twin accepts more.
"""

from __future__ import annotations

import argparse
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.errors import SpecDecodeError
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from specdecode.server.isolation import Isolation, credential
from specdecode.server.state import ServeOptions, ServerState
from specdecode.suffix import SuffixStore
from tests.conftest import make_checkpoint
from tests.fakes import LookupTarget
from tests.test_server import NO_EOS, serving, slow_down, wait_for

TOKENS = 24
PROMPT = " ".join(f"t{(37 * i) % 90 + 3}" for i in range(12))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny checkpoint whose greedy text wanders before it repeats (scale 1.5: at the default
    2.5 it falls into a two-token loop at once, which its own context already predicts)."""
    return load_model(str(make_checkpoint(tmp_path_factory.mktemp("suffix-server") / "tiny",
                                          scale=1.5)))


@contextmanager
def suffix_server(loaded: LoadedModel, **options: Any) -> Iterator[tuple[Any, ServerState]]:
    """A server with the suffix drafter at a fixed k of 4 (deterministic drafts)."""
    with serving(loaded, drafter="suffix", auto=False, k=4, **options) as served:
        yield served


def metric(srv: Any, name: str, key: str | None = None, **labels: str) -> float:
    """One series from /metrics (0 when absent), with `key` as the bearer token if given."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    text = httpx.get(f"{srv.url}/metrics", headers=headers, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


@dataclass(frozen=True)
class Reply:
    text: str
    accepted: float  # draft tokens accepted while it ran (requests are sent one at a time)


def ask(srv: Any, key: str | None = "unused", user: str | None = None, prompt: str = PROMPT,
        max_tokens: int = TOKENS) -> Reply:
    before = metric(srv, "spec_decode_num_accepted_tokens_total", key)
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "logit_bias": NO_EOS}
    if user is not None:
        body["user"] = user
    response = httpx.post(f"{srv.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return Reply(response.json()["choices"][0]["text"],
                 metric(srv, "spec_decode_num_accepted_tokens_total", key) - before)


def store_of(state: ServerState) -> SuffixStore:
    store = getattr(state.served.make_drafter, "store", None)
    assert isinstance(store, SuffixStore)
    return store


def watch_views(store: SuffixStore, monkeypatch: pytest.MonkeyPatch) -> dict[str | None, set[bool]]:
    """Record, per scope a drafter asked the store for, whether it found stored text there."""
    seen: dict[str | None, set[bool]] = {}
    view = store.view

    @contextmanager
    def watched(key: str | None) -> Iterator[Any]:
        with view(key) as found:
            seen.setdefault(key, set()).add(found is not None)
            yield found

    monkeypatch.setattr(store, "view", watched)
    return seen


def test_by_default_a_user_drafts_only_from_their_own_earlier_requests(
        model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is isolation per user: Alice's repeated prompt is drafted from her first
    request (more accepted); Bob's identical prompt, and Alice's `user` presented with another
    key, read no stored text and draft exactly as a cold request. The store keys are digests:
    no raw key or user id is kept, nor shown by /metrics."""
    assert drafter_factory("suffix", LookupTarget()).isolation == "user"  # type: ignore[union-attr]
    with suffix_server(model) as (srv, state):
        assert state.served.isolation.mode == "user"
        store = store_of(state)
        seen = watch_views(store, monkeypatch)
        cold = ask(srv, "key-1", "alice")
        warm = ask(srv, "key-1", "alice")
        bob = ask(srv, "key-1", "bob")
        other_key = ask(srv, "key-2", "alice")
        anonymous = ask(srv, None, None)
        assert cold.text == warm.text == bob.text == other_key.text == anonymous.text
        assert warm.accepted > cold.accepted
        assert bob.accepted == other_key.accepted == anonymous.accepted == cold.accepted
        scope = state.served.isolation.key
        alice, bob_key = scope("key-1", "alice"), scope("key-1", "bob")
        assert seen[alice] == {False, True}  # cold first, then her first request
        assert seen[bob_key] == {False} == seen[scope("key-2", "alice")] == seen[scope(None, None)]
        assert None not in seen  # the shared scope is never read under isolation
        assert len(store) == 5
        for key in (alice, bob_key):
            with store.view(key) as found:
                assert found is not None
        keys = [str(key) for key in store._roots]  # the scopes held: digests only
        text = httpx.get(f"{srv.url}/metrics").text
        for raw in ("key-1", "key-2", "alice", "bob"):
            assert not any(raw in key for key in keys) and raw not in text
        assert 'suffix_store_info{isolation="user",model_name="tiny"} 1.0' in text


def test_the_configured_api_key_and_the_user_field_make_the_scope(model: LoadedModel) -> None:
    """With --api-key every client presents the same key: the `user` field tells users apart."""
    with suffix_server(model, api_key="s3cret") as (srv, state):
        cold = ask(srv, "s3cret", "alice")
        assert ask(srv, "s3cret", "alice").accepted > cold.accepted
        assert ask(srv, "s3cret", "bob").accepted == cold.accepted
        assert not any("s3cret" in str(key) for key in store_of(state)._roots)


def test_shared_mode_lets_every_request_draft_from_every_earlier_one(
        model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    with suffix_server(model, suffix_isolation="shared") as (srv, state):
        seen = watch_views(store_of(state), monkeypatch)
        cold = ask(srv, "key-1", "alice")
        bob = ask(srv, "key-2", "bob")
        assert bob.text == cold.text and bob.accepted > cold.accepted
        assert ask(srv, None, None).accepted == bob.accepted
        assert list(seen) == [None]  # one scope, the shared one
        assert 'isolation="shared"' in httpx.get(f"{srv.url}/metrics").text


def test_metrics_show_the_store_and_it_never_exceeds_its_caps(model: LoadedModel) -> None:
    """32 requests of 8 users, 4 at a time, into a store of 32 KiB and 4 requests: /metrics,
    scraped throughout, never shows it over either cap; every request was stored then evicted
    or is still held; its bytes count as draft memory."""
    with suffix_server(model, suffix_mib=1 / 32, suffix_requests=4) as (srv, state):
        store = store_of(state)
        assert metric(srv, "suffix_store_requests") == 0 < metric(srv, "suffix_store_bytes")
        assert metric(srv, "suffix_store_max_bytes") == 32 * 1024
        assert metric(srv, "suffix_store_max_requests") == 4
        peaks = {"bytes": 0.0, "requests": 0.0}
        done = threading.Event()

        def scrape() -> None:
            while not done.is_set():
                peaks["bytes"] = max(peaks["bytes"], metric(srv, "suffix_store_bytes"))
                peaks["requests"] = max(peaks["requests"], metric(srv, "suffix_store_requests"))

        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            prompts = [" ".join(f"t{(11 * i + 5 * j) % 90 + 3}" for j in range(6 + i % 7))
                       for i in range(32)]
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: ask(srv, "unused", f"user{i % 8}", prompts[i], 16),
                              range(32), timeout=120))
        finally:
            done.set()
            scraper.join(30)
        held = metric(srv, "suffix_store_requests")
        assert 0 < held <= 4 and peaks["requests"] <= 4
        assert 0 < metric(srv, "suffix_store_bytes") <= 32 * 1024 and peaks["bytes"] <= 32 * 1024
        assert held + metric(srv, "suffix_store_evicted_requests_total") == 32
        assert metric(srv, "memory_bytes", component="draft_store") == \
            metric(srv, "suffix_store_bytes") == store.nbytes()
        print(f"\nsuffix store under load: peak {peaks['bytes']:.0f} bytes of {32 * 1024}, "
              f"peak {peaks['requests']:.0f} requests of 4, "
              f"{metric(srv, 'suffix_store_evicted_requests_total'):.0f} evicted")


def test_without_the_suffix_drafter_there_are_no_store_series(model: LoadedModel) -> None:
    with serving(model, drafter="ngram", auto=False, k=4) as (srv, _):
        text = httpx.get(f"{srv.url}/metrics").text
        assert "suffix_store" not in text and 'component="draft_store"' not in text


def test_only_requests_that_finish_are_stored(model: LoadedModel,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose client leaves mid-stream, and one whose engine step fails, leave
    nothing in the store (they drafted and committed text first); a finished one is stored."""
    with suffix_server(model, max_batch=2) as (srv, state):
        engine = state.worker.engine
        slow_down(engine, monkeypatch)
        with httpx.Client(timeout=30) as http, http.stream(
                "POST", f"{srv.url}/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                      "stream": True, "logit_bias": NO_EOS}) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if events == 4:  # a few steps drafted and committed: the drafter holds text
                    break
        assert wait_for(lambda: metric(srv, "request_success_total",
                                       finished_reason="abort") == 1, 5)
        assert wait_for(lambda: not engine.busy, 5)
        assert len(store_of(state)) == 0 == metric(srv, "suffix_store_requests")

        steps = {"n": 0}
        step = engine.step

        def failing_step() -> Any:  # fails the request's fourth step
            steps["n"] += 1
            if steps["n"] == 4:
                raise RuntimeError("injected")
            return step()

        monkeypatch.setattr(engine, "step", failing_step)
        failed = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
            "logit_bias": NO_EOS})
        assert failed.status_code == 500
        assert len(store_of(state)) == 0
        ask(srv)
        assert len(store_of(state)) == 1 == metric(srv, "suffix_store_requests")


def test_bad_store_options_are_one_clear_error_before_the_model_loads(tmp_path: Path) -> None:
    for options, needle in (({"suffix_mib": 0.0}, "--suffix-mib"),
                            ({"suffix_mib": -1.0}, "--suffix-mib"),
                            ({"suffix_mib": float("nan")}, "--suffix-mib"),
                            ({"suffix_mib": float("inf")}, "--suffix-mib"),
                            ({"suffix_requests": 0}, "--suffix-requests"),
                            ({"suffix_requests": -3}, "--suffix-requests"),
                            ({"suffix_isolation": "nobody"}, "--suffix-isolation")):
        with pytest.raises(SpecDecodeError, match=needle):
            ServeOptions(drafter=DrafterOptions("suffix", **options)).check()
    from specdecode.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for argv, needle in ((["--suffix-mib", "0"], "--suffix-mib"),
                         (["--suffix-mib", "-2"], "--suffix-mib"),
                         (["--suffix-requests", "0"], "--suffix-requests")):
        # tmp_path is no checkpoint: the option is refused before any loading is tried
        args = parser.parse_args(["serve", "--model", str(tmp_path), "--drafter", "suffix",
                                  *argv])
        with pytest.raises(SpecDecodeError, match=needle):
            args.func(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--suffix-isolation", "nobody"])


def test_serve_defaults_isolate_and_take_the_registrys_caps(tmp_path: Path) -> None:
    from specdecode.cli.serve import options_from_args, register
    from specdecode.limits import SUFFIX_STORE_MIB, SUFFIX_STORE_REQUESTS

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", str(tmp_path), "--drafter", "suffix"])
    factory = drafter_factory(options_from_args(args).drafter, LookupTarget())
    assert factory is not None and factory.store is not None
    assert factory.isolation == "user"
    assert factory.store.max_bytes == SUFFIX_STORE_MIB * 2**20
    assert factory.store.max_requests == SUFFIX_STORE_REQUESTS
    args = parser.parse_args(["serve", "--model", str(tmp_path), "--drafter", "suffix",
                              "--suffix-isolation", "shared", "--suffix-mib", "8",
                              "--suffix-requests", "50"])
    factory = drafter_factory(options_from_args(args).drafter, LookupTarget())
    assert factory is not None and factory.store is not None
    assert (factory.isolation, factory.store.max_bytes, factory.store.max_requests) == \
        ("shared", 8 * 2**20, 50)


def test_scope_keys() -> None:
    isolation = Isolation()
    key = isolation.key
    assert key("k", "alice") == key("k", "alice") != key("k", "bob") != key("j", "bob")
    assert key("k", None) != key("k", "") and key(None, "k") != key("k", None)
    assert key("a", "b:c") != key("a:b", "c")  # length-prefixed: no two pairs join alike
    assert len(key(None, None) or "") == 32 and "alice" not in (key("k", "alice") or "")
    assert Isolation().key("k", "alice") != key("k", "alice")  # a secret per server
    assert Isolation("shared").key("k", "alice") is None
    with pytest.raises(ValueError, match="isolation"):
        Isolation("per-request")
    assert credential({"authorization": "Bearer abc "}) == "abc"
    assert credential({"authorization": "bearer abc"}) == "abc"
    assert credential({"authorization": "Basic Zm9v"}) == "Basic Zm9v"
    assert credential({}) is None
