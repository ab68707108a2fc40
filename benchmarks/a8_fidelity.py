"""How far each exact target is from fp32, against how far llama.cpp itself is, on the same GGUF.

Teacher-forced (specdecode.agreement): every target reads the same token ids, Spec-Bench prompts
of every category (held out: nothing here was tuned on them), scored 8 positions per forward
pass as speculation scores drafts; per position the argmax is compared with fp32's (top-1
agreement) and KL(p_fp32 || p_target) in nats is averaged. The targets: checkpoint (the GGUF's
weights, fp32 activations), checkpoint-a8 (the same weights, int8 activations per block of 32,
integer dot products) and llama.cpp's own CPU kernels on the same file (`--backend llama.cpp`,
which also rounds activations to 8 bits).

    python benchmarks/a8_fidelity.py [--model NAME_OR_GGUF] [--per-category 2] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SPEC_BENCH = (Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench"
              / "question.jsonl")


def prompts(per_category: int) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    with SPEC_BENCH.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            cat = row.get("category", "?")
            if seen.get(cat, 0) >= per_category:
                continue
            seen[cat] = seen.get(cat, 0) + 1
            turns = row.get("turns") or [row.get("prompt", "")]
            out.append(str(turns[0]))
    return out


def main(argv: list[str] | None = None) -> int:
    from specdecode.agreement import compare_logits, teacher_forced_logits
    from specdecode.models.backends import load_model

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256, help="ids per prompt, at most")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llamacpp", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = prompts(args.per_category)
    targets = ["checkpoint", "checkpoint-a8"]
    ref = load_model(args.model, "fp32", "native")
    ids = [ref.tokenizer.encode(t)[: args.max_tokens] for t in texts]
    ids = [x for x in ids if len(x) >= 2]
    start = time.perf_counter()
    want = [teacher_forced_logits(ref.model, x, 8) for x in ids]
    ref.model = None  # free the fp32 copy before the next target loads
    rows = []
    for name in [*targets, *([] if args.no_llamacpp else ["llama.cpp"])]:
        loaded = (load_model(args.model, "auto", "llama.cpp") if name == "llama.cpp"
                  else load_model(args.model, name, "native"))
        got = [teacher_forced_logits(loaded.model, x, 8) for x in ids]
        top1, kl, kl_max = compare_logits(torch.cat(want), torch.cat(got))
        rows.append((name, top1, kl, kl_max))
        if hasattr(loaded.model, "close"):
            loaded.model.close()
    positions = sum(len(x) for x in ids)
    print(f"# agreement with fp32: {ref.name}, {len(ids)} Spec-Bench prompts "
          f"({args.per_category} per category), {positions} positions, teacher forced in blocks "
          f"of 8, {args.threads} threads ({time.perf_counter() - start:.0f} s)")
    print("| target | top-1 agreement | mean KL (nats) | max KL |")
    print("|---|---|---|---|")
    for name, top1, kl, kl_max in rows:
        print(f"| {name} | {top1:.4f} | {kl:.5f} | {kl_max:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
