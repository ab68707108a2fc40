"""Workload loading: both line formats, malformed lines, strict mode, filters, the default set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.bench.workloads import (
    DEFAULT_CATEGORY,
    describe_workload,
    filter_prompts,
    load_default_workload,
    load_workload,
    prompts_from_description,
    read_prompts,
    workload_fingerprint,
)
from specdecode.errors import SpecDecodeError

SPECBENCH = Path("/work/shared/data/specbench/question.jsonl")


def write_lines(path: Path, lines: list[object]) -> Path:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def test_specbench_format(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "q.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a post.", "Shorten it."]},
        {"question_id": 82, "category": "qa", "turns": ["Why?"], "reference": ["Because."]},
    ])
    w = load_workload(path)
    assert [p.id for p in w.prompts] == ["81", "82"]
    assert w.prompts[0].turns == ["Write a post.", "Shorten it."]
    assert w.prompts[0].category == "writing"
    assert w.prompts[1].source == f"{path}:2"
    assert w.skipped == []


def test_plain_format_with_defaults_and_overrides(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "mine.jsonl", [
        {"prompt": "Hello there"},
        "",
        {"prompt": "Poem please", "category": "creative", "max_tokens": 50, "temperature": 1.0,
         "id": "poem"},
    ])
    prompts, skipped = read_prompts(path)
    assert skipped == []
    assert prompts[0].id == "mine-1" and prompts[0].category == DEFAULT_CATEGORY
    assert prompts[0].turns == ["Hello there"] and prompts[0].max_tokens is None
    assert (prompts[1].id, prompts[1].max_tokens, prompts[1].temperature) == ("poem", 50, 1.0)


def test_malformed_lines_reported_with_path_and_line_and_skipped(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "w.jsonl", [
        {"prompt": "ok 1"},
        "{not json",
        {"prompt": "bad tokens", "max_tokens": 0},
        {"prompt": "x", "turns": ["y"]},
        {"question_id": 3, "category": "qa", "turns": []},
        {"prompt": "ok 2", "id": "dup"},
        {"prompt": "again", "id": "dup"},
    ])
    prompts, skipped = read_prompts(path)
    assert [p.turns[0] for p in prompts] == ["ok 1", "ok 2"]
    assert [msg.split(": ")[0] for msg in skipped] == [f"{path}:{n}" for n in (2, 3, 4, 5, 7)]
    assert "invalid JSON" in skipped[0] and "max_tokens" in skipped[1]
    assert "duplicate" in skipped[4]


def test_strict_mode_refuses_the_first_malformed_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "w.jsonl", [{"prompt": "ok"}, {"prompt": 5}])
    with pytest.raises(SpecDecodeError, match=r"w\.jsonl:2"):
        load_workload(path, strict=True)
    assert len(load_workload(path).prompts) == 1


def test_empty_and_all_malformed_workloads_are_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(SpecDecodeError, match="no prompts"):
        load_workload(empty)
    bad = write_lines(tmp_path / "bad.jsonl", ["[1, 2]"])
    with pytest.raises(SpecDecodeError, match="1 malformed"):
        load_workload(bad)
    with pytest.raises(SpecDecodeError, match="cannot read"):
        load_workload(tmp_path / "missing.jsonl")


def test_unknown_category_names_it_and_lists_known(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "w.jsonl", [
        {"prompt": "a", "category": "code"}, {"prompt": "b", "category": "qa"}])
    with pytest.raises(SpecDecodeError, match=r"'poetry'.*known categories: code, qa"):
        load_workload(path, categories=["qa", "poetry"])


def test_category_filter_and_limit_per_category(tmp_path: Path) -> None:
    lines = [{"prompt": f"{c}{i}", "category": c} for i in range(3) for c in ("a", "b", "c")]
    w = load_workload(write_lines(tmp_path / "w.jsonl", lines), categories=["a", "c"],
                      limit_per_category=2)
    assert [p.turns[0] for p in w.prompts] == ["a0", "c0", "a1", "c1"]
    with pytest.raises(SpecDecodeError, match=">= 1"):
        filter_prompts(w.prompts, limit_per_category=0)
    with pytest.raises(SpecDecodeError, match=r"no prompts .* selected"):
        load_workload(tmp_path / "w.jsonl", categories=[])


def test_default_workload_shape() -> None:
    w = load_default_workload()
    counts: dict[str, int] = {}
    for p in w.prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    assert counts == {c: 4 for c in ("code", "summarization", "qa", "chat", "translation",
                                     "creative")}
    assert all(p.max_tokens is not None and 64 <= p.max_tokens <= 96 for p in w.prompts)
    assert all(p.temperature == 1.0 for p in w.prompts if p.category == "creative")
    assert all(p.temperature is None for p in w.prompts if p.category != "creative")
    assert 1 <= sum(len(p.turns) > 1 for p in w.prompts) <= 2
    assert all("def " in p.turns[0] for p in w.prompts if p.category == "code")
    for p in w.prompts:
        if p.category == "summarization":
            passage = p.turns[0].split("\n\n", 1)[1]
            assert 120 <= len(passage.split()) <= 200, p.id


def test_default_workload_filtered() -> None:
    w = load_default_workload(categories=["code"], limit_per_category=2)
    assert [p.id for p in w.prompts] == ["code-1", "code-2"]


def test_fingerprint_tracks_content_and_description_round_trips(tmp_path: Path) -> None:
    w = load_default_workload()
    desc = describe_workload(w)
    assert desc["n_prompts"] == 24 and desc["fingerprint"] == workload_fingerprint(w.prompts)
    assert prompts_from_description(desc) == w.prompts
    changed = [*w.prompts]
    changed[0] = type(changed[0])(**{**changed[0].to_dict(), "turns": ["different"]})
    assert workload_fingerprint(changed) != desc["fingerprint"]


@pytest.mark.skipif(not SPECBENCH.exists(), reason="Spec-Bench questions not present")
def test_real_specbench_file_loads() -> None:
    w = load_workload(SPECBENCH, strict=True)
    assert len(w.prompts) == 480
    assert sum(len(p.turns) == 2 for p in w.prompts) == 80
    assert len(load_workload(SPECBENCH, categories=["summarization"]).prompts) == 80
