"""The distilled draft on the llama.cpp backend (drafters.distilled_gguf): the GGUF export loads
in llama.cpp and gives the native distilled draft's logits; the cache reuses an export and
writes atomically; a draft made for another target is refused naming its file; greedy
speculation with it is token-identical to plain decoding.

The models are small random Llamas written as GGUF (f32) by models.gguf_write; the draft is a
distilled draft of the target's shape (2 of its 3 blocks, perturbed, and a head over its 280
lowest token ids) saved as `specdecode train draft` saves one. Without llama-cpp-python these
tests skip, unless SPECDECODE_REQUIRE_LLAMACPP=1; the last one loads SmolLM2 (slow).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.identity import assert_identical

if os.environ.get("SPECDECODE_REQUIRE_LLAMACPP") != "1":
    pytest.importorskip("llama_cpp")

from specdecode.drafters import distilled_gguf
from specdecode.drafters.distilled_gguf import (
    SubsetDraft,
    cached_export,
    export_distilled_gguf,
    load_gguf_draft,
    sidecar_path,
)
from specdecode.models.gguf_write import write_gguf
from specdecode.models.llamacpp import LlamaCppModel, load_llamacpp

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
         "num_hidden_layers": 3}
SUBSET = 280  # the draft head's tokens: ids 0..279 (the lowest, as training picks them); the
# cut GGUF tokenizer keeps the 256 byte tokens llama.cpp needs to load it
PROMPT = [5, 7, 3, 8, 5, 7, 3, 290, 12, 5, 7]  # 290: outside the subset, fed as an embedding
# llama.cpp keeps keys and values in f16 (relative rounding 2^-11 ~ 5e-4); everything else in
# these f32 exports is f32 as in the native draft, so a logit (magnitudes up to ~2.2 here) moves
# by about that share of its size: measured 8.6e-4 (f16 blocks 1.3e-3; Q8_0 4e-2, Q4_0 0.48)
TOLERANCE = 5e-3


@dataclasses.dataclass
class Tiny:
    root: Path
    target_gguf: Path
    target: Any  # the GGUF on llama.cpp
    native: Any  # the same checkpoint on the native runner
    draft_dir: Path  # the distilled draft's folder
    draft: Any  # the native distilled draft


def _distilled(native: Any, folder: Path, seed: int) -> Any:
    """A distilled draft of `native` saved in `folder` with a card naming `native`'s weights."""
    from specdecode.drafters.distilled import (
        DraftLayout,
        build_draft,
        initial_weights,
        load_distilled,
        save_distilled,
    )
    from specdecode.models.cards import weights_sha256, write_model_card

    layout = DraftLayout((0, 2), SUBSET)
    gen = torch.Generator().manual_seed(seed)
    own = {k: v + 0.05 * torch.randn(v.shape, generator=gen) * v.abs().mean()
           for k, v in initial_weights(native, layout).items()}  # not the target's blocks
    draft = build_draft(native, layout, torch.arange(SUBSET), own)
    save_distilled(draft, folder, layout)
    write_model_card(folder, {"kind": "distilled-draft", "target": "tiny",
                              "target_sha256": weights_sha256(native)}, "tiny draft")
    return load_distilled(folder, native)  # as shipped: bf16 blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiny]:
    from specdecode.models.config import config_from_hf, read_hf_config
    from specdecode.models.loading import load_native

    root = tmp_path_factory.mktemp("distilled")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(root / "cache"))  # conversions and exports
        folder = make_checkpoint(root / "target", seed=6, scale=4.0, **SMALL)
        cfg = write_gguf(folder, root / "target.gguf")
        native = load_native(folder, config_from_hf(read_hf_config(folder)))
        draft = _distilled(native, root / "draft", seed=1)
        target = load_llamacpp(root / "target.gguf", cfg, threads=1)
        yield Tiny(root, root / "target.gguf", target, native, root / "draft", draft)
        target.close()


def _native_logits(tiny: Tiny, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return tiny.draft(torch.tensor([tokens]), tiny.draft.new_cache(1, 32))[0]


def test_subset_export_gives_the_native_drafts_logits(tiny: Tiny) -> None:
    path = export_distilled_gguf(tiny.draft_dir, tiny.target_gguf, tiny.root / "sub.gguf",
                                 weight_type="f32", head="subset")
    draft = load_gguf_draft(path, tiny.target)
    assert isinstance(draft, SubsetDraft) and draft.cfg.vocab_size == SMALL["vocab_size"]
    ref = _native_logits(tiny, PROMPT)
    out = draft(torch.tensor([PROMPT]), draft.new_cache(1, 32))[0].clone()
    assert out.shape == ref.shape
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))  # -inf outside the subset
    assert int(torch.isfinite(out[0]).sum()) == SUBSET
    assert float((out[:, :SUBSET] - ref[:, :SUBSET]).abs().max()) < TOLERANCE
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # fed in two calls (as a drafter feeds it), the last position's logits are the same
    cache = draft.new_cache(1, 32)
    draft(torch.tensor([PROMPT[:6]]), cache, logits_for="none")
    last = draft(torch.tensor([PROMPT[6:]]), cache, logits_for="last")[0, -1]
    assert torch.equal(last, out[-1])
    draft.close()


