"""Where results go: an append-only JSONL file written as measurements are made, and report.json.

`results.jsonl` holds the run header on its first line, then one record a line
(`{"kind": "sample" | "cost_curve" | "memory" | "audit" | "replay", "data": {...}}`), each
flushed and fsync'd before the next measurement starts: Ctrl-C or a crash loses nothing
already measured, at worst a last line cut short, which reading ignores. `--resume` reopens
such a file, refuses it if its header describes a different model, workload (or arrivals),
machine or set of configurations, and reports which (config, prompt, turn, batch_size) units
are done so the harness skips them. A failed
request (a "sample" whose "error" is set, e.g. an HTTP 500 from an endpoint) is kept, with what it
measured before failing, in `Results.failures` and report.json's "failures": it is in no
statistic, and --resume measures its unit again. So does a request measured under interference
(`bench.interference.is_disturbed`): the later measurement of a unit replaces the earlier one in
every statistic, and the replaced sample stays in the file and in report.json's "superseded".

`report.json` is assembled from the JSONL (every raw sample kept) and written atomically
(temporary name, fsync, rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from specdecode.bench.interference import is_disturbed
from specdecode.bench.records import (
    SCHEMA_VERSION,
    AuditVerdict,
    CostCurve,
    MemoryRecord,
    Record,
    ReplayRecord,
    RequestSample,
    RunHeader,
    kind_of,
    record_from_dict,
)
from specdecode.errors import SpecDecodeError
from specdecode.files import atomic_write_text

RESULTS_FILE = "results.jsonl"
REPORT_JSON = "report.json"
REPORT_HTML = "report.html"

UnitKey = tuple[str, str, int, int]  # (config, prompt_id, turn, batch_size)


@dataclass
class Results:
    """Everything a results file holds, in file order."""

    header: RunHeader
    samples: list[RequestSample] = field(default_factory=list)  # requests that succeeded
    failures: list[RequestSample] = field(default_factory=list)  # requests that failed
    superseded: list[RequestSample] = field(default_factory=list)  # measured again later
    cost_curves: list[CostCurve] = field(default_factory=list)
    memory: list[MemoryRecord] = field(default_factory=list)
    audits: list[AuditVerdict] = field(default_factory=list)
    # open-loop replay windows; a window replayed again (--resume) replaces the earlier record
    replays: list[ReplayRecord] = field(default_factory=list)
    truncated_tail: bool = False  # the last line was cut short (a crash mid-write), ignored
    _where: dict[UnitKey, int] = field(default_factory=dict, repr=False, compare=False)

    def add(self, record: Record) -> None:
        """File a record under its kind; a successful sample of a unit already measured
        replaces the earlier one (which moves to `superseded`)."""
        if isinstance(record, RequestSample):
            if record.failed:
                self.failures.append(record)
            else:
                self._add_sample(record)
        elif isinstance(record, CostCurve):
            self.cost_curves.append(record)
        elif isinstance(record, MemoryRecord):
            self.memory.append(record)
        elif isinstance(record, ReplayRecord):
            self.replays = [r for r in self.replays if r.key != record.key] + [record]
        else:
            self.audits.append(record)

    def _add_sample(self, sample: RequestSample) -> None:
        if len(self._where) != len(self.samples):  # samples were given to the constructor
            self._where = {s.unit: i for i, s in enumerate(self.samples)}
        at = self._where.get(sample.unit)
        if at is None:
            self._where[sample.unit] = len(self.samples)
            self.samples.append(sample)
        else:
            self.superseded.append(self.samples[at])
            self.samples[at] = sample

    def samples_of(self, key: tuple[str, int]) -> list[RequestSample]:
        """The successful requests of one (config, batch size)."""
        return [s for s in self.samples if (s.config, s.batch_size) == key]

    def done_units(self) -> set[UnitKey]:
        """The (config, prompt_id, turn, batch_size) units already measured (a failed request
        is not, nor one measured under interference: --resume runs them again)."""
        return {s.unit for s in self.samples if not is_disturbed(s, self.header)}


def check_writable(folder: str | Path) -> Path:
    """Create `folder` if needed and prove a file can be written there, else SpecDecodeError."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise SpecDecodeError(
            f"output folder {path} is not writable: {exc.strerror or exc}"
        ) from None
    return path


def preflight(folder: str | Path, resume: bool) -> Path:
    """Check the output folder before any expensive work (model loading, measuring).

    Raises SpecDecodeError if it is not writable, or if it already holds results and `resume`
    is off. Returns the folder.
    """
    path = check_writable(folder)
    if (path / RESULTS_FILE).exists() and not resume:
        raise SpecDecodeError(
            f"{path / RESULTS_FILE} already exists: pass --resume to continue it, or choose "
            "another output folder"
        )
    return path


