"""Does the installed llama.cpp binary run on this CPU? Asked in a child process, once per binary
and CPU, and the answer cached.

Why: a llama.cpp build can hold instructions or kernels this CPU cannot execute, and the first
one kills the interpreter with no message (`Fatal Python error: Illegal instruction`). Two
causes seen here: a wheel compiled with `-march=native` on one CPU kind and reused on another;
and ggml's AMX kernels built by GCC 12 on an AMX Xeon: that compiler's `_tile_loadconfig`
intrinsic tells the optimiser it reads 8 bytes, so the stores of the tile shapes into the
64-byte configuration are removed as dead, the tiles stay unconfigured and the first tile
instruction raises #UD (SIGILL), although the CPU, the hypervisor and the kernel's permission
all allow AMX (docs/llamacpp.md; scripts/install_llamacpp.py checks the compiler for it).

The probe writes tiny models whose matrices are of each weight type a llama.cpp peer or target
here meets (F16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), and decodes 1, 8 and 33 positions of each in a
child process, opened both ways this project opens models: as the backend does (extra buffer
types off, so no weight is repacked for AMX or other CPU-specific layouts) and as
llama-cpp-python's `Llama` does by default (the peer; AMX-repacked weights where the build has
AMX). A child that dies by a signal or hangs names the step it was in; the parent turns that
into a SpecDecodeError naming the cause and the fix, before anything in this process touches
the binary. The result is cached under `<cache>/probes/` keyed by the binary's bytes, the CPU's
flags and this probe's version, so the check costs a few seconds once per installation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdecode.errors import SpecDecodeError

PROBE_VERSION = 1
TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
WIDTHS = (1, 8, 33)  # one row (a plain step: ggml's vector kernels), a draft, past a 32-row tile
MODES = {"backend": False, "default": True}  # mode -> use_extra_bufts
TIMEOUT_S = 180.0
BINDING = "llama_cpp"  # the module probed (tests probe a fake that faults on purpose)
FIX = ("rebuild the binding with `bash scripts/install_llamacpp.sh --rebuild` (it tests its "
       "build and falls back to flags that run here; docs/llamacpp.md)")

# the tiny model: one block, every matrix a multiple of 256 inputs (a K-quant super-block) and
# of 32 outputs (the AMX kernels' tile pair), so every kernel path above takes it
HIDDEN, FF, HEADS, VOCAB = 256, 512, 4, 512


@dataclass(frozen=True)
class ProbeResult:
    """What the child processes saw: per mode, None (every step ran) or why it stopped."""

    binary: str
    failures: dict[str, str | None]

    def ok(self, mode: str) -> bool:
        return self.failures.get(mode) is None

    def as_dict(self) -> dict[str, Any]:
        return {"binary": self.binary, "failures": self.failures}


# --- the binary's identity -------------------------------------------------------------------

def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.machine() + " " + platform.processor()


def _module_files(module: str) -> list[Path]:
    """The binding's package and shared libraries (what a rebuild changes), without importing
    it (importing alone is harmless, but the point is to touch nothing before the probe)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SpecDecodeError(f"the llama.cpp binding ({module}) is not installed: run "
                              "`bash scripts/install_llamacpp.sh` (docs/llamacpp.md)")
    root = Path(spec.origin).parent
    libs = sorted(p for p in root.rglob("*") if p.suffix in (".so", ".dylib") or ".so." in p.name)
    return [Path(spec.origin), *libs]


