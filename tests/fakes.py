"""Shared fakes of the test suite (tests only).

- `FakeRunner` and its helpers: a bench Runner producing synthetic, self-consistent samples.
- `ScriptedDrafter`: a drafter that is always right, always wrong, or right for a prefix.

FakeRunner's timing model (seconds): prefill `prefill_s`; a plain decode step
`step_s * batch_cost(B)`; a speculative step `step_s * batch_cost(B) * (k * c + v(B, k))`.
Acceptance per draft token is i.i.d. with probability alpha (per drafter name). Every time gets
multiplicative log-normal noise of relative size `noise`. Greedy output tokens depend only on
(prompt, turn, position), so a correct speculative config reproduces plain decoding's tokens;
configs named in `corrupt` change one token (a deliberately lossy engine).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdecode.bench.records import (
    AuditVerdict,
    ConfigSpec,
    CostCurve,
    MemoryRecord,
    RequestSample,
)
from specdecode.bench.runner import RunnerDescription, effective_temperature, request_seed
from specdecode.bench.workloads import Prompt, Workload
from specdecode.drafters.base import Draft, Drafter, DraftRequest
from specdecode.models.invariance import Invariance

DEFAULT_TOKENS = 32


def linear_v(base: float = 1.05, per_batch: float = 0.0) -> Callable[[int, int], float]:
    """v(B, k) = base + per_batch * (B - 1) * k: verification gets dearer with batch size."""
    return lambda batch, k: base + per_batch * (batch - 1) * k


@dataclass
class FakeRunner:
    alpha: dict[str, float] = field(default_factory=lambda: {"ngram": 0.7})
    step_s: float = 0.010
    prefill_s: float = 0.030
    c: float = 0.05
    v: Callable[[int, int], float] = field(default_factory=linear_v)
    noise: float = 0.03
    seed: int = 0
    weight_hash: str = "a" * 64
    precision: str = "fp32"
    corrupt: set[str] = field(default_factory=set)
    audits: bool = True
    interrupt_after: int | None = None  # raise KeyboardInterrupt on that run() call
    calls: list[tuple[str, int, list[str]]] = field(default_factory=list)

    def describe(self) -> RunnerDescription:
        return {"runner": "fake", "model_name": "fake-135m", "precision": self.precision,
                "weight_hash": self.weight_hash, "torch_threads": 2}

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        self.calls.append((config.name, config.batch_size, [p.id for p in prompts]))
        if self.interrupt_after is not None and len(self.calls) > self.interrupt_after:
            raise KeyboardInterrupt
        return [self._request(p, turn, config) for p in prompts for turn in range(len(p.turns))]

    def cost_curves(self, configs: Sequence[ConfigSpec]) -> list[CostCurve]:
        return []

    def memory(self, config: ConfigSpec) -> MemoryRecord | None:
        draft = 0 if config.is_plain else 1 << 20
        return MemoryRecord(config.name, config.batch_size, 100 << 20, draft,
                            config.batch_size << 22, 0, 300 << 20)

    def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
        return []

    # ------------------------------------------------------------------ synthetic requests

    def _rng(self, *parts: object) -> np.random.Generator:
        key = ":".join(str(p) for p in (self.seed, *parts))
        return np.random.default_rng(zlib.crc32(key.encode()))

    def _noisy(self, rng: np.random.Generator, t: float) -> float:
        return float(t * np.exp(rng.normal(0.0, self.noise)))

    def _tokens(self, prompt: Prompt, turn: int, n: int, temperature: float,
                config: ConfigSpec) -> list[int]:
        base = [zlib.crc32(f"{prompt.id}:{turn}:{i}".encode()) % 49152 for i in range(n)]
        if temperature > 0:
            rng = self._rng("sample", config.name, prompt.id, turn)
            base = [int(x) for x in rng.integers(0, 49152, size=n)]
        if config.name in self.corrupt and n > 3:
            base[3] = (base[3] + 1) % 49152
        return base

    def _request(self, prompt: Prompt, turn: int, config: ConfigSpec) -> RequestSample:
        rng = self._rng(config.name, config.batch_size, prompt.id, turn)
        n = prompt.max_tokens or DEFAULT_TOKENS
        temperature = effective_temperature(prompt, config)
        batch_cost = 1.0 + 0.15 * (config.batch_size - 1)
        ttft = self._noisy(rng, self.prefill_s * batch_cost)
        counters = _Counters()
        if config.is_plain:
            for _ in range(n - 1):
                counters.step(self._noisy(rng, self.step_s * batch_cost), 0, 0, 0.0)
        else:
            self._speculate(rng, config, n, batch_cost, counters)
        return RequestSample(
            config=config.name, batch_size=config.batch_size, prompt_id=prompt.id,
            category=prompt.category, turn=turn, prompt_tokens=40 + 10 * turn,
            output_tokens=n, ttft_s=ttft, itl_s=counters.itl, latency_s=ttft + sum(counters.itl),
            drafted=sum(counters.dpp), accepted=sum(counters.app),
            accepted_per_pos=counters.app, drafted_per_pos=counters.dpp,
            rejections=counters.rejections, steps=counters.steps, draft_s=counters.draft_s,
            target_s=counters.target_s, verify_s=0.0, prefill_s=ttft,
            output_token_ids=self._tokens(prompt, turn, n, temperature, config),
            text=f"reply to {prompt.id} turn {turn}", temperature=temperature,
            started_at=float(request_seed(prompt, turn, self.seed)),
        )

    def _speculate(self, rng: np.random.Generator, config: ConfigSpec, n: int,
                   batch_cost: float, counters: _Counters) -> None:
        k = config.k if isinstance(config.k, int) else 3
        alpha = self.alpha.get(config.drafter, 0.5)
        remaining = n - 1
        while remaining > 0:
            kk = min(k, remaining - 1) if remaining > 1 else 0
            accepted = 0
            while accepted < kk and rng.random() < alpha:
                accepted += 1
            draft_t = self._noisy(rng, self.step_s * batch_cost * kk * self.c)
            verify_t = self._noisy(rng, self.step_s * batch_cost * self.v(config.batch_size, kk))
            counters.spec_step(draft_t, verify_t, kk, accepted)
            remaining -= accepted + 1


@dataclass
class _Counters:
    itl: list[float] = field(default_factory=list)
    dpp: list[int] = field(default_factory=list)
    app: list[int] = field(default_factory=list)
    steps: int = 0
    rejections: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0

    def step(self, t: float, drafted: int, accepted: int, draft_t: float) -> None:
        self.steps += 1
        self.itl += [t + draft_t] + [0.0] * accepted
        self.target_s += t
        self.draft_s += draft_t

    def spec_step(self, draft_t: float, verify_t: float, drafted: int, accepted: int) -> None:
        self.step(verify_t, drafted, accepted, draft_t)
        width = max(len(self.dpp), drafted)
        self.dpp += [0] * (width - len(self.dpp))
        self.app += [0] * (width - len(self.app))
        for i in range(drafted):
            self.dpp[i] += 1
        for i in range(accepted):
            self.app[i] += 1
        if accepted < drafted:
            self.rejections += 1


def plain(batch: int = 1, name: str = "plain") -> ConfigSpec:
    return ConfigSpec(name=name, drafter="none", k=0, batch_size=batch)


def ngram(batch: int = 1, k: int = 4, name: str = "ngram-k4") -> ConfigSpec:
    return ConfigSpec(name=name, drafter="ngram", k=k, batch_size=batch,
                      options={"ngram_max": 3, "ngram_min": 1})


def make_prompts(n: int = 12, categories: Sequence[str] = ("code", "qa", "chat"),
                 multi_turn_every: int = 5, max_tokens: int = 24) -> list[Prompt]:
    out = []
    for i in range(n):
        turns = ["first question", "follow-up"] if i % multi_turn_every == 4 else ["question"]
        out.append(Prompt(id=f"p{i}", category=categories[i % len(categories)], turns=turns,
                          max_tokens=max_tokens + 4 * (i % 3)))
    return out


def workload_of(prompts: Sequence[Prompt], name: str = "synthetic") -> Workload:
    return Workload(name=name, path=f"<{name}>", prompts=list(prompts))


# ------------------------------------------------------------- drafters


class ScriptedDrafter(Drafter):
    """Proposes from a known continuation: always right, always wrong, or right for a prefix."""

    def __init__(self, script: list[int], prompt_len: int, mode: str, right_for: int = 0,
                 vocab: int = 49152) -> None:
        self.name, self.script, self.prompt_len = f"scripted-{mode}", script, prompt_len
        self.mode, self.right_for, self.vocab = mode, right_for, vocab

    def reset(self) -> None:
        pass

    def _token(self, i: int, j: int) -> int:
        right = self.script[i] if i < len(self.script) else 0
        if self.mode == "perfect" or (self.mode == "partial" and j < self.right_for):
            return right
        return (right + 1) % self.vocab

    def propose(self, request: DraftRequest) -> Draft:
        context, k = request.context, request.k
        done = len(context) - self.prompt_len
        return Draft(torch.tensor([self._token(done + j, j) for j in range(k)]), None)


# ------------------------------------------------------------- several targets (bench --targets)


@dataclass
class FakeTargetsRunner:
    """Several targets of one fake model (`bench.targets.TargetsRunner`'s protocol): each a
    FakeRunner with its own plain step time; a target's greedy output differs from fp32's on
    the prompts listed in `diverge` (every configuration of that target alike, so speculation
    stays lossless with respect to its own target); `agreement` gives each target's recorded
    (top-1, mean KL) with fp32; the llama-cpp-python peer runs as plain decoding at
    `peer_step_s`."""

    step_s: dict[str, float]
    agreement: dict[str, tuple[float, float]]
    diverge: dict[str, set[str]] = field(default_factory=dict)
    alpha: dict[str, float] = field(default_factory=lambda: {"ngram": 0.75})
    corrupt: set[str] = field(default_factory=set)
    peer_step_s: float | None = 0.008
    fidelity: str = "any"
    refused: dict[str, dict[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.runners = {t: FakeRunner(alpha=self.alpha, step_s=s, corrupt=self.corrupt,
                                      seed=i, noise=0.02)
                        for i, (t, s) in enumerate(self.step_s.items())}
        self.peer = FakeRunner(step_s=self.peer_step_s or 0.01, seed=99, noise=0.02)

    def describe(self) -> RunnerDescription:
        targets = {t: {"backend": "llama.cpp" if t == "llama.cpp" else "native",
                       "precision": "gguf" if t == "llama.cpp" else t, "exact": True,
                       "invariance": "max |logit difference|: 0 across draft widths, 0 across "
                                     "batch rows, 0 across chunkings", "measured": True,
                       "max_logit_difference": 0.0, "refused": self.refused.get(t, {}),
                       "speculation": "allowed",
                       "agreement": {"top1": a[0], "mean_kl": a[1], "max_kl": 4 * a[1],
                                     "positions": 290, "chunk": 8}}
                   for t, a in self.agreement.items()}
        return {"runner": "fake", "model_name": "fake-135m",
                "precision": ",".join(self.step_s), "weight_hash": "a" * 64,
                "torch_threads": 2,
                "details": {"targets": targets, "fidelity": self.fidelity,
                            "cpu_features": ["avx2"], "agreement_text": "a fake text",
                            "no_reference": None if self.peer_step_s else "no llama_cpp"}}

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        from dataclasses import replace

        from specdecode.bench.peers import is_peer

        if is_peer(config.drafter):
            as_plain = replace(config, drafter="none", k=0)
            return [replace(s, config=config.name) for s in self.peer.run(prompts, as_plain)]
        samples = self.runners[config.target].run(prompts, config)
        off = self.diverge.get(config.target, set())
        return [replace(s, output_token_ids=[t ^ 1 for t in s.output_token_ids])
                if s.prompt_id in off else s for s in samples]

    def cost_curves(self, configs: Sequence[ConfigSpec]) -> list[CostCurve]:
        return []

    def memory(self, config: ConfigSpec) -> MemoryRecord | None:
        return None

    def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
        return []


class LookupTarget:
    """A stand-in target for drafters that never run the target (prompt lookups): what of
    models.target.Target the drafter registry reads before making them. It scores nothing, so
    its check finds every shape exact (the registry's refusal of a target that is not is tested
    on real models: test_precision, test_invariance)."""

    precision = "fp32"
    backend = "native"
    invariance: Invariance | None = None

    def check_invariance(self, width: int) -> Invariance:
        self.invariance = Invariance(widths=0.0, rows=0.0, chunks=0.0, width=width)
        return self.invariance
