"""The built-in structured workload (`--workload structured`) and the report's structured-output
section: the file loads, every schema compiles with llguidance and is bounded so outputs can
finish, the categories are counted; the HTML and report.json show validity, forced tokens and
the constraint's mask time against the request time."""

from __future__ import annotations

import dataclasses
import io
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from specdecode.bench.harness import RunOptions, run_bench
from specdecode.bench.plan import select_workload, structured_lines
from specdecode.bench.records import ConfigSpec, RequestSample
from specdecode.bench.workloads import (
    BUILTIN_WORKLOADS,
    Prompt,
    builtin_workload_path,
    load_structured_workload,
)
from specdecode.errors import SpecDecodeError
from specdecode.report.analysis import analyze, structured_summary
from specdecode.report.html import render_html
from specdecode.report.recommend import recommend
from tests.fakes import FakeRunner, make_prompts, ngram, plain, workload_of

pytest.importorskip("llguidance")

CATEGORIES = ("extraction", "classification", "records", "quotes")
MIN_PROMPTS = 24
# every prompt's limit: small schemas finish well within it; a quote of up to 320 characters
# (SmolLM2 wrote 30-92 tokens) within 128
MAX_TOKENS = {"extraction": 96, "classification": 96, "records": 96, "quotes": 128}


def _schema(p: Prompt) -> dict[str, Any]:
    assert p.constraint is not None and p.constraint["kind"] == "json_schema", p.id
    schema = json.loads(p.constraint["text"])
    assert isinstance(schema, dict)
    return schema


def _unbounded(schema: dict[str, Any], where: str) -> list[str]:
    """Places in `schema` an output could grow without bound (so it could be cut by
    max_tokens): strings without maxLength, numbers, integers without both bounds, arrays
    without maxItems, objects allowing extra properties."""
    out: list[str] = []
    if "enum" in schema:
        return out
    kind = schema.get("type")
    if kind == "string" and "maxLength" not in schema:
        out.append(f"{where}: string without maxLength")
    elif kind == "number":
        out.append(f"{where}: number (unbounded digits; use a bounded integer)")
    elif kind == "integer" and not {"minimum", "maximum"} <= set(schema):
        out.append(f"{where}: integer without minimum and maximum")
    elif kind == "array":
        if "maxItems" not in schema:
            out.append(f"{where}: array without maxItems")
        out += _unbounded(schema["items"], f"{where}[]")
    elif kind == "object":
        if schema.get("additionalProperties") is not False:
            out.append(f"{where}: object allowing additional properties")
        for key, sub in schema.get("properties", {}).items():
            out += _unbounded(sub, f"{where}.{key}")
    elif kind not in ("boolean", "string", "integer"):
        out.append(f"{where}: unexpected schema {schema}")
    return out


def test_structured_workload_loads_with_its_categories() -> None:
    w = load_structured_workload()
    assert w.name == "structured" and not w.skipped
    assert len(w.prompts) >= MIN_PROMPTS
    counts = Counter(p.category for p in w.prompts)
    assert set(counts) == set(CATEGORIES)
    assert all(n >= 6 for n in counts.values()), counts
    assert len({p.id for p in w.prompts}) == len(w.prompts)
    assert all(p.max_tokens == MAX_TOKENS[p.category] and p.temperature is None
               for p in w.prompts)
    assert load_structured_workload(["records"], 2).known_categories == ["records"]
    assert len(load_structured_workload(["records"], 2).prompts) == 2


def test_every_schema_is_small_bounded_and_fits_its_category() -> None:
    for p in load_structured_workload().prompts:
        schema = _schema(p)
        assert schema["type"] == "object" and set(schema["required"]) == set(
            schema["properties"]), p.id
        assert not _unbounded(schema, p.id), _unbounded(schema, p.id)
        props = schema["properties"]
        if p.category == "extraction":
            assert 3 <= len(props) <= 6, p.id
        elif p.category == "classification":
            assert any("enum" in sub for sub in props.values()), p.id
        elif p.category == "quotes":  # a verbatim span of the prompt: long, copied text
            assert props["quote"]["type"] == "string" and props["quote"]["maxLength"] <= 320
        else:
            (array,) = props.values()
            assert array["type"] == "array" and array["maxItems"] <= 4, p.id
            assert 2 <= len(array["items"]["properties"]) <= 6, p.id


