"""`specdecode audit --endpoint URL --reference URL` (bench.http_audit) against small fake
OpenAI-compatible servers on loopback: replies that are a function of the prompt (and seed),
with deliberately broken variants (a reply that differs at a known token, a server that fails a
request, one whose sampled distribution is skewed, one whose replies change with its load), each
of which the audit must catch; and a real run against vLLM in tests/test_vllm_integration.py's
servers is in docs/measurements/vllm.md."""

from __future__ import annotations

import asyncio
import json
import random
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specdecode.bench.http_audit import first_difference
from specdecode.server.background import BackgroundServer
from tests.cli_run import run_cli


@dataclass
class Behaviour:
    """How a fake server answers."""

    token_ids: bool = True  # honours return_token_ids (else: 400 on it, as a strict server)
    differ_on: str | None = None  # a prompt whose reply differs from the reference's at token 5
    fail_on: str | None = None  # a prompt answered with a 500
    skew: float = 0.0  # sampled: probability of moving the second token to a rare one
    load_sensitive: bool = False  # replies differ while more than one request is in flight


def reply_ids(prompt: str, n: int, seed: int | None, temperature: float,
              skew: float) -> list[int]:
    """The "model": greedy ids from the prompt; sampled ids from the seed."""
    base = zlib.crc32(prompt.encode())
    if temperature == 0:
        return [(base + 7 * i) % 1000 for i in range(n)]
    rng = random.Random(seed)
    ids = [rng.choice([1, 2, 3]), rng.choice([4, 5, 6, 7])][:n]
    if skew and rng.random() < skew:
        ids[-1] = 99
    return ids


def fake_app(b: Behaviour) -> Starlette:
    in_flight = [0]

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        if "return_token_ids" in body and not b.token_ids:
            return JSONResponse({"error": {"message": "unknown field return_token_ids"}},
                                status_code=400)
        prompt = body["messages"][0]["content"]
        if prompt == b.fail_on:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        in_flight[0] += 1
        await asyncio.sleep(0.01)
        busy = in_flight[0] > 1
        in_flight[0] -= 1
        ids = reply_ids(prompt, body["max_tokens"], body.get("seed"), body["temperature"],
                        b.skew)
        if (prompt == b.differ_on and len(ids) > 5) or (b.load_sensitive and busy):
            ids[5:] = [i + 1 for i in ids[5:]]
        choice = {"index": 0, "message": {"role": "assistant",
                                          "content": " ".join(f"w{i}" for i in ids)},
                  "finish_reason": "length"}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        return JSONResponse({"choices": [choice]})

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"])])


@contextmanager
def servers(endpoint: Behaviour, reference: Behaviour) -> Iterator[tuple[str, str]]:
    with BackgroundServer(fake_app(endpoint)) as e, BackgroundServer(fake_app(reference)) as r:
        yield e.url, r.url


def workload(tmp_path: Path) -> Path:
    path = tmp_path / "w.jsonl"
    lines = [{"id": f"p{i}", "category": "c", "prompt": f"prompt number {i}"} for i in range(6)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def audit(tmp_path: Path, endpoint: Behaviour, reference: Behaviour, *extra: str
          ) -> tuple[int, dict, str]:
    with servers(endpoint, reference) as (e, r):
        code, out, err = run_cli(["audit", "--endpoint", e, "--reference", r, "--workload",
                                  str(workload(tmp_path)), "--max-tokens", "12", "--json",
                                  "--out", str(tmp_path / "replies.jsonl"), *extra])
    return code, json.loads(out) if out.strip() else {}, err


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference("abc", "ab") == 2


def test_identical_servers_pass_and_every_reply_is_kept(tmp_path: Path) -> None:
    code, result, err = audit(tmp_path, Behaviour(), Behaviour())
    assert code == 0 and result["verdict"] == "PASS", err
    assert len(result["comparisons"]) == 6 and all(c["identical"] for c in result["comparisons"])
    assert all(c["unit"] == "token" for c in result["comparisons"])
    logged = (tmp_path / "replies.jsonl").read_text().splitlines()
    assert len(logged) == 12  # 6 prompts x 2 servers


def test_a_reply_that_differs_is_caught_with_its_position_and_both_texts(tmp_path: Path) -> None:
    code, result, _ = audit(tmp_path, Behaviour(differ_on="prompt number 3"), Behaviour())
    assert code == 1 and result["verdict"] == "FAIL"
    bad = [c for c in result["comparisons"] if not c["identical"]]
    assert [c["prompt_id"] for c in bad] == ["p3"] and bad[0]["position"] == 5
    assert bad[0]["endpoint_text"] != bad[0]["reference_text"]


def test_without_token_ids_the_texts_are_compared(tmp_path: Path) -> None:
    code, result, err = audit(tmp_path, Behaviour(token_ids=False, differ_on="prompt number 1"),
                              Behaviour())
    assert code == 1 and "texts compared" in err
    bad = [c for c in result["comparisons"] if not c["identical"]]
    assert bad[0]["unit"] == "character" and bad[0]["prompt_id"] == "p1"


def test_a_failed_request_is_reported_for_that_request(tmp_path: Path) -> None:
    code, result, _ = audit(tmp_path, Behaviour(fail_on="prompt number 2"), Behaviour())
    assert code == 1 and result["verdict"] == "INCOMPLETE" and result["errors"] == 1
    failed = [c for c in result["comparisons"] if c["identical"] is None]
    assert [c["prompt_id"] for c in failed] == ["p2"] and "HTTP 500" in failed[0]["error"]
    assert sum(1 for c in result["comparisons"] if c["identical"]) == 5


def test_a_reference_that_changes_with_load_is_reported_at_concurrency(tmp_path: Path) -> None:
    code, result, _ = audit(tmp_path, Behaviour(), Behaviour(load_sensitive=True),
                            "--concurrency", "4")
    assert result["reference_self"] is not None
    assert not all(c["identical"] for c in result["reference_self"])
    code, result, _ = audit(tmp_path, Behaviour(), Behaviour(), "--concurrency", "4")
    assert code == 0 and all(c["identical"] for c in result["reference_self"])


@pytest.mark.parametrize("skew", [0.0, 0.5])
def test_sampled_distributions_are_compared(tmp_path: Path, skew: float) -> None:
    """Broken variant: an endpoint whose second token goes to a rare value half the time."""
    code, result, err = audit(tmp_path, Behaviour(skew=skew), Behaviour(), "--temperature",
                              "1.0", "--samples", "300", "--tokens", "2", "--concurrency", "8")
    sampled = result["sampled"]
    assert sampled is not None, err
    if skew:
        assert code == 1 and result["verdict"] == "FAIL" and sampled["p_value"] < 1e-3
    else:
        assert code == 0 and result["verdict"] == "PASS" and sampled["samples"] == 300


def test_endpoint_arguments_are_checked(tmp_path: Path) -> None:
    code, _, err = run_cli(["audit", "--endpoint", "http://127.0.0.1:9"])
    assert code == 2 and "--reference" in err
    code, _, err = run_cli(["audit", "--endpoint", "ftp://x", "--reference", "http://a"])
    assert code == 2 and "http(s) URL" in err
    code, _, err = run_cli(["audit", "--endpoint", "http://127.0.0.1:9", "--reference",
                            "http://127.0.0.1:9"])
    assert code == 2 and "cannot reach http://127.0.0.1:9/v1/models" in err
