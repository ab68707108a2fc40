"""The native runner's row-invariant kernels (kernels.c), built on first use and loaded.

Why C: PyTorch's CPU products and attention choose their kernels and blockings by shape (MKL's
GEMV for one row, other micro-kernels for 2-3 rows and for multiples of 4; fbgemm's fp16 kernels;
the fused attention's key blocks), so a position's logits move in the last bits with the number
of positions scored beside it. kernels.c computes every output element by one fixed sequence of
operations whatever the shape (its header says how), which is what bit-exact speculation needs.

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
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC",
         "-shared")
PANEL = 16  # kernels.c: output columns per packed panel
KIND_FP32, KIND_BF16 = 0, 1

_P = ctypes.c_void_p
_I = ctypes.c_int64


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
    lib.sd_matmul.argtypes = [_P, _I, _I, _P, ctypes.c_int, _I, _P, _P]
    lib.sd_matmul.restype = None
    lib.sd_attention.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I, _I, _I, _P, _P, _I,
                                 ctypes.c_float, _P]
    lib.sd_attention.restype = None
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


def pack(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) weight -> panels of PANEL output columns (kernels.c's layout), fp32 or bf16."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = torch.zeros(panels * PANEL, k, dtype=dtype)
    w[:n] = weight.detach().to(dtype)
    return w.view(panels, PANEL, k).transpose(1, 2).contiguous()  # (P, K, PANEL)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The (N, K) fp32 weight of `pack`'s panels."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:n].float()


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 times the packed (N, K) weight's transpose, + bias: (..., N) fp32."""
    k = packed.shape[1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        kind = KIND_BF16 if packed.dtype == torch.bfloat16 else KIND_FP32
        _lib().sd_matmul(x2.data_ptr(), m, k, packed.data_ptr(), kind, n,
                         None if bias is None else bias.data_ptr(), y.data_ptr())
    return y.view(*x.shape[:-1], n)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              rows: torch.Tensor, mask: torch.Tensor | None, used: int) -> torch.Tensor:
    """Row-invariant attention.

    q: (R, NH, D) fp32, heads contiguous in each row (a row may be strided). k_cache, v_cache:
    (B, KVH, capacity, D) fp32. rows: (R,) int64, the cache row of each query row. mask: (R, used)
    bool (True = may attend) or None (every slot below `used`). Returns (R, NH, D).
    """
    r, nh, d = q.shape
    kvh = k_cache.shape[1]
    if q.stride(2) != 1 or q.stride(1) != d or k_cache.stride(3) != 1 or k_cache.stride(2) != d \
            or k_cache.stride() != v_cache.stride():
        raise ValueError("attention: q rows and cache slots must hold contiguous heads")
    out = torch.empty(r, nh, d, dtype=torch.float32)
    m = None if mask is None else mask.to(torch.uint8).contiguous()
    rows = rows.to(torch.int64).contiguous()
    _lib().sd_attention(
        q.data_ptr(), q.stride(0), r, nh, d, k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), kvh, rows.data_ptr(),
        None if m is None else m.data_ptr(), used, 1.0 / d ** 0.5, out.data_ptr())
    return out
