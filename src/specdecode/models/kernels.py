"""The native runner's row-invariant kernels (kernels.c), built on first use, tried, and loaded.

Why C: PyTorch's CPU products and attention choose their kernels and blockings by shape (MKL's
GEMV for one row, other micro-kernels for 2-3 rows and for multiples of 4; fbgemm's fp16 kernels;
the fused attention's key blocks), so a position's logits move in the last bits with the number
of positions scored beside it. kernels.c computes every output element by one fixed sequence of
operations whatever the shape (its header says how), which is what bit-exact speculation needs;
and it runs a whole transformer block per call, which removes most of a decoding step's
per-operator overhead.

Paths: the same source is compiled once per instruction set (PATHS: AVX-512 with VNNI,
AVX-512, AVX2+FMA, scalar), each with explicit `-m` flags rather than `-march=native`, so a
build holds no instruction its path does not name. At first use the best path this CPU's flags
allow is compiled with the system C compiler (`cc`, or $CC) into the cache folder
(`$SPECDECODE_CACHE/kernels`, else `$XDG_CACHE_HOME/specdecode/kernels`, else
~/.cache/specdecode/kernels; the file keyed by source, flags, compiler and the CPU's flags), then
tried in a child process (every weight kind, rows alone and in blocks, compared bit for bit): a
path whose child dies (an instruction the CPU or the OS refuses, whatever its flags say) or whose
rows differ is refused, said in the log, and the next path tried; the verdict is cached beside
the library. The float kinds give the same bits on every path (vector lanes are output
columns); so do the integer-activation kinds (exact int32 sums).

`SPECDECODE_KERNEL_PATH=<name>` forces a path (an unknown one, or one this CPU cannot run, is an
error); `SPECDECODE_NO_KERNELS=1` turns the kernels off (the runner then uses PyTorch's, which
are not exact); `SPECDECODE_REQUIRE_KERNELS=1` makes a build or probe failure an error instead
of a fallback (CI sets it). OpenMP threads come from the same runtime as PyTorch's (libgomp,
loaded by torch first), so `torch.set_num_threads` governs both.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError

SOURCE = Path(__file__).with_name("kernels.c")
HEADERS = (Path(__file__).with_name("kernels_fp.h"),)  # included by kernels.c
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared")
ABI = 5  # kernels.c SD_ABI
PANEL = 16  # kernels.c: output columns per packed panel
GROUP = 32  # inputs per scale of the 4-bit and grouped int8 formats (Q6_K blocks: 16)
QBLOCK = 32  # kernels.c: inputs per int8 scale of the a8 kinds' activations
CHUNK = 64  # kernels.c: rows per pass
KIND_F32, KIND_BF16, KIND_I8, KIND_I4, KIND_I8G, KIND_Q4, KIND_Q8, KIND_Q5, KIND_Q6 = range(9)
QUANT_KINDS = (KIND_Q4, KIND_Q8, KIND_Q5, KIND_Q6)  # integer activations: the "a8" precisions
MAX_HEAD_DIM = 512  # kernels.c's per-row RoPE buffer
ENOMEM = 1
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")


@dataclass(frozen=True)
class KernelPath:
    """One instruction set the kernels are compiled for."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must report
    x86: bool = True


PATHS = (
    KernelPath("avx512vnni", (*_AVX512, "-mavx512vnni"),
               ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                "avx512_vnni")),
    KernelPath("avx512", _AVX512, ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                   "avx512dq")),
    KernelPath("avx2", _AVX2, ("avx2", "fma", "f16c")),
    KernelPath("scalar", (), (), x86=False),
)
PATH_NAMES = tuple(p.name for p in PATHS)
PATH_ENV = "SPECDECODE_KERNEL_PATH"

_P = ctypes.c_void_p
_I = ctypes.c_int64
log = logging.getLogger(__name__)


class SdMat(ctypes.Structure):
    _fields_ = [("w", _P), ("scale", _P), ("zero", _P), ("bias", _P), ("n", _I), ("k", _I),
                ("kind", ctypes.c_int32), ("round_x", ctypes.c_int32),
                ("group", ctypes.c_int32), ("offset", ctypes.c_int32), ("hbits", _P),
                ("kblock", _I)]


class SdAttn(ctypes.Structure):
    _fields_ = [("kc", _P), ("vc", _P), ("c_row", _I), ("c_head", _I), ("kvh", _I),
                ("rows", _P), ("mask", _P), ("used", _I)]


