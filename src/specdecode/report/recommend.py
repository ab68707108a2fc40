"""The recommendation: enable speculation or not, with which drafter and k, up to which batch size.

Rule: a configuration is "on" at a batch size only where the lower bound of its measured
speedup's confidence interval (total ratio, see `analysis`) is above 1 AND its losslessness audit
passed (a configuration without any verdict is not recommended). Among configurations that are
on at their smallest measured batch size, the one with the highest measured speedup there wins;
it stays on up to the last batch size before the first one where it is not on. Configurations
measured under interference (other work on the machine, see `interference`) keep their verdict
but the recommendation carries a warning naming them: their speedups are not reliable.

The equivalent vLLM setting is given as a `--speculative-config` JSON string. Key names follow
vLLM's documentation of `SpeculativeConfig` ("method", "model", "num_speculative_tokens",
"prompt_lookup_max", "prompt_lookup_min"). Not verified against every vLLM release: recent
releases name a separate draft model "method": "draft_model" while older ones inferred it from
"model" alone, and whether Medusa / a batch-size cut-off are honoured depends on the version.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specdecode.bench import interference
from specdecode.bench.peers import is_peer
from specdecode.bench.records import ConfigSpec, RequestSample
from specdecode.drafters.options import INT8_COPY, W4A16_COPY
from specdecode.report import frontier
from specdecode.report.analysis import (
    Analysis,
    ConfigSummary,
    Interval,
    find_baseline,
    is_on,
    jsonable,
    loops,
    measure_speedup,
)

HEAD_METHODS = ("eagle", "eagle3", "medusa", "mtp")
DRAFT_MODEL_NAMES = ("draft-model", "draft_model", "draft")
# the quantized-copy drafters (drafters.options; drafter names, not precisions) as vLLM spells
# a checkpoint of that kind
QUANTIZED_COPIES = {INT8_COPY: "an int8 (e.g. W8A8 or GPTQ 8-bit)",
                    W4A16_COPY: "a 4-bit (AWQ or GPTQ)"}


@dataclass
class Recommendation:
    """What to deploy, and the measured evidence for it."""

    enable: bool
    config: str | None = None
    drafter: str | None = None
    k: int | None = None
    batch_sizes_on: list[int] = field(default_factory=list)
    turn_off_above: int | None = None  # keep it on up to this batch size; None: no measured cap
    vllm_config: dict[str, Any] | None = None
    evidence: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # e.g. measured under interference
    # a run of several targets (report.frontier): the chosen target, the fidelity rule it was
    # chosen under, and the headline saying so
    target: str | None = None
    fidelity: str | None = None
    headline: str = ""

    @property
    def vllm_json(self) -> str | None:
        """The `--speculative-config` argument for vLLM, or None."""
        return json.dumps(self.vllm_config) if self.vllm_config is not None else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["vllm_json"] = self.vllm_json
        return dict(jsonable(data))

    def render(self) -> str:
        """The recommendation as plain text (headline, evidence, notes, vLLM setting)."""
        if self.headline:
            head = self.headline
        elif self.enable:
            cap = (f"; turn it off above batch size {self.turn_off_above}"
                   if self.turn_off_above is not None else
                   f"; it wins at every measured batch size ({_sizes(self.batch_sizes_on)})")
            head = (f"Enable speculative decoding: {self.config} (drafter {self.drafter}, "
                    f"k={self.k}) at batch sizes {_sizes(self.batch_sizes_on)}{cap}.")
        else:
            head = "Do not enable speculative decoding: no configuration showed a speedup " \
                   "whose confidence interval lies above 1 with a passing losslessness audit."
        lines = [head, *(f"Warning: {w}" for w in self.warnings),
                 *(f"- {e}" for e in self.evidence), *(f"Note: {n}" for n in self.notes)]
        if self.vllm_json is not None:
            lines.append(f"vLLM: --speculative-config '{self.vllm_json}'")
        return "\n".join(lines)


def _sizes(sizes: list[int]) -> str:
    return ", ".join(str(b) for b in sizes)


def _fmt_ci(s: ConfigSummary) -> str:
    if s.speedup is None:
        return "no plain baseline measured"
    t, m = s.speedup.total_ratio, s.speedup.median_ratio
    return (f"speedup {t.estimate:.2f}x (95% CI {t.low:.2f}-{t.high:.2f}, {s.speedup.n_pairs} "
            f"paired requests; median ratio {m.estimate:.2f}x)")


def _audit_text(analysis: Analysis, s: ConfigSummary) -> str:
    passed = analysis.audit_passed(s.spec.name, s.spec.batch_size)
    return {True: "audit passed", False: "audit FAILED", None: "no audit verdict"}[passed]


def evidence_line(analysis: Analysis, s: ConfigSummary) -> str:
    """One line of numbers for a configuration at one batch size."""
    a = s.acceptance
    return (f"{s.spec.name} at batch size {s.spec.batch_size}: {_fmt_ci(s)}, alpha "
            f"{a.alpha:.2f}, accepted/drafted {a.rate:.2f}, mean acceptance length "
            f"{a.mean_acceptance_length:.2f}, {s.throughput_tok_s:.1f} tok/s; "
            f"{_audit_text(analysis, s)}")


def _by_name(analysis: Analysis) -> dict[str, list[ConfigSummary]]:
    out: dict[str, list[ConfigSummary]] = {}
    for s in analysis.configs:  # peers (bench.peers) are measured beside, never recommended
        if not s.spec.is_plain and not is_peer(s.spec.drafter):
            out.setdefault(s.spec.name, []).append(s)
    for runs in out.values():
        runs.sort(key=lambda s: s.spec.batch_size)
    return out


def _on_prefix(analysis: Analysis, runs: list[ConfigSummary]) -> list[ConfigSummary]:
    prefix: list[ConfigSummary] = []
    for s in runs:
        if not is_on(analysis, s):
            break
        prefix.append(s)
    return prefix


def vllm_speculative_config(spec: ConfigSpec, k: int) -> tuple[dict[str, Any] | None, str]:
    """vLLM's speculative_config for a configuration, and a note (why None, or caveats)."""
    from specdecode.drafters.options import model_part

    opts = spec.options
    part = model_part(spec.drafter)
    if part is not None:  # lookup first, a model drafter otherwise
        cfg_m, note_m = vllm_speculative_config(replace(spec, drafter=part), k)
        note = (f"vLLM runs one drafting method per deployment: this is {spec.drafter}'s model "
                "part alone, without the n-gram lookup it tries first, so re-measure it")
        if cfg_m is None:
            return None, note_m
        return cfg_m, f"{note}; {note_m}" if note_m else note
    if spec.drafter == "ngram":
        cfg: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k}
        for ours, theirs in (("ngram_max", "prompt_lookup_max"), ("ngram_min",
                                                                   "prompt_lookup_min")):
            if ours in opts:
                cfg[theirs] = int(opts[ours])
        note = "" if "prompt_lookup_max" in cfg else (
            "set prompt_lookup_max / prompt_lookup_min to the n-gram sizes the drafter used")
        return cfg, note
    if spec.drafter in DRAFT_MODEL_NAMES:
        model = str(opts.get("model", "<path to the draft model>"))
        return ({"method": "draft_model", "model": model, "num_speculative_tokens": k},
                'older vLLM releases infer a draft model from "model" alone: drop "method" '
                "if yours rejects it")
    if spec.drafter in QUANTIZED_COPIES:
        kind = QUANTIZED_COPIES[spec.drafter]
        return ({"method": "draft_model", "model": f"<{kind} checkpoint of the target>",
                 "num_speculative_tokens": k},
                f"vLLM quantizes no copy of the target on the fly: export {kind} checkpoint of "
                "the target and run it as the draft model (its acceptance may differ from this "
                "copy's: re-measure)")
    if spec.drafter in HEAD_METHODS:
        model = str(opts.get("model", f"<path to the {spec.drafter} checkpoint>"))
        return ({"method": spec.drafter, "model": model, "num_speculative_tokens": k},
                "check that your vLLM release supports this method for your target")
    return None, f"vLLM has no equivalent of the {spec.drafter!r} drafter"


