"""From a validated request to a Generation: model name, prompt, limits and sampling parameters.

Every refusal is an APIError (4xx) naming the field. Model names resolve only against the model
this server loaded (its name and the name /v1/models lists); nothing in a request names a file.

Context: a request fits when prompt + max_tokens <= `ServedModel.window`, the smaller of the
model's context and what one row of the shared KV cache holds after the draft room (k + 1).
Before any tokenization, `check_prompt_size` refuses a prompt over `max_prompt_bytes` of text
(by default window x the vocabulary's longest token in bytes: more text than that cannot fit
the window), so a huge prompt costs the server no tokenizing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from pydantic import BaseModel

from specdecode.constraints import (
    ANY_JSON_OBJECT,
    ConstraintSpec,
    compile_constraint,
    grammar_spec,
    json_schema_spec,
    regex_spec,
)
from specdecode.drafters.registry import DrafterFactory
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams
from specdecode.server.isolation import Isolation
from specdecode.server.openai_errors import APIError
from specdecode.server.protocol import (
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    TextPart,
)
from specdecode.server.tokens import PromptEncoder

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# Below this temperature sampling is greedy (as in vLLM): dividing float32 logits by a smaller
# one can overflow to inf and make the probabilities NaN.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class ServedModel:
    """The one model a server serves, with everything needed to start a request on it."""

    name: str  # the id /v1/models lists
    loaded_name: str  # the loaded checkpoint's own name (also accepted)
    model: Target
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    make_drafter: DrafterFactory | None
    k: int  # draft length, or the cap under the controller; 0 without a drafter
    window: int  # prompt + max_tokens limit (see the module docstring)
    created: int  # unix time the server started
    prompts: PromptEncoder  # tokenizes prompts (message contents as text)
    max_prompt_bytes: int  # longer prompt text is refused before tokenizing
    rule: str = "invariant"  # how sampled drafts are verified (SamplingParams.rule)
    # whose stored text a `suffix` drafter reads (server.isolation): per user unless shared
    isolation: Isolation = field(default_factory=Isolation)

    @property
    def vocab_size(self) -> int:
        return int(self.model.cfg.vocab_size)


def check_model(served: ServedModel, name: str) -> None:
    """404 unless `name` is this server's model (exact match, nothing else is looked up)."""
    if name not in (served.name, served.loaded_name):
        raise APIError(404, f"the model '{name[:100]}' does not exist; this server serves "
                            f"'{served.name}'", "model", "model_not_found")


def check_refused(req: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 naming the first field this server names but does not implement that asks for
    something (protocol.REFUSED_FIELDS), and for a response_format type it lacks."""
    path = "/v1/chat/completions" if isinstance(req, ChatCompletionRequest) else \
        "/v1/completions"
    for refused in REFUSED_FIELDS[path]:
        for param, value in _values(req, refused.name):
            if not refused.allows(value):
                accepted = ", ".join(json.dumps(ok) for ok in refused.neutral)
                hint = f": {refused.hint}" if refused.hint else ""
                raise APIError(400, f"{param} = {_shown(value)} is not supported (accepted: "
                                    f"{accepted}){hint}", param, "unsupported_value")
    if isinstance(req, ChatCompletionRequest):
        kind = (req.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise APIError(400, f"response_format type '{str(kind)[:40]}' is not supported "
                                "(text, json_object, json_schema)", "response_format",
                           "unsupported_value")


def _values(req: BaseModel, name: str) -> list[tuple[str, Any]]:
    """(param, value) of field `name` in `req`: "messages[].name" gives each message's."""
    head, _, rest = name.partition("[].")
    if not rest:
        return [(name, getattr(req, name))]
    return [(f"{head}[{i}].{rest}", getattr(item, rest))
            for i, item in enumerate(getattr(req, head))]


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def constraint_spec(req: SamplingRequest) -> ConstraintSpec | None:
    """The request's structured-output constraint (response_format json_object / json_schema,
    or vLLM's guided_json / guided_regex / guided_grammar), checked: a bad schema or grammar
    is a 400 naming the field. None: unconstrained text."""
    asked: list[tuple[str, Any]] = []
    response_format = getattr(req, "response_format", None) or {}
    kind = response_format.get("type", "text")
    if kind == "json_object":
        asked.append(("response_format", ANY_JSON_OBJECT))
    elif kind == "json_schema":
        asked.append(("response_format.json_schema.schema", _schema_of(response_format)))
    asked += [(name, value) for name, value in (
        ("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
        ("guided_grammar", req.guided_grammar)) if value is not None]
    if not asked:
        return None
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise APIError(400, f"give one structured-output constraint, got {names}",
                       asked[1][0], "invalid_value")
    field, value = asked[0]
    make = regex_spec if field == "guided_regex" else grammar_spec \
        if field == "guided_grammar" else json_schema_spec
    try:
        return make(value, field)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), field, "invalid_value") from None


def _schema_of(response_format: dict[str, Any]) -> Any:
    """response_format.json_schema.schema (OpenAI: {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}})."""
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise APIError(400, "response_format json_schema needs json_schema.schema (a JSON "
                            "schema object)", "response_format.json_schema", "invalid_value")
    schema = spec["schema"]
    if not isinstance(schema, dict | bool):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                       "response_format.json_schema.schema", "invalid_value")
    return schema


