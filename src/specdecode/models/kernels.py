"""The native runner's row-invariant kernels (kernels.c), built on first use and loaded.

Why C: PyTorch's CPU products and attention choose their kernels and blockings by shape (MKL's
GEMV for one row, other micro-kernels for 2-3 rows and for multiples of 4; fbgemm's fp16 kernels;
the fused attention's key blocks), so a position's logits move in the last bits with the number
of positions scored beside it. kernels.c computes every output element by one fixed sequence of
operations whatever the shape (its header says how), which is what bit-exact speculation needs;
and it runs a whole transformer block per call, which removes most of a decoding step's
per-operator overhead.

The library is compiled once per source, compiler, flags and CPU with the system C compiler
(`cc`, or $CC) into the cache folder (`$SPECDECODE_CACHE/kernels`, default
~/.cache/specdecode/kernels) and loaded with ctypes; OpenMP threads come from the same runtime as
PyTorch's (libgomp, loaded by torch first), so `torch.set_num_threads` governs both. Where no
compiler works, `library()` is None and `build_error()` says why: the runner then keeps
PyTorch's kernels and its load-time invariance check reports the difference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC",
         "-shared")
PANEL = 16  # kernels.c: output columns per packed panel
GROUP = 32  # kernels.c: inputs per scale of the 4-bit format
KIND_F32, KIND_BF16, KIND_I8, KIND_I4, KIND_I8G = 0, 1, 2, 3, 4
MAX_HEAD_DIM = 512  # kernels.c's per-row RoPE buffer

_P = ctypes.c_void_p
_I = ctypes.c_int64


class SdMat(ctypes.Structure):
    _fields_ = [("w", _P), ("scale", _P), ("zero", _P), ("bias", _P), ("n", _I), ("k", _I),
                ("kind", ctypes.c_int32), ("round_x", ctypes.c_int32)]


class SdAttn(ctypes.Structure):
    _fields_ = [("kc", _P), ("vc", _P), ("c_row", _I), ("c_head", _I), ("kvh", _I),
                ("rows", _P), ("mask", _P), ("used", _I)]


class SdBlockW(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("inter", _I), ("eps", ctypes.c_float), ("attn_norm", _P), ("mlp_norm", _P),
                ("qkv", SdMat), ("o", SdMat), ("gate_up", SdMat), ("down", SdMat)]


def _cache_dir() -> Path:
    root = os.environ.get("SPECDECODE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "specdecode")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("SPECDECODE_NO_KERNELS") == "1":
        return None, "SPECDECODE_NO_KERNELS=1 is set"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C compiler {cc} does not run: {e}"
    key = hashlib.sha256(b"\0".join(
        [source, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()]
    )).hexdigest()[:16]
    folder = _cache_dir()
    target = folder / f"libspecdecode-{key}.so"
    if not target.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                out = Path(tmp) / target.name
                done = subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE), "-lm"],
                                      capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    return None, f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-800:]}"
                os.replace(out, target)  # atomic: another process may build the same file
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building {SOURCE.name} with {cc} failed: {e}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        return None, f"loading {target} failed: {e}"
    lib.sd_matmul.argtypes = [_P, _I, ctypes.POINTER(SdMat), _P]
    lib.sd_matmul.restype = None
    lib.sd_attention.argtypes = [_P, _I, _I, _I, _I, ctypes.POINTER(SdAttn), _P]
    lib.sd_attention.restype = None
    lib.sd_block.argtypes = [_P, _I, ctypes.POINTER(SdBlockW), _P, _P, _P,
                             ctypes.POINTER(SdAttn)]
    lib.sd_block.restype = None
    lib.sd_has_avx2.restype = ctypes.c_int
    return lib, None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built here (see build_error)."""
    return _build()[0]


def build_error() -> str | None:
    """Why the kernels are unavailable, or None."""
    return _build()[1]