def _deploy_k(s: ConfigSummary) -> tuple[int, str]:
    if isinstance(s.spec.k, int):
        return s.spec.k, ""
    k = max(1, round(s.k_effective)) if math.isfinite(s.k_effective) else 1
    return k, (f'k was "auto" (mean {s.k_effective:.2f} drafted per step); vLLM needs a fixed '
               f"num_speculative_tokens, so {k} is suggested")


def loop_note(analysis: Analysis, s: ConfigSummary) -> str | None:
    """Where plain decoding's outputs loop (stats.loops), how many, and the speedup on the
    requests whose outputs do not: the figure that holds for traffic that ends by itself."""
    base = find_baseline(s.spec, analysis.results.header.configs)
    if base is None:
        return None
    plain = analysis.results.samples_of(base.key)
    looping = {(x.prompt_id, x.turn) for x in plain if loops(x)}
    if not looping:
        return None

    def ends(samples: list[RequestSample]) -> list[RequestSample]:
        """The requests whose plain output does not loop."""
        return [x for x in samples if (x.prompt_id, x.turn) not in looping]

    text = (f"{len(looping)} of {len(plain)} requests' plain outputs loop (at least half of "
            "their 4-grams repeat their own earlier text, as a small model at greedy does); "
            "a drafter predicts a loop cheaply (a prompt lookup for free), so the speedup "
            "above overstates traffic whose outputs end by themselves")
    rest = measure_speedup(ends(analysis.results.samples_of(s.key)), ends(plain), base.name,
                           analysis.n_resamples, analysis.seed)
    if rest is None or rest.n_pairs < 2:
        return text + "; too few other requests to measure it without them"
    r, d = rest.total_ratio, rest.decode_ratio
    return text + (f"; on the {rest.n_pairs} other requests: {r.estimate:.2f}x "
                   f"(95% CI {r.low:.2f}-{r.high:.2f}), after the first token {d.estimate:.2f}x "
                   f"({d.low:.2f}-{d.high:.2f})")


