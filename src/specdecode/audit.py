"""The losslessness audit: does this configuration's output distribution equal the target's?

Greedy configurations: speculative output must be token-identical to plain decoding, prompt by
prompt. Sampled configurations: `samples` plain and `samples` speculative generations of the first
`tokens` tokens (independent seeds) are compared as two categorical samples over whole token
sequences; under the invariant rule (SamplingParams.rule), every plain sample's seed is also run
speculatively, and must give the same tokens: an exact check beside the statistical one.
Outcomes are grouped into the `cells` most frequent sequences plus "other" (a grouped
distribution: its TV distance is a lower bound on the full one). Reported: the estimated total-
variation distance with a (1 - delta) upper confidence bound, and a two-sample chi-square p-value;
the verdict fails when p < false_alarm, a rate the user states (default 1e-3), or when a seed's
speculative output differs from its plain output.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdecode.audit_stats import chi_square_homogeneity, required_samples, tv_two_sample
from specdecode.drafters.base import Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Generation, adopt_prefill
from specdecode.errors import SpecDecodeError
from specdecode.limits import AUDIT_POWER, AUDIT_REAL_TV
from specdecode.sampling import SamplingParams

Outcome = tuple[int, ...]
POWER, TV_REAL = AUDIT_POWER, AUDIT_REAL_TV
CELLS = 30  # outcome cells: the most frequent sequences (the rest pooled into one more)


@dataclass(frozen=True)
class AuditResult:
    mode: str  # "greedy" or "sampled"
    passed: bool
    samples: int  # per side: generations (sampled) or prompts (greedy)
    tokens: int  # tokens per outcome
    false_alarm: float
    p_value: float | None = None
    tv_estimate: float | None = None
    tv_upper: float | None = None
    confidence: float | None = None
    cells: int | None = None
    mismatches: int = 0
    acceptance_rate: float | None = None
    detectable_tv: float | None = None  # TV this sample size catches with power POWER
    identical: int | None = None  # rule invariant: seeds whose speculative output is plain's

    def render(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.mode == "greedy":
            return (f"audit (greedy): {verdict}: {self.samples - self.mismatches}/{self.samples} "
                    f"prompts token-identical to plain decoding over {self.tokens} tokens")
        acc = "n/a" if self.acceptance_rate is None else f"{self.acceptance_rate:.2f}"
        return (
            f"audit (sampled): {verdict}: first {self.tokens} tokens, {self.samples} plain vs "
            f"{self.samples} speculative samples, {self.cells} outcome cells\n"
            f"  estimated TV distance {self.tv_estimate:.3f}, upper bound {self.tv_upper:.3f} at "
            f"{self.confidence:.0%} confidence\n"
            f"  chi-square homogeneity p = {self.p_value:.3g} (fail below {self.false_alarm:g}); "
            f"detects TV >= {self.detectable_tv:.2f} with power {POWER:g}\n"
            f"  speculative accepted/drafted during the audit: {acc}"
            + ("" if self.identical is None else
               f"\n  seeded identity (rule invariant): {self.identical}/{self.samples} seeds "
               "token-identical to plain decoding")
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _generate(model: Any, prompt: list[int], params: SamplingParams, drafter: Drafter | None,
              k: int, eos: tuple[int, ...], template: Generation | None = None,
              constraint: Any = None) -> Generation:
    gen = Generation(model, None, prompt, params, drafter, k, eos, constraint=constraint)
    if template is not None:
        adopt_prefill(gen, template)
    for _ in gen.run():
        pass
    gen.release()
    return gen


def audit_greedy(model: Any, prompts: list[list[int]], params: SamplingParams,
                 make_drafter: Callable[[], Drafter], k: int, eos: tuple[int, ...] = (),
                 constraint: Any = None) -> AuditResult:
    """Greedy identity, prompt by prompt; `constraint` (constraints.Constraint): both sides
    constrained by it."""
    mismatches = 0
    for prompt in prompts:
        plain = _generate(model, prompt, params, None, 0, eos, constraint=constraint).output
        spec = _generate(model, prompt, params, make_drafter(), k, eos,
                         constraint=constraint).output
        mismatches += plain != spec
    return AuditResult("greedy", mismatches == 0, len(prompts), params.max_tokens, 0.0,
                       mismatches=mismatches)


def grouped(a: Counter[Outcome], b: Counter[Outcome], cells: int) -> tuple[list[int], list[int]]:
    # Ties broken by a hash of the outcome, never by which sample saw it first: an order that
    # favoured one sample would bias the "other" cell and make a correct configuration fail.
    pooled = a + b
    top = sorted(pooled, key=lambda o: (-pooled[o], hashlib.sha256(repr(o).encode()).digest()))
    top = top[:cells]
    rest_a = sum(a.values()) - sum(a[o] for o in top)
    rest_b = sum(b.values()) - sum(b[o] for o in top)
    return [a[o] for o in top] + [rest_a], [b[o] for o in top] + [rest_b]


def audit_sampled(model: Any, prompt: list[int], params: SamplingParams,
                  make_drafter: Callable[[], Drafter], k: int, samples: int, tokens: int = 2,
                  false_alarm: float = 1e-3, cells: int = CELLS, seed: int = 0,
                  eos: tuple[int, ...] = (), progress: Callable[[int], None] | None = None,
                  constraint: Any = None) -> AuditResult:
    if tokens < 2:
        raise SpecDecodeError(
            f"--tokens {tokens}: the sampled audit needs at least 2 tokens per outcome (the "
            "first token comes from the target alone, so with one token the drafter never runs "
            "and the audit could not fail)")
    plain: Counter[Outcome] = Counter()
    spec: Counter[Outcome] = Counter()
    drafted = accepted = 0
    identical: int | None = 0 if params.rule == "invariant" else None
    template = Generation(model, None, prompt, dataclasses.replace(params, max_tokens=tokens))
    template.prefill()  # every sample starts from this prompt's KV (a copy, not a recompute)
    warm = make_drafter()
    if isinstance(warm, DraftModelDrafter) and warm.cache_model is None:  # its own cache
        warm._sync(prompt)
    for i in range(samples):
        p = dataclasses.replace(params, max_tokens=tokens, seed=seed + 2 * i)
        plain_out = _generate(model, prompt, p, None, 0, eos, template, constraint).output
        plain[tuple(plain_out)] += 1
        if identical is not None:  # the same seed, speculatively: must give the same tokens
            same = _speculative(model, prompt, p, make_drafter, warm, k, eos, template,
                                constraint)
            identical += same.output == plain_out
        p = dataclasses.replace(p, seed=seed + 2 * i + 1)
        gen = _speculative(model, prompt, p, make_drafter, warm, k, eos, template, constraint)
        spec[tuple(gen.output)] += 1
        drafted += gen.counters.drafted
        accepted += gen.counters.accepted
        if progress is not None:
            progress(i + 1)
    a, b = grouped(plain, spec, cells)
    test = chi_square_homogeneity(a, b)
    tv = tv_two_sample(a, b, delta=0.05)
    detectable = detectable_tv(samples, false_alarm, len(a))
    passed = test.p_value >= false_alarm and identical in (None, samples)
    return AuditResult(
        "sampled", passed, samples, tokens, false_alarm, test.p_value,
        tv.estimate, tv.upper_bound, tv.confidence, len(a),
        acceptance_rate=accepted / drafted if drafted else None, detectable_tv=detectable,
        identical=identical,
    )


def _speculative(model: Any, prompt: list[int], params: SamplingParams,
                 make_drafter: Callable[[], Drafter], warm: Drafter, k: int,
                 eos: tuple[int, ...], template: Generation,
                 constraint: Any) -> Generation:
    drafter = make_drafter()
    if isinstance(drafter, DraftModelDrafter) and isinstance(warm, DraftModelDrafter):
        drafter.copy_state_from(warm)  # its own cache, with the prompt already fed
    return _generate(model, prompt, params, drafter, k, eos, template, constraint)


def detectable_tv(samples: int, false_alarm: float, cells: int) -> float:
    """Smallest TV on a 0.01 grid that `samples` per side detect with power POWER."""
    for step in range(1, 101):
        tv = step / 100
        if required_samples(tv, false_alarm, POWER, max(2, cells), two_sample=True) <= samples:
            return tv
    return 1.0


def samples_to_detect(tv: float, false_alarm: float, cells: int = CELLS + 1) -> int:
    """Samples per side a sampled audit needs to detect a TV distance of `tv` with power POWER
    (at most `cells` outcome cells: more cells need more samples, so the default is an upper
    bound for `audit_sampled`'s grouping)."""
    return required_samples(tv, false_alarm, POWER, max(2, cells), two_sample=True)
