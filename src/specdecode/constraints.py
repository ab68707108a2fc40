"""Structured output: JSON schema, regex and grammar constraints, through llguidance.

A `ConstraintSpec` is what the user asked for (a JSON schema, a regex, a Lark or GBNF grammar),
checked by llguidance's compiler without any tokenizer, so a bad schema is refused before any
model loads. `compile_constraint` binds it to a tokenizer (a `Constraint`, shared by requests);
`Constraint.matcher()` makes one request's `Matcher`: the allowed-token mask at the committed
state and along a speculative path, forced tokens, commit and rollback.

How the engine uses it (docs/structured-output.md): the mask is one step of the ONE sampling
pipeline (`sampling.process_logits`, argument `allowed`), applied to the target's p at every
verified position (row t: the state after context ++ draft[:t]) and to the drafter's q at every
drafted position; a draft token the grammar forbids is cut before verification; a token that is
the only one allowed is committed without being scored.
"""

from __future__ import annotations

import dataclasses
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.errors import SpecDecodeError

KINDS = ("json_schema", "regex", "grammar")
LIBRARY = "llguidance==1.9.1"
# JSON is compiled compact (no optional whitespace): a small model can otherwise loop on
# whitespace, and more tokens are forced. A schema's own "x-guidance" options override this
# (e.g. {"x-guidance": {"whitespace_flexible": true}}).
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}
ANY_JSON_OBJECT = '{"type": "object"}'


def load_llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise SpecDecodeError(
            "structured output needs llguidance: pip install -c constraints.txt -e "
            "\".[structured]\"") from None
    return llguidance


@dataclass(frozen=True)
class ConstraintSpec:
    """A constraint as the user gave it: `kind` (json_schema, regex, grammar), its `text`, and
    `origin`, what errors name (a flag and file, or a request field)."""

    kind: str
    text: str
    origin: str

    def grammar(self) -> str:
        """The llguidance grammar of this constraint, checked without a tokenizer; raises
        SpecDecodeError naming `origin` and the problem."""
        llg = load_llguidance()
        if self.kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(
                _json_schema(self.text, self.origin), defaults=JSON_DEFAULTS)
        elif self.kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(self.text)
        elif self.kind == "grammar":
            grammar = _lark_grammar(self.text, self.origin)
        else:
            raise SpecDecodeError(f"{self.origin}: unknown constraint kind {self.kind!r} "
                                  f"({', '.join(KINDS)})")
        check_grammar(grammar, None, self.origin)
        return str(grammar)

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "text": self.text, "origin": self.origin}


