"""The backends a target runs on: one record (`Backend`) per backend, `load_model` (which loads a
checkpoint on one), and the only module that compares a backend's name. `--backend`'s help and
errors, bench's `--targets` and the report read the records; adding a backend is adding its
record here, with its load function, and its Target (models.target's protocol). load_model sits
here, above the backends' loaders, which use the checkpoint helpers of models.loading below.

A record says how the backend loads (`load`), which precisions it takes and what it runs at
(`takes`, `runs_as`, `auto_precision`), how its load-time invariance check works (`invariance`,
in words), whether `--backend auto` may pick it (`automatic`), and
its names in bench and the report: `bench_target` (one `bench --targets` target named so, at
its own precision; None with `bench_per_precision`: one target per precision, named by it) and
`peer` (the library whose own decoding of the same file bench measures beside it).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.errors import SpecDecodeError
from specdecode.models import precision as precisions
from specdecode.models.config import NATIVE_FAMILIES, config_from_hf, read_hf_config

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

AUTO = "auto"  # --backend's default: native where the checkpoint's family has it, else transformers


@dataclass(frozen=True)
class LoadRequest:
    """What a backend's `load` is asked: the --model value, the precision as the user named it
    ("auto" included; Backend.precision resolves it), and the caller's needs."""

    spec: str | None
    precision: str
    max_batch: int = 1
    gemv_copy: bool | None = None
    start: float = 0.0  # time.perf_counter() when the load began (LoadedModel.load_seconds)
    folder: tuple[Path, Path, str] | None = None  # loading.resolve_folder(spec), if resolved
    # a drafter's model: what it drafts is verified by the target, so its own exactness does not
    # matter and its load-time invariance check (seconds to minutes on a large model) is skipped
    as_draft: bool = False


@dataclass(frozen=True)
class Backend:
    """One backend (see the module docstring)."""

    name: str
    summary: str
    load: Callable[[LoadRequest], LoadedModel]
    takes: Callable[[], tuple[str, ...]]  # the precisions --precision may name (read on use)
    auto_precision: Callable[[], str]
    invariance: str
    precision_note: str = ""
    runs_as: str | None = None  # the one precision it runs whatever it takes (None: the one asked)
    aliases: tuple[str, ...] = ()
    automatic: bool = False  # --backend auto may pick it
    bench_target: str | None = None
    bench_aliases: tuple[str, ...] = ()
    bench_per_precision: bool = False
    peer: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def precision(self, asked: str) -> str:
        """The precision a target loaded here with --precision `asked` runs at; SpecDecodeError
        naming the value where this backend does not take it."""
        if asked == precisions.AUTO:
            return self.auto_precision()
        takes = self.takes()
        if asked not in takes and precisions.find(asked) is None:
            raise SpecDecodeError(f"unknown precision '{asked}' (supported: "
                                  f"{', '.join((precisions.AUTO, *takes))})")
        if asked not in takes:
            raise SpecDecodeError(
                f"--precision {asked} does not apply to the {self.name} backend: "
                f"{self.precision_note}(it takes: {', '.join((precisions.AUTO, *takes))})")
        return self.runs_as or asked


def load_model(
    spec: str | None = None, precision: str = "fp32", backend: str = AUTO,
    gemv_copy: bool | None = None, max_batch: int = 1, as_draft: bool = False,
) -> LoadedModel:
    """Load --model (default: SmolLM2-135M-Instruct) on `backend` (auto: the native runner where
    the checkpoint's family has one, else transformers) at `precision` (Backend.precision).

    gemv_copy: on the native runner at fp32, hold each matrix a second time in the layout that
    makes one-row steps faster (LlamaModel.add_gemv_copies: plain decoding faster, the weights
    held twice; docs/measurements/code-figures.md). Default: on, unless the environment sets
    SPECDECODE_GEMV_COPY=0.
    max_batch: the largest batch the caller will run (the llama.cpp backend allocates a KV
    stream per row and per prompt being prefilled up front: 2 * max_batch + 2 of them).
    as_draft: a drafter's model (LoadRequest.as_draft): no load-time invariance check.
    """
    from specdecode.models.loading import resolve_folder

    request = LoadRequest(spec, precision, max_batch, gemv_copy, time.perf_counter(),
                          as_draft=as_draft)
    if not is_auto(backend):
        return get(backend).load(request)
    folder = resolve_folder(spec)  # the checkpoint's family picks the backend
    chosen = for_family(read_hf_config(folder[0]).get("model_type"))
    return chosen.load(dataclasses.replace(request, folder=folder))


