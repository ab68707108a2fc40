"""c(k) and v(k) measured on this machine, for the in-process runner.

Both are ratios to ONE plain target step: the median time of a target forward pass scoring one
new position after `context` tokens (`calibration.forward_costs`).

- v(k): the time of a target pass scoring k + 1 positions (the pending token and k drafts) over
  that of one position: row k + 1 of `forward_costs`.
- c(k): the drafting cost per drafted token, median time of one `propose(context, k)` of a
  fresh drafter, divided by k and by the plain step time. The drafter is first given the context
  once (untimed), so each timed call is a steady-state step: a model drafter feeds the last
  context token and its own k - 1 drafts, an n-gram drafter looks its suffix up. A drafter
  proposing fewer than k tokens there is an error, not a cheap step.

A benchmark, not a test: the context is a random block of token ids repeated (a model's compute
does not depend on the values; an n-gram drafter finds matches to continue), and a few repeats
keep it quick; ratios are of medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdecode.bench.records import CostCurve
from specdecode.calibration import forward_costs
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.registry import DrafterFactory
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls, after one untimed call."""
    fn()
    times: list[float] = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def target_rows(model: Any, context: int, kmax: int, repeats: int) -> list[dict[str, Any]]:
    """`forward_costs` at batch 1 for 1..kmax + 1 scored positions (row i scores i + 1)."""
    return forward_costs(model, 1, context, kmax + 1, repeats)


def drafting_seconds(factory: DrafterFactory, k: int, context_ids: Sequence[int],
                     repeats: int) -> float:
    """Median seconds of one greedy `propose(context, k)` by a fresh drafter (steady state)."""
    drafter = factory()
    context = torch.tensor(list(context_ids), dtype=torch.long)
    params = SamplingParams()

    def propose() -> None:
        with torch.inference_mode():
            n = len(drafter.propose(DraftRequest(context, k, params, len(context))).tokens)
        if n != k:
            raise SpecDecodeError(f"drafter {drafter.name} proposed {n} tokens instead of {k} "
                                  f"while measuring c(k) over {len(context)} tokens of context")

    try:
        return median_seconds(propose, repeats)
    finally:
        drafter.reset()


def cost_curve(
    factory: DrafterFactory, drafter: str, ks: Sequence[int], rows: Sequence[dict[str, Any]],
    context_ids: Sequence[int], repeats: int, config: str = "",
) -> CostCurve:
    """The CostCurve of one drafter at batch 1 for draft lengths `ks` (all <= len(rows) - 1)."""
    step_s = float(rows[0]["median_s"])
    c = [drafting_seconds(factory, k, context_ids, repeats) / k / step_s for k in ks]
    v = [float(rows[k]["v"]) for k in ks]
    return CostCurve(drafter=drafter, batch_size=1, k=list(ks), c=c, v=v, target_step_s=step_s,
                     config=config)


def repeating_context(vocab_size: int, length: int, seed: int = 0, period: int = 16
                      ) -> list[int]:
    """`length` token ids repeating a random block of `period`: a model's cost does not depend
    on the ids, and an n-gram drafter finds a match to continue, as on repetitive text."""
    gen = torch.Generator().manual_seed(seed)
    block = [int(t) for t in torch.randint(vocab_size, (period,), generator=gen)]
    return [block[i % period] for i in range(length)]