def recommend(analysis: Analysis, fidelity: str | None = None) -> Recommendation:
    """The deployment recommendation from an Analysis (see the module docstring; a run of
    several targets: `recommend_targets`, under `fidelity`), with a warning when
    configurations were measured under interference (`interference.warning`)."""
    rec = recommend_targets(analysis, fidelity) if frontier.is_targets_run(analysis) else \
        _recommend(analysis)
    results = analysis.results
    warning = interference.warning(interference.assess(results.header, results.samples))
    if warning is not None:
        rec.warnings.append(warning)
    return rec


def _recommend(analysis: Analysis) -> Recommendation:
    candidates: list[tuple[float, list[ConfigSummary], list[ConfigSummary]]] = []
    for runs in _by_name(analysis).values():
        prefix = _on_prefix(analysis, runs)
        if prefix and prefix[0].speedup is not None:
            candidates.append((prefix[0].speedup.total_ratio.estimate, prefix, runs))
    if not candidates:
        evidence = [evidence_line(analysis, runs[0]) for runs in _by_name(analysis).values()]
        return Recommendation(enable=False, evidence=evidence)
    _, prefix, runs = max(candidates, key=lambda c: (c[0], len(c[1])))
    best = prefix[0]
    k, k_note = _deploy_k(best)
    vllm, vllm_note = vllm_speculative_config(best.spec, k)
    off = runs[len(prefix)] if len(prefix) < len(runs) else None
    evidence = [evidence_line(analysis, s) for s in runs]
    notes = [n for n in (loop_note(analysis, best), k_note, vllm_note) if n]
    if off is not None:
        notes.append(f"at batch size {off.spec.batch_size} it is not a demonstrated win: "
                     f"{_fmt_ci(off)}, {_audit_text(analysis, off)}. Larger batches leave "
                     "less idle compute for verification")
        notes.append(f"to stop speculating above batch size {prefix[-1].spec.batch_size} in "
                     f'vLLM, releases that support it take "disable_by_batch_size": '
                     f"{prefix[-1].spec.batch_size} in the same JSON (a V0-engine option; "
                     "check your release before relying on it)")
    return Recommendation(
        enable=True, config=best.spec.name, drafter=best.spec.drafter, k=k,
        batch_sizes_on=[s.spec.batch_size for s in prefix],
        turn_off_above=prefix[-1].spec.batch_size if off is not None else None,
        vllm_config=vllm, evidence=evidence, notes=notes,
    )


# ------------------------------------------------------------------------- several targets


def _x(iv: Interval | None) -> str:
    return "-" if iv is None or not math.isfinite(iv.estimate) else \
        f"{iv.estimate:.2f}x [{iv.low:.2f}, {iv.high:.2f}]"


def fidelity_text(p: frontier.TargetPoint) -> str:
    """A target's fidelity in words."""
    f = p.fidelity
    text = "agreement with fp32 not measured" if f is None else (
        f"top-1 agreement with fp32 {f.top1:.1%}, mean KL {f.mean_kl:.2g} nats")
    if p.same_output is not None:
        text += f", same greedy output as fp32 on {p.same_output[0]}/{p.same_output[1]} requests"
    return text


