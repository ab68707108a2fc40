"""Benchmark (not a test): the Qwen2.5-Coder pair (1.5B target, 0.5B draft; `specdecode models
install qwen2.5-coder`) against the peers its users run, in one interleaved run (issue #44,
docs/measurements/2026-12-07-qwen-pair.md).

    python benchmarks/qwen_pair.py --out runs/qwen-pair [--systems A,B,...] [--per-category 4]
        [--max-tokens 128] [--batch-sizes 1] [--threads 2] [--resume] [--costs]

Every system is an OpenAI-compatible server on 127.0.0.1, all started at once and measured by
`specdecode bench --endpoint` over the same prompts, interleaved (the first system is the
baseline of the report's ratios):

- `generate`: llama-cpp-python's own server (`python -m llama_cpp.server`, its `Llama.generate`)
  on the 1.5B, plain, as its users run it (its process sets no GGML_CPU_TILED_MM);
- `server`: llama.cpp's `llama-server -m 1.5B` (scripts/build_llama_server.py: llama.cpp's
  defaults, llamafile's sgemm on), plain;
- `server-md`: `llama-server -m 1.5B -md 0.5B --spec-type draft-simple --spec-draft-n-max N`
  (--draft-max, default 8);
- `lcpp`, `lcpp-draft`, `lcpp-ngram`: `specdecode serve --backend llama.cpp` on the 1.5B: plain,
  `--drafter draft-model --draft-model qwen2.5-coder-0.5b --k auto`, `--drafter ngram --k auto`;
- `native`, `native-draft`: `specdecode serve` on the native runner (the precision `auto` gives:
  checkpoint, the file's K-quant blocks bit for bit with float activations), plain and with the
  0.5B draft at k auto; `native-a8`, `native-a8-draft`: the same at `--precision checkpoint-a8`
  (the blocks bit for bit, activations int8 per block of 32, exact integer sums).

Workload: Spec-Bench (`--workload`), the first --per-category prompts of each category and all
of `coding` (--coding-all, default on), written to OUT/workload.jsonl. Greedy (Spec-Bench
prompts set no temperature). `--resume` continues an interrupted bench run in OUT/bench.

`--costs` adds `specdecode costs` of the target and the draft on the llama.cpp backend
(OUT/costs-*.json): v(T) for T = 1..16 after 256 tokens of context, and c = t_draft(1) /
t_target(1). Acceptance per position comes from this project's servers' counters in the bench
report. Logs of every server and command in OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

SPECBENCH = "/work/shared/data/specbench/question.jsonl"
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
SYSTEMS = ("generate", "server", "server-md", "lcpp", "lcpp-draft", "lcpp-ngram", "native",
           "native-draft", "native-a8", "native-a8-draft")
DEFAULT_SYSTEMS = "generate,server,server-md,lcpp,lcpp-draft"
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Launch:
    name: str
    cmd: list[str]
    ready: str  # the path that answers 200 once the model is loaded
    env: dict[str, str]


def model_path(name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "specdecode.cli", "models", "path", name],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name}: {out.stderr.strip()} (specdecode models install qwen2.5-coder)")
    return out.stdout.strip()


def llama_server_binary() -> str:
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "build_llama_server.py")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"build_llama_server.py failed: {out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def launch(name: str, port: int, threads: int, draft_max: int,
           draft_extra: tuple[str, ...] = ()) -> Launch:
    """How to start system `name` on `port`; `draft_extra`: more flags of this project's draft
    systems (e.g. --draft-vocab 32768 --max-step-cost inf)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("GGML_CPU_TILED_MM", None)  # peers run as their users run them
    own = [sys.executable, "-m", "specdecode.cli", "serve", "--model", TARGET, "--port",
           str(port), "--threads", str(threads), "--max-batch", "4", "--log-level", "warning"]
    draft = ["--drafter", "draft-model", "--draft-model", DRAFT, "--k", "auto", *draft_extra]
    if name == "generate":
        return Launch(name, [sys.executable, "-m", "llama_cpp.server", "--model",
                             model_path(TARGET), "--host", "127.0.0.1", "--port", str(port),
                             "--n_threads", str(threads), "--n_threads_batch", str(threads),
                             "--n_ctx", "4096", "--verbose", "False"], "/v1/models", env)
    if name in ("server", "server-md"):
        cmd = [llama_server_binary(), "-m", model_path(TARGET), "--host", "127.0.0.1",
               "--port", str(port), "-t", str(threads), "-c", "4096", "-np", "1",
               "--metrics"]  # its spec_decode_* counters, under vLLM's names
        if name == "server-md":
            # this llama.cpp infers a type only from MTP / DFlash drafts: without --spec-type a
            # plain -md draft loads and never drafts (the runs before 2026-12-07 session 5)
            cmd += ["-md", model_path(DRAFT), "--spec-type", "draft-simple",
                    "--spec-draft-n-max", str(draft_max)]
        return Launch(name, cmd, "/health", env)
    backend = ["--backend", "llama.cpp"] if name.startswith("lcpp") else []
    a8 = ["--precision", "checkpoint-a8"]
    extra = {"lcpp": ["--drafter", "none"], "native": ["--drafter", "none"],
             "lcpp-draft": draft, "native-draft": draft,
             "lcpp-ngram": ["--drafter", "ngram", "--k", "auto"],
             "native-a8": [*a8, "--drafter", "none"], "native-a8-draft": [*a8, *draft]}
    if name not in extra:
        raise SystemExit(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
    return Launch(name, [*own, *backend, *extra[name]], "/health", env)


class Server:
    def __init__(self, spec: Launch, port: int, log: Path) -> None:
        self.spec, self.log = spec, log
        self.url = f"http://127.0.0.1:{port}"
        with log.open("wb") as sink:
            self.proc = subprocess.Popen(spec.cmd, stdout=sink, stderr=subprocess.STDOUT,
                                         env=spec.env, start_new_session=True, cwd=REPO)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.spec.name} exited; see {self.log}")
            try:
                if httpx.get(self.url + self.spec.ready, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise SystemExit(f"{self.spec.name} did not start in {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def write_workload(source: str, per_category: int, coding_all: bool, dest: Path,
                   categories: list[str] | None = None) -> int:
    """The first `per_category` prompts of each category (all of coding with `coding_all`),
    of `categories` only where given."""
    taken: dict[str, int] = {}
    lines = []
    for line in Path(source).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        category = json.loads(line).get("category", "")
        if categories and category not in categories:
            continue
        limit = 10**9 if coding_all and category == "coding" else per_category
        if taken.get(category, 0) < limit:
            taken[category] = taken.get(category, 0) + 1
            lines.append(line)
    dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def run(cmd: list[str], log: Path) -> int:
    with log.open("a", encoding="utf-8") as sink:
        sink.write(f"$ {' '.join(cmd)}\n")
        sink.flush()
        return subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO).returncode


