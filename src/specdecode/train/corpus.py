"""Offline training corpora as token streams, for training drafters on the target's predictions.

The default corpus is Debian's python3.11-doc HTML (/usr/share/doc/python3.11/html, installed by
scripts/install_corpora.sh), stripped to text; without it, the running interpreter's standard
library source (.py files), which is always present. Any other files or folders can be named:
.html/.htm files are stripped to text, every other file is read as UTF-8 text.

`load_corpus` returns a train stream and a held-out stream of token ids. Documents are assigned
to one side or the other whole (by a seeded shuffle), so held-out text is never seen in training.
"""

from __future__ import annotations

import random
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import torch

from specdecode.errors import SpecDecodeError

PYTHON_DOC_HTML = Path(f"/usr/share/doc/python{sys.version_info[0]}.{sys.version_info[1]}/html")
DEBIAN_DOC_HTML = Path("/usr/share/doc/python3.11/html")
TEXT_SUFFIXES = frozenset((".html", ".htm", ".py", ".txt", ".md", ".rst", ".json", ".jsonl"))
_SKIP_TAGS = frozenset(("script", "style", "head", "title", "nav"))
_BLOCK_TAGS = frozenset(("p", "div", "pre", "li", "dt", "dd", "tr", "br", "h1", "h2", "h3", "h4",
                         "h5", "h6", "section", "table", "blockquote"))


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # (N,) int64 token ids of the training documents, concatenated
    heldout: torch.Tensor  # (M,) int64 token ids of the held-out documents
    sources: tuple[str, ...]  # the paths read (as given or defaulted)
    documents: int  # documents read (before the token budget cut)

    def describe(self) -> dict[str, Any]:
        return {"sources": list(self.sources), "documents": self.documents,
                "train_tokens": int(self.train.numel()),
                "heldout_tokens": int(self.heldout.numel())}


class _TextExtractor(HTMLParser):
    """Text of an HTML page: the Sphinx body (div role=main) when present, else everything,
    without scripts, styles and navigation; block elements end a line."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.main: list[str] = []
        self._skip = 0
        self._main_depth = 0  # div nesting inside the main body (0: outside)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIP_TAGS:
            self._skip += 1
        if tag == "div":
            if self._main_depth:
                self._main_depth += 1
            elif ("role", "main") in attrs:
                self._main_depth = 1
        if tag in _BLOCK_TAGS:
            self._add("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP_TAGS and self._skip:
            self._skip -= 1
        if tag == "div" and self._main_depth:
            self._main_depth -= 1
        if tag in _BLOCK_TAGS:
            self._add("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self._add(data)

    def _add(self, text: str) -> None:
        self.parts.append(text)
        if self._main_depth:
            self.main.append(text)


def html_to_text(html: str) -> str:
    """Visible text of an HTML page (its main body if marked), with blank runs collapsed."""
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    raw = "".join(parser.main or parser.parts).replace("\xb6", "")  # drop Sphinx pilcrows
    lines = [line.rstrip() for line in raw.splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def default_corpus_paths() -> list[Path]:
    """python3.11-doc's HTML when installed, else this interpreter's standard-library source."""
    for doc in (PYTHON_DOC_HTML, DEBIAN_DOC_HTML):
        if doc.is_dir():
            return [doc]
    return [Path(sysconfig.get_paths()["stdlib"])]


def corpus_files(path: Path) -> list[Path]:
    """The text files under `path` (itself if a file), sorted; site-packages and tests skipped."""
    if not path.exists():
        raise SpecDecodeError(f"{path}: corpus path does not exist")
    if path.is_file():
        return [path]
    skip = ("site-packages", "__pycache__", "test", "tests", "idlelib", "_static", "_sources")
    return sorted(
        f for f in path.rglob("*")
        if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
        and not any(part in skip for part in f.relative_to(path).parts[:-1])
    )


def read_document(path: Path) -> str:
    """A file's text (HTML stripped), or '' if it cannot be decoded as UTF-8."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""
    if path.suffix.lower() in (".html", ".htm"):
        return html_to_text(raw)
    return raw.strip()


def read_documents(paths: Sequence[Path]) -> list[str]:
    """Non-empty documents of every path; a path that is missing or holds no text raises."""
    docs: list[str] = []
    for path in paths:
        texts = [t for t in (read_document(f) for f in corpus_files(path)) if t]
        if not texts:
            raise SpecDecodeError(
                f"{path}: corpus path holds no text (expected UTF-8 text, .py or .html files)"
            )
        docs.extend(texts)
    return docs


def _tokenize(tokenizer: Any, docs: Iterable[str], budget: int, eos: int | None) -> torch.Tensor:
    """Token ids of `docs` in order (each followed by `eos` if given), cut at `budget` tokens."""
    ids: list[int] = []
    for doc in docs:
        if len(ids) >= budget:
            break
        ids.extend(tokenizer.encode(doc))
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids[:budget], dtype=torch.long)


def load_corpus(
    paths: Sequence[str | Path] | None,
    tokenizer: Any,
    max_tokens: int = 200_000,
    heldout_fraction: float = 0.05,
    seed: int = 0,
) -> Corpus:
    """Train and held-out token streams (1-D int64) from `paths` (default: default_corpus_paths).

    Documents are shuffled with `seed` and split whole: the first `heldout_fraction` of them
    (at least one) are held out, the rest are training documents (a single document: its tail
    is held out). The train stream holds at most
    `max_tokens` tokens, the held-out stream at most `heldout_fraction * max_tokens` (at least
    1,000). Each document is followed by the tokenizer's first end-of-sequence id, if it has one.
    A path that does not exist or holds no text raises SpecDecodeError naming it.
    """
    if not 0 < heldout_fraction < 1:
        raise SpecDecodeError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if max_tokens < 1:
        raise SpecDecodeError(f"max_tokens must be >= 1, got {max_tokens}")
    chosen = [Path(p).expanduser() for p in paths] if paths else default_corpus_paths()
    docs = read_documents(chosen)
    random.Random(seed).shuffle(docs)
    n_held = max(1, round(heldout_fraction * len(docs))) if len(docs) > 1 else 0
    eos_ids = list(getattr(tokenizer, "eos_ids", ()) or ())
    eos = int(eos_ids[0]) if eos_ids else None
    held_budget = max(1_000, round(heldout_fraction * max_tokens))
    if n_held == 0:  # one document: its tail is held out
        ids = _tokenize(tokenizer, docs, max_tokens + held_budget, eos)
        held = max(1, min(held_budget, round(heldout_fraction * ids.numel())))
        cut = min(max_tokens, ids.numel() - held)
        train, heldout = ids[:cut], ids[cut:]
    else:
        heldout = _tokenize(tokenizer, docs[:n_held], held_budget, eos)
        train = _tokenize(tokenizer, docs[n_held:], max_tokens, eos)
    return Corpus(train, heldout, tuple(str(p) for p in chosen), len(docs))


def sequences(stream: torch.Tensor, length: int) -> torch.Tensor:
    """The stream cut into rows of `length` tokens (the tail dropped): (N, length)."""
    n = stream.numel() // length
    if n == 0:
        raise SpecDecodeError(
            f"the corpus gave {stream.numel()} tokens, fewer than one sequence of {length}"
        )
    return stream[: n * length].view(n, length)
