"""Layer-skipping self-speculation: the target drafts for itself by running a subset of its blocks.

The draft is the target's own forward pass with `layers=` (the native runner runs only those
blocks, then the final norm and LM head), so it needs no extra weights. It reuses
`DraftModelDrafter` through `LayerSubset`, a thin wrapper whose forward passes `layers=`: each
draft token is drawn from q computed by the same sampling pipeline as the target's p.

It drafts in the target's own KV cache (drafters.base.Drafter.rounds, engine.draft_in_cache), as
Draft & Verify, SWIFT and LayerSkip do: at its kept blocks the draft reads the target's keys and
values of the committed tokens (computed by the full model: a closer draft, if anything, and
lossless either way, since its tokens are verified against q) and writes its own past the
committed length, where the target's verification overwrites them. So it holds no cache of its
own, prefills nothing, feeds only the pending token and its draft tokens, and a batch's rows
draft together. Called directly (`propose`, outside an engine) it drafts in a cache of its own,
a second prefill of the prompt through the kept blocks.

Which blocks to keep is measured, not guessed (as Draft & Verify and SWIFT do): `calibrate_layers`
teacher-forces a short calibration text through the model and greedily drops, one at a time, the
block whose removal keeps the highest agreement between the draft's argmax and the full model's
argmax, until `budget_layers` remain. The choice is cached per model (a digest of its weights),
budget and calibration text in a JSON file under the specdecode cache folder
(`cached_calibration`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.drafters.base import native
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.errors import SpecDecodeError
from specdecode.models.cache import KVCache
from specdecode.models.invariance import Invariance, measure
from specdecode.models.llama import LlamaModel
from specdecode.models.paths import cache_root
from specdecode.models.target import Cache, Target
from specdecode.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from specdecode.drafters.distilled import SubsetHead

# Share of the blocks the draft runs by default: the budget that lost least on SmolLM2-135M,
# where no budget paid (docs/measurements/code-figures.md). Deeper models skip more.
DEFAULT_KEEP_FRACTION = 0.9
CALIBRATION_VERSION = "1"  # bump when the search changes (the text is in the cache key)
_SAMPLE_PER_TENSOR = 4096  # values per weight tensor that go into the model digest

# (user, assistant) exchanges rendered as one chat: assistant-style text of several kinds.
CALIBRATION_CHAT: tuple[tuple[str, str], ...] = (
    (
        "Write a Python function that returns the n-th Fibonacci number.",
        "Here is an iterative version:\n\n```python\ndef fibonacci(n: int) -> int:\n"
        "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n```\n\n"
        "It runs in linear time and constant memory.",
    ),
    (
        "Summarize: The city council voted on Tuesday to extend the library's opening hours. "
        "Starting next month, the main branch will stay open until 9 pm on weekdays, and a new "
        "reading room for students will open on the second floor.",
        "The city council approved longer library hours: from next month the main branch will "
        "be open until 9 pm on weekdays, and a new student reading room will open upstairs.",
    ),
    (
        "Why is the sky blue?",
        "Sunlight contains all colors. When it passes through the atmosphere, the short blue "
        "wavelengths are scattered by air molecules much more than the longer red ones, so blue "
        "light reaches our eyes from every direction of the sky.",
    ),
)


@dataclass(frozen=True)
class Calibration:
    layers: tuple[int, ...]  # kept blocks, ascending
    agreement: float  # share of scored positions where the draft's argmax is the full model's
    positions: int  # scored positions of the calibration text
    evaluations: int  # teacher-forced forward passes the search ran
    seconds: float


class LayerSubset:
    """The target restricted to `layers` (a models.target.Target): what DraftModelDrafter
    calls its draft model. It holds no weights of its own (all are the target's)."""

    supports_trees = False  # a draft model: it drafts chains
    invariance: Invariance | None = None

    def __init__(self, model: LlamaModel, layers: Sequence[int]) -> None:
        self.model = model
        self.layers = tuple(layers)
        self.cfg = model.cfg
        self.rows_independent = model.rows_independent
        self.backend, self.precision, self.dtype = model.backend, model.precision, model.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return self.model.new_cache(batch, capacity)

    def weight_bytes(self) -> int:
        return 0  # the target's blocks: nothing held beside them

    def version(self) -> str:
        return self.model.version()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.head(hidden)

    def check_invariance(self, width: int) -> Invariance:
        """As any target's (a draft model is never verified against; the interface asks)."""
        self.invariance = measure(self, width)
        return self.invariance

    def __call__(self, tokens: torch.Tensor, cache: Cache,
                 positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                 num_new: Sequence[int] | None = None, logits_for: str | torch.Tensor = "all",
                 layers: Sequence[int] | None = None, return_hidden: bool = False
                 ) -> torch.Tensor:
        if layers is not None:
            raise SpecDecodeError("a layer subset runs its own layers only")
        return self.model(tokens, cache, positions, tree_mask, num_new, logits_for,
                          self.layers, return_hidden)


class LayerSkipDrafter(DraftModelDrafter):
    """Self-speculation drafter (one per request) running the target's blocks `layers` only."""

    def __init__(self, model: LlamaModel, layers: Sequence[int], capacity: int = 4096,
                 head: SubsetHead | None = None) -> None:
        """`head`: a cheaper LM head to draft through (drafters.draft_head), or None: the
        target's."""
        from specdecode.drafters.draft_head import WithHead

        check_layers(model, layers)
        subset = LayerSubset(model, layers)
        super().__init__(subset if head is None else WithHead(subset, head), "layerskip",
                         capacity, in_cache=True)
        self.target = model
        self.head = head

    def weights(self) -> Target:
        """The target's own blocks: memory reports count none of them (a draft head's own rows,
        if any: drafters.draft_head)."""
        return self.target if self.head is None else self.model


def check_layers(model: Target, layers: Sequence[int]) -> None:
    """Raise SpecDecodeError unless `model` is on the native runner and `layers` are its blocks."""
    n = native(model, "layerskip").cfg.num_layers
    if not layers or any(not 0 <= i < n for i in layers) or list(layers) != sorted(set(layers)):
        raise SpecDecodeError(
            f"layerskip layers must be distinct ascending block indices in 0..{n - 1}, "
            f"got {list(layers)}"
        )


def default_budget(model: LlamaModel) -> int:
    """Blocks the draft keeps by default: DEFAULT_KEEP_FRACTION of them, at least one."""
    return max(1, round(DEFAULT_KEEP_FRACTION * model.cfg.num_layers))


def calibration_ids(tokenizer: Tokenizer, chat: Sequence[tuple[str, str]]) -> list[int]:
    """The calibration text as token ids: one chat of the exchanges (plain text if no template)."""
    if tokenizer.chat_template is not None:
        messages = []
        for user, assistant in chat:
            messages += [{"role": "user", "content": user},
                         {"role": "assistant", "content": assistant}]
        return list(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    return list(tokenizer.encode("\n\n".join(f"{u}\n{a}" for u, a in chat)))


def agreement(
    model: LlamaModel, ids: torch.Tensor, layers: Sequence[int], reference: torch.Tensor
) -> float:
    """Share of positions where the argmax of `layers` alone equals `reference` (teacher forced).

    ids: (1, T); reference: (T,) the full model's argmax at each position.
    """
    with torch.inference_mode():
        logits = model(ids, model.new_cache(1, ids.shape[1]), layers=layers)[0]  # (T, V)
    return float((logits.argmax(dim=-1) == reference).float().mean())


def search_layers(
    model: LlamaModel, ids: torch.Tensor, budget_layers: int, shortlist: int = 3
) -> tuple[list[int], float, int]:
    """Greedy backward elimination: (kept layers, their agreement, forward passes run).

    From all blocks, repeatedly drop the block whose removal keeps the highest agreement with the
    full model, until `budget_layers` remain. The first round measures every block; later rounds
    re-measure only the `shortlist` blocks that scored best when last measured (one pass over a
    few hundred tokens costs about one full forward, so a full greedy round per drop would cost
    num_layers passes each).
    """
    kept = list(range(model.cfg.num_layers))
    with torch.inference_mode():
        reference = model(ids, model.new_cache(1, ids.shape[1]))[0].argmax(dim=-1)  # (T,)
    scores: dict[int, float] = {}
    pool = list(kept)
    current, evaluations = 1.0, 1
    while len(kept) > budget_layers:
        for i in pool:
            scores[i] = agreement(model, ids, [j for j in kept if j != i], reference)
        evaluations += len(pool)
        best = max(pool, key=lambda i: (scores[i], i))  # ties: drop the later block
        kept.remove(best)
        current = scores.pop(best)
        pool = sorted(kept, key=lambda i: (scores[i], i), reverse=True)[:shortlist]
    return kept, current, evaluations


def calibrate_layers(
    target: Target,
    tokenizer: Tokenizer,
    budget_layers: int,
    chat: Sequence[tuple[str, str]] = CALIBRATION_CHAT,
    shortlist: int = 3,
) -> Calibration:
    """Choose the `budget_layers` blocks the draft keeps by measured greedy agreement on `chat`.

    Cost: about num_layers + shortlist * (blocks dropped) teacher-forced passes over `chat`.
    """
    model = native(target, "layerskip")
    if not 1 <= budget_layers <= model.cfg.num_layers:
        raise SpecDecodeError(
            f"layerskip budget must be 1..{model.cfg.num_layers} layers, got {budget_layers}"
        )
    start = time.perf_counter()
    ids = torch.tensor([calibration_ids(tokenizer, chat)])  # (1, T)
    kept, score, evaluations = search_layers(model, ids, budget_layers, shortlist)
    seconds = time.perf_counter() - start
    return Calibration(tuple(kept), score, ids.shape[1], evaluations, seconds)


def model_digest(model: LlamaModel) -> str:
    """A digest of the model's config and weights (an evenly spaced sample of every tensor)."""
    h = hashlib.sha256(json.dumps(model.cfg.to_dict(), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        if not isinstance(t, torch.Tensor) or t.is_quantized:
            continue
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE_PER_TENSOR)
        sample = flat[::step][:_SAMPLE_PER_TENSOR].to(torch.float64).numpy()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()


def calibration_path(
    model: LlamaModel, budget_layers: int, chat: Sequence[tuple[str, str]] = CALIBRATION_CHAT
) -> Path:
    """Where the calibration of `model` at `budget_layers` on `chat` is stored."""
    text = hashlib.sha256(json.dumps(list(chat)).encode()).hexdigest()[:8]
    key = f"{model_digest(model)[:24]}-keep{budget_layers}-{text}-v{CALIBRATION_VERSION}"
    return cache_root() / "layerskip" / f"{key}.json"


def cached_calibration(
    target: Target,
    tokenizer: Tokenizer | None,
    budget_layers: int,
    chat: Sequence[tuple[str, str]] = CALIBRATION_CHAT,
) -> Calibration:
    """The stored calibration for this model, budget and text, else a new one (stored).

    Calibrating needs `tokenizer`; reading a stored one does not.
    """
    model = native(target, "layerskip")
    path = calibration_path(model, budget_layers, chat)
    if path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return Calibration(**{**data, "layers": tuple(data["layers"])})
        except (OSError, ValueError, TypeError, KeyError):
            pass  # unreadable: calibrate again and overwrite it
    if tokenizer is None:
        raise SpecDecodeError(
            "the layerskip drafter must calibrate its layers for this model (once, then cached "
            f"in {path.parent}) and needs the model's tokenizer for it"
        )
    result = calibrate_layers(model, tokenizer, budget_layers, chat)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(result)), encoding="utf-8")
    os.replace(tmp, path)
    return result