def available() -> bool:
    return library() is not None


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the row-invariant kernels are unavailable: {build_error()}")
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class Panels:
    """A weight matrix (n outputs, k inputs) in kernels.c's panel layout, and what it needs."""

    kind: int
    w: torch.Tensor
    n: int
    k: int
    scale: torch.Tensor | None = None  # I8: (P * 16,); I4, I8G: (P, k / 32, 16)
    zero: torch.Tensor | None = None  # I4: (P, k / 32, 16)
    bias: torch.Tensor | None = None  # (n,) fp32
    round_x: bool = False  # inputs rounded to bf16 (the "a16" precisions)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.scale, self.zero)
                   if t is not None)

    def struct(self) -> SdMat:
        return SdMat(_ptr(self.w), _ptr(self.scale), _ptr(self.zero), _ptr(self.bias), self.n,
                     self.k, self.kind, int(self.round_x))


def _panelled(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """(n, ...) rows padded with `fill` to a multiple of PANEL, as (P, PANEL, ...)."""
    n = t.shape[0]
    pad = -n % PANEL
    if pad:
        t = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])
    return t.view(-1, PANEL, *t.shape[1:])


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


def pack_float(weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
               round_x: bool = False) -> Panels:
    """An (n, k) float weight at `dtype` (fp32 or bf16)."""
    n, k = weight.shape
    w = _panelled(weight.detach().to(dtype)).transpose(1, 2).contiguous()  # (P, k, 16)
    return Panels(KIND_BF16 if dtype == torch.bfloat16 else KIND_F32, w, n, k,
                  bias=_bias(bias), round_x=round_x)