def test_full_export_is_a_plain_gguf_llamacpp_loads(tiny: Tiny) -> None:
    """The full-vocabulary export needs no sidecar: llama.cpp loads it with the target's whole
    tokenizer, and on the subset its logits are the native draft's."""
    path = export_distilled_gguf(tiny.draft_dir, tiny.target_gguf, tiny.root / "full.gguf",
                                 weight_type="f32", head="full")
    assert not sidecar_path(path).exists()
    cfg = dataclasses.replace(tiny.target.cfg, num_layers=2)
    model = LlamaCppModel(path, cfg, threads=1, sequences=4)
    ref = _native_logits(tiny, PROMPT)
    out = model(torch.tensor([PROMPT]), model.new_cache(1, 32))[0].clone()
    assert float((out[:, :SUBSET] - ref[:, :SUBSET]).abs().max()) < TOLERANCE
    model.close()


@pytest.mark.parametrize("weight_type", ["f16", "q8_0", "q4_0"])
def test_quantized_exports_load_and_stay_close(tiny: Tiny, weight_type: str) -> None:
    """Smaller weight types load and draft (how close they stay moves acceptance, never the
    output); Q8_0 keeps the native draft's greedy tokens on this prompt."""
    f32 = export_distilled_gguf(tiny.draft_dir, tiny.target_gguf, tiny.root / "f.gguf",
                                weight_type="f32")
    path = export_distilled_gguf(tiny.draft_dir, tiny.target_gguf,
                                 tiny.root / f"{weight_type}.gguf", weight_type=weight_type)
    assert path.stat().st_size < f32.stat().st_size
    draft = load_gguf_draft(path, tiny.target)
    ref = _native_logits(tiny, PROMPT)
    out = draft(torch.tensor([PROMPT]), draft.new_cache(1, 32))[0].clone()
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))
    if weight_type != "q4_0":
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
    draft.close()


