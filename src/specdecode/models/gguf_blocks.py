"""A GGUF's quantized blocks as the row-invariant kernels' panels, bit for bit, never through fp32.

Every block type here stores, per group of 16 or 32 inputs, small integer codes and a scale
(and for some an offset or a minimum) from which ggml computes the weight; `decode` reads those
numbers out of the raw bytes (vectorized, from the file's memory map) into one canonical form:

    w = (code - offset) * scale + zero        code unsigned, scale/zero fp32 per group

where scale and zero are the exact fp32 values ggml multiplies by (an fp16 d, or a K-quant's
d * sub-scale, exact in fp32), so `weight_of` of the panels equals gguf-py's de-quantization of
the file bit for bit (tests/test_gguf_blocks.py checks every type against it, with a broken
variant of the bit layout that the check catches). `panels` then lays the canonical form out
for the precision's arithmetic: "fp" (the checkpoint precision: fp32 activations, 4-bit or
int8 code panels) or "a8" (checkpoint-a8: int8 activations, integer dot products).

Types: F32, F16, BF16 (fp32 panels), Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K. Another
type is a SpecDecodeError naming it, the tensor and what works.

Fused matrices (q|k|v, gate|up) whose parts are stored in different types (a Q4_K_M file keeps
attn_v and some ffn_down in Q6_K) are joined in the widest common form: groups of 16, offsets
moved into the zeros (w = code * scale + (zero - offset * scale), exact), codes of the widest
part's bits (a8: 4-, 5- or 6-bit panels, bytes only for 8-bit codes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models import kernels

TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
QK_K = 256


@dataclass(frozen=True)
class Blocks:
    """A matrix (n outputs, k inputs) as codes and per-group numbers (see the module docstring);
    `codes` None for a float matrix (then `dense` holds it)."""

    n: int
    k: int
    codes: np.ndarray | None  # (n, k) uint8
    scale: np.ndarray | None  # (n, k / group) fp32
    zero: np.ndarray | None  # (n, k / group) fp32, or None
    offset: int
    group: int
    bits: int  # the widest code: 4, 5, 6 or 8
    dense: np.ndarray | None = None  # (n, k) fp32 for F32 / F16 / BF16
    # K-quants: the scales as the file holds them, (d, dmin or None, sc, m or None): d, dmin
    # (n, S) fp32 per super-block of 256, sc, m (n, S, 256 / group) int8 (scale = d * sc)
    kq: tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None] | None = None

    def weight(self) -> np.ndarray:
        """The fp32 weight, computed as ggml does (the tests' reference)."""
        if self.dense is not None:
            return self.dense
        assert self.codes is not None and self.scale is not None
        scale = np.repeat(self.scale, self.group, axis=1)
        w = (self.codes.astype(np.float32) - np.float32(self.offset)) * scale
        if self.zero is not None:
            w = w + np.repeat(self.zero, self.group, axis=1)
        return w.astype(np.float32)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes (little-endian fp16) per value along the last axis -> fp32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per 32-input block: byte j holds input j (low nibble) and j + 16 (high)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """4 bytes per block, bit e (little-endian) the fifth bit of input e: (..., 32) of 0/1."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 12 bytes -> 8 six-bit scales and 8 six-bit minimums."""
    sc = sc.astype(np.uint8)
    low = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    high_s = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    high_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return (np.concatenate([low[0], high_s], axis=-1),
            np.concatenate([low[1], high_m], axis=-1))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes per super-block, in 4 chunks of 32 bytes: a chunk's low nibbles are 32 inputs,
    its high nibbles the next 32."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0xF, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def decode(raw: np.ndarray, type_name: str, n: int, k: int, what: str) -> Blocks:
    """The blocks of one tensor: `raw` (n, bytes per row) uint8 as gguf-py reads it (or (n, k)
    of floats), `what` names the tensor in errors."""
    if type_name not in TYPES:
        raise SpecDecodeError(
            f"{what}: stored as {type_name}, which the exact native path cannot hold (it holds "
            f"{', '.join(TYPES)}); run this file with --backend llama.cpp, or --precision fp32")
    if type_name in ("F32", "F16", "BF16"):
        if type_name == "BF16":
            dense = (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(
                np.float32)
        else:
            dense = np.asarray(raw, dtype=np.float32)
        return Blocks(n, k, None, None, None, 0, 0, 32, dense.reshape(n, k))
    blocks = _split(raw, type_name, n, k)
    return _DECODERS[type_name](blocks, n, k)


_BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
                "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def _split(raw: np.ndarray, type_name: str, n: int, k: int) -> np.ndarray:
    size, nbytes = _BLOCK_BYTES[type_name]
    if k % size:
        raise SpecDecodeError(f"a {type_name} matrix needs inputs in blocks of {size}, got {k}")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // size, nbytes)


def _q4_0(b: np.ndarray, n: int, k: int) -> Blocks:
    d = _f16(b[..., 0:2])
    codes = _nibbles_32(b[..., 2:18]).reshape(n, k)
    return Blocks(n, k, codes, d, None, 8, 32, 4)


def _q4_1(b: np.ndarray, n: int, k: int) -> Blocks:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    codes = _nibbles_32(b[..., 4:20]).reshape(n, k)
    return Blocks(n, k, codes, d, m, 0, 32, 4)


def _q5_0(b: np.ndarray, n: int, k: int) -> Blocks:
    d = _f16(b[..., 0:2])
    codes = (_nibbles_32(b[..., 6:22]) | (_high_bits_32(b[..., 2:6]) << 4)).reshape(n, k)
    return Blocks(n, k, codes, d, None, 16, 32, 5)


def _q5_1(b: np.ndarray, n: int, k: int) -> Blocks:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    codes = (_nibbles_32(b[..., 8:24]) | (_high_bits_32(b[..., 4:8]) << 4)).reshape(n, k)
    return Blocks(n, k, codes, d, m, 0, 32, 5)


def _q8_0(b: np.ndarray, n: int, k: int) -> Blocks:
    d = _f16(b[..., 0:2])
    codes = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, k)
    return Blocks(n, k, codes, d, None, 128, 32, 8)


def _k_minned(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, n: int
              ) -> dict[str, Any]:
    """The per-group scale and zero of a K-quant with minimums, and its file form."""
    return {"scale": (d[..., None] * sc.astype(np.float32)).reshape(n, -1),
            "zero": -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1),
            "kq": (d, dmin, sc.astype(np.int8), mn.astype(np.int8))}


