"""Forward costs of the native runner on its row-invariant kernels against PyTorch's kernels.

A benchmark, not a test: a SmolLM2-135M-shaped model with random weights (the cost of a step does
not depend on the weights' values), each precision on the row-invariant kernels (models.kernels:
a whole block per call) and on PyTorch's (MKL, fbgemm, the weight-only CPU kernels, SDPA), one
forward of B rows x T new positions after `--context` tokens, interleaved round by round, median
and quartiles of `--reps` rounds; plus the prefill of the context and a 30-layer model too small
to cost anything but per-operator overhead. Prints a table and writes JSON (--out).

    python benchmarks/kernel_costs.py --threads 2 --context 256 --reps 15 --out costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specdecode.models import kernels
from specdecode.models.config import ModelConfig
from specdecode.models.invariance import measure
from specdecode.models.llama import LlamaModel

SHAPES = ((1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (4, 1), (8, 1), (8, 4))  # (B, T)


def smollm_like(layers: int = 30, hidden: int = 576, inter: int = 1536, vocab: int = 49152
                ) -> LlamaModel:
    cfg = ModelConfig("llama", vocab, hidden, inter, layers, 9, 3, hidden // 9, 1e-5, 1e5, 8192,
                      True)
    torch.manual_seed(0)
    model = LlamaModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def step_ms(model: LlamaModel, batch: int, width: int, context: int, reps: int) -> list[float]:
    cache = model.new_cache(batch, context + 32)
    top = min(1000, model.cfg.vocab_size)
    out = []
    with torch.inference_mode():
        for b in range(batch):
            view = cache.view(b, 1)
            model(torch.randint(2, top, (1, context)), view, logits_for="none")
            cache.lengths[b] = context
        tokens = torch.randint(2, top, (batch, width))
        for i in range(reps + 2):
            t = time.perf_counter()
            model(tokens, cache)
            dt = (time.perf_counter() - t) * 1e3
            cache.lengths[:] = [context] * batch
            if i >= 2:  # warm-up
                out.append(dt)
    return out


def prefill_ms(model: LlamaModel, context: int) -> float:
    with torch.inference_mode():
        best = float("inf")
        for _ in range(2):
            cache = model.new_cache(1, context + 8)
            t = time.perf_counter()
            model(torch.randint(100, 1000, (1, context)), cache, logits_for="last")
            best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def machine() -> dict[str, Any]:
    flags = ""
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.split("\n")[0] \
        if kernels.available() else None
    return {"cpu": name, "isa": isa, "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cc": cc, "kernels": kernels.available(),
            "kernels_error": kernels.build_error()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--precisions", default="fp32,bf16,w8a16,w4a16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine()
    print(json.dumps(info), flush=True)
    base = smollm_like()
    results: dict[str, Any] = {"machine": info, "context": args.context, "rows": []}
    modes = ("exact", "torch") if kernels.available() else ("torch",)
    for precision in args.precisions.split(","):
        model = base if precision == "fp32" else base.with_precision(precision)
        if kernels.available():
            model.set_exact(True)
            inv = measure(model)
            print(f"{precision}: invariance on the kernels: {inv.describe()}", flush=True)
            results.setdefault("invariance", {})[precision] = inv.as_dict()
        samples: dict[tuple[str, int, int], list[float]] = {}
        prefill: dict[str, float] = {}
        for _round in range(1):  # modes interleaved per shape
            for b, t in SHAPES:
                for mode in modes:
                    model.set_exact(mode == "exact")
                    samples[mode, b, t] = step_ms(model, b, t, args.context, args.reps)
        for mode in modes:
            model.set_exact(mode == "exact")
            prefill[mode] = prefill_ms(model, args.context)
        for (mode, b, t), xs in samples.items():
            q1, med, q3 = quartiles(xs)
            one = statistics.median(samples[mode, 1, 1])
            row = {"precision": precision, "mode": mode, "batch": b, "width": t,
                   "ms_median": med, "ms_q1": q1, "ms_q3": q3, "v": med / one}
            results["rows"].append(row)
            print(f"{precision:6s} {mode:6s} B={b} T={t:2d}: {med:7.2f} ms [{q1:.2f}, {q3:.2f}] "
                  f"v={med / one:.2f}", flush=True)
        for mode, ms in prefill.items():
            results["rows"].append({"precision": precision, "mode": mode, "prefill_ms": ms})
            print(f"{precision:6s} {mode:6s} prefill {args.context}: {ms:.1f} ms", flush=True)
    tiny = smollm_like(layers=30, hidden=72, inter=96, vocab=512)
    for mode in modes:
        tiny.set_exact(mode == "exact")
        q1, med, q3 = quartiles(step_ms(tiny, 1, 1, args.context, args.reps))
        results["rows"].append({"precision": "fp32", "mode": mode, "model": "overhead-30L",
                                "ms_median": med})
        print(f"30 tiny layers (per-step overhead) {mode}: {med:.2f} ms [{q1:.2f}, {q3:.2f}]")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