def _byte_tokenizer(folder: Path) -> Any:
    """A byte-level tokenizer (256 single-byte tokens and an EOS): every string is spellable."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from specdecode.models.tokenizer import Tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<eos>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(alphabet))}}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return Tokenizer(folder)


def test_every_schema_compiles_and_starts_with_a_brace(tmp_path: Path) -> None:
    from specdecode.constraints import ConstraintSpec, compile_constraint

    tok = _byte_tokenizer(tmp_path)
    brace = tok.token_id("{")
    assert brace is not None
    for p in load_structured_workload().prompts:
        assert p.constraint is not None
        spec = ConstraintSpec(**p.constraint)
        matcher = compile_constraint(spec, tok, tok.vocab_size).matcher()
        allowed = matcher.allowed([])
        assert allowed[brace] and int(allowed.sum()) == 1, p.id  # compact JSON: '{' forced


def test_bench_selects_the_structured_workload_by_name() -> None:
    assert set(BUILTIN_WORKLOADS) == {"default", "structured"}
    w = select_workload("structured", ["classification"], None, strict=False)
    assert w.name == "structured" and {p.category for p in w.prompts} == {"classification"}
    assert len(w.prompts) == Counter(p.category for p in load_structured_workload().prompts)[
        "classification"]  # a built-in name other than the default keeps every prompt
    assert builtin_workload_path("structured").name == "structured_workload.jsonl"
    default = select_workload("default", None, None, strict=False)  # the same as no --workload
    assert [p.id for p in default.prompts] == [
        p.id for p in select_workload(None, None, None, strict=False).prompts]
    with pytest.raises(SpecDecodeError, match="unknown built-in workload"):
        builtin_workload_path("nope")


# --------------------------------------------------------------------------------- the report

MASK_S = 0.002
FORCED = 5


class StructuredRunner(FakeRunner):
    """FakeRunner whose constrained requests report validity (prompt p1 invalid for the
    speculative configuration), forced tokens and mask time."""

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        out = []
        for s in super().run(prompts, config):
            prompt = next(p for p in prompts if p.id == s.prompt_id)
            if prompt.constraint is not None:
                s = dataclasses.replace(s, valid=not (s.prompt_id == "p1" and not
                                                      config.is_plain),
                                        forced=FORCED, mask_s=MASK_S)
            out.append(s)
        return out


def _constrained_prompts(n: int) -> list[Prompt]:
    schema = json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}})
    prompts = make_prompts(n, multi_turn_every=99)
    return [dataclasses.replace(p, constraint={"kind": "json_schema", "text": schema,
                                               "origin": "test"}) if i < n - 1 else p
            for i, p in enumerate(prompts)]  # the last one unconstrained


def test_report_shows_validity_forced_tokens_and_mask_cost(tmp_path: Path) -> None:
    n = 4
    prompts = _constrained_prompts(n)
    outcome = run_bench(StructuredRunner(), workload_of(prompts), [plain(), ngram()],
                        RunOptions(tmp_path / "out", progress=False, n_resamples=200),
                        out=io.StringIO())
    report = json.loads(outcome.report_json.read_text())
    by_name = {c["spec"]["name"]: c["structured"] for c in report["analysis"]["configs"]}
    constrained = n - 1
    assert by_name["plain"]["n_valid"] == by_name["plain"]["n_constrained"] == constrained
    assert by_name["plain"]["valid_share"] == 1.0
    assert by_name["ngram-k4"]["n_valid"] == constrained - 1
    assert by_name["ngram-k4"]["valid_share"] == pytest.approx((constrained - 1) / constrained)
    for st in by_name.values():
        assert st["forced_tokens"] == FORCED * constrained
        assert st["mask_s"] == pytest.approx(MASK_S * constrained)
        assert st["mask_share"] == pytest.approx(st["mask_s"] / st["request_s"])
        assert 0 < st["mask_share"] < 1 and st["output_tokens"] > st["forced_tokens"]

    html = outcome.report_html.read_text()
    assert 'id="structured"' in html
    assert f">{constrained}/{constrained}<" in html and f">{constrained - 1}/{constrained}<" in html
    assert html.count('class="fail">2/3<') == 1  # the speculative row is flagged
    assert "mask time / request time" in html

    lines = structured_lines(outcome.results_path)
    assert len(lines) == 2 and f"{constrained - 1}/{constrained} outputs valid" in lines[0]
    assert f"{FORCED * constrained}/" in lines[1]


def test_no_structured_section_without_constraints(tmp_path: Path) -> None:
    outcome = run_bench(FakeRunner(), workload_of(make_prompts(3, multi_turn_every=99)),
                        [plain(), ngram()],
                        RunOptions(tmp_path / "out", progress=False, n_resamples=200),
                        out=io.StringIO())
    analysis = analyze(outcome.analysis.results, n_resamples=200)
    assert all(c.structured is None for c in analysis.configs)
    assert 'id="structured"' not in render_html(analysis, recommend(analysis))
    assert structured_summary(outcome.analysis.results.samples) is None
    assert structured_lines(outcome.results_path) == []
