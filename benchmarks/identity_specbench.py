"""Greedy speculative output against the same precision's plain output, token by token, on
Spec-Bench prompts (a benchmark-sized identity check, not a test).

For each precision on the native runner's row-invariant kernels: the load-time invariance
measure, then every prompt decoded greedily by plain decoding and by `--drafter` under the
controller (k auto), at batch 1 and at batch `--batch` (continuous batching, rows of other
prompts beside each other), and the count of outputs token-identical to plain batch-1 decoding.
Prints a table and writes JSON with every mismatch's prompt and first differing position.

    python benchmarks/identity_specbench.py --prompts 48 --max-tokens 128 --batch 8 \
        --precisions fp32,bf16,w8a16,w4a16 --drafter ngram --threads 2 --out identity.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specdecode.control import Controller
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from specdecode.models.precision import apply_precision
from specdecode.sampling import SamplingParams

SPECBENCH = Path(os.environ.get("SPECBENCH", "/work/shared/data/specbench/question.jsonl"))
CATEGORIES = ("summarization", "rag", "coding", "math_reasoning")


def prompts(n: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in SPECBENCH.read_text().splitlines() if line.strip()]
    picked: list[tuple[str, str]] = []
    per = -(-n // len(CATEGORIES))
    for cat in CATEGORIES:
        mine = [r for r in rows if r.get("category") == cat][:per]
        picked += [(f"{cat}-{r['question_id']}", r["turns"][0]) for r in mine]
    return picked[:n]


def decode(loaded: LoadedModel, model: Any, ids: list[list[int]], factory: Any, batch: int,
           max_tokens: int) -> list[list[int]]:
    engine = BatchEngine(model, batch, max(len(x) for x in ids) + max_tokens + 32,
                         controller=Controller(kmax=8) if factory is not None else None)
    gens = [Generation(model, None, x, SamplingParams(max_tokens=max_tokens),
                       None if factory is None else factory(), 0 if factory is None else 8,
                       loaded.tokenizer.eos_ids) for x in ids]
    return [g.output for g in run_batch(engine, gens)]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)) if len(a) != len(b) else -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precisions", default="fp32,bf16,w8a16,w4a16")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model()
    tok = loaded.tokenizer
    chosen = prompts(args.prompts)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
           for _, text in chosen]
    report: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}, "precisions": {}}
    for precision in args.precisions.split(","):
        model = apply_precision(loaded.model, precision)
        factory = drafter_factory(args.drafter, model)  # refuses an inexact target
        start = time.perf_counter()
        plain = decode(loaded, model, ids, None, 1, args.max_tokens)
        row: dict[str, Any] = {"invariance": model.invariance.as_dict()
                               if model.invariance else None}
        for batch in (1, args.batch):
            spec = decode(loaded, model, ids, factory, batch, args.max_tokens)
            same = [s == p for s, p in zip(spec, plain, strict=True)]
            row[f"batch{batch}"] = {
                "identical": sum(same), "of": len(same),
                "mismatches": [{"prompt": chosen[i][0], "first": first_difference(spec[i],
                                                                                  plain[i])}
                               for i, ok in enumerate(same) if not ok]}
            if batch > 1:
                plain_b = decode(loaded, model, ids, None, batch, args.max_tokens)
                row[f"plain_batch{batch}_identical"] = sum(
                    a == b for a, b in zip(plain_b, plain, strict=True))
        row["seconds"] = time.perf_counter() - start
        report["precisions"][precision] = row
        print(f"{precision}: batch 1 {row['batch1']['identical']}/{len(ids)}, batch "
              f"{args.batch} {row[f'batch{args.batch}']['identical']}/{len(ids)} identical to "
              f"plain (plain at batch {args.batch}: "
              f"{row[f'plain_batch{args.batch}_identical']}/{len(ids)}); {row['seconds']:.0f} s",
              flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
