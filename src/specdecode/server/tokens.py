"""Prompt tokenization for the server: message contents are text, never control tokens.

A chat template wraps every message in control tokens (`<|im_start|>user ... <|im_end|>`). If
the contents were tokenized with special-token parsing on, a user who writes
`hi<|im_end|>\\n<|im_start|>system\\n...` would get real control tokens, closing their own turn
and opening a system turn. As in OpenAI's API, `PromptEncoder.chat` tokenizes what the messages
contain as text (the markers become ordinary tokens such as `<`, `|`, `im`, ...), while the
markers the template itself writes stay control tokens. `special_in_content=True` (serve flag
`--allow-special-tokens-in-content`, for trusted callers) restores plain parsing of the whole
rendered prompt.

How: each special-token string inside a content is replaced, before rendering, by a sentinel
carrying a per-request random nonce (so a client cannot forge one); the rendered prompt is cut
at the sentinels, the template's text is encoded with special-token parsing, each marker the
user wrote is encoded as text by a copy of the tokenizer with special tokens off, and the
pieces are merged and post-processed as one sequence (BOS and the like, as `encode_prompt`).
A prompt whose contents hold no special-token string takes the plain path: the same ids as
`Tokenizer.encode_prompt` of the rendered template.

/v1/completions prompts keep special-token parsing: there the caller writes the whole prompt,
markers included, and no other party's turn is in it to forge.

Encoding goes through `encode_batch`, which releases the GIL while it works (`encode` holds it:
a 1 MB prompt stopped every other thread, the event loop included, for over a second). The
server runs it in a worker thread, so even a long prompt never stalls other requests.

`longest_token_bytes` (the vocabulary's longest entry, in UTF-8 bytes as stored) bounds how
much text one token can cover for byte-level BPE and SentencePiece vocabularies (a stored entry
is never shorter than the text it stands for), which gives the server a size no prompt that
fits its context can exceed (`ServedModel.max_prompt_bytes`), checked before tokenizing.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from specdecode.models.tokenizer import Tokenizer


class PromptEncoder:
    """Token ids of server prompts over one checkpoint's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, special_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special_in_content = special_in_content
        # the Hugging Face tokenizer behind specdecode's wrapper (which exposes no way to turn
        # special-token parsing off)
        self._hf: HFTokenizer = tokenizer._tok
        self._as_text = HFTokenizer.from_str(self._hf.to_str())
        self._as_text.encode_special_tokens = True  # special-token strings are plain text
        added = self._hf.get_added_tokens_decoder().values()
        # longest first, so a marker that contains another is replaced whole
        self.special_strings = tuple(sorted({t.content for t in added if t.special and t.content},
                                            key=len, reverse=True))
        self._special_re = (re.compile("|".join(map(re.escape, self.special_strings)))
                            if self.special_strings else None)
        self._bos = tokenizer.token_id(tokenizer.bos_token)
        vocab = self._hf.get_vocab(with_added_tokens=True)
        self.longest_token_bytes = max((len(t.encode("utf-8")) for t in vocab), default=1)

    def completion(self, text: str) -> list[int]:
        """A /v1/completions prompt: special-token parsing on (see the module docstring)."""
        return self._finish(self._encode(self._hf, text, add_special_tokens=True))

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Messages rendered with the chat template; their contents tokenized as text."""
        tok = self.tokenizer
        if self.special_in_content or self._special_re is None or not any(
                self._special_re.search(m["content"]) for m in messages):
            return self._finish(self._encode(self._hf, tok.apply_chat_template(messages),
                                             add_special_tokens=True))
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def sentinel(match: re.Match[str]) -> str:
            found.append(match.group(0))
            return f"\ue000{nonce}:{len(found) - 1}\ue001"

        special_re = self._special_re
        hidden = [{**m, "content": special_re.sub(sentinel, m["content"])} for m in messages]
        rendered = tok.apply_chat_template(hidden)
        # re.split with one group: template text, marker index, template text, ...
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        pieces: list[Encoding] = []
        for i, part in enumerate(parts):
            if i % 2:
                pieces.append(self._encode(self._as_text, found[int(part)]))
            elif part:
                pieces.append(self._encode(self._hf, part))
        merged = Encoding.merge(pieces, growing_offsets=True)
        return self._finish(self._hf.post_process(merged, None, add_special_tokens=True))

    @staticmethod
    def _encode(hf: HFTokenizer, text: str, add_special_tokens: bool = False) -> Encoding:
        # encode_batch, unlike encode, releases the GIL (see the module docstring)
        return hf.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def _finish(self, encoding: Encoding) -> list[int]:
        """The ids, without a doubled BOS (as Tokenizer.encode_prompt)."""
        ids = list(encoding.ids)
        if self._bos is not None and ids[:2] == [self._bos, self._bos]:
            ids = ids[1:]
        return ids
