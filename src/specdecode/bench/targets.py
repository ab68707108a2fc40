"""`bench --targets fp32,bf16,w4a16,llama.cpp`: several targets of one model measured in ONE
interleaved run over the same prompts, to answer "what is the fastest lossless way to run this
model here, at the fidelity I need?" (the analysis: `report.frontier`).

Each target is a precision of the native runner (fp32, checkpoint, bf16, int8, w8a16, w4a16)
or the GGUF on the llama.cpp backend (`llama.cpp`). Every target runs every configuration of
`--configs` (default `DEFAULT_TARGET_CONFIGS`: plain decoding, the n-gram lookup and the hybrid
ngram+w4a16, both under `--k auto`), named `<target>/<config>` and measured against the plain
decoding of its own target. Where llama-cpp-python is installed and the model is a GGUF, its own
`Llama.generate` on the same file is measured beside them at batch size 1 (`PEER_NAME`, the
reference every target's tokens/s is divided by), plain greedy, same token ids and budget.

A configuration a target cannot run is left out for that target, with the reason in the report:
speculation on a target that is not batch invariant (int8 by construction; any other whose
load-time invariance check fails, `drafters.registry`), a drafter that needs the native runner on
llama.cpp, a hybrid whose model part is the target itself (the w4a16 copy of a w4a16 target
drafts at the target's own cost). A configuration no target can run is an error.

At load, each target's batch invariance (`model.invariance`, where its loader measured it) and
its agreement with the fp32 target (`agreement`: top-1 and mean KL, teacher forced on the
built-in text in blocks of 8 positions) are recorded in the run header, with the CPU's vector
features: a precision the CPU has no instructions for (bf16 without AVX512_BF16) is slower
here, and the run shows by how much.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from specdecode.bench.options import BenchOptions
from specdecode.bench.peers import is_peer
from specdecode.bench.records import (
    AuditVerdict,
    ConfigSpec,
    CostCurve,
    MemoryRecord,
    RequestSample,
)
from specdecode.bench.runner import RunnerDescription
from specdecode.bench.workloads import Prompt
from specdecode.errors import SpecDecodeError
from specdecode.models import backends, precision
from specdecode.models.target import Target

DEFAULT_TARGET_CONFIGS = "plain;ngram:k=auto;ngram+w4a16:k=auto"
PEER_NAME = "llama-cpp-python/generate"  # Llama.generate on the same GGUF: the reference
PEER_DRAFTER = "llamacpp-generate"
REFERENCE = precision.REFERENCE.name  # agreement is measured against this target
AGREEMENT_CHUNK = 8
# the CPU's vector features the run header states: those the precisions run faster with
# (their records' faster_with) among the families that decide a CPU's matrix speed
CPU_FEATURES = tuple(dict.fromkeys(("avx2", "avx512f", *(f for p in precision.PRECISIONS
                                                        for f in p.faster_with),
                                    "amx_bf16", "amx_int8")))


# ----------------------------------------------------------------------------------- planning


def parse_targets(text: str) -> list[str]:
    """`--targets` as target names (models.backends.bench_targets), in the given order;
    SpecDecodeError naming a bad one."""
    given = [t.strip() for t in text.split(",") if t.strip()]
    found = [backends.bench_target(t) for t in given]
    unknown = [t for t, target in zip(given, found, strict=True) if target is None]
    if unknown or not given:
        known = ", ".join(t.name for t in backends.bench_targets())
        raise SpecDecodeError(f"--targets: unknown target(s) {', '.join(unknown) or '(none)'} "
                              f"(known: {known})")
    names = [target.name for target in found if target is not None]
    dupes = sorted({t for t in names if names.count(t) > 1})
    if dupes:
        raise SpecDecodeError(f"--targets names {', '.join(dupes)} twice")
    return names


def precision_of(target: str) -> str:
    """The ConfigSpec precision of a target (models.backends.BenchTarget)."""
    return _target(target).precision


def _target(name: str) -> backends.BenchTarget:
    found = backends.bench_target(name)
    if found is None:
        raise SpecDecodeError(f"--targets: unknown target {name!r}")
    return found


def skip_reason(target: str, config: ConfigSpec) -> str | None:
    """Why `config` is left out on `target` before anything loads (None: it is measured)."""
    from specdecode.drafters.options import model_part
    from specdecode.models.exactness import allow_inexact
    from specdecode.models.precision import coupling

    if config.is_plain:
        return None
    part = model_part(config.drafter) or config.drafter.removesuffix("-tree")
    if part == target:
        return (f"its draft model is a {part} copy of the {target} target, drafting at the "
                "target's own cost")
    coupled = coupling(target)
    if coupled is not None and not allow_inexact():  # the one way past it (models.exactness)
        return f"speculation refused on {target}: {coupled}"
    return None


def target_configs(targets: Sequence[str], configs: Sequence[ConfigSpec],
                   batch_sizes: Sequence[int], peer: bool
                   ) -> tuple[list[ConfigSpec], dict[str, dict[str, str]]]:
    """Every configuration on every target at every batch size (named `<target>/<name>`),
    llama-cpp-python's plain decoding at batch size 1 when `peer`; and per target, the
    configurations left out with the reason (`skip_reason`)."""
    out: list[ConfigSpec] = []
    skipped: dict[str, dict[str, str]] = {t: {} for t in targets}
    for batch in batch_sizes:
        for target in targets:
            for c in configs:
                name = f"{target}/{c.name}"
                why = skip_reason(target, c)
                if why is not None:
                    skipped[target][name] = why
                    continue
                out.append(dataclasses.replace(c, name=name, precision=precision_of(target),
                                               target=target, batch_size=batch))
        if peer and batch == 1:
            host = backends.peer_target()
            out.append(ConfigSpec(PEER_NAME, PEER_DRAFTER, 1, precision=host.precision,
                                  target=host.name, batch_size=1))
    return out, skipped


def peer_available(model: str | None) -> str | None:
    """Why llama-cpp-python's `Llama.generate` cannot be the reference here (None: it can)."""
    from specdecode.models.llamacpp import import_llama_cpp
    from specdecode.models.paths import default_model_path

    try:
        import_llama_cpp()
    except SpecDecodeError as exc:
        return str(exc)
    source = default_model_path() if model is None else Path(model).expanduser()
    if model is not None and not source.exists():  # a name of `specdecode models install`
        from specdecode.models.install import resolve

        source = resolve(model) or source
    if source.suffix != ".gguf":
        return f"{source} is not a GGUF file: llama-cpp-python cannot run it"
    return None


