"""Target precisions of the native runner: fp32 (the reference), bf16 and int8.

Each precision is a different target: losslessness is always relative to the model as it runs.
Only the weight matrices change; embeddings are looked up in the same precision as the LM head,
and everything else (activations, RMSNorm, RoPE, softmax, the KV cache) stays fp32.

- fp32: MKL sgemm on fp32 weights.
- bf16: weights rounded to bf16. This CPU class (AVX2, no AVX512-BF16) runs bf16 x bf16 GEMMs
  slowly (oneDNN converts on every call: 2.5x slower than fp32 at 16 rows), so the bf16-rounded
  weights are held in fbgemm's packed fp16 format and multiplied with fp32 activations and fp32
  accumulation. Every bf16 value with 2^-14 <= |w| <= 65504 is exact in fp16; smaller magnitudes
  become fp16 subnormals (absolute error <= 2^-25, far below bf16's own rounding of any weight
  that matters); larger ones are refused.
- int8: symmetric per-output-channel int8 weights, activations quantized dynamically per call
  (per tensor, 7-bit range on AVX2 so that u8 x s8 pair sums cannot saturate), fbgemm kernels.
  Fastest here and the flattest cost in the number of scored rows, but the least faithful, and
  NOT batch invariant: one activation scale covers every row of a call, so a position scored
  together with drafts gets slightly different logits than the same position scored alone.

The fbgemm operators used here are the ones behind torch.ao dynamic quantization (deprecated
in PyTorch 2.10+, present through 2.14); a build without them gets a SpecDecodeError naming
the precision, the CPU and the precisions that work.
"""

from __future__ import annotations

import platform
import warnings
from typing import Any

import torch
from torch import nn

from specdecode.errors import SpecDecodeError

PRECISIONS = ("fp32", "bf16", "int8")
FP16_MAX = 65504.0


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in fbgemm's packed format (bf16-valued fp16, or int8)."""

    def __init__(self, kind: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.kind = kind
        self.out_features, self.in_features = weight.shape
        self.has_bias = bias is not None
        b = None if bias is None else bias.detach().float().contiguous()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized-tensor creation is deprecated
            self.packed, self.nbytes = _pack(kind, weight.detach().float(), b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "bf16":
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)  # 7-bit activations

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}"


def _pack(kind: str, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, int]:
    if kind == "bf16":
        big = float(w.abs().max()) if w.numel() else 0.0
        if big > FP16_MAX:
            raise SpecDecodeError(
                f"precision bf16: a weight of magnitude {big:g} exceeds the fp16 range the bf16 "
                "kernels of this runner hold weights in; use fp32"
            )
        packed = torch.ops.quantized.linear_prepack_fp16(w.to(torch.bfloat16).float(), bias)
        return packed, w.numel() * 2
    q, scales = quantize_rows(w)
    zeros = torch.zeros(len(scales), dtype=torch.long)
    qw = torch._make_per_channel_quantized_tensor(q, scales.double(), zeros, 0)
    return torch.ops.quantized.linear_prepack(qw, bias), w.numel() + 4 * len(scales)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 (rows, cols), scales fp32 (rows,)), w ~= q * scale."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales.float()


def float_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight fp32, bias or None) of a linear or embedding module at any precision."""
    if isinstance(module, PackedLinear):
        if module.kind == "bf16":
            w, b = torch.ops.quantized.linear_unpack_fp16(module.packed)
            return w.float(), b
        w, b = torch.ops.quantized.linear_unpack(module.packed)
        return w.dequantize(), b
    if isinstance(module, Int8Embedding):
        return module.q.float() * module.scales[:, None], None
    if isinstance(module, nn.Linear):
        return module.weight.detach().float(), None if module.bias is None else module.bias.detach()
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"no weight tensor in {type(module).__name__}")
    return weight.detach().float(), None


class Int8Embedding(nn.Module):
    """Embedding rows stored as int8 with one scale per row (the int8 LM head's quantization)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scales = quantize_rows(weight.detach().float())
        self.q: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.q[tokens].float() * self.scales[tokens, None]


class Bf16Embedding(nn.Module):
    """Embedding rows stored in bf16 (looked up in fp32)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight: torch.Tensor
        self.register_buffer("weight", weight.detach().to(torch.bfloat16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens].float()


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


def check_supported(precision: str) -> None:
    """Raise SpecDecodeError unless this PyTorch build and CPU can run `precision`."""
    if precision == "fp32":
        return
    engines = quantized_engines()
    has_fbgemm = "fbgemm" in engines or "x86" in engines
    ops = ("linear_prepack_fp16", "linear_dynamic_fp16") if precision == "bf16" else (
        "linear_prepack", "linear_dynamic")
    has_ops = all(hasattr(torch.ops.quantized, op) for op in ops)
    if has_fbgemm and has_ops:
        return
    works = ["fp32"] + [p for p in ("bf16", "int8") if p != precision and has_fbgemm]
    raise SpecDecodeError(
        f"precision {precision} is not supported on this CPU/build ({cpu_name()}, PyTorch "
        f"{torch.__version__}): it needs the fbgemm (x86) kernels, and this build has quantized "
        f"engines {engines}{'' if has_ops else ' without the fbgemm linear operators'}; "
        f"precisions that work here: {', '.join(works)}"
    )


def apply_precision(model: Any, precision: str) -> Any:
    """The model at `precision`: fp32 returns `model` itself; bf16 and int8 return a new model
    sharing the non-matrix tensors (norms) with `model`, which is left unchanged."""
    if precision not in PRECISIONS:
        raise SpecDecodeError(
            f"unknown precision '{precision}' (supported: {', '.join(PRECISIONS)})"
        )
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
