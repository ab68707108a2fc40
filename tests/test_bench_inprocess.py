"""The in-process runner on the real engine: a small random checkpoint through the harness, and
SmolLM2 end to end."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specdecode.bench.harness import RunOptions, run_bench
from specdecode.bench.inprocess import (
    InProcessRunner,
    RequestTrace,
    TurnRequest,
    conversation_text,
    generate_one,
    kv_bytes,
    weight_bytes,
)
from specdecode.bench.inprocess import (
    factory_key as inprocess_factory_key,
)
from specdecode.bench.records import ConfigSpec, RequestSample
from specdecode.bench.workloads import Prompt, Workload
from specdecode.drafters.base import Draft, Drafter, DraftRequest
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Generation, StepOutput
from specdecode.errors import SpecDecodeError
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.fakes import ScriptedDrafter

PLAIN = ConfigSpec("plain")
INT8 = ConfigSpec("int8-k2", "int8", 2)
NGRAM = ConfigSpec("ngram-k3", "ngram", 3)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: on 2 shared cores, two threads contend badly with other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(make_checkpoint(tmp_path_factory.mktemp("tiny") / "ck")))


def tiny_prompts() -> list[Prompt]:
    return [
        Prompt("rep", "code", ["t5 t6 t7 t8 t5 t6 t7 t8 t5 t6"]),
        Prompt("conv", "chat", ["t9 t10 t11", "t12 t13"]),
        Prompt("hot", "creative", ["t20 t21 t22"], temperature=0.8),
    ]


def workload_of(prompts: Sequence[Prompt]) -> Workload:
    return Workload("tiny", "memory", list(prompts))


def options(path: Path, **kw: Any) -> RunOptions:
    return RunOptions(path, progress=False, n_resamples=200, **kw)


# ------------------------------------------------------------------------- timing attribution


def test_trace_attributes_a_step_of_m_tokens_as_its_time_then_zeros() -> None:
    trace = RequestTrace(start=10.0)
    trace.observe(StepOutput([5, 6, 7], "a", None), 10.5)
    trace.observe(StepOutput([], "", None), 10.6)
    trace.observe(StepOutput([8], "b", None), 10.9)
    trace.observe(StepOutput([9, 4], "c", "length"), 11.0)
    assert trace.ttft is not None and trace.done is not None
    assert trace.ttft == pytest.approx(0.5)
    assert trace.itl == pytest.approx([0.0, 0.0, 0.4, 0.1, 0.0])
    assert trace.done == 11.0 and "".join(trace.text) == "abc"
    assert trace.ttft + sum(trace.itl) == pytest.approx(trace.done - trace.start)


def test_samples_record_seed_and_rule_and_a_peers_sampler_claims_no_rule() -> None:
    """A sampled sample carries its seed and rule (the identity audit pairs invariant-rule
    seeds with plain's); a llama.cpp peer samples with its own sampler, so it records none and
    is never paired (it would fail an identity it never promised)."""
    from specdecode.bench.inprocess import Finished, TurnRequest, to_sample
    from specdecode.counters import Counters

    prompt = Prompt("p", "chat", ("hi",))
    params = SamplingParams(temperature=0.8, seed=11)
    trace = RequestTrace(start=0.0)
    trace.observe(StepOutput([5], "a", "length"), 0.1)
    done = Finished([5], trace, Counters(), 0, 0, 0)
    ours = to_sample(ConfigSpec("ngram-k3", "ngram", 3), TurnRequest(prompt, 0, [1], params), done)
    peer = to_sample(ConfigSpec("gen", "llamacpp-generate", 1), TurnRequest(prompt, 0, [1], params),
                     done)
    assert (ours.seed, ours.rule) == (11, "invariant") and peer.rule == ""


def _plain_output(m: LoadedModel, ids: list[int], n: int) -> list[int]:
    gen = Generation(m.model, m.tokenizer, ids, SamplingParams(max_tokens=n))
    for _ in gen.run():
        pass
    return gen.output


@pytest.mark.parametrize("mode", ["perfect", "wrong"])
def test_generate_one_counts_rejections_and_bursts(tiny: LoadedModel, mode: str) -> None:
    ids = tiny.tokenizer.encode("t5 t6 t7")
    script = _plain_output(tiny, ids, 12)
    drafter = ScriptedDrafter(script, len(ids), mode, vocab=96)
    request = TurnRequest(Prompt("p", "c", ["x"]), 0, ids, SamplingParams(max_tokens=12))
    done = generate_one(tiny.model, tiny.tokenizer, request, drafter, 3, ())
    c = done.counters
    assert done.tokens == script
    if mode == "perfect":
        assert done.rejections == 0 and c.accepted == c.drafted
        assert done.trace.itl.count(0.0) == len(script) - c.steps  # m - 1 zeros per step
    else:
        assert c.accepted == 0 and done.rejections == c.drafted_per_pos[0] == c.steps - 1
        assert 0.0 not in done.trace.itl
    assert len(done.trace.itl) == len(done.tokens) - 1
    assert done.draft_kv == 0 and done.target_kv > 0


def test_a_draft_models_own_cache_is_counted(tiny: LoadedModel) -> None:
    ids = tiny.tokenizer.encode("t5 t6 t7")
    request = TurnRequest(Prompt("p", "c", ["x"]), 0, ids, SamplingParams(max_tokens=8))
    drafter = DraftModelDrafter(tiny.model, "draft-model")
    done = generate_one(tiny.model, tiny.tokenizer, request, drafter, 2, ())
    assert done.draft_kv == kv_bytes(tiny.model.new_cache(1, 128)) > 0  # its first allocation


def test_a_suffix_configurations_memory_counts_its_store(tiny: LoadedModel) -> None:
    """`suffix` (#24): the store of earlier requests is draft memory (MemoryRecord.draft_store),
    within its cap; other drafters have none, and a record written before the field reads 0."""
    from specdecode.bench.records import MemoryRecord

    suffix = ConfigSpec("suffix-k3", "suffix", 3, options={"suffix_mib": 1 / 32})
    runner = InProcessRunner(tiny, default_max_tokens=12, audit_samples=0)
    runner.fit_capacity(tiny_prompts(), 3)
    runner.check([PLAIN, NGRAM, suffix])
    for config in (PLAIN, NGRAM, suffix):
        runner.run(tiny_prompts()[:1], config)
    factory = runner.factory(suffix)
    store = factory.store if factory is not None else None
    assert store is not None and len(store) == 1  # the request ran, then was stored
    record = runner.memory(suffix)
    assert record is not None and 0 < record.draft_store == store.nbytes() <= 32 * 1024
    for config in (PLAIN, NGRAM):
        other = runner.memory(config)
        assert other is not None and other.draft_store == 0
    old = {key: value for key, value in record.to_dict().items() if key != "draft_store"}
    assert MemoryRecord.from_dict(old).draft_store == 0


# ----------------------------------------------------------------------------- end to end


def test_tiny_end_to_end_through_the_harness(tiny: LoadedModel, tmp_path: Path) -> None:
    runner = InProcessRunner(tiny, default_max_tokens=12, audit_samples=0)  # audits: below
    configs = [PLAIN, INT8, NGRAM]
    runner.fit_capacity(tiny_prompts(), 3)
    runner.check(configs)
    outcome = run_bench(runner, workload_of(tiny_prompts()), configs, options(tmp_path / "o"),
                        out=io.StringIO())
    results = outcome.analysis.results
    report = json.loads(outcome.report_json.read_text())
    assert len(report["samples"]) == 12 and "<svg" in outcome.report_html.read_text()
    for s in results.samples:
        assert not s.problems() and 1 <= s.output_tokens <= 12
        assert s.ttft_s + sum(s.itl_s) <= s.latency_s + 1e-9
        assert s.prefill_s + s.draft_s + s.target_s + s.verify_s <= s.latency_s
        assert s.steps >= 1 and (s.drafted == 0 if s.config == "plain" else True)
        assert s.drafted > 0 or s.config != "int8-k2"  # n-gram lookup may find no match
        assert (s.temperature == 0.8) == (s.prompt_id == "hot")
    by = {(s.config, s.prompt_id, s.turn): s for s in results.samples}
    first, second = by[("plain", "conv", 0)], by[("plain", "conv", 1)]
    assert second.prompt_tokens == first.prompt_tokens + first.output_tokens + 2
    audits = {a.config: a for a in outcome.analysis.audits}
    # 3 greedy requests and the seeded sampled one ("hot", rule invariant): plain's tokens
    assert audits["int8-k2"].passed and audits["int8-k2"].n_compared == 4
    assert audits["ngram-k3"].passed and audits["ngram-k3"].method == "seeded-token-identity"
    memory = {m.config: m for m in results.memory}
    # the int8 copy drafts in the target's cache (its draft positions are the target's room
    # for verification): weights of its own, no KV
    assert memory["int8-k2"].draft_weights > 0 and memory["int8-k2"].draft_kv == 0
    assert memory["ngram-k3"].draft_weights == 0 == memory["plain"].draft_kv
    assert memory["plain"].target_weights == weight_bytes(tiny.model) > 0
    curves = {c.drafter: c for c in results.cost_curves}
    assert curves["int8"].k == [1, 2] and curves["ngram"].k == [1, 2, 3]
    assert all(c > 0 for c in curves["int8"].c) and curves["int8"].v[0] > 0


def test_a_hybrid_gets_no_synthetic_cost_curve(tiny: LoadedModel) -> None:
    """On the repeating context of a cost curve the lookup half of ngram+int8 always matches, so
    a curve would show it drafting for free; its c comes from the run's timings instead."""
    runner = InProcessRunner(tiny, default_max_tokens=12, audit_samples=0, cost_repeats=1)
    hybrid = ConfigSpec("h-k2", "ngram+int8", 2)
    runner.fit_capacity(tiny_prompts(), 2)
    runner.check([PLAIN, INT8, hybrid])
    curves = runner.cost_curves([PLAIN, INT8, hybrid])
    assert [c.drafter for c in curves] == ["int8"]


class Interrupting(InProcessRunner):
    """Records timed run() calls; raises KeyboardInterrupt (Ctrl-C) on call `after` + 1
    (never when `after` < 0)."""

    def __init__(self, loaded: LoadedModel, after: int, **kw: Any) -> None:
        super().__init__(loaded, **kw)
        self.after = after
        self.timed: list[tuple[str, str]] = []

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        if not prompts[0].id.startswith("warmup-"):
            if 0 <= self.after <= len(self.timed):
                raise KeyboardInterrupt
            self.timed.append((config.name, prompts[0].id))
        return super().run(prompts, config)


def test_resume_measures_only_what_is_missing(tiny: LoadedModel, tmp_path: Path) -> None:
    prompts, configs = tiny_prompts()[:2], [PLAIN, INT8]
    first = Interrupting(tiny, after=2, default_max_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        run_bench(first, workload_of(prompts), configs, options(tmp_path), out=io.StringIO())
    second = Interrupting(tiny, after=-1, default_max_tokens=8)
    outcome = run_bench(second, workload_of(prompts), configs, options(tmp_path, resume=True),
                        out=io.StringIO())
    assert len(first.timed) == 2 and len(second.timed) == 2
    assert not set(first.timed) & set(second.timed)
    units = [s.unit for s in outcome.analysis.results.samples]
    assert len(units) == len(set(units)) == 6
    assert (outcome.resumed, outcome.measured) == (2, 4)  # rep: 1 turn, conv: 2 turns


# ------------------------------------------------------------- batching, controller, audits


def test_batch_of_two_runs_on_the_batch_engine(tiny: LoadedModel, tmp_path: Path) -> None:
    configs = [ConfigSpec("plain", batch_size=2), ConfigSpec("int8-k2", "int8", 2, batch_size=2),
               ConfigSpec("ngram-auto", "ngram", "auto", batch_size=2, options={"kmax": 3})]
    runner = InProcessRunner(tiny, default_max_tokens=8, audit_samples=0)
    runner.fit_capacity(tiny_prompts(), 3)
    outcome = run_bench(runner, workload_of(tiny_prompts()), configs, options(tmp_path),
                        out=io.StringIO())
    samples = outcome.analysis.results.samples
    assert len(samples) == 12 and all(s.batch_size == 2 and not s.problems() for s in samples)
    groups = {(s.prompt_id, s.config): s.group for s in samples}
    assert groups[("rep", "plain")] == groups[("conv", "int8-k2")] == 0
    assert groups[("hot", "ngram-auto")] == 1
    audits = {a.config: a for a in outcome.analysis.audits}
    assert audits["int8-k2"].passed and audits["ngram-auto"].passed
    assert audits["int8-k2"].n_compared == 4  # rep, conv turns 0, 1 (greedy), hot (seeded)
    memory = {m.config: m for m in outcome.analysis.results.memory}
    assert memory["plain"].target_kv == tiny.model.new_cache(2, 1).nbytes() * (
        memory["plain"].target_kv // tiny.model.new_cache(2, 1).nbytes())  # one 2-row cache


def test_refusals_before_measuring(tiny: LoadedModel) -> None:
    runner = InProcessRunner(tiny)
    with pytest.raises(SpecDecodeError, match="1 to 1 prompts"):
        runner.run(tiny_prompts()[:2], PLAIN)
    with pytest.raises(SpecDecodeError, match=r"kmax \(--kmax\) must be an integer in 1..64"):
        runner.check([ConfigSpec("ngram-auto", "ngram", "auto", options={"kmax": 99})])
    with pytest.raises(SpecDecodeError, match="takes no option 'colour'"):
        runner.check([ConfigSpec("ngram-x", "ngram", 2, options={"colour": 1})])
    with pytest.raises(SpecDecodeError, match="ngram_max must be an integer"):
        runner.check([ConfigSpec("ngram-bad", "ngram", 2, options={"ngram_max": "x"})])


def test_sampled_configs_get_a_statistical_audit(tiny: LoadedModel) -> None:
    runner = InProcessRunner(tiny, default_max_tokens=4, audit_samples=40)
    cool = Prompt("cool", "creative", ["t20 t21 t22"], temperature=0.1)
    runner.run([cool], INT8)
    runner.run([tiny_prompts()[0]], NGRAM)  # greedy only: nothing to audit here
    (verdict,) = runner.audit(INT8)
    assert verdict.method == "sampled-chi-square" and verdict.n_compared == 40
    assert verdict.passed and verdict.p_value is not None and "temperature 0.1" in verdict.details
    assert runner.audit(NGRAM) == [] and runner.audit(PLAIN) == []
    batch2 = ConfigSpec("int8-k2", "int8", 2, batch_size=2)
    runner.run([cool], batch2)
    assert runner.audit(batch2)[0].p_value == verdict.p_value  # reused, not rerun


class NeverDrafts(Drafter):
    """Proposes nothing: speculative decoding with it IS plain decoding."""

    name = "never"

    def propose(self, request: DraftRequest) -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long), None)


def test_sampled_audit_passes_a_config_that_is_plain_decoding(tiny: LoadedModel) -> None:
    runner = InProcessRunner(tiny, default_max_tokens=4, audit_samples=40)
    runner._factories[inprocess_factory_key(NGRAM)] = NeverDrafts
    runner.run([tiny_prompts()[2]], NGRAM)  # temperature 0.8
    (verdict,) = runner.audit(NGRAM)
    assert verdict.passed, verdict.details


def test_a_failed_sampled_audit_reaches_the_verdict(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import specdecode.bench.inprocess as inprocess
    from specdecode.audit import AuditResult

    failed = AuditResult("sampled", False, 40, 2, 1e-3, p_value=1e-9, tv_estimate=0.4,
                         tv_upper=0.5, confidence=0.95, cells=10, detectable_tv=0.3)
    monkeypatch.setattr(inprocess, "audit_sampled", lambda *a, **kw: failed)
    runner = InProcessRunner(tiny, default_max_tokens=4)
    runner.run([tiny_prompts()[2]], INT8)
    (verdict,) = runner.audit(INT8)
    assert not verdict.passed and verdict.n_failed == 1 and verdict.p_value == 1e-9


def test_conversation_uses_the_chat_template_with_earlier_replies() -> None:
    seen: list[list[dict[str, str]]] = []

    def apply(messages: list[dict[str, str]]) -> str:
        seen.append(messages)
        return "T"

    tok = SimpleNamespace(chat_template="x", apply_chat_template=apply)
    assert conversation_text(tok, ["a", "b"], ["r"], chat=True) == "T"  # type: ignore[arg-type]
    assert seen == [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "r"},
                     {"role": "user", "content": "b"}]]
    assert conversation_text(tok, ["a", "b"], ["r"], chat=False) == "a\n\nr\n\nb"  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm_end_to_end_plain_and_int8(smollm: LoadedModel, tmp_path: Path) -> None:
    prompts = [Prompt("qa", "qa", ["What is the boiling point of water at sea level?"]),
               Prompt("code", "code", ["Write a Python function that reverses a string."])]
    runner = InProcessRunner(smollm, max_tokens_cap=8)
    configs = [PLAIN, INT8]
    runner.fit_capacity(prompts, 2)
    runner.check(configs)
    outcome = run_bench(runner, workload_of(prompts), configs, options(tmp_path),
                        out=io.StringIO())
    samples = outcome.analysis.results.samples
    assert len(samples) == 4 and all(s.output_tokens == 8 for s in samples)
    raw = len(smollm.tokenizer.encode(prompts[0].turns[0]))
    assert all(s.prompt_tokens > raw + 5 for s in samples if s.prompt_id == "qa")  # template
    audit = next(a for a in outcome.analysis.audits if a.config == "int8-k2")
    assert audit.passed and audit.n_compared == 2
    memory = {m.config: m for m in outcome.analysis.results.memory}
    assert 0 < memory["int8-k2"].draft_weights < memory["int8-k2"].target_weights
    assert outcome.report_html.exists() and "int8-k2" in outcome.summary
