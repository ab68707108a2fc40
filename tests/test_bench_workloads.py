"""Workload loading: both line formats, malformed lines, strict mode, filters, the default set."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from specdecode.bench.plan import select_workload
from specdecode.bench.workloads import (
    DEFAULT_CATEGORY,
    DEFAULT_MIN_GAP,
    FOLLOW_UPS,
    Prompt,
    arrivals,
    build_repetitive,
    describe_workload,
    filter_prompts,
    load_default_workload,
    load_repetitive_workload,
    load_workload,
    prompts_from_description,
    read_prompts,
    spread_order,
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


# ------------------------------------------------------------------------- repetitive workload


def by_group(prompts: list[Prompt]) -> dict[str, list[tuple[int, Prompt]]]:
    """Each repeat group's (place in the run, prompt), in run order."""
    out: dict[str, list[tuple[int, Prompt]]] = {}
    for i, p in enumerate(prompts):
        assert p.repeat_group is not None
        out.setdefault(p.repeat_group, []).append((i, p))
    return out


def test_repetitive_workload_is_deterministic_and_seeded() -> None:
    a, b = load_repetitive_workload(), load_repetitive_workload()
    assert a.prompts == b.prompts and a.name == "repetitive"
    assert workload_fingerprint(a.prompts) == workload_fingerprint(b.prompts)
    other = load_repetitive_workload(seed=1).prompts
    assert [p.id for p in other] != [p.id for p in a.prompts]  # the seed draws the order
    assert sorted(p.id for p in other) == sorted(p.id for p in a.prompts)  # of the same requests
    assert len(a.prompts) == 24 and len({p.id for p in a.prompts}) == 24
    assert {p.category for p in a.prompts} == {"summarization", "rag", "coding"}
    assert describe_workload(a)["n_repeat_groups"] == 8
    assert prompts_from_description(describe_workload(a)) == a.prompts


def test_each_group_asks_about_the_same_document_again() -> None:
    groups = by_group(load_repetitive_workload().prompts)
    assert len(groups) == 8
    for group, members in groups.items():
        prompts = [p for _, p in members]
        assert [p.id for p in prompts] == [f"{group}-r{i}" for i in range(3)]  # in order
        first, repeats = prompts[0], prompts[1:]
        assert all(p.category == first.category and len(p.turns) == 1 for p in repeats)
        instructions = [p.turns[0].rsplit("\n", 1)[1] for p in repeats]
        assert len(set(instructions)) == 2  # two different questions
        if first.category == "coding":
            assert len(first.turns) == 2  # a multi-turn code edit, then edits of the program
            assert all(p.turns[0].startswith(first.turns[0] + "\n\n") for p in repeats)
            assert all(i.split(": ", 1)[1] in FOLLOW_UPS["coding"] for i in instructions)
            continue
        assert set(instructions) <= set(FOLLOW_UPS[first.category])
        document = repeats[0].turns[0].rsplit("\n\n", 1)[0]
        assert len(document) > 500 and document == repeats[1].turns[0].rsplit("\n\n", 1)[0]
        assert document in first.turns[0]  # the first request's own text
        if first.category == "rag":  # the first's question is replaced by another
            question = first.turns[0].rsplit("\n", 1)[1]
            assert question.endswith("?") and all(question not in p.turns[0] for p in repeats)


def test_order_spreads_each_group_over_the_run() -> None:
    prompts = load_repetitive_workload().prompts
    info = arrivals(prompts)
    for members in by_group(prompts).values():
        places = [i for i, _ in members]
        assert all(b - a >= DEFAULT_MIN_GAP for a, b in itertools.pairwise(places))
        assert [info[p.id].repeat_index for _, p in members] == [0, 1, 2]
    assert [info[p.id].index for p in prompts] == list(range(24))
    # many groups: new documents keep arriving while earlier ones come back, and two requests
    # of a group are never in one batch of 8 but in the last places, where nothing else is left
    groups = [[Prompt(f"g{g}-{i}", "rag", ["x"], repeat_group=f"g{g}") for i in range(3)]
              for g in range(20)]
    order = spread_order(groups, seed=3)
    assert order == spread_order(groups, seed=3) and order != spread_order(groups, seed=4)
    assert sorted(p.id for p in order) == sorted(p.id for g in groups for p in g)
    places = {p.id: i for i, p in enumerate(order)}
    for g in range(20):
        at = [places[f"g{g}-{i}"] for i in range(3)]
        assert at == sorted(at)
        assert all(b - a >= DEFAULT_MIN_GAP or b >= 50 for a, b in itertools.pairwise(at))
    first_places = sorted(places[f"g{g}-0"] for g in range(20))
    assert first_places[-1] > 20  # not every first request comes before every repeat
    assert min(places[f"g{g}-1"] for g in range(20)) < 20


def test_repetitive_workload_filters_and_refuses_other_sources(tmp_path: Path) -> None:
    w = load_repetitive_workload(categories=["coding"], limit_per_category=1)
    assert [p.repeat_group for p in w.prompts] == ["rep-code-1"] * 3
    with pytest.raises(SpecDecodeError, match=r"'qa'.*known categories: coding, rag, summ"):
        load_repetitive_workload(categories=["qa"])
    path = write_lines(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "qa", "turns": ["Why?"]}])
    with pytest.raises(SpecDecodeError, match="no summarization, rag, coding prompts"):
        load_repetitive_workload(path)
    with pytest.raises(SpecDecodeError, match="built from"):
        build_repetitive([Prompt("x", "qa", ["Why?"])])
    with pytest.raises(SpecDecodeError, match="--specbench builds --workload repetitive"):
        select_workload(str(path), None, None, False, specbench=str(path))
    assert select_workload("repetitive", None, None, False).name == "repetitive"


def test_repeat_group_in_a_plain_workload_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "w.jsonl", [
        {"prompt": "Doc. Question one?", "repeat_group": "doc"},
        {"prompt": "Other."},
        {"prompt": "Doc. Question two?", "repeat_group": "doc"},
        {"prompt": "bad", "repeat_group": 3},
    ])
    prompts, skipped = read_prompts(path)
    assert [p.repeat_group for p in prompts] == ["doc", None, "doc"]
    assert len(skipped) == 1 and "repeat_group" in skipped[0]
    info = arrivals(prompts)
    assert [(a.index, a.repeat_group, a.repeat_index) for a in info.values()] == [
        (0, "doc", 0), (1, "", 0), (2, "doc", 1)]
    ungrouped = [Prompt(p.id, p.category, p.turns) for p in prompts]
    assert workload_fingerprint(ungrouped) != workload_fingerprint(prompts)


@pytest.mark.skipif(not SPECBENCH.exists(), reason="Spec-Bench questions not present")
def test_repetitive_workload_from_specbench() -> None:
    w = load_repetitive_workload(SPECBENCH)
    assert w.name == "repetitive-specbench" and w.path == str(SPECBENCH)
    assert len(w.prompts) == 36 and w.prompts == load_repetitive_workload(SPECBENCH).prompts
    groups = by_group(w.prompts)
    assert len(groups) == 12
    source = {p.id: p for p in load_workload(SPECBENCH).prompts}
    for group, members in groups.items():
        first = members[0][1]
        assert first.turns == source[group].turns  # the Spec-Bench prompt as it is
        for _, p in members[1:]:
            if first.category == "summarization":
                assert first.turns[0].removeprefix("Summarize:").strip() in p.turns[0]
                assert not p.turns[0].startswith("Summarize:")
    assert len(load_repetitive_workload(SPECBENCH, ["rag"], 10).prompts) == 30
