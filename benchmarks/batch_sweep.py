"""Benchmark (not a test): throughput and per-token latency of batched speculative decoding.

Batch sizes x workloads of high and low acceptance x {plain, fixed k, auto}, on SmolLM2 with the
n-gram drafter by default (drafting costs almost nothing, so what decides is verification at
batch B; `--drafter NAME` measures another, e.g. w4a16 or ngram+w4a16, whose 4-bit copy drafts
a batch's rows together in the target's cache, one forward per draft position):

- summarization, greedy: Spec-Bench's summarization prompts (articles cut to 1500 characters so
  a batch of 32 prefills in reasonable time on 2 cores) - high acceptance;
- writing, temperature 1.0: Spec-Bench's writing prompts (cycled with distinct seeds) - low.

Batch size B is the engine's number of slots: every configuration runs the same 2B requests
(`--requests-per-slot`; at least 8, `--min-requests`) through one BatchEngine of B rows, a
finished request's row taken by the next waiting one (continuous batching, as a loaded server
runs; with only B requests the batch would drain as requests finish at different steps, a tail
that penalises speculation and that a loaded server does not have). Prompts are prefilled before
the clock starts, the same for every configuration. auto's controller starts cold in each batch
size's first round (its t(B, T) table calibrated at the prompts' mean length, alpha at the
prior) and keeps what it learned into the later rounds, as a server's controller does.
`plain-aa` runs plain decoding a second time in the rotation: its ratio to plain is the noise
floor of the cell (an A/A test). `auto-noguard` is auto without the controller's check of its
own outcome (control.PayGuard), to see what the check changes. Printed per cell: throughput
(emitted tokens/s of the whole batch), its ratio to plain, ITL p50 / p99 (ms per token; a step
that emits m tokens counts its time once and m-1 zeros, as the report does), accepted/drafted,
and memory (target weights, draft weights, target KV, draft KV, peak RSS) and, for auto, how
many times its guard held speculation off (control.PayGuard; over the cell's rounds). Then, per
workload, the batch size from which the best fixed k no longer beats plain.

    python benchmarks/batch_sweep.py [--batches 1,2,4,8,16,32] [--max-tokens 48] [--out F.json]
        [--configs plain,k=1,k=2,k=4,auto,auto-cap,auto-noguard,plain-aa]
        [--cap 1.5]
        [--workloads summarization,writing]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.hardware import machine_summary
from specdecode.bench.inprocess import kv_bytes
from specdecode.calibration import calibrated_costs
from specdecode.control import Controller, CostModel
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine, Generation, adopt_prefill
from specdecode.memory import weight_bytes
from specdecode.models.backends import load_model
from specdecode.sampling import SamplingParams

SPECBENCH = Path(__file__).resolve().parents[2] / "shared/data/specbench/question.jsonl"
CONFIGS: list[tuple[str, int | str]] = [("plain", 0), ("k=1", 1), ("k=2", 2), ("k=4", 4),
                                        ("auto", "auto"), ("auto-cap", "auto"),
                                        ("auto-noguard", "auto"), ("plain-aa", 0)]
KMAX = 6


def prompts(category: str, n: int, cut: int) -> list[str]:
    rows = [json.loads(line) for line in SPECBENCH.read_text().splitlines() if line.strip()]
    turns = [r["turns"][0][:cut] for r in rows if r["category"] == category]
    return [turns[i % len(turns)] for i in range(n)]


def prefilled(loaded: Any, texts: list[str], temperature: float, max_tokens: int
              ) -> list[Generation]:
    """One prefilled plain Generation per prompt: every cell copies its KV instead of
    prefilling again (prefill is outside the clock either way)."""
    tok = loaded.tokenizer
    templates = []
    for i, text in enumerate(texts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i)
        gen = Generation(loaded.model, None, ids, params, None, 0, tok.eos_ids)
        gen.prefill()
        templates.append(gen)
    return templates


def run_cell(loaded: Any, templates: list[Generation], k: int | str,
             controller: Controller | None, batch: int,
             make: Callable[[], Any] | None = None) -> dict[str, Any]:
    model = loaded.model
    make = make or NgramDrafter
    gens = []
    for t in templates:
        kk = KMAX if k == "auto" else int(k)
        gen = Generation(model, None, t.context[: t.prompt_len], t.params,
                         make() if kk else None, kk, loaded.tokenizer.eos_ids)
        adopt_prefill(gen, t)
        gens.append(gen)
    engine = BatchEngine(model, batch, max(g.capacity for g in gens),
                         controller if k == "auto" else None)
    for gen in gens:
        engine.submit(gen)
    itl: list[float] = []
    start = time.perf_counter()
    last: dict[int, float] = {}
    full_tokens, full_s = 0, 0.0  # over the steps that decoded every one of the B slots
    draft_kv = 0  # the most the drafters' own caches held at once
    while engine.busy:
        draft_kv = max(draft_kv, sum(kv_bytes(getattr(g.drafter, "cache", None))
                                     for g in engine.active))
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if len(outputs) == batch:
            full_tokens += sum(len(out.tokens) for _, out in outputs)
            full_s += now - t0
        for gen, out in outputs:
            if out.tokens:  # a request's first token is its TTFT (queueing), not an ITL
                if id(gen) in last:
                    itl.append(now - last[id(gen)])
                itl.extend([0.0] * (len(out.tokens) - 1))
                last[id(gen)] = now
    wall = time.perf_counter() - start
    drafted = sum(g.counters.drafted for g in gens)
    module = gens[0].drafter.weights() if gens[0].drafter is not None else None
    accepted = sum(g.counters.accepted for g in gens)
    return {"throughput": sum(len(g.output) for g in gens) / wall, "itl": itl,
            "full_throughput": full_tokens / full_s if full_s else 0.0,
            "accepted_per_drafted": accepted / drafted if drafted else None,
            "target_kv_bytes": engine.cache.nbytes(), "draft_kv_bytes": draft_kv,
            "draft_weight_bytes": 0 if module is None else weight_bytes(module, shared=model),
            "peak_rss_bytes": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss * 1024}


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def measure_batch(loaded: Any, texts: list[str], temperature: float, max_tokens: int,
                  rounds: int, batch: int, configs: list[tuple[str, int | str]] = CONFIGS,
                  cap: float = 1.5, drafter: str = "ngram") -> list[dict[str, Any]]:
    """Every config `rounds` times, the order rotated each round; per config: the median of
    its throughput ratio to the same round's plain run, with min-max, and pooled ITLs."""
    templates = prefilled(loaded, texts, temperature, max_tokens)
    run_cell(loaded, templates[:1], 2, None, 1)  # warm-up
    context = round(statistics.mean(t.prompt_len for t in templates))
    costs = CostModel(target_s=calibrated_costs(loaded.model, [batch], KMAX, context=context,
                                                repeats=2))
    controllers = {label: Controller(kmax=KMAX, costs=copy.deepcopy(costs), max_step_cost=(
        cap if label == "auto-cap" else None)) for label, k in configs if k == "auto"}
    if "auto-noguard" in controllers:  # the controller's model alone, without PayGuard
        controllers["auto-noguard"].guard = None
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in configs}
    # one drafter factory per configuration, kept over its rounds (its drafters share what
    # they learn of acceptance by match length, as a server's do)
    makers = {label: drafter_factory(drafter, loaded.model) for label, _ in configs}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for label, k in order:
            runs[label].append(run_cell(loaded, templates, k, controllers.get(label), batch,
                                        makers[label]))
    cells = []
    for label, _ in configs:
        rs = runs[label]
        ratios = [a["full_throughput"] / p["full_throughput"] for a, p in
                  zip(rs, runs["plain"], strict=True)]
        whole = [a["throughput"] / p["throughput"] for a, p in zip(rs, runs["plain"],
                                                                     strict=True)]
        itl = [x for cell in rs for x in cell["itl"]]
        acc = [c["accepted_per_drafted"] for c in rs if c["accepted_per_drafted"] is not None]
        cells.append({"config": label, "throughput": statistics.median(
            c["full_throughput"] for c in rs), "ratio": statistics.median(ratios),
            "whole_run_throughput": statistics.median(c["throughput"] for c in rs),
            "whole_run_ratio": statistics.median(whole),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
            "accepted_per_drafted": statistics.mean(acc) if acc else None,
            "guard_holds": guard.holds if (guard := getattr(controllers.get(label), "guard",
                                                            None)) else None,
            **{key: rs[-1][key] for key in ("target_kv_bytes", "draft_kv_bytes",
                                            "draft_weight_bytes", "peak_rss_bytes")}})
    return cells


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests-per-slot", type=int, default=2,
                    help="requests per cell = this x the batch size, through B slots")
    ap.add_argument("--min-requests", type=int, default=8,
                    help="at least this many requests per cell (batch 1 and 2 cells of 2B "
                    "requests are a few seconds long: noise decides them)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default=",".join(label for label, _ in CONFIGS),
                    help="a subset of plain,k=1,k=2,k=4,auto,auto-cap,auto-noguard,plain-aa "
                    "(plain is always run: the ratios)")
    ap.add_argument("--workloads", default="summarization,writing")
    ap.add_argument("--drafter", default="ngram",
                    help="any drafter name generate takes (default ngram); a model drafter "
                    "drafts row by row, so its cost grows with the batch")
    ap.add_argument("--cap", type=float, default=1.5,
                    help="auto-cap: auto with no step costing more than this many plain steps")
    args = ap.parse_args()
    wanted = {"plain", *args.configs.split(",")}
    configs = [c for c in CONFIGS if c[0] in wanted]
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model()
    hw = machine_summary()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# SmolLM2-135M-Instruct fp32, {args.drafter} drafter, {args.max_tokens} new tokens, "
          f"{hw['cpu']} ({hw['cores']} cores, {torch.get_num_threads()} threads), load average "
          f"{hw.get('load_avg_1m')}; {args.rounds} rounds per cell, order rotated; target "
          f"weights {loaded.weight_bytes() / 2**20:.0f} MiB (draft weights and KV: per cell)")
    print(f"# max({args.requests_per_slot}B, {args.min_requests}) requests through B slots; "
          "tok/s = tokens emitted by the steps in which all B slots decoded / their time (the "
          "throughput at batch B); x plain = median over rounds of (config tok/s / plain tok/s "
          "of the same round), (min-max); "
          "whole run = the same ratio over the whole run, the final drain included; ITL pooled "
          "over rounds, each request's first token excluded (it is its TTFT)")
    workloads = [w for w in (("summarization greedy", "summarization", 0.0, 1500),
                             ("writing T=1.0", "writing", 1.0, 1500))
                 if w[1] in args.workloads.split(",")]
    results: list[dict[str, Any]] = []
    for name, category, temperature, cut in workloads:
        print(f"\n## {name}")
        print(f"{'batch':>5} {'config':>12} {'tok/s':>8} {'x plain (min-max)':>18} "
              f"{'whole run':>9} {'ITL p50':>8} {'ITL p99':>8} {'acc/dr':>6} {'target KV':>9} "
              f"{'draft W':>8} {'draft KV':>8} {'peak RSS':>8} {'holds':>5}")
        for batch in batches:
            texts = prompts(category, max(args.requests_per_slot * batch, args.min_requests),
                            cut)
            for cell in measure_batch(loaded, texts, temperature, args.max_tokens, args.rounds,
                                      batch, configs, args.cap, args.drafter):
                cell.update(workload=name, batch=batch)
                results.append(cell)
                acc = cell["accepted_per_drafted"]
                spread = f"{cell['ratio']:.2f} ({cell['ratio_min']:.2f}-{cell['ratio_max']:.2f})"
                print(f"{batch:5d} {cell['config']:>12} {cell['throughput']:8.1f} {spread:>18} "
                      f"{cell['whole_run_ratio']:9.2f} {cell['itl_p50_ms']:8.1f} "
                      f"{cell['itl_p99_ms']:8.1f} "
                      f"{'-' if acc is None else f'{acc:.2f}':>6} "
                      f"{cell['target_kv_bytes'] / 2**20:8.1f}M "
                      f"{cell['draft_weight_bytes'] / 2**20:7.1f}M "
                      f"{cell['draft_kv_bytes'] / 2**20:7.1f}M "
                      f"{cell['peak_rss_bytes'] / 2**30:7.2f}G "
                      f"{'-' if cell['guard_holds'] is None else cell['guard_holds']:>5}",
                      flush=True)
        summarize(name, [r for r in results if r["workload"] == name], batches)
    if args.out:
        Path(args.out).write_text(json.dumps({"hardware": hw, "results": results}, indent=2))