class SdBlockW(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("inter", _I), ("eps", ctypes.c_float), ("attn_norm", _P), ("mlp_norm", _P),
                ("qkv", SdMat), ("o", SdMat), ("gate_up", SdMat), ("down", SdMat)]


class KernelError(SpecDecodeError):
    """The kernels cannot be used as asked: a forced path that does not run here, a build that
    failed where SPECDECODE_REQUIRE_KERNELS=1 requires them."""


def _cache_dir() -> Path:
    root = os.environ.get("SPECDECODE_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "specdecode")
    return Path(root) / "kernels"


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


def path_by_name(name: str) -> KernelPath:
    for p in PATHS:
        if p.name == name:
            return p
    raise KernelError(f"{PATH_ENV}={name}: no such kernel path (known: {', '.join(PATH_NAMES)})")


def cpu_runs(path: KernelPath, flags: frozenset[str] | None = None) -> str | None:
    """None if this CPU's flags allow `path`, else what it lacks."""
    if not path.x86:
        return None
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return f"it is an x86 path and this machine is {platform.machine()}"
    have = cpu_flags() if flags is None else flags
    missing = [f for f in path.needs if f not in have]
    return None if not missing else f"this CPU lacks {', '.join(missing)}"


def compile_path(path: KernelPath, cc: str | None = None, extra: tuple[str, ...] = ()
                 ) -> Path:
    """The shared library of `path`, compiled now unless the cache holds it (`extra`: more
    flags, e.g. the tests' deliberately broken variants)."""
    cc = cc or _compiler()
    if cc is None:
        raise KernelError("no C compiler found (set CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"the C compiler {cc} does not run: {e}") from e
    flags = (*FLAGS, *path.flags, *extra)
    key = hashlib.sha256(b"\0".join(
        [SOURCE.read_bytes(), *(h.read_bytes() for h in HEADERS), " ".join(flags).encode(),
         version.encode(),
         " ".join(sorted(cpu_flags())).encode(), path.name.encode()])).hexdigest()[:16]
    folder = _cache_dir()
    target = folder / f"libspecdecode-{path.name}-{key}.so"
    if target.exists():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([cc, *flags, "-o", str(out), str(SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise KernelError(f"{cc} failed to build {SOURCE.name} for the {path.name} "
                                  f"path: {done.stderr.strip()[-800:]}")
            os.replace(out, target)  # atomic: another process may build the same file
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"building {SOURCE.name} for the {path.name} path with {cc} "
                          f"failed: {e}") from e
    return target


def open_library(target: Path) -> ctypes.CDLL:
    """Load a kernels library and declare its functions; its constants must match ours."""
    lib = ctypes.CDLL(str(target))
    lib.sd_abi.restype = ctypes.c_int
    if lib.sd_abi() != ABI:
        raise KernelError(f"{target}: kernels ABI {lib.sd_abi()}, this package expects {ABI}")
    consts = (ctypes.c_int64 * 6)()
    lib.sd_constants(consts)
    want = (ABI, PANEL, CHUNK, QBLOCK, MAX_HEAD_DIM, ctypes.sizeof(SdMat))
    if tuple(consts) != want:
        raise KernelError(f"{target}: kernels.c's constants {tuple(consts)} differ from "
                          f"kernels.py's {want} (ABI, PANEL, CHUNK, QBLOCK, MAX_HEAD_DIM, "
                          "sizeof(sd_mat))")
    lib.sd_matmul.argtypes = [_P, _I, ctypes.POINTER(SdMat), _P]
    lib.sd_matmul.restype = ctypes.c_int
    lib.sd_attention.argtypes = [_P, _I, _I, _I, _I, ctypes.POINTER(SdAttn), _P]
    lib.sd_attention.restype = ctypes.c_int
    lib.sd_block.argtypes = [_P, _I, ctypes.POINTER(SdBlockW), _P, _P, _P,
                             ctypes.POINTER(SdAttn)]
    lib.sd_block.restype = ctypes.c_int
    lib.sd_forward.argtypes = [_P, _I, _I, ctypes.POINTER(SdBlockW), _P, _P, _P,
                               ctypes.POINTER(SdAttn), _P, ctypes.c_float,
                               ctypes.POINTER(SdMat), _P, _I, _P]
    lib.sd_forward.restype = ctypes.c_int
    lib.sd_has_avx2.restype = ctypes.c_int
    lib.sd_isa.restype = ctypes.c_int
    return lib


# --- the child-process trial of a path -------------------------------------------------------

def trial(lib: ctypes.CDLL) -> str | None:
    """Every weight kind at 1..12 and 70 rows: None if each row alone equals the same row in
    every block, else what differed. Run in a child (a fault must not kill the caller)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 40, 256
    x = torch.randn(70, k, generator=gen)
    codes4 = torch.randint(0, 16, (n, k), generator=gen)
    codes8 = torch.randint(-127, 128, (n, k), generator=gen)
    s, z = torch.rand(n, k // 32, generator=gen), torch.randn(n, k // 32, generator=gen)
    s16, z16 = torch.rand(n, k // 16, generator=gen), torch.randn(n, k // 16, generator=gen)
    w = torch.randn(n, k, generator=gen)
    cases = {
        "f32": pack_float(w, torch.float32), "bf16": pack_float(w, torch.bfloat16, round_x=True),
        "i8": pack_int8(codes8, s[:, 0]), "i4": pack_int4(codes4, s, z),
        "i8g16": pack_int8_groups(codes8, s16, z16, group=16),
        "q4": pack_q4(codes4, s, z, offset=8), "q8": pack_q8(codes8 + 128, s16, None,
                                                           offset=128, group=16),
        "q5": pack_q5((codes8 + 128) >> 3, s, None, offset=16),
        "q6": pack_q6((codes8 + 128) >> 2, s16, z16, offset=32, group=16),
        "q4k": pack_q4(codes4, s, z, kscales=KScales(
            s[:, :1] * 0.1, s[:, 1:2] * 0.1, torch.randint(0, 64, (n, 1, 8), generator=gen,
                                                           dtype=torch.int8),
            torch.randint(0, 64, (n, 1, 8), generator=gen, dtype=torch.int8))),
    }
    for name, panels in cases.items():
        mat = panels.struct()

        def run(rows: torch.Tensor, mat: SdMat = mat) -> torch.Tensor:
            y = torch.empty(rows.shape[0], n)
            if lib.sd_matmul(rows.contiguous().data_ptr(), rows.shape[0], ctypes.byref(mat),
                             y.data_ptr()):
                raise MemoryError("kernels: out of memory")
            return y

        full = run(x)
        if not torch.isfinite(full).all():
            return f"{name}: non-finite products"
        for rows in (*range(1, 13), 70):
            if not torch.equal(run(x[:rows]), full[:rows]):
                return f"{name}: {rows} rows differ from the same rows among 70"
    return None


def _trial_in_child(target: Path) -> str | None:
    code = ("import sys; from pathlib import Path; from specdecode.models import kernels as k; "
            "why = k.trial(k.open_library(Path(sys.argv[1]))); print(why or 'ok')")
    env = {key: v for key, v in os.environ.items() if key != "PYTHONFAULTHANDLER"}
    env["OMP_NUM_THREADS"] = "2"
    try:
        done = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True,
                              text=True, timeout=300, env=env, check=False)
    except subprocess.TimeoutExpired:
        return "the trial hung for 300 s"
    if done.returncode < 0:
        import signal

        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return f"the trial was killed by {name}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"the trial failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    return None if lines[-1] == "ok" else lines[-1]


def tried(path: KernelPath, target: Path) -> str | None:
    """The cached verdict of `target`'s trial in a child process (None: it runs)."""
    verdict = target.with_suffix(".trial.json")
    try:
        return json.loads(verdict.read_text(encoding="utf-8"))["failure"]  # type: ignore[no-any-return]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    failure = _trial_in_child(target)
    with contextlib.suppress(OSError):  # an unwritable cache only costs a trial next time
        verdict.write_text(json.dumps({"path": path.name, "failure": failure}), encoding="utf-8")
    return failure


@dataclass(frozen=True)
class Loaded:
    lib: ctypes.CDLL | None
    path: str | None
    error: str | None
    refused: tuple[str, ...] = ()  # "name: why" of the paths tried and refused first


def _candidates() -> list[KernelPath]:
    forced = os.environ.get(PATH_ENV)
    if forced:
        path = path_by_name(forced.strip())
        why = cpu_runs(path)
        if why is not None:
            raise KernelError(f"{PATH_ENV}={forced}: the {path.name} path cannot run here: {why}")
        return [path]
    return [p for p in PATHS if cpu_runs(p) is None]


def _load() -> Loaded:
    if os.environ.get("SPECDECODE_NO_KERNELS") == "1":
        return Loaded(None, None, "SPECDECODE_NO_KERNELS=1 is set")
    refused: list[str] = []
    for path in _candidates():
        try:
            target = compile_path(path)
            failure = tried(path, target)
            if failure is not None and failure.startswith("the trial failed"):
                # a damaged cached library (a half-written file, another build's leftovers):
                # built again once, tried again
                target.unlink(missing_ok=True)
                target.with_suffix(".trial.json").unlink(missing_ok=True)
                target = compile_path(path)
                failure = tried(path, target)
            if failure is None:
                if refused:
                    log.warning("kernels: using the %s path; refused first: %s", path.name,
                                "; ".join(refused))
                return Loaded(open_library(target), path.name, None, tuple(refused))
        except (KernelError, OSError) as e:
            failure = str(e)
        refused.append(f"{path.name}: {failure}")
        log.warning("kernels: the %s path is refused: %s", path.name, failure)
    return Loaded(None, None, "no kernel path runs here (" + "; ".join(refused) + ")",
                  tuple(refused))


@functools.cache
def _loaded() -> Loaded:
    required = os.environ.get("SPECDECODE_REQUIRE_KERNELS") == "1"
    try:
        loaded = _load()
    except KernelError as e:
        if required or os.environ.get(PATH_ENV):
            raise
        loaded = Loaded(None, None, str(e))
    if loaded.lib is None and required:
        raise KernelError(f"SPECDECODE_REQUIRE_KERNELS=1 and the kernels are unavailable: "
                          f"{loaded.error}")
    if loaded.lib is None:  # said once per process: precision auto silently meaning fp32 is not
        log.warning("the row-invariant kernels are unavailable (%s): the native runner uses "
                    "PyTorch's kernels, --precision auto is fp32, and precisions that need the "
                    "kernels are refused", loaded.error)
    return loaded


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built here (see build_error)."""
    return _loaded().lib


def library_name() -> str | None:
    """The loaded library's file name (it carries the hash of the source, flags, compiler and
    CPU flags it was built for: compile_path), or None."""
    lib = library()
    return None if lib is None else Path(lib._name).name


def build_error() -> str | None:
    """Why the kernels are unavailable, or None."""
    return _loaded().error


def path_name() -> str | None:
    """The kernel path in use ("avx512vnni", "avx512", "avx2", "scalar"), or None."""
    return _loaded().path


def available() -> bool:
    return library() is not None


def bit_planes_pay() -> bool:
    """Whether 5- and 6-bit codes (GGUF's Q5_0, Q5_K, Q6_K, ...) are held as 4-bit panels plus
    their high bits (pack_q5, pack_q6: 0.63 / 0.75 bytes a weight) rather than as bytes
    (pack_q8: 1). Both hold the same codes and give the same bits. The high bits are laid out
    so that a vector of them costs a shift, a mask and an or (AVX-512 and AVX2 alike); on
    AVX2 the fewer bytes then pay where a product is bound by memory (one to two rows) and
    cost up to a tenth at nine (docs/measurements/2026-12-07-high-bits.md). The scalar build,
    a fallback, keeps bytes."""
    return (path_name() or "scalar") != "scalar"


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the row-invariant kernels are unavailable: {build_error()}")
    return lib


def release_openmp_threads() -> bool:
    """Let the OpenMP runtime end the worker threads it keeps for the calling thread
    (`omp_pause_resource_all(omp_pause_soft)`); they come back if this thread runs a parallel
    region again. True where the runtime (the libgomp already loaded) did so.

    Why: libgomp keeps a team per thread that ever started a parallel region, and once its
    threads outnumber the CPUs it stops spinning at barriers and sleeps in the kernel instead.
    A server loads (and checks) its model on the main thread, then runs every step on its
    engine thread: with the main thread's team still alive, each of a step's barriers became a
    futex wait (a plain step of the Qwen2.5-Coder-1.5B pair target ~10 ms slower, 2 cores)."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:  # no libgomp in this process: no team to end
        return False
    pause = getattr(gomp, "omp_pause_resource_all", None)
    if pause is None:  # a runtime older than OpenMP 5.0
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return int(pause(1)) == 0  # 1: omp_pause_soft


def _check(rc: int, what: str) -> None:
    if rc == ENOMEM:
        raise MemoryError(f"kernels: {what} could not allocate its scratch memory")
    if rc:
        raise RuntimeError(f"kernels: {what} failed (code {rc})")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class Panels:
    """A weight matrix (n outputs, k inputs) in kernels.c's panel layout, and what it needs."""

    kind: int
    w: torch.Tensor
    n: int
    k: int
    scale: torch.Tensor | None = None  # I8: (P * 16,); grouped kinds: (P, k / group, 16)
    zero: torch.Tensor | None = None  # grouped kinds with zeros: (P, k / group, 16)
    bias: torch.Tensor | None = None  # (n,) fp32
    round_x: bool = False  # inputs rounded to bf16 (the "a16" precisions)
    group: int = 0  # inputs per scale (grouped and a8 kinds)
    offset: int = 0  # a8 kinds: value = code - offset
    hbits: torch.Tensor | None = None  # Q5: the plane of fifth bits; Q6: fifth, then sixth
    kblock: int = 0  # 256: `scale` holds K-quant super-block tables (KScales), `zero` marks mins

    @property
    def nbytes(self) -> int:
        held = {id(t): t for t in (self.w, self.scale, self.zero, self.hbits) if t is not None}
        return sum(t.numel() * t.element_size() for t in held.values())

    def struct(self) -> SdMat:
        return SdMat(_ptr(self.w), _ptr(self.scale), _ptr(self.zero), _ptr(self.bias), self.n,
                     self.k, self.kind, int(self.round_x), self.group, self.offset,
                     _ptr(self.hbits), self.kblock)


def _panelled(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """(n, ...) rows padded with `fill` to a multiple of PANEL, as (P, PANEL, ...)."""
    n = t.shape[0]
    pad = -n % PANEL
    if pad:
        t = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])
    return t.view(-1, PANEL, *t.shape[1:])


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


def _group_table(t: torch.Tensor | None) -> torch.Tensor | None:
    """(n, groups) per-group values as (P, groups, 16) fp32."""
    return None if t is None else _panelled(t.float()).transpose(1, 2).contiguous()


def _check_groups(k: int, group: int, what: str) -> None:
    if group not in (16, 32) or k % group:
        raise ValueError(f"{what} need groups of 16 or 32 inputs dividing {k}, got {group}")


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
              bias: torch.Tensor | None = None, round_x: bool = True, group: int = GROUP
              ) -> Panels:
    """4-bit codes 0..15 per (n, k), with a scale and a zero per output and group of `group`
    inputs, (n, k / group) each: w[n][k] = codes[n][k] * scales[n][k // group] + zeros[...]."""
    n, k = codes.shape
    _check_groups(k, group, "4-bit panels")
    c = _panelled(codes.to(torch.uint8)).transpose(1, 2)  # (P, k, 16)
    w = (c[..., :8] | (c[..., 8:] << 4)).contiguous()  # (P, k, 8)
    return Panels(KIND_I4, w, n, k, scale=_group_table(scales), zero=_group_table(zeros),
                  bias=_bias(bias), round_x=round_x, group=group)


def pack_int8_groups(codes: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     round_x: bool = False, group: int = GROUP) -> Panels:
    """int8 codes per (n, k) with a scale (and optionally a zero) per output and group of
    `group` inputs, (n, k / group): w[n][k] = codes[n][k] * scales[n][k // group] (+ zero)
    (GGUF's Q8_0 blocks; Q5_x and Q6_K with their offsets applied to the codes)."""
    n, k = codes.shape
    _check_groups(k, group, "grouped int8 panels")
    w = _panelled(codes.to(torch.int8)).transpose(1, 2).contiguous()  # (P, k, 16)
    return Panels(KIND_I8G, w, n, k, scale=_group_table(scales), zero=_group_table(zeros),
                  bias=_bias(bias), round_x=round_x, group=group)


def _quads(codes: torch.Tensor) -> torch.Tensor:
    """(n, k) byte codes as (P, k / 4, 16, 4): quad i of inputs 4i..4i+3 of each column."""
    k = codes.shape[1]
    c = _panelled(codes.to(torch.uint8))  # (P, 16, k)
    return c.view(c.shape[0], PANEL, k // 4, 4).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class KScales:
    """A K-quant's scales as the file holds them, per output row and super-block of 256
    inputs: d and (with minimums) dmin fp32 (n, S), and per group the int8 sub-scale and
    sub-minimum (n, S, 256 / group): scale = d * sc, zero = -(dmin * m)."""

    d: torch.Tensor
    dmin: torch.Tensor | None
    sc: torch.Tensor
    m: torch.Tensor | None

    def table(self) -> torch.Tensor:
        """kernels.c's layout: (P, S, bytes) uint8, per panel and super-block 16 d, [16 dmin],
        the sub-scales group-major, [the sub-minimums]."""
        def floats(t: torch.Tensor) -> torch.Tensor:  # (n, S) -> (P, S, 64) bytes
            return _panelled(t.float()).transpose(1, 2).contiguous().view(torch.uint8)

        def ints(t: torch.Tensor) -> torch.Tensor:  # (n, S, per) -> (P, S, per * 16) bytes
            q = _panelled(t.to(torch.int8)).permute(0, 2, 3, 1).contiguous()
            return q.view(torch.uint8).reshape(q.shape[0], q.shape[1], -1)

        parts = [floats(self.d)] + ([floats(self.dmin)] if self.dmin is not None else [])
        parts += [ints(self.sc)] + ([ints(self.m)] if self.m is not None else [])
        return torch.cat(parts, dim=-1).contiguous()

    def per_group(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero) per row and group, fp32, as the kernels compute them."""
        scale = (self.d[..., None] * self.sc.float()).reshape(self.d.shape[0], -1)
        if self.dmin is None or self.m is None:
            return scale, None
        return scale, (-(self.dmin[..., None] * self.m.float())).reshape(self.d.shape[0], -1)


def _with_kscales(p: Panels, k: KScales | None) -> Panels:
    if k is None:
        return p
    if p.k % 256:
        raise ValueError(f"K-quant scales need inputs in blocks of 256, got {p.k}")
    table = k.table()
    return dataclasses.replace(p, scale=table, zero=table if k.dmin is not None else None,
                               kblock=256)


def pack_q8(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
            bias: torch.Tensor | None = None, offset: int = 0, group: int = GROUP,
            kscales: KScales | None = None) -> Panels:
    """Byte codes 0..255 for the integer-activation (a8) products: w[n][k] = (codes[n][k] -
    offset) * scales[n][k // group] (+ zeros[...])."""
    n, k = codes.shape
    _check_groups(k, group, "a8 panels")
    if k % QBLOCK:
        raise ValueError(f"a8 panels need inputs divisible by {QBLOCK}, got {k}")
    if codes.min() < 0 or codes.max() > 255:
        raise ValueError("a8 byte codes must lie in 0..255")
    if kscales is not None and codes.max() > 63:
        # kernels.c keeps an octet's sums in int16 beside K-quant scales (6-bit codes at most)
        raise ValueError("a8 byte codes with K-quant scales must lie in 0..63")
    return _with_kscales(Panels(KIND_Q8, _quads(codes), n, k, scale=_group_table(scales),
                                zero=_group_table(zeros), bias=_bias(bias), group=group,
                                offset=offset), kscales)


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
            bias: torch.Tensor | None = None, offset: int = 0, group: int = GROUP,
            kscales: KScales | None = None) -> Panels:
    """4-bit codes 0..15 for the a8 products: w = (code - offset) * scale (+ zero); octet i of
    inputs 8i..8i+7: input 8i + j in the low nibble of byte j, 8i + 4 + j in the high one."""
    n, k = codes.shape
    _check_groups(k, group, "a8 panels")
    if k % QBLOCK:
        raise ValueError(f"a8 panels need inputs divisible by {QBLOCK}, got {k}")
    q = _quads(codes)  # (P, k / 4, 16, 4)
    w = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # (P, k / 8, 16, 4)
    return _with_kscales(Panels(KIND_Q4, w, n, k, scale=_group_table(scales),
                                zero=_group_table(zeros), bias=_bias(bias), group=group,
                                offset=offset), kscales)


def pack_q5(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
            bias: torch.Tensor | None = None, offset: int = 0, group: int = GROUP,
            kscales: KScales | None = None) -> Panels:
    """5-bit codes 0..31 for the a8 products: the low four bits as pack_q4 lays them out, the
    fifth as _high_bits packs them (16 bytes per octet of inputs and panel)."""
    if codes.min() < 0 or codes.max() > 31:
        raise ValueError("5-bit codes must lie in 0..31")
    low = pack_q4(codes & 0xF, scales, zeros, bias, offset=offset, group=group,
                  kscales=kscales)
    return dataclasses.replace(low, kind=KIND_Q5, hbits=_high_bits(codes, 5))


def pack_q6(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
            bias: torch.Tensor | None = None, offset: int = 0, group: int = GROUP,
            kscales: KScales | None = None) -> Panels:
    """6-bit codes 0..63 for the a8 products (GGUF's Q6_K): the low four bits as pack_q4 lays
    them out, the fifth and sixth as _high_bits packs them (32 bytes per octet of inputs and
    panel). The products are those of pack_q8 on the same codes, bit for bit (the same integer
    sums), from 0.75 bytes a weight."""
    if codes.min() < 0 or codes.max() > 63:
        raise ValueError("6-bit codes must lie in 0..63")
    low = pack_q4(codes & 0xF, scales, zeros, bias, offset=offset, group=group,
                  kscales=kscales)
    return dataclasses.replace(low, kind=KIND_Q6, hbits=_high_bits(codes, 6))


# kernels.c's Q5 layout: the fifth bit of element e of vector t is bit Q5_BIT[t][e // 16] of
# byte e % 16 (one variable shift a vector lands each bit on bit 4)
Q5_BIT = ((4, 5), (6, 7), (0, 1), (2, 3))


def _vectors(q: torch.Tensor) -> torch.Tensor:
    """(P, k / 4, 16, 4) quads as kernels.c's octet vectors (P, k / 8, 4, 32): V_t, t = 2h + s,
    is quad 2i + h's columns 8s..8s+7 (element e: column 8s + e // 4, input j = e % 4)."""
    return q.reshape(q.shape[0], -1, 4, 32)


def _high_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The bits above the low four of 5- or 6-bit codes, kernels.c's way: per octet i of each
    panel, Q6 32 bytes (byte e: bits 4-5 of V_t's element e at bits 2t..2t+1), Q5 16 bytes
    (the fifth bit of V_t's element e at bit Q5_BIT[t][e // 16] of byte e % 16)."""
    v = _vectors(_quads(codes >> 4)).to(torch.int32)  # (P, k / 8, 4, 32)
    if bits == 6:
        out = sum(v[:, :, t] << (2 * t) for t in range(4))
    else:
        lanes = v.view(*v.shape[:3], 2, 16)  # (P, k / 8, t, e // 16, e % 16)
        out = sum(lanes[:, :, t, s] << Q5_BIT[t][s] for t in range(4) for s in range(2))
    assert isinstance(out, torch.Tensor)
    return out.to(torch.uint8).contiguous()


def _high_of(p: Panels) -> torch.Tensor:
    """The inverse of _high_bits: (P, k / 4, 16, 4) quads of the bits above the low four."""
    assert p.hbits is not None
    h = p.hbits.to(torch.int32)
    if p.kind == KIND_Q6:
        v = torch.stack([(h >> (2 * t)) & 3 for t in range(4)], dim=2)  # (P, k / 8, 4, 32)
    else:
        v = torch.stack([torch.cat([(h >> Q5_BIT[t][s]) & 1 for s in range(2)], dim=-1)
                         for t in range(4)], dim=2)
    return v.reshape(v.shape[0], -1, PANEL, 4).to(torch.uint8)


def _per_group(t: torch.Tensor | None, p: Panels) -> torch.Tensor | None:
    return None if t is None else t.transpose(1, 2).reshape(-1, p.k // p.group)[: p.n]


def _kscales_of(p: Panels) -> KScales:
    """The K-quant form back from kernels.c's table (the inverse of KScales.table)."""
    assert p.scale is not None
    per, S, P = 256 // p.group, p.k // 256, p.scale.shape[0]
    has_min = p.zero is not None
    t = p.scale.view(P, S, -1)

    def floats(at: int) -> torch.Tensor:  # (P, S, 64 bytes) -> (n, S)
        f = t[..., at:at + 64].contiguous().view(torch.float32)  # (P, S, 16)
        return f.permute(0, 2, 1).reshape(P * PANEL, S)[: p.n]

    def ints(at: int) -> torch.Tensor:  # (P, S, per * 16) -> (n, S, per)
        q = t[..., at:at + per * PANEL].contiguous().view(torch.int8).view(P, S, per, PANEL)
        return q.permute(0, 3, 1, 2).reshape(P * PANEL, S, per)[: p.n]

    at = 128 if has_min else 64
    return KScales(floats(0), floats(64) if has_min else None, ints(at),
                   ints(at + per * PANEL) if has_min else None)


def _scale_zero(p: Panels) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n, k / group) scales and zeros (or None) of grouped or a8 panels."""
    if p.kblock:
        return _kscales_of(p).per_group()
    scale = _per_group(p.scale, p)
    assert scale is not None
    return scale, _per_group(p.zero, p)


def group_scales(p: Panels) -> torch.Tensor:
    """(n, k / group) scales of grouped or a8 panels."""
    return _scale_zero(p)[0]


def codes_of(p: Panels) -> torch.Tensor:
    """The (n, k) weight values (F32, BF16) or integer codes the panels hold (a8 kinds: the
    stored codes, before their offset)."""
    if p.kind == KIND_I4:
        lo, hi = p.w & 0xF, p.w >> 4
        flat = torch.cat([lo, hi], dim=-1)  # (P, k, 16)
    elif p.kind in QUANT_KINDS:
        q = p.w
        if p.kind in (KIND_Q4, KIND_Q5, KIND_Q6):
            q = torch.stack([q & 0xF, q >> 4], dim=2).reshape(q.shape[0], p.k // 4, PANEL, 4)
        if p.kind in (KIND_Q5, KIND_Q6):
            q = q | (_high_of(p) << 4)
        return q.transpose(1, 2).reshape(-1, p.k)[: p.n]
    else:
        flat = p.w
    return flat.transpose(1, 2).reshape(-1, p.k)[: p.n]


def weight_of(p: Panels) -> torch.Tensor:
    """The (n, k) fp32 weight the panels multiply by, as the kernel holds it (codes * scale,
    + zero where there are zeros; a8 kinds: (code - offset) * scale + zero)."""
    c = codes_of(p).float()
    if p.kind == KIND_I8:
        assert p.scale is not None
        return c * p.scale[: p.n, None]
    if p.kind in (KIND_I4, KIND_I8G, *QUANT_KINDS):
        if p.kind in QUANT_KINDS:
            c = c - p.offset
        scales, zero = _scale_zero(p)
        scale = scales.repeat_interleave(p.group, 1)
        if zero is None:
            return c * scale
        return torch.addcmul(zero.repeat_interleave(p.group, 1), c, scale)
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
        _check(_lib().sd_matmul(x2.data_ptr(), x2.shape[0], ctypes.byref(mat), y.data_ptr()),
               "a product")
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
    _check(_lib().sd_attention(q.data_ptr(), q.stride(0), r, nh, d, ctypes.byref(spec),
                               out.data_ptr()), "attention")
    return out


def block(x: torch.Tensor, weights: SdBlockW, cos: torch.Tensor, sin: torch.Tensor,
          slots: torch.Tensor, spec: SdAttn) -> None:
    """Apply one transformer block to x (M, hidden) fp32 contiguous, in place (kernels.c
    sd_block); cos, sin (M, head_dim) contiguous; slots (M,) int64: where each row's key and
    value go in its cache row."""
    _check(_lib().sd_block(x.data_ptr(), x.shape[0], ctypes.byref(weights), cos.data_ptr(),
                           sin.data_ptr(), slots.data_ptr(), ctypes.byref(spec)), "a block")


def blocks(x: torch.Tensor, weights: ctypes.Array[SdBlockW], cos: torch.Tensor,
           sin: torch.Tensor, slots: torch.Tensor, specs: ctypes.Array[SdAttn]) -> None:
    """Apply every block to x (M, hidden) fp32 contiguous, in place, in one call (kernels.c
    sd_forward without its head): weights[l] and specs[l] of layer l."""
    _check(_lib().sd_forward(x.data_ptr(), x.shape[0], len(weights), weights, cos.data_ptr(),
                             sin.data_ptr(), slots.data_ptr(), specs, None, 0.0, None, None, 0,
                             None), "the blocks of a forward pass")


def forward(x: torch.Tensor, blocks: ctypes.Array[SdBlockW], cos: torch.Tensor,
            sin: torch.Tensor, slots: torch.Tensor, specs: ctypes.Array[SdAttn],
            final_norm: torch.Tensor, eps: float, head: Panels, which: torch.Tensor
            ) -> torch.Tensor:
    """Every block, the final norm and the head in one call (kernels.c sd_forward): x (M,
    hidden) fp32 contiguous (overwritten), `which` (W,) int64 the rows whose logits are
    returned, (W, vocab)."""
    which = which.to(torch.int64).contiguous()
    logits = torch.empty(which.numel(), head.n, dtype=torch.float32)
    mat = head.struct()
    _check(_lib().sd_forward(x.data_ptr(), x.shape[0], len(blocks), blocks, cos.data_ptr(),
                             sin.data_ptr(), slots.data_ptr(), specs, final_norm.data_ptr(),
                             eps, ctypes.byref(mat), which.data_ptr(), which.numel(),
                             logits.data_ptr()), "a forward pass")
    return logits
