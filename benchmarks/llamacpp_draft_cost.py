"""Benchmark (not a test): the distilled draft exported to GGUF on the llama.cpp backend, by
weight type and head: its cost ratio c and its greedy agreement with the target.

- c: the time of one greedy `propose(context, k=1)` of a fresh drafter in steady state (it feeds
  the pending token, as when drafting), over the time of one target step scoring one position
  after the same context (bench.costcurves.drafting_seconds, calibration.forward_costs: what
  `specdecode bench` measures, with more repeats). Measured in rounds, every variant once per
  round after the target's step, so load on a shared machine falls on all of them alike; the
  figure is the median over rounds with its min and max.
- agreement: the share of positions of the target's own plain greedy output (built-in prompts)
  where the draft's greedy token, fed the same context, is the target's next token: the
  acceptance rate of one-token greedy drafts.

    python benchmarks/llamacpp_draft_cost.py [--types f32,f16,q8_0,q4_0] [--heads subset,full]
        [--rounds 7] [--repeats 15] [--context 128] [--prompts 12] [--max-tokens 64]
        [--threads 1] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.costcurves import drafting_seconds, repeating_context
from specdecode.bench.hardware import machine_summary
from specdecode.bench.workloads import load_default_workload
from specdecode.calibration import forward_costs
from specdecode.drafters.distilled import DEFAULT_DIR
from specdecode.drafters.distilled_gguf import export_distilled_gguf
from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.engine import Generation
from specdecode.models.backends import load_model
from specdecode.models.paths import default_model_path
from specdecode.sampling import SamplingParams


def agreement(target: Any, draft: Any, sequences: list[tuple[list[int], list[int]]]) -> float:
    """Share of output positions where the draft's argmax is the target's next token."""
    hits = total = 0
    for prompt, output in sequences:
        ids = prompt + output
        cache = draft.new_cache(1, len(ids) + 1)
        logits = draft(torch.tensor([ids[:-1]]), cache, logits_for="all")[0]
        guesses = logits[len(prompt) - 1:].argmax(-1).tolist()  # predicts output[0..]
        hits += sum(int(g == t) for g, t in zip(guesses, output, strict=True))
        total += len(output)
        cache.release()
    return hits / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="f32,f16,q8_0,q4_0")
    ap.add_argument("--heads", default="subset,full")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(backend="llama.cpp")
    target, tok = loaded.model, loaded.tokenizer
    folder = Path(tempfile.mkdtemp(prefix="distilled-gguf-"))
    variants: dict[str, Any] = {}
    for head in args.heads.split(","):
        for wtype in args.types.split(","):
            path = export_distilled_gguf(DEFAULT_DIR, default_model_path(),
                                         folder / f"{head}-{wtype}.gguf", weight_type=wtype,
                                         head=head)
            make = drafter_factory(DrafterOptions("draft-model", draft_model=str(path)), target)
            assert make is not None
            variants[f"{head}-{wtype}"] = (make, path.stat().st_size)
    every = load_default_workload().prompts
    prompts = every[:: max(1, len(every) // args.prompts)][: args.prompts]  # all categories
    sequences = []
    for p in prompts:
        ids = tok.encode_prompt(tok.apply_chat_template([{"role": "user",
                                                          "content": p.turns[0]}]))
        gen = Generation(target, None, ids, SamplingParams(max_tokens=args.max_tokens), None, 0,
                         tok.eos_ids)
        for _ in gen.run():
            pass
        gen.release()
        sequences.append((ids, gen.output))
    context = repeating_context(target.cfg.vocab_size, args.context)
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    steps: list[float] = []
    start = time.perf_counter()
    for _ in range(args.rounds):
        step = float(forward_costs(target, 1, args.context, 1, args.repeats)[0]["median_s"])
        steps.append(step)
        for name, (make, _) in variants.items():
            ratios[name].append(drafting_seconds(make, 1, context, args.repeats) / step)
    rows = []
    for name, (make, size) in variants.items():
        drafter = make()
        rows.append({
            "variant": name, "bytes": size,
            "c_median": statistics.median(ratios[name]), "c_min": min(ratios[name]),
            "c_max": max(ratios[name]),
            "draft_ms": statistics.median(ratios[name]) * statistics.median(steps) * 1e3,
            "agreement": agreement(target, drafter.model, sequences),
        })
    result = {"machine": machine_summary(), "threads": args.threads, "context": args.context,
              "rounds": args.rounds, "repeats": args.repeats,
              "target_step_ms": [s * 1e3 for s in steps], "seconds": time.perf_counter() - start,
              "positions": sum(len(o) for _, o in sequences), "variants": rows}
    print(f"target step {statistics.median(steps) * 1e3:.2f} ms (median of {args.rounds} rounds,"
          f" {min(steps) * 1e3:.2f}-{max(steps) * 1e3:.2f}), context {args.context}, "
          f"{args.threads} thread(s); agreement over {result['positions']} positions")
    for r in rows:
        print(f"  {r['variant']:12s} {r['bytes'] / 2**20:6.1f} MiB  c {r['c_median']:.3f} "
              f"[{r['c_min']:.3f}, {r['c_max']:.3f}]  {r['draft_ms']:.2f} ms  "
              f"agreement {r['agreement']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
