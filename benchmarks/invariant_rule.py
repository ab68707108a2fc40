"""Benchmark (not a test): the drafter-invariant rule against the standard residual rule.

Per drafter x temperature, on the same prompts with the same seeds, measured interleaved in one
run (which rule goes first alternates by prompt): the acceptance (accepted / drafted) under each
rule, the lower bound (1 - TV) / (1 + TV) of Daliri, Musco and Suresh (2024) averaged over the
verified positions (TV(p, q) = 1 - sum min(p, q) there, read from the residual run), mean
acceptance length, and tokens/s of the decoding phase as ratios: invariant / residual and each
rule / plain decoding under the same rule (median over prompts, min-max). It also counts the
seeded speculative outputs token-identical to plain seeded output under each rule: all of them
under "invariant", few beyond their first tokens under "residual".

    python benchmarks/invariant_rule.py [--backend native|llama.cpp] [--drafters ngram,w4a16]
        [--k 4] [--temperatures 0.3,0.7,1.0] [--prompts 8] [--max-tokens 64] [--threads 1]
        [--out F.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from specdecode.bench.hardware import machine_summary
from specdecode.bench.workloads import load_default_workload
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import Generation
from specdecode.models.backends import load_model
from specdecode.sampling import SamplingParams

RULES = ("invariant", "residual")


@dataclasses.dataclass
class Run:
    output: list[int]
    decode_tps: float  # tokens after the first step over the time after it
    drafted: int
    accepted: int
    steps: int
    alphas: list[float]  # per verified position: sum min(p, q) (residual), or accepted (0/1)


def run_one(loaded: Any, ids: list[int], params: SamplingParams, drafter: Any, k: int) -> Run:
    gen = Generation(loaded.model, None, ids, params, drafter, k, loaded.tokenizer.eos_ids)
    alphas: list[float] = []
    gen.step()  # prefill and the first token: the same work under both rules
    first, first_n = time.perf_counter(), len(gen.output)
    while gen.finish_reason is None:
        gen.step()
        alphas += gen.control.alphas
    elapsed = time.perf_counter() - first
    gen.release()
    c = gen.counters
    return Run(list(gen.output), (len(gen.output) - first_n) / max(elapsed, 1e-9), c.drafted,
               c.accepted, c.steps, alphas)


def spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f}x [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="native")
    ap.add_argument("--drafters", default="ngram,w4a16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", default="0.3,0.7,1.0")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(backend=args.backend)
    tok = loaded.tokenizer
    prompts = [p for p in load_default_workload().prompts][: args.prompts]
    ids = [tok.encode_prompt(tok.apply_chat_template([{"role": "user", "content": p.turns[0]}]))
           for p in prompts]
    drafters = {name: drafter_factory(name, loaded.model) for name in args.drafters.split(",")}
    temps = [float(t) for t in args.temperatures.split(",")]
    print(f"# {loaded.describe()}, batch 1, k={args.k}, {len(ids)} built-in prompts x "
          f"{args.max_tokens} tokens; machine {json.dumps(machine_summary())}")
    # warm-up: one short request per configuration
    for make in drafters.values():
        for rule in RULES:
            warm = SamplingParams(temperature=0.7, max_tokens=8, seed=1, rule=rule)
            run_one(loaded, ids[0], warm, make() if make else None, args.k)
    rows: list[dict[str, Any]] = []
    for t in temps:
        runs: dict[tuple[str, str], list[Run]] = {}
        for i, prompt in enumerate(ids):
            order = RULES if i % 2 == 0 else RULES[::-1]
            for rule in order:
                params = SamplingParams(temperature=t, max_tokens=args.max_tokens,
                                        seed=7000 + i, rule=rule)
                runs.setdefault(("plain", rule), []).append(
                    run_one(loaded, prompt, params, None, 0))
                for name, make in drafters.items():
                    assert make is not None
                    runs.setdefault((name, rule), []).append(
                        run_one(loaded, prompt, params, make(), args.k))
        for name in drafters:
            inv, res = runs[(name, "invariant")], runs[(name, "residual")]
            pinv, pres = runs[("plain", "invariant")], runs[("plain", "residual")]
            alphas = [a for r in res for a in r.alphas]
            row = {
                "drafter": name, "temperature": t,
                "acceptance_invariant": sum(r.accepted for r in inv) / max(1, sum(
                    r.drafted for r in inv)),
                "acceptance_residual": sum(r.accepted for r in res) / max(1, sum(
                    r.drafted for r in res)),
                "bound": statistics.fmean(a / (2 - a) for a in alphas) if alphas else None,
                "tokens_per_step_invariant": sum(len(r.output) for r in inv) / max(1, sum(
                    r.steps for r in inv)),
                "tokens_per_step_residual": sum(len(r.output) for r in res) / max(1, sum(
                    r.steps for r in res)),
                "identical_invariant": sum(a.output == b.output for a, b in zip(inv, pinv,
                                                                                strict=True)),
                "identical_residual": sum(a.output == b.output for a, b in zip(res, pres,
                                                                               strict=True)),
                "prompts": len(ids),
                "invariant_over_residual": [a.decode_tps / b.decode_tps
                                            for a, b in zip(inv, res, strict=True)],
                "invariant_over_plain": [a.decode_tps / b.decode_tps
                                         for a, b in zip(inv, pinv, strict=True)],
                "residual_over_plain": [a.decode_tps / b.decode_tps
                                        for a, b in zip(res, pres, strict=True)],
                "plain_invariant_over_residual": [a.decode_tps / b.decode_tps
                                                  for a, b in zip(pinv, pres, strict=True)],
            }
            rows.append(row)
            bound = "n/a" if row["bound"] is None else f"{row['bound']:.2f}"
            print(f"{name:>8} T={t:.1f}  accept inv {row['acceptance_invariant']:.2f} "
                  f"res {row['acceptance_residual']:.2f} bound {bound}  tok/step inv "
                  f"{row['tokens_per_step_invariant']:.2f} res "
                  f"{row['tokens_per_step_residual']:.2f}  identical to plain inv "
                  f"{row['identical_invariant']}/{len(ids)} res "
                  f"{row['identical_residual']}/{len(ids)}")
            print(f"{'':>8}        speed inv/res {spread(row['invariant_over_residual'])}  "
                  f"inv/plain {spread(row['invariant_over_plain'])}  res/plain "
                  f"{spread(row['residual_over_plain'])}  plain inv/res "
                  f"{spread(row['plain_invariant_over_residual'])}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"machine": machine_summary(), "args": vars(args), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
