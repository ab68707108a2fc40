"""The real default model: SmolLM2-135M-Instruct from its GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models import backends, loading
from specdecode.models.loading import LoadedModel
from specdecode.models.paths import default_model_path
from specdecode.sampling import SamplingParams
from tests.identity import assert_identical

PINNED_PROMPT = "Once upon a time, in a small village by the sea,"
PINNED_64 = (
    " there was a wise old wizard named Thorold. He lived in a tower surrounded by a beautiful "
    "garden filled with all sorts of magical creatures.\n\nThorold was known for his kindness and "
    "generosity. He had a special gift, a magical staff that could help those who were suffering."
    " He lived in a small"
)


def _generate(m: LoadedModel, prompt: str, params: SamplingParams) -> list[int]:
    gen = Generation(m.model, m.tokenizer, m.tokenizer.encode(prompt), params)
    for _ in gen.run():
        pass
    return gen.output


def test_config_read_from_gguf(smollm: LoadedModel) -> None:
    cfg = smollm.model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_embeddings and cfg.rope_theta == 100000.0
    assert smollm.backend == "native"


def test_logits_match_transformers_gguf_loader(smollm: LoadedModel) -> None:
    """Oracle: transformers' own GGUF loader (de-quantize + un-permute) on the same file."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    ids = torch.tensor([smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    with torch.inference_mode():
        ref = hf(ids).logits
        ours = smollm.model(ids, smollm.model.new_cache(1, 64))
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4


def test_pinned_greedy_output(smollm: LoadedModel) -> None:
    out = _generate(smollm, PINNED_PROMPT, SamplingParams(max_tokens=64))
    assert len(out) == 64
    assert smollm.tokenizer.decode(out) == PINNED_64


def test_chat_template_from_gguf(smollm: LoadedModel) -> None:
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert smollm.tokenizer.eos_ids == (2,)


def test_seeded_sampling_is_reproducible(smollm: LoadedModel) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    first = _generate(smollm, "My favourite colour is", params)
    assert first == _generate(smollm, "My favourite colour is", params)
    other = SamplingParams(temperature=1.0, max_tokens=16, seed=4321)
    assert first != _generate(smollm, "My favourite colour is", other)


def test_seeded_sampling_with_a_model_drafter_is_plain_sampling(smollm: LoadedModel) -> None:
    """Rule invariant: the 4-bit copy of the target draws its drafts with the target's noise;
    with a seed, the output is plain sampled output (built-in prompts, 64 tokens) and most
    drafts are accepted."""
    from specdecode.bench.workloads import load_default_workload
    from specdecode.drafters.registry import drafter_factory

    make = drafter_factory("w4a16", smollm.model)
    assert make is not None
    tok = smollm.tokenizer
    runs, plains = [], []
    for i, prompt in enumerate(load_default_workload().prompts[:6]):
        ids = tok.encode_prompt(tok.apply_chat_template([{"role": "user",
                                                          "content": prompt.turns[0]}]))
        params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=64, seed=900 + i)
        plain = Generation(smollm.model, None, ids, params, None, 0, tok.eos_ids)
        spec = Generation(smollm.model, None, ids, params, make(), 4, tok.eos_ids)
        for gen in (plain, spec):
            for _ in gen.run():
                pass
        runs.append(spec)
        plains.append(plain.output)
    assert assert_identical(runs, plains, "w4a16 copy, seeded").rate > 0.5


def test_second_load_uses_the_converted_cache(
    smollm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("converted again although the cache holds the model")

    monkeypatch.setattr("specdecode.models.gguf_convert.convert_gguf", refuse)
    again = backends.load_model()
    assert again.model.cfg == smollm.model.cfg


def test_interrupted_conversion_leaves_no_half_written_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))

    def interrupted(path: Path, dest: Path) -> None:
        (dest / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr("specdecode.models.gguf_convert.convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        loading.converted_folder(default_model_path())
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_unreadable_gguf_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(SpecDecodeError, match=r"broken\.gguf: not a readable GGUF"):
        backends.load_model(str(bad))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
