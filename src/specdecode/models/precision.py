"""Target precisions: one record (`Precision`) per precision, and the only module that compares
a precision's name. Loading, the speculation refusal, bench's target lists, the report, help
texts and error messages read the records; adding a precision is adding its record here and its
matrix class in models.linears (and, for a new arithmetic, a kernel path in models.kernels).

Each precision is a different target: losslessness is always relative to the model as it runs.
Only the weight matrices change; embeddings are looked up in the same precision as the LM head,
and everything else (activations, RMSNorm, RoPE, softmax, the KV cache) stays fp32.

A record says what the precision holds (`weights`: its weight kinds, with their bytes per
parameter), which kernel paths can run it (`paths`, the preferred first: the row-invariant
kernels of models.kernels where it has them, PyTorch's otherwise), whether a position's logits
are the same bit for bit whatever else is scored with it (`row_invariant`, from its paths) and
why (`invariance`), how far it is from the reference (`fidelity`), what it needs of the PyTorch
build and the CPU (`requires`, `KernelPath.requires`, `KernelPath.cpu_flags`; `faster_with`:
CPU features it runs slower without), and how the native runner builds it (`matrix`, `ends`).

On PyTorch's kernels no precision is exact: attention and the fp32 / fp16 GEMMs pick kernels by
shape (~1e-4 of a logit on SmolLM2 at fp32), and bf16 rounding at w8a16 / w4a16 amplifies that
to ~1e-1. The fbgemm operators used for bf16 and int8 are the ones behind torch.ao dynamic
quantization (deprecated in PyTorch 2.10+, present through 2.14); a build without them gets a
SpecDecodeError naming the precision, the CPU and the precisions that work.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    import torch
    from torch import nn

# This module imports neither torch nor the kernels at import time: the command line builds its
# help from these records before anything heavy loads. The matrix classes are reached through
# _linears() when a model is built.

# The front ends' default: resolved per backend (models.backends): "checkpoint" on the native
# runner where the row-invariant kernels build (the checkpoint's own weights, bit for bit, with
# an arithmetic of its own, at the speed of its quantization: on SmolLM2's Q4_1 GGUF top-1
# agreement with fp32 1.0 and mean KL 3e-11 measured, at a w4a16 step's cost and a fifth of
# fp32's weight bytes), else fp32; the llama.cpp backend's own ("gguf").
AUTO = "auto"

# How far a precision's logits are from the reference's (the bench measures it: top-1, KL):
# "reference": it is the reference (fp32); "checkpoint": the reference's weights bit for bit in
# another layout, so only the order of summation differs; "rounded": weights rounded, fp32 or
# bf16 activations; "quantized": weights and activations quantized.
Fidelity = Literal["reference", "checkpoint", "rounded", "quantized"]

# A precision's matrix and ends, as the native runner builds them: matrix(weight, bias, exact)
# and ends(head, embedding, tied, exact) -> (LM head, embedding); `exact`: on the row-invariant
# kernels.
Matrix: TypeAlias = "Callable[[torch.Tensor, torch.Tensor | None, bool], nn.Module]"
Ends: TypeAlias = "Callable[[torch.Tensor, torch.Tensor, bool, bool], tuple[nn.Module, nn.Module]]"
GROUP = 32  # inputs per group of the grouped formats (models.linears.GROUP, kernels.GROUP)


def _linears() -> ModuleType:
    from specdecode.models import linears

    return linears


def _kernels() -> ModuleType:
    from specdecode.models import kernels

    return kernels


# ------------------------------------------------------------------------- the build and the CPU


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CPU's feature flags (the first "flags" line of /proc/cpuinfo; none where unreadable)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return next((line.partition(":")[2].split() for line in text.splitlines()
                 if line.startswith("flags")), [])


def quantized_engines() -> list[str]:
    import torch

    return list(torch.backends.quantized.supported_engines)


def weight_only_kernels() -> list[str]:
    """The weight-only kernels this build has and can run (a tiny product each)."""
    import torch

    found = []
    try:
        x = torch.ones(1, GROUP, dtype=torch.bfloat16)
        q = torch.ones(16, GROUP, dtype=torch.int8)
        torch._weight_int8pack_mm(x, q, torch.ones(16, dtype=torch.bfloat16))
        found.append("_weight_int8pack_mm")
        packed = torch._convert_weight_to_int4pack_for_cpu(q.int(), 1)
        sz = torch.ones(1, 16, 2, dtype=torch.bfloat16)
        torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
        found.append("_weight_int4pack_mm_for_cpu")
    except (AttributeError, RuntimeError, NotImplementedError):
        pass
    return found


@dataclass(frozen=True)
class Requirement:
    """Something a precision or a kernel path needs of the PyTorch build, the compiler or the
    CPU: `what`, and `missing()`, why this machine lacks it (None: it has it)."""

    what: str
    missing: Callable[[], str | None]


def _kernels_missing() -> str | None:
    error = _kernels().build_error()
    return None if error is None else f"it needs the row-invariant kernels ({error})"


def _fbgemm_missing(ops: tuple[str, ...]) -> Callable[[], str | None]:
    def missing() -> str | None:
        import torch

        engines = quantized_engines()
        has_fbgemm = "fbgemm" in engines or "x86" in engines
        has_ops = all(hasattr(torch.ops.quantized, op) for op in ops)
        if has_fbgemm and has_ops:
            return None
        return (f"it needs the fbgemm (x86) kernels, and this build has quantized engines "
                f"{engines}{'' if has_ops else ' without the fbgemm linear operators'}")
    return missing


def _weight_only_missing(kernel: str) -> Callable[[], str | None]:
    def missing() -> str | None:
        if kernel in weight_only_kernels():
            return None
        return (f"it needs PyTorch's weight-only CPU kernel {kernel}, which this build lacks "
                "or cannot run")
    return missing


def cpu_has(*flags: str) -> Requirement:
    """A requirement on the CPU's feature flags (an AVX-512 or VNNI kernel path's)."""
    def missing() -> str | None:
        lacking = [f for f in flags if f not in cpu_flags()]
        return None if not lacking else f"it needs CPU features {', '.join(lacking)}"
    return Requirement(f"CPU features {', '.join(flags)}", missing)


ROW_INVARIANT_KERNELS = Requirement(
    "the row-invariant kernels (models/kernels.c, built on first use with the system C compiler "
    "and OpenMP)", _kernels_missing)
FBGEMM_FP16 = Requirement("PyTorch's fbgemm fp16 operators (linear_prepack_fp16, "
                          "linear_dynamic_fp16)",
                          _fbgemm_missing(("linear_prepack_fp16", "linear_dynamic_fp16")))
FBGEMM_INT8 = Requirement("PyTorch's fbgemm int8 operators (linear_prepack, linear_dynamic)",
                          _fbgemm_missing(("linear_prepack", "linear_dynamic")))
INT8PACK = Requirement("PyTorch's _weight_int8pack_mm", _weight_only_missing("_weight_int8pack_mm"))
INT4PACK = Requirement("PyTorch's _weight_int4pack_mm_for_cpu",
                       _weight_only_missing("_weight_int4pack_mm_for_cpu"))


def _bf16_head_missing() -> str | None:
    why = FBGEMM_FP16.missing()
    return None if why is None else f"its bf16 LM head: {why}"


BF16_HEAD = Requirement("a bf16 LM head (fbgemm fp16) off the row-invariant kernels",
                        _bf16_head_missing)


# ------------------------------------------------------------------------------- the records


@dataclass(frozen=True)
class WeightKind:
    """One way a precision holds a weight matrix: its name, bytes per parameter (scales
    included) and what it is."""

    name: str
    bytes_per_weight: float
    what: str


F32 = WeightKind("f32", 4.0, "fp32")
BF16 = WeightKind("bf16", 2.0, "bf16 (held as fp16 by fbgemm, as bf16 panels on the kernels)")
I8_ROW = WeightKind("i8-row", 1.0, "int8 per output channel, one scale per row")
I8_GROUP = WeightKind("i8-group32", 1.125, "int8 per group of 32 inputs with an fp32 scale "
                      "(GGUF Q8_0's layout)")
I4_GROUP = WeightKind("i4-group32", 0.625, "4 bits per group of 32 inputs with a bf16 scale "
                      "and offset")
Q4_1 = WeightKind("q4_1", 0.75, "GGUF Q4_1 blocks recovered bit for bit: 4 bits per group of "
                  "32 inputs with its fp16 d and m (held fp32)")
GGUF = WeightKind("gguf", 0.0, "the GGUF file's own tensors, as stored (bytes: the file's)")
GGUF_BLOCKS = WeightKind("gguf-blocks", 0.7, "a GGUF's own blocks read bit for bit (Q4_0, Q4_1, "
                         "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): codes with their fp32 scales "
                         "and minimums per group of 16 or 32 inputs (models.gguf_blocks)")


@dataclass(frozen=True)
class KernelPath:
    """A way of running a precision's products: whether a row's outputs are the same bit for
    bit whatever else the call holds (`row_invariant`), what it needs (`requires`, checked on
    this machine by `missing`), and the CPU feature flags it needs (`cpu_flags`)."""

    name: str
    row_invariant: bool
    requires: tuple[Requirement, ...] = ()
    cpu_flags: tuple[str, ...] = ()

    def missing(self) -> str | None:
        """Why this machine cannot take this path (None: it can)."""
        checks = self.requires + ((cpu_has(*self.cpu_flags),) if self.cpu_flags else ())
        return next((why for why in (r.missing() for r in checks) if why is not None), None)


ROW_INVARIANT = KernelPath("row-invariant kernels (models.kernels)", True, (ROW_INVARIANT_KERNELS,))
TORCH_DENSE = KernelPath("PyTorch (MKL sgemm, SDPA attention)", False)
TORCH_FP16 = KernelPath("PyTorch fbgemm fp16", False, (FBGEMM_FP16,))
TORCH_INT8_DYNAMIC = KernelPath("PyTorch fbgemm dynamic int8", False, (FBGEMM_INT8,))
TORCH_W8 = KernelPath("PyTorch _weight_int8pack_mm", False, (INT8PACK,))
TORCH_W4 = KernelPath("PyTorch _weight_int4pack_mm_for_cpu", False, (INT4PACK,))
GGML = KernelPath("llama.cpp (ggml), row-invariant where built without llamafile's tiled GEMMs "
                  "(scripts/install_llamacpp.sh; measured at load)", True)

_INVARIANT_KERNELS = (
    "on the row-invariant kernels every output element of a product, of attention and of a norm "
    "is computed by one fixed sequence of operations that depends only on its own row")


@dataclass(frozen=True)
class Precision:
    """One precision (see the module docstring). `matrix` and `ends` are None for the reference
    (the model as loaded) and for a precision the native runner does not build (a backend's
    own, "gguf"). `rows_independent`: a row's outputs do not depend on the other rows' values
    (then a batch's rows draft together: engine.draft_rows). `reference_weights`: it holds the
    reference's weights bit for bit in another layout, so heads and drafts made for the
    reference are made for it (LlamaModel.identity_state). `gemv_copy`: off the row-invariant
    kernels, one-row calls are faster with a transposed copy of each matrix
    (LlamaModel.add_gemv_copies)."""

    name: str
    summary: str
    weights: tuple[WeightKind, ...]
    paths: tuple[KernelPath, ...]
    invariance: str
    fidelity: Fidelity
    backend: str
    matrix: Matrix | None = None
    ends: Ends | None = None
    requires: tuple[Requirement, ...] = ()
    faster_with: tuple[str, ...] = ()
    rows_independent: bool = True
    reference_weights: bool = False
    gemv_copy: bool = False
    gguf_mode: str | None = None  # built straight from a GGUF's blocks, in this arithmetic

    @property
    def row_invariant(self) -> bool:
        """Whether one of its kernel paths gives a position the same logits bit for bit
        whatever else is scored with it: then it may be a target of speculation (measured
        at load all the same: models.invariance)."""
        return any(path.row_invariant for path in self.paths)

    @property
    def reference(self) -> bool:
        return self.fidelity == "reference"

    @property
    def bytes_per_weight(self) -> tuple[float, float]:
        """The fewest and most bytes per parameter its weight kinds take."""
        sizes = [w.bytes_per_weight for w in self.weights]
        return min(sizes), max(sizes)

    def missing(self) -> str | None:
        """Why this PyTorch build and CPU cannot run it (None: they can)."""
        return next((why for why in (r.missing() for r in self.requires) if why is not None),
                    None)


NATIVE = "native"  # the backend that builds these precisions (models.backends)

PRECISIONS: tuple[Precision, ...] = (
    Precision(
        "fp32", "fp32 weights: the reference", (F32,), (ROW_INVARIANT, TORCH_DENSE),
        _INVARIANT_KERNELS, "reference", NATIVE, gemv_copy=True),
    Precision(
        "checkpoint", "every matrix in the smallest panels holding the checkpoint's weights bit "
                      "for bit (a GGUF's own blocks, else fp32), inputs not rounded",
        (GGUF_BLOCKS, Q4_1, I8_GROUP, F32), (ROW_INVARIANT,), _INVARIANT_KERNELS, "checkpoint",
        NATIVE, lambda w, b, exact: _linears().checkpoint_matrix(w, b, exact),
        lambda *ends: _linears().checkpoint_ends(*ends), (ROW_INVARIANT_KERNELS,),
        reference_weights=True, gguf_mode="fp"),
    Precision(
        "checkpoint-a8", "the checkpoint's weights bit for bit as in checkpoint; each row's "
                         "activations rounded to int8 per block of 32 inputs (256 for K-quant "
                         "matrices) before exact "
                         "integer dot products (VNNI where the CPU has it): llama.cpp's CPU "
                         "arithmetic, and the cheapest width",
        (GGUF_BLOCKS, Q4_1, I8_GROUP, F32), (ROW_INVARIANT,),
        _INVARIANT_KERNELS + "; a row's activations are rounded with scales of its own, and "
        "integer sums are exact in any order", "quantized", NATIVE,
        lambda w, b, exact: _linears().a8_matrix(w, b, exact),
        lambda *ends: _linears().a8_ends(*ends), (ROW_INVARIANT_KERNELS,),
        faster_with=("avx512_vnni",), reference_weights=True, gguf_mode="a8"),
    Precision(
        "bf16", "weights rounded to bf16, fp32 activations and accumulation", (BF16,),
        (ROW_INVARIANT, TORCH_FP16), _INVARIANT_KERNELS, "rounded", NATIVE,
        lambda w, b, exact: _linears().Fp16Linear(w, b, exact),
        lambda *ends: _linears().bf16_ends(*ends), (FBGEMM_FP16,), faster_with=("avx512_bf16",)),
    Precision(
        "int8", "int8 weights per output channel, each call's activations quantized with one "
                "scale (7-bit on AVX2); a plain-decoding target and a drafter",
        (I8_ROW,), (TORCH_INT8_DYNAMIC,),
        "its kernels quantize each call's activations with one scale, so a position scored "
        "with draft tokens gets different logits than scored alone", "quantized", NATIVE,
        lambda w, b, exact: _linears().Int8DynamicLinear(w, b, exact),
        lambda *ends: _linears().int8_ends(*ends), (FBGEMM_INT8,), faster_with=("avx512_vnni",),
        rows_independent=False),
    Precision(
        "w8a16", "int8 weights per output channel (bf16 scale), activations rounded to bf16",
        (I8_ROW, I8_GROUP, BF16), (ROW_INVARIANT, TORCH_W8), _INVARIANT_KERNELS, "rounded",
        NATIVE, lambda w, b, exact: _linears().W8A16Linear(w, b, exact),
        lambda *ends: _linears().weight_only_ends(*ends), (INT8PACK, BF16_HEAD),
        faster_with=("avx512_bf16",)),
    Precision(
        "w4a16", "4-bit weights per group of 32 inputs (a GGUF's Q4_1 blocks kept where the "
                 "kernels build), activations rounded to bf16",
        (I4_GROUP, Q4_1, I8_GROUP, BF16), (ROW_INVARIANT, TORCH_W4), _INVARIANT_KERNELS,
        "rounded", NATIVE, lambda w, b, exact: _linears().W4A16Linear(w, b, exact),
        lambda *ends: _linears().weight_only_ends(*ends), (INT4PACK, BF16_HEAD),
        faster_with=("avx512_bf16",)),
    Precision(
        "gguf", "the GGUF's own quantization, run by llama.cpp", (GGUF,), (GGML,),
        "llama.cpp computes each row alone where its tiled GEMMs are off; measured at load",
        "checkpoint", "llama.cpp"),
)
REFERENCE = next(p for p in PRECISIONS if p.reference)


def of_backend(backend: str) -> tuple[Precision, ...]:
    """The precisions `backend` runs, in the order of PRECISIONS."""
    return tuple(p for p in PRECISIONS if p.backend == backend)


def native_names() -> tuple[str, ...]:
    """The precisions the native runner builds, in the order of PRECISIONS."""
    return tuple(p.name for p in of_backend(NATIVE))


def choices() -> tuple[str, ...]:
    """What --precision and specdecode.load take for the native runner."""
    return (AUTO, *native_names())


def find(name: str) -> Precision | None:
    """The record named `name`, or None. (Every lookup reads PRECISIONS when it runs: a record
    added there is known everywhere.)"""
    return next((p for p in PRECISIONS if p.name == name), None)


def get(name: str) -> Precision:
    """The record of `name`; SpecDecodeError naming it and the choices where there is none."""
    found = find(name)
    if found is None:
        raise SpecDecodeError(f"unknown precision '{name}' (supported: {', '.join(choices())})")
    return found


def check_choice(name: str) -> None:
    """Refuse a --precision value that is neither "auto" nor a native precision."""
    if name not in choices():
        raise SpecDecodeError(f"unknown precision '{name}' (supported: {', '.join(choices())})")


def coupling(name: str) -> str | None:
    """Why a target at `name` cannot speculate by construction (its rows are coupled: no kernel
    path of it is row-invariant), or None ("auto", or a precision that may: its loaded target is
    measured)."""
    found = find(name)
    return None if found is None or found.row_invariant else found.invariance


def speculative_names() -> tuple[str, ...]:
    """The native precisions a target of speculation can run at (error messages list them)."""
    return tuple(p.name for p in of_backend(NATIVE) if p.row_invariant)


def is_auto(name: str) -> bool:
    """Whether --precision `name` leaves the choice to the backend (models.backends)."""
    return name == AUTO


def is_reference(name: str) -> bool:
    """Whether `name` is the reference precision (what fidelity is measured against)."""
    return name == REFERENCE.name


def check_supported(precision: str) -> None:
    """Raise SpecDecodeError unless this PyTorch build and CPU can run `precision`."""
    why = get(precision).missing()
    if why is None:
        return
    import torch

    works = [p.name for p in of_backend(NATIVE) if p.name != precision and p.missing() is None]
    raise SpecDecodeError(
        f"precision {precision} is not supported on this CPU/build ({cpu_name()}, PyTorch "
        f"{torch.__version__}): {why}; precisions that work here: {', '.join(works)}"
    )


NATIVE_DEFAULT = "checkpoint"  # "auto" on the native runner where the row-invariant kernels build


def native_default() -> str:
    """What "auto" means on the native runner: checkpoint where the row-invariant kernels build
    (fp32's weights bit for bit, its own arithmetic: agreement with fp32 measured, not assumed;
    a fifth of fp32's weight bytes, a fraction of its step), else the reference."""
    return NATIVE_DEFAULT if _kernels().available() else REFERENCE.name


DRAFT_DEFAULT = "checkpoint-a8"  # a native draft model's precision where the kernels build


def draft_default() -> str:
    """The precision a separate draft model loads at on the native runner: the cheapest step
    that holds its checkpoint's weights (int8 activations: a draft's exactness is irrelevant,
    the target verifies every token), else what "auto" means."""
    return DRAFT_DEFAULT if _kernels().available() else native_default()


def resolve(precision: str, native: bool) -> str:
    """The precision `precision` names: "auto" is native_default() on the native runner, else
    the reference; any other name is itself."""
    if not is_auto(precision):
        return precision
    return native_default() if native else REFERENCE.name


def apply_precision(model: Any, precision: str) -> Any:
    """The model at `precision` ("auto" on the native runner: native_default(); elsewhere the
    reference): the reference returns `model` itself; the others a new model sharing the
    non-matrix tensors (norms) with `model`, which is left unchanged."""
    check_choice(precision)
    native = getattr(model, "backend", "") == NATIVE
    record = get(resolve(precision, native))
    if record.reference:
        return model
    if not native:
        raise SpecDecodeError(f"precision {record.name} is not available on the {model.backend} "
                              f"backend (it supports: {REFERENCE.name})")
    check_supported(record.name)
    return model.with_precision(record.name)


def copy_at(model: Any, precision: str) -> Any:
    """A native `model` at `precision` for drafting: `model` itself where it already runs at it
    (held once: re-quantizing de-quantized weights need not give back the same codes), else
    apply_precision's copy."""
    return model if get(model.precision) is get(precision) else apply_precision(model, precision)


def quantize_int8(model: Any) -> Any:
    """The int8 copy of a native model (per-channel int8 weights, dynamic activations)."""
    return apply_precision(model, "int8")