def json_schema_spec(schema: str | dict[str, Any] | bool, origin: str) -> ConstraintSpec:
    """A JSON-schema constraint from its text or parsed value, checked now."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    spec = ConstraintSpec("json_schema", text, origin)
    spec.grammar()
    return spec


def regex_spec(regex: str, origin: str) -> ConstraintSpec:
    """A regular-expression constraint (Rust regex syntax), checked now."""
    spec = ConstraintSpec("regex", regex, origin)
    spec.grammar()
    return spec


def grammar_spec(grammar: str, origin: str) -> ConstraintSpec:
    """A Lark (llguidance's dialect) or GBNF (llama.cpp's) grammar, checked now."""
    spec = ConstraintSpec("grammar", grammar, origin)
    spec.grammar()
    return spec


def spec_from_file(kind: str, path: str, flag: str) -> ConstraintSpec:
    """A json_schema or grammar constraint read from `path` (given as `flag`)."""
    origin = f"{flag} {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"{origin}: cannot read the file ({exc})") from None
    maker = json_schema_spec if kind == "json_schema" else grammar_spec
    return maker(text, origin)


def spec_from_args(json_schema: str | None, regex: str | None,
                   grammar: str | None) -> ConstraintSpec | None:
    """The constraint of the `--json-schema FILE`, `--regex R`, `--grammar FILE` flags (at most
    one), or None."""
    given = [name for name, value in (("--json-schema", json_schema), ("--regex", regex),
                                      ("--grammar", grammar)) if value is not None]
    if len(given) > 1:
        raise SpecDecodeError(f"give at most one constraint, got {' and '.join(given)}")
    if json_schema is not None:
        return spec_from_file("json_schema", json_schema, "--json-schema")
    if regex is not None:
        return regex_spec(regex, "--regex")
    if grammar is not None:
        return spec_from_file("grammar", grammar, "--grammar")
    return None


def _json_schema(text: str, origin: str) -> dict[str, Any] | bool:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecDecodeError(f"{origin}: not valid JSON ({exc})") from None
    if not isinstance(schema, dict | bool):
        raise SpecDecodeError(
            f"{origin}: a JSON schema must be an object (or true/false), got "
            f"{type(schema).__name__}")
    return schema


def _lark_grammar(text: str, origin: str) -> str:
    from llguidance.gbnf_to_lark import any_to_lark

    llg = load_llguidance()
    try:
        lark = any_to_lark(text)  # GBNF is converted; Lark passes through
    except Exception as exc:  # the converter raises its own error types
        raise SpecDecodeError(f"{origin}: not a valid GBNF grammar ({exc})") from None
    return str(llg.LLMatcher.grammar_from_lark(lark))


def check_grammar(grammar: str, tokenizer: Any, origin: str) -> None:
    message = load_llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
    if message:
        raise SpecDecodeError(f"{origin}: {message.strip()}")


# ---------------------------------------------------------------------------------------------
# Binding to a tokenizer


_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = \
    weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...] = ()) -> Any:
    """llguidance's tokenizer for a specdecode Tokenizer (models.tokenizer), over the model's
    vocabulary (ids past the tokenizer's are never allowed), its EOS tokens `eos_ids` (the
    engine's: default the tokenizer's). Made once per tokenizer, vocabulary size and EOS set
    (about 0.3 s for a 49k vocabulary)."""
    made = _LL_TOKENIZERS.setdefault(tokenizer, {})
    eos = tuple(eos_ids) or tuple(tokenizer.eos_ids)
    if (vocab_size, eos) not in made:
        try:
            made[vocab_size, eos] = load_llguidance().LLTokenizer(
                tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(eos) or None)
        except ValueError as exc:
            raise SpecDecodeError(f"structured output: llguidance cannot use this tokenizer "
                                  f"({exc})") from None
    return made[vocab_size, eos]


class Constraint:
    """A constraint bound to a tokenizer: shared by every request that uses it."""

    def __init__(self, spec: ConstraintSpec, ll_tok: Any, vocab_size: int) -> None:
        self.spec, self.ll_tokenizer, self.vocab_size = spec, ll_tok, vocab_size
        self.grammar = spec.grammar()
        check_grammar(self.grammar, ll_tok, spec.origin)
        self.eos_ids = tuple(int(t) for t in ll_tok.eos_tokens)
        if not self.matcher().allowed([]).any():
            raise SpecDecodeError(f"{spec.origin}: no token of this vocabulary can start an "
                                  "output that satisfies the constraint")

    def matcher(self) -> Matcher:
        """A fresh per-request matcher at the start of the output."""
        return Matcher(self)


def compile_constraint(spec: ConstraintSpec, tokenizer: Any, vocab_size: int,
                       eos_ids: tuple[int, ...] = ()) -> Constraint:
    """`spec` bound to a specdecode Tokenizer, the model's vocabulary size and the engine's
    EOS tokens (default: the tokenizer's): the grammar allows EOS where it may end."""
    return Constraint(spec, ll_tokenizer(tokenizer, vocab_size, eos_ids), vocab_size)


class Matcher:
    """One request's grammar state.

    The committed state is the output so far. A speculative *path* of tokens past it (a draft)
    is consumed lazily as masks along it are asked for, and the masks are kept: the drafter's
    masks at its drafted positions are the verifier's at the same rows. `commit(tokens)` makes
    the committed output longer, rolling the path back first where it differs (a rejected
    draft); `rollback()` drops the path.
    """

    def __init__(self, constraint: Constraint) -> None:
        llg = load_llguidance()
        self.constraint = constraint
        self.vocab_size = constraint.vocab_size
        self._m = llg.LLMatcher(constraint.ll_tokenizer, constraint.grammar, log_level=0)
        self.path: list[int] = []  # consumed past the committed state
        self._masks: list[torch.Tensor] = []  # _masks[j]: after committed ++ path[:j]
        self.mask_ns = 0  # time spent computing masks (the constraint's own cost)

    # -- masks -----------------------------------------------------------------------------

    def allowed(self, prefix: list[int]) -> torch.Tensor:
        """The (V,) bool mask of tokens allowed after committed ++ `prefix`. Every token of
        `prefix` must be allowed where it stands (check with `valid_prefix`)."""
        self._follow(prefix)
        while True:
            if len(self._masks) == len(self.path):  # the mask at the path's end
                ended = bool(self.path) and self.path[-1] in self.constraint.eos_ids
                self._masks.append(torch.zeros(self.vocab_size, dtype=torch.bool) if ended
                                   else self._compute_mask())
            if len(prefix) < len(self._masks):
                return self._masks[len(prefix)]
            tok = prefix[len(self.path)]
            if not bool(self._masks[len(self.path)][tok]):
                raise ValueError(f"token {tok} is not allowed after {len(self.path)} tokens")
            self._consume(tok)

    def masks(self, draft: list[int]) -> torch.Tensor:
        """The (len(draft) + 1, V) masks after committed ++ draft[:t], t = 0..len(draft)."""
        return torch.stack([self.allowed(draft[:t]) for t in range(len(draft) + 1)])

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from the committed state."""
        for j, tok in enumerate(tokens):
            if not bool(self.allowed(tokens[:j])[tok]):
                return j
        return len(tokens)

    def forced(self) -> int | None:
        """The token after the committed state when it is the only one allowed, else None."""
        ids = torch.nonzero(self.allowed([])).flatten()
        return int(ids[0]) if ids.numel() == 1 else None

    def dead(self) -> bool:
        """Whether no token is allowed after the committed state (a dead end)."""
        return not bool(self.allowed([]).any())

    # -- state -----------------------------------------------------------------------------

    def commit(self, tokens: list[int]) -> int:
        """Append `tokens` to the committed output, rolling back the part of the path they do
        not follow (a rejected draft). Returns how many were taken: all, except that a token
        the grammar forbids is not, nor any after it, and none after one that leads to a dead
        end (the caller then ends the request)."""
        n = 0
        for j, tok in enumerate(tokens):
            if not bool(self.allowed(tokens[:j])[tok]):
                break
            n = j + 1
            if not bool(self.allowed(tokens[: j + 1]).any()):
                break
        self._follow(tokens[:n])
        self.allowed(tokens[:n])
        del self.path[:n]
        del self._masks[:n]
        return n

    def take_step(self, committed: list[int], eos_ids: frozenset[int], room: int
                  ) -> tuple[list[int], list[int], bool]:
        """After a verified step: commit its tokens (rolling back the rest of the draft), then
        take the tokens the grammar forces (the only one allowed: the target's constrained
        distribution is that token with probability 1, so it is emitted without being
        scored), at most `room` of them, up to an EOS. Returns the committed tokens taken, the
        forced ones, and whether the request reached a dead end (a token refused, or nothing
        allowed after them and no EOS)."""
        taken = self.commit(committed)
        forced: list[int] = []
        if taken == len(committed) and not eos_ids.intersection(committed):
            while len(forced) < room and (tok := self.forced()) is not None:
                self.commit([tok])
                forced.append(tok)
                if tok in eos_ids:
                    break
        ended = eos_ids.intersection(committed + forced)
        dead = taken < len(committed) or (not ended and self.dead())
        return committed[:taken], forced, dead

    def rollback(self) -> None:
        """Drop the speculative path: back to the committed state."""
        if self.path:
            self._m.rollback(self._consumed(self.path))
            self.path.clear()
            del self._masks[1:]

    def accepting(self) -> bool:
        """Whether the committed output is complete under the grammar (EOS may end it)."""
        self.rollback()
        return bool(self._m.is_accepting())

    # -- internals -------------------------------------------------------------------------

    def _follow(self, prefix: list[int]) -> None:
        """Roll the path back to where it first differs from `prefix` (a path that `prefix`
        only stops short of is kept: its masks stay known)."""
        n = 0
        limit = min(len(self.path), len(prefix))
        while n < limit and self.path[n] == prefix[n]:
            n += 1
        if n < limit:
            self._m.rollback(self._consumed(self.path[n:]))
            del self.path[n:]
            del self._masks[n + 1:]

    def _consumed(self, tokens: list[int]) -> int:
        """How many of `tokens` (a tail of the path) llguidance consumed: all but an EOS."""
        return sum(1 for tok in tokens if tok not in self.constraint.eos_ids)

    def _consume(self, tok: int) -> None:
        """Take `tok` onto the path. An EOS is not given to llguidance (whose rollback does
        not count EOS tokens consumed after the grammar stopped): nothing may follow it."""
        if tok in self.constraint.eos_ids:
            self.path.append(tok)
            return
        if not self._m.consume_token(tok):
            raise RuntimeError(f"llguidance refused token {tok}: {self._m.get_error()}")
        self.path.append(tok)

    def _compute_mask(self) -> torch.Tensor:
        start = time.perf_counter_ns()
        words = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self.vocab_size]
        mask = torch.from_numpy(bits.astype(bool))
        if mask.numel() < self.vocab_size:  # a model vocabulary past the tokenizer's
            mask = torch.cat([mask, torch.zeros(self.vocab_size - mask.numel(), dtype=torch.bool)])
        only = torch.nonzero(mask).flatten()
        if only.numel() == 1 and int(only[0]) not in self.constraint.eos_ids and \
                self._m.validate_tokens([int(only[0])]) == 0:
            mask[only] = False  # llguidance marks a token it cannot take when none is allowed
        self.mask_ns += time.perf_counter_ns() - start
        return mask


def constrain_draft(draft: Any, matcher: Matcher) -> Any:
    """A draft (drafters.base.Draft) as the verifier takes it under a constraint: cut before
    its first token the grammar forbids (that token could never be accepted: p gives it 0, so
    it would cost a scored position for nothing) and its q restricted to the mask at each
    drafted position (sampling.restrict_probs: unchanged for a drafter that drew through the
    mask). Lossless: see docs/structured-output.md."""
    from specdecode.sampling import restrict_probs

    tokens = draft.tokens.tolist()
    n = matcher.valid_prefix(tokens)
    q = None if draft.q is None or n == 0 else restrict_probs(
        draft.q[:n], matcher.masks(tokens[:n])[:n])
    confidence = None if draft.confidence is None or n == 0 else draft.confidence[:n]
    return dataclasses.replace(draft, tokens=draft.tokens[:n], q=q, confidence=confidence)
