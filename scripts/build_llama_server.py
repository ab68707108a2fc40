"""Build llama.cpp's `llama-server` from the llama.cpp that llama-cpp-python 0.3.36 vendors, the
way its users build it, for `specdecode bench --endpoint` (issue #44): the peer users run for
speculative decoding is `llama-server -m TARGET.gguf -md DRAFT.gguf`.

Usage: python scripts/build_llama_server.py [--exact] [--safe] [--rebuild]
Prints the path of the binary (cached; a second run prints it at once).

- Source: the llama-cpp-python 0.3.36 sdist from the registry (`pip download --no-binary`),
  so the server runs exactly the kernels the llama.cpp backend and `Llama.generate` run.
- Flags: llama.cpp's defaults as a user's `cmake -B build && cmake --build build` gives them:
  `-march=native` (GGML_NATIVE), llamafile's sgemm on, AMX where the CPU and compiler run it;
  OpenSSL, the web UI download and the tests off (the machine builds offline). With GCC 12
  (Debian 12's), ggml's AMX tile configuration is optimised away and its AMX kernels die with
  SIGILL on AMX CPUs: there AMX is built out, as scripts/install_llamacpp.py decides
  (`tile_config_dropped`), and said. `--safe` builds AMX out anyway.
- `--exact`: the project's exact build instead (llamafile's sgemm off), to compare with.
- Proof: the binary serves one completion of the default SmolLM2 GGUF before it is cached; a
  crash (SIGILL) rebuilds AMX off and says so.
The binary is static (no shared libraries to find), written under a temporary name and
renamed into place. About 10 minutes on 2 cores, once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# one AMX decision for both builds
from install_llamacpp import (
    NO_AMX,
    VERSION,
    compiler,
    compiler_version,
    cpu_flags,
    tile_config_dropped,
)

USER_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
              "-DCMAKE_BUILD_TYPE=Release")
EXACT = ("-DGGML_LLAMAFILE=OFF",)
SAFE = (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


def say(msg: str) -> None:
    print(f"build_llama_server: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    env = os.environ.get("SPECDECODE_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or
                                      Path.home() / ".cache") / "specdecode"
    return base / "llama-server"


def key(flags: list[str], cc: str) -> str:
    parts = [VERSION, " ".join(flags), " ".join(cpu_flags()), compiler_version(cc)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def source(work: Path) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, unpacked under `work`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                    ":all:", f"llama-cpp-python=={VERSION}", "-d", str(work)], check=True)
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    return next(work.glob("llama_cpp_python-*/")) / "vendor" / "llama.cpp"


def build(src: Path, build_dir: Path, flags: list[str]) -> Path:
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *gen, *flags], check=True,
                   stdout=subprocess.DEVNULL)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs],
                   check=True, stdout=subprocess.DEVNULL)
    return next(build_dir.rglob("bin/llama-server"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proves(binary: Path) -> str | None:
    """None if `binary` serves one greedy completion of the default SmolLM2 GGUF, else why not."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from specdecode.models.paths import default_model_path

    port = free_port()
    proc = subprocess.Popen([str(binary), "-m", str(default_model_path()), "--host",
                             "127.0.0.1", "--port", str(port), "-t", "2", "-c", "512"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if proc.poll() is not None:
                code = proc.returncode
                name = signal.Signals(-code).name if code < 0 else f"exit {code}"
                return f"llama-server died ({name})"
            try:
                body = json.dumps({"prompt": "Hello", "n_predict": 4, "temperature": 0}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as r:
                    if json.loads(r.read()).get("content") is not None:
                        return None
            except OSError:
                time.sleep(0.5)
        return "llama-server did not answer within 120 s"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exact", action="store_true",
                    help="llamafile's sgemm off (the project's exact build), not the user build")
    ap.add_argument("--safe", action="store_true", help="build AMX out from the start")
    ap.add_argument("--rebuild", action="store_true", help="ignore a cached binary")
    args = ap.parse_args(argv)
    cc = compiler()
    flags = [*USER_FLAGS, *(EXACT if args.exact else ())]
    sets = [(flags, "native (llama.cpp's defaults)")]
    safe = [*flags, *SAFE]
    if args.safe:
        sets = [(safe, "AMX off (asked for)")]
    elif tile_config_dropped(cc):
        sets = [(safe, f"AMX off: {compiler_version(cc)} drops the AMX tile configuration, so "
                       "ggml's AMX kernels would die with SIGILL on AMX CPUs")]
    else:
        sets.append((safe, "AMX off: the native build died"))
    for chosen, why in sets:
        dest = cache_dir() / key(chosen, cc) / "llama-server"
        if dest.is_file() and not args.rebuild:
            print(dest)
            return 0
        say(f"building llama-server {VERSION} ({why}; about 10 minutes on 2 cores)")
        with tempfile.TemporaryDirectory() as tmp:
            binary = build(source(Path(tmp)), Path(tmp) / "build", chosen)
            problem = proves(binary)
            if problem is not None:
                say(f"{problem}; {why} does not run here")
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            partial = dest.with_name(f".llama-server.partial-{os.getpid()}")
            shutil.copy2(binary, partial)
            os.replace(partial, dest)
            (dest.parent / "FLAGS").write_text(f"{why}\n{' '.join(chosen)}\n", encoding="utf-8")
        say(f"built with {why}")
        print(dest)
        return 0
    say("no build of llama-server runs on this CPU")
    return 1


if __name__ == "__main__":
    sys.exit(main())
