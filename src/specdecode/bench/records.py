"""The versioned result schema of `specdecode bench` (`SCHEMA_VERSION`).

Every record is a plain dataclass with `to_dict()` / `from_dict()`; dicts hold only JSON types.
On disk (see `store`) each record is one JSON line `{"kind": KIND, "data": {...}}`.

Timing attribution inside a `RequestSample` (all times in seconds, wall clock):

- `ttft_s`: from the request's submission to its first output token (prefill included).
- `itl_s`: one entry per output token after the first, so `len(itl_s) == output_tokens - 1`.
  A step that emits m tokens at once (m - 1 accepted draft tokens plus the recovered or bonus
  token) contributes m entries: the first is the time since the previous emission (the whole
  step: draft + score + verify), the other m - 1 are 0.0, because those tokens reach the user
  at the same instant. This keeps `ttft_s + sum(itl_s)` equal to the time of the last token,
  and makes ITL percentiles show the burstiness speculation really produces.
- `latency_s`: submission to the request's completion (the last token, or end of stream).
- `prefill_s`: the prompt's prefill pass(es). `draft_s`, `target_s`, `verify_s`: time spent
  drafting, in target forward passes after prefill (scoring) and in verification, summed over
  the request's steps. With batch size > 1 a batched phase's time is charged in full to every
  request in it.

Counter attribution (integers, per request; the first output token comes from prefill and is not
a step):

- `steps`: target forward passes after prefill (verification steps; plain decoding: one a token).
- `drafted`, `accepted`: draft tokens proposed and kept over all steps.
- `drafted_per_pos[i]`: steps that drafted at least i + 1 tokens; `sum(drafted_per_pos) ==
  drafted`. `accepted_per_pos[i]`: steps whose draft token at position i was accepted (so the
  first i + 1 were); `sum(accepted_per_pos) == accepted`.
- `rejections`: steps in which a draft token was rejected (a recovered token was drawn). With
  `accepted` it gives the i.i.d. maximum-likelihood alpha: accepted / (accepted + rejections).
- `error`: why the request failed ("" when it succeeded). A failed sample keeps what was
  measured before the failure; `store.Results` files it under `failures`, out of every statistic.
- `alpha_micro`, `alpha_positions`: the engine's direct measure of alpha, sum over verified draft
  positions of sum_x min(p(x), q(x)) in millionths, and the number of those positions (as in
  `specdecode.counters.Counters`); 0 / 0 when the runner does not measure it.

Arrival (set by the harness from the workload's order, `workloads.arrivals`): `arrival` is the
request's prompt's place in the run (0-based; the turns of a conversation share it; -1 in files
written before it was recorded), `repeat_group` the document it is about ("" when its prompt has
none) and `repeat_index` how many requests of that group came before it (0: the first). The
report follows acceptance from cold to warm with them (`analysis.warmup_summary`).

Open-loop replay (`bench --arrivals recorded|poisson:RATE`, bench.openloop): `scheduled_s` is
when the request was due, `sent_s` when it was actually submitted (or sent), both in seconds
from the replay's first arrival (None in a closed-loop run), `window` the replay window it ran
in. There `ttft_s` and `latency_s` run from `scheduled_s`, not from submission: a request that
waited for a free row, or behind a late client, waited as a user would (no coordinated
omission). Each window of each configuration also leaves a `ReplayRecord`.

Machine load: `load` is the harness's reading of the CPU counters around the batch the request
ran in (`bench.interference.LoadReading` as a dict: wall_s, other_cores, steal_cores,
own_cores, load1, cores); empty when not recorded (files written before it existed).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, TypeVar

from specdecode.drafters.options import DrafterOptions
from specdecode.errors import SpecDecodeError

SCHEMA_VERSION = 1

PLAIN_DRAFTERS = ("none", "plain")

T = TypeVar("T")
JsonDict = dict[str, Any]


def _build(cls: type[T], data: object, what: str) -> T:
    """Make `cls` from `data`, ignoring unknown keys; a missing required key names the field."""
    if not isinstance(data, dict):
        raise SpecDecodeError(f"{what}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    kwargs = {key: value for key, value in data.items() if key in names}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise SpecDecodeError(f"{what}: {exc}") from None


@dataclass(frozen=True)
class ConfigSpec:
    """One configuration to measure: a drafter, its k, sampling and batch size.

    `drafter` is "none" for plain decoding (the baseline), otherwise the drafter's name
    ("ngram", "draft_model", "eagle", "medusa", ...). `k` is the draft length or "auto" (the
    engine chooses per step). `temperature` None means each prompt's own temperature (greedy when
    the prompt sets none); a number overrides every prompt's. `options` holds drafter arguments
    (for example "model": a draft checkpoint, "ngram_max" / "ngram_min": n-gram sizes).
    The same `name` may be measured at several batch sizes: the unit is (name, batch_size).
    `target` names the target the configuration runs on where one run measures several
    (`bench --targets`: "fp32", "bf16", "w4a16", "llama.cpp"; see `bench.targets`); "" in a run
    of one target. A speculative configuration's baseline is the plain one of its own target.
    """

    name: str
    drafter: str = "none"
    k: int | Literal["auto"] = 0
    temperature: float | None = None
    precision: str = "fp32"
    batch_size: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    target: str = ""

    @property
    def is_plain(self) -> bool:
        """True for the plain-decoding baseline (no drafter, or k == 0)."""
        return self.drafter in PLAIN_DRAFTERS or self.k == 0

    @property
    def key(self) -> tuple[str, int]:
        """(name, batch_size): what identifies a measured configuration."""
        return (self.name, self.batch_size)

    def validate(self) -> None:
        """Raise SpecDecodeError naming the first invalid field."""
        if not self.name:
            raise SpecDecodeError("config name must be non-empty")
        if self.batch_size < 1:
            raise SpecDecodeError(f"config {self.name}: batch_size must be >= 1")
        if self.k != "auto" and (not isinstance(self.k, int) or self.k < 0):
            raise SpecDecodeError(f"config {self.name}: k must be an int >= 0 or 'auto'")
        if self.temperature is not None and not self.temperature >= 0:
            raise SpecDecodeError(f"config {self.name}: temperature must be >= 0")

    def to_dict(self) -> JsonDict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> ConfigSpec:
        return _build(cls, data, "config")


def drafter_options(config: ConfigSpec) -> DrafterOptions:
    """The drafter a configuration measures, as drafters.registry.drafter_factory reads it: its
    name, k and `options` (the configuration string's key=value pairs), checked: an option the
    drafter does not read is an error naming the configuration and the option."""
    try:
        return DrafterOptions.from_mapping(config.drafter, config.options, config.k)
    except SpecDecodeError as exc:
        raise SpecDecodeError(f"config {config.name}: {exc}") from None


@dataclass
class RequestSample:
    """One request (one turn of one prompt) measured under one configuration.

    See the module docstring for how times and counters are attributed.
    """

    config: str
    batch_size: int
    prompt_id: str
    category: str
    turn: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    itl_s: list[float]
    latency_s: float
    drafted: int
    accepted: int
    accepted_per_pos: list[int]
    drafted_per_pos: list[int]
    rejections: int
    steps: int
    draft_s: float
    target_s: float
    verify_s: float
    output_token_ids: list[int]
    text: str
    temperature: float = 0.0
    group: int = 0  # index of the batch group the request ran in (same for every config)
    started_at: float = 0.0  # unix time the request was submitted (for drift analysis)
    prefill_s: float = 0.0
    alpha_micro: int = 0
    alpha_positions: int = 0
    error: str = ""  # why the request failed ("" when it succeeded; see `failed`)
    load: dict[str, float] = field(default_factory=dict)  # the machine's load (see above)
    # a sampled request's seed and verification rule (SamplingParams.rule; "" when greedy or
    # unknown, e.g. a remote server): under "invariant" the same seed gives the same tokens
    seed: int | None = None
    rule: str = ""
    # structured output: whether the output satisfies the prompt's constraint (complete under
    # its grammar; None: no constraint), tokens the constraint forced (emitted unscored), and
    # seconds spent computing its masks; those two are None where unknown (a remote server:
    # bench.http_constraints)
    valid: bool | None = None
    forced: int | None = 0
    mask_s: float | None = 0.0
    # where the request came in the run (see above; defaults: files written before)
    arrival: int = -1
    repeat_group: str = ""
    repeat_index: int = 0
    # open-loop replay (see above; None / -1 in a closed-loop run)
    scheduled_s: float | None = None
    sent_s: float | None = None
    window: int = -1

    @property
    def failed(self) -> bool:
        """True for a request that failed (HTTP error, broken stream, ...): it is kept in the
        results file, with what it measured before failing, but left out of every statistic."""
        return bool(self.error)

    @property
    def unit(self) -> tuple[str, str, int, int]:
        """(config, prompt_id, turn, batch_size): what resume counts as done."""
        return (self.config, self.prompt_id, self.turn, self.batch_size)

    def output_units(self) -> list[int] | list[str]:
        """What two outputs are compared by and what a loop is searched in: the token ids; for a
        remote server's sample, whose ids are stand-ins (`text_ids`), the text's pieces (words
        and the whitespace between them): servers count tokens differently (vLLM's usage counts
        the end-of-sequence token, this project's does not), so equal texts may carry different
        counts, and n copies of one CRC would look like a loop."""
        ids = self.output_token_ids
        if ids and ids == text_ids(self.text, len(ids)):
            return _PIECES.findall(self.text)
        return ids

    def problems(self) -> list[str]:
        """Inconsistencies between the fields (empty when the sample is well formed)."""
        out: list[str] = []
        times = [self.ttft_s, self.latency_s, self.prefill_s, self.draft_s, self.target_s,
                 self.verify_s]
        if not all(math.isfinite(t) and t >= 0 for t in [*times, *self.itl_s]):
            out.append("times must be finite and >= 0")
        if self.output_tokens > 0 and len(self.itl_s) != self.output_tokens - 1:
            out.append(f"len(itl_s)={len(self.itl_s)} != output_tokens - 1")
        if len(self.output_token_ids) != self.output_tokens:
            out.append("len(output_token_ids) != output_tokens")
        if sum(self.accepted_per_pos) != self.accepted:
            out.append("sum(accepted_per_pos) != accepted")
        if sum(self.drafted_per_pos) != self.drafted:
            out.append("sum(drafted_per_pos) != drafted")
        if len(self.accepted_per_pos) > len(self.drafted_per_pos):
            out.append("accepted_per_pos is longer than drafted_per_pos")
        pairs = zip(self.accepted_per_pos, self.drafted_per_pos, strict=False)
        if any(a > d for a, d in pairs):
            out.append("accepted_per_pos[i] > drafted_per_pos[i]")
        if self.accepted > self.drafted or self.rejections > self.steps:
            out.append("accepted > drafted or rejections > steps")
        if self.alpha_micro > 1_000_000 * self.alpha_positions or self.alpha_micro < 0:
            out.append("alpha_micro must lie in [0, 1e6 * alpha_positions]")
        return out

    def to_dict(self) -> JsonDict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> RequestSample:
        return _build(cls, data, "sample")


_PIECES = re.compile(r"\s+|\S+")


def text_ids(text: str, n: int) -> list[int]:
    """n copies of a CRC of the text: stand-ins for token ids where a server streams text only
    (bench.http_runner), equal exactly when texts (and counts) are."""
    return [zlib.crc32(text.encode("utf-8")) & 0x7FFFFFFF] * n


@dataclass(frozen=True)
class HardwareInfo:
    """Where the measurements ran."""

    cpu_model: str
    cpu_cores: int
    torch_threads: int | None
    accelerator: str | None
    platform: str
    python: str

    def to_dict(self) -> JsonDict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> HardwareInfo:
        return _build(cls, data, "hardware")


@dataclass(frozen=True)
class ModelInfo:
    """The target model: name, precision and a hash of its weights (detects a target swap)."""

    name: str
    precision: str
    weight_hash: str

    def to_dict(self) -> JsonDict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> ModelInfo:
        return _build(cls, data, "model")


@dataclass(frozen=True)
class RunHeader:
    """The first line of a results file: what was measured, where, with what.

    `workload` is `workloads.describe_workload(...)`: name, fingerprint, counts and the prompts.
    """

    schema_version: int
    specdecode_version: str
    created_at: str  # ISO 8601, UTC
    hardware: HardwareInfo
    model: ModelInfo
    workload: JsonDict
    configs: list[ConfigSpec]
    runner: JsonDict = field(default_factory=dict)
    seed: int = 0

    def to_dict(self) -> JsonDict:
        data = asdict(self)
        data["configs"] = [c.to_dict() for c in self.configs]
        return data

    @classmethod
    def from_dict(cls, data: object) -> RunHeader:
        if not isinstance(data, dict):
            raise SpecDecodeError("header: expected a JSON object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SpecDecodeError(
                f"results schema version {version!r} is not supported (this specdecode reads "
                f"version {SCHEMA_VERSION})"
            )
        data = dict(data)
        data["hardware"] = HardwareInfo.from_dict(data.get("hardware"))
        data["model"] = ModelInfo.from_dict(data.get("model"))
        data["configs"] = [ConfigSpec.from_dict(c) for c in data.get("configs", [])]
        return _build(cls, data, "header")


@dataclass(frozen=True)
class CostCurve:
    """Measured cost curves at one batch size, relative to one plain target step.

    `c[i]`: cost of drafting ONE token when drafting `k[i]` tokens (the drafting cost of a step
    is k * c(k) target steps; this is the c of the speedup formula). `v[i]`: cost of scoring and
    verifying k[i] + 1 positions in one target pass. `target_step_s`: the absolute time of one
    plain target step these ratios are relative to.
    """

    drafter: str
    batch_size: int
    k: list[int]
    c: list[float]
    v: list[float]
    target_step_s: float
    config: str = ""

    def to_dict(self) -> JsonDict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> CostCurve:
        return _build(cls, data, "cost curve")


@dataclass(frozen=True)
class MemoryRecord:
    """Memory of one configuration, in bytes (0 where not applicable, e.g. no draft model).
    `draft_store`: the drafter's store of earlier requests (`suffix`) after the configuration's
    requests, draft memory that is neither weights nor KV (0 in files written before it)."""

    config: str
    batch_size: int
    target_weights: int
    draft_weights: int
    target_kv: int
    draft_kv: int
    peak_rss: int
    draft_store: int = 0

    def to_dict(self) -> JsonDict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> MemoryRecord:
        return _build(cls, data, "memory record")


@dataclass(frozen=True)
class AuditVerdict:
    """A losslessness verdict for one configuration.

    `method` names the check ("greedy-token-identity": token ids equal plain decoding's at
    temperature 0; "seeded-token-identity": also seeded sampled requests under the invariant
    rule, which must equal plain decoding's with the same seed; or a distribution test).
    `n_compared` counts what was compared (requests or samples), `n_failed` how many failed;
    `p_value` is set by statistical tests. A sampled audit also states its power and what it
    audited (None / "" in files written before): `detectable_tv`, the TV distance its samples
    detect with probability `audit.POWER`; `samples_needed`, the samples per side that detect
    `audit.TV_REAL`; its `false_alarm` rate, `temperature`, and the prompt and turn it ran.
    """

    config: str
    passed: bool
    method: str
    n_compared: int
    n_failed: int
    details: str = ""
    batch_size: int | None = None
    p_value: float | None = None
    detectable_tv: float | None = None
    samples_needed: int | None = None
    false_alarm: float | None = None
    temperature: float | None = None
    prompt_id: str = ""
    turn: int | None = None

    def to_dict(self) -> JsonDict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> AuditVerdict:
        return _build(cls, data, "audit verdict")


@dataclass(frozen=True)
class ReplayRecord:
    """One window of an open-loop replay under one configuration (bench.openloop).

    `start_s`: the window's first arrival, from the replay's first; `requests`: its arrivals
    (a conversation's later turns, sent as the replies before them end, are not); `span_s`:
    its last scheduled arrival after its first; `sent_span_s`: the same, measured (first to
    last submission); `late_max_s`: the latest a request was submitted after it was due.
    `steps_by_batch[b - 1]`: engine steps that decoded b requests (exact in process; over HTTP
    from the server's engine_steps_total where it exports it), or with `batch_source` "in
    flight" the seconds during which b requests were in flight, as the client saw them (other
    servers). Over HTTP the window's speculation counters, read from /metrics before and after
    it, are the record's (as for a batch: see http_metrics); in process they are the samples'
    own and these stay 0.
    """

    config: str
    batch_size: int
    window: int
    start_s: float
    requests: int
    span_s: float
    sent_span_s: float
    late_max_s: float
    steps_by_batch: list[float]
    batch_source: str  # "engine" | "server engine_steps_total" | "in flight" | ""
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    rejections: int = 0
    steps: int = 0
    alpha_micro: int = 0
    alpha_positions: int = 0

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.config, self.batch_size, self.window)

    def to_dict(self) -> JsonDict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> ReplayRecord:
        return _build(cls, data, "replay record")


Record = RequestSample | CostCurve | MemoryRecord | AuditVerdict | ReplayRecord

RECORD_KINDS: dict[str, type[Record]] = {
    "sample": RequestSample,
    "cost_curve": CostCurve,
    "memory": MemoryRecord,
    "audit": AuditVerdict,
    "replay": ReplayRecord,
}


def kind_of(record: Record) -> str:
    """The `kind` tag a record is stored under."""
    for kind, cls in RECORD_KINDS.items():
        if isinstance(record, cls):
            return kind
    raise TypeError(f"not a bench record: {type(record).__name__}")


def record_from_dict(kind: str, data: object) -> Record:
    """Rebuild a record from its stored kind tag and data; unknown kinds are an error."""
    cls = RECORD_KINDS.get(kind)
    if cls is None:
        raise SpecDecodeError(f"unknown record kind {kind!r}")
    return cls.from_dict(data)
