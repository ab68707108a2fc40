"""The llama.cpp backend: the engine on llama.cpp's kernels is lossless against llama.cpp's own
decoding (greedy: token-identical at batch 1 and 4, rows not moving each other; sampled: the
chi-square test against the enumerated target distribution), it refuses speculation on a build
that is not batch-invariant, and bad input gets one clear error.

The small models are random Llama checkpoints written as GGUF by models.gguf_write. Without
llama-cpp-python these tests skip, unless SPECDECODE_REQUIRE_LLAMACPP=1 (CI sets it): then a
missing binding fails them.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.audit_stats import required_samples
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams, probs_from_logits
from tests.conftest import make_checkpoint
from tests.identity import assert_identical
from tests.test_engine_sampled import CELLS, FALSE_ALARM, gof_p_value

if os.environ.get("SPECDECODE_REQUIRE_LLAMACPP") != "1":
    pytest.importorskip("llama_cpp")

from specdecode.models.gguf_write import write_gguf
from specdecode.models.llamacpp import LlamaCppModel, load_llamacpp

VOCAB = 300  # the GGUF's stand-in byte tokenizer needs 258+
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
PROMPT = [5, 7, 3, 8, 5, 7, 3]
PARAMS = SamplingParams(temperature=0.8, top_k=6, max_tokens=2,  # few cells: a powerful test
                        rule="residual")  # the rule the broken verifier breaks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(target, draft) on llama.cpp: small random Llamas sharing a vocabulary. The draft is the
    target's weights at another scale: close enough that about a third of its tokens are
    accepted, far enough that a verifier without the residual is 0.18 from the target in total
    variation over the first token (chosen by computing it)."""
    root = tmp_path_factory.mktemp("gguf")
    out = []
    for name, seed, layers, scale in (("target", 6, 2, 4.0), ("draft", 6, 2, 2.0)):
        folder = make_checkpoint(root / name, seed=seed, scale=scale, num_hidden_layers=layers,
                                 **SMALL)
        cfg = write_gguf(folder, root / f"{name}.gguf")
        out.append(load_llamacpp(root / f"{name}.gguf", cfg, threads=1))
    return tuple(out)


def _run(model: Any, prompt: list[int], params: SamplingParams, drafter: Any = None,
         k: int = 0) -> list[int]:
    gen = Generation(model, None, prompt, params, drafter, k)
    for _ in gen.run():
        pass
    return gen.output


def test_load_checks_batch_invariance(tiny: Any) -> None:
    target = tiny[0]
    assert target.invariance is not None and target.invariance.exact, target.invariance


def test_logits_match_the_native_runner_on_the_same_weights(tiny: Any, tmp_path: Path) -> None:
    """The GGUF writer and the backend agree with the native runner (KV in f16 on llama.cpp)."""
    from specdecode.models.config import config_from_hf, read_hf_config
    from specdecode.models.loading import load_native

    folder = make_checkpoint(tmp_path / "t", seed=6, scale=4.0, num_hidden_layers=2, **SMALL)
    native = load_native(folder, config_from_hf(read_hf_config(folder)))
    toks = torch.tensor([PROMPT])
    with torch.inference_mode():
        ours = tiny[0](toks, tiny[0].new_cache(1, 16)).clone()
        ref = native(toks, native.new_cache(1, 16))
    assert float((ours - ref).abs().max()) < 2e-2
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_is_token_identical_batch_1(tiny: Any, k: int) -> None:
    target, draft = tiny
    params = SamplingParams(max_tokens=40)
    plain = Generation(target, None, PROMPT, params)
    for _ in plain.run():
        pass
    for drafter in (DraftModelDrafter(draft), NgramDrafter(4, 1)):
        gen = Generation(target, None, PROMPT, params, drafter, k)
        for _ in gen.run():
            pass
        assert_identical([gen], [plain.output], f"{type(drafter).__name__} k={k}")


