"""Benchmark (not a test): how often the distilled draft, exported as a Hugging Face folder for
vLLM's draft_model (drafters.distilled_hf), picks SmolLM2's greedy token, with its full head and
restricted to its training subset, on Spec-Bench prompts (docs/measurements/vllm.md).

    python benchmarks/distilled_hf_agreement.py [--per-category 2] [--max-tokens 64]

For each prompt's first turn: SmolLM2 (fp32, transformers) decodes greedily; the draft scores the
same sequence in one pass; at every generated position the draft's argmax over the whole
vocabulary and over its subset are compared with the target's token.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdecode.bench.workloads import load_workload
from specdecode.drafters.distilled import DEFAULT_DIR, read_config
from specdecode.drafters.distilled_hf import cached_hf_export
from specdecode.models.loading import converted_folder
from specdecode.models.paths import default_model_path

SPECBENCH = "/work/shared/data/specbench/question.jsonl"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=SPECBENCH)
    p.add_argument("--categories", default="summarization,rag,coding,writing")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    target_dir = converted_folder(default_model_path())
    draft_dir = cached_hf_export(DEFAULT_DIR, default_model_path())
    subset = int(read_config(DEFAULT_DIR)["vocab_size"])
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    workload = load_workload(args.workload, categories=args.categories.split(","),
                             limit_per_category=args.per_category)
    full = sub = outside = n = 0
    for prompt in workload.prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt.turns[0]}],
                                      add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.inference_mode():
            out = target.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
            start = ids.shape[1]
            want = out[0, start:]
            logits = draft(out).logits[0, start - 1:-1]
        picks = logits.argmax(-1)
        full += int((picks == want).sum())
        sub += int((logits[:, :subset].argmax(-1) == want).sum())
        outside += int((picks >= subset).sum())
        n += len(want)
    print(f"{n} positions: full head agrees {full} ({full / n:.3f}), subset-restricted "
          f"{sub} ({sub / n:.3f}); full head's pick outside the subset {outside} "
          f"({outside / n:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
