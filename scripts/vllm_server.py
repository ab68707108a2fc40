"""Start vLLM's OpenAI-compatible server on this project's model, plain or speculative, from the
venv that scripts/install_vllm.sh made (vLLM's pins conflict with this package's extras, so it
lives in a venv of its own; this module runs in either).

    python scripts/vllm_server.py ngram --port 8102      # serves until Ctrl-C
    python scripts/vllm_server.py lookup --print-command # the command line only
    python scripts/vllm_server.py --print-model          # the HF folder

Configurations (`CONFIGS`): `plain`; vLLM's own `ngram` (the lookup the issue tried: 4 tokens,
matches of 2 to 4) and `suffix` (Arctic Inference's suffix tree; scripts/install_vllm.sh builds
it); this project's `lookup` (integrations.vllm.NgramLookup) and `suffix-lookup`
(SuffixLookup) as `custom_class` proposers; `distilled`, vLLM's `draft_model` with this
project's distilled draft exported as a Hugging Face folder; or any `--speculative-config`
JSON.

The flags that work on a CPU (docs/serving.md, "vLLM"): float32 (SmolLM2's GGUF de-quantized
exactly, as this project's fp32 target), `--enforce-eager` (no torch.compile), a KV cache of a
fixed size (`--kv-cache-memory-bytes`: on the CPU build `--gpu-memory-utilization` is a share of
the machine's memory, from which the worker's own memory is subtracted, so its default 0.92
fails and small shares fail too once the worker is loaded), and threads left to the OS
(`VLLM_CPU_OMP_THREADS_BIND=nobind`, `OMP_NUM_THREADS`): vLLM's default binds one core and
reserves the other for its scheduler on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specdecode.errors import SpecDecodeError

VENV_ENV = "SPECDECODE_VLLM_VENV"
SRC = Path(__file__).resolve().parents[1] / "src"  # the folder holding the `specdecode` package
INSTALL_HINT = "run `bash scripts/install_vllm.sh` (or set $SPECDECODE_VLLM_VENV to its venv)"
MODEL_NAME = "smollm2"
DISTILLED = "<the distilled draft's HF export>"  # filled in by speculative_config
CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "lookup": {"method": "custom_class", "num_speculative_tokens": 8,
               "model": "specdecode.integrations.vllm.NgramLookup"},
    "suffix-lookup": {"method": "custom_class", "num_speculative_tokens": 8,
                      "model": "specdecode.integrations.vllm.SuffixLookup"},
    # vLLM's draft-model speculation with this project's distilled draft, exported as an HF
    # folder (drafters.distilled_hf) when the configuration is resolved; 2 tokens: the draft
    # agrees with the target's greedy token on few Spec-Bench positions (docs/measurements/vllm.md)
    "distilled": {"method": "draft_model", "num_speculative_tokens": 2, "model": DISTILLED},
}


def default_venv() -> Path:
    """$SPECDECODE_VLLM_VENV, else .venv-vllm/ in the checkout this package runs from."""
    env = os.environ.get(VENV_ENV)
    return Path(env).expanduser() if env else SRC.parent / ".venv-vllm"


def vllm_python(venv: Path | None = None) -> Path:
    """The vLLM venv's interpreter; an error naming the install script when there is none."""
    venv = venv or default_venv()
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SpecDecodeError(f"vLLM is not installed: no {python}; {INSTALL_HINT}")
    return python


def installed_vllm(venv: Path) -> str | None:
    """The version of the vLLM installed in `venv` (read from its package metadata: vllm-cpu or
    vllm), None where none is found."""
    for meta in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info/METADATA")):
        name = meta.parent.name.split("-")[0]
        if name not in ("vllm", "vllm_cpu"):
            continue
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def model_folder() -> Path:
    """SmolLM2's Hugging Face folder this project writes (the GGUF de-quantized to fp32
    safetensors, with its tokenizer and chat template), converting it first if needed."""
    from specdecode.models.loading import resolve_folder

    return resolve_folder(None)[0]


