"""Memory after bursts of long prompts (issue 26, item 4): tokenizing a long prompt leaves the
freed memory resident in glibc's arenas (retention, not a leak); the server gives it back with
malloc_trim after every long prompt. The soak over a real server is
benchmarks/server_soak.py (figures in docs/measurements/server-soak.md)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from specdecode.models.loading import LoadedModel
from specdecode.server import allocator
from specdecode.server.state import LONG_PROMPT_BYTES
from tests.test_server import serving, tiny  # noqa: F401  (tiny: a fixture)

glibc_only = pytest.mark.skipif(allocator._malloc_trim() is None,
                                reason="needs glibc's malloc_trim")


def rss_bytes() -> int:
    text = Path("/proc/self/status").read_text(encoding="ascii")
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


@glibc_only
def test_trim_gives_back_what_tokenizing_a_long_prompt_left_resident() -> None:
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(96)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    allocator.trim()
    before = rss_bytes()
    # a thread of its own, as the server's long-prompt thread: its arena keeps what it freed
    worker = threading.Thread(target=lambda: tok.encode_batch(["t2 t3 t4 t5 " * 100_000]))
    worker.start()
    worker.join()
    retained = rss_bytes() - before
    assert allocator.trim()
    released = retained - (rss_bytes() - before)
    assert retained > 16 << 20  # what the freed tokens left resident: tens of MB
    # most of it: in a process with other threads (the full suite) RSS moves for other reasons
    assert released > retained * 0.5


def test_trim_is_harmless_where_there_is_no_malloc_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_malloc_trim", lambda: None)
    assert allocator.trim() is False
    assert allocator.trimming(lambda: 7)() == 7


def test_the_server_trims_after_each_long_prompt_only(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    calls: list[int] = []

    def counted() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(allocator, "trim", counted)
    long_text = "t3 " * (LONG_PROMPT_BYTES // 3 + 1)  # tokenized, then too long for the window
    with serving(tiny, drafter="none", max_prompt_bytes=1 << 20) as (srv, _):
        url = f"{srv.url}/v1/completions"
        short = httpx.post(url, json={"model": "tiny", "prompt": "t3 t4", "max_tokens": 2},
                           timeout=60)
        assert short.status_code == 200 and calls == []
        refused = httpx.post(url, json={"model": "tiny", "prompt": long_text, "max_tokens": 2},
                             timeout=60)
        assert refused.status_code == 400 and calls == [1]
        assert refused.json()["error"]["code"] == "context_length_exceeded"
