"""Workloads: the prompts a benchmark runs, from JSONL files or the built-in default set.

Two line formats, detected per line:

- Spec-Bench: `{"question_id": int | str, "category": str, "turns": [str, ...]}` (other keys,
  such as "reference", are ignored). Several turns make a multi-turn conversation: the runner
  generates the assistant's reply between consecutive user turns.
- plain: `{"prompt": str | [str, ...], "category"?: str, "id"?: str, "max_tokens"?: int,
  "temperature"?: float}`; without "id" a prompt is named `<file stem>-<line number>`.

Both formats accept optional "max_tokens" and "temperature", at most one structured-output
constraint (docs/structured-output.md): "json_schema" (a schema object), "regex" or "grammar"
(Lark or GBNF text), and "repeat_group" (a non-empty string: requests about the same document,
which the report follows from cold to warm). Blank lines are ignored. A malformed
line is reported as `path:line: reason` and skipped, or refused in strict mode.

- OpenAI requests: a `serve --record` recording or any log of request bodies (`bench.requests`:
  `{"request": BODY, "arrival_s"...}`, or a bare body with "messages", or "model" and
  "prompt"), checked as the server checks them; each is one turn sent as it was (`request`),
  with its arrival time (`arrival_s`, from the first request; sorted into arrival order).

Files are read a line at a time (a line over MAX_LINE_BYTES is malformed), the selection
applied as they are read, so a recording of a gigabyte is never held whole: only the prompts
kept are. A last line cut short (a recording truncated mid-line, or still being written) is
skipped and named, even in strict mode: the rest replays.

The repetitive workload (`build_repetitive`, `--workload repetitive`) is built from summarization,
RAG and coding prompts (Spec-Bench's, or the small built-in set in repetitive_source.jsonl): each
document is asked about again with other instructions, and the requests of one document are
spread over the run (see `spread_order`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any

from specdecode.bench.requests import (
    RecordedArrival,
    Recording,
    RequestLineError,
    arrange,
    arrival_of,
    is_header,
    is_request,
    parse_request,
)
from specdecode.errors import SpecDecodeError

DEFAULT_CATEGORY = "uncategorized"


class MalformedLine(ValueError):
    """A workload line that cannot be read as a prompt (the message says why)."""


@dataclass
class Prompt:
    """One prompt: a single user turn, or the user turns of a conversation.

    `max_tokens` / `temperature` None mean the runner's default and greedy decoding (unless the
    configuration overrides the temperature). `source` is where it was read: `path:line`.
    """

    id: str
    category: str
    turns: list[str]
    max_tokens: int | None = None
    temperature: float | None = None
    source: str = ""
    # structured output: constraints.ConstraintSpec.to_dict() (kind, text, origin), or None
    constraint: dict[str, str] | None = None
    # the document this request is about, shared by the requests that ask about it again
    # (None: a request of its own); the report compares a group's first request with its repeats
    repeat_group: str | None = None
    # an OpenAI request replayed as it was sent (bench.requests): its body and route; None for
    # a prompt the runner renders from its turns
    request: dict[str, Any] | None = None
    route: str = ""
    # seconds after the workload's first arrival at which it arrived (None: unknown)
    arrival_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    """Prompts selected from one file, the lines skipped in it and the filters applied."""

    name: str
    path: str
    prompts: list[Prompt]
    skipped: list[str] = field(default_factory=list)
    categories: list[str] | None = None
    limit_per_category: int | None = None
    # what the file says beyond its prompts: sessions, lines out of arrival order (notes), the
    # models a recording was made with (bench.requests.Recording.models)
    notes: list[str] = field(default_factory=list)
    recorded_with: list[dict[str, Any]] = field(default_factory=list)

    @property
    def known_categories(self) -> list[str]:
        """Categories present in the selected prompts, sorted."""
        return sorted({p.category for p in self.prompts})


def _opt_int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MalformedLine(f'"{key}" must be an integer >= 1, got {value!r}')
    return value


def _opt_temperature(obj: dict[str, Any]) -> float | None:
    value = obj.get("temperature")
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise MalformedLine(f'"temperature" must be a number >= 0, got {value!r}')
    return float(value)


def _text_list(value: object, key: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise MalformedLine(f'"{key}" must be a non-empty string or list of strings')
    if not all(isinstance(t, str) and t.strip() for t in value):
        raise MalformedLine(f'every entry of "{key}" must be a non-empty string')
    return list(value)


def _category(obj: dict[str, Any], required: bool) -> str:
    value = obj.get("category")
    if value is None and not required:
        return DEFAULT_CATEGORY
    if not isinstance(value, str) or not value.strip():
        raise MalformedLine(f'"category" must be a non-empty string, got {value!r}')
    return value


def parse_prompt(obj: object, default_id: str, source: str) -> Prompt:
    """Read one decoded JSON line as a Prompt, detecting its format; raise MalformedLine."""
    if not isinstance(obj, dict):
        raise MalformedLine(f"expected a JSON object, got {type(obj).__name__}")
    if is_request(obj):
        return request_prompt(obj, default_id, source)
    is_specbench, is_plain = "turns" in obj, "prompt" in obj
    if is_specbench == is_plain:
        raise MalformedLine('expected exactly one of "turns" (Spec-Bench) or "prompt" (plain)')
    id_key, text_key = ("question_id", "turns") if is_specbench else ("id", "prompt")
    raw_id = obj.get(id_key, None if is_specbench else default_id)
    if isinstance(raw_id, bool) or not isinstance(raw_id, int | str) or str(raw_id) == "":
        raise MalformedLine(f'"{id_key}" must be an integer or a non-empty string')
    return Prompt(
        id=str(raw_id),
        category=_category(obj, required=is_specbench),
        turns=_text_list(obj[text_key], text_key),
        max_tokens=_opt_int(obj, "max_tokens"),
        temperature=_opt_temperature(obj),
        source=source,
        constraint=_constraint(obj),
        repeat_group=_opt_group(obj),
    )


def request_prompt(obj: dict[str, Any], default_id: str, source: str) -> Prompt:
    """An OpenAI request line (bench.requests) as a Prompt of one turn, sent as it was."""
    try:
        req = parse_request(obj)
    except RequestLineError as exc:
        raise MalformedLine(str(exc)) from None
    return Prompt(id=req.id or default_id, category=req.category, turns=[req.text],
                  max_tokens=req.max_tokens, temperature=req.temperature, source=source,
                  constraint=req.constraint, request=req.body, route=req.route,
                  arrival_s=None if req.arrival is None else req.arrival.seconds)


def _opt_group(obj: dict[str, Any]) -> str | None:
    value = obj.get("repeat_group")
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise MalformedLine(f'"repeat_group" must be a non-empty string, got {value!r}')
    return value


CONSTRAINT_KEYS = ("json_schema", "regex", "grammar")


def _constraint(obj: dict[str, Any]) -> dict[str, str] | None:
    """The line's structured-output constraint, checked (constraints.ConstraintSpec), or None."""
    given = [key for key in CONSTRAINT_KEYS if key in obj]
    if not given:
        return None
    if len(given) > 1:
        raise MalformedLine(f"give at most one of {', '.join(CONSTRAINT_KEYS)}, got {given}")
    from specdecode.constraints import grammar_spec, json_schema_spec, regex_spec

    key, value = given[0], obj[given[0]]
    if key != "json_schema" and not isinstance(value, str):
        raise MalformedLine(f'"{key}" must be a string')
    make = {"json_schema": json_schema_spec, "regex": regex_spec, "grammar": grammar_spec}[key]
    try:
        return make(value, f'"{key}"').to_dict()
    except SpecDecodeError as exc:
        raise MalformedLine(str(exc)) from None


