"""Tokenizer.encode_prompt: the special tokens a tokenizer adds at the start of a sequence."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from specdecode.models.tokenizer import Tokenizer
from tests.conftest import write_tiny_tokenizer


def _bos_tokenizer(folder: Path) -> Tokenizer:
    """A word-level tokenizer whose post-processor prepends <bos> (as Gemma's does)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "hello": 3, "world": 4}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    tok.add_special_tokens(["<bos>", "<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>",
                                                              "eos_token": "<eos>"}))
    return Tokenizer(folder)


def test_encode_prompt_adds_the_tokenizers_bos_once(tmp_path: Path) -> None:
    tok = _bos_tokenizer(tmp_path / "bos")
    assert tok.encode("hello world") == [3, 4]
    assert tok.encode_prompt("hello world") == [1, 3, 4]
    # a chat template that renders the BOS itself: still one BOS
    assert tok.encode_prompt("<bos> hello world") == [1, 3, 4]


def test_encode_prompt_equals_encode_without_a_post_processor(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, 8)
    tok = Tokenizer(tmp_path)
    assert tok.encode_prompt("t3 t4 t5") == tok.encode("t3 t4 t5") == [3, 4, 5]
