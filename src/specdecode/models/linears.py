"""The weight matrices and embeddings of the native runner's precisions (models.precision holds
one record per precision naming which of these it builds), and the quantizers that fill them.

Every class here multiplies y = x W^T + b for one way of holding W; which precision uses which,
and what each costs and guarantees, is the precision's record, not this module's business.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models import kernels

GROUP = 32  # inputs per 4-bit group (w4a16)
FP16_MAX = 65504.0


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in one of fbgemm's packed formats (Fp16Linear: bf16-valued
    fp16; Int8DynamicLinear: int8 with dynamically quantized activations). Each subclass says
    how it packs, multiplies and unpacks; none compares a precision's name."""

    kind = ""  # the precision whose weights it holds (for extra_repr)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 exact: bool = False) -> None:
        """`exact` is taken for the signature every precision's matrix shares and left to
        `set_exact`, which the model calls on every matrix once it is built."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.has_bias = bias is not None
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        self.panels: kernels.Panels | None = None  # set by a subclass with a row-invariant path
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized-tensor creation is deprecated
            self.packed, self.nbytes = self._pack(weight.detach().float(), self.bias_f32)

    def _pack(self, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, int]:
        raise NotImplementedError

    def set_exact(self, exact: bool) -> None:
        """Move to the row-invariant kernels where this format has them (none by default)."""

    def exact_panels(self) -> kernels.Panels | None:
        return self.panels

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight fp32, bias or None) as the kernels multiply with it."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}"


class Fp16Linear(PackedLinear):
    """bf16-rounded weights held in fbgemm's packed fp16 format, multiplied with fp32
    activations and accumulation; once `set_exact`, in the row-invariant kernels' bf16 panels
    (models.kernels) instead: fbgemm's fp16 kernels take another path for one row than for
    several, so a row's outputs move in the last bits with the rows beside it."""

    kind = "bf16"

    def _pack(self, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, int]:
        big = float(w.abs().max()) if w.numel() else 0.0
        if big > FP16_MAX:
            raise SpecDecodeError(
                f"precision bf16: a weight of magnitude {big:g} exceeds the fp16 range the bf16 "
                "kernels of this runner hold weights in; use fp32"
            )
        packed = torch.ops.quantized.linear_prepack_fp16(w.to(torch.bfloat16).float(), bias)
        return packed, w.numel() * 2

    def set_exact(self, exact: bool) -> None:
        """Hold the weight as the row-invariant kernels' panels (exact) or as fbgemm's packed
        fp16 (not)."""
        if exact == (self.panels is not None):
            return
        w, b = self.unpacked()
        if exact:
            self.panels = kernels.pack_float(w, torch.bfloat16, b)
            self.packed, self.nbytes = None, self.panels.nbytes
        else:
            self.panels = None
            self.packed, self.nbytes = self._pack(w, b)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.panels is not None:
            return kernels.weight_of(self.panels), self.bias_f32
        w, b = torch.ops.quantized.linear_unpack_fp16(self.packed)
        return w.float(), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return kernels.matmul(x, self.panels)
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


class Int8DynamicLinear(PackedLinear):
    """Symmetric per-output-channel int8 weights; each call quantizes its activations with one
    scale (fbgemm's linear_dynamic, 7-bit on AVX2). No row-invariant kernel exists for it: the
    shared activation scale couples the rows of a call by construction."""

    kind = "int8"

    def _pack(self, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, int]:
        q, scales = quantize_rows(w)
        zeros = torch.zeros(len(scales), dtype=torch.long)
        qw = torch._make_per_channel_quantized_tensor(q, scales.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(qw, bias), w.numel() + 4 * len(scales)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, b = torch.ops.quantized.linear_unpack(self.packed)
        return w.dequantize(), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)  # 7-bit activations