def noise_band(aa: dict[str, Any] | None) -> tuple[float, float]:
    """The ratios a median over rounds takes by chance in this run: plain against itself
    (plain-aa) missed 1.0 by |1 - r|, so a median within [min(r, 1/r), max(r, 1/r)] is
    indistinguishable from plain. Without an A/A cell, no band: (1.0, 1.0)."""
    if aa is None:
        return 1.0, 1.0
    r = aa["ratio"]
    return min(r, 1 / r), max(r, 1 / r)


def summarize(name: str, cells: list[dict[str, Any]], batches: list[int]) -> None:
    """Where the best fixed k stops beating plain (beyond the A/A noise, where measured); auto
    against plain and the best fixed k."""
    def at(b: int) -> list[dict[str, Any]]:
        return [r for r in cells if r["batch"] == b]

    def aa_at(b: int) -> dict[str, Any] | None:
        return next((r for r in at(b) if r["config"] == "plain-aa"), None)

    fixed = [b for b in batches if any(r["config"].startswith("k=") for r in at(b))]
    best_k = {b: max(r["ratio"] for r in at(b) if r["config"].startswith("k=")) for b in fixed}
    band = {b: noise_band(aa_at(b)) for b in fixed}
    stop = next((b for b in fixed if best_k[b] < band[b][0]), None)
    even = [b for b in fixed if aa_at(b) is not None and band[b][0] <= best_k[b] <= band[b][1]]
    if fixed:
        print(f"speculation (best fixed k) stops paying at batch {stop} for {name}"
              if stop else f"speculation pays at every batch size measured for {name}")
        if even:
            print(f"  break-even (the best fixed k within plain-aa's noise) at batch "
                  f"{', '.join(map(str, even))}")
    for b in batches:
        auto = next((r for r in at(b) if r["config"] == "auto"), None)
        if auto is None:
            continue
        best = max((r for r in at(b) if not r["config"].startswith(("auto", "plain-aa"))),
                   key=lambda r: r["ratio"])
        aa = aa_at(b)
        noise = "" if aa is None else (f"; plain against itself {aa['ratio']:.2f}x "
                                       f"({aa['ratio_min']:.2f}-{aa['ratio_max']:.2f})")
        print(f"  batch {b:2d}: auto {auto['ratio']:.2f}x plain; best fixed {best['config']} "
              f"{best['ratio']:.2f}x; auto / best {auto['ratio'] / best['ratio']:.2f}{noise}")


if __name__ == "__main__":
    main()