def costs(out: Path, threads: int, log: Path) -> None:
    """v(T) of the target and the draft on the llama.cpp backend, and c at T = 1."""
    for role, name in (("target", TARGET), ("draft", DRAFT)):
        run([sys.executable, "-m", "specdecode.cli", "costs", "--model", name, "--backend",
             "llama.cpp", "--context", "256", "--kmax", "15", "--batches", "1", "--no-peer",
             "--threads", str(threads), "--json", str(out / f"costs-{role}.json")], log)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--systems", default=DEFAULT_SYSTEMS,
                   help=f"comma-separated, the baseline first ({', '.join(SYSTEMS)})")
    p.add_argument("--workload", default=SPECBENCH)
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--categories", default=None, help="comma-separated (default: all 13)")
    p.add_argument("--no-coding-all", dest="coding_all", action="store_false")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-max", type=int, default=8, help="llama-server -md: --spec-draft-n-max")
    p.add_argument("--draft-extra", default="",
                   help="more flags for this project's draft systems, e.g. '--draft-vocab 32768 "
                        "--max-step-cost inf' (serve caps a step at 1.5 plain steps by default)")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--costs", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "commands.log"
    names = args.systems.split(",")
    workload = args.out / "workload.jsonl"
    n = write_workload(args.workload, args.per_category, args.coding_all, workload,
                       args.categories.split(",") if args.categories else None)
    # a SIGTERM stops the servers too (the ExitStack below), as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"{n} prompts; systems {', '.join(names)}", file=sys.stderr)
    if args.costs:
        costs(args.out, args.threads, log)
    with ExitStack() as stack:
        servers = {}
        for i, name in enumerate(names):
            spec = launch(name, args.port + i, args.threads, args.draft_max,
                          tuple(args.draft_extra.split()))
            servers[name] = Server(spec, args.port + i, args.out / f"{name}.log")
            stack.callback(servers[name].stop)
        for server in servers.values():
            server.wait_ready(1800)
        print("servers up", file=sys.stderr)
        endpoints = [x for nm in names for x in ("--endpoint", f"{nm}={servers[nm].url}/v1")]
        bench = args.out / "bench"
        if bench.exists() and not args.resume:
            shutil.rmtree(bench)
        code = run([sys.executable, "-m", "specdecode.cli", "bench", *endpoints, "--workload",
                    str(workload), "--max-tokens", str(args.max_tokens), "--batch-sizes",
                    args.batch_sizes, "--out", str(bench), "--quiet",
                    *(["--resume"] if args.resume else [])], log)
        print(f"bench: exit {code}; see {log} and {bench}/report.html", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