MAX_LINE_BYTES = 16 << 20  # a longer line is malformed (the server takes 1 MiB bodies)
Keep = Callable[[Prompt], bool]


def _decode(raw: bytes) -> object:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise MalformedLine("not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise MalformedLine(f"invalid JSON ({exc.msg} at column {exc.colno})") from None


def _lines(handle: IO[bytes]) -> Iterator[tuple[int, bytes | None, bool]]:
    """(line number, bytes without the newline or None when over MAX_LINE_BYTES, whether it
    ended with a newline), one line in memory at a time."""
    lineno = 0
    while raw := handle.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := handle.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass  # the rest of an overlong line
            yield lineno, None, True
            continue
        yield lineno, raw.rstrip(b"\r\n"), raw.endswith(b"\n")


@dataclass
class _Reading:
    """What reading one file gathered: the prompts kept with their arrivals, the lines skipped
    and why, the recording's sessions and models."""

    kept: list[tuple[Prompt, RecordedArrival | None]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    recording: Recording = field(default_factory=Recording)
    seen: set[str] = field(default_factory=set)


def _read_line(reading: _Reading, raw: bytes | None, path: Path, lineno: int,
               keep: Keep | None) -> None:
    """Take one line in: a header, a prompt (kept when `keep` says so), else MalformedLine."""
    if raw is None:
        raise MalformedLine(f"longer than {MAX_LINE_BYTES} bytes")
    obj = _decode(raw)
    if is_header(obj):
        assert isinstance(obj, dict)
        reading.recording.header(obj)
        return
    prompt = parse_prompt(obj, f"{path.stem}-{lineno}", f"{path}:{lineno}")
    if prompt.id in reading.seen:
        raise MalformedLine(f"duplicate prompt id {prompt.id!r}")
    reading.seen.add(prompt.id)
    arrival = None
    if prompt.request is not None and isinstance(obj, dict):
        arrival = arrival_of(obj)  # checked already, by parse_prompt
        reading.recording.seen(arrival)
    if keep is None or keep(prompt):
        reading.kept.append((prompt, arrival))


def _read(path: Path, strict: bool, keep: Keep | None) -> _Reading:
    reading = _Reading()
    try:
        with path.open("rb") as handle:
            for lineno, raw, ended in _lines(handle):
                if raw is not None and not raw.strip():
                    continue
                try:
                    _read_line(reading, raw, path, lineno, keep)
                except MalformedLine as exc:
                    cut = not ended and raw is not None and str(exc).startswith("invalid JSON")
                    message = f"{path}:{lineno}: " + (
                        "cut short: the file ends mid-line (a recording truncated, or still "
                        "being written)" if cut else str(exc))
                    if strict and not cut:
                        raise SpecDecodeError(f"malformed workload line: {message}") from None
                    reading.skipped.append(message)
    except OSError as exc:
        raise SpecDecodeError(f"cannot read workload {path}: {exc.strerror or exc}") from None
    return reading


def read_prompts(path: str | Path, strict: bool = False, keep: Keep | None = None
                 ) -> tuple[list[Prompt], list[str]]:
    """Read the prompts of a JSONL file, a line at a time: (prompts, one `path:line: reason`
    per skipped line). `keep` selects prompts as they are read (the others are not held).
    Requests with arrival times come in arrival order, with `arrival_s` from the first.

    In strict mode the first malformed line raises SpecDecodeError instead.
    """
    prompts, skipped, _, _ = _read_file(Path(path), strict, keep)
    return prompts, skipped


def _read_file(path: Path, strict: bool, keep: Keep | None
               ) -> tuple[list[Prompt], list[str], list[str], list[dict[str, Any]]]:
    """read_prompts, with the notes and the recorded models of a recording."""
    reading = _read(path, strict, keep)
    ordered, offsets, notes = arrange(reading.kept, reading.recording)
    prompts = [p if t is None and p.arrival_s is None else dataclasses.replace(p, arrival_s=t)
               for p, t in zip(ordered, offsets, strict=True)]
    return prompts, reading.skipped, notes, reading.recording.models


def filter_prompts(
    prompts: Sequence[Prompt],
    categories: Sequence[str] | None = None,
    limit_per_category: int | None = None,
) -> list[Prompt]:
    """Keep the given categories (all when None) and the first N prompts of each, in order.

    An unknown category raises SpecDecodeError naming it and listing the known ones.
    """
    known = sorted({p.category for p in prompts})
    if categories is not None:
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise SpecDecodeError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                f"{', '.join(repr(c) for c in unknown)}; known categories: {', '.join(known)}"
            )
    if limit_per_category is not None and limit_per_category < 1:
        raise SpecDecodeError(f"limit per category must be >= 1, got {limit_per_category}")
    wanted = set(categories) if categories is not None else set(known)
    counts: dict[str, int] = {}
    kept: list[Prompt] = []
    for prompt in prompts:
        n = counts.get(prompt.category, 0)
        if prompt.category in wanted and (limit_per_category is None or n < limit_per_category):
            counts[prompt.category] = n + 1
            kept.append(prompt)
    return kept


def load_workload(
    path: str | Path,
    *,
    categories: Sequence[str] | None = None,
    limit_per_category: int | None = None,
    strict: bool = False,
    name: str | None = None,
) -> Workload:
    """Read a workload file, the filters applied as it is read (`selector`); an empty result
    raises SpecDecodeError."""
    path = Path(path)
    keep, known = selector(categories, limit_per_category)
    selected, skipped, notes, models = _read_file(path, strict, keep)
    if not known:
        reason = f" ({len(skipped)} malformed lines skipped)" if skipped else ""
        raise SpecDecodeError(f"workload {path} holds no prompts{reason}")
    filter_prompts([Prompt("", c, [""]) for c in sorted(known)], categories)  # names unknown
    if not selected:
        raise SpecDecodeError(f"no prompts of workload {path} were selected")
    return Workload(
        name=name or path.stem,
        path=str(path),
        prompts=selected,
        skipped=skipped,
        categories=list(categories) if categories is not None else None,
        limit_per_category=limit_per_category,
        notes=notes,
        recorded_with=models,
    )


def selector(categories: Sequence[str] | None, limit_per_category: int | None
             ) -> tuple[Keep, set[str]]:
    """A `keep` that takes the given categories (all when None) and the first N prompts of
    each, as `filter_prompts` does, while reading; and the set of every category it saw."""
    if limit_per_category is not None and limit_per_category < 1:
        raise SpecDecodeError(f"limit per category must be >= 1, got {limit_per_category}")
    known: set[str] = set()
    counts: dict[str, int] = {}

    def keep(prompt: Prompt) -> bool:
        known.add(prompt.category)
        n = counts.get(prompt.category, 0)
        if categories is not None and prompt.category not in categories:
            return False
        if limit_per_category is not None and n >= limit_per_category:
            return False
        counts[prompt.category] = n + 1
        return True

    return keep, known


# built-in workloads shipped with the package: the name `--workload` takes -> the data file
BUILTIN_WORKLOADS = {
    "default": "default_workload.jsonl",
    "structured": "structured_workload.jsonl",  # JSON-schema prompts, docs/structured-output.md
}


def builtin_workload_path(name: str) -> Path:
    """The data file of the built-in workload `name` (BUILTIN_WORKLOADS)."""
    if name not in BUILTIN_WORKLOADS:
        raise SpecDecodeError(f"unknown built-in workload {name!r} (known: "
                              f"{', '.join(BUILTIN_WORKLOADS)})")
    return Path(str(resources.files("specdecode") / "data" / BUILTIN_WORKLOADS[name]))


def default_workload_path() -> Path:
    """The built-in default workload shipped with the package."""
    return builtin_workload_path("default")


def load_builtin_workload(
    name: str, categories: Sequence[str] | None = None, limit_per_category: int | None = None
) -> Workload:
    """A built-in workload (BUILTIN_WORKLOADS), filtered; its lines are never skipped."""
    return load_workload(builtin_workload_path(name), categories=categories,
                         limit_per_category=limit_per_category, strict=True, name=name)


def load_default_workload(
    categories: Sequence[str] | None = None, limit_per_category: int | None = None
) -> Workload:
    """The built-in default workload (24 prompts, 6 categories), filtered."""
    return load_builtin_workload("default", categories, limit_per_category)


def load_structured_workload(
    categories: Sequence[str] | None = None, limit_per_category: int | None = None
) -> Workload:
    """The built-in structured workload (every prompt with its own JSON schema: extraction,
    classification into enums, lists of records), filtered."""
    return load_builtin_workload("structured", categories, limit_per_category)


def workload_fingerprint(prompts: Sequence[Prompt]) -> str:
    """sha256 of the selected prompts' content (ids, categories, turns, limits), not of paths."""
    digest = hashlib.sha256()
    for p in prompts:
        item: list[Any] = [p.id, p.category, p.turns, p.max_tokens, p.temperature]
        if p.constraint is not None:  # (prompts without one keep their fingerprints)
            item.append([p.constraint["kind"], p.constraint["text"]])
        if p.repeat_group is not None:  # (the same: old runs' fingerprints are unchanged)
            item.append({"repeat_group": p.repeat_group})
        if p.request is not None:  # a replayed request: what is sent, and when
            item.append({"request": p.request, "route": p.route, "arrival_s": p.arrival_s})
        digest.update(json.dumps(item, ensure_ascii=False).encode("utf-8") + b"\n")
    return digest.hexdigest()


def describe_workload(workload: Workload) -> dict[str, Any]:
    """The workload as stored in a run header: name, fingerprint, counts, filters and prompts."""
    per_category: dict[str, int] = {}
    for p in workload.prompts:
        per_category[p.category] = per_category.get(p.category, 0) + 1
    return {
        "name": workload.name,
        "path": workload.path,
        "fingerprint": workload_fingerprint(workload.prompts),
        "n_prompts": len(workload.prompts),
        "n_turns": sum(len(p.turns) for p in workload.prompts),
        "per_category": per_category,
        "categories": workload.categories,
        "limit_per_category": workload.limit_per_category,
        "n_skipped_lines": len(workload.skipped),
        "n_repeat_groups": len({p.repeat_group for p in workload.prompts if p.repeat_group}),
        "n_requests": sum(p.request is not None for p in workload.prompts),
        "notes": list(workload.notes),
        "recorded_with": list(workload.recorded_with),
        "prompts": [p.to_dict() for p in workload.prompts],
    }


def prompts_from_description(description: dict[str, Any]) -> list[Prompt]:
    """The prompts stored by `describe_workload` (e.g. in a report's header)."""
    out: list[Prompt] = []
    for item in description.get("prompts", []):
        out.append(Prompt(**{k: item[k] for k in Prompt.__dataclass_fields__ if k in item}))
    return out


# -------------------------------------------------------------------------- repetitive workload

REPETITIVE_WORKLOAD = "repetitive"  # the name `--workload` takes
REPETITIVE_SOURCE = "repetitive_source.jsonl"  # the built-in documents (this project's own text)
REPETITIVE_CATEGORIES = ("summarization", "rag", "coding")
DEFAULT_REPETITIVE_DOCUMENTS = 4  # from a Spec-Bench file: documents per category by default
DEFAULT_FOLLOW_UPS = 2  # requests after the first about each document
# Two requests of one document are at least this many places apart in the run where the other
# documents allow it, so that at batch sizes up to 8 a repeat never shares a batch with an
# earlier request of its document (a store only holds requests that have finished).
DEFAULT_MIN_GAP = 8

# The later requests about a document: other instructions over the same text (summarization,
# RAG) and edits of the same program (coding). Fixed, so the workload is the same everywhere.
FOLLOW_UPS: dict[str, tuple[str, ...]] = {
    "summarization": (
        "List the three main points of the text above.",
        "Answer in one sentence: what is the text above about?",
        "Which people, places and organisations does the text above name? Answer as a list.",
    ),
    "rag": (
        "Answer in one sentence: what is the text above about?",
        "Quote the sentence of the text above that says the most about its main subject.",
        "List the names, dates and numbers that the text above mentions.",
    ),
    "coding": (
        "Add type hints and a docstring to every function.",
        "Add a check that rejects invalid input with a clear error message.",
        "Rename the variables to descriptive names and add a comment above each block.",
    ),
}
CODE_EDIT = ("{task}\n\nA program for the request above was written earlier. Write the whole "
             "program again with this change: {edit}")


def _document(source: Prompt) -> str:
    """The text a summarization or RAG prompt is about, without its instruction or question
    (Spec-Bench: "Summarize: TEXT"; RAG: the passages, then the question on the last line)."""
    text = source.turns[0]
    if source.category == "summarization":
        return text.removeprefix("Summarize:").strip()
    passages, newline, _question = text.rpartition("\n")
    return passages if newline and passages.strip() else text


def follow_up(source: Prompt, instruction: str) -> str:
    """A later request about `source`'s document: the same text (summarization, RAG) with
    another instruction, or (coding) the first request as context and a change to make."""
    if source.category == "coding":
        return CODE_EDIT.format(task=source.turns[0], edit=instruction)
    return f"{_document(source)}\n\n{instruction}"


def spread_order(groups: Sequence[Sequence[Prompt]], seed: int = 0,
                 min_gap: int = DEFAULT_MIN_GAP) -> list[Prompt]:
    """Every group's requests in one run, each group's in its own order, spread over the run.

    Place by place, a group is drawn among those whose previous request is at least `min_gap`
    places back (or that have not started), with probability proportional to the requests it
    has left, from `random.Random(seed)` (integer draws only, so the order is the same on every
    platform and Python version); when no group is ready (near the end), the one ready soonest
    goes, closer than `min_gap`. New documents thus keep arriving through the run while the
    earlier ones come back: acceptance by position shows the store filling up, first against
    repeat requests shows what one document's history is worth.
    """
    rng = random.Random(seed)
    taken = [0] * len(groups)
    ready_at = [0] * len(groups)
    order: list[Prompt] = []
    for place in range(sum(len(g) for g in groups)):
        left = [g for g in range(len(groups)) if taken[g] < len(groups[g])]
        ready = [g for g in left if ready_at[g] <= place]
        if ready:
            draw = rng.randrange(sum(len(groups[g]) - taken[g] for g in ready))
            for chosen in ready:
                draw -= len(groups[chosen]) - taken[chosen]
                if draw < 0:
                    break
        else:
            chosen = min(left, key=lambda g: (ready_at[g], g))
        order.append(groups[chosen][taken[chosen]])
        taken[chosen] += 1
        ready_at[chosen] = place + min_gap
    return order


def build_repetitive(sources: Sequence[Prompt], *, follow_ups: int = DEFAULT_FOLLOW_UPS,
                     seed: int = 0, min_gap: int = DEFAULT_MIN_GAP) -> list[Prompt]:
    """The repetitive workload's requests from summarization, RAG and coding `sources`.

    Each source is a group (`repeat_group` = its id): first the source itself as written (id
    `ID-r0`; a Spec-Bench coding conversation keeps its own follow-up turn: a multi-turn code
    edit), then `follow_ups` single-turn requests `ID-r1`, ... about the same document, their
    instructions taken in turn from FOLLOW_UPS so neighbouring documents get different pairs.
    Each keeps its source's category, max_tokens and temperature. The groups are interleaved by
    `spread_order(seed, min_gap)`.
    """
    if not 1 <= follow_ups <= min(len(v) for v in FOLLOW_UPS.values()):
        raise SpecDecodeError(f"follow-ups per document must be in 1..3, got {follow_ups}")
    groups: list[list[Prompt]] = []
    seen: dict[str, int] = {}
    for source in sources:
        if source.category not in FOLLOW_UPS:
            raise SpecDecodeError(f"prompt {source.id}: the repetitive workload is built from "
                                  f"{', '.join(REPETITIVE_CATEGORIES)} prompts, not "
                                  f"{source.category!r}")
        nth = seen.get(source.category, 0)
        seen[source.category] = nth + 1
        instructions = FOLLOW_UPS[source.category]
        group = [Prompt(id=f"{source.id}-r0", category=source.category, turns=list(source.turns),
                        max_tokens=source.max_tokens, temperature=source.temperature,
                        source=source.source, constraint=source.constraint,
                        repeat_group=source.id)]
        for j in range(1, follow_ups + 1):
            instruction = instructions[(nth + j - 1) % len(instructions)]
            group.append(Prompt(id=f"{source.id}-r{j}", category=source.category,
                                turns=[follow_up(source, instruction)],
                                max_tokens=source.max_tokens, temperature=source.temperature,
                                source=f"{source.source} (follow-up {j})",
                                repeat_group=source.id))
        groups.append(group)
    return spread_order(groups, seed, min_gap)


def load_repetitive_workload(
    specbench: str | Path | None = None, categories: Sequence[str] | None = None,
    limit_per_category: int | None = None, *, seed: int = 0, strict: bool = False,
) -> Workload:
    """The repetitive workload: from a Spec-Bench file's summarization, RAG and coding prompts
    (the first DEFAULT_REPETITIVE_DOCUMENTS of each unless `limit_per_category`), or without
    one from the built-in documents (3 summarization, 3 RAG, 2 coding: 24 requests); `seed`
    draws the order (`spread_order`). Categories and the limit select documents, each of which
    gives 1 + DEFAULT_FOLLOW_UPS requests."""
    if specbench is None:
        path = Path(str(resources.files("specdecode") / "data" / REPETITIVE_SOURCE))
        name, strict = REPETITIVE_WORKLOAD, True
    else:
        path, name = Path(specbench), f"{REPETITIVE_WORKLOAD}-specbench"
        if limit_per_category is None:
            limit_per_category = DEFAULT_REPETITIVE_DOCUMENTS
    prompts, skipped = read_prompts(path, strict=strict)
    sources = [p for p in prompts if p.category in REPETITIVE_CATEGORIES]
    if not sources:
        raise SpecDecodeError(f"{path} holds no {', '.join(REPETITIVE_CATEGORIES)} prompts to "
                              "build the repetitive workload from")
    selected = filter_prompts(sources, categories, limit_per_category)
    if not selected:
        raise SpecDecodeError(f"no prompts of {path} were selected")
    return Workload(name=name, path=str(path), prompts=build_repetitive(selected, seed=seed),
                    skipped=skipped,
                    categories=list(categories) if categories is not None else None,
                    limit_per_category=limit_per_category)


@dataclass(frozen=True)
class Arrival:
    """Where a prompt comes in a run: its place in the workload's order (0-based), its repeat
    group ("" for a prompt of its own) and how many of its group's prompts come before it."""

    index: int
    repeat_group: str
    repeat_index: int


def arrivals(prompts: Sequence[Prompt]) -> dict[str, Arrival]:
    """Each prompt's Arrival, by id."""
    out: dict[str, Arrival] = {}
    before: dict[str, int] = {}
    for index, p in enumerate(prompts):
        group = p.repeat_group or ""
        nth = before.get(group, 0) if group else 0
        if group:
            before[group] = nth + 1
        out[p.id] = Arrival(index, group, nth)
    return out
