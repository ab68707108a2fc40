"""A byte-level stand-in tokenizer for GGUFs written here whose vocabulary has no text (the
tests' small random models, the llama.cpp crash probe's tiny models): llama.cpp needs a
loadable tokenizer even where nothing is ever tokenized. Below the loaders (no imports of
them), so the crash probe can write one."""

from __future__ import annotations

from typing import Any

from specdecode.errors import SpecDecodeError


def byte_vocab(writer: Any, vocab_size: int, eos: int) -> None:
    """A byte-level BPE stand-in tokenizer of `vocab_size` tokens (at least 258)."""
    if vocab_size < 258:
        raise SpecDecodeError(f"a GGUF without a source tokenizer needs a vocabulary of at "
                              f"least 258 tokens, this one has {vocab_size}")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):  # GPT-2's byte-to-unicode table: unprintable bytes map past 255
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    tokens = [chars[b] for b in range(256)] + [f"<t{i}>" for i in range(256, vocab_size)]
    tokens[256] = chars[ord("a")] + chars[ord("b")]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab_size)
    writer.add_token_merges([f"{chars[ord('a')]} {chars[ord('b')]}"])
    writer.add_eos_token_id(eos)
    writer.add_bos_token_id(eos)
    writer.add_add_bos_token(False)