def speed_text(p: frontier.TargetPoint) -> str:
    """The fastest lossless configuration's tokens/s and ratios."""
    ref = f", {_x(p.vs_reference)} llama.cpp's plain decoding" if p.vs_reference else ""
    if p.decode_vs_reference is not None:
        ref += f" (after the first token {_x(p.decode_vs_reference)})"
    own = f", {_x(p.speedup)} its plain decoding" if p.speedup is not None else ""
    return f"{p.best.spec.name} {p.tok_s:.1f} tok/s{own}{ref}"


def point_line(p: frontier.TargetPoint) -> str:
    """One target at one batch size: plain, its fastest lossless configuration, fidelity."""
    ref = f" ({_x(p.plain_vs_reference)} llama.cpp's plain)" if p.plain_vs_reference else ""
    best = "no speculative configuration demonstrated a win" if p.best is p.plain else \
        f"fastest lossless {speed_text(p)}"
    return (f"{p.target} at batch size {p.batch_size}: plain {p.plain.throughput_tok_s:.1f} "
            f"tok/s{ref}; {best}; {fidelity_text(p)}"
            + ("; on the speed-fidelity frontier" if p.on_frontier else ""))


def recommend_targets(analysis: Analysis, fidelity: str | None = None) -> Recommendation:
    """Among the targets whose fidelity `fidelity` admits (fp32 | any | kl=X | top1=X; None:
    the rule the run was started with, kept in its header), the fastest lossless configuration
    at the smallest batch size measured (frontier.choose); the evidence is every target's
    point, the notes the frontier (what each level of fidelity costs) and whether the choice is
    within noise of the next."""
    details = analysis.results.header.runner.get("details") or {}
    rule = frontier.parse_fidelity(fidelity if fidelity is not None else details.get("fidelity"))
    points = frontier.target_points(analysis)
    batch = min((p.batch_size for p in points), default=1)
    choice = frontier.choose(analysis, points, rule, batch)
    evidence = [point_line(p) for p in points]
    notes = [frontier_note(points, batch), *refusal_notes(analysis)]
    if choice.point is None:
        return Recommendation(enable=False, evidence=evidence, notes=notes, fidelity=rule.text,
                              headline=f"No target measured at batch size {batch} meets the "
                                       f"fidelity asked for ({rule.describe()}).")
    p, best = choice.point, choice.point.best
    headline = (f"Fastest lossless configuration for {rule.describe()}, at batch size "
                f"{batch}: {speed_text(p)}; {fidelity_text(p)}.")
    if choice.runner_up is not None and choice.lead is not None:
        notes.insert(0, f"ahead of the next admitted target's best, "
                        f"{choice.runner_up.best.spec.name}, by {_x(choice.lead)}"
                        + (" (paired, same requests): within the noise, a tie"
                           if choice.tied else " (paired, same requests)"))
    if best.spec.is_plain:
        return Recommendation(enable=False, config=best.spec.name, target=p.target,
                              fidelity=rule.text, headline=headline, evidence=evidence,
                              notes=notes)
    k, k_note = _deploy_k(best)
    vllm, vllm_note = vllm_speculative_config(best.spec, k)
    on = [s.spec.batch_size for s in analysis.configs
          if s.spec.name == best.spec.name and is_on(analysis, s)]
    return Recommendation(enable=True, config=best.spec.name, drafter=best.spec.drafter, k=k,
                          batch_sizes_on=on, vllm_config=vllm, evidence=evidence,
                          notes=notes + [n for n in (k_note, vllm_note) if n],
                          target=p.target, fidelity=rule.text, headline=headline)


def frontier_note(points: Sequence[frontier.TargetPoint], batch: int) -> str:
    """The speed-fidelity frontier at `batch`, most faithful first."""
    front = sorted((p for p in points if p.batch_size == batch and p.on_frontier),
                   key=lambda p: (-p.fidelity.top1, p.fidelity.mean_kl)  # type: ignore[union-attr]
                   if p.fidelity else (0.0, 0.0))
    if not front:
        return f"no speed-fidelity frontier at batch size {batch} (agreement not measured)"
    return (f"the speed-fidelity frontier at batch size {batch}, most faithful first: "
            + "; ".join(f"{p.target}: {speed_text(p)} ({fidelity_text(p)})" for p in front))


def refusal_notes(analysis: Analysis) -> list[str]:
    """Configurations the run left out on some target, and why (bench.targets)."""
    notes = []
    for facts in frontier.target_facts(analysis).values():
        for config, why in (facts.get("refused") or {}).items():
            notes.append(f"{config} was not measured: {why}")
    return notes
