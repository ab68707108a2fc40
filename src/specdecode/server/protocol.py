"""Request schemas of the OpenAI endpoints this server implements (pydantic, strict types).

Strict: a string is never coerced into a number or a number into a boolean, and NaN or infinity
are refused, so a wrong type is a 400 naming the field (a float with no fraction, 5.0, counts as
an integer: JSON has one number type). Ranges follow the OpenAI API (temperature in [0, 2],
top_p in (0, 1], penalties in [-2, 2], logit_bias values in [-100, 100], at most 4 stop
strings; repetition_penalty in [0.01, 10]: a smaller one overflows float32 logits). `top_k`,
`min_p` and `repetition_penalty` are extensions (as in vLLM). Every field
that is accepted but not implemented (n > 1, logprobs, echo, tools...) is refused with a 400 by
`prepare`, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from specdecode.limits import MAX_SEED, MIN_SEED

MAX_STOP = 4
MAX_STOP_CHARS = 512
MAX_LOGIT_BIAS = 300



def _integral(value: Any, depth: int = 2) -> Any:
    """5.0 -> 5, also inside lists (two levels: prompts of token ids); anything else as is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list) and depth > 0:
        return [_integral(v, depth - 1) for v in value]
    return value


Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TokenId = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

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
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured output, as vLLM spells it (extensions; docs/structured-output.md)
    guided_json: dict[str, Any] | str | None = Field(default=None, description="extension")
    guided_regex: str | None = Field(default=None, description="extension")
    guided_grammar: str | None = Field(default=None, description="extension (Lark or GBNF)")


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
