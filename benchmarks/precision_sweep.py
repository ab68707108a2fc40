"""Benchmark (not a test): each target precision's plain speed, v(k) curve and best lossless
speculative configuration, with llama.cpp's plain decoding of the same GGUF where installed.

Per precision (fp32, bf16, int8, w8a16, w4a16), batch 1:

1. `specdecode costs --context 512 --kmax 16`: the target's forward time scoring k positions
   after a 512-token context (medians of round-robin repeats), hence plain tokens/s = 1 / t(1)
   and the curve v(k) = t(k) / t(1);
2. `specdecode tune` on Spec-Bench's summarization and coding prompts and on the built-in
   workload: every drafter x k measured against plain decoding, interleaved over the same
   prompts, with the audit verdict; the pick is the best lossless configuration. (Not for the
   int8, w8a16 and w4a16 targets: they are not batch invariant, so no speculative mode on them
   is lossless; see drafters.registry.check_batch_invariant.)

In the same run, where the `llama-cpp-python` bindings are installed (optional: they compile
llama.cpp on install), llama.cpp's plain decoding of the same GGUF at batch 1 (greedy, same
prompts), so the ratios to it are measured side by side.

    python benchmarks/precision_sweep.py [--precisions fp32,bf16,int8,w8a16,w4a16] [--prompts 4]
        [--max-tokens 48] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SPECBENCH = Path(__file__).resolve().parents[2] / "shared/data/specbench/question.jsonl"
# int8, w8a16 and w4a16 targets are not batch invariant, so speculation on them is refused
# (drafters.registry): they get their cost curve and plain speed only.
DRAFTERS = {"fp32": "int8,ngram,layerskip", "bf16": "int8,ngram,layerskip"}


def run(cmd: list[str], env: dict[str, str]) -> str:
    print("$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}")
    return done.stdout


def cost_summary(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    rows = data["curves"][0]
    return {"plain_tok_s": 1.0 / rows[0]["median_s"], "v": [r["v"] for r in rows]}


def pick_line(tune_output: str) -> str:
    return next((ln for ln in tune_output.splitlines() if ln.startswith("pick:")), "pick: -")


def llama_cpp_tok_s(gguf: str, prompts: list[str], max_tokens: int, threads: int
                    ) -> float | None:
    try:
        from llama_cpp import Llama  # type: ignore[import-not-found]
    except ImportError:
        return None
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, verbose=False)
    llm("Hello", max_tokens=8, temperature=0.0)  # warm-up
    rates = []
    for text in prompts:
        start = time.perf_counter()
        out = llm(text, max_tokens=max_tokens, temperature=0.0)
        rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - start))
    return statistics.median(rates)


def specbench_subset(out: Path) -> Path:
    rows = [json.loads(x) for x in SPECBENCH.read_text().splitlines() if x.strip()]
    keep = [r for r in rows if r["category"] in ("summarization", "coding")]
    path = out / "specbench-summarization-coding.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="fp32,bf16,int8,w8a16,w4a16")
    ap.add_argument("--prompts", type=int, default=4, help="tune prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k-values", default="2,4")
    ap.add_argument("--out", type=Path, default=Path("runs/precision-sweep"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    workloads = {"built-in": None, "spec-bench summarization+coding": specbench_subset(args.out)}
    rows: dict[str, dict[str, Any]] = {}
    for precision in args.precisions.split(","):
        costs = args.out / f"costs-{precision}.json"
        run(["specdecode", "costs", "--precision", precision, "--context", "512", "--kmax", "16",
             "--no-peer", "--json", str(costs)], env)
        row = cost_summary(costs)
        row["picks"] = {}
        for name, path in workloads.items() if precision in DRAFTERS else ():
            slug = re.sub(r"\W+", "-", name)
            cmd = ["specdecode", "tune", "--precision", precision, "--drafters",
                   DRAFTERS[precision], "--k-values", args.k_values, "--prompts",
                   str(args.prompts), "--max-tokens", str(args.max_tokens), "--quiet",
                   "--out", str(args.out / f"tune-{precision}-{slug}")]
            if path is not None:
                cmd += ["--workload", str(path)]
            out = run(cmd, env)
            print(out, flush=True)
            row["picks"][name] = pick_line(out)
        rows[precision] = row
    from specdecode.bench.workloads import load_default_workload
    from specdecode.models.paths import default_model_path

    texts = [p.turns[0] for p in load_default_workload(None).prompts[: args.prompts]]
    ref = llama_cpp_tok_s(str(default_model_path()), texts, args.max_tokens, args.threads)
    print(f"\n# batch 1, {args.threads} threads, context 512 for t(k); tune: "
          f"{args.prompts} prompts x {args.max_tokens} tokens per workload")
    print(f"{'precision':>9} {'plain tok/s':>11} {'x llama.cpp':>11}  v(2) v(4) v(8) v(16)")
    for precision, row in rows.items():
        v = row["v"]
        ratio = f"{row['plain_tok_s'] / ref:.2f}" if ref else "-"
        print(f"{precision:>9} {row['plain_tok_s']:11.1f} {ratio:>11}  " +
              " ".join(f"{v[k - 1]:.2f}" for k in (2, 4, 8, 16) if k <= len(v)))
        for name, line in row["picks"].items():
            print(f"{'':>9}   {name}: {line}")
    print("llama.cpp plain: " + (f"{ref:.1f} tok/s (llama-cpp-python, same GGUF)" if ref else
                                 "not installed (pip install llama-cpp-python; optional)"))
    (args.out / "summary.json").write_text(json.dumps({"rows": rows, "llama_cpp": ref},
                                                      indent=1))


if __name__ == "__main__":
    main()
