"""`bench --endpoint` against a real third-party server: llama-cpp-python's OpenAI-compatible
server (`python -m llama_cpp.server`, its [server] extra), plain and with its prompt-lookup
drafting, on a small random Llama written as GGUF. Loopback only; two prompts, 12 tokens each.
It exports no Prometheus metrics, so acceptance must come out unknown (None), never zero.

Skips without llama-cpp-python's server dependencies unless SPECDECODE_REQUIRE_LLAMACPP=1 (CI
installs them with scripts/install_llamacpp.sh).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_checkpoint

if os.environ.get("SPECDECODE_REQUIRE_LLAMACPP") != "1":
    pytest.importorskip("llama_cpp")
    pytest.importorskip("pydantic_settings")
    pytest.importorskip("sse_starlette")

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # spawns llama-cpp-python's server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_cpp_server(gguf: Path, *extra: str) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
         "--port", str(port), "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", "256",
         "--verbose", "False", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"llama_cpp.server exited: {proc.stderr.read()!r}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{base}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError("llama_cpp.server did not answer within 60 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_bench_endpoint_measures_llama_cpp_server_with_and_without_lookup(tmp_path: Path
                                                                          ) -> None:
    from specdecode.models.gguf_write import write_gguf
    from tests.test_bench_endpoint import run_cli

    folder = make_checkpoint(tmp_path / "t", seed=3, vocab_size=300, hidden_size=64,
                             intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256)
    gguf = tmp_path / "t.gguf"
    write_gguf(folder, gguf)
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "abab abab abab", "id": "a"}\n'
                        '{"prompt": "hello hello hello", "id": "b"}\n', encoding="utf-8")
    with llama_cpp_server(gguf) as plain, llama_cpp_server(
            gguf, "--draft_model", "prompt-lookup-decoding",
            "--draft_model_num_pred_tokens", "4") as lookup:
        out = tmp_path / "run"
        code, stdout, err = run_cli([
            "bench", "--endpoint", f"plain={plain}", "--endpoint", f"lookup={lookup}",
            "--workload", str(workload), "--no-chat-template", "--max-tokens", "12",
            "--out", str(out), "--quiet", "--resamples", "100"])
    assert code == 0, err
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    names = {c["spec"]["name"] for c in report["analysis"]["configs"]}
    assert names == {"plain", "lookup"}
    on = next(c for c in report["analysis"]["configs"] if c["spec"]["name"] == "lookup")
    assert on["acceptance"]["alpha"] is None  # no metrics endpoint: unknown, not zero
    assert "lookup" in stdout
