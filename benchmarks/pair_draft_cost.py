"""Benchmark (not a test): what a draft token of the Qwen2.5-Coder pair's 0.5B costs, and what a
pruned head (`--draft-vocab N`: the lowest N ids of its head, drafters.draft_head) buys and
loses (issue #44, item 3). In one process, on the pair installed by `specdecode models install
qwen2.5-coder`:

1. Held-out text: Spec-Bench prompts (the chat template applied) and the target's own greedy
   continuation of each (`--continue` tokens, the target at `--precision`).
2. alpha per head size: the draft's greedy token against the target's, teacher-forced over the
   continuations only (the prompt's positions are not what a draft drafts), and the coverage:
   the share of the target's tokens below N (a token above N can never be drafted).
3. Costs (drafters.auto.measure: the target and every draft interleaved round by round after a
   warm-up, medians): c = one draft token's forward (argmax included) over the target's plain
   step, v(T) over T positions, after the first prompt and its continuation as context; and the
   engine's own price of a drafting step: `DraftModelDrafter.propose` with k drafts (its Python,
   sync and sampling pipeline included) per drafted token, over the plain step.
4. The predicted speedup of each, max over k of E(alpha, k) / (k c + v(k + 1)).

    python benchmarks/pair_draft_cost.py --vocabs 0,65536,32768,16384 --per-category 3 \
        --categories coding,math_reasoning,writing,qa,summarization,translation [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from specdecode.acceptance import expected_tokens
from specdecode.bench.hardware import machine_summary
from specdecode.bench.workloads import load_workload
from specdecode.drafters import auto
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.draft_head import with_draft_head
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.models.backends import load_model
from specdecode.sampling import SamplingParams

SPECBENCH = Path(__file__).resolve().parents[2] / "shared/data/specbench/question.jsonl"


def held_out(target: Any, tokenizer: Any, args: argparse.Namespace
             ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy continuation) per Spec-Bench prompt."""
    out = []
    work = load_workload(args.specbench, categories=args.categories.split(","),
                         limit_per_category=args.per_category)
    for p in work.prompts:
        ids = tokenizer.encode_prompt(p.turns[0])[-args.max_prompt:]
        cache = target.new_cache(1, len(ids) + args.tokens + 1)
        cont: list[int] = []
        with torch.inference_mode():
            logits = target(torch.tensor([ids]), cache, logits_for="last")[0, -1]
            for _ in range(args.tokens):
                cont.append(int(logits.argmax()))
                logits = target(torch.tensor([[cont[-1]]]), cache, logits_for="last")[0, -1]
        out.append((ids, cont))
    return out


def agreement(draft: Any, texts: list[tuple[list[int], list[int]]], vocab: int
              ) -> tuple[float, float]:
    """(alpha, coverage) of `draft` over the continuations, teacher-forced."""
    hits = covered = total = 0
    for ids, cont in texts:
        seq = torch.tensor([ids + cont])
        with torch.inference_mode():
            logits = draft(seq, draft.new_cache(1, seq.shape[1]))[0]
        got = logits[len(ids) - 1 : -1].argmax(dim=-1)
        want = torch.tensor(cont)
        hits += int((got == want).sum())
        covered += int((want < vocab).sum())
        total += len(cont)
    return hits / total, covered / total


def propose_cost(model: Any, ids: list[int], k: int, rounds: int) -> float:
    """Median seconds per drafted token of DraftModelDrafter.propose over `ids` (greedy), its
    cache synced to all but the last token first (as in decoding: one pending token); in
    inference mode, as the engine runs it."""
    drafter = DraftModelDrafter(model, "draft-model", len(ids) + k + 8)
    context = torch.tensor(ids)
    times = []
    with torch.inference_mode():
        drafter.propose(DraftRequest(context[:-1], 1, SamplingParams(), len(ids)))  # warm, synced
        for _ in range(rounds):
            drafter.fed = drafter.fed[: len(ids) - 1]
            assert drafter.cache is not None
            drafter.cache.rollback(0, len(ids) - 1)
            start = time.perf_counter()
            drafter.propose(DraftRequest(context, k, SamplingParams(), len(ids)))
            times.append(time.perf_counter() - start)
    return statistics.median(times) / k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--precision", default="checkpoint-a8")
    ap.add_argument("--vocabs", default="0,65536,32768,16384", help="0: the whole head")
    ap.add_argument("--specbench", default=str(SPECBENCH))
    ap.add_argument("--categories", default="coding,math_reasoning,writing,qa,summarization,"
                                            "translation")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="target continuation per prompt")
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--k", type=int, default=4, help="drafts per propose call (engine cost)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(args.model, precision=args.precision)
    target, tokenizer = loaded.model, loaded.tokenizer
    draft = load_model(args.draft_model, precision="auto", as_draft=True).model
    print(f"# {machine_summary()}; threads {args.threads}; target {args.model} "
          f"{target.precision}, draft {args.draft_model} {draft.precision}")
    texts = held_out(target, tokenizer, args)
    print(f"# {len(texts)} prompts, {sum(len(c) for _, c in texts)} continuation tokens")
    vocabs = [int(v) for v in args.vocabs.split(",")]
    models = {v: draft if v == 0 else with_draft_head(draft, v) for v in vocabs}
    size = int(draft.cfg.vocab_size)
    parts: dict[str, Any] = {
        str(v): auto._Part(m, False, lambda: None)  # type: ignore[arg-type,return-value]
        for v, m in models.items()}
    context = texts[0][0] + texts[0][1]
    sel = auto.measure(target, context, parts, rounds=args.rounds, max_k=8)
    plain = sel.plain_step_s
    print(f"target plain step {plain * 1e3:.1f} ms after {len(context)} tokens; v(1..9) = "
          + ", ".join(f"{x:.2f}" for x in sel.v))
    rows = []
    print(f"{'head rows':>10}{'coverage':>10}{'alpha':>8}{'c fwd':>8}{'c propose':>11}"
          f"{'pred (fwd)':>12}{'pred (propose)':>16}")
    for v, m in models.items():
        alpha, coverage = agreement(m, texts, v or size)
        c_fwd = next(r.c for r in sel.candidates if r.name == str(v))
        c_prop = propose_cost(m, context, args.k, args.rounds) / plain
        best = {}
        for name, c in (("fwd", c_fwd), ("propose", c_prop)):
            s, k = max((expected_tokens(alpha, k) / (k * c + sel.v[k]), k)
                       for k in range(1, len(sel.v)))
            best[name] = (s, k)
        rows.append({"vocab": v or size, "coverage": coverage, "alpha": alpha, "c_forward": c_fwd,
                     "c_propose": c_prop, "predicted_forward": best["fwd"],
                     "predicted_propose": best["propose"]})
        print(f"{v or size:>10}{coverage:>10.3f}{alpha:>8.3f}{c_fwd:>8.3f}{c_prop:>11.3f}"
              f"{best['fwd'][0]:>9.2f}x k{best['fwd'][1]}{best['propose'][0]:>12.2f}x k"
              f"{best['propose'][1]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_summary(), "v": sel.v,
                                               "plain_step_s": plain, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
