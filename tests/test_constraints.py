"""Structured output with speculation stays lossless.

Small random models over a 16-token vocabulary whose tokens are the letters a, c..p (id 1 is
EOS), with llguidance constraints over those letters. Greedy: constrained speculative decoding
is token-identical to plain constrained decoding. Sampled: a chi-square goodness-of-fit test of
the first two emitted tokens against the EXACT constrained target distribution (enumerated with
the same sampling pipeline) passes, and fails for each broken variant kept here: the mask on p
only, the mask on q only, the matcher not rolled back after a rejection.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import specdecode.sampling as sampling
import specdecode.verification as verification
from specdecode.constraints import (
    Constraint,
    ConstraintSpec,
    Matcher,
    grammar_spec,
    json_schema_spec,
    regex_spec,
    spec_from_args,
)
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import DEAD_END, BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from specdecode.sampling import SamplingParams, probs_from_logits
from tests.conftest import make_checkpoint
from tests.identity import assert_identical
from tests.test_engine_sampled import FALSE_ALARM, SAMPLES, gof_p_value  # one chi-square setup

llguidance = pytest.importorskip("llguidance")

VOCAB = 16
EOS = 1
LETTERS = "a" + "?" + "cdefghijklmnop"  # token id -> letter (id 1 is EOS)
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2}
MODELS = (("target", 6, 2, 4.0), ("draft", 7, 1, 8.0))
PROMPT = [5, 7, 3, 8]
# First c, j, k, m or n (a set chosen, by computing the first token's exact law under each
# broken variant, where the draft model's q puts 0.6 of its mass outside it); then after c any
# of i..p, after j or k only d (forced), after m or n any of c..p.
REGEX = "(c[i-p]|[jk]d|[mn][c-p])[c-p]*"
# the residual rule: the one whose q handling the broken variants below break (under the
# invariant rule verification never reads q; its own identity test is below)
PARAMS = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=2, rule="residual")


def letter_tokenizer() -> Any:
    """llguidance's tokenizer for the 16-token letter vocabulary (a `tokenizers` JSON with a
    byte-level decoder: what llguidance reads from a real tokenizer; llguidance tokenizes
    forced text with it, so it must split text into letters)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(LETTERS) if i != EOS}
    vocab["<eos>"] = EOS
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # a token per letter
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return llguidance.LLTokenizer(tok.to_str(), eos_token=EOS)


def ids(text: str) -> list[int]:
    return [LETTERS.index(c) for c in text]


def constraint(spec: ConstraintSpec) -> Constraint:
    return Constraint(spec, letter_tokenizer(), VOCAB)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    root = tmp_path_factory.mktemp("models")
    loaded = []
    for name, seed, layers, scale in MODELS:
        folder = make_checkpoint(root / name, seed=seed, scale=scale, num_hidden_layers=layers,
                                 **SMALL)
        loaded.append(load_native(folder, config_from_hf(read_hf_config(folder))))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield loaded[0], loaded[1]
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def regex() -> Constraint:
    return constraint(regex_spec(REGEX, "--regex"))


# ------------------------------------------------------------------------ the constraint itself


def test_matcher_masks_follow_the_grammar_and_roll_back(regex: Constraint) -> None:
    m = regex.matcher()
    first = m.allowed([])
    assert sorted(torch.nonzero(first).flatten().tolist()) == ids("cjkmn")
    assert torch.nonzero(m.allowed(ids("j"))).flatten().tolist() == ids("d")
    assert m.valid_prefix(ids("cd")) == 1  # c then d: d is not in i..p
    masks = m.masks(ids("c"))
    assert masks.shape == (2, VOCAB) and bool(masks[1][ids("k")[0]])
    assert m.commit(ids("k")) == 1 and m.forced() == ids("d")[0]  # forced: exactly one allowed
    m.allowed(ids("dcc"))  # a speculative path...
    assert m.commit(ids("dd")) == 2  # ...rolled back where the committed tokens differ
    assert m.accepting() and bool(m.allowed([])[EOS])
    assert m.valid_prefix([EOS, EOS]) == 1 and not m.allowed([EOS]).any()  # nothing after EOS
    assert m.commit(ids("e")) == 1 and m.valid_prefix(ids("f")) == 1  # the EOS path rolled back
    assert m.commit([EOS]) == 1