def distilled_folder() -> Path:
    """The shipped distilled draft for SmolLM2 as a Hugging Face folder (exported once into the
    cache: drafters.distilled_hf)."""
    from specdecode.drafters.distilled import DEFAULT_DIR
    from specdecode.drafters.distilled_hf import cached_hf_export
    from specdecode.models.paths import default_model_path

    return cached_hf_export(DEFAULT_DIR, default_model_path())


def speculative_config(config: str) -> dict[str, Any] | None:
    """A configuration's `--speculative-config` (None: plain): a name of CONFIGS or JSON."""
    if config in CONFIGS:
        spec = CONFIGS[config]
        if spec is not None and spec.get("model") == DISTILLED:
            return {**spec, "model": str(distilled_folder())}
        return spec
    try:
        value = json.loads(config)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise SpecDecodeError(f"{config!r}: expected one of {', '.join(CONFIGS)} or a "
                              "--speculative-config JSON object")
    return value


@dataclass(frozen=True)
class Launch:
    """How to start one vLLM server."""

    config: str = "plain"
    port: int = 8100
    threads: int = 2
    max_model_len: int = 2048
    kv_cache: str = "1G"  # --kv-cache-memory-bytes
    model: Path | None = None  # default: model_folder()
    venv: Path | None = None  # default: default_venv()
    extra: tuple[str, ...] = ()  # more server flags

    def command(self) -> list[str]:
        """The server's command line; refused (SpecDecodeError) for a custom_class configuration
        where the venv holds a vLLM that cannot run this project's proposers."""
        spec = speculative_config(self.config)
        python = vllm_python(self.venv)
        version = installed_vllm(self.venv or default_venv())
        if spec is not None and spec.get("method") == "custom_class" and version is not None:
            from specdecode.integrations.vllm import check_vllm

            check_vllm(version)
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model or model_folder()),
               "--served-model-name", MODEL_NAME, "--dtype", "float32",
               "--max-model-len", str(self.max_model_len), "--enforce-eager",
               "--kv-cache-memory-bytes", self.kv_cache, "--seed", "0",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-uvicorn-access-log"]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        return cmd + list(self.extra)

    def env(self) -> dict[str, str]:
        """The server's environment: threads left to the OS, this checkout's package first on
        the path (so `custom_class` imports these proposers, not another copy)."""
        env = dict(os.environ)
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(self.threads),
                   PYTHONPATH=os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH"))
                                              if p))
        return env


class Server:
    """A vLLM server process (its own process group: vLLM starts an engine and a worker
    process), its log in a file; `stop` ends the group."""

    def __init__(self, launch: Launch, log_path: Path) -> None:
        self.launch = launch
        self.url = f"http://127.0.0.1:{launch.port}"
        self.log_path = log_path
        command = launch.command()
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=launch.env(),
                                         start_new_session=True)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until /v1/models answers; an error with the log's tail if the process ends or the
        time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SpecDecodeError(f"vLLM ({self.launch.config}) exited with status "
                                      f"{self.proc.returncode} while starting; its log "
                                      f"{self.log_path} ends:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise SpecDecodeError(f"vLLM ({self.launch.config}) did not answer within {timeout_s:.0f}"
                              f" s; its log {self.log_path} ends:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/vllm_server.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="plain",
                        help=f"{' | '.join(CONFIGS)} | a --speculative-config JSON object")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache", default="1G", help="--kv-cache-memory-bytes (default 1G)")
    parser.add_argument("--print-command", action="store_true",
                        help="print the command line and exit")
    parser.add_argument("--print-model", action="store_true",
                        help="print (making it if needed) the model's HF folder and exit")
    args, extra = parser.parse_known_args(argv)
    try:
        if args.print_model:
            print(model_folder())
            return 0
        launch = Launch(args.config, args.port, args.threads, args.max_model_len, args.kv_cache,
                        extra=tuple(extra))
        command = launch.command()
    except SpecDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_command:
        print(" ".join(_quote(c) for c in command))
        return 0
    os.execve(command[0], command, launch.env())


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


if __name__ == "__main__":
    raise SystemExit(main())