def load_on_native(request: LoadRequest) -> LoadedModel:
    """The checkpoint on the native runner at the precision asked, on the row-invariant kernels
    where they build (NATIVE's load)."""
    from specdecode.models import loading
    from specdecode.models.invariance import DEFAULT_WIDTH
    from specdecode.models.tokenizer import Tokenizer

    precision = NATIVE.precision(request.precision)
    if request.as_draft and precisions.is_auto(request.precision):
        precision = precisions.draft_default()
    folder, source, name = request.folder or loading.resolve_folder(request.spec)
    cfg = config_from_hf(read_hf_config(folder), str(folder / "config.json"))
    record = precisions.get(precisions.resolve(precision, native=True))
    if source.suffix == ".gguf" and record.gguf_mode is not None:
        # the GGUF's own blocks, never through fp32 (seconds, and the file's size in memory)
        from specdecode.models.gguf_blocks import load_gguf_model

        model = load_gguf_model(source, cfg, record.gguf_mode, record.name)
    else:
        model = precisions.apply_precision(loading.load_native(folder, cfg), precision)
    exact = loading.make_exact(model)
    gemv_copy = request.gemv_copy
    if gemv_copy is None:
        gemv_copy = os.environ.get("SPECDECODE_GEMV_COPY", "1") != "0"
    if gemv_copy and not exact and precisions.get(model.precision).gemv_copy:
        model.add_gemv_copies()
    if not request.as_draft:  # of the kernels it runs on from here (gemv included)
        from specdecode.models.invariance_cache import checked

        checked(model, source, DEFAULT_WIDTH)
    return loading.LoadedModel(model, Tokenizer(folder), name, source, model.precision,
                               time.perf_counter() - request.start)


def load_on_transformers(request: LoadRequest) -> LoadedModel:
    """The checkpoint on Hugging Face transformers, fp32 (TRANSFORMERS's load)."""
    from specdecode.models import loading
    from specdecode.models.hf_adapter import load_transformers
    from specdecode.models.invariance import DEFAULT_WIDTH
    from specdecode.models.tokenizer import Tokenizer

    TRANSFORMERS.precision(request.precision)  # refuses any other precision, before loading
    folder, source, name = request.folder or loading.resolve_folder(request.spec)
    model = load_transformers(folder)
    if not request.as_draft:  # PyTorch's kernels: measured, refused if inexact
        model.check_invariance(DEFAULT_WIDTH)
    return loading.LoadedModel(model, Tokenizer(folder), name, source, model.precision,
                               time.perf_counter() - request.start)


def load_on_llamacpp(request: LoadRequest) -> LoadedModel:
    """A GGUF on the llama.cpp backend (models.llamacpp; LLAMACPP's load): the weights as the
    file stores them, the tokenizer and config from the same conversion the native runner uses
    (cached)."""
    from specdecode.models import loading
    from specdecode.models.llamacpp import import_llama_cpp, load_llamacpp
    from specdecode.models.tokenizer import Tokenizer

    import_llama_cpp()  # the missing extra is named before any conversion work
    precision = LLAMACPP.precision(request.precision)
    folder, source, name = request.folder or loading.resolve_folder(request.spec)
    if source.suffix != ".gguf":
        raise SpecDecodeError(f"{source}: the llama.cpp backend needs a .gguf file (--model)")
    cfg = config_from_hf(read_hf_config(folder), str(folder / "config.json"))
    sequences: int | None = 2 * request.max_batch + 2
    if os.environ.get("SPECDECODE_LLAMACPP_SEQUENCES"):
        sequences = None  # the user's setting wins
    model = load_llamacpp(source, cfg, sequences=sequences, check=not request.as_draft)
    return loading.LoadedModel(model, Tokenizer(folder), name, source, precision,
                               time.perf_counter() - request.start)


