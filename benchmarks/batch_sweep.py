"""Benchmark (not a test): throughput and per-token latency of batched speculative decoding.

Batch sizes x workloads of high and low acceptance x {plain, fixed k, auto}, on SmolLM2 with the
n-gram drafter (drafting costs almost nothing, so what decides is verification at batch B):

- summarization, greedy: Spec-Bench's summarization prompts (articles cut to 1500 characters so
  a batch of 32 prefills in reasonable time on 2 cores) - high acceptance;
- writing, temperature 1.0: Spec-Bench's writing prompts (cycled with distinct seeds) - low.

Every configuration runs the same B requests in one BatchEngine (prompts prefilled before the
clock starts; the same for every configuration). Printed per cell: throughput (emitted tokens/s
of the whole batch), its ratio to plain, ITL p50 / p99 (ms per token; a step that emits m tokens
counts its time once and m-1 zeros, as the report does), accepted/drafted, and memory (target
weights, draft weights, target KV, draft KV, peak RSS). Then, per workload, the batch size from
which the best fixed k no longer beats plain.

    python benchmarks/batch_sweep.py [--batches 1,2,4,8,16,32] [--max-tokens 48] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from specdecode.control import Controller, calibrated_costs
from specdecode.costs import hardware
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import BatchEngine, Generation
from specdecode.models.loading import load_model
from specdecode.sampling import SamplingParams

SPECBENCH = Path(__file__).resolve().parents[2] / "shared/data/specbench/question.jsonl"
CONFIGS: list[tuple[str, int | str]] = [("plain", 0), ("k=2", 2), ("k=4", 4), ("auto", "auto")]
KMAX = 6


def prompts(category: str, n: int, cut: int) -> list[str]:
    rows = [json.loads(line) for line in SPECBENCH.read_text().splitlines() if line.strip()]
    turns = [r["turns"][0][:cut] for r in rows if r["category"] == category]
    return [turns[i % len(turns)] for i in range(n)]


def run_cell(loaded: Any, texts: list[str], temperature: float, k: int | str, max_tokens: int,
             controller: Controller | None) -> dict[str, Any]:
    tok, model = loaded.tokenizer, loaded.model
    gens = []
    for i, text in enumerate(texts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i)
        kk = KMAX if k == "auto" else int(k)
        gen = Generation(model, None, ids, params, NgramDrafter() if kk else None, kk,
                         tok.eos_ids)
        gen.prefill()
        gens.append(gen)
    engine = BatchEngine(model, len(gens), max(g.capacity for g in gens),
                         controller if k == "auto" else None)
    for gen in gens:
        engine.submit(gen)
    last = {id(g): 0.0 for g in gens}
    itl: list[float] = []
    start = time.perf_counter()
    for gen in gens:
        last[id(gen)] = start
    while engine.busy:
        outputs = engine.step()
        now = time.perf_counter()
        for gen, out in outputs:
            if out.tokens:
                itl.append(now - last[id(gen)])
                itl.extend([0.0] * (len(out.tokens) - 1))
                last[id(gen)] = now
    wall = time.perf_counter() - start
    emitted = sum(len(g.output) for g in gens)
    drafted = sum(g.counters.drafted for g in gens)
    accepted = sum(g.counters.accepted for g in gens)
    q = statistics.quantiles(itl, n=100) if len(itl) > 1 else [itl[0]] * 99
    return {"throughput": emitted / wall, "itl_p50_ms": q[49] * 1e3, "itl_p99_ms": q[98] * 1e3,
            "accepted_per_drafted": accepted / drafted if drafted else None,
            "target_kv_bytes": engine.cache.nbytes(), "draft_kv_bytes": 0,
            "draft_weight_bytes": 0, "peak_rss_bytes": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model()
    hw = hardware()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# SmolLM2-135M-Instruct fp32, n-gram drafter, {args.max_tokens} new tokens, "
          f"{hw['cpu']} ({hw['cores']} cores, {torch.get_num_threads()} threads); target "
          f"weights {loaded.weight_bytes() / 2**20:.0f} MiB, draft weights 0, draft KV 0")
    workloads = [("summarization greedy", "summarization", 0.0, 1500),
                 ("writing T=1.0", "writing", 1.0, 1500)]
    results: list[dict[str, Any]] = []
    for name, category, temperature, cut in workloads:
        print(f"\n## {name}")
        print(f"{'batch':>5} {'config':>6} {'tok/s':>8} {'x plain':>8} {'ITL p50':>8} "
              f"{'ITL p99':>8} {'acc/dr':>6} {'target KV':>9} {'peak RSS':>8}")
        for batch in batches:
            texts = prompts(category, batch, cut)
            run_cell(loaded, texts[:1], temperature, 2, 4, None)  # warm-up
            controller = Controller(kmax=KMAX, costs=calibrated_costs(loaded.model, [batch],
                                                                      KMAX, repeats=2))
            plain = None
            for label, k in CONFIGS:
                cell = run_cell(loaded, texts, temperature, k, args.max_tokens, controller)
                plain = cell["throughput"] if label == "plain" else plain
                cell.update(workload=name, batch=batch, config=label,
                            ratio=cell["throughput"] / plain if plain else None)
                results.append(cell)
                acc = cell["accepted_per_drafted"]
                print(f"{batch:5d} {label:>6} {cell['throughput']:8.1f} {cell['ratio']:8.2f} "
                      f"{cell['itl_p50_ms']:8.1f} {cell['itl_p99_ms']:8.1f} "
                      f"{'-' if acc is None else f'{acc:.2f}':>6} "
                      f"{cell['target_kv_bytes'] / 2**20:8.1f}M "
                      f"{cell['peak_rss_bytes'] / 2**30:7.2f}G", flush=True)
        cells = [r for r in results if r["workload"] == name]
        stop = next((b for b in batches if max(r["ratio"] for r in cells if r["batch"] == b
                                               and r["config"].startswith("k=")) < 1.0), None)
        print(f"speculation (best fixed k) stops paying at batch {stop} for {name}"
              if stop else f"speculation pays at every batch size measured for {name}")
    if args.out:
        Path(args.out).write_text(json.dumps({"hardware": hw, "results": results}, indent=2))


if __name__ == "__main__":
    main()
