"""Peers measured beside this project's configurations on the llama.cpp backend: llama-cpp-python
itself, as a user who runs llama.cpp from Python would, on the same GGUF and thread count.

- `llamacpp-generate`: `Llama.generate`, its plain decoding.
- `llamacpp-lookup:k=N`: `Llama.generate` with its own speculation, `LlamaPromptLookupDecoding`
  (prompt lookup drafting N tokens; it needs every position's logits, `logits_all`).

Each request starts from an empty KV cache (`Llama.reset`; otherwise a repeated prompt would skip
its prefill), with the request's token ids (the same ones the engine gets), seed and temperature.
Their sampling chain is set to the engine's plain pipeline (no top-k / top-p / min-p unless asked
for), but llama.cpp samples with its own random numbers, so sampled outputs are comparable in
distribution only; greedy outputs are compared token by token like any configuration's.
Drafting counters are unknown for peers (their `drafted` stays 0).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from specdecode.counters import Counters
from specdecode.errors import SpecDecodeError

PEERS = ("llamacpp-generate", "llamacpp-lookup")


def is_peer(drafter: str) -> bool:
    return drafter in PEERS


class LlamaCppPeers:
    """llama-cpp-python `Llama` objects over one GGUF, one per peer kind and draft length."""

    def __init__(self, source: Path, threads: int, n_ctx: int) -> None:
        from specdecode.models.llamacpp import import_llama_cpp
        from specdecode.models.llamacpp_probe import require_runs

        self.L = import_llama_cpp()
        # the peer opens the GGUF as users do (Llama's defaults: extra buffer types on)
        require_runs("default", f"peer llama-cpp-python on {source}")
        self.source, self.threads, self.n_ctx = source, threads, n_ctx
        self._llms: dict[tuple[str, int], Any] = {}

    def version(self) -> str:
        return str(getattr(self.L, "__version__", "unknown"))

    def llm(self, drafter: str, k: int) -> Any:
        key = (drafter, k if drafter == "llamacpp-lookup" else 0)
        if key not in self._llms:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            lookup = drafter == "llamacpp-lookup"
            self._llms[key] = self.L.Llama(
                str(self.source), n_ctx=self.n_ctx, n_threads=self.threads,
                n_threads_batch=self.threads, verbose=False, flash_attn=False,
                logits_all=lookup,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if lookup else None)
        return self._llms[key]

    def generate(self, drafter: str, k: int, prompt_ids: list[int], params: Any,
                 tokenizer: Any, eos_ids: tuple[int, ...], trace: Any) -> tuple[
                     list[int], Counters]:
        """Run one request; feeds `trace` (bench.inprocess.RequestTrace) per token."""
        from specdecode.engine import StepOutput
        from specdecode.models.tokenizer import IncrementalDecoder

        if len(prompt_ids) + params.max_tokens > self.n_ctx:
            raise SpecDecodeError(f"peer {drafter}: prompt + max_tokens exceed its context of "
                                  f"{self.n_ctx}")
        llm = self.llm(drafter, k)
        llm.reset()
        llm.set_seed(params.seed if params.seed is not None else 0)
        counters = Counters(prompt_tokens=len(prompt_ids))
        decoder = IncrementalDecoder(tokenizer)
        out: list[int] = []
        eos = frozenset(eos_ids)
        greedy = params.temperature == 0
        stream = llm.generate(
            prompt_ids, temp=0.0 if greedy else params.temperature,
            top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
            repeat_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, reset=True)
        start = time.perf_counter_ns()
        for token in stream:
            token = int(token)
            reason = "stop" if token in eos else None
            emitted = [] if reason else [token]
            out += emitted
            if reason is None and len(out) >= params.max_tokens:
                reason = "length"
            counters.steps += 1
            trace.observe(StepOutput(emitted, decoder.push(emitted), reason), time.perf_counter())
            if reason is not None:
                break
        counters.target_ns = time.perf_counter_ns() - start
        counters.emitted = len(out)
        return out, counters
