"""Target precisions of the native runner: fp32 (the reference), bf16, int8, w8a16 and w4a16.

Each precision is a different target: losslessness is always relative to the model as it runs.
Only the weight matrices change; embeddings are looked up in the same precision as the LM head,
and everything else (activations, RMSNorm, RoPE, softmax, the KV cache) stays fp32.

- fp32: MKL sgemm on fp32 weights.
- bf16: weights rounded to bf16. This CPU class (AVX2, no AVX512-BF16) runs bf16 x bf16 GEMMs
  slowly (oneDNN converts on every call), so on PyTorch's kernels the bf16-rounded
  weights are held in fbgemm's packed fp16 format and multiplied with fp32 activations and fp32
  accumulation. Every bf16 value with 2^-14 <= |w| <= 65504 is exact in fp16; smaller magnitudes
  become fp16 subnormals (absolute error <= 2^-25, far below bf16's own rounding of any weight
  that matters); larger ones are refused.
- int8: symmetric per-output-channel int8 weights, activations quantized dynamically per call
  (per tensor, 7-bit range on AVX2 so that u8 x s8 pair sums cannot saturate), fbgemm kernels.
  The flattest cost in the number of scored rows, but the least faithful, and
  NOT batch invariant: one activation scale covers every row of a call, so a position scored
  together with drafts gets slightly different logits than the same position scored alone.
- w8a16 / w4a16: weight-only quantization. Weights int8 per output channel (w8a16) or 4-bit
  per group of 32 inputs with a scale and an offset (w4a16, the granularity of the GGUF's Q4_1
  blocks); each call rounds its activations to bf16, multiplies with PyTorch's weight-only
  CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`: bf16 products, fp32
  accumulation) and returns fp32. Unlike int8's, these products are row-invariant: an output
  row depends on its own input row only, bit for bit (checked for 1-300 rows and 1 or 2
  threads). On PyTorch's kernels the LM head and the embedding are bf16 as in the bf16
  precision (fp32 logits: a bf16-output head rounds them to 8 significant bits, making exact
  ties between top tokens common). On the row-invariant kernels the head is int8 per group of
  32 inputs with an fp32 scale (GroupedInt8Linear: the layout of GGUF's Q8_0 blocks, in which
  SmolLM2's tied table is stored, so it is reproduced exactly) and the tied embedding reads its
  rows: half a bf16 head's bytes per step, and closer to the checkpoint.

Batch invariance: on the row-invariant kernels (models.kernels; the default where they build)
fp32, bf16, w8a16 and w4a16 give a position the same logits bit for bit whatever else is
scored with it; the weight-only layers then hold their codes in the kernels' panels (fp32
sums of the bf16-rounded inputs, fp32 outputs) instead of PyTorch's kernels. int8's shared
activation scale makes it row-coupled by construction: speculation on it is refused
(drafters.registry.check_batch_invariant). On PyTorch's kernels no precision is exact:
attention and the fp32 / fp16 GEMMs pick kernels by shape (~1e-4 of a logit on SmolLM2 at
fp32), and bf16 rounding at w8a16 / w4a16 amplifies that to ~1e-1.

The fbgemm operators used here are the ones behind torch.ao dynamic quantization (deprecated
in PyTorch 2.10+, present through 2.14); a build without them gets a SpecDecodeError naming
the precision, the CPU and the precisions that work.
"""

from __future__ import annotations

import platform
from typing import Any

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.models.linears import GROUP

PRECISIONS = ("fp32", "checkpoint", "bf16", "int8", "w8a16", "w4a16")
# The front ends' default: "checkpoint" on the native runner where the row-invariant kernels
# build (the checkpoint's own weights, bit for bit, at the speed of its quantization: on
# SmolLM2's Q4_1 GGUF top-1 agreement with fp32 1.0 at a w4a16 step's cost and a tenth of the
# memory), else fp32; the llama.cpp backend's own ("gguf").
AUTO = "auto"
CHOICES = (AUTO, *PRECISIONS)
WEIGHT_ONLY = ("w8a16", "w4a16")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def quantized_engines() -> list[str]:
    return list(torch.backends.quantized.supported_engines)


def weight_only_kernels() -> list[str]:
    """The weight-only kernels this build has and can run (a tiny product each)."""
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


def _missing(precision: str) -> str | None:
    """Why this build and CPU cannot run `precision`, or None if they can."""
    if precision == "checkpoint":
        error = kernels.build_error()
        return None if error is None else f"it needs the row-invariant kernels ({error})"
    if precision in WEIGHT_ONLY:
        need = "_weight_int8pack_mm" if precision == "w8a16" else "_weight_int4pack_mm_for_cpu"
        if need not in weight_only_kernels():
            return (f"it needs PyTorch's weight-only CPU kernel {need}, which this build lacks "
                    "or cannot run")
        head = _missing("bf16")
        return None if head is None else f"its bf16 LM head: {head}"
    if precision == "fp32":
        return None
    engines = quantized_engines()
    has_fbgemm = "fbgemm" in engines or "x86" in engines
    ops = ("linear_prepack_fp16", "linear_dynamic_fp16") if precision == "bf16" else (
        "linear_prepack", "linear_dynamic")
    has_ops = all(hasattr(torch.ops.quantized, op) for op in ops)
    if has_fbgemm and has_ops:
        return None
    return (f"it needs the fbgemm (x86) kernels, and this build has quantized engines "
            f"{engines}{'' if has_ops else ' without the fbgemm linear operators'}")


def check_supported(precision: str) -> None:
    """Raise SpecDecodeError unless this PyTorch build and CPU can run `precision`."""
    why = _missing(precision)
    if why is None:
        return
    works = [p for p in PRECISIONS if p != precision and _missing(p) is None]
    raise SpecDecodeError(
        f"precision {precision} is not supported on this CPU/build ({cpu_name()}, PyTorch "
        f"{torch.__version__}): {why}; precisions that work here: {', '.join(works)}"
    )


def resolve(precision: str, native: bool) -> str:
    """The precision `precision` names: "auto" is checkpoint on the native runner where the
    row-invariant kernels build (fp32's logits at a tenth of its memory and a fraction of its
    step), else fp32; any other name is itself."""
    if precision != AUTO:
        return precision
    return "checkpoint" if native and kernels.available() else "fp32"


def apply_precision(model: Any, precision: str) -> Any:
    """The model at `precision`: fp32 returns `model` itself; the others return a new model
    sharing the non-matrix tensors (norms) with `model`, which is left unchanged."""
    if precision not in CHOICES:
        raise SpecDecodeError(
            f"unknown precision '{precision}' (supported: {', '.join(CHOICES)})"
        )
    precision = resolve(precision, getattr(model, "backend", "") == "native")
    if precision == "fp32":
        return model
    if getattr(model, "backend", "") != "native":
        raise SpecDecodeError(
            f"precision {precision} is not available on the {model.backend} backend "
            "(it supports: fp32)"
        )
    check_supported(precision)
    return model.with_precision(precision)


def quantize_int8(model: Any) -> Any:
    """The int8 copy of a native model (per-channel int8 weights, dynamic activations)."""
    return apply_precision(model, "int8")