def _reference() -> str:
    return precisions.REFERENCE.name


def _gguf() -> str:
    return precisions.get("gguf").name


NATIVE = Backend(
    precisions.NATIVE, "this project's PyTorch runner for the Llama family, on the row-invariant "
    "kernels where they build", load_on_native, precisions.native_names, precisions.native_default,
    "measured at load (models.invariance: the target's check_invariance)", automatic=True,
    bench_per_precision=True)
TRANSFORMERS = Backend(
    "transformers", "Hugging Face transformers' own model, for families without a native runner",
    load_on_transformers, lambda: (precisions.REFERENCE.name,), _reference,
    "PyTorch's kernels: not row-invariant bit for bit (models.invariance measures it)",
    "it runs the checkpoint in fp32 ", runs_as=precisions.REFERENCE.name, automatic=True)
LLAMACPP = Backend(
    "llama.cpp", "the GGUF on llama.cpp (llama-cpp-python), docs/llamacpp.md", load_on_llamacpp,
    # the reference's name is taken too: a GGUF's fp32 reference is the file's own weights
    # de-quantized exactly, which llama.cpp runs (load_model's default precision is fp32)
    lambda: (_gguf(), precisions.REFERENCE.name), _gguf,
    "measured at load (models.llamacpp.batch_invariance)",
    "it runs the GGUF's own quantization (pick another GGUF file for another precision) ",
    runs_as="gguf", aliases=("llamacpp",), bench_target="llama.cpp",
    bench_aliases=("llamacpp", "gguf"), peer="llama-cpp-python")
BACKENDS: tuple[Backend, ...] = (NATIVE, TRANSFORMERS, LLAMACPP)


def choices() -> tuple[str, ...]:
    """What --backend takes."""
    return (AUTO, *(b.name for b in BACKENDS))


def get(name: str) -> Backend:
    """The backend named `name` (or one of its aliases); SpecDecodeError naming the choices."""
    found = next((b for b in BACKENDS if name in b.names), None)
    if found is None:
        raise SpecDecodeError(f"unknown backend '{name}' ({', '.join(choices())})")
    return found


def for_family(family: str | None) -> Backend:
    """The backend --backend auto picks for a checkpoint of `family` (config.json's
    model_type): the native runner where it has the family, else transformers."""
    return NATIVE if family in NATIVE_FAMILIES else TRANSFORMERS


def is_auto(name: str) -> bool:
    return name == AUTO


def target_precision(backend: str, precision: str) -> str:
    """The precision a target of --backend `backend` --precision `precision` runs at, before
    anything loads (auto: as on the native runner)."""
    return (NATIVE if is_auto(backend) else get(backend)).precision(precision)


# ------------------------------------------------------------------------- bench's targets


@dataclass(frozen=True)
class BenchTarget:
    """One `bench --targets` target: its name there and in the report, where it runs and at
    which precision (the precision --precision takes for it, and the one it reports)."""

    name: str
    backend: Backend
    precision: str

    @property
    def peer(self) -> str | None:
        """The library whose own decoding bench measures beside this target (None: none)."""
        return self.backend.peer


def bench_targets() -> tuple[BenchTarget, ...]:
    """Every target `bench --targets` knows, in order: the native runner's precisions, then
    each backend measured as one target."""
    out: list[BenchTarget] = []
    for backend in BACKENDS:
        if backend.bench_per_precision:
            out += [BenchTarget(p, backend, p) for p in backend.takes()]
        elif backend.bench_target is not None:
            out.append(BenchTarget(backend.bench_target, backend, backend.auto_precision()))
    return tuple(out)


def bench_target(name: str) -> BenchTarget | None:
    """The bench target `name` names (its aliases included, any case), or None."""
    key = name.strip().lower()
    for target in bench_targets():
        aliases = () if target.backend.bench_per_precision else target.backend.bench_aliases
        if key == target.name or key in aliases:
            return target
    return None


def peer_target() -> BenchTarget:
    """The target whose backend has a peer (llama-cpp-python's own decoding), which bench
    loads to measure the peer beside the targets."""
    return next(t for t in bench_targets() if t.peer is not None)
