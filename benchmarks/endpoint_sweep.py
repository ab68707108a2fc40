"""Benchmark (not a test): `specdecode bench --endpoint` against this package's own server, with
speculation auto and off, at several concurrency levels.

Starts two `specdecode serve` processes on free loopback ports, both serving the same model (the
default SmolLM2-135M-Instruct, loaded offline): "auto" (--drafter int8 --k auto: the controller
picks k per step, 0 = off) and "off" (--drafter none). Both get --max-batch equal to the highest
concurrency, so every concurrent request decodes in the same batch. Then it runs the report's
HTTP runner over both endpoints ("off" is the baseline), interleaved over the same prompts (the
built-in workload's, round-robin over its categories), at each concurrency level, and prints:
throughput, TTFT and ITL p50 / p99 per endpoint, and the ratios auto / off side by side, with the
measured speedup (total ratio, 95% bootstrap CI) and acceptance read from the server's /metrics.
Everything is timed on the client side per streamed event (see bench.http_runner). The report
(results.jsonl, report.json, report.html) stays in --out.

    python benchmarks/endpoint_sweep.py [--concurrency 1,4,16] [--prompts 16] [--max-tokens 32]
        [--drafter int8] [--model PATH] [--max-seq-len 1024] [--out DIR]

Servers and client run with OMP_NUM_THREADS=1 unless it is set (a shared machine): one torch
thread per server.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import httpx

from specdecode.bench.hardware import describe_hardware, detect_hardware
from specdecode.bench.plan import round_robin
from specdecode.bench.workloads import load_default_workload
from specdecode.cli import main as specdecode_main

START_TIMEOUT_S = 600.0
SERVING = re.compile(r"serving .* at (http://\S+)/v1")


def write_workload(path: Path, n: int) -> None:
    """n prompts of the built-in workload, one category after another, in the plain format."""
    prompts = round_robin(load_default_workload().prompts, n)
    lines = [json.dumps({"id": p.id, "category": p.category, "prompt": p.turns,
                         "temperature": p.temperature, "max_tokens": p.max_tokens})
             for p in prompts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@contextmanager
def serve(name: str, extra: list[str], log: Path) -> Iterator[str]:
    """`specdecode serve` on a free loopback port; yields its base URL once /health is 200."""
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--port", "0",
           "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with log.open("w", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=sink, text=True, env=env)
        found: list[str] = []

        def pump() -> None:  # copy stderr to the log, catching the "serving ... at URL" line
            assert proc.stderr is not None
            for line in proc.stderr:
                if not sink.closed:
                    sink.write(line)
                    sink.flush()
                match = SERVING.search(line)
                if match and not found:
                    found.append(match.group(1))

        threading.Thread(target=pump, daemon=True).start()
        try:
            yield wait_ready(name, proc, found, log)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(name: str, proc: subprocess.Popen[str], found: list[str], log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server {name} exited ({proc.returncode}); see {log}")
        if found:
            try:
                if httpx.get(f"{found[0]}/health", timeout=5).status_code == 200:
                    return found[0]
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise SystemExit(f"server {name} did not start in {START_TIMEOUT_S:.0f} s; see {log}")


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * scale:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b:
        return "-"
    return f"{a / b:.2f}x"


def table(report: dict[str, Any]) -> list[str]:
    """Per concurrency: off, auto, then the ratios auto / off."""
    by_key = {(c["spec"]["name"], c["spec"]["batch_size"]): c
              for c in report["analysis"]["configs"]}
    sizes = sorted({b for _, b in by_key})
    head = (f"{'conc':>4} {'server':<7}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'ITL p50':>9}{'ITL p99':>9}  acceptance / speedup")
    lines = [head, f"{'':>4} {'':<7}{'':>8}{'(ms)':>10}{'(ms)':>10}{'(ms)':>9}{'(ms)':>9}"]
    for b in sizes:
        off, auto = by_key.get(("off", b)), by_key.get(("auto", b))
        for name, c in (("off", off), ("auto", auto)):
            if c is None:
                continue
            a = c["acceptance"]
            acc = "" if name == "off" else (
                f"accepted/drafted {fmt(a['rate'], digits=2)}, mean acceptance length "
                f"{fmt(a['mean_acceptance_length'], digits=2)}")
            lines.append(f"{b:>4} {name:<7}{fmt(c['throughput_tok_s']):>8}"
                         f"{fmt(c['ttft']['p50'], 1000, 0):>10}{fmt(c['ttft']['p99'], 1000, 0):>10}"
                         f"{fmt(c['itl']['p50'], 1000):>9}{fmt(c['itl']['p99'], 1000):>9}  {acc}")
        if off is None or auto is None:
            continue
        spd = (auto.get("speedup") or {}).get("total_ratio") or {}
        ci = (f"speedup {fmt(spd.get('estimate'), digits=2)}x [{fmt(spd.get('low'), digits=2)}, "
              f"{fmt(spd.get('high'), digits=2)}]") if spd else ""
        lines.append(
            f"{b:>4} {'auto/off':<7}{ratio(auto['throughput_tok_s'], off['throughput_tok_s']):>8}"
            f"{ratio(auto['ttft']['p50'], off['ttft']['p50']):>10}"
            f"{ratio(auto['ttft']['p99'], off['ttft']['p99']):>10}"
            f"{ratio(auto['itl']['p50'], off['itl']['p50']):>9}"
            f"{ratio(auto['itl']['p99'], off['itl']['p99']):>9}  {ci}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=16,
                    help="prompts of the built-in workload (at least the highest concurrency)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--drafter", default="int8", help="the auto server's drafter")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime(
        "endpoint-sweep-%Y%m%d-%H%M%S", time.gmtime()))
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    workload = args.out / "workload.jsonl"
    write_workload(workload, args.prompts)
    model = ["--model", args.model] if args.model else []
    common = [*model, "--max-batch", str(max(levels)), "--max-seq-len", str(args.max_seq_len)]
    start = time.perf_counter()
    with ExitStack() as stack:
        off = stack.enter_context(serve("off", [*common, "--drafter", "none"],
                                        args.out / "server-off.log"))
        auto = stack.enter_context(serve("auto", [*common, "--drafter", args.drafter,
                                                  "--k", "auto"], args.out / "server-auto.log"))
        print(f"servers ready in {time.perf_counter() - start:.0f} s: off {off}, auto {auto}",
              flush=True)
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = specdecode_main(
                ["bench", "--endpoint", f"off={off}", "--endpoint", f"auto={auto}", "--workload",
                 str(workload), "--batch-sizes", args.concurrency, "--max-tokens",
                 str(args.max_tokens), "--out", str(args.out / "report"), "--quiet"])
    print(out.getvalue(), end="")
    if code != 0:
        raise SystemExit(err.getvalue().strip())
    report = json.loads((args.out / "report" / "report.json").read_text(encoding="utf-8"))
    header = report["header"]
    n_req = len(report["samples"])
    hardware = describe_hardware(detect_hardware())
    print(f"\nendpoint sweep: {header['model']['name']} served by `specdecode serve` (auto: "
          f"--drafter {args.drafter} --k auto; off: --drafter none), max-batch {max(levels)}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')} per server; client and "
          f"servers on {hardware}")
    print(f"{args.prompts} prompts (built-in workload), max_tokens {args.max_tokens}, "
          f"concurrency = concurrent streaming requests; {n_req} requests measured, "
          f"{len(report.get('failures', []))} failed; wall {time.perf_counter() - start:.0f} s")
    print("\n".join(table(report)))
    print(f"report: {args.out / 'report' / 'report.html'}")


if __name__ == "__main__":
    main()