def pack_int8(codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
              round_x: bool = True) -> Panels:
    """Per-output-column int8: w[n][k] = codes[n][k] * scales[n]."""
    n, k = codes.shape
    w = _panelled(codes.to(torch.int8)).transpose(1, 2).contiguous()  # (P, k, 16)
    return Panels(KIND_I8, w, n, k, scale=_panelled(scales.float()).reshape(-1).contiguous(),
                  bias=_bias(bias), round_x=round_x)


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              bias: torch.Tensor | None = None, round_x: bool = True) -> Panels:
    """4-bit codes 0..15 per (n, k), with a scale and a zero per output and group of 32
    inputs, (n, k / 32) each: w[n][k] = codes[n][k] * scales[n][k // 32] + zeros[n][k // 32]."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"4-bit panels need inputs divisible by {GROUP}, got {k}")
    c = _panelled(codes.to(torch.uint8)).transpose(1, 2)  # (P, k, 16)
    w = (c[..., :8] | (c[..., 8:] << 4)).contiguous()  # (P, k, 8)
    return Panels(KIND_I4, w, n, k, scale=_panelled(scales.float()).transpose(1, 2).contiguous(),
                  zero=_panelled(zeros.float()).transpose(1, 2).contiguous(), bias=_bias(bias),
                  round_x=round_x)


def pack_int8_groups(codes: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None = None, round_x: bool = False) -> Panels:
    """int8 codes per (n, k) with a scale per output and group of 32 inputs, (n, k / 32):
    w[n][k] = codes[n][k] * scales[n][k // 32] (the layout of GGUF's Q8_0 blocks)."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"grouped int8 panels need inputs divisible by {GROUP}, got {k}")
    w = _panelled(codes.to(torch.int8)).transpose(1, 2).contiguous()  # (P, k, 16)
    return Panels(KIND_I8G, w, n, k, scale=_panelled(scales.float()).transpose(1, 2).contiguous(),
                  bias=_bias(bias), round_x=round_x)


def group_scales(p: Panels) -> torch.Tensor:
    """(n, k / 32) scales of I4 or I8G panels."""
    assert p.scale is not None
    return p.scale.transpose(1, 2).reshape(-1, p.k // GROUP)[: p.n]


def codes_of(p: Panels) -> torch.Tensor:
    """The (n, k) weight values (F32, BF16) or integer codes (I8, I4) the panels hold."""
    if p.kind == KIND_I4:
        lo, hi = p.w & 0xF, p.w >> 4
        flat = torch.cat([lo, hi], dim=-1)  # (P, k, 16)
    else:
        flat = p.w
    return flat.transpose(1, 2).reshape(-1, p.k)[: p.n]


def weight_of(p: Panels) -> torch.Tensor:
    """The (n, k) fp32 weight the panels multiply by, as the kernel computes it (for int4,
    codes * scale + zero)."""
    c = codes_of(p).float()
    if p.kind == KIND_I8:
        assert p.scale is not None
        return c * p.scale[: p.n, None]
    if p.kind == KIND_I8G:
        return c * group_scales(p).repeat_interleave(GROUP, 1)
    if p.kind == KIND_I4:
        assert p.scale is not None and p.zero is not None
        scale = p.scale.transpose(1, 2).reshape(-1, p.k // GROUP)[: p.n]
        zero = p.zero.transpose(1, 2).reshape(-1, p.k // GROUP)[: p.n]
        return torch.addcmul(zero.repeat_interleave(GROUP, 1), c,
                             scale.repeat_interleave(GROUP, 1))
    return c


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    return x2


def matmul(x: torch.Tensor, panels: Panels) -> torch.Tensor:
    """x (..., k) fp32 times the panels' weight transposed, + bias: (..., n) fp32."""
    x2 = _rows(x, panels.k)
    y = torch.empty(x2.shape[0], panels.n, dtype=torch.float32)
    if x2.shape[0]:
        mat = panels.struct()
        _lib().sd_matmul(x2.data_ptr(), x2.shape[0], ctypes.byref(mat), y.data_ptr())
    return y.view(*x.shape[:-1], panels.n)


def attn_spec(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
              mask: torch.Tensor | None, used: int) -> SdAttn:
    """Which keys each query row attends: `rows` (R,) int64 the cache row of each query row,
    `mask` (R, used) uint8 (1 = may attend) or None (every slot below `used`). k_cache, v_cache:
    (B, KVH, capacity, D) fp32 of one layer, slots contiguous. The tensors must outlive it."""
    if k_cache.stride(3) != 1 or k_cache.stride(2) != k_cache.shape[3] \
            or k_cache.stride() != v_cache.stride() or k_cache.dtype != torch.float32:
        raise ValueError("attention: the cache must hold contiguous fp32 slots")
    return SdAttn(k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                  k_cache.shape[1], rows.data_ptr(), _ptr(mask), used)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              rows: torch.Tensor, mask: torch.Tensor | None, used: int) -> torch.Tensor:
    """Row-invariant attention: q (R, NH, D) fp32 with heads contiguous in each row (a row may
    be strided); mask (R, used) bool or None. Returns (R, NH, D)."""
    r, nh, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        raise ValueError("attention: q rows must hold contiguous heads")
    rows = rows.to(torch.int64).contiguous()
    m = None if mask is None else mask.to(torch.uint8).contiguous()
    spec = attn_spec(k_cache, v_cache, rows, m, used)
    out = torch.empty(r, nh, d, dtype=torch.float32)
    _lib().sd_attention(q.data_ptr(), q.stride(0), r, nh, d, ctypes.byref(spec), out.data_ptr())
    return out


def block(x: torch.Tensor, weights: SdBlockW, cos: torch.Tensor, sin: torch.Tensor,
          slots: torch.Tensor, spec: SdAttn) -> None:
    """Apply one transformer block to x (M, hidden) fp32 contiguous, in place (kernels.c
    sd_block); cos, sin (M, head_dim) contiguous; slots (M,) int64: where each row's key and
    value go in its cache row."""
    _lib().sd_block(x.data_ptr(), x.shape[0], ctypes.byref(weights), cos.data_ptr(),
                    sin.data_ptr(), slots.data_ptr(), ctypes.byref(spec))