def test_bad_constraints_are_one_clear_error_naming_the_source(tmp_path: Any) -> None:
    bad = {
        "--regex": lambda: regex_spec("a(b", "--regex"),
        "--grammar": lambda: grammar_spec('start: "a" | missing', "--grammar g.lark"),
        "--json-schema": lambda: json_schema_spec('{"type": "nope"}', "--json-schema s.json"),
    }
    for origin, make in bad.items():
        with pytest.raises(SpecDecodeError, match=origin):
            make()
    with pytest.raises(SpecDecodeError, match="not valid JSON"):
        json_schema_spec('{"type": ', "--json-schema s.json")
    with pytest.raises(SpecDecodeError, match="must be an object"):
        json_schema_spec("[1]", "response_format.json_schema.schema")
    with pytest.raises(SpecDecodeError, match="Unimplemented"):
        json_schema_spec({"not": {}}, "--json-schema s.json")
    with pytest.raises(SpecDecodeError, match="cannot read"):
        spec_from_args(str(tmp_path / "missing.json"), None, None)
    with pytest.raises(SpecDecodeError, match="at most one"):
        spec_from_args(None, "a", "g.lark")
    with pytest.raises(SpecDecodeError, match="no token"):  # no letter token spells 'z'
        constraint(regex_spec("z+", "--regex"))


def test_gbnf_and_lark_grammars_both_compile() -> None:
    lark = constraint(grammar_spec('start: "c" ("d" | "e")+', "--grammar g.lark")).matcher()
    gbnf = constraint(grammar_spec('root ::= "c" [de]+', "--grammar g.gbnf")).matcher()
    for m in (lark, gbnf):
        assert m.forced() == ids("c")[0] and m.commit(ids("c")) == 1
        assert sorted(torch.nonzero(m.allowed([])).flatten().tolist()) == ids("de")


# ------------------------------------------------------------------------ greedy: identical


def run(target: Any, drafter: Any, k: int, params: SamplingParams,
        spec: Constraint | None, prompt: list[int] = PROMPT) -> Generation:
    gen = Generation(target, None, prompt, params, drafter, k, (EOS,), constraint=spec)
    for _ in gen.run():
        pass
    return gen


def allowed_by(c: Constraint, tokens: list[int]) -> bool:
    m = c.matcher()
    return m.valid_prefix(tokens) == len(tokens)


DRAFTERS: dict[str, Callable[[Any], Any]] = {
    "draft-model": lambda draft: DraftModelDrafter(draft),
    "lookup": lambda draft: NgramDrafter(3, 1),
    "hybrid": lambda draft: HybridDrafter(NgramDrafter(3, 1), DraftModelDrafter(draft),
                                          "ngram+draft", min_expected=0.0),
}


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_constrained_speculation_is_plain_constrained_decoding(
        models: Any, regex: Constraint, name: str, k: int) -> None:
    target, draft = models
    params = SamplingParams(max_tokens=24)
    runs, plains = [], []
    for prompt in ([3, 3, 9, 12, 3, 3, 9], [14, 2], [9, 9, 2]):
        plain = run(target, None, 0, params, regex, prompt)
        runs.append(run(target, DRAFTERS[name](draft), k, params, regex, prompt))
        plains.append(plain.output)
        assert allowed_by(regex, plain.output)
        unconstrained = run(target, None, 0, params, None, prompt)
        assert not allowed_by(regex, unconstrained.output)  # the constraint did something
    assert_identical(runs, plains, f"{name} k={k} under a regex")