def binary_key(module: str) -> str:
    """Digest of the binding's libraries (size, mtime and the first MiB of each: a rebuild
    changes all three), the CPU's flags and the probe's version."""
    h = hashlib.sha256(f"{PROBE_VERSION}\n{_cpu_flags()}\n".encode())
    for path in _module_files(module):
        st = path.stat()
        h.update(f"{path.name} {st.st_size} {st.st_mtime_ns}\n".encode())
        with path.open("rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()[:24]


def _probe_dir() -> Path:
    from specdecode.models.paths import cache_root

    return cache_root() / "probes"


# --- the tiny models -------------------------------------------------------------------------

def _kquant_blocks(rows: int, cols: int, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed K-quant blocks (the `gguf` package cannot quantize to these):
    small finite fp16 scales, random codes. Values do not matter to a crash probe."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype.name == "Q4_K":  # d, dmin (fp16) lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d (fp16) ends the block
        raw[..., size - 2:size] = scale
    return raw.reshape(rows, cols // block * size)


def _matrix(rows: int, cols: int, type_name: str, rng: np.random.Generator) -> tuple[
        np.ndarray, Any]:
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if type_name in ("Q4_K", "Q6_K"):
        return _kquant_blocks(rows, cols, qtype, rng), qtype
    return np.asarray(quants.quantize(w, qtype)), qtype


def write_probe_model(dest: Path, type_name: str) -> None:
    """A one-block Llama GGUF whose matrices (embedding and head included) are `type_name`."""
    from gguf import GGUFWriter, LlamaFileType

    from specdecode.models.gguf_vocab import byte_vocab

    rng = np.random.default_rng(0)
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(f"specdecode probe {type_name}")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    byte_vocab(writer, VOCAB, 2)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_v.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FF, HIDDEN), "blk.0.ffn_up.weight": (FF, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FF)}
    for name, (rows, cols) in shapes.items():
        data, qtype = _matrix(rows, cols, type_name, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)
    for norm in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(norm, np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dest)


def probe_models(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for type_name in TYPES:
        path = folder / f"probe-v{PROBE_VERSION}-{type_name}.gguf"
        if not path.exists():
            write_probe_model(path, type_name)
        out[type_name] = path
    return out


# --- the child -------------------------------------------------------------------------------

def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def child_main(module: str, mode: str, models: list[Path]) -> int:
    """Load each model as `mode` opens it and decode every width; one progress line per step
    before it runs, so a parent that sees this process die knows where."""
    import importlib

    L = importlib.import_module(module)
    quiet = L.llama_log_callback(lambda level, text, user: None)  # kept alive while it runs
    L.llama_log_set(quiet, None)
    L.llama_backend_init()
    for path in models:
        _say(f"step load {path.name}")
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = MODES[mode]
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            _say(f"error {path.name}: llama.cpp cannot load it")
            return 3
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 128, 64, 64, 1
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = 0
        ctx = L.llama_init_from_model(model, cp)
        batch = L.llama_batch_init(64, 0, 1)
        pos = 0
        for width in WIDTHS:
            _say(f"step decode {path.name} {width}")
            for i in range(width):
                batch.token[i] = 3 + (pos + i) % 200
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = True
            batch.n_tokens = width
            if L.llama_decode(ctx, batch) != 0:
                _say(f"error {path.name}: llama_decode failed at width {width}")
                return 3
            pos += width
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    _say("done")
    return 0


# --- the parent ------------------------------------------------------------------------------

def describe_exit(returncode: int | None, last: str, mode: str) -> str:
    """One line saying how the child ended and in which step."""
    where = last.removeprefix("step ").strip() or "importing the binding"
    opened = ("as this project's backend opens models (extra buffer types off)" if mode ==
              "backend" else "as llama-cpp-python's Llama opens them by default (extra buffer "
              "types on: AMX or repacked weights where the build has them)")
    if returncode is None:
        return f"hung for {TIMEOUT_S:.0f} s in: {where}, {opened}"
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        what = {"SIGILL": " (an instruction this CPU cannot run)",
                "SIGSEGV": " (a memory fault)", "SIGBUS": " (a bus error)",
                "SIGFPE": " (an arithmetic fault)"}.get(name, "")
        return f"killed by {name}{what} in: {where}, {opened}"
    return f"exited with status {returncode} in: {where}, {opened}"


def run_child(module: str, mode: str, models: list[Path]) -> str | None:
    """Run the probe child; None if it finished, else why not."""
    cmd = [sys.executable, "-m", "specdecode.models.llamacpp_probe", "--child", "--module",
           module, "--mode", mode, *map(str, models)]
    # without faulthandler: its dump of every thread's stack is noise here, the signal says it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
        return describe_exit(None, steps[-1] if steps else "", mode)
    lines = proc.stdout.splitlines()
    if proc.returncode == 0 and lines and lines[-1] == "done":
        return None
    errors = [ln.removeprefix("error ") for ln in lines if ln.startswith("error ")]
    if errors:
        return f"{errors[-1]} ({mode} mode)"
    steps = [ln for ln in lines if ln.startswith("step ")]
    detail = describe_exit(proc.returncode, steps[-1] if steps else "", mode)
    tail = proc.stderr.strip().splitlines()[-1:] if proc.returncode > 0 else []
    return detail + (f": {tail[0]}" if tail else "")


def _default_model() -> list[Path]:
    from specdecode.models.paths import default_model_path

    try:
        return [default_model_path()]
    except SpecDecodeError:
        return []


def probe(module: str | None = None, refresh: bool = False,
          extra: list[Path] | None = None) -> ProbeResult:
    """The cached probe result for the installed binding on this CPU (run it if missing);
    `extra` GGUFs are decoded too (the install script adds the default model)."""
    module = module or BINDING
    key = binary_key(module)
    cached = _probe_dir() / f"llamacpp-{key}.json"
    if cached.exists() and not refresh:
        try:
            raw = json.loads(cached.read_text(encoding="utf-8"))
            return ProbeResult(raw["binary"], dict(raw["failures"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache entry: probe again
    models = [*probe_models(_probe_dir() / "models").values(), *(extra or [])]
    failures = {mode: run_child(module, mode, models) for mode in MODES}
    result = ProbeResult(str(_module_files(module)[0].parent), failures)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=cached.parent, delete=False,
                                     suffix=".tmp") as f:
        json.dump(result.as_dict(), f)
    os.replace(f.name, cached)
    return result


def require_runs(mode: str, what: str, module: str | None = None) -> None:
    """Raise one clear error if the binding dies on this CPU when opened as `mode` does."""
    result = probe(module)
    failure = result.failures.get(mode)
    if failure is not None:
        raise SpecDecodeError(
            f"{what}: the llama.cpp binding at {result.binary} does not run on this CPU: "
            f"a child process decoding a tiny model was {failure}. Nothing was loaded in this "
            f"process. To fix it, {FIX}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specdecode.models.llamacpp_probe",
        description="Check that the installed llama.cpp binding runs on this CPU.")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--module", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=tuple(MODES), default="backend",
                        help=argparse.SUPPRESS)
    parser.add_argument("--refresh", action="store_true", help="ignore a cached result")
    parser.add_argument("--with-default-model", action="store_true",
                        help="also decode the default GGUF (SmolLM2's Q4_1) where installed")
    parser.add_argument("models", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.module or BINDING, args.mode, args.models)
    try:
        result = probe(args.module, refresh=args.refresh,
                       extra=_default_model() if args.with_default_model else [])
    except SpecDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for mode in MODES:
        failure = result.failures[mode]
        print(f"{mode}: {'runs' if failure is None else failure}")
    return 0 if all(result.ok(m) for m in MODES) else 1


if __name__ == "__main__":
    sys.exit(main())