def _q4_k(b: np.ndarray, n: int, k: int) -> Blocks:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    codes = _k_nibbles(b[..., 16:144]).reshape(n, k)
    f = _k_minned(d, dmin, sc, mn, n)
    return Blocks(n, k, codes, f["scale"], f["zero"], 0, 32, 4, kq=f["kq"])


def _q5_k(b: np.ndarray, n: int, k: int) -> Blocks:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]  # bit 2c (first half) and 2c + 1 (second half) of chunk c, per input
    shifts = np.arange(8, dtype=np.uint8)
    high = ((qh[..., None, :] >> shifts[:, None]) & 1).reshape(*qh.shape[:-1], 256)
    codes = (_k_nibbles(b[..., 48:176]) | (high << 4)).reshape(n, k)
    f = _k_minned(d, dmin, sc, mn, n)
    return Blocks(n, k, codes, f["scale"], f["zero"], 0, 32, 5, kq=f["kq"])


def _q6_k(b: np.ndarray, n: int, k: int) -> Blocks:
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    halves = []
    for h in range(2):  # each half of a super-block: 64 bytes of ql, 32 of qh, 128 inputs
        lo, hi = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64]
        top = qh[..., 32 * h:32 * h + 32]
        parts = [(lo & 0xF) | ((top & 3) << 4), (hi & 0xF) | (((top >> 2) & 3) << 4),
                 (lo >> 4) | (((top >> 4) & 3) << 4), (hi >> 4) | (((top >> 6) & 3) << 4)]
        halves.append(np.concatenate(parts, axis=-1))
    codes = np.concatenate(halves, axis=-1).reshape(n, k)
    scale = (d[..., None] * sc).reshape(n, -1)
    kq = (d, None, b[..., 192:208].view(np.int8).copy(), None)
    return Blocks(n, k, codes, scale, None, 32, 16, 6, kq=kq)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


# --- joining and permuting -------------------------------------------------------------------

