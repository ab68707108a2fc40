"""Build, cache, install and prove llama-cpp-python (the llama.cpp backend's binding and peer).

Run through scripts/install_llamacpp.sh (inside the venv; `--rebuild` ignores a cached wheel).

The build is the way the backend is exact: llamafile's sgemm off (its blockings depend on the
batch shape; docs/llamacpp.md), `-march=native` otherwise. Two things can still make a build die
on a CPU with `Illegal instruction`, and this script guards against both:
- a wheel compiled for another CPU kind: the wheel cache is keyed by the version, the flags,
  `CMAKE_ARGS` from the environment (honoured: appended after this script's flags, so a user's
  `-D` wins; then the backend's load-time check decides whether speculation is exact), the
  Python tag, the machine, the CPU's flags and the compiler's version;
- ggml's AMX kernels built by a compiler whose `_tile_loadconfig` declares an 8-byte operand
  (GCC 12, Debian 12's): the optimiser deletes the stores of the tile shapes, and the first tile
  instruction on an AMX CPU raises SIGILL. `tile_config_dropped` compiles that pattern and
  compares it with a full 64-byte operand; where the compiler drops the configuration, AMX is
  built out (`-mno-amx-*`) and the script says so.
After installing, it proves the build: models.llamacpp_probe decodes tiny F16, Q8_0, Q4_0, Q4_1,
Q4_K and Q6_K models and the default GGUF in child processes, both as the backend and as
llama-cpp-python's `Llama` open them. A crash rebuilds with the safe flags (AMX off) and says so;
a crash of the safe build fails the install with the probe's message.

The cached wheel is written under a temporary name and renamed into place; a cached wheel that
is not a whole zip (an interrupted copy) is deleted and rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.3.36"
FLAGS = ("-DGGML_NATIVE=ON", "-DGGML_LLAMAFILE=OFF", "-DLLAMA_OPENSSL=OFF")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
SAFE = (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
REPO = Path(__file__).resolve().parent.parent

# The AMX kernels' pattern: a 64-byte tile configuration built on the stack, then loaded.
TILE_CONFIG_C = r"""
#include <immintrin.h>
#include <stdint.h>
struct cfg { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
#ifdef FULL_OPERAND
static inline void load(const void *c) {
    __asm__ volatile("ldtilecfg %0" :: "m"(*(const struct cfg *)c));
}
#else
static inline void load(const void *c) { _tile_loadconfig(c); }
#endif
void configure(void) {
    struct cfg c __attribute__((aligned(64))) = {0};
    c.palette = 1;
    for (int i = 0; i < 8; i++) { c.rows[i] = 16; c.colsb[i] = 64; }
    load(&c);
}
"""


def say(msg: str) -> None:
    print(f"install_llamacpp: {msg}", file=sys.stderr, flush=True)


def compiler() -> str:
    """The C++ compiler CMake will use: ggml's AMX kernels are C++."""
    return os.environ.get("CXX") or "c++"


def compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    except OSError:
        return "none"
    return (out.stdout.splitlines() or ["unknown"])[0]


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return sorted(line.split(":", 1)[1].split())
    except OSError:
        pass
    return [platform.processor()]


def _instructions_before_load(cc: str, full_operand: bool) -> int | None:
    """How many instructions `configure` runs before ldtilecfg, or None if `cc` cannot build
    AMX code at all."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tile.cpp"
        src.write_text(TILE_CONFIG_C, encoding="utf-8")
        cmd = [cc, "-O2", "-mamx-tile", "-S", "-o", "-", str(src)]
        if full_operand:
            cmd.insert(1, "-DFULL_OPERAND")
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError:
            return None
    if out.returncode != 0:
        return None
    body = out.stdout.split("configure:", 1)[-1].split("ldtilecfg", 1)[0]
    return sum(1 for line in body.splitlines() if re.match(r"\s+[a-z]", line))


def tile_config_dropped(cc: str, full_operand_both: bool = False) -> bool:
    """True if `cc` deletes the tile configuration's stores before `_tile_loadconfig` (fewer
    instructions than with a full 64-byte operand). `full_operand_both` compiles the corrected
    loader twice (a compiler without the bug must answer False: the tests' control)."""
    intrinsic = _instructions_before_load(cc, full_operand=full_operand_both)
    full = _instructions_before_load(cc, full_operand=True)
    if intrinsic is None or full is None:
        return False  # no AMX code can be built: nothing to drop
    return intrinsic < full


def wheel_key(flags: list[str], user_args: str, cc: str) -> str:
    parts = [VERSION, " ".join(flags), user_args, platform.machine(),
             sys.implementation.cache_tag or "", " ".join(cpu_flags()), compiler_version(cc)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def wheel_cache() -> Path:
    env = os.environ.get("SPECDECODE_WHEELS")
    if env:
        return Path(env)
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "specdecode" / "wheels"


def whole_wheel(folder: Path) -> Path | None:
    """The folder's wheel if it is a complete zip holding the binding, else None."""
    wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    if len(wheels) != 1:
        return None
    try:
        with zipfile.ZipFile(wheels[0]) as z:
            if z.testzip() is not None or "llama_cpp/__init__.py" not in z.namelist():
                return None
    except (OSError, zipfile.BadZipFile):
        return None
    return wheels[0]


def build(folder: Path, cmake_args: str) -> Path:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    say(f"building llama-cpp-python {VERSION} with CMAKE_ARGS={cmake_args} (about 6 minutes "
        "on 2 cores)")
    env = dict(os.environ, CMAKE_ARGS=cmake_args,
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir",
                    "-w", str(tmp), f"llama-cpp-python=={VERSION}"], env=env, check=True)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    wheel = whole_wheel(folder)
    if wheel is None:
        raise SystemExit(f"install_llamacpp: the build in {folder} left no whole wheel")
    return wheel


def install(wheel: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--force-reinstall", str(wheel)], check=True)


def prove() -> tuple[bool, str]:
    """Run the crash probe (fresh) in children, the default GGUF included where installed."""
    cmd = [sys.executable, "-m", "specdecode.models.llamacpp_probe", "--refresh",
           "--with-default-model"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"),
                                                       env.get("PYTHONPATH")]))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return out.returncode == 0, (out.stdout + out.stderr).strip()