def quantize_rows(
    w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 (rows, cols), scales (rows,) in `scale_dtype`),
    w ~= q * scale, q rounded on the grid of the scale as stored."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_groups(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of `group` inputs, in the weight-only kernel's convention
    w ~= (q - 8) * scale + zero: (q int32 (rows, cols) in 0..15, scale_zeros bf16
    (cols / group, rows, 2)). Scale (max - min) / 15 and zero min + 8 scale are rounded to bf16
    first and q rounded on that grid; a constant group gets scale 0 and zero = its value."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).bfloat16()
    zero = (lo + 8 * scale.float()).bfloat16()
    s = scale.float()[..., None]
    q = torch.where(s > 0, torch.round((g - zero.float()[..., None]) / s.clamp_min(1e-30)) + 8,
                    torch.full_like(g, 8.0))
    q = q.clamp_(0, 15).to(torch.int32).reshape(rows, cols)
    return q, torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()


def recover_q4_1(w: torch.Tensor, group: int = GROUP
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The 4-bit blocks a matrix was de-quantized from, if it was: GGUF's Q4_1 stores per group
    of 32 inputs an fp16 scale d and minimum m, w = code * d + m (computed in fp32), the smallest
    weight of a group with code 0 and the largest with code 15. Returns (codes (rows, cols) 0..15,
    d, m (rows, cols / group) fp32) when every weight comes back bit for bit, else None."""
    rows, cols = w.shape
    if cols % group:
        return None
    g = w.reshape(rows, cols // group, group)
    m = g.amin(dim=-1)
    d = ((g.amax(dim=-1) - m) / 15).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round((g - m[..., None]) / safe[..., None]).clamp_(0, 15)
    if not torch.equal(codes * d[..., None] + m[..., None], g):
        return None
    return codes.to(torch.uint8).reshape(rows, cols), d, m


class WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W held as integer codes and scales (W8A16Linear: int8 per output
    channel; W4A16Linear: 4 bits per group of 32 inputs); x is rounded to bf16 for the product,
    y is fp32. Row-invariant.

    Two kernels hold the same codes and scales: PyTorch's weight-only CPU kernels (bf16 products
    and outputs) and, once `set_exact`, the row-invariant kernels' panels (models.kernels: fp32
    products of the bf16-rounded inputs, fp32 outputs, a whole block per call). Either converts
    to the other exactly; each subclass says how its codes travel between them."""

    kind = ""  # the precision whose weights it holds (for extra_repr)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 exact: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.q: torch.Tensor | None  # int8 (out, in), or the 4-bit kernel's packed layout
        self.scales: torch.Tensor | None  # bf16 (out,), or scale/zero pairs (in / 32, out, 2)
        self.panels: kernels.Panels | None = self._exact_at_build(w) if exact else None
        if self.panels is not None:
            self.register_buffer("q", None)
            self.register_buffer("scales", None)
            return
        q, scales = self._quantize(w)
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)

    def _exact_at_build(self, w: torch.Tensor) -> kernels.Panels | None:
        """Panels holding `w` exactly where this format can (None: quantize it)."""
        return None

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scales) in PyTorch's weight-only kernel's layout."""
        raise NotImplementedError

    def _codes_of_panels(self, p: kernels.Panels) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _torch_codes(self, q: torch.Tensor, scales: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _pack_exact(self, codes: torch.Tensor, scales: torch.Tensor) -> kernels.Panels:
        raise NotImplementedError

    def _to_torch(self, codes: torch.Tensor, scales: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _product(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _weight(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the panels (memory.weight_bytes adds them: they are not buffers)."""
        return 0 if self.panels is None else self.panels.nbytes

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes (out, in), scales) in PyTorch's convention, whichever kernel holds them."""
        if self.panels is not None:
            return self._codes_of_panels(self.panels)
        assert self.q is not None and self.scales is not None
        return self._torch_codes(self.q, self.scales)

    def set_exact(self, exact: bool) -> None:
        """Move the codes to the row-invariant kernels' panels (exact) or back to PyTorch's
        weight-only kernels; the codes and scales are the same either way."""
        if exact == (self.panels is not None):
            return
        codes, scales = self._codes()
        if exact:
            self.panels = self._pack_exact(codes, scales)
            self.q = self.scales = None
        else:
            self.panels = None
            self.q, self.scales = self._to_torch(codes, scales)

    def exact_panels(self) -> kernels.Panels | None:
        return self.panels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return kernels.matmul(x, self.panels)
        assert self.q is not None and self.scales is not None
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = self._product(rows, self.q, self.scales).float()
        y = y if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight as the kernels use it, fp32 (out, in)."""
        if self.panels is not None:
            return kernels.weight_of(self.panels)
        return self._weight(*self._codes())

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}"


class W8A16Linear(WeightOnlyLinear):
    """int8 codes per output channel with a bf16 scale: w = code * scale."""

    kind = "w8a16"

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows(w, torch.bfloat16)

    def _codes_of_panels(self, p: kernels.Panels) -> tuple[torch.Tensor, torch.Tensor]:
        assert p.scale is not None
        return kernels.codes_of(p), p.scale[: p.n].bfloat16()

    def _torch_codes(self, q: torch.Tensor, scales: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, scales

    def _pack_exact(self, codes: torch.Tensor, scales: torch.Tensor) -> kernels.Panels:
        return kernels.pack_int8(codes, scales.float(), self.bias)

    def _to_torch(self, codes: torch.Tensor, scales: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return codes.to(torch.int8), scales

    def _product(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, q, scales)

    def _weight(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return codes.float() * scales.float()[:, None]


class W4A16Linear(WeightOnlyLinear):
    """4-bit codes per group of 32 inputs with a bf16 scale and offset: w = (code - 8) * scale
    + zero. On the row-invariant kernels a matrix de-quantized from GGUF Q4_1 blocks keeps its
    own blocks (fp16 d and m held fp32) instead of being quantized again."""

    kind = "w4a16"

    def _exact_at_build(self, w: torch.Tensor) -> kernels.Panels | None:
        blocks = recover_q4_1(w)  # the checkpoint's own 4-bit blocks: held exactly
        return None if blocks is None else kernels.pack_int4(*blocks, self.bias)

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_features % GROUP or self.out_features % 16:
            raise SpecDecodeError(
                f"precision w4a16 needs weight matrices with inputs divisible by {GROUP} and "
                f"outputs by 16; this model has one of {self.out_features} x "
                f"{self.in_features}: use w8a16")
        q4, scales = quantize_groups(w)
        return torch._convert_weight_to_int4pack_for_cpu(q4, 1), scales

    def _codes_of_panels(self, p: kernels.Panels) -> tuple[torch.Tensor, torch.Tensor]:
        assert p.scale is not None and p.zero is not None
        scale = p.scale.transpose(1, 2).reshape(-1, p.k // GROUP)[: p.n]
        zero = p.zero.transpose(1, 2).reshape(-1, p.k // GROUP)[: p.n] + 8 * scale
        return kernels.codes_of(p), torch.stack((scale, zero), dim=-1).transpose(0, 1).bfloat16()

    def _torch_codes(self, q: torch.Tensor, scales: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        unit = torch.ones_like(scales)
        unit[..., 1] = 8
        codes = torch._weight_int4pack_mm_for_cpu(eye, q, GROUP, unit).float().t()  # (out, in)
        return codes.round().to(torch.int32), scales

    def _pack_exact(self, codes: torch.Tensor, scales: torch.Tensor) -> kernels.Panels:
        # kernels.c computes codes * scale + (zero - 8 scale)
        scale, zero = scales[..., 0].float().t(), scales[..., 1].float().t()
        return kernels.pack_int4(codes, scale, zero - 8 * scale, self.bias)

    def _to_torch(self, codes: torch.Tensor, scales: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1), \
            scales.contiguous()

    def _product(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, q, GROUP, scales)

    def _weight(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        scale, zero = (scales[..., i].float().t().repeat_interleave(GROUP, dim=1)
                       for i in (0, 1))
        return (codes.float() - 8) * scale + zero


def quantize_row_groups(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row and group of `group` inputs: (codes int8 (rows, cols),
    scales fp32 (rows, cols / group)), w ~= codes * scale, scale = max |w| / 127 of the group.
    A matrix de-quantized from GGUF's Q8_0 blocks (w = code * d, the largest |code| 127) comes
    back exactly: its d = max |w| / 127, a division without rounding."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    scales = g.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(g / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(rows, cols), scales


class PanelLinear(nn.Module):
    """y = x W^T + b with W held only in the row-invariant kernels' panels (models.kernels: fp32,
    int8 per group or 4-bit per group); without the kernels, the same weight through PyTorch."""

    def __init__(self, panels: kernels.Panels) -> None:
        super().__init__()
        self.panels = panels
        self.out_features, self.in_features = panels.n, panels.k
        self.nbytes = panels.nbytes
        self.exact = True
        self._dense: torch.Tensor | None = None

    def set_exact(self, exact: bool) -> None:
        self.exact = exact

    def exact_panels(self) -> kernels.Panels | None:
        return self.panels if self.exact else None

    def dequantized(self) -> torch.Tensor:
        return kernels.weight_of(self.panels)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of the weight for `tokens` (an embedding lookup of a tied table), fp32."""
        flat = tokens.reshape(-1)
        p, c = flat // kernels.PANEL, flat % kernels.PANEL
        values = self.panels.w[p, :, c].float()  # (n, in)
        if self.panels.kind == kernels.KIND_I8G:
            assert self.panels.scale is not None
            values = values * self.panels.scale[p, :, c].repeat_interleave(self.panels.group,
                                                                           dim=1)
            if self.panels.zero is not None:
                values = values + self.panels.zero[p, :, c].repeat_interleave(self.panels.group,
                                                                              dim=1)
        elif self.panels.kind != kernels.KIND_F32:
            raise ValueError("rows() reads fp32 or grouped int8 panels")
        return values.view(*tokens.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact and kernels.available():
            return kernels.matmul(x, self.panels)
        if self._dense is None:
            self._dense = self.dequantized()
        return torch.nn.functional.linear(x.float(), self._dense, self.panels.bias)

    def extra_repr(self) -> str:
        return f"kind {self.panels.kind}, in={self.in_features}, out={self.out_features}"


class GroupedInt8Linear(PanelLinear):
    """The LM head of the weight-only precisions on the row-invariant kernels: int8 per output
    row and group of 32 inputs (GGUF's Q8_0 layout, in which SmolLM2's tied embedding is stored:
    reproduced exactly), fp32 inputs and sums. Against a bf16 head it reads half the bytes per
    step (the head is ~a third of a 4-bit SmolLM2 step's weight traffic) and matches the
    checkpoint closer."""

    def __init__(self, weight: torch.Tensor) -> None:
        codes, scales = quantize_row_groups(weight.detach().float())
        super().__init__(kernels.pack_int8_groups(codes, scales))


def checkpoint_matrix(weight: torch.Tensor, bias: torch.Tensor | None, exact: bool = True
                      ) -> PanelLinear:
    """A matrix of the "checkpoint" precision: the smallest panels that hold `weight` bit for
    bit: the 4-bit blocks it was de-quantized from (GGUF Q4_1), else int8 per group (Q8_0), else
    fp32; inputs are not rounded, so the products differ from fp32's only by summation order.
    (`exact`: the signature every precision's matrix shares; panels are its only layout.)"""
    w = weight.detach().float()
    blocks = recover_q4_1(w)
    if blocks is not None:
        return PanelLinear(kernels.pack_int4(*blocks, bias, round_x=False))
    if w.shape[1] % GROUP == 0:
        codes, scales = quantize_row_groups(w)
        if torch.equal(codes.float() * scales.repeat_interleave(GROUP, dim=1), w):
            return PanelLinear(kernels.pack_int8_groups(codes, scales, bias))
    return PanelLinear(kernels.pack_float(w, torch.float32, bias))


def a8_matrix(weight: torch.Tensor, bias: torch.Tensor | None, exact: bool = True
              ) -> PanelLinear:
    """A matrix of the "checkpoint-a8" precision from its fp32 values: the blocks it was
    de-quantized from (GGUF Q4_1: 4-bit codes with d and m; Q8_0: bytes with d), for integer
    dot products against int8 activations; else fp32 panels (fp32 arithmetic). A GGUF target
    is built from its own blocks instead (models.gguf_blocks), which covers every block type."""
    w = weight.detach().float()
    blocks = recover_q4_1(w) if w.shape[1] % kernels.QBLOCK == 0 else None
    if blocks is not None:
        codes, d, m = blocks
        return PanelLinear(kernels.pack_q4(codes, d, m, bias))
    if w.shape[1] % kernels.QBLOCK == 0:
        codes, scales = quantize_row_groups(w)
        if torch.equal(codes.float() * scales.repeat_interleave(GROUP, dim=1), w):
            return PanelLinear(kernels.pack_q8(codes.to(torch.int16) + 128, scales, None, bias,
                                               offset=128))
    return PanelLinear(kernels.pack_float(w, torch.float32, bias))


def a8_ends(head: torch.Tensor, embed: torch.Tensor, tied: bool, exact: bool
            ) -> tuple[nn.Module, nn.Module]:
    """The head as an a8 matrix; the embedding rows looked up in fp32 (the same values)."""
    return a8_matrix(head, None), nn.Embedding.from_pretrained(embed)


class TiedEmbedding(nn.Module):
    """Embedding rows read from a PanelLinear head (a tied table held once)."""

    def __init__(self, head: PanelLinear) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule, so its bytes are counted once

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head[0].rows(tokens)


def float_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight fp32, bias or None) of a linear or embedding module at any precision."""
    if isinstance(module, PackedLinear):
        return module.unpacked()
    if isinstance(module, WeightOnlyLinear):
        return module.dequantized(), module.bias
    if isinstance(module, PanelLinear):
        return module.dequantized(), module.panels.bias
    if isinstance(module, TiedEmbedding):
        return module.head[0].dequantized(), None
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


# ------------------------------------------------------------------------------------------------
# A precision's matrices and ends (the LM head and the embedding), as its record names them
# (models.precision.Precision.matrix / .ends). `exact`: the model runs on the row-invariant
# kernels; `tied`: the embedding is the head's table.


def checkpoint_ends(head: torch.Tensor, embed: torch.Tensor, tied: bool, exact: bool
                    ) -> tuple[nn.Module, nn.Module]:
    """The head held exactly too, and a tied table held once (read from the head's panels)."""
    lm_head = checkpoint_matrix(head, None)
    readable = lm_head.panels.kind in (kernels.KIND_F32, kernels.KIND_I8G)
    return lm_head, (TiedEmbedding(lm_head) if tied and readable
                     else nn.Embedding.from_pretrained(embed))


def bf16_ends(head: torch.Tensor, embed: torch.Tensor, tied: bool, exact: bool
              ) -> tuple[nn.Module, nn.Module]:
    """bf16 head and embedding (fp32 logits: a bf16-output head would round them to 8
    significant bits, making exact ties between top tokens common)."""
    return Fp16Linear(head, None), Bf16Embedding(embed)


def weight_only_ends(head: torch.Tensor, embed: torch.Tensor, tied: bool, exact: bool
                     ) -> tuple[nn.Module, nn.Module]:
    """On the row-invariant kernels an int8 head per group of 32 inputs (exact for a GGUF's
    Q8_0 table) whose rows a tied embedding reads; elsewhere bf16 ends."""
    if not exact or head.shape[1] % GROUP:
        return bf16_ends(head, embed, tied, exact)
    lm_head = GroupedInt8Linear(head)
    return lm_head, TiedEmbedding(lm_head) if tied else Bf16Embedding(embed)


def int8_ends(head: torch.Tensor, embed: torch.Tensor, tied: bool, exact: bool
              ) -> tuple[nn.Module, nn.Module]:
    """int8 head and embedding, quantized as the int8 matrices are."""
    return Int8DynamicLinear(head, None), Int8Embedding(embed)