def permute_rows(b: Blocks, order: np.ndarray) -> Blocks:
    """The same blocks with output rows reordered (llama.cpp's q/k RoPE permutation undone)."""
    def take(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[order]

    kq = None if b.kq is None else (b.kq[0][order], take(b.kq[1]), b.kq[2][order],
                                    take(b.kq[3]))
    return Blocks(b.n, b.k, take(b.codes), take(b.scale), take(b.zero), b.offset, b.group,
                  b.bits, take(b.dense), kq)


def _widened(b: Blocks) -> Blocks:
    """Groups of 16, the offset folded into an explicit zero: the form any block type joins."""
    assert b.codes is not None and b.scale is not None
    scale = np.repeat(b.scale, b.group // 16, axis=1) if b.group == 32 else b.scale
    zero = None if b.zero is None else (
        np.repeat(b.zero, b.group // 16, axis=1) if b.group == 32 else b.zero)
    if b.offset:  # (c - o) s + z = c s + (z - o s): o s is exact (o a power of two)
        base = np.zeros_like(scale) if zero is None else zero
        zero = (base - np.float32(b.offset) * scale).astype(np.float32)
    return Blocks(b.n, b.k, b.codes, scale, zero, 0, 16, max(b.bits, 5))


def join(parts: list[Blocks]) -> Blocks:
    """Output rows of several matrices of the same input width, one after another."""
    if len(parts) == 1:
        return parts[0]
    k = parts[0].k
    if any(p.dense is not None for p in parts):  # any float part: the join is float
        dense = np.concatenate([p.weight() for p in parts])
        return Blocks(dense.shape[0], k, None, None, None, 0, 0, 32, dense)
    same = all((p.group, p.offset, p.zero is None, p.bits <= 4) ==
               (parts[0].group, parts[0].offset, parts[0].zero is None, parts[0].bits <= 4)
               for p in parts)
    if not same:
        parts = [_widened(p) for p in parts]
    first = parts[0]
    zero = None if first.zero is None else np.concatenate([p.zero for p in parts])  # type: ignore[misc]
    kq = None
    if same and all(p.kq is not None for p in parts):  # the file's form survives the join
        kqs = [p.kq for p in parts]
        kq = (np.concatenate([q[0] for q in kqs]),  # type: ignore[index]
              None if first.zero is None else np.concatenate([q[1] for q in kqs]),  # type: ignore[index,misc]
              np.concatenate([q[2] for q in kqs]),  # type: ignore[index]
              None if first.zero is None else np.concatenate([q[3] for q in kqs]))  # type: ignore[index,misc]
    return Blocks(sum(p.n for p in parts), k, np.concatenate([p.codes for p in parts]),  # type: ignore[misc]
                  np.concatenate([p.scale for p in parts]), zero, first.offset,  # type: ignore[misc]
                  first.group, max(p.bits for p in parts), kq=kq)


# --- panels ----------------------------------------------------------------------------------

MODES = ("fp", "a8")


def panels(b: Blocks, mode: str, bias: torch.Tensor | None = None) -> kernels.Panels:
    """The blocks laid out for the kernels: mode "fp" (fp32 activations: 4-bit panels where
    the codes fit 4 bits and the weight has a zero or an offset, else int8 panels) or "a8"
    (int8 activations: 4-bit or byte codes with the offset)."""
    if b.dense is not None:
        return kernels.pack_float(torch.from_numpy(np.ascontiguousarray(b.dense)), torch.float32,
                                  bias)
    assert b.codes is not None and b.scale is not None
    codes = torch.from_numpy(np.ascontiguousarray(b.codes))
    scale = torch.from_numpy(np.ascontiguousarray(b.scale, dtype=np.float32))
    zero = None if b.zero is None else torch.from_numpy(
        np.ascontiguousarray(b.zero, dtype=np.float32))
    if mode == "a8":
        bits = max(b.bits, 4)
        if bits in (5, 6) and not kernels.bit_planes_pay():
            bits = 8  # the same codes as bytes: the same bits
        pack = {4: kernels.pack_q4, 5: kernels.pack_q5, 6: kernels.pack_q6}.get(bits,
                                                                                kernels.pack_q8)
        kscales = None
        if b.kq is not None:  # the file's own scales: 0.09 bytes a weight, not 0.25
            d, dmin, sc, mn = (None if a is None else torch.from_numpy(np.ascontiguousarray(a))
                               for a in b.kq)
            assert d is not None and sc is not None
            kscales = kernels.KScales(d, dmin, sc, mn)
        return pack(codes, scale, zero, bias, offset=b.offset, group=b.group, kscales=kscales)
    if mode != "fp":
        raise ValueError(f"mode {mode!r} (one of {MODES})")
    if b.bits <= 4 and (zero is not None or b.offset):
        # the 4-bit panels take a zero: (c - o) s + z = c s + (z - o s), o s exact
        base = torch.zeros_like(scale) if zero is None else zero
        zeros = base - float(b.offset) * scale if b.offset else base
        return kernels.pack_int4(codes, scale, zeros, bias, round_x=False, group=b.group)
    signed = codes.to(torch.int16) - b.offset
    if signed.max() > 127:  # a joined Q8_0 part: byte codes with the offset folded into a zero;
        # its groups take (c - 128) s + (z + 128 s), and there z = -128 s: exact (checked)
        wide = signed.view(b.n, -1, b.group).amax(-1) > 127  # (n, groups)
        signed = (signed.view(b.n, -1, b.group) - 128 * wide[..., None]).view(b.n, b.k)
        base = torch.zeros_like(scale) if zero is None else zero
        moved = torch.where(wide, base + 128.0 * scale, base)
        if not torch.equal(torch.where(wide, moved - 128.0 * scale, moved), base):
            raise SpecDecodeError("int8 panels cannot hold these blocks exactly (internal)")
        zero = moved
    return kernels.pack_int8_groups(signed, scale, zero, bias, round_x=False, group=b.group)


# --- the file's tensor index, read fast ------------------------------------------------------

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str
    n: int  # rows (outputs)
    k: int  # inputs (the innermost dimension)
    data: np.ndarray  # a memory map of its bytes: (n, bytes per row), or (n, k) floats


def _skip_value(buf: Any, at: int, vtype: int) -> int:
    import struct

    if vtype in _SCALAR:
        return at + struct.calcsize("<" + _SCALAR[vtype])
    if vtype == 8:
        (length,) = struct.unpack_from("<Q", buf, at)
        return at + 8 + length
    if vtype == 9:
        etype, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if etype in _SCALAR:
            return at + count * struct.calcsize("<" + _SCALAR[etype])
        for _ in range(count):
            at = _skip_value(buf, at, etype)
        return at
    raise SpecDecodeError(f"GGUF metadata value of unknown type {vtype}")


def read_index(path: Any) -> dict[str, TensorEntry]:
    """Every tensor of a GGUF file as a memory map, without reading its metadata's values
    (gguf-py's reader builds every tokenizer string: seconds for a 150k vocabulary)."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise SpecDecodeError(f"{path}: not a GGUF file of version 2 or later")
        at, alignment = 24, 32
        for _ in range(n_kv):
            (klen,) = struct.unpack_from("<Q", buf, at)
            key = bytes(buf[at + 8:at + 8 + klen]).decode("utf-8", "replace")
            (vtype,) = struct.unpack_from("<I", buf, at + 8 + klen)
            value_at = at + 12 + klen
            if key == "general.alignment" and vtype == 4:
                (alignment,) = struct.unpack_from("<I", buf, value_at)
            at = _skip_value(buf, value_at, vtype)
        infos = []
        for _ in range(n_tensors):
            (nlen,) = struct.unpack_from("<Q", buf, at)
            name = bytes(buf[at + 8:at + 8 + nlen]).decode("utf-8")
            at += 8 + nlen
            (ndim,) = struct.unpack_from("<I", buf, at)
            dims = struct.unpack_from(f"<{ndim}Q", buf, at + 4)
            ttype, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * ndim)
            at += 4 + 8 * ndim + 12
            infos.append((name, dims, ttype, offset))
        start = (at + alignment - 1) // alignment * alignment
    except struct.error as exc:
        raise SpecDecodeError(f"{path}: a truncated or damaged GGUF header ({exc})") from exc
    finally:
        buf.close()
    out = {}
    for name, dims, ttype, offset in infos:
        qtype = GGMLQuantizationType(ttype)
        k, n = int(dims[0]), int(np.prod(dims[1:])) if len(dims) > 1 else 1
        size, nbytes = GGML_QUANT_SIZES[qtype]
        row = k // size * nbytes
        dtype = {"F32": np.float32, "F16": np.float16}.get(qtype.name, np.uint8)
        cols = row // np.dtype(dtype).itemsize
        data = np.memmap(path, dtype=dtype, mode="r", offset=start + offset, shape=(n, cols))
        out[name] = TensorEntry(name, qtype.name, n, k, data)
    return out


# --- the native runner's model from a GGUF's blocks -------------------------------------------

class BlockRowsEmbedding(torch.nn.Module):
    """Embedding rows de-quantized on demand from the GGUF's own blocks (a memory map of the
    file, nothing copied): the values ggml computes for them, bit for bit."""

    def __init__(self, raw: np.ndarray, type_name: str, n: int, k: int) -> None:
        super().__init__()
        self.raw, self.type_name, self.n, self.k = raw, type_name, n, k

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1).cpu().numpy()
        rows = decode(np.asarray(self.raw[ids]), self.type_name, len(ids), self.k, "embedding")
        return torch.from_numpy(np.ascontiguousarray(rows.weight())).view(*tokens.shape, self.k)

    @property
    def nbytes(self) -> int:
        return 0  # the file's pages, mapped: counted as the file's, not as held weights


def _rows_order(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (gguf_convert._unpermute)."""
    from specdecode.models.gguf_convert import _unpermute

    return _unpermute(np.arange(rows)[:, None], heads)[:, 0]


def load_gguf_model(path: Any, cfg: Any, mode: str, precision: str) -> Any:
    """The native runner (LlamaModel) at `precision`, every matrix built from the GGUF's own
    blocks in `mode` ("fp" or "a8"); norms and biases fp32; the embedding read from the head's
    panels (tied, fp mode) or from the file's blocks. Needs the row-invariant kernels."""
    from specdecode.models.linears import PanelLinear, TiedEmbedding
    from specdecode.models.llama import LlamaModel, rope_inv_freq

    if not kernels.available():
        raise SpecDecodeError(f"precision {precision} needs the row-invariant kernels "
                              f"({kernels.build_error()})")
    tensors = read_index(path)
    permute = cfg.family == "llama"  # llama.cpp permutes q/k rows only for llama

    def blocks(name: str, heads: int = 0) -> Blocks:
        t = tensors.get(name)
        if t is None:
            raise SpecDecodeError(f"{path}: tensor '{name}' is missing")
        b = decode(t.data, t.type_name, t.n, t.k, f"{path}: tensor '{name}'")
        return permute_rows(b, _rows_order(t.n, heads)) if permute and heads else b

    def vector(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise SpecDecodeError(f"{path}: tensor '{name}' is missing")
        return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))

    def linear(parts: list[Blocks], bias: torch.Tensor | None = None) -> PanelLinear:
        return PanelLinear(panels(join(parts), mode, bias))

    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.precision = precision
    model.norm = torch.nn.Parameter(vector("output_norm.weight"), requires_grad=False)
    model.inv_freq = rope_inv_freq(cfg)
    for i, block in enumerate(model.layers):
        p = f"blk.{i}."
        block.attn_norm = torch.nn.Parameter(vector(p + "attn_norm.weight"), requires_grad=False)
        block.mlp_norm = torch.nn.Parameter(vector(p + "ffn_norm.weight"), requires_grad=False)
        bias = None
        if cfg.qkv_bias:
            q_bias = vector(p + "attn_q.bias")
            k_bias = vector(p + "attn_k.bias")
            if permute:
                q_bias = q_bias[torch.from_numpy(_rows_order(len(q_bias), cfg.num_heads))]
                k_bias = k_bias[torch.from_numpy(_rows_order(len(k_bias), cfg.num_kv_heads))]
            bias = torch.cat([q_bias, k_bias, vector(p + "attn_v.bias")])
        block.qkv = linear([blocks(p + "attn_q.weight", cfg.num_heads),
                            blocks(p + "attn_k.weight", cfg.num_kv_heads),
                            blocks(p + "attn_v.weight")], bias)
        block.o = linear([blocks(p + "attn_output.weight")])
        block.gate_up = linear([blocks(p + "ffn_gate.weight"), blocks(p + "ffn_up.weight")])
        block.down = linear([blocks(p + "ffn_down.weight")])
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    model.lm_head = linear([blocks(head_name)])
    embed = tensors["token_embd.weight"]
    readable = model.lm_head.panels.kind in (kernels.KIND_F32, kernels.KIND_I8G)
    if head_name == "token_embd.weight" and readable:
        model.embed = TiedEmbedding(model.lm_head)
    else:
        model.embed = BlockRowsEmbedding(embed.data, embed.type_name, embed.n, embed.k)
    return model.set_exact(True).eval()