def encode_line(kind: str, data: dict[str, Any]) -> bytes:
    """One JSONL line (newline included); NaN and infinity are refused."""
    text = json.dumps({"kind": kind, "data": data}, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


def _complete_prefix(data: bytes) -> tuple[bytes, bool]:
    """The bytes up to the last newline, and whether an incomplete tail was cut off."""
    if not data or data.endswith(b"\n"):
        return data, False
    cut = data.rfind(b"\n") + 1
    return data[:cut], True


def _decode(raw: bytes, path: Path, lineno: int) -> tuple[str, object]:
    try:
        obj = json.loads(raw.decode("utf-8"))
        return str(obj["kind"]), obj["data"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise SpecDecodeError(f"{path}:{lineno}: corrupt results line") from None


def parse_results(data: bytes, path: Path) -> Results:
    """Parse the bytes of a results file; a cut-short last line is ignored, not an error."""
    complete, truncated = _complete_prefix(data)
    lines = complete.split(b"\n")[:-1] if complete else []
    if not lines:
        raise SpecDecodeError(f"{path} has no header line: not a specdecode results file")
    kind, header_data = _decode(lines[0], path, 1)
    if kind != "header":
        raise SpecDecodeError(f"{path}:1: expected the header line, found {kind!r}")
    results = Results(header=RunHeader.from_dict(header_data), truncated_tail=truncated)
    for lineno, raw in enumerate(lines[1:], start=2):
        kind, record = _decode(raw, path, lineno)
        try:
            results.add(record_from_dict(kind, record))
        except SpecDecodeError as exc:
            raise SpecDecodeError(f"{path}:{lineno}: {exc}") from None
    return results


def read_results(path: str | Path) -> Results:
    """Read a results JSONL file (see `parse_results`)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecDecodeError(f"cannot read results {path}: {exc.strerror or exc}") from None
    return parse_results(data, path)


def header_mismatches(old: RunHeader, new: RunHeader) -> list[str]:
    """Why a run with header `new` may not continue a file with header `old` (empty: it may)."""
    out: list[str] = []
    if old.model != new.model:
        out.append(f"model {old.model} != {new.model}")
    old_fp, new_fp = old.workload.get("fingerprint"), new.workload.get("fingerprint")
    if old_fp != new_fp:
        out.append(f"workload fingerprint {old_fp} != {new_fp}")
    old_arrivals, new_arrivals = old.workload.get("arrivals"), new.workload.get("arrivals")
    if old_arrivals != new_arrivals:
        out.append(f"arrivals {(old_arrivals or {}).get('described', 'closed loop')} != "
                   f"{(new_arrivals or {}).get('described', 'closed loop')}")
    hw_fields = ("cpu_model", "cpu_cores", "torch_threads", "accelerator")
    for name in hw_fields:
        a, b = getattr(old.hardware, name), getattr(new.hardware, name)
        if a != b:
            out.append(f"hardware {name} {a!r} != {b!r}")
    if [c.to_dict() for c in old.configs] != [c.to_dict() for c in new.configs]:
        out.append("the configurations differ")
    return out


class ResultStore:
    """An open results file; `append` makes each record durable before returning."""

    def __init__(self, path: Path, handle: IO[bytes], results: Results) -> None:
        self.path = path
        self._handle = handle
        self.results = results

    def append(self, record: Record) -> None:
        """Write one record as a line, flush and fsync it, and keep it in `results`."""
        self._handle.write(encode_line(kind_of(record), record.to_dict()))
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self.results.add(record)

    def done_units(self) -> set[UnitKey]:
        """Units already measured (loaded on resume, plus those appended since)."""
        return self.results.done_units()

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _resume(path: Path, header: RunHeader) -> ResultStore:
    data = path.read_bytes()
    results = parse_results(data, path)
    problems = header_mismatches(results.header, header)
    if problems:
        raise SpecDecodeError(
            f"cannot resume {path}: it was measured with a different setup ("
            + "; ".join(problems)
            + "). Use another output folder."
        )
    complete, _ = _complete_prefix(data)
    os.truncate(path, len(complete))  # drop a cut-short last line before appending
    return ResultStore(path, path.open("ab"), results)


def open_store(folder: str | Path, header: RunHeader, resume: bool = False) -> ResultStore:
    """Open `folder/results.jsonl` for appending: a new file, or (resume) an existing one.

    An existing file without `resume` is refused rather than overwritten.
    """
    path = preflight(folder, resume) / RESULTS_FILE
    if path.exists():
        return _resume(path, header)
    handle = path.open("xb")
    store = ResultStore(path, handle, Results(header=header))
    handle.write(encode_line("header", header.to_dict()))
    handle.flush()
    os.fsync(handle.fileno())
    return store


def build_report(results: Results, derived: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report.json document: header and every raw record, plus derived sections."""
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "header": results.header.to_dict(),
        "samples": [s.to_dict() for s in results.samples],
        "failures": [s.to_dict() for s in results.failures],
        "superseded": [s.to_dict() for s in results.superseded],
        "cost_curves": [c.to_dict() for c in results.cost_curves],
        "memory": [m.to_dict() for m in results.memory],
        "audits": [a.to_dict() for a in results.audits],
        "replays": [r.to_dict() for r in results.replays],
    }
    report.update(derived or {})
    return report


def write_report_json(path: str | Path, report: dict[str, Any]) -> None:
    """Write report.json atomically."""
    atomic_write_text(path, json.dumps(report, ensure_ascii=False, indent=1, allow_nan=False))


def results_from_report(report: object) -> Results:
    """The raw records of a report.json document (derived sections are recomputed, not read)."""
    if not isinstance(report, dict) or "header" not in report:
        raise SpecDecodeError("not a specdecode report: no header")
    results = Results(header=RunHeader.from_dict(report["header"]))
    for kind, key in (("sample", "superseded"), ("sample", "samples"), ("sample", "failures"),
                      ("cost_curve", "cost_curves"), ("memory", "memory"), ("audit", "audits"),
                      ("replay", "replays")):
        for item in report.get(key, []):
            results.add(record_from_dict(kind, item))
    return results


def load_report(path: str | Path) -> Results:
    """Read a report.json file, or a results.jsonl file, into Results."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_results(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"cannot read report {path}: {exc}") from None
    return results_from_report(report)