def plan_targets(options: BenchOptions, batch_sizes: Sequence[int],
                 configs: Sequence[ConfigSpec]
                 ) -> tuple[list[ConfigSpec], dict[str, dict[str, str]], str | None]:
    """The configurations of a `--targets` run (`configs`: `--configs` parsed, default
    DEFAULT_TARGET_CONFIGS), those left out, and why there is no llama-cpp-python reference
    (None: there is); checked before anything loads (BenchOptions.check refused --endpoint,
    --precision and --backend beside --targets)."""
    from specdecode.report.frontier import parse_fidelity

    parse_fidelity(options.fidelity)
    targets = parse_targets(options.targets or "")
    peers = [c.name for c in configs if is_peer(c.drafter)]
    if peers:
        raise SpecDecodeError(f"--targets adds llama-cpp-python's own decoding as the reference "
                              f"itself: leave {', '.join(peers)} out of --configs")
    no_peer = peer_available(options.model)
    host = backends.peer_target().name  # its backend's library is the peer's
    if host in targets and no_peer is not None and "llama_cpp" in no_peer:
        raise SpecDecodeError(f"--targets {host}: {no_peer}")
    grid, skipped = target_configs(targets, configs, sorted(set(batch_sizes)), no_peer is None)
    measured = {g.name for g in grid}
    for c in configs:
        if not any(f"{t}/{c.name}" in measured for t in targets):
            first = skipped[targets[0]][f"{targets[0]}/{c.name}"]
            raise SpecDecodeError(f"config {c.name} runs on none of the targets "
                                  f"{', '.join(targets)}: {first}")
    return grid, skipped, no_peer


