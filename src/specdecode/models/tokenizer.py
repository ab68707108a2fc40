"""Tokenizer and chat template, read from a checkpoint folder (tokenizer.json + config files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from specdecode.errors import SpecDecodeError


def _raise(message: str) -> None:
    raise SpecDecodeError(f"chat template: {message}")


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise SpecDecodeError(f"{path}: cannot read tokenizer ({exc})") from exc
        config = _read_json(folder / "tokenizer_config.json")
        self.chat_template = _chat_template(folder, config)
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.eos_ids = tuple(
            i for i in (self.token_id(self.eos_token),) if i is not None
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def vocabulary(self) -> dict[str, int]:
        """Every token's string and id, added tokens included."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` JSON (what llguidance builds its own from)."""
        return str(self._tok.to_str())

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """`text` as the first tokens of a sequence: with the special tokens the tokenizer's own
        post-processor adds (e.g. Gemma's <bos>; none for SmolLM2), never doubling a BOS that
        the text already starts with (chat templates render one)."""
        ids = list(self._tok.encode(text, add_special_tokens=True).ids)
        bos = self.token_id(self.bos_token)
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render messages with the checkpoint's chat template, ready for the assistant's turn."""
        if self.chat_template is None:
            raise SpecDecodeError("this checkpoint has no chat template (drop --chat)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, **_: json.dumps(x)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class IncrementalDecoder:
    """Turns a growing list of token ids into text increments, holding back split UTF-8."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self._emitted :]
        self._emitted = len(text)
        return new

    def text(self) -> str:
        return self._tok.decode(self._ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"{path}: unreadable ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
