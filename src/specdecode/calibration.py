"""Cost calibration at run time: the measured seconds of a target forward pass t(B, T) that the
controller (--k auto) starts from, before every step it runs refines them.

`forward_costs` times one forward pass scoring 1..kmax new positions per row after a fixed
context (warmed up, round-robin over the widths, medians); `calibrated_costs` turns that into
the t(B, T) table a control.CostModel starts from. It sits at the bottom, beside the runners it
times: it imports no part of speculation (the controller is built from its figures, not the
reverse), and the engine, the server, the CLI and the benchmarks call it. `generate --k auto`
reads it through calibration_cache (once per model, precision, backend and machine); the
`specdecode costs` report over these figures is bench.costs.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdecode.models.target import Target

CostTable = dict[tuple[int, int], float]  # (batch size B, width T) -> seconds of t(B, T)
CONTEXT = 128  # tokens of context the run-time calibration measures after
REPEATS = 2  # round-robin repeats of each width


def quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles of `xs` (inclusive method; one value: itself twice)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def forward_costs(model: Target, batch: int, context: int, kmax: int, repeats: int) -> list[dict]:
    """Time of one forward scoring k = 1..kmax positions per row after `context` tokens.

    Rows: k, batch, median_s / min_s / max_s over `repeats`, first_s (the first, cold call of
    that shape), v = median(k) / median(1) and v_q1 / v_q3 (quartiles of the per-repeat ratio).
    """
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    cache = model.new_cache(batch, context + kmax + 1)
    with torch.inference_mode():
        for i in range(0, context, 256):
            n = min(256, context - i)
            model(torch.randint(vocab, (batch, n), generator=gen), cache, logits_for="none")
    tokens = [torch.randint(vocab, (batch, k), generator=gen) for k in range(1, kmax + 1)]

    def step(k: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model(tokens[k - 1], cache)
        elapsed = time.perf_counter() - start
        for b in range(batch):
            cache.rollback(b, context)
        return elapsed

    first = [step(k) for k in range(1, kmax + 1)]  # cold: each shape's first call
    for k in range(1, kmax + 1):
        step(k)  # warm-up
    times: list[list[float]] = [[] for _ in range(kmax)]
    for _ in range(max(1, repeats)):
        for k in range(1, kmax + 1):
            times[k - 1].append(step(k))
    t1 = statistics.median(times[0])
    rows = []
    for k in range(1, kmax + 1):
        ts = times[k - 1]
        ratios = [t / one for t, one in zip(ts, times[0], strict=True)]
        q1, q3 = quartiles(ratios)
        rows.append({"k": k, "batch": batch, "median_s": statistics.median(ts), "min_s": min(ts),
                     "max_s": max(ts), "first_s": first[k - 1],
                     "v": statistics.median(ts) / t1, "v_q1": q1, "v_q3": q3})
    return rows


def calibrated_costs(model: Target, batches: list[int], kmax: int, context: int = CONTEXT,
                     repeats: int = REPEATS) -> CostTable:
    """The t(B, T) table measured now for T = 1..kmax+1 at each batch size (what
    control.CostModel(target_s=...) starts from)."""
    costs: CostTable = {}
    for batch in batches:
        for row in forward_costs(model, batch, context, kmax + 1, repeats):
            costs[(batch, int(row["k"]))] = float(row["median_s"])
    return costs