# ------------------------------------------------------------------------------------ loading


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """Which of CPU_FEATURES the CPU has (its first "flags" line)."""
    flags = precision.cpu_flags(cpuinfo)
    return [f for f in CPU_FEATURES if f in flags]


def agreement_ids(tokenizer: Any) -> list[int]:
    """The token ids agreement is measured on: the built-in text of `agreement`."""
    from specdecode.agreement import BUILTIN_TEXT

    return list(tokenizer.encode(BUILTIN_TEXT))


def agreement_with(reference: Any, model: Any, ids: Sequence[int]) -> dict[str, Any]:
    """`model`'s teacher-forced agreement with `reference` (logits (T, V) of the fp32 target
    on `ids`): top-1, mean and max KL, positions, chunk."""
    from specdecode.agreement import compare_logits, teacher_forced_logits

    top1, mean_kl, max_kl = compare_logits(reference, teacher_forced_logits(
        model, ids, AGREEMENT_CHUNK))
    return {"top1": top1, "mean_kl": mean_kl, "max_kl": max_kl, "positions": len(ids),
            "chunk": AGREEMENT_CHUNK}


def invariance_facts(model: Target) -> dict[str, Any]:
    """The target's measured batch invariance, as its loader recorded it (None: not measured)."""
    measured = model.invariance
    if measured is None:
        return {"exact": None, "invariance": None}
    return {"exact": bool(measured.exact), "invariance": measured.describe(),
            "max_logit_difference": float(measured.worst)}


@dataclasses.dataclass
class LoadedTarget:
    """One target: its runner (bench.inprocess.InProcessRunner) and its facts for the header."""

    name: str
    runner: Any
    facts: dict[str, Any]


def load_target(options: BenchOptions, name: str, max_batch: int, make: Any,
                err: TextIO) -> LoadedTarget:
    """Load `name` and build its runner with `make(loaded)`."""
    from specdecode.models.backends import load_model

    start = time.perf_counter()
    target = _target(name)
    print(f"specdecode: loading the {name} target", file=err)
    loaded = load_model(options.model, target.precision, target.backend.name,
                        max_batch=max_batch)
    facts = {"backend": loaded.backend, "precision": loaded.precision,
             "weight_bytes": loaded.weight_bytes(), "load_s": time.perf_counter() - start,
             **invariance_facts(loaded.model)}
    return LoadedTarget(name, make(loaded), facts)


class TargetsRunner:
    """The bench Runner over several loaded targets: each configuration runs on the
    InProcessRunner of its `target` (the llama-cpp-python peer on the llama.cpp one)."""

    def __init__(self, targets: dict[str, LoadedTarget], fidelity: str,
                 no_reference: str | None) -> None:
        self.targets = targets
        self.fidelity = fidelity
        self.no_reference = no_reference

    def _runner(self, config: ConfigSpec) -> Any:
        if config.target not in self.targets:
            raise SpecDecodeError(f"config {config.name}: no target {config.target!r} loaded")
        return self.targets[config.target].runner

    def describe(self) -> RunnerDescription:
        """The first target's description with every target's facts under details."""
        first = next(iter(self.targets.values()))
        out = dict(first.runner.describe())
        details = dict(out.get("details") or {})
        details.pop("exactness", None)  # per target, under "targets"
        details.update({
            "backend": "several", "targets": {n: t.facts for n, t in self.targets.items()},
            "fidelity": self.fidelity, "reference_target": REFERENCE,
            "no_reference": self.no_reference, "cpu_features": cpu_features(),
            "agreement_text": "the built-in text of specdecode.agreement, teacher forced in "
                              f"blocks of {AGREEMENT_CHUNK} positions"})
        out["precision"] = ",".join(n for n, t in self.targets.items()
                                    if t.facts.get("measured", True))
        out["details"] = details
        return out  # type: ignore[return-value]

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        return list(self._runner(config).run(prompts, config))

    def cost_curves(self, configs: Sequence[ConfigSpec]) -> list[CostCurve]:
        """Each target's curves, named by configuration (drafter names repeat across
        targets, so a curve named only by its drafter would be found for every target)."""
        curves: list[CostCurve] = []
        for name, target in self.targets.items():
            mine = [c for c in configs if c.target == name and not is_peer(c.drafter)]
            for curve in target.runner.cost_curves(mine):
                if curve.config:
                    curves.append(curve)
                    continue
                curves += [dataclasses.replace(curve, config=c.name) for c in mine
                           if c.drafter == curve.drafter and c.batch_size == curve.batch_size]
        return curves

    def memory(self, config: ConfigSpec) -> MemoryRecord | None:
        return self._runner(config).memory(config)  # type: ignore[no-any-return]

    def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
        return list(self._runner(config).audit(config))


