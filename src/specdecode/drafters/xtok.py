"""A draft model with a DIFFERENT tokenizer from the target's: drafting through text.

The idea is Hugging Face's Universal Assisted Generation (Hugging Face blog, "Universal Assisted
Generation: Faster Decoding with Any Assistant Model", 2024): the draft and the target only share
text. Each step:

1. sync: the target tokens committed since the last step are decoded to text (a few earlier
   tokens are decoded with them, so spaces, merges and multi-byte characters at the seam come out
   right) and appended to a draft-side token context, re-encoding only its last word (`DraftText`);
2. draft: the draft model (its own KV cache, rolled back to the longest common prefix, as in
   `DraftModelDrafter`) proposes a few tokens greedily;
3. re-tokenise: those tokens are decoded to text and the text is encoded with the target's
   tokenizer, together with the last committed target tokens' text so a token that merges across
   the seam is tokenised as the target would;
4. boundary: the draft text stops at an arbitrary point, so the target token that reaches its end
   may be a partial merge (" th" where the target would write " the"). The text is cut at the start
   of its last whitespace run (pre-tokenizers split there, so every token before it is final);
   without whitespace the last target token is dropped. When the draft ended its text (its EOS),
   nothing is cut and the target's EOS is proposed after it;
5. the first k of those target tokens are proposed with q = None.

Losslessness. Verification is the engine's, unchanged. Greedy: only tokens equal to the target's
argmax are kept, so the output is plain decoding's whatever is proposed. Sampled: the draft is
deterministic (greedy draft model, deterministic tokenizers, no random numbers drawn), so each
proposed token is a function of the committed context alone, fixed before verification draws its
uniforms. verify_chain treats q = None as one-hot on the proposed token x_i: it emits x_i with
probability p_i(x_i), otherwise a token drawn from p_i with x_i removed, and that is exactly p_i
for ANY x_i chosen independently of those uniforms (see verify.verify_chain). So sampled use is
lossless too, and this drafter accepts it. Its acceptance under sampling is p_i(x_i), lower than a
same-tokenizer draft reporting its q: a q over the target's vocabulary would need the draft's
distribution marginalised over every tokenisation of the text, which this drafter does not attempt
(Timor et al. 2025, "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies", study exact schemes for that).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specdecode.drafters.base import EMPTY, Draft, Drafter, DraftRequest
from specdecode.models.target import Target
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams

LOOKBACK = 4  # tokens decoded before a seam, so the seam's text comes out as in a full decode
MAX_TAIL_CHARS = 256  # a draft-side tail without whitespace is split when it grows past this
SPLIT_KEEP = 64  # ... keeping this many characters in the re-encoded tail
GREEDY = SamplingParams()  # the draft model always drafts greedily (see the module docstring)


def text_increment(tok: Tokenizer, ids: list[int], old_end: int) -> str | None:
    """The text that ids[old_end:] add after ids[:old_end]; None while it ends inside a character.

    Decodes only LOOKBACK tokens before the seam, falling back to full decodes when the short
    decode is not a prefix of the longer one (a tokenizer whose decoding is not local).
    """
    start = max(0, old_end - LOOKBACK)
    before, after = tok.decode(ids[start:old_end]), tok.decode(ids[start:])
    if not after.startswith(before):
        before, after = tok.decode(ids[:old_end]), tok.decode(ids)
        if not after.startswith(before):
            return None
    if after.endswith("\ufffd"):  # a multi-byte character whose last bytes are not here yet
        return None
    return after[len(before):]


def last_word_start(text: str) -> int:
    """Index where the last whitespace run after a non-space character starts; 0 if none."""
    for i in range(len(text) - 1, 0, -1):
        if text[i].isspace() and not text[i - 1].isspace():
            return i
    return 0


def splits_at_spaces(tok: Tokenizer) -> bool:
    """Whether encoding text in pieces cut before a space gives the ids of encoding it whole
    (true of byte-level BPE and of SentencePiece without an added prefix space)."""
    probe = "Hello world, it is 12 o'clock."
    cut = last_word_start(probe)
    return tok.encode(probe) == tok.encode(probe[:cut]) + tok.encode(probe[cut:])


class DraftText:
    """Draft-side token ids of a text that only grows.

    Ids for text[:stable_chars] are final; the tail (from the last whitespace run on) is
    re-encoded whenever text is added. Tokenizers that cannot be encoded in pieces re-encode
    the whole text instead.
    """

    def __init__(self, tok: Tokenizer, incremental: bool) -> None:
        self.tok, self.incremental = tok, incremental
        self.text = ""
        self.ids: list[int] = []
        self.stable_ids = 0  # ids[:stable_ids] encode text[:stable_chars]
        self.stable_chars = 0

    def extend(self, new_text: str) -> None:
        self.text += new_text
        if not self.incremental:
            self.ids = self.tok.encode(self.text)
            return
        tail = self.text[self.stable_chars :]
        cut = last_word_start(tail)
        if cut == 0 and len(tail) > MAX_TAIL_CHARS:
            cut = len(tail) - SPLIT_KEEP
        ids = self.ids[: self.stable_ids]
        if cut > 0:
            ids += self.tok.encode(tail[:cut])
            self.stable_ids, self.stable_chars = len(ids), self.stable_chars + cut
        self.ids = ids + self.tok.encode(tail[cut:])


class XtokDrafter(Drafter):
    """Drafts with `inner` (any drafter over the draft's vocabulary, normally a
    `DraftModelDrafter`) through text: see the module docstring for the five moves."""

    def __init__(
        self,
        inner: Drafter,
        draft_tok: Tokenizer,
        target_tok: Tokenizer,
        name: str = "xtok",
        incremental: bool | None = None,
    ) -> None:
        self.name = name
        self.inner, self.draft_tok, self.target_tok = inner, draft_tok, target_tok
        self.incremental = splits_at_spaces(draft_tok) if incremental is None else incremental
        self.draft_eos = frozenset(draft_tok.eos_ids)
        self.target_eos = target_tok.eos_ids[:1]
        self.reset()

    def weights(self) -> torch.nn.Module | Target | None:
        return self.inner.weights()

    def kv_bytes(self) -> int:
        return self.inner.kv_bytes()

    def reset(self) -> None:
        self.inner.reset()
        self.seen: list[int] = []  # the committed target context of the last call
        self.decoded = 0  # seen[:decoded] is in self.draft.text
        self.draft = DraftText(self.draft_tok, self.incremental)

    def propose(self, request: DraftRequest) -> Draft:
        """Up to k target tokens re-tokenised from the draft model's greedy continuation."""
        ctx, k = request.context.tolist(), request.k
        if k <= 0 or not self._sync(ctx):
            return Draft(EMPTY, None)
        ids = self.draft.ids
        inner = self.inner.propose(
            DraftRequest(torch.tensor(ids), self._budget(k), GREEDY, len(ids), None))
        text, ended = self.draft_text(inner.tokens.tolist())
        tokens = self.target_tokens(ctx, text, ended)[:k]
        return Draft(torch.tensor(tokens, dtype=torch.long), None)

    def _sync(self, ctx: list[int]) -> bool:
        """Bring the draft-side text up to `ctx`; False while its text ends inside a character."""
        if len(ctx) < len(self.seen) or ctx[: len(self.seen)] != self.seen:
            self.reset()
        self.seen = ctx
        if self.decoded == len(ctx):
            return True
        new_text = text_increment(self.target_tok, ctx, self.decoded)
        if new_text is None:
            full = self.target_tok.decode(ctx)
            if full.endswith("\ufffd"):
                return False
            # earlier text changed (a decoder that is not prefix-stable): start again from it
            self.draft, new_text = DraftText(self.draft_tok, self.incremental), full
        self.draft.extend(new_text)
        self.decoded = len(ctx)
        return True

    def _budget(self, k: int) -> int:
        """Draft tokens to ask for: k target tokens' worth of text at the context's ratio of
        draft to target tokens, plus one for the boundary cut."""
        ratio = (len(self.draft.ids) + 1) / (self.decoded + 1)
        return min(math.ceil(ratio * k) + 1, 4 * k + 8)

    def draft_text(self, tokens: list[int]) -> tuple[str, bool]:
        """(text of the draft tokens, whether the draft ended its text with its EOS)."""
        ended = False
        for i, tok in enumerate(tokens):
            if tok in self.draft_eos:
                tokens, ended = tokens[:i], True
                break
        window = self.draft.ids[-LOOKBACK:]
        before, after = self.draft_tok.decode(window), self.draft_tok.decode(window + tokens)
        if not after.startswith(before):
            return "", False
        text = after[len(before):]
        if text.endswith("\ufffd"):  # the draft stopped inside a character
            return text.rstrip("\ufffd"), False
        return text, ended

    def target_tokens(self, ctx: list[int], text: str, ended: bool) -> list[int]:
        """The target's tokens for `text` following `ctx`, up to the last one known final."""
        cut = 0 if ended else last_word_start(text)
        if cut > 0:
            text = text[:cut]
        tail = ctx[-LOOKBACK:]
        ids = self.target_tok.encode(self.target_tok.decode(tail) + text)
        ids = ids[len(tail):] if ids[: len(tail)] == tail else self.target_tok.encode(text)
        if ended:
            return ids + list(self.target_eos)
        return ids if cut > 0 else ids[:-1]


def xtok_factory(
    target_tok: Tokenizer | None, draft_path: str, capacity: int = 4096
) -> Callable[[], XtokDrafter]:
    """Load the draft at `draft_path` (GGUF file or folder, with its own tokenizer) once; the
    maker of per-request drafters sharing it."""
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.errors import SpecDecodeError
    from specdecode.models.backends import load_model

    if target_tok is None:
        raise SpecDecodeError("--drafter xtok needs the target's tokenizer")
    loaded = load_model(draft_path, precision="auto", as_draft=True)  # a draft: not checked
    draft, draft_tok = loaded.model, loaded.tokenizer
    incremental = splits_at_spaces(draft_tok)

    def make() -> XtokDrafter:
        inner = DraftModelDrafter(draft, "xtok-draft", capacity)
        return XtokDrafter(inner, draft_tok, target_tok, incremental=incremental)

    return make
