"""5- and 6-bit codes as bytes or as 4-bit panels plus their high bits (kernels.bit_planes_pay;
docs/measurements/2026-12-07-high-bits.md): one GGUF at checkpoint-a8 loaded both ways in one
process, the logits compared bit for bit, then the time of scoring T positions after --context
tokens (batch 1), both models interleaved in shuffled rounds.

    python benchmarks/high_bits.py [--model qwen2.5-coder-1.5b] [--widths 1,2,3,5,9]
        [--rounds 5] [--threads 2]

Prints per T the median of each form (3 calls a round) and packed / bytes, then v(T) of each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from specdecode.models import gguf_blocks, kernels, loading
from specdecode.models import precision as precisions
from specdecode.models.config import config_from_hf, read_hf_config

FORMS = {"bytes": False, "packed": True}


def load_both(spec: str) -> dict[str, Any]:
    folder, source, _ = loading.resolve_folder(spec)
    cfg = config_from_hf(read_hf_config(folder), "config")
    record = precisions.get("checkpoint-a8")
    assert record.gguf_mode is not None
    chosen = kernels.bit_planes_pay
    models = {}
    try:
        for name, pay in FORMS.items():
            kernels.bit_planes_pay = lambda pay=pay: pay  # type: ignore[misc]
            models[name] = gguf_blocks.load_gguf_model(source, cfg, record.gguf_mode, record.name)
    finally:
        kernels.bit_planes_pay = chosen  # type: ignore[method-assign]
    return models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,2,3,5,9")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    models = load_both(args.model)
    vocab = next(iter(models.values())).cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab, (1, 40), generator=gen)
    logits = {}
    with torch.inference_mode():
        for name, m in models.items():
            logits[name] = m(prompt, m.new_cache(1, 64))
    print(f"{args.model} on the {kernels.path_name()} path, {args.threads} threads, batch 1, "
          f"context {args.context}; logits bit-identical: "
          f"{torch.equal(logits['bytes'], logits['packed'])}")
    context = torch.randint(vocab, (1, args.context), generator=gen)
    caches = {}
    with torch.inference_mode():
        for name, m in models.items():
            caches[name] = m.new_cache(1, args.context + max(widths) + 1)
            m(context, caches[name], logits_for="none")
    tokens = {t: torch.randint(vocab, (1, t), generator=gen) for t in widths}

    def step(name: str, t: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            models[name](tokens[t], caches[name])
        elapsed = time.perf_counter() - start
        caches[name].rollback(0, args.context)
        return elapsed

    times: dict[tuple[str, int], list[float]] = {(n, t): [] for n in models for t in widths}
    for key in times:
        step(*key)  # warm-up
    for _ in range(args.rounds):
        order = list(times)
        random.shuffle(order)
        for key in order:
            times[key] += [step(*key) for _ in range(3)]
    med = {key: statistics.median(v) for key, v in times.items()}
    for t in widths:
        a, b = med[("bytes", t)], med[("packed", t)]
        print(f"T={t}: bytes {a * 1e3:.1f} ms, packed {b * 1e3:.1f} ms, packed/bytes {b / a:.3f}")
    for name in models:
        print(f"{name} v(T): " + " ".join(f"{t}:{med[(name, t)] / med[(name, 1)]:.2f}"
                                          for t in widths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
