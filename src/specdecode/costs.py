"""Cost curves (a benchmark, not a test): the time of one forward pass scoring k new positions
over a fixed context, per batch size, and v(k) = time(k) / time(1). Also, at batch 1, the
per-token latency of plain decoding here against transformers' generate() on the same weights.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from specdecode.models.loading import load_model


def hardware() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__}


def _median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of fn() over `repeats` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def forward_costs(model: Any, batch: int, context: int, kmax: int, repeats: int) -> list[dict]:
    """Median time of one forward scoring k = 1..kmax positions after `context` tokens."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    cache = model.new_cache(batch, context + kmax + 1)
    with torch.inference_mode():
        for i in range(0, context, 256):
            n = min(256, context - i)
            model(torch.randint(vocab, (batch, n), generator=gen), cache, logits_for="none")
    rows = []
    for k in range(1, kmax + 1):
        tokens = torch.randint(vocab, (batch, k), generator=gen)

        def step(tokens: torch.Tensor = tokens) -> None:
            with torch.inference_mode():
                model(tokens, cache)
            for b in range(batch):
                cache.rollback(b, context)

        med, lo, hi = _median_time(step, repeats)
        rows.append({"k": k, "batch": batch, "median_s": med, "min_s": lo, "max_s": hi})
    t1 = rows[0]["median_s"]
    for r in rows:
        r["v"] = r["median_s"] / t1
    return rows


def _per_token(run: Callable[[int], object], new_tokens: int, repeats: int) -> float:
    """Marginal seconds per decoded token: (time(n + 1 tokens) - time(1 token)) / n, medians."""
    one = _median_time(lambda: run(1), repeats)[0]
    many = _median_time(lambda: run(new_tokens + 1), repeats)[0]
    return (many - one) / new_tokens


def peer_comparison(loaded: Any, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Per-token plain greedy decoding latency, native runner vs transformers generate()."""
    from transformers import AutoModelForCausalLM

    from specdecode.engine import Generation
    from specdecode.models.loading import resolve_folder
    from specdecode.sampling import SamplingParams

    folder = resolve_folder(None if loaded.name == "SmolLM2-135M-Instruct" else
                            str(loaded.source))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = loaded.tokenizer.encode("The history of the printing press begins")

    def ours(n: int) -> None:
        gen = Generation(loaded.model, None, prompt, SamplingParams(max_tokens=n))
        for _ in gen.run():
            pass

    def theirs(n: int) -> None:
        with torch.inference_mode():
            hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)

    native = _per_token(ours, new_tokens, repeats)
    peer = _per_token(theirs, new_tokens, repeats)
    return {"native_s_per_token": native, "transformers_s_per_token": peer,
            "ratio_native_over_transformers": native / peer, "new_tokens": new_tokens,
            "batch": 1}


def run_costs(model_spec: str | None, precision: str, backend: str, context: int, kmax: int,
              batches: list[int], repeats: int, compare_transformers: bool = True
              ) -> dict[str, Any]:
    loaded = load_model(model_spec, precision, backend)
    curves = [forward_costs(loaded.model, b, context, kmax, repeats) for b in batches]
    result: dict[str, Any] = {"model": loaded.describe(), "hardware": hardware(),
                              "context": context, "curves": curves}
    if compare_transformers and precision == "fp32":
        result["peer"] = peer_comparison(loaded, 32, max(3, repeats // 2))
    return result


def print_costs(result: dict[str, Any]) -> None:
    hw, m = result["hardware"], result["model"]
    print(f"# forward cost vs positions scored: {m['name']} ({m['backend']}, {m['precision']}), "
          f"context {result['context']}, {hw['cpu']}, {hw['torch_threads']} threads")
    batches = [c[0]["batch"] for c in result["curves"]]
    print("  k " + "".join(f" | b={b}: ms (min-max)  v(k)" for b in batches))
    for i in range(len(result["curves"][0])):
        cells = []
        for curve in result["curves"]:
            r = curve[i]
            cells.append(f" | {r['median_s'] * 1e3:7.1f} ({r['min_s'] * 1e3:.0f}-"
                         f"{r['max_s'] * 1e3:.0f}) {r['v']:5.2f}")
        print(f"{curve[i]['k']:3d}" + "".join(cells))
    peer = result.get("peer")
    if peer:
        print(f"# plain greedy decoding, batch 1, per token (marginal, median): native "
              f"{peer['native_s_per_token'] * 1e3:.1f} ms, transformers generate() "
              f"{peer['transformers_s_per_token'] * 1e3:.1f} ms, ratio native/transformers "
              f"{peer['ratio_native_over_transformers']:.2f}")
