"""The real Qwen2.5-Coder pair (`specdecode models install qwen2.5-coder`; issue #44): greedy
speculative decoding with the 0.5B draft is token-identical to plain decoding of the 1.5B
target, on the native runner's exact path and on the llama.cpp backend (whose plain decoding is
also llama-cpp-python's own `Llama.generate`).

Slow: measured on a 2-core Xeon shared with other work (load 9), the native case took 584 s
(the first load converts the 1.5B) and the llama.cpp one about 450 s, most of it the load-time
invariance checks of the 1.5B (235 s) and the 0.5B; a quiet machine is several times faster.
Skips where the pair is not installed, unless SPECDECODE_REQUIRE_QWEN_PAIR=1: then a missing
pair fails (`specdecode models install qwen2.5-coder` installs it). The native 1.5B holds its
weights as the native runner's precision `auto` does (de-quantized fp32 until the K-quant
kernels land: 7 GB), one model of the pair at a time.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest

from specdecode.models.catalog import QWEN_CODER_05B, QWEN_CODER_15B
from specdecode.models.install import check_file, installed_path
from tests.identity import assert_identical

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "A train leaves at 3pm at 60 km/h. How far has it gone by 5:30pm?"]
TOKENS = 24


def _pair() -> tuple[Path, Path]:
    missing = [m.name for m in (QWEN_CODER_15B, QWEN_CODER_05B)
               if check_file(m, installed_path(m)) is not None]
    if missing:
        if os.environ.get("SPECDECODE_REQUIRE_QWEN_PAIR") == "1":
            pytest.fail(f"{', '.join(missing)} not installed: run `specdecode models install "
                        "qwen2.5-coder`")
        pytest.skip(f"{', '.join(missing)} not installed")
    return installed_path(QWEN_CODER_15B), installed_path(QWEN_CODER_05B)


def _prompt(loaded: Any, text: str) -> list[int]:
    tok = loaded.tokenizer
    return list(tok.encode_prompt(tok.apply_chat_template([{"role": "user", "content": text}])))


def _greedy(loaded: Any, drafter: Any, k: Any) -> list[Any]:
    from specdecode.engine import Generation
    from specdecode.sampling import SamplingParams

    gens = []
    for text in PROMPTS:
        gen = Generation(loaded.model, None, _prompt(loaded, text),
                         SamplingParams(max_tokens=TOKENS), drafter() if drafter else None, k)
        for _ in gen.run():
            pass
        gens.append(gen)
    return gens


@pytest.mark.parametrize("backend", ["native", "llama.cpp"])
def test_greedy_speculation_with_the_draft_is_token_identical(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode.drafters.registry import DrafterOptions, drafter_factory
    from specdecode.models.backends import load_model

    _pair()
    loaded = load_model(QWEN_CODER_15B.name, precision="auto", backend=backend)
    try:
        assert loaded.model.invariance is not None and loaded.model.invariance.exact, \
            loaded.exactness()
        plain = [list(g.output) for g in _greedy(loaded, None, 0)]
        factory = drafter_factory(
            DrafterOptions("draft-model", draft_model=QWEN_CODER_05B.name), loaded.model,
            tokenizer=loaded.tokenizer)
        assert factory is not None
        assert_identical(_greedy(loaded, factory, 4), plain, f"the pair on {backend}")
        if backend == "llama.cpp":  # its plain decoding is llama-cpp-python's own
            import llama_cpp.llama_cpp as low

            from specdecode.bench.inprocess import RequestTrace
            from specdecode.bench.peers import LlamaCppPeers
            from specdecode.sampling import SamplingParams

            # Llama's defaults repack Q4_K weights for this CPU (extra buffer types), whose
            # kernels round differently from the file's layout at every width: its greedy
            # output then departs at a near-tie (index 7 of the first prompt on a Xeon). Opened
            # as the backend opens the file, its own generate loop must equal ours.
            default = low.llama_model_default_params

            def file_layout() -> Any:
                params = default()
                params.use_extra_bufts = False
                return params

            monkeypatch.setattr(low, "llama_model_default_params", file_layout)
            peers = LlamaCppPeers(loaded.source, loaded.model.threads, 1024)
            eos = tuple(loaded.tokenizer.eos_ids)
            for text, ours in zip(PROMPTS, plain, strict=True):
                theirs, _ = peers.generate("llamacpp-generate", 1, _prompt(loaded, text),
                                           SamplingParams(max_tokens=TOKENS), loaded.tokenizer,
                                           eos, RequestTrace(0.0))
                assert theirs == ours
            del peers
    finally:
        del loaded
        gc.collect()