def speculation_text(refused: dict[str, str], measured: Sequence[ConfigSpec]) -> str:
    """Whether the target speculates in this run: "allowed", or the reason when every
    speculative configuration was refused."""
    if not refused:
        return "allowed"
    if not measured:
        return "refused (why: below)"
    return f"allowed; {len(refused)} configuration(s) left out (why: below)"


def refusals(runner: Any, configs: Sequence[ConfigSpec]) -> dict[str, str]:
    """The configurations `runner`'s target refuses (its drafter registry's reason), by name;
    the others are built and checked (bench.inprocess.InProcessRunner.check)."""
    refused = {}
    for c in configs:
        try:
            runner.check([c])
        except SpecDecodeError as exc:
            refused[c.name] = str(exc)
    return refused


def make_targets_runner(options: BenchOptions, plan: Any, skipped: dict[str, dict[str, str]],
                        no_reference: str | None, make: Any, err: TextIO = sys.stderr
                        ) -> TargetsRunner:
    """Load every target (and llama.cpp for the reference when it is not a target), measure
    each one's agreement with fp32, build and check its configurations: those a target
    refuses are dropped from `plan.configs` (a configuration refused on every target raises
    its first refusal). `make(loaded)` builds a target's InProcessRunner."""
    from specdecode.agreement import teacher_forced_logits

    targets = parse_targets(options.targets or "")
    max_batch = max(c.batch_size for c in plan.configs)
    host = backends.peer_target().name  # loaded for the peer when it is not a target itself
    wanted = targets + ([host] if no_reference is None and host not in targets else [])
    loaded = {n: load_target(options, n, max_batch, make, err) for n in wanted}
    reference_model = loaded[REFERENCE].runner.loaded.model if REFERENCE in loaded else None
    if reference_model is None:
        from specdecode.models.backends import load_model

        reference_model = load_model(options.model, REFERENCE, backends.NATIVE.name).model
    tokenizer = next(iter(loaded.values())).runner.loaded.tokenizer
    ids = agreement_ids(tokenizer)
    reference = teacher_forced_logits(reference_model, ids, AGREEMENT_CHUNK)
    kept: list[ConfigSpec] = []
    for name, target in loaded.items():
        target.facts["measured"] = name in targets  # llama.cpp only as the reference's runtime
        target.facts["agreement"] = agreement_with(reference, target.runner.loaded.model, ids)
        mine = [c for c in plan.configs if c.target == name]
        refused = refusals(target.runner, mine)
        target.facts["refused"] = {**skipped.get(name, {}), **refused}
        target.facts["speculation"] = speculation_text(
            target.facts["refused"], [c for c in mine if not c.is_plain
                                      and not is_peer(c.drafter) and c.name not in refused])
        kept += [c for c in mine if c.name not in refused]
    for c in plan.configs:
        base = c.name.split("/", 1)[-1]
        if c.name not in {k.name for k in kept} and not any(
                k.name.split("/", 1)[-1] == base for k in kept):
            raise SpecDecodeError(loaded[c.target].facts["refused"][c.name])
    for target in loaded.values():
        for config, why in target.facts["refused"].items():
            print(f"specdecode: {config} left out: {why}", file=err)
    plan.configs = [c for c in plan.configs if c in kept]
    return TargetsRunner(loaded, options.fidelity or "any", no_reference)
