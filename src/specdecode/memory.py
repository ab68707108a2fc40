"""Memory accounting shared by the benchmark report and the server's /metrics: weight bytes
of a module (packed weights included, shared tensors counted once; a drafter's through
Drafter.weights) and this process's peak resident memory."""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdecode.models.target import Target


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor of a module's state, packed (int8) weights unpacked, and every buffer, also
    those left out of the state (derived copies such as the runner's gemv copies)."""
    out: list[torch.Tensor] = []
    for value in module.state_dict().values():
        items = value if isinstance(value, tuple) else (value,)
        out += [t for t in items if isinstance(t, torch.Tensor)]
    return out + list(module.buffers())


def _pointer(t: torch.Tensor) -> int:
    return id(t) if t.is_quantized else t.data_ptr()  # unpacked copies: one each


def weight_bytes(module: torch.nn.Module | Target, shared: torch.nn.Module | Target | None = None
                 ) -> int:
    """Bytes of a module's distinct weights, leaving out what it shares with `shared` (e.g. a
    drafter's model that reuses the target's tensors or blocks).

    Packed weights count too: those a state dict unpacks (torch.ao dynamic quantization) and
    those of submodules that state their size as an integer `nbytes` (models.precision).
    """
    if not isinstance(module, torch.nn.Module):  # a runner that counts its own (llama.cpp)
        return int(module.weight_bytes())
    seen: set[int] = set()
    skip: set[int] = set()
    if isinstance(shared, torch.nn.Module):
        seen = {t.data_ptr() for t in _tensors(shared) if not t.is_quantized}
        skip = {id(m) for m in shared.modules()}
    total = 0
    for t in _tensors(module):
        if _pointer(t) not in seen:
            seen.add(_pointer(t))
            total += t.numel() * t.element_size()
    for sub in module.modules():
        packed = getattr(sub, "nbytes", None)
        if id(sub) not in skip and isinstance(packed, int) and not isinstance(packed, bool):
            total += packed
    return total


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
