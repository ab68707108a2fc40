"""The target users get: `specdecode` with no --precision loads SmolLM2 at "auto", which is the
checkpoint precision where the row-invariant kernels build (the GGUF's Q4_1 blocks as 4-bit
panels and its Q8_0 table as grouped int8, bit for bit). Greedy speculative decoding on it is
token-identical to plain decoding on it, end to end: at batch 1 and in batches of 8, chains and
token trees, prompt lookups and model drafters, and through the server; every check also
asserts that tokens were drafted and accepted (tests/identity.py).

Slow tier (real SmolLM2); sized to add at most a few minutes to CI: two prompts of each of the
built-in workload's six categories (12: a batch of 8 and a ragged one of 4), 20 tokens each.
"""

from __future__ import annotations

from typing import Any

import pytest

from specdecode.bench.workloads import load_default_workload
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.models import kernels
from specdecode.models.loading import LoadedModel
from specdecode.sampling import SamplingParams
from tests.identity import assert_identical, assert_identical_outputs

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"kernels unavailable: {kernels.build_error()}")

TOKENS = 20
# (drafter, k, batch): lookups and a model drafter, chains and trees, batch 1 and 8
RUNS = (
    ("ngram", 4, 1), ("ngram", 4, 8),
    ("suffix", 6, 8), ("ngram-tree", 4, 1),
    ("w4a16", 3, 1), ("w4a16", 3, 8), ("w4a16-tree", 3, 8),
    ("ngram+w4a16", 4, 8),
)


@pytest.fixture(scope="module")
def prompts(smollm_default: LoadedModel) -> list[list[int]]:
    tok = smollm_default.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p.turns[0]}]))
            for p in load_default_workload(limit_per_category=2).prompts]


@pytest.fixture(scope="module")
def plain(smollm_default: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Plain greedy decoding, one request at a time: the reference every run must equal."""
    out = []
    for ids in prompts:
        gen = Generation(smollm_default.model, None, ids, SamplingParams(max_tokens=TOKENS),
                         None, 0, smollm_default.eos_ids)
        for _ in gen.run():
            pass
        out.append(gen.output)
    return out


def test_the_default_target_is_the_checkpoint_and_passed_its_check(
        smollm_default: LoadedModel) -> None:
    assert smollm_default.precision == "checkpoint" and smollm_default.backend == "native"
    measured = smollm_default.model.invariance
    assert measured is not None and measured.exact and measured.rows == 0.0, measured
    assert smollm_default.verdict().status == "exact"


def _speculative(m: LoadedModel, prompts: list[list[int]], name: str, k: int, batch: int
                 ) -> list[Generation]:
    make = drafter_factory(DrafterOptions(name, k=k), m.model, tokenizer=m.tokenizer)
    assert make is not None
    gens = [Generation(m.model, None, ids, SamplingParams(max_tokens=TOKENS), make(), k,
                       m.eos_ids) for ids in prompts]
    if batch == 1:
        for gen in gens:
            for _ in gen.run():
                pass
        return gens
    capacity = max(g.capacity for g in gens)
    for start in range(0, len(gens), batch):
        run_batch(BatchEngine(m.model, batch, capacity), gens[start:start + batch])
    return gens


@pytest.mark.parametrize(("name", "k", "batch"), RUNS, ids=[f"{n}-k{k}-b{b}" for n, k, b in RUNS])
def test_greedy_speculation_on_the_default_target_is_plain_decoding(
        smollm_default: LoadedModel, prompts: list[list[int]], plain: list[list[int]],
        name: str, k: int, batch: int) -> None:
    gens = _speculative(smollm_default, prompts, name, k, batch)
    drafted = assert_identical(gens, plain, f"{name} k={k} batch {batch}")
    if name.startswith("w4a16"):  # the 4-bit copy of the checkpoint follows it closely
        assert drafted.rate > 0.5, drafted


def test_the_identity_check_catches_a_verifier_that_keeps_wrong_drafts(
        smollm_default: LoadedModel, prompts: list[list[int]], plain: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant, on the default target: greedy verification that keeps every draft token
    (no comparison with the target's argmax). A drafter right for 2 tokens of every 4 then puts
    wrong tokens in the output, and the identity check fails; with the real verifier it holds."""
    import specdecode.verification as verification
    from tests.fakes import ScriptedDrafter

    def run() -> list[Generation]:
        gens = [Generation(smollm_default.model, None, ids, SamplingParams(max_tokens=TOKENS),
                           ScriptedDrafter(out, len(ids), "partial", right_for=2), 4,
                           smollm_default.eos_ids) for ids, out in zip(prompts[:2], plain[:2],
                                                                       strict=True)]
        for gen in gens:
            for _ in gen.run():
                pass
        return gens

    assert_identical(run(), plain[:2], "partly right drafts")
    real = verification.verify_greedy
    monkeypatch.setattr(verification, "verify_greedy", lambda target, draft: real(
        draft.new_tensor([*draft.tolist(), int(target[-1])]), draft))
    with pytest.raises(AssertionError, match="differs from plain"):
        assert_identical(run(), plain[:2], "every draft kept")


def _plain_texts(m: LoadedModel, prompts: list[list[int]]) -> list[str]:
    """Plain decoding's text, as the server streams it (the tokenizer's incremental decode)."""
    texts = []
    for ids in prompts:
        gen = Generation(m.model, m.tokenizer, ids, SamplingParams(max_tokens=TOKENS), None, 0,
                         m.eos_ids)
        texts.append("".join(out.text for out in gen.run()))
    return texts


def test_the_server_on_the_default_target_returns_plain_decoding(
        smollm_default: LoadedModel, prompts: list[list[int]]) -> None:
    """Four concurrent greedy chat requests (rows of one batch) with the lookup-then-copy hybrid
    at k = 3: each reply's tokens are plain decoding's; the server's counters show drafts
    accepted."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_server import client, metric, serving

    questions = [p.turns[0] for p in load_default_workload(limit_per_category=2).prompts[:4]]
    with serving(smollm_default, drafter="ngram+w4a16", k=3, auto=False, max_batch=4,
                 max_seq_len=512) as (srv, _):
        c = client(srv)
        name = c.models.list().data[0].id

        def ask(question: str) -> Any:
            return c.chat.completions.create(
                model=name, messages=[{"role": "user", "content": question}],
                max_tokens=TOKENS, temperature=0)

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, questions))
        assert_identical_outputs(  # each reply's text is plain decoding's
            [r.choices[0].message.content for r in replies],
            _plain_texts(smollm_default, prompts[:4]),
            int(metric(srv, "spec_decode_num_draft_tokens_total")),
            int(metric(srv, "spec_decode_num_accepted_tokens_total")), "server")
