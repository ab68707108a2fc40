"""Bad input never reaches the engine: each case of the table gets its 4xx and an OpenAI error
body naming the field; a fuzz run from the server's own OpenAPI schema (schemathesis, loopback,
bounded) never gets a 5xx or a hang."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from specdecode.limits import MAX_SEED, MIN_SEED
from specdecode.models.loading import LoadedModel
from specdecode.server import prepare
from specdecode.server.background import BackgroundServer
from specdecode.server.openai_errors import APIError
from specdecode.server.prometheus import REFUSED_REASONS
from specdecode.server.protocol import REFUSED_FIELDS, ChatCompletionRequest, Refused
from specdecode.server.state import ServerState
from tests.test_server import metric, serving, tiny, wait_for  # noqa: F401  (tiny: a fixture)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK = {"model": "tiny", "prompt": "t3 t4", "max_tokens": 2}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "t3"}], "max_tokens": 2}

# (id, path, body: dict or raw bytes, status, error param, error code)
CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("invalid-json", COMPLETIONS, b'{"model": "tiny",', 400, None, "invalid_json"),
    ("not-an-object", COMPLETIONS, b"[1, 2]", 400, None, "invalid_body"),
    # issue 37: these two had code null, counted as reason http_400
    ("not-utf8", CHAT, b'{"model": "\xff\xfe", "messages": []}', 400, None, "invalid_json"),
    ("nested-100k-deep", CHAT, b'{"model": "tiny", "messages": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", 400, None, "invalid_json"),
    ("missing-model", COMPLETIONS, {"prompt": "t3"}, 400, "model", "missing_field"),
    ("missing-prompt", COMPLETIONS, {"model": "tiny"}, 400, "prompt", "missing_field"),
    ("missing-messages", CHAT, {"model": "tiny"}, 400, "messages", "missing_field"),
    ("temperature-wrong-type", COMPLETIONS, {**OK, "temperature": "hot"}, 400, "temperature",
     "invalid_value"),
    ("stream-wrong-type", COMPLETIONS, {**OK, "stream": 1}, 400, "stream", "invalid_value"),
    ("max-tokens-wrong-type", COMPLETIONS, {**OK, "max_tokens": "2"}, 400, "max_tokens",
     "invalid_value"),
    ("content-wrong-type", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": 3}]},
     400, "messages[0].content", "invalid_value"),
    ("unknown-role", CHAT, {**OK_CHAT, "messages": [{"role": "root", "content": "t3"}]}, 400,
     "messages[0].role", "invalid_value"),
    ("no-messages", CHAT, {**OK_CHAT, "messages": []}, 400, "messages", "invalid_value"),
    ("unknown-model", COMPLETIONS, {**OK, "model": "../../etc/passwd"}, 404, "model",
     "model_not_found"),
    ("unknown-model-chat", CHAT, {**OK_CHAT, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("temperature-high", COMPLETIONS, {**OK, "temperature": 2.5}, 400, "temperature",
     "invalid_value"),
    ("temperature-negative", CHAT, {**OK_CHAT, "temperature": -0.1}, 400, "temperature",
     "invalid_value"),
    ("temperature-nan", COMPLETIONS, b'{"model": "tiny", "prompt": "t3", "temperature": NaN}',
     400, "temperature", "invalid_value"),
    ("top-p-zero", COMPLETIONS, {**OK, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("top-p-high", COMPLETIONS, {**OK, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("max-tokens-negative", COMPLETIONS, {**OK, "max_tokens": -5}, 400, "max_tokens",
     "invalid_value"),
    ("max-tokens-huge", COMPLETIONS, {**OK, "max_tokens": 10**12}, 400, "max_tokens",
     "context_length_exceeded"),
    ("max-completion-tokens-huge", CHAT, {**OK_CHAT, "max_completion_tokens": 100_000}, 400,
     "max_tokens", "context_length_exceeded"),
    ("prompt-over-context", COMPLETIONS, {**OK, "prompt": "t3 " * 400}, 400, "prompt",
     "context_length_exceeded"),
    ("chat-over-context", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "t3 " * 400}]},
     400, "messages", "context_length_exceeded"),
    ("empty-prompt", COMPLETIONS, {**OK, "prompt": ""}, 400, "prompt", "invalid_value"),
    ("token-id-outside-vocab", COMPLETIONS, {**OK, "prompt": [3, 96]}, 400, "prompt",
     "invalid_value"),
    ("batch-of-prompts", COMPLETIONS, {**OK, "prompt": ["t3", "t4"]}, 400, "prompt",
     "unsupported_value"),
    ("too-many-stops", COMPLETIONS, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "invalid_value"),
    ("empty-stop", COMPLETIONS, {**OK, "stop": ""}, 400, "stop", "invalid_value"),
    ("n-above-one", COMPLETIONS, {**OK, "n": 2}, 400, "n", "unsupported_value"),
    ("logprobs", CHAT, {**OK_CHAT, "logprobs": True}, 400, "logprobs", "unsupported_value"),
    ("tool-choice-required-without-tools", CHAT, {**OK_CHAT, "tools": [],
     "tool_choice": "required"}, 400, "tool_choice", "unsupported_value"),
    ("tool-choice-named-without-tools", CHAT, {**OK_CHAT, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, 400, "tool_choice", "unsupported_value"),
    # issue 37: chat took echo and best_of (and a null content) and ignored them with a 200
    ("chat-echo", CHAT, {**OK_CHAT, "echo": True}, 400, "echo", "unsupported_value"),
    ("chat-best-of", CHAT, {**OK_CHAT, "best_of": 2}, 400, "best_of", "unsupported_value"),
    ("completion-echo", COMPLETIONS, {**OK, "echo": True}, 400, "echo", "unsupported_value"),
    ("completion-best-of", COMPLETIONS, {**OK, "best_of": 3}, 400, "best_of",
     "unsupported_value"),
    ("completion-logprobs", COMPLETIONS, {**OK, "logprobs": 0}, 400, "logprobs",
     "unsupported_value"),
    ("completion-suffix", COMPLETIONS, {**OK, "suffix": ""}, 400, "suffix", "unsupported_value"),
    ("top-logprobs", CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs",
     "unsupported_value"),
    ("tools", CHAT, {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", "unsupported_value"),
    ("message-name", CHAT, {**OK_CHAT, "messages": [
        {"role": "user", "content": "t3"}, {"role": "user", "content": "t4", "name": "bo"}]},
     400, "messages[1].name", "unsupported_value"),
    ("null-content", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content", "invalid_value"),
    ("null-content-second", CHAT, {**OK_CHAT, "messages": [
        {"role": "user", "content": "t3"}, {"role": "user", "content": None}]}, 400,
     "messages[1].content", "invalid_value"),
    ("null-content-assistant", CHAT, {**OK_CHAT, "messages": [
        {"role": "user", "content": "t3"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "t4"}]}, 400, "messages[1].content", "invalid_value"),
    ("missing-content", CHAT, {**OK_CHAT, "messages": [{"role": "user"}]}, 400,
     "messages[0].content", "missing_field"),
    # no field is silently dropped: one the schema does not know is refused, named as sent
    ("unknown-field", COMPLETIONS, {**OK, "max_new_tokens": 5}, 400, "max_new_tokens",
     "unknown_field"),
    ("unknown-field-odd-name", CHAT, {**OK_CHAT, "str": 1}, 400, "str", "unknown_field"),
    ("suffix-on-chat", CHAT, {**OK_CHAT, "suffix": "x"}, 400, "suffix", "unknown_field"),
    ("unknown-message-field", CHAT, {**OK_CHAT, "messages": [
        {"role": "user", "content": "t3", "tool_calls": []}]}, 400, "messages[0].tool_calls",
     "unknown_field"),
    ("unknown-stream-option", COMPLETIONS, {**OK, "stream": True, "stream_options": {
        "continuous_usage_stats": True}}, 400, "stream_options.continuous_usage_stats",
     "unknown_field"),
    ("logit-bias-not-a-token", COMPLETIONS, {**OK, "logit_bias": {"abc": 1}}, 400, "logit_bias",
     "invalid_value"),
    ("logit-bias-superscript-digit", COMPLETIONS, {**OK, "logit_bias": {"\u00b2": 1}}, 400,
     "logit_bias", "invalid_value"),
    ("logit-bias-arabic-indic-digit", COMPLETIONS, {**OK, "logit_bias": {"\u0661": 1}}, 400,
     "logit_bias", "invalid_value"),
    ("logit-bias-5000-digits", COMPLETIONS, {**OK, "logit_bias": {"9" * 5000: 1}}, 400,
     "logit_bias", "invalid_value"),
    ("logit-bias-outside-vocab", COMPLETIONS, {**OK, "logit_bias": {"96": 1}}, 400,
     "logit_bias", "invalid_value"),
    ("logit-bias-signed", COMPLETIONS, {**OK, "logit_bias": {"+3": 1}}, 400, "logit_bias",
     "invalid_value"),
    ("logit-bias-range", COMPLETIONS, {**OK, "logit_bias": {"3": 500}}, 400, "logit_bias.3",
     "invalid_value"),
    ("penalty-range", COMPLETIONS, {**OK, "presence_penalty": 3}, 400, "presence_penalty",
     "invalid_value"),
    ("repetition-penalty-tiny", COMPLETIONS, {**OK, "repetition_penalty": 1e-300}, 400,
     "repetition_penalty", "invalid_value"),
    ("seed-huge", COMPLETIONS, {**OK, "seed": 2**70}, 400, "seed", "invalid_value"),
    ("response-format-unknown", CHAT, {**OK_CHAT, "response_format": {"type": "yaml"}}, 400,
     "response_format", "unsupported_value"),
    ("json-schema-invalid", CHAT, {**OK_CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400,
     "response_format.json_schema.schema", "invalid_value"),
    ("json-schema-missing", CHAT, {**OK_CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", "invalid_value"),
    ("guided-regex-invalid", COMPLETIONS, {**OK, "guided_regex": "a(b"}, 400, "guided_regex",
     "invalid_value"),
    ("guided-grammar-invalid", COMPLETIONS, {**OK, "guided_grammar": 'start: "a" | nope'}, 400,
     "guided_grammar", "invalid_value"),
    ("two-constraints", COMPLETIONS, {**OK, "guided_regex": "a", "guided_json": {}}, 400,
     "guided_regex", "invalid_value"),
    ("oversized-body", COMPLETIONS, {**OK, "prompt": "t3 " * 400_000}, 413, None,
     "request_too_large"),
]


@pytest.fixture(scope="module")
def plain_server(tiny: LoadedModel  # noqa: F811
                 ) -> Iterator[tuple[BackgroundServer, ServerState]]:
    """The tiny model without a drafter, rows of 64 tokens: every generation is short."""
    with serving(tiny, drafter="none", max_seq_len=64, max_batch=2) as served:
        yield served


@pytest.mark.parametrize(("path", "body", "status", "param", "code"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_4xx_with_openai_error(
        plain_server: tuple[BackgroundServer, ServerState], path: str, body: Any, status: int,
        param: str | None, code: str | None) -> None:
    srv, state = plain_server
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(srv.url + path, content=raw, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    assert not state.worker.engine.busy and state.inflight == 0


def test_every_refusal_is_counted_under_a_documented_reason(
        plain_server: tuple[BackgroundServer, Any]) -> None:
    """Issue 37's probe: a body that is not UTF-8 and one nested 100k deep are counted as
    invalid_json; whatever this module sent before, /metrics counts no reason outside
    REFUSED_REASONS (the list docs/serving.md gives: tests/test_server_docs.py)."""
    srv, _ = plain_server
    before = metric(srv, "requests_refused_total", reason="invalid_json")
    for body in (b'{"model": "\xff\xfe", "messages": []}', b"[" * 100_000 + b"]" * 100_000):
        response = httpx.post(srv.url + CHAT, content=body, timeout=30,
                              headers={"Content-Type": "application/json"})
        assert response.json()["error"]["code"] == "invalid_json", response.text
    assert metric(srv, "requests_refused_total", reason="invalid_json") == before + 2
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    reasons = set(re.findall(r'^requests_refused_total\{[^}]*reason="([^"]+)"', text, re.M))
    assert reasons and reasons <= REFUSED_REASONS, reasons


@pytest.mark.parametrize("which", [0, -1], ids=["first", "last"])
def test_refused_fields_with_neutral_values_are_accepted(
        plain_server: tuple[BackgroundServer, Any], which: int) -> None:
    """Every refused field sent with a value that asks for nothing (its first, then its last
    neutral value: null, false, 1, [], "none"...) is a normal 200 on both routes."""
    srv, _ = plain_server
    for path, base in ((COMPLETIONS, OK), (CHAT, OK_CHAT)):
        body = json.loads(json.dumps(base))
        for field in REFUSED_FIELDS[path]:
            head, _, rest = field.name.partition("[].")
            for item in (body[head] if rest else [body]):
                item[rest or head] = field.neutral[which]
        response = httpx.post(srv.url + path, json=body, timeout=30)
        assert response.status_code == 200, (body, response.text)


def test_response_format_json_is_implemented() -> None:
    """Issue 37, item 4: response_format json_object and json_schema are constrained output
    (docs/serving.md called them refused); another type is refused. (Over HTTP on SmolLM2:
    tests/test_constraints.py; the tiny model's tokenizer has no bytes for llguidance.)"""
    for fmt in ({"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}}}):
        req = ChatCompletionRequest.model_validate({**OK_CHAT, "response_format": fmt})
        prepare.check_refused(req)
        spec = prepare.constraint_spec(req)
        assert (spec is None) == (fmt["type"] == "text"), fmt
    yaml = ChatCompletionRequest.model_validate({**OK_CHAT, "response_format": {"type": "yaml"}})
    with pytest.raises(APIError, match="not supported"):
        prepare.check_refused(yaml)


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "9" * 5000, "96", " 3"])
def test_logit_bias_error_names_the_key(plain_server: tuple[BackgroundServer, Any],
                                        key: str) -> None:
    """Keys are ASCII decimal token ids below the vocabulary size: a Unicode digit (which
    str.isdigit accepts) or a number past Python's integer-string limit is a 400 whose message
    quotes the key (its first 20 characters), never a 500 or another token id."""
    srv, _ = plain_server
    response = httpx.post(srv.url + COMPLETIONS, json={**OK, "logit_bias": {key: 1}}, timeout=30)
    assert response.status_code == 400, response.text
    assert repr(key[:20]) in response.json()["error"]["message"]


def test_logit_bias_key_with_leading_zeros_is_its_id(
        plain_server: tuple[BackgroundServer, Any]) -> None:
    """'0...01' (5,001 digits) is token id 1, read without int()'s 4300-digit limit."""
    srv, _ = plain_server
    response = httpx.post(srv.url + COMPLETIONS, timeout=30,
                          json={**OK, "logit_bias": {"0" * 5000 + "1": 1}})
    assert response.status_code == 200, response.text


def test_tiny_temperature_is_greedy_not_nan(plain_server: tuple[BackgroundServer, Any]) -> None:
    """Logits divided by a temperature like 1e-300 overflow float32: such requests are greedy."""
    srv, _ = plain_server
    texts = set()
    for temperature in (0, 5e-324, 1e-300, 1e-6):
        response = httpx.post(srv.url + COMPLETIONS, timeout=30,
                              json={**OK, "max_tokens": 6, "temperature": temperature})
        assert response.status_code == 200, response.text
        texts.add(response.json()["choices"][0]["text"])
    assert len(texts) == 1


def test_routing_and_content_type_errors(plain_server: tuple[BackgroundServer, Any]) -> None:
    srv, _ = plain_server
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/v1/nothing").status_code == 404
        assert http.get(COMPLETIONS).status_code == 405
        sent_as_text = http.post(COMPLETIONS, content=json.dumps(OK),
                                 headers={"Content-Type": "text/plain"})
        assert sent_as_text.status_code == 400
        assert sent_as_text.json()["error"]["code"] == "invalid_body"
        for response in (http.get("/v1/nothing"), http.get(COMPLETIONS)):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert http.post(COMPLETIONS, json=OK).status_code == 200  # still serving


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["positive", "negative"])
def test_fuzz_from_openapi_schema_never_5xx(plain_server: tuple[BackgroundServer, Any],
                                            mode: GenerationMode) -> None:
    """Requests generated from /openapi.json (valid ones, then schema-violating ones) to every
    operation over loopback: no 5xx, and the server still answers afterwards. Valid bodies name
    the served model and leave out the fields refused by design, so they reach tokenization, the
    engine and the stream."""
    srv, state = plain_server
    schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json", timeout=30)
    strategy = schema.as_strategy(generation_mode=mode)
    if mode == GenerationMode.POSITIVE:
        strategy = strategy.map(_supported_request)
    failures: list[str] = []

    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Any) -> None:
        response = case.call(base_url=srv.url, timeout=30)
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r}: {response.text[:200]}")

    run()
    assert failures == []
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    assert wait_for(lambda: state.inflight == 0 and not state.worker.engine.busy, 5)


CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_grammar")


def _supported_request(case: Any) -> Any:
    """Name the served model and drop the refused fields (covered below) and the
    structured-output constraints (a random schema or regex is mostly refused)."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "tiny"
        for name in CONSTRAINTS:
            case.body.pop(name, None)
        for field in REFUSED_FIELDS[case.path]:
            head, _, rest = field.name.partition("[].")
            for item in (case.body.get(head) or [] if rest else [case.body]):
                if isinstance(item, dict):
                    item.pop(rest or head, None)
    return case


def _demanding(document: dict[str, Any], path: str, field: Refused) -> dict[str, Any]:
    """A copy of the server's OpenAPI document in which every body of `path` carries `field`
    with a value other than its neutral ones."""
    doc = copy.deepcopy(document)
    schemas = doc["components"]["schemas"]
    head, _, rest = field.name.partition("[].")
    body_ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    target = schemas[body_ref["schema"]["$ref"].rsplit("/", 1)[1]]
    name = head
    if rest:  # a field of each item of a list, e.g. messages[].name
        target, name = schemas[target["properties"][head]["items"]["$ref"].rsplit("/", 1)[1]], rest
    target["required"] = sorted({*target.get("required", []), name})
    target["properties"][name] = {"allOf": [target["properties"][name],
                                            {"not": {"enum": list(field.neutral)}}]}
    return doc


REFUSED_CASES = [(path, field) for path, fields in REFUSED_FIELDS.items() for field in fields]


@pytest.mark.parametrize(("path", "field"), REFUSED_CASES,
                         ids=[f"{'chat' if 'chat' in p else 'completions'}-{f.name}"
                              for p, f in REFUSED_CASES])
def test_fuzz_refused_fields_from_openapi_schema(plain_server: tuple[BackgroundServer, Any],
                                                 path: str, field: Refused) -> None:
    """Issue 37: schemathesis generates valid bodies from /openapi.json in which `field` (each
    of protocol.REFUSED_FIELDS) asks for something; every one is a 400 unsupported_value naming
    a refused field it carries (the first, in the table's order), never a 200 that ignored it."""
    srv, _ = plain_server
    document = httpx.get(f"{srv.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(_demanding(document, path, field))
    strategy = schema[path]["POST"].as_strategy(generation_mode=GenerationMode.POSITIVE)
    seen: list[str] = []

    @settings(max_examples=4, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Any) -> None:
        case.body["model"] = "tiny"
        if not MIN_SEED <= case.body.get("seed", 0) <= MAX_SEED:
            # the generator steps one past a 64-bit bound (-2**63 - 1 seen): the body must be
            # valid but for the refused field, so such a seed is put back in range
            case.body["seed"] = MIN_SEED
        asking = _asking(case.body, path)
        assert any(param.startswith(field.name.split("[]")[0]) for param in asking), case.body
        response = case.call(base_url=srv.url, timeout=30)
        assert response.status_code == 400, (case.body, response.text)
        error = response.json()["error"]
        assert error["code"] == "unsupported_value" and error["param"] in asking, error
        seen.append(error["param"])

    run()
    assert seen


def _asking(body: dict[str, Any], path: str) -> list[str]:
    """The params of the refused fields in `body` whose value asks for something."""
    out = []
    for field in REFUSED_FIELDS[path]:
        head, _, rest = field.name.partition("[].")
        items = [(f"{head}[{i}].{rest}", m) for i, m in enumerate(body.get(head) or [])] \
            if rest else [(head, body)]
        for param, item in items:
            key = rest or head
            if key in item and not field.allows(item[key]):
                out.append(param)
    return out


TOKENS = st.integers(3, 95).map(lambda i: f"t{i}")
SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 0.99), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 2**63), "max_tokens": st.integers(1, 12),
    "stop": st.one_of(TOKENS, st.lists(TOKENS, max_size=4)),
    "logit_bias": st.dictionaries(st.integers(0, 95).map(str), st.floats(-100, 100),
                                  max_size=4),
    "stream": st.booleans(),
})


@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), words=st.lists(TOKENS, min_size=1, max_size=8), sampling=SAMPLING)
def test_random_valid_requests_complete(plain_server: tuple[BackgroundServer, Any], chat: bool,
                                        words: list[str], sampling: dict[str, Any]) -> None:
    """Any valid combination of sampling parameters, streamed or not, ends with 200 and a
    finish reason (property-based: the schema fuzz above rarely builds a valid request)."""
    srv, _ = plain_server
    text = " ".join(words)
    body = {"model": "tiny", **sampling,
            **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})}
    response = httpx.post(srv.url + (CHAT if chat else COMPLETIONS), json=body, timeout=30)
    assert response.status_code == 200, response.text
    if sampling.get("stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] in ("stop", "length") and not any(finish[:-1])
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