def test_greedy_batch_of_4_rows_do_not_move_each_other(tiny: Any) -> None:
    """Four prompts in one BatchEngine (ragged drafts, rows joining and leaving) give each
    prompt's batch-1 plain output."""
    target, draft = tiny
    prompts = [PROMPT, [9, 4, 4, 9, 4], [11, 12, 13, 11, 12, 13, 11], [200, 3, 150]]
    lengths = [30, 12, 40, 25]
    plain = [_run(target, p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, lengths,
                                                                            strict=True)]
    engine = BatchEngine(target, max_batch=3, max_seq_len=128)  # 4 requests, 3 rows: one waits
    gens = [Generation(target, None, p, SamplingParams(max_tokens=n),
                       NgramDrafter(3, 1) if i % 2 else DraftModelDrafter(draft), 2 + i)
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    run_batch(engine, gens)
    assert_identical(gens, plain, "batch of 4 on 3 rows")


def test_a_rollback_that_leaves_stale_kv_is_caught(tiny: Any, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    """Negative control: if rolling back a rejected draft left its llama.cpp cells in place, the
    next step would attend over them (or llama.cpp refuses the repeated positions): either way
    the run must not pass the identity check above."""
    from specdecode.models import llamacpp

    target, draft = tiny
    params = SamplingParams(max_tokens=40)
    plain = _run(target, PROMPT, params)

    def keep_cells(self: Any, row: int, length: int) -> None:
        self.lengths[row] = length  # no llama_memory_seq_rm

    monkeypatch.setattr(llamacpp.LlamaCppCache, "rollback", keep_cells)
    try:
        broken = _run(target, PROMPT, params, DraftModelDrafter(draft), 4)
    except SpecDecodeError as exc:
        assert "llama_decode failed" in str(exc)
    else:
        assert broken != plain


def test_speculation_refused_on_a_build_that_is_not_batch_invariant(
        tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny[0]
    real = LlamaCppModel._logits
    monkeypatch.setattr(LlamaCppModel, "_logits", lambda self, n: real(self, n) + 1e-3 * n)
    monkeypatch.setattr(target, "invariance", target.invariance)  # restored after the test
    target.check_invariance(9)
    with pytest.raises(SpecDecodeError,
                       match=r"needs a batch-invariant target.*llama.cpp.*GGML_LLAMAFILE=OFF"):
        drafter_factory("ngram", target)
    assert drafter_factory("none", target) is None  # plain decoding stays available
    monkeypatch.setenv("SPECDECODE_ALLOW_INEXACT", "1")
    assert drafter_factory("ngram", target) is not None


def test_invariance_check_sees_a_shape_dependent_model(tiny: Any, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Negative control for the load-time check: logits perturbed by the call's width."""
    from specdecode.models import llamacpp

    target = tiny[0]
    real = LlamaCppModel._logits

    def shaped(self: Any, n: int) -> torch.Tensor:
        return real(self, n) + 1e-3 * n

    monkeypatch.setattr(LlamaCppModel, "_logits", shaped)
    measured = llamacpp.batch_invariance(target)
    assert not measured.exact and measured.widths > 0


MOVED = {  # broken variants the load-time check missed before it compared every position of
    # calls up to --kmax + 1, batches of more than 64 rows and another thread count
    "positions past the first of a call of 9": lambda self, n: slice(1, None) if n == 9 else None,
    "rows past 64 of a call": lambda self, n: slice(64, None) if n > 64 else None,
    "another thread count": lambda self, n: slice(None) if self.threads != 1 else None,
}


@pytest.mark.parametrize("what", list(MOVED))
def test_the_check_covers_every_position_wide_batches_and_threads(
        tiny: Any, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """Logits moved in the last bits where llama.cpp's kernels could switch: a width, a batch
    past 64 rows, a thread count (the fixture runs on 1 thread; the check tries 2)."""
    from specdecode.models import llamacpp

    target, real, moved = tiny[0], LlamaCppModel._logits, MOVED[what]

    def shaped(self: Any, n: int) -> torch.Tensor:
        out, where = real(self, n), moved(self, n)
        if where is not None:
            out = out.clone()
            out[where] *= 1 + 2 ** -12
        return out

    monkeypatch.setattr(LlamaCppModel, "_logits", shaped)
    measured = llamacpp.batch_invariance(target)
    assert not measured.exact and measured.width == 9, measured
    field = {"positions past the first of a call of 9": measured.widths,
             "rows past 64 of a call": measured.rows, "another thread count": measured.threads}
    assert field[what] is not None and field[what] > 0, measured
    assert target.threads == 1  # the check puts the thread count back


def test_a_unified_kv_cache_is_caught_by_the_invariance_check(tmp_path: Path) -> None:
    """Negative control for the backend's one-stream-per-row layout: in llama.cpp's unified KV
    cache a row's cells move with what other rows hold, and so do its logits."""
    from specdecode.models.llamacpp import batch_invariance

    folder = make_checkpoint(tmp_path / "t", seed=6, scale=4.0, num_hidden_layers=2, **SMALL)
    cfg = write_gguf(folder, tmp_path / "t.gguf")
    unified = LlamaCppModel(tmp_path / "t.gguf", cfg, threads=1, sequences=4, unified_kv=True)
    assert batch_invariance(unified, context=120).rows > 0


def exact_pairs(target: Any, params: SamplingParams) -> dict[tuple[int, int], float]:
    ctx = torch.tensor(PROMPT)
    empty = torch.zeros(0, dtype=torch.long)
    out: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        first = probs_from_logits(target(ctx[None], target.new_cache(1, 16))[0, -1:].clone(),
                                  params, ctx, len(PROMPT), empty)[0]
        for a in torch.nonzero(first).flatten().tolist():
            hist = torch.tensor([*PROMPT, a])
            logits = target(hist[None], target.new_cache(1, 16))[0, -1:].clone()
            second = probs_from_logits(logits, params, hist, len(PROMPT), empty)[0]
            for b in torch.nonzero(second).flatten().tolist():
                out[(a, b)] = float(first[a] * second[b])
    return out


SAMPLES = required_samples(0.15, FALSE_ALARM, 0.999, CELLS + 1)


def _pairs(target: Any, make: Any, k: int) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(SAMPLES):
        p = SamplingParams(**{**PARAMS.__dict__, "seed": 20_000 + seed})
        out = _run(target, PROMPT, p, make() if make else None, k)
        counts[(out[0], out[1])] += 1
    return counts


def test_prompts_of_several_rows_beyond_a_call_are_fed_in_slices(tiny: Any) -> None:
    """8 rows x 100 tokens is more than llama.cpp's 512 positions per call: the backend feeds
    such a multi-row prompt in slices of its columns (ragged rows included), and each row then
    scores as if prefilled alone; the calibration (`serve --k auto`, `costs --batches 8`) feeds
    its context that way."""
    from specdecode.calibration import forward_costs

    model = tiny[0]
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(VOCAB, (8, 100), generator=gen)
    news = [100 - 7 * b for b in range(8)]
    cache = model.new_cache(8, 128)
    model(tokens, cache, num_new=news, logits_for="none")
    assert list(cache.lengths) == news
    nxt = torch.randint(VOCAB, (8, 1), generator=gen)
    together = model(nxt, cache)[:, 0]
    for b, n in enumerate(news):
        alone = model.new_cache(1, 128)
        model(tokens[b : b + 1, :n], alone, logits_for="none")
        assert torch.equal(model(nxt[b : b + 1], alone)[0, 0], together[b]), b
        alone.release()
    cache.release()  # its 8 sequences, for the calibration's 8 rows
    rows = forward_costs(model, 8, 128, 3, 1)
    assert [r["k"] for r in rows] == [1, 2, 3] and all(r["median_s"] > 0 for r in rows)


@pytest.mark.statistical
@pytest.mark.parametrize("k", [1, 3])
def test_sampled_speculation_has_the_target_distribution(tiny: Any, k: int) -> None:
    target, draft = tiny
    exact = exact_pairs(target, PARAMS)
    assert gof_p_value(_pairs(target, lambda: DraftModelDrafter(draft), k), exact) > FALSE_ALARM


@pytest.mark.statistical
def test_sampled_broken_verifier_is_rejected(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the verifier without the residual distribution, on this backend."""
    import specdecode.verification as verification
    from tests.test_engine_sampled import _no_residual

    target, draft = tiny
    monkeypatch.setattr(verification, "verify_chain", _no_residual)
    counts = _pairs(target, lambda: DraftModelDrafter(draft), 2)
    assert gof_p_value(counts, exact_pairs(target, PARAMS)) < FALSE_ALARM


def test_draft_gguf_with_another_vocabulary_is_refused(tiny: Any, tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "d", seed=1, **{**SMALL, "vocab_size": 320})
    write_gguf(folder, tmp_path / "d.gguf")
    with pytest.raises(SpecDecodeError, match="vocabulary of 320"):
        drafter_factory(DrafterOptions("draft-model", draft_model=str(tmp_path / "d.gguf")),
                        tiny[0])()


def test_bad_gguf_and_too_many_threads_are_one_clear_error(tmp_path: Path) -> None:
    from specdecode.models.config import config_from_hf, read_hf_config

    folder = make_checkpoint(tmp_path / "t", **SMALL)
    cfg = config_from_hf(read_hf_config(folder))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(SpecDecodeError, match=r"bad\.gguf: llama\.cpp cannot load"):
        LlamaCppModel(bad, cfg)
    good = tmp_path / "t.gguf"
    write_gguf(folder, good)
    with pytest.raises(SpecDecodeError, match="--threads 999 is more than"):
        LlamaCppModel(good, cfg, threads=999)


def test_missing_binding_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from specdecode.models.llamacpp import import_llama_cpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(SpecDecodeError, match=r"specdecode\[llamacpp\]"):
        import_llama_cpp()


def test_metrics_and_the_run_header_name_the_backend_and_its_exactness(tiny: Any) -> None:
    from specdecode.models.loading import LoadedModel
    from specdecode.server.prometheus import ServerMetrics

    loaded = LoadedModel(tiny[0], None, "tiny", Path("t.gguf"), "gguf", 0.0)  # type: ignore[arg-type]
    assert loaded.exactness().startswith("exact: batch-invariant")
    metrics = ServerMetrics("tiny")
    metrics.set_backend(loaded.backend, loaded.backend_version(), loaded.exactness())
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    assert 'backend="llama.cpp"' in text and 'version="0.3.36"' in text
    assert 'exactness="exact: batch-invariant' in text
