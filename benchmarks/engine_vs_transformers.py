"""Benchmark (not a test): speculative vs plain decoding at batch 1 on SmolLM2, ours vs
transformers' assisted generation with the same target, the same int8 draft and the same prompts.

Prints, per temperature: tokens/s of plain and speculative decoding (ours and transformers'),
their ratios measured in this one run (interleaved, after a warm-up, medians over prompts with
min-max spread), the measured alpha, accepted/drafted, c (cost of drafting one token relative to
one target step), v(k), the predicted speedup S = (1 - a^(k+1)) / ((1 - a)(k c + v(k))) and
measured / predicted.

    python benchmarks/engine_vs_transformers.py [--k 3] [--max-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any

import torch

from specdecode.bench.hardware import machine_summary
from specdecode.calibration import forward_costs
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Generation
from specdecode.models.backends import load_model
from specdecode.models.loading import resolve_folder
from specdecode.models.precision import quantize_int8
from specdecode.sampling import SamplingParams

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize in two sentences: The Industrial Revolution began in Britain in the late 18th "
    "century, when new machines for spinning and weaving, powered first by water and then by "
    "steam, moved textile production from homes into factories.",
    "What causes the seasons on Earth?",
    "Translate into French: The library opens at nine and closes at six.",
    "Give me three tips for a job interview.",
    "Write a short story opening about a lighthouse keeper.",
]


def ours(loaded: Any, ids: list[int], params: SamplingParams, drafter: Any, k: int) -> Any:
    gen = Generation(loaded.model, None, ids, params, drafter, k, loaded.tokenizer.eos_ids)
    start = time.perf_counter()
    for _ in gen.run():
        pass
    return len(gen.output) / (time.perf_counter() - start), gen.counters


def theirs(hf: Any, assistant: Any, ids: list[int], params: SamplingParams, k: int) -> float:
    kwargs: dict[str, Any] = {"max_new_tokens": params.max_tokens, "pad_token_id": 2,
                              "eos_token_id": 2}
    if params.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=params.temperature, top_k=0)
    if assistant is not None:
        kwargs.update(assistant_model=assistant, num_assistant_tokens=k,
                      num_assistant_tokens_schedule="constant")
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), **kwargs)
    return (out.shape[1] - len(ids)) / (time.perf_counter() - start)


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    loaded = load_model()
    draft = quantize_int8(copy.deepcopy(loaded.model))
    folder = resolve_folder(None)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_draft = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(hf), {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig})
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in PROMPTS]
    hw = machine_summary()
    print(f"# SmolLM2-135M-Instruct fp32 target, int8 copy as draft, k={args.k}, batch 1, "
          f"{args.max_tokens} new tokens, {hw['cpu']} ({hw['cores']} cores, "
          f"{torch.get_num_threads()} threads), torch {hw['torch']}")
    target_curve = forward_costs(loaded.model, 1, 128, args.k + 1, 5)
    draft_curve = forward_costs(draft, 1, 128, 1, 5)
    c = draft_curve[0]["median_s"] / target_curve[0]["median_s"]
    v = target_curve[args.k]["v"]  # k+1 positions scored
    print(f"# c = {c:.2f} (int8 draft step / target step), v({args.k}) = {v:.2f}")
    for temperature in (0.0, 0.7):
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=0)
        rows: dict[str, list[float]] = {"ours plain": [], "ours spec": [], "hf plain": [],
                                        "hf assisted": []}
        drafted = accepted = alpha_n = 0
        alpha_sum = 0.0
        steps = 0
        ours(loaded, prompts[0], params, None, 0)  # warm-up
        theirs(hf, None, prompts[0], params, args.k)
        for ids in prompts:
            rows["ours plain"].append(ours(loaded, ids, params, None, 0)[0])
            rate, counters = ours(loaded, ids, params, DraftModelDrafter(draft), args.k)
            rows["ours spec"].append(rate)
            rows["hf plain"].append(theirs(hf, None, ids, params, args.k))
            rows["hf assisted"].append(theirs(hf, hf_draft, ids, params, args.k))
            drafted += counters.drafted
            accepted += counters.accepted
            steps += counters.steps
            alpha_sum += counters.alpha_micro / 1e6
            alpha_n += counters.alpha_positions
        alpha = alpha_sum / alpha_n
        k = args.k
        predicted = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + v))
        ratio = [s / p for s, p in zip(rows["ours spec"], rows["ours plain"], strict=True)]
        hf_ratio = [s / p for s, p in zip(rows["hf assisted"], rows["hf plain"], strict=True)]
        vs_hf = [s / h for s, h in zip(rows["ours spec"], rows["hf assisted"], strict=True)]
        print(f"\n## temperature {temperature}: tokens/s, median (min-max) over "
              f"{len(prompts)} prompts")
        for name, xs in rows.items():
            print(f"  {name:12s} {med(xs)}")
        print(f"  ours spec / ours plain     {med(ratio)}")
        print(f"  hf assisted / hf plain     {med(hf_ratio)}")
        print(f"  ours spec / hf assisted    {med(vs_hf)}")
        print(f"  alpha {alpha:.3f}, accepted/drafted {accepted / max(1, drafted):.3f}, mean "
              f"acceptance length {(accepted + steps) / steps:.2f}")
        print(f"  predicted speedup {predicted:.2f}, measured/predicted "
              f"{statistics.median(ratio) / predicted:.2f}")


if __name__ == "__main__":
    main()
