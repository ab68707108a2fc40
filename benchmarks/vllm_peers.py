"""Benchmark (not a test): vLLM's plain decoding and speculation beside this project's proposers
inside vLLM and this project's own server, on Spec-Bench, with the losslessness audit of every
speculative vLLM server (docs/measurements/vllm.md).

    python benchmarks/vllm_peers.py --servers plain,ngram,lookup --out runs/vllm-a \\
        [--workload question.jsonl] [--per-category 3] [--max-tokens 64] [--batch-sizes 1,8]

For one group of servers (all running at once: `bench --endpoint` interleaves them over the same
prompts; on a 24 GiB machine three vLLM servers fit beside other work, so the configurations are
measured in groups, each with vLLM plain as its baseline):

1. starts them: vLLM configurations of scripts/vllm_server.py's CONFIGS by name, and `own`, this
   project's server (`specdecode serve --drafter ngram --k auto`, the checkpoint precision);
   each with --threads threads (OMP_NUM_THREADS), vLLM with a 256 MiB KV cache; `distilled` is
   vLLM's draft_model with this project's distilled draft (exported on first use);
2. audits every speculative vLLM server against vLLM plain (`audit --endpoint`, greedy, the
   first --audit-per-category prompts of each category, at concurrency 1 and 8), writing
   audit-NAME-cC.json;
3. runs `specdecode bench --endpoint` over all of them (the first is the baseline) on Spec-Bench
   summarization, RAG, coding and writing, greedy, at --batch-sizes concurrency levels;
4. stops them. Logs in --out.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack, redirect_stderr, redirect_stdout
from pathlib import Path

import httpx

from specdecode.cli import main as specdecode_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: its scripts/
from scripts.vllm_server import CONFIGS, Launch, Server

SPECBENCH = "/work/shared/data/specbench/question.jsonl"
CATEGORIES = "summarization,rag,coding,writing"
# the own server's best configuration on a fast target: the checkpoint precision (auto) with the
# n-gram lookup at an adaptive k (docs/measurements/2026-12-04-fast-exact-targets.md)
OWN = ["--drafter", "ngram", "--k", "auto", "--max-batch", "8"]


class OwnServer:
    """`specdecode serve` with the project's best configuration."""

    def __init__(self, port: int, threads: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port),
                 "--log-level", "warning", "--threads", str(threads), *OWN], stdout=sink,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.log = log

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"own server exited; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise SystemExit(f"own server did not start; see {self.log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cli(argv: list[str], log: Path) -> int:
    """`specdecode ARGV` in process, its stdout and stderr appended to `log`."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = specdecode_main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    with log.open("a", encoding="utf-8") as f:
        f.write(f"$ specdecode {' '.join(argv)}\n{err.getvalue()}{out.getvalue()}\n")
    return code


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="plain,ngram,lookup",
                   help=f"comma-separated, the baseline first: {', '.join(CONFIGS)}, own")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workload", default=SPECBENCH)
    p.add_argument("--categories", default=CATEGORIES)
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--audit-per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--skip-audit", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.servers.split(",")
    log = args.out / "commands.log"
    with ExitStack() as stack:
        servers: dict[str, Server | OwnServer] = {}
        for i, name in enumerate(names):
            port = args.port + i
            if name == "own":
                servers[name] = OwnServer(port, args.threads, args.out / "own.log")
            else:
                servers[name] = Server(Launch(name, port, args.threads, kv_cache="256M"),
                                       args.out / f"{name}.log")
            stack.callback(servers[name].stop)
        for server in servers.values():
            server.wait_ready(1200)
        print(f"servers up: {', '.join(names)}", file=sys.stderr)
        base = servers[names[0]].url
        if not args.skip_audit:
            for name in names[1:]:
                if name == "own":
                    continue
                for c in (1, 8):
                    path = args.out / f"audit-{name}-c{c}.json"
                    code = cli(["audit", "--endpoint", servers[name].url, "--reference", base,
                                "--workload", args.workload, "--categories", args.categories,
                                "--limit-per-category", str(args.audit_per_category),
                                "--max-tokens", str(args.max_tokens), "--concurrency", str(c),
                                "--json", "--out", str(args.out / "audit-replies.jsonl")], log)
                    text = log.read_text(encoding="utf-8").rstrip().splitlines()[-1]
                    path.write_text(text + "\n", encoding="utf-8")
                    verdict = json.loads(text).get("verdict") if text.startswith("{") else "?"
                    print(f"audit {name} c{c}: exit {code}, {verdict}", file=sys.stderr)
        endpoints = [x for n in names for x in ("--endpoint", f"{n}={servers[n].url}")]
        code = cli(["bench", *endpoints, "--workload", args.workload, "--categories",
                    args.categories, "--limit-per-category", str(args.per_category),
                    "--max-tokens", str(args.max_tokens), "--batch-sizes", args.batch_sizes,
                    "--out", str(args.out / "bench"), "--quiet"], log)
        print(f"bench: exit {code}; summary in {log}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
