"""Request schemas of the OpenAI endpoints this server implements (pydantic, strict types).

Strict: a string is never coerced into a number or a number into a boolean, and NaN or infinity
are refused, so a wrong type is a 400 naming the field (a float with no fraction, 5.0, counts as
an integer: JSON has one number type). Ranges follow the OpenAI API (temperature in [0, 2],
top_p in (0, 1], penalties in [-2, 2], logit_bias values in [-100, 100], at most 4 stop
strings; repetition_penalty in [0.01, 10]: a smaller one overflows float32 logits). `top_k`,
`min_p` and `repetition_penalty` are extensions (as in vLLM).

No field is silently ignored. A field of the OpenAI API that this server names but does not
implement (`REFUSED_FIELDS`: n > 1, echo, logprobs, tools...) is accepted only with a value that
asks for nothing (null, false, 1, []) and otherwise refused by `prepare` with a 400 naming it;
any field not declared here is refused by the schema (`unknown_field`). docs/serving.md lists
the same fields (tests/test_server_docs.py compares them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic_core import PydanticCustomError

from specdecode.limits import MAX_SEED, MIN_SEED

MAX_STOP = 4
MAX_STOP_CHARS = 512
MAX_LOGIT_BIAS = 300
# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# A request label (metadata "label", or an --api-key label): the name live speculation metrics
# and recordings group traffic by, so a Prometheus label value: short, no quotes or spaces
LABEL_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"



def _integral(value: Any, depth: int = 2) -> Any:
    """5.0 -> 5, also inside lists (two levels: prompts of token ids); anything else as is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list) and depth > 0:
        return [_integral(v, depth - 1) for v in value]
    return value


Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_METADATA_KEY)]
MetadataValue = Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TokenId = Annotated[int, Field(ge=0)]


@dataclass(frozen=True)
class Refused:
    """A field this server names but does not implement: accepted only as one of `neutral`
    (values that ask for nothing), else a 400 naming it (`prepare.check_refused`)."""

    name: str  # as in a request body; "messages[].name" is that field of every message
    neutral: tuple[Any, ...]
    hint: str = ""  # what to do instead, appended to the 400's message

    def allows(self, value: Any) -> bool:
        """Whether `value` asks for nothing: one of `neutral`, of the same type (True is not
        1, 0 is not False)."""
        return any(type(value) is type(ok) and value == ok for ok in self.neutral)


N = Refused("n", (None, 1), "send n separate requests")
BEST_OF = Refused("best_of", (None, 1))
ECHO = Refused("echo", (None, False), "the reply never repeats the prompt")
REFUSED_FIELDS: dict[str, tuple[Refused, ...]] = {
    "/v1/completions": (N, BEST_OF, ECHO, Refused("logprobs", (None,)),
                        Refused("suffix", (None,))),
    "/v1/chat/completions": (
        N, BEST_OF, ECHO, Refused("logprobs", (None, False)), Refused("top_logprobs", (None,)),
        Refused("tools", (None, []), "this server makes no tool calls"),
        Refused("tool_choice", (None, "none", "auto"), "this server makes no tool calls"),
        Refused("messages[].name", (None,), "the chat template renders no participant names "
                                             "(write the name into the content)")),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _json_integers(cls, value: Any) -> Any:
        """JSON has one number type: a float with no fraction counts as an integer."""
        return _integral(value)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class SamplingRequest(_Strict):
    """The fields both endpoints share. None means the default."""

    model: str = Field(max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="extension; 0 or -1 = off")
    min_p: float | None = Field(default=None, ge=0.0, lt=1.0, description="extension")
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0,
                                             description="extension")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Bias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    n: int | None = Field(default=None, ge=1, le=128, description="refused unless 1")
    best_of: int | None = Field(default=None, ge=1, description="refused unless 1")
    echo: bool | None = Field(default=False, description="refused unless false")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's free-form string pairs; "label" names the traffic in the live speculation
    # metrics and in a recording (after the API key's own label), "category" in a replay's report
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None,
                                                             max_length=MAX_METADATA)
    # structured output, as vLLM spells it (extensions; docs/structured-output.md)
    guided_json: dict[str, Any] | str | None = Field(default=None, description="extension")
    guided_regex: str | None = Field(default=None, description="extension")
    guided_grammar: str | None = Field(default=None, description="extension (Lark or GBNF)")


    @field_validator("metadata")
    @classmethod
    def _label(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """metadata.label, where given, is a label: 1-64 letters, digits or `_.:-`."""
        label = (value or {}).get("label")
        if label is not None and not re.match(LABEL_PATTERN, label):
            raise PydanticCustomError(
                "invalid_label", "metadata.label must be 1-64 letters, digits or _.:- (it "
                "names a series of the speculation metrics)")
        return value


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, description="refused unless null")
    suffix: str | None = Field(default=None, description="refused unless null")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(default=None, description="refused unless null")

    @field_validator("content", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        """OpenAI allows null content only on an assistant message with tool_calls, which
        this server does not take: null is refused, not read as empty text."""
        if value is None:
            raise PydanticCustomError(
                "null_content", "content is null: only an assistant message with tool_calls "
                "may have null content, and this server makes no tool calls")
        return value


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = Field(default=False, description="refused unless false")
    top_logprobs: int | None = Field(default=None, description="refused unless null")
    tools: list[dict[str, Any]] | None = Field(default=None, description="refused unless []")
    tool_choice: str | dict[str, Any] | None = Field(default=None,
                                                     description="refused unless none or auto")
    response_format: dict[str, Any] | None = Field(
        default=None, description="text, json_object or json_schema (constrained output)")
