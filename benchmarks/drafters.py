"""Benchmark (not a test): every drafter on every workload category, at batch 1, greedy and
temperature 0.7, against plain decoding measured interleaved over the same prompts.

A drafter's k is a number (a fixed draft length: every proposed token verified) or `auto` /
`autoN` (the controller's --k auto with kmax N, default 8: the n-gram drafter's tokens are
fitted to the width that pays, other drafters get the controller's k; the cost table is
calibrated once, at 256 tokens of context, and refined by every step as it runs).

Per drafter x category: alpha (E[sum min(p, q)], or p(x) for deterministic drafts), accepted /
drafted, mean acceptance length (bonus included), c (drafting time per draft token over the
target's time per plain step, both measured in this run; a draft model's own prefill of the
prompt counts as drafting time), and tokens/s of whole requests (prefill included) as a ratio to
plain decoding of the same prompts (median over prompts, min-max). The training cost of each trained
drafter is read from its model card. A second ratio counts the decoding phase alone (prefill
excluded: the same work on both sides, it dilutes the ratio of long prompts).

Workloads: the built-in prompts by category, and any Spec-Bench-format file
(../shared/data/specbench/question.jsonl by default), a few prompts per category.

    python benchmarks/drafters.py [--drafters ngram:4,ngram:auto,layerskip:3,int8:3,heads:4]
        [--per-category 2] [--max-tokens 64] [--temperatures 0,0.7] [--threads 2]
        [--specbench FILE] [--categories summarization,rag,coding,...] [--no-builtin]
        [--out F.json]
        [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.hardware import machine_summary
from specdecode.bench.workloads import Prompt, load_default_workload, load_workload
from specdecode.calibration import calibrated_costs
from specdecode.control import Controller, CostModel
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine, Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.backends import load_model
from specdecode.report.analysis import self_repeat
from specdecode.sampling import SamplingParams

SPECBENCH = Path(__file__).resolve().parents[2] / "shared/data/specbench/question.jsonl"
CARDS = Path(__file__).resolve().parents[1] / "src/specdecode/data"


def run_one(loaded: Any, ids: list[int], params: SamplingParams, drafter: Any, k: int,
            costs: CostModel | None = None) -> tuple[float, float, Any, list[int]]:
    """(tokens/s of the whole request, prefill included: the request as users see it;
    tokens/s of its decoding phase alone: the tokens after the first step's, over the time
    after it; counters; the output tokens). Every configuration runs through the same
    batch-1 engine; `costs` given means --k auto (k is then kmax)."""
    return timed_decode(loaded.model, loaded.tokenizer.eos_ids, ids, params, drafter, k, costs)


def timed_decode(model: Any, eos: list[int], ids: list[int], params: SamplingParams,
                 drafter: Any, k: int, costs: CostModel | None = None
                 ) -> tuple[float, float, Any, list[int]]:
    """run_one on a bare model and its EOS ids."""
    gen = Generation(model, None, ids, params, drafter, k, eos)
    controller = None if costs is None else Controller(kmax=k, costs=costs)
    engine = BatchEngine(model, 1, gen.capacity, controller=controller)
    start = time.perf_counter()
    engine.submit(gen)
    first, first_n = 0.0, 0
    while engine.busy:
        engine.step()
        if not first and gen.output:
            first, first_n = time.perf_counter(), len(gen.output)
    end = time.perf_counter()
    n = len(gen.output)
    return n / (end - start), (n - first_n) / max(1e-9, end - first), gen.counters, \
        [int(t) for t in gen.output]


def parse_k(text: str) -> tuple[int, bool]:
    """'4' -> (4, False); 'auto' -> (8, True); 'auto6' -> (6, True)."""
    if text.startswith("auto"):
        return int(text[4:] or 8), True
    return int(text), False


def training_cost(name: str) -> str:
    for card in CARDS.glob(f"{name}/*/card.json"):
        data = json.loads(card.read_text())
        seconds = data.get("train_seconds") or data.get("seconds") or data.get("time_s")
        steps = data.get("steps")
        return f"{name}: trained {steps} steps in {seconds} s ({card.parent.name}, {card})"
    return f"{name}: no training"


def prompts_by_category(args: argparse.Namespace) -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    sources = [load_default_workload(None).prompts if args.builtin else []]
    if args.specbench and Path(args.specbench).exists():
        cats = args.categories.split(",") if args.categories else None
        sources.append(load_workload(args.specbench, categories=cats,
                                     limit_per_category=args.per_category).prompts)
    for source, prefix in zip(sources, ("built-in", "spec-bench"), strict=False):
        for p in source:
            if p.temperature is not None and p.temperature > 0:
                continue  # the built-in high-temperature prompts: temperatures set here
            group = groups.setdefault(f"{prefix}/{p.category}", [])
            if len(group) < args.per_category:
                group.append(p)
    return groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters",
                    default="ngram:4,ngram:auto,layerskip:3,int8:3,heads:4,distilled:4")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--specbench", default=str(SPECBENCH))
    ap.add_argument("--categories", default="summarization,rag,coding,qa,translation,writing")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-builtin", dest="builtin", action="store_false",
                    help="only the Spec-Bench-format file's prompts")
    ap.add_argument("--precision", default="fp32", help="the target's precision (fp32 | bf16)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(None, args.precision)
    tok = loaded.tokenizer
    factories: dict[str, tuple[Any, int, bool]] = {}  # "name:k" -> (factory, k or kmax, auto)
    for item in args.drafters.split(","):
        name, k_text = item.split(":")
        k, auto = parse_k(k_text)
        try:
            factories[item] = (drafter_factory(name, loaded.model, tokenizer=tok),
                               k, auto)
        except SpecDecodeError as exc:
            print(f"# {name}: skipped ({exc})")
    kmax = max((k for _, k, auto in factories.values() if auto), default=0)
    costs = CostModel(target_s=calibrated_costs(loaded.model, [1], kmax, context=256)) \
        if kmax else None
    groups = prompts_by_category(args)
    hw = machine_summary()
    print(f"# SmolLM2-135M-Instruct {args.precision} target, batch 1, {args.max_tokens} new "
          "tokens, "
          f"{hw['cpu']} ({hw['cores']} cores, {torch.get_num_threads()} threads), load average "
          f"{hw.get('load_avg_1m')}; {args.per_category} prompts per category; plain and every "
          "drafter interleaved per prompt, after a warm-up")
    for name in dict.fromkeys(item.split(":")[0] for item in factories):
        print(f"# training cost: {training_cost(name)}")
    results: list[dict[str, Any]] = []
    prompt_rows: list[dict[str, Any]] = []  # per temperature and category: its prompts, once
    for temperature in (float(t) for t in args.temperatures.split(",")):
        print(f"\n## temperature {temperature}")
        print(f"{'category':<28}{'drafter':<11}{'k':>6}{'alpha':>7}{'acc/dr':>7}{'len':>6}"
              f"{'c':>6}{'x plain (min-max)':>20}{'decode x plain':>20}")
        for category, prompts in groups.items():
            rates: dict[str, list[float]] = {"plain": []}
            decode: dict[str, list[float]] = {"plain": []}
            counters: dict[str, list[Any]] = {}
            plain_step: list[float] = []
            per_prompt: list[dict[str, Any]] = []
            for i, p in enumerate(prompts):
                ids = tok.encode(tok.apply_chat_template([{"role": "user",
                                                           "content": p.turns[0]}]))
                params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                        seed=i)
                if not results and i == 0:
                    run_one(loaded, ids, params, None, 0)  # warm-up
                rate, dec, c0, out = run_one(loaded, ids, params, None, 0)
                rates["plain"].append(rate)
                decode["plain"].append(dec)
                plain_step.append(c0.target_ns / max(1, c0.steps))
                by_drafter: dict[str, float] = {}
                prompt_row = {"id": p.id, "prompt_tokens": len(ids), "new_tokens": len(out),
                              "self_repeat": self_repeat(out), "ratio": by_drafter}
                for name, (factory, k, auto) in factories.items():
                    rate, dec, c, _ = run_one(loaded, ids, params, factory(), k,
                                              costs if auto else None)
                    rates.setdefault(name, []).append(rate)
                    decode.setdefault(name, []).append(dec)
                    counters.setdefault(name, []).append(c)
                    by_drafter[name] = rate / rates["plain"][-1]
                per_prompt.append(prompt_row)
                print(f"# {category} {p.id}: {len(ids)} prompt / {len(out)} new tokens, "
                      f"{prompt_row['self_repeat']:.2f} of its 4-grams repeat its own output; "
                      + ", ".join(f"{n} {r:.2f}x" for n, r in by_drafter.items()),
                      flush=True)
            step_ns = statistics.median(plain_step)
            prompt_rows.append({"temperature": temperature, "category": category,
                                "prompts": per_prompt})
            prompt_len = statistics.median(r["prompt_tokens"] for r in per_prompt)
            new_tokens = statistics.median(r["new_tokens"] for r in per_prompt)
            print(f"# {category}: median {prompt_len:.0f} prompt tokens, {new_tokens:.0f} new "
                  "tokens (plain)")
            for name, (_, k, auto) in factories.items():
                cs = counters[name]
                drafted = sum(c.drafted for c in cs)
                accepted = sum(c.accepted for c in cs)
                steps = sum(c.steps for c in cs)
                positions = sum(c.alpha_positions for c in cs)
                alpha = sum(c.alpha_micro for c in cs) / 1e6 / positions if positions else 0.0
                cost = sum(c.draft_ns for c in cs) / max(1, drafted) / step_ns
                ratios = [s / b for s, b in zip(rates[name], rates["plain"], strict=True)]
                decode_ratios = [s / b for s, b in zip(decode[name], decode["plain"],
                                                       strict=True)]
                row = {"temperature": temperature, "category": category, "drafter": name,
                       "k": f"auto{k}" if auto else k, "alpha": alpha,
                       "accepted_per_drafted": accepted / max(1, drafted),
                       "mean_acceptance_length": (accepted + steps) / max(1, steps), "c": cost,
                       "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                       "ratio_max": max(ratios),
                       "decode_ratio": statistics.median(decode_ratios),
                       "decode_ratio_min": min(decode_ratios),
                       "decode_ratio_max": max(decode_ratios),
                       "prompt_tokens": prompt_len, "new_tokens": new_tokens}
                results.append(row)
                print(f"{category:<28}{name.split(':')[0]:<11}{row['k']:>6}{alpha:>7.2f}"
                      f"{row['accepted_per_drafted']:>7.2f}{row['mean_acceptance_length']:>6.2f}"
                      f"{cost:>6.2f}{row['ratio']:>8.2f} ({row['ratio_min']:.2f}-"
                      f"{row['ratio_max']:.2f})   {row['decode_ratio']:.2f} "
                      f"({row['decode_ratio_min']:.2f}-{row['decode_ratio_max']:.2f})",
                      flush=True)
        best: dict[str, tuple[float, str]] = {}
        for r in results:
            if r["temperature"] == temperature and r["ratio"] > best.get(r["category"],
                                                                           (0.0, ""))[0]:
                best[r["category"]] = (r["ratio"], r["drafter"])
        for category, (ratio, name) in best.items():
            verdict = "wins" if ratio > 1.0 else "every drafter loses"
            print(f"  best on {category}: {name} {ratio:.2f}x plain ({verdict})")
    if args.out:
        Path(args.out).write_text(json.dumps({"hardware": hw, "results": results,
                                              "prompts": prompt_rows}, indent=1))


if __name__ == "__main__":
    main()