def flag_sets(cc: str, forced_safe: bool) -> list[tuple[list[str], str]]:
    """The builds to try in order, each with why."""
    native = list(FLAGS)
    safe = [*FLAGS, *SAFE]
    if forced_safe:
        return [(safe, "AMX off (asked for)")]
    if tile_config_dropped(cc):
        return [(safe, f"AMX off: {compiler_version(cc)} drops the AMX tile configuration "
                       "(_tile_loadconfig's 8-byte operand), so ggml's AMX kernels would die "
                       "with SIGILL on AMX CPUs")]
    return [(native, "native"), (safe, "AMX off: the native build died in the probe")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/install_llamacpp.sh")
    parser.add_argument("--rebuild", action="store_true", help="ignore a cached wheel")
    parser.add_argument("--safe", action="store_true", help="build AMX off from the start")
    args = parser.parse_args(argv)
    cc = compiler()
    user_args = os.environ.get("CMAKE_ARGS", "")
    if user_args:
        say(f"CMAKE_ARGS from the environment is honoured, after this script's flags: "
            f"{user_args}")
    last = ""
    for flags, why in flag_sets(cc, args.safe):
        cmake_args = " ".join(shlex.quote(f) for f in flags)
        if user_args:
            cmake_args += " " + user_args
        folder = wheel_cache() / f"llama-cpp-python-{wheel_key(flags, user_args, cc)}"
        wheel = None if args.rebuild else whole_wheel(folder)
        if wheel is None and folder.exists():
            say(f"{folder}: not a whole wheel (an interrupted build or copy): rebuilding")
        say(f"build: {why}")
        if wheel is None:
            wheel = build(folder, cmake_args)
        else:
            say(f"using the cached wheel {wheel}")
        install(wheel)
        ok, report = prove()
        if ok:
            say("the build runs here: " + " | ".join(report.splitlines()))
            return 0
        last = report
        say(f"the build dies on this CPU: {report}")
        args.rebuild = False
    say("no build of llama-cpp-python runs on this CPU; the last probe said: " + last)
    return 1


if __name__ == "__main__":
    sys.exit(main())
