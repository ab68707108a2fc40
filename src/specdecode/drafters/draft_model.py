"""A separate draft model sharing the target's tokenizer (or a quantized copy of the target: int8,
w4a16). The draft keeps its own KV cache; on every proposal it re-syncs with the committed
context by rolling back to the longest common prefix, then drafts k tokens one by one, each from
q computed by the same sampling pipeline as the target's p.

A quantized copy has the target's cache layout, and with `borrow_kv` it holds the target's keys
and values of the prompt (handed over by the engine after the target's prefill) and of every
token committed since (after each step) instead of computing them through its own weights: it
computes only its draft positions, the draft attends over the target's own KV (a closer draft,
if anything), a long prompt costs no draft prefill, and the steps it sits out (another drafter
drafted, or speculation was off) cost no catching up.
That prefill was the copy's largest cost on long prompts: PyTorch's 4-bit kernel runs many rows
1.6-1.8x slower than fp32 sgemm (64-256 rows of a 3072 x 576 product, 2 threads), so on
Spec-Bench summarization (600-900-token prompts, 64 new tokens) the w4a16 copy's drafting cost
c, its prefill included, was 1.5-1.9 target steps per draft token against ~0.6 on short prompts.
Lossless either way: whatever the draft attends over, its tokens are verified against q."""

from __future__ import annotations

import time
from typing import Any

import torch

from specdecode.drafters.base import EMPTY, Draft, draw, ids_tensor
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams


def check_vocab(target: Any, draft: Any, draft_name: str) -> None:
    tv, dv = target.cfg.vocab_size, draft.cfg.vocab_size
    if tv != dv:
        raise SpecDecodeError(
            f"draft model {draft_name} has a vocabulary of {dv} tokens but the target has {tv}: "
            "a draft model must share the target's tokenizer (for a draft with another "
            "tokenizer, use --drafter xtok, which drafts through text)"
        )


class DraftModelDrafter:
    """Drafts with `model` in its own KV cache, which grows with the request up to `capacity`."""

    def __init__(self, model: Any, name: str = "draft-model", capacity: int = 4096,
                 borrow_kv: bool = False) -> None:
        self.name = name
        self.model = model
        self.capacity = capacity
        self.borrow_kv = borrow_kv
        self.cache: Any = None
        self.fed: list[int] = []  # tokens whose KV the draft cache holds, in order
        self.catch_up_ns = 0  # time the last propose spent catching up (see _sync)
        self.held = 0  # leading cache positions that hold the target's KV (take_kv)

    def reset(self) -> None:
        self.cache, self.fed, self.held = None, [], 0

    def copy_state_from(self, other: DraftModelDrafter) -> None:
        """Start from another drafter's cache of the same model (e.g. a prefilled prompt)."""
        if other.cache is None or other.model is not self.model or not hasattr(other.cache, "k"):
            return
        n = len(other.fed)
        self.cache = self.model.new_cache(1, other.cache.capacity)
        self._write_prefix(other.cache.k[:, 0, :, :n], other.cache.v[:, 0, :, :n])
        self.fed, self.held = list(other.fed), other.held

    def take_kv(self, start: int, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold the target's keys and values (layers, kv_heads, n, head_dim) of the n committed
        `tokens` at positions start.. (with borrow_kv, where the layouts match, and where the
        lends are contiguous: positions before `start` are the target's from earlier lends)."""
        if not self.borrow_kv or not tokens:
            return
        if start == 0:
            self.reset()
        elif start != self.held:
            return  # not continuing the last lend: the draft catches up by itself
        self._reserve(start + len(tokens) + 1)
        own = getattr(self.cache, "k", None)
        if own is None or own.dtype != k.dtype or (own.shape[0], own.shape[2], own.shape[4]) != (
                k.shape[0], k.shape[1], k.shape[3]):
            return  # another layout: the draft computes its own
        self._write_prefix(k, v, start)
        del self.fed[start:]
        self.fed.extend(tokens)
        self.held = len(self.fed)

    def _write_prefix(self, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Hold keys and values (layers, kv_heads, n, head_dim) as the cache's slots
        start..start+n-1, the cache then holding start + n positions."""
        end = start + k.shape[2]
        self.cache.k[:, 0, :, start:end] = k
        self.cache.v[:, 0, :, start:end] = v
        self.cache.lengths[0] = end

    def _reserve(self, tokens: int) -> None:
        """Make the cache hold `tokens` positions: allocate, or grow (doubling) with one copy."""
        if self.cache is not None and self.cache.capacity >= tokens:
            return
        size = min(self.capacity, max(tokens, 128, 2 * getattr(self.cache, "capacity", 0)))
        old, self.cache = self.cache, self.model.new_cache(1, size)
        if old is not None and hasattr(old, "k"):
            n = old.lengths[0]
            self._write_prefix(old.k[:, 0, :, :n], old.v[:, 0, :, :n])
        elif old is not None:  # a cache without tensors to copy: start again
            self.fed, self.held = [], 0

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Roll back to the common prefix with `context`, feed the rest; logits of the last one.

        The time spent feeding more than the one pending token (the prompt, or the tokens
        committed while speculation was off) is kept in `catch_up_ns`: it is a one-off cost of
        (re)starting, not a cost per draft token, and the controller keeps the two apart.
        """
        start = time.perf_counter_ns()
        self._reserve(len(context) + 1)
        n = 0
        limit = min(len(self.fed), len(context) - 1)  # always feed at least one token
        while n < limit and self.fed[n] == context[n]:
            n += 1
        self.cache.rollback(0, n)
        self.fed = context[:n]
        self.held = min(self.held, n)
        logits = self._feed(context[n:])
        self.catch_up_ns = time.perf_counter_ns() - start if len(context) - n > 2 else 0
        return logits

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([tokens]), self.cache, logits_for="last")
        self.fed.extend(tokens)
        return logits[0]  # (1, V)

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        params: SamplingParams,
        prompt_len: int,
        generator: torch.Generator | None,
    ) -> Draft:
        ctx = context.tolist()
        if len(ctx) + k + 1 > self.capacity:
            return Draft(EMPTY, None)
        self._reserve(len(ctx) + k + 1)
        logits = self._sync(ctx)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            tok, q = draw(logits, params, ids_tensor(ctx + tokens), prompt_len, generator)
            qs += [] if q is None else [q]
            tokens.append(tok)
            if i + 1 < k:
                logits = self._feed([tok])
        q_all = torch.stack(qs) if qs else None
        return Draft(torch.tensor(tokens, dtype=torch.long), q_all)
