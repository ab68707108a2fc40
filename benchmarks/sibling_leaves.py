"""Benchmark (not a test): a draft model with and without sibling leaves (`X` against `X-tree`),
tokens committed per target pass and tokens/s, on Spec-Bench summarization, RAG and coding
prompts, batch 1, interleaved per prompt.

    python benchmarks/sibling_leaves.py [--drafter w4a16|distilled] [--ks 3,5]
        [--temperatures 0,0.7] [--per-category 3] [--max-tokens 48] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.bench.hardware import machine_summary
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import Generation
from specdecode.models.backends import load_model
from specdecode.sampling import SamplingParams

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench" / \
    "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--drafter", default="w4a16")
    ap.add_argument("--ks", default="3,5")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--specbench", default=str(SPEC_BENCH))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    tok = loaded.tokenizer
    lines = Path(args.specbench).read_text(encoding="utf-8").splitlines()
    questions = [json.loads(line) for line in lines if line.strip()]
    prompts = [q for cat in ("summarization", "rag", "coding")
               for q in [q for q in questions if q["category"] == cat][: args.per_category]]
    makers = {name: drafter_factory(name, loaded.model) for name in
              (args.drafter, args.drafter + "-tree")}
    print(f"# {json.dumps(machine_summary())}, {args.threads} threads; {len(prompts)} prompts x "
          f"{args.max_tokens} tokens, batch 1")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for k in (int(k) for k in args.ks.split(",")):
            totals = {name: [0, 0, 0.0] for name in makers}
            for i, q in enumerate(prompts):
                ids = tok.encode(tok.apply_chat_template(
                    [{"role": "user", "content": q["turns"][0]}]))
                order = list(makers) if i % 2 == 0 else list(makers)[::-1]
                for name in order:
                    make = makers[name]
                    assert make is not None
                    params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                            seed=i)
                    gen = Generation(loaded.model, tok, ids, params, make(), k, tok.eos_ids)
                    start = time.perf_counter()
                    for _ in gen.run():
                        pass
                    spent = time.perf_counter() - start
                    gen.release()
                    totals[name][0] += len(gen.output)
                    totals[name][1] += gen.counters.steps
                    totals[name][2] += spent
            for name, (tokens, steps, spent) in totals.items():
                print(f"T={temperature} k={k} {name:16s} tokens per target pass "
                      f"{tokens / steps:.2f}, {tokens / spent:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
