"""Deliberately inconsistent drafters, shipped so the losslessness audit can prove it catches them.

Each samples its draft tokens one way and reports a q computed another way, the class of bug that
reached users of other implementations. Never use these for generation: `specdecode audit
--inject-fault NAME` builds one to show the audit failing, and the test suite uses them to show
its statistical tests can fail.

- "q-without-temperature": samples at the request's temperature, reports q at temperature 1;
- "top-p-one-side": its sampler applies top_p = 0.5, the q it reports does not;
- "sampler-one-side": samples from the processed distribution, reports q from raw logits;
- "q-from-other-model": samples from its own model, reports q computed by another model (e.g. an
  int8 draft whose q comes from the unquantized weights).
"""

from __future__ import annotations

import dataclasses

import torch

from specdecode.drafters.base import EMPTY, Draft, DraftRequest, ids_tensor
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams, probs_from_logits, sample

FAULTS = ("q-without-temperature", "top-p-one-side", "sampler-one-side", "q-from-other-model")


class FaultyDrafter(DraftModelDrafter):
    def __init__(self, model: Target, fault: str, other: Target | None = None,
                 capacity: int = 4096) -> None:
        if fault not in FAULTS:
            raise SpecDecodeError(f"unknown fault '{fault}' (known: {', '.join(FAULTS)})")
        if fault == "q-from-other-model" and other is None:
            raise SpecDecodeError("fault q-from-other-model needs the other model")
        super().__init__(model, f"faulty-{fault}", capacity)
        self.fault = fault
        self.reporter = None if other is None else DraftModelDrafter(other, "reporter", capacity)

    def reset(self) -> None:
        super().reset()
        if self.reporter is not None:
            self.reporter.reset()

    def _sampling_and_reported(
        self, params: SamplingParams
    ) -> tuple[SamplingParams, SamplingParams]:
        if self.fault == "q-without-temperature":
            return params, dataclasses.replace(params, temperature=1.0)
        if self.fault == "top-p-one-side":
            return dataclasses.replace(params, top_p=0.5), params
        if self.fault == "sampler-one-side":
            raw = SamplingParams(temperature=1.0, max_tokens=params.max_tokens)
            return params, raw
        return params, params

    def propose(self, request: DraftRequest) -> Draft:
        k, params, prompt_len, generator = (request.k, request.params, request.prompt_len,
                                            request.generator)
        if params.greedy:
            raise SpecDecodeError("fault injection needs sampling (temperature > 0)")
        ctx = request.context.tolist()
        sampling, reported = self._sampling_and_reported(params)
        logits = self._sync(ctx)
        other = self.reporter._sync(ctx) if self.reporter is not None else logits
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            history = ids_tensor(ctx + tokens)
            allowed = request.allowed(tokens)  # structured output: the fault, not the mask
            q_true = probs_from_logits(logits, sampling, history, prompt_len, EMPTY, allowed)[0]
            qs.append(probs_from_logits(other, reported, history, prompt_len, EMPTY, allowed)[0])
            tokens.append(int(sample(q_true, generator)))
            if i + 1 < k:
                logits = self._feed(tokens[-1:])
                other = logits if self.reporter is None else self.reporter._feed(tokens[-1:])
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(qs))
