"""`specdecode costs` (a benchmark, not a test): cost curves, the time of one forward pass
scoring k new positions over a fixed context, per batch size (calibration.forward_costs), and
v(k) = time(k) / time(1). Also, at batch 1, the per-token latency of plain greedy decoding here
against transformers' generate() on the same weights.

Noise (a shared 2-core machine): every shape is warmed up before timing, shapes are timed
round-robin (one pass over k = 1..kmax per repeat) so that a slow spell hits every k alike,
and each figure is a median with its spread (min-max, and the interquartile range of v(k)
over repeats). The two decoders of the peer comparison alternate run by run and are compared
by their median time per decode step, each step timed on its own.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch

from specdecode.bench.hardware import load_average, machine_summary
from specdecode.calibration import forward_costs, quartiles
from specdecode.models.backends import load_model
from specdecode.models.llama import LlamaModel
from specdecode.models.precision import is_reference


def _prompt(tokenizer: Any, context: int) -> list[int]:
    from specdecode.agreement import BUILTIN_TEXT

    ids = tokenizer.encode(BUILTIN_TEXT)
    return (ids * (context // len(ids) + 1))[:context]


def peer_comparison(loaded: Any, new_tokens: int, repeats: int,
                    context: int = 512) -> dict[str, Any]:
    """Plain greedy decoding at batch 1 after a `context`-token prompt: median seconds per
    decode step, native runner vs transformers generate() (same weights, fp32, same threads)."""
    from transformers import AutoModelForCausalLM

    from specdecode.models.loading import resolve_folder

    folder = resolve_folder(None if loaded.name == "SmolLM2-135M-Instruct" else
                            str(loaded.source))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = _prompt(loaded.tokenizer, context)
    # ours: the native runner; theirs: transformers' generate() (not its backend: no adapter)
    runs = {"ours": (_native_steps, loaded.model), "theirs": (_transformers_steps, hf)}
    steps: dict[str, list[float]] = {name: [] for name in runs}
    run_medians: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(max(1, repeats) + 1):  # the first round warms up both
        for name, (run, model) in runs.items():
            s = run(model, prompt, new_tokens)
            if r > 0:
                steps[name] += s
                run_medians[name].append(statistics.median(s))
    native, peer = statistics.median(steps["ours"]), statistics.median(steps["theirs"])
    ratios = [a / b for a, b in zip(run_medians["ours"], run_medians["theirs"], strict=True)]
    return {"native_s_per_token": native, "transformers_s_per_token": peer,
            "ratio_native_over_transformers": native / peer,
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "native_q1_q3": quartiles(steps["ours"]),
            "transformers_q1_q3": quartiles(steps["theirs"]),
            "new_tokens": new_tokens, "runs": max(1, repeats), "context": len(prompt),
            "batch": 1}


def _native_steps(model: Any, prompt: list[int], n: int) -> list[float]:
    """Seconds of each decode step after the first (which includes the prefill)."""
    from specdecode.engine import Generation
    from specdecode.sampling import SamplingParams

    gen = Generation(model, None, prompt, SamplingParams(max_tokens=n))
    times = []
    while gen.finish_reason is None:
        start = time.perf_counter()
        gen.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def _transformers_steps(hf: Any, prompt: list[int], n: int) -> list[float]:
    """Intervals between tokens streamed out of generate() after the first token."""
    stamps: list[float] = []

    class Clock:
        def put(self, value: torch.Tensor) -> None:
            stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    with torch.inference_mode():
        hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, streamer=Clock())
    # put() gets the prompt, then each new token: intervals from the 2nd token on
    return [b - a for a, b in itertools.pairwise(stamps[1:])]


def run_costs(model_spec: str | None, precision: str, backend: str, context: int, kmax: int,
              batches: list[int], repeats: int, compare_transformers: bool = True
              ) -> dict[str, Any]:
    loaded = load_model(model_spec, precision, backend, max_batch=max(batches))
    result: dict[str, Any] = {"model": loaded.describe(), "hardware": machine_summary(),
                              "context": context, "repeats": repeats}
    result["curves"] = [forward_costs(loaded.model, b, context, kmax, repeats) for b in batches]
    # the native runner against transformers on the same weights (llama.cpp's peers, its own
    # Python loops, are measured by `bench --backend llama.cpp`)
    if compare_transformers and is_reference(loaded.precision) and \
            isinstance(loaded.model, LlamaModel):
        result["peer"] = peer_comparison(loaded, 32, max(3, repeats // 2), context)
    result["load_avg_1m_end"] = load_average()
    return result


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def print_costs(result: dict[str, Any]) -> None:
    hw, m = result["hardware"], result["model"]
    load = "" if hw.get("load_avg_1m") is None else (
        f", load average {hw['load_avg_1m']:.1f} -> {result.get('load_avg_1m_end') or 0:.1f}")
    print(f"# forward cost vs positions scored: {m['name']} ({m['backend']}, {m['precision']}), "
          f"context {result['context']}, {hw['cpu']}, {hw['torch_threads']} threads{load}; "
          f"medians of {result.get('repeats', '?')} round-robin repeats after warm-up; first = "
          "the cold first call of that shape; IQR = quartiles of the per-repeat ratio")
    others = max(hw.get("load_avg_1m") or 0,  # the load of others, roughly: ours ~ threads
                 (result.get("load_avg_1m_end") or 0) - hw["torch_threads"])
    if hw.get("cores") and others >= 0.5 * hw["cores"]:
        print(f"# warning: load average ~{others:.1f} besides this run on {hw['cores']} cores: "
              "other processes "
              "compete for the cores, and OpenMP threads that spin-wait for a descheduled peer "
              "can make multi-threaded timings several times slower (compare with "
              "OMP_NUM_THREADS=1, or OMP_WAIT_POLICY=PASSIVE)")
    batches = [c[0]["batch"] for c in result["curves"]]
    print("  k " + "".join(f" | b={b}: ms (min-max) first  v(k) (IQR)     " for b in batches))
    for i in range(len(result["curves"][0])):
        cells = []
        for curve in result["curves"]:
            r = curve[i]
            cells.append(f" | {r['median_s'] * 1e3:7.1f} ({r['min_s'] * 1e3:.0f}-"
                         f"{r['max_s'] * 1e3:.0f}) {r.get('first_s', 0) * 1e3:5.0f} "
                         f"{r['v']:5.2f} ({r.get('v_q1', r['v']):.2f}-"
                         f"{r.get('v_q3', r['v']):.2f})")
        print(f"{result['curves'][0][i]['k']:3d}" + "".join(cells))
    peer = result.get("peer")
    if peer:
        nq, tq = peer.get("native_q1_q3"), peer.get("transformers_q1_q3")
        spread = "" if not nq or not tq else (
            f" (IQR {_ms(nq[0])}-{_ms(nq[1])} vs {_ms(tq[0])}-{_ms(tq[1])})")
        runs = "" if "ratio_min" not in peer else (
            f"; per-run ratios {peer['ratio_min']:.2f}-{peer['ratio_max']:.2f}")
        print(f"# plain greedy decoding, batch 1, {peer.get('context', '?')}-token prompt, "
              f"median per decode step over {peer.get('runs', '?')} alternating runs of "
              f"{peer['new_tokens']} tokens: native {_ms(peer['native_s_per_token'])} ms, "
              f"transformers generate() {_ms(peer['transformers_s_per_token'])} ms{spread}, "
              f"ratio native/transformers {peer['ratio_native_over_transformers']:.2f}{runs}")