def check_prompt_size(served: ServedModel,
                      req: CompletionRequest | ChatCompletionRequest) -> int:
    """400 for a prompt too long to fit the window, decided without tokenizing: text over
    `max_prompt_bytes` UTF-8 bytes, or more token ids than the window. Returns the bytes of
    text to tokenize."""
    size, ids = 0, 0
    if isinstance(req, ChatCompletionRequest):
        param = "messages"
        size = sum(len(_text(m.content).encode("utf-8")) for m in req.messages)
    else:
        param = "prompt"
        for part in req.prompt if isinstance(req.prompt, list) else [req.prompt]:
            if isinstance(part, str):
                size += len(part.encode("utf-8"))
            elif isinstance(part, list):
                ids = max(ids, len(part))
            else:
                ids += 1
    if size > served.max_prompt_bytes:
        raise APIError(400, f"the prompt is {size} bytes; this server's context of "
                            f"{served.window} tokens holds at most {served.max_prompt_bytes} "
                            "bytes of text", param, "context_length_exceeded")
    if ids > served.window:
        raise APIError(400, f"the prompt is {ids} tokens; this server's context is "
                            f"{served.window} tokens (prompt + max_tokens)", param,
                       "context_length_exceeded")
    return size


def completion_prompt(req: CompletionRequest, prompts: PromptEncoder, vocab_size: int
                      ) -> list[int]:
    """Token ids of the one prompt of a completion request (text or ids, alone or in a list,
    ids below the model's `vocab_size`); `prompts`: the served model's encoder (bench's
    in-process replay passes its own)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request: batches of prompts are not supported",
                           "prompt", "unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompts.completion(prompt)
    ids = [int(t) for t in prompt if isinstance(t, int)]
    if any(t >= vocab_size for t in ids):
        raise APIError(400, f"prompt token ids must be below the vocabulary size "
                            f"{vocab_size}", "prompt", "invalid_value")
    return ids


def chat_prompt(req: ChatCompletionRequest, prompts: PromptEncoder) -> list[int]:
    """Token ids of the messages rendered with the model's chat template (their contents
    tokenized as text: see specdecode.server.tokens)."""
    if prompts.tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template: use /v1/completions",
                       "messages", "no_chat_template")
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": _text(m.content)} for m in req.messages]
    try:
        return prompts.chat(messages)
    except (SpecDecodeError, TemplateError, TypeError, ValueError) as exc:
        raise APIError(400, f"the chat template refused these messages: {exc}",
                       "messages", "invalid_value") from exc


def _text(content: str | list[TextPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def max_tokens(requested: int | None, prompt_len: int, window: int, default: int | None,
               prompt_param: str = "prompt") -> int:
    """The request's max_tokens: checked against the window, or the default that fits.

    `default` None means all the room the prompt leaves (chat); `prompt_param` names the field
    that held the prompt, for the error when the prompt alone is too long or empty.
    """
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", prompt_param, "invalid_value")
    room = window - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens; this server's context is "
                            f"{window} tokens (prompt + max_tokens)", prompt_param,
                       "context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"max_tokens {requested} + prompt {prompt_len} tokens exceeds this "
                            f"server's context of {window} tokens", "max_tokens",
                       "context_length_exceeded")
    return requested


def sampling_params(req: SamplingRequest, limit: int, vocab_size: int,
                    rule: str = "invariant") -> SamplingParams:
    """SamplingParams of a request (OpenAI defaults: temperature 1, top_p 1; a temperature
    below MIN_TEMPERATURE is greedy)."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    temperature = _or(req.temperature, 1.0)
    params = SamplingParams(
        temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
        top_k=max(0, _or(req.top_k, 0)),
        top_p=_or(req.top_p, 1.0), min_p=_or(req.min_p, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        logit_bias=_logit_bias(req.logit_bias, vocab_size), seed=req.seed, max_tokens=limit,
        stop=stop, rule=rule,
    )
    try:
        params.validate(vocab_size)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), None, "invalid_value") from exc
    return params


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as sorted (id, bias) pairs; 400 naming a key that is not a valid id.

    A key is ASCII decimal digits only: str.isdigit() also accepts other scripts' digits ("١",
    which int() reads as 1) and superscripts ("²", which int() refuses), and a key longer than
    the largest id is refused before int() (which raises past 4300 digits).
    """
    pairs = []
    digits = len(str(vocab_size - 1))
    for key, value in (bias or {}).items():
        number = key.lstrip("0") or "0"  # int() counts leading zeros against its limit too
        if not (key.isascii() and key.isdigit() and len(number) <= digits
                and int(number) < vocab_size):
            raise APIError(400, f"logit_bias key {key[:20]!r} is not a token id in "
                                f"0..{vocab_size - 1} (ASCII decimal digits)", "logit_bias",
                           "invalid_value")
        if not math.isfinite(value):
            raise APIError(400, "logit_bias values must be finite", "logit_bias",
                           "invalid_value")
        pairs.append((int(number), float(value)))
    return tuple(sorted(pairs))


def new_generation(served: ServedModel, prompt_ids: list[int], params: SamplingParams,
                   spec: ConstraintSpec | None = None, scope: str | None = None) -> Generation:
    """A Generation for the engine, with a fresh per-request drafter when speculating, under
    the request's structured-output constraint `spec` if any. A drafter reading a store of
    earlier requests (`suffix`) is given the request's isolation `scope`
    (Isolation.key; None: the shared scope) now, before its first step: it drafts only from
    text stored under that scope, and its own text is stored under it."""
    drafter = served.make_drafter() if served.make_drafter is not None else None
    if drafter is not None:
        drafter.isolation_key = scope
    try:
        constraint = None if spec is None else compile_constraint(
            spec, served.tokenizer, served.vocab_size, served.eos_ids)
        return Generation(served.model, served.tokenizer, prompt_ids, params, drafter,
                          served.k if drafter is not None else 0, served.eos_ids,
                          constraint=constraint)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), spec.origin if spec else None, "invalid_value") from exc