def test_batched_requests_with_different_constraints_match_alone(models: Any,
                                                                 regex: Constraint) -> None:
    target, draft = models
    other = constraint(regex_spec("(cd|ef)+g?", "--regex"))
    params = SamplingParams(max_tokens=16)
    specs = [regex, other, None, regex]
    alone = [run(target, None, 0, params, s, [4 + i, 9]).output for i, s in enumerate(specs)]
    gens = [Generation(target, None, [4 + i, 9], params, DraftModelDrafter(draft), 3, (EOS,),
                       constraint=s) for i, s in enumerate(specs)]
    run_batch(BatchEngine(target, 2, 64), gens)
    assert_identical(gens, alone, "constrained rows")


def test_forced_tokens_are_emitted_unscored_and_change_nothing(
        models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first letter, 'cdefgh' is forced (one allowed token each): constrained
    decoding emits those 6 tokens without a target step, with the same output as when forcing
    is turned off (every token then scored)."""
    target, draft = models
    forced = constraint(regex_spec("[i-p]cdefgh[i-p]+", "--regex"))
    params = SamplingParams(max_tokens=12)
    outputs = {}
    for mode in ("forced", "scored"):
        if mode == "scored":
            monkeypatch.setattr(Matcher, "forced", lambda self: None)
        for k, drafter in ((0, None), (3, DraftModelDrafter(draft))):
            gen = run(target, drafter, k, params, forced, [3, 3])
            outputs[mode, k] = (gen.output, gen.counters)
    for k in (0, 3):
        assert outputs["forced", k][0] == outputs["scored", k][0]
    out, counters = outputs["forced", 0]
    assert out[1:7] == ids("cdefgh") and counters.forced == 6
    assert counters.steps == len(out) - 6 and outputs["scored", 0][1].steps == len(out)


def test_a_dead_end_ends_the_request_with_a_reason_saying_so(models: Any) -> None:
    """'cz': after 'c' only 'z' would do, which no token spells."""
    target, _ = models
    gen = run(target, None, 0, SamplingParams(max_tokens=8),
              constraint(regex_spec("cz", "--regex")), [3, 3])
    assert gen.output == ids("c") and gen.finish_reason == DEAD_END


# ------------------------------------------------------------------------ sampled: same law


def exact_pairs(target: Any, spec: Constraint) -> dict[tuple[int, int], float]:
    """P(first two tokens = (a, b)) for plain constrained sampling, by enumeration."""
    m = spec.matcher()
    empty = torch.zeros(0, dtype=torch.long)
    out: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        ctx = torch.tensor(PROMPT)
        logits = target(ctx[None], target.new_cache(1, 8))[0, -1:]
        first = probs_from_logits(logits, PARAMS, ctx, len(PROMPT), empty,
                                  m.allowed([])[None])[0]
        for a in torch.nonzero(first).flatten().tolist():
            hist = torch.tensor([*PROMPT, a])
            logits = target(hist[None], target.new_cache(1, 8))[0, -1:]
            second = probs_from_logits(logits, PARAMS, hist, len(PROMPT), empty,
                                       m.allowed([a])[None])[0]
            for b in torch.nonzero(second).flatten().tolist():
                out[(a, b)] = float(first[a] * second[b])
    return out


def observed_pairs(target: Any, make_drafter: Callable[[], Any] | None, k: int,
                   spec: Constraint, n: int = SAMPLES) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(n):
        params = SamplingParams(**{**PARAMS.__dict__, "seed": 20_000 + seed})
        gen = run(target, make_drafter() if make_drafter else None, k, params, spec)
        out = [*gen.output, -1, -1]
        counts[(out[0], out[1])] += 1
    return counts


@pytest.mark.statistical
@pytest.mark.parametrize("k", [0, 2])
def test_sampled_constrained_speculation_has_the_constrained_target_law(
        models: Any, regex: Constraint, k: int) -> None:
    target, draft = models
    counts = observed_pairs(target, lambda: DraftModelDrafter(draft), k, regex)
    assert gof_p_value(counts, exact_pairs(target, regex)) > FALSE_ALARM


@pytest.mark.statistical
def test_lookup_drafts_outside_the_grammar_are_cut_and_stay_exact(
        models: Any, regex: Constraint) -> None:
    """A lookup (no q) proposes tokens the grammar may forbid; they are cut, and the emitted
    law is still the constrained target's."""
    target, _ = models
    counts = observed_pairs(target, lambda: NgramDrafter(2, 1), 2, regex)
    assert gof_p_value(counts, exact_pairs(target, regex)) > FALSE_ALARM


def test_seeded_constrained_speculation_is_plain_constrained_sampling(
        models: Any, regex: Constraint) -> None:
    """Rule invariant: with a constraint too, a seed gives plain decoding's tokens, for a model
    drafter (its q drawn inside the mask with the target's noise) and a lookup (cut drafts)."""
    target, draft = models
    for make in (lambda: DraftModelDrafter(draft), lambda: NgramDrafter(2, 1)):
        runs, plains = [], []
        for seed in range(40):
            params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=seed)
            plains.append(run(target, None, 0, params, regex).output)
            runs.append(run(target, make(), 3, params, regex))
        assert_identical(runs, plains, f"seeded under a regex: {runs[0].drafter.name}")