def test_cache_reuses_an_export_and_keys_it_by_its_inputs(
        tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tiny.root / "cache-reuse"))
    first = cached_export(tiny.draft_dir, tiny.target_gguf)
    assert first.parent == tiny.root / "cache-reuse" / "drafts"
    assert sidecar_path(first).is_file()
    stamp = first.stat().st_mtime_ns

    def no_export(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("exported again")

    monkeypatch.setattr(distilled_gguf, "export_distilled_gguf", no_export)
    assert cached_export(tiny.draft_dir, tiny.target_gguf) == first
    assert first.stat().st_mtime_ns == stamp
    monkeypatch.undo()
    monkeypatch.setenv("SPECDECODE_CACHE", str(tiny.root / "cache-reuse"))
    other = cached_export(tiny.draft_dir, tiny.target_gguf, weight_type="f32")
    assert other != first and other.parent == first.parent
    # a GGUF whose sidecar is missing (never complete) is exported again, not used
    sidecar_path(first).unlink()
    assert cached_export(tiny.draft_dir, tiny.target_gguf) == first
    assert sidecar_path(first).is_file()


def test_an_interrupted_export_leaves_nothing_behind(tiny: Tiny, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(distilled_gguf, "_write_sidecar", crash)  # after the GGUF's temp file
    dest = tmp_path / "out" / "d.gguf"
    with pytest.raises(OSError, match="disk full"):
        export_distilled_gguf(tiny.draft_dir, tiny.target_gguf, dest)
    assert list(dest.parent.iterdir()) == []  # no temporary file, no half-written GGUF


def test_a_draft_for_another_target_is_refused_naming_its_file(tiny: Tiny,
                                                              tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "other", seed=7, scale=4.0, **SMALL)
    write_gguf(folder, tmp_path / "other.gguf")
    with pytest.raises(SpecDecodeError, match=r"draft\.safetensors: these weights were trained "
                                              r"for a different target"):
        export_distilled_gguf(tiny.draft_dir, tmp_path / "other.gguf", tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists()
    # an export made for one target GGUF, given to another llama.cpp target
    path = export_distilled_gguf(tiny.draft_dir, tiny.target_gguf, tmp_path / "ok.gguf")
    cfg = write_gguf(folder, tmp_path / "other.gguf")
    other = load_llamacpp(tmp_path / "other.gguf", cfg, threads=1, check=False)
    with pytest.raises(SpecDecodeError, match=r"ok\.gguf: this draft was exported for another"):
        load_gguf_draft(path, other)
    other.close()


def test_a_sidecar_that_is_not_one_is_refused(tiny: Tiny, tmp_path: Path) -> None:
    path = export_distilled_gguf(tiny.draft_dir, tiny.target_gguf, tmp_path / "d.gguf")
    sidecar_path(path).write_bytes(b"not safetensors")
    with pytest.raises(SpecDecodeError, match=r"d\.embed\.safetensors: missing or unreadable"):
        load_gguf_draft(path, tiny.target)


def test_export_command_writes_the_gguf_and_prints_its_path(tiny: Tiny, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    from tests.cli_run import run_cli

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    common = ["export", "--distilled", str(tiny.draft_dir), "--model", str(tiny.target_gguf)]
    code, out, err = run_cli([*common, "--type", "f16", "--head", "full",
                              "--out", str(tmp_path / "d.gguf")])
    assert (code, out.strip(), err) == (0, str(tmp_path / "d.gguf"), "")
    code, out, _ = run_cli(common)  # into the cache, as --drafter distilled would
    assert code == 0 and Path(out.strip()) == cached_export(tiny.draft_dir, tiny.target_gguf)
    code, _, err = run_cli([*common, "--type", "q3"])
    assert code == 2 and "weight type 'q3'" in err
    code, _, err = run_cli([*common, "--out", str(tmp_path / "d.bin")])
    assert code == 2 and "--out must end in .gguf" in err


def _gen(model: Any, prompt: list[int], params: SamplingParams, drafter: Any = None,
         k: int = 0) -> Generation:
    gen = Generation(model, None, prompt, params, drafter, k)
    for _ in gen.run():
        pass
    gen.release()
    return gen


def _run(model: Any, prompt: list[int], params: SamplingParams, drafter: Any = None,
         k: int = 0) -> list[int]:
    return _gen(model, prompt, params, drafter, k).output


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_the_distilled_gguf_is_token_identical(tiny: Tiny,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           k: int) -> None:
    """`--drafter distilled` on a llama.cpp target (exported on first use), and the same file
    given as `--drafter draft-model`: plain greedy's tokens, and some of its drafts accepted."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tiny.root / "cache-identity"))
    params = SamplingParams(max_tokens=40)
    plain = _run(tiny.target, PROMPT, params)
    make = drafter_factory(DrafterOptions("distilled", distilled=str(tiny.draft_dir)),
                           tiny.target)
    assert make is not None
    drafter = make()
    assert drafter.name == "distilled"
    assert_identical([_gen(tiny.target, PROMPT, params, drafter, k)], [plain], "distilled")
    path = cached_export(tiny.draft_dir, tiny.target_gguf)
    as_file = drafter_factory(DrafterOptions("draft-model", draft_model=str(path)), tiny.target)
    assert as_file is not None
    assert_identical([_gen(tiny.target, PROMPT, params, as_file(), k)], [plain], "as a file")


def test_greedy_batch_of_rows_with_the_distilled_gguf(tiny: Tiny,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tiny.root / "cache-identity"))
    prompts = [PROMPT, [9, 4, 4, 9, 4], [11, 12, 13, 11, 12, 13, 11], [200, 3, 150, 299]]
    lengths = [30, 12, 40, 25]
    plain = [_run(tiny.target, p, SamplingParams(max_tokens=n))
             for p, n in zip(prompts, lengths, strict=True)]
    make = drafter_factory(DrafterOptions("distilled", distilled=str(tiny.draft_dir)),
                           tiny.target)
    assert make is not None
    engine = BatchEngine(tiny.target, max_batch=3, max_seq_len=128)
    gens = [Generation(tiny.target, None, p, SamplingParams(max_tokens=n), make(), 1 + i)
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    run_batch(engine, gens)
    assert_identical(gens, plain, "distilled rows")


@pytest.mark.slow
def test_smollm_greedy_with_the_shipped_distilled_draft_is_token_identical() -> None:
    """The shipped draft exported for SmolLM2's GGUF (into the user cache, as `--drafter
    distilled --backend llama.cpp` does) on 4 built-in prompts (one in 6), 48 tokens, k = 3."""
    from specdecode.bench.workloads import load_default_workload
    from specdecode.models.backends import load_model

    loaded = load_model(backend="llama.cpp")
    make = drafter_factory("distilled", loaded.model)
    assert make is not None
    tok = loaded.tokenizer
    runs, plains = [], []
    for prompt in load_default_workload().prompts[::6]:
        ids = tok.encode_prompt(tok.apply_chat_template([{"role": "user",
                                                          "content": prompt.turns[0]}]))
        params = SamplingParams(max_tokens=48)
        plain = Generation(loaded.model, None, ids, params, None, 0, tok.eos_ids)
        spec = Generation(loaded.model, None, ids, params, make(), 3, tok.eos_ids)
        for gen in (plain, spec):
            for _ in gen.run():
                pass
            gen.release()
        runs.append(spec)
        plains.append(plain.output)
    assert_identical(runs, plains, "shipped distilled draft on llama.cpp")
