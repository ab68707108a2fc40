"""Structured output over HTTP: a prompt's constraint as request fields, and its outputs judged on
this side (`bench --endpoint`; docs/structured-output.md).

Sent (`request_fields`), as OpenAI and vLLM spell them, which this package's server takes:

- a JSON schema: chat, OpenAI's `response_format: {"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}`; completions, vLLM's `guided_json: {...}`;
- a regular expression: `guided_regex` (both APIs);
- a grammar (Lark or GBNF): `guided_grammar` (both APIs).

Judged (`Judge`), from the returned text only, never from what the server says:

- a JSON schema: the text parsed as JSON (strictly: no NaN or Infinity) and validated against
  the schema by `jsonschema_rs` (a JSON-schema validator, not the grammar: a server may emit
  whitespace or key orders that this package's compact grammar would not, and they are valid);
- a regex or a grammar: llguidance, the library that compiled the constraint, over the text's
  UTF-8 bytes (a byte-level vocabulary, one token per byte, so the verdict does not depend on
  any model's tokenizer): valid when every byte is allowed and the grammar may end there
  (for a regex: a full match, under llguidance's own regex syntax, as the server was asked).

An output that does not satisfy its constraint (a server that ignored the field, or one cut
by its token limit) is `valid=False`, not an error. What the constraint cost the server and the
tokens it forced are not visible over HTTP: samples record them as unknown (None).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from specdecode.errors import SpecDecodeError

SCHEMA_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]")
BYTE_EOS = 256  # the byte vocabulary's end-of-sequence token (never fed)


def schema_name(prompt_id: str) -> str:
    """OpenAI's json_schema name (letters, digits, "_" and "-", at most 64) from a prompt id."""
    return SCHEMA_NAME_CHARS.sub("_", prompt_id)[:64] or "output"


def request_fields(constraint: dict[str, str] | None, chat: bool,
                   prompt_id: str) -> dict[str, Any]:
    """The request body's fields that carry `constraint` (a ConstraintSpec's dict; {} for
    None)."""
    if constraint is None:
        return {}
    kind, text = constraint["kind"], constraint["text"]
    if kind == "json_schema":
        schema = json.loads(text)
        if chat:
            return {"response_format": {"type": "json_schema", "json_schema": {
                "name": schema_name(prompt_id), "schema": schema}}}
        return {"guided_json": schema}
    if kind == "regex":
        return {"guided_regex": text}
    if kind == "grammar":
        return {"guided_grammar": text}
    raise SpecDecodeError(f"{constraint.get('origin', 'constraint')}: unknown constraint kind "
                          f"{kind!r}")


class _ByteTokenizer:
    """A vocabulary of the 256 bytes and an end token, as llguidance.TokenizerWrapper takes."""

    def __init__(self) -> None:
        self.eos_token_id = BYTE_EOS
        self.bos_token_id = None
        self.tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
        self.special_token_ids = [BYTE_EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@functools.cache
def byte_ll_tokenizer() -> Any:
    """llguidance's tokenizer over the byte vocabulary (made once)."""
    from specdecode.constraints import load_llguidance

    llg = load_llguidance()
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokenizer()))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class Judge:
    """Whether a returned text satisfies one constraint (see the module docstring). Built once
    per constraint; raises SpecDecodeError naming its origin when it cannot be judged."""

    def __init__(self, constraint: dict[str, str]) -> None:
        self.kind, self.origin = constraint["kind"], constraint.get("origin", "constraint")
        self._check: Callable[[str], bool]
        if self.kind == "json_schema":
            self._check = self._json_checker(constraint["text"])
        elif self.kind in ("regex", "grammar"):
            self._check = self._grammar_checker(constraint)
        else:
            raise SpecDecodeError(f"{self.origin}: unknown constraint kind {self.kind!r}")

    def __call__(self, text: str) -> bool:
        return self._check(text)

    def _json_checker(self, text: str) -> Callable[[str], bool]:
        try:
            import jsonschema_rs
        except ImportError:
            raise SpecDecodeError(
                f"{self.origin}: judging JSON outputs of an endpoint needs jsonschema-rs: pip "
                "install -c constraints.txt -e \".[structured]\"") from None
        try:
            validator = jsonschema_rs.validator_for(json.loads(text))
        except (ValueError, jsonschema_rs.ValidationError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecDecodeError(f"{self.origin}: the JSON-schema validator refuses this "
                                  f"schema ({first})") from None

        def check(output: str) -> bool:
            try:
                value = json.loads(output, parse_constant=_reject_constant)
            except ValueError:
                return False
            return bool(validator.is_valid(value))
        return check

    def _grammar_checker(self, constraint: dict[str, str]) -> Callable[[str], bool]:
        from specdecode.constraints import ConstraintSpec, check_grammar, load_llguidance

        llg = load_llguidance()
        spec = ConstraintSpec(constraint["kind"], constraint["text"], self.origin)
        grammar = spec.grammar()
        tokenizer = byte_ll_tokenizer()
        check_grammar(grammar, tokenizer, self.origin)

        def check(output: str) -> bool:
            matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
            data = list(output.encode("utf-8"))
            taken = matcher.try_consume_tokens(data)
            return taken == len(data) and not matcher.is_error() and \
                bool(matcher.is_accepting())
        return check


class Judges:
    """One Judge per distinct constraint (kind, text), built on first use."""

    def __init__(self) -> None:
        self._judges: dict[tuple[str, str], Judge] = {}

    def judge(self, constraint: dict[str, str]) -> Judge:
        key = (constraint["kind"], constraint["text"])
        if key not in self._judges:
            self._judges[key] = Judge(constraint)
        return self._judges[key]

    def valid(self, constraint: dict[str, str] | None, text: str) -> bool | None:
        """Whether `text` satisfies `constraint` (None: no constraint)."""
        return None if constraint is None else self.judge(constraint)(text)
