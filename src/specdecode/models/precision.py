"""Target precisions: fp32 (the reference), bf16, and int8 (per-channel dynamic quantization).

Each precision is a different target: losslessness is always relative to the model as it runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from specdecode.errors import SpecDecodeError

PRECISIONS = ("fp32", "bf16", "int8")


def quantize_int8(model: nn.Module) -> nn.Module:
    """int8 weights (per output channel) with activations quantized dynamically per step."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if "x86" not in torch.backends.quantized.supported_engines and (
        "fbgemm" not in torch.backends.quantized.supported_engines
    ):
        raise SpecDecodeError(
            "precision int8 needs PyTorch's x86 quantized engine (fbgemm), which this CPU/build "
            f"lacks (engines: {torch.backends.quantized.supported_engines}); use fp32 or bf16"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, inplace=False)


def apply_precision(model: Any, precision: str) -> Any:
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
    if precision == "bf16":
        return model.to(torch.bfloat16)
    return quantize_int8(model)