def _q_unmasked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken: the drafter draws without the mask and its q is verified as drawn."""
    monkeypatch.setattr(DraftRequest, "allowed", lambda self, drafted: None)
    monkeypatch.setattr(sampling, "restrict_probs", lambda q, allowed: q)


def _p_unmasked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken: the target's p is computed without the mask (q keeps it)."""
    monkeypatch.setattr(verification, "row_masks", lambda matcher, draft: None)


def _no_rollback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken: after verification the matcher keeps the whole draft it was advanced along
    (rejected tokens included) and consumes only what follows the accepted ones."""
    commit = Matcher.commit

    def keep_path(self: Matcher, tokens: list[int]) -> int:
        accepted = 0
        while accepted < min(len(tokens), len(self.path)) and \
                self.path[accepted] == tokens[accepted]:
            accepted += 1
        path = list(self.path)
        taken = commit(self, path) if path else 0  # the draft, as if all accepted
        return commit(self, tokens[accepted:]) + accepted if taken == len(path) else 0

    monkeypatch.setattr(Matcher, "commit", keep_path)


@pytest.mark.statistical
@pytest.mark.parametrize("broken", [_q_unmasked, _p_unmasked, _no_rollback],
                         ids=["mask-on-p-only", "mask-on-q-only", "no-rollback"])
def test_broken_variants_are_caught(models: Any, regex: Constraint,
                                    monkeypatch: pytest.MonkeyPatch,
                                    broken: Callable[[pytest.MonkeyPatch], None]) -> None:
    target, draft = models
    exact = exact_pairs(target, regex)
    broken(monkeypatch)
    counts = observed_pairs(target, lambda: DraftModelDrafter(draft), 2, regex)
    assert gof_p_value(counts, exact) < FALSE_ALARM


# ------------------------------------------------------------------------ JSON schema (SmolLM2)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"], "additionalProperties": False}


@pytest.mark.slow
def test_smollm_json_schema_output_validates_and_speculation_is_identical(smollm: Any) -> None:
    import jsonschema_rs

    from specdecode.constraints import compile_constraint
    from specdecode.drafters.registry import drafter_factory

    tok = smollm.tokenizer
    spec = compile_constraint(json_schema_spec(json.dumps(SCHEMA), "schema"), tok,
                              smollm.model.cfg.vocab_size)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": (
        "Describe Ada, a 36 year old engineer who loves the colour green, as JSON with the "
        "fields name, age and colour.")}]))
    params = SamplingParams(max_tokens=48)
    outputs = []
    for name, k in (("none", 0), ("ngram+w4a16", 3)):
        factory = drafter_factory(name, smollm.model) if name != "none" else None
        gen = Generation(smollm.model, tok, prompt, params, factory() if factory else None, k,
                         tok.eos_ids, constraint=spec)
        for _ in gen.run():
            pass
        outputs.append(gen)
    plain, speculative = outputs
    assert_identical([speculative], [plain.output], "ngram+w4a16 under a JSON schema")
    assert plain.finish_reason == "stop" and plain.counters.forced > 0
    jsonschema_rs.validate(SCHEMA, json.loads(tok.decode(plain.output)))


# ------------------------------------------------------------------------ command line


@pytest.mark.parametrize("command", ["generate", "audit", "bench"])
def test_bad_constraint_flags_are_one_error_before_any_model_loads(
        command: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import specdecode.models.backends as backends
    from specdecode.cli import main

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(backends, "load_model", no_model)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nope"}')
    argv = [command, *(["x"] if command == "generate" else []), "--json-schema", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--json-schema {bad}: Invalid type: nope" in err and "Traceback" not in err
    assert main([*argv[:-2], "--regex", "a(b"]) == 2
    assert "--regex: " in capsys.readouterr().err


def test_a_workload_line_carries_its_own_constraint_and_bench_flags_fill_the_rest(
        tmp_path: Any) -> None:
    from specdecode.bench.plan import constrain_workload
    from specdecode.bench.workloads import load_workload, workload_fingerprint

    path = tmp_path / "w.jsonl"
    lines = [{"prompt": "a", "json_schema": {"type": "object"}},
             {"prompt": "b", "regex": "(yes|no)"},
             {"prompt": "c"},
             {"prompt": "d", "json_schema": {"type": "nope"}},
             {"prompt": "e", "regex": "a", "grammar": "start: \"a\""}]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    workload = load_workload(path)
    assert [p.turns[0] for p in workload.prompts] == ["a", "b", "c"]
    assert any('"json_schema": Invalid type: nope' in s for s in workload.skipped)
    assert any("at most one" in s for s in workload.skipped)
    kinds = [p.constraint["kind"] if p.constraint else None for p in workload.prompts]
    assert kinds == ["json_schema", "regex", None]
    filled = constrain_workload(workload, regex_spec("[0-9]+", "--regex"))
    assert [p.constraint["text"] for p in filled.prompts if p.constraint] == [
        '{"type": "object"}', "(yes|no)", "[0-9]+"]
    assert workload_fingerprint(filled.prompts) != workload_fingerprint(workload.prompts)


@pytest.mark.slow
def test_smollm_server_response_format_streams_valid_json_equal_to_plain(smollm: Any) -> None:
    """response_format json_schema over HTTP (the int8 drafter at k = 3), streamed and not:
    the same text as plain constrained decoding in-process, and it validates."""
    import jsonschema_rs

    from specdecode.constraints import compile_constraint
    from tests.test_server import client, serving

    tok = smollm.tokenizer
    question = "Describe Ada, a 36 year old engineer who loves green, as JSON."
    eos = tuple(sorted(set(tok.eos_ids) | set(smollm.model.cfg.eos_token_ids)))
    spec = compile_constraint(json_schema_spec(SCHEMA, "schema"), tok,
                              smollm.model.cfg.vocab_size, eos)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
    gen = Generation(smollm.model, tok, ids, SamplingParams(max_tokens=48), None, 0, eos,
                     constraint=spec)
    expected = "".join(out.text for out in gen.run())
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    with serving(smollm, max_batch=2, max_seq_len=512, k=3, auto=False) as (srv, _):
        c = client(srv)
        name = c.models.list().data[0].id
        messages: Any = [{"role": "user", "content": question}]
        whole = c.chat.completions.create(model=name, messages=messages, max_tokens=48,
                                          temperature=0, response_format=fmt)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=name, messages=messages, max_tokens=48, temperature=0, stream=True,
            response_format=fmt) if ch.choices)
        any_object = c.chat.completions.create(model=name, messages=messages, max_tokens=48,
                                               temperature=0,
                                               response_format={"type": "json_object"})
    assert whole.choices[0].message.content == expected == streamed
    jsonschema_rs.validate(SCHEMA, json.loads(expected))
    assert (any_object.choices[0].message.content or "").startswith("{")
