"""The distilled draft as a Hugging Face folder (drafters.distilled_hf), the form vLLM's
`draft_model` loads: transformers loads the export as a plain LlamaForCausalLM and gives the
native distilled draft's logits on the draft's vocabulary subset, for a tied and an untied
target; a wrongly mapped export is caught by that comparison; a draft for another target is
refused naming its file; the cache reuses an export; `specdecode export --format hf` writes one
and refuses GGUF-only options. The last test exports the draft shipped for SmolLM2 (slow).

The models are small random Llamas written as GGUF (f32) by models.gguf_write, the draft a
distilled draft of the target's shape (2 of its 3 blocks, perturbed, a head over its 280 lowest
token ids) saved as `specdecode train draft` saves one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.drafters.distilled_hf import cached_hf_export, export_distilled_hf
from specdecode.errors import SpecDecodeError
from specdecode.models.gguf_write import write_gguf
from tests.conftest import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
         "num_hidden_layers": 3}
SUBSET = 280
PROMPT = [5, 7, 3, 8, 5, 7, 3, 290, 12, 5, 7]  # 290: outside the subset
TOLERANCE = 1e-4  # both sides fp32 from the same values: only summation order differs


@dataclasses.dataclass
class Tiny:
    root: Path
    target_gguf: Path
    native: Any  # the target on the native runner
    draft_dir: Path
    draft: Any  # the native distilled draft


def _make(root: Path, tied: bool) -> Tiny:
    from specdecode.drafters.distilled import (
        DraftLayout,
        build_draft,
        initial_weights,
        load_distilled,
        save_distilled,
    )
    from specdecode.models.cards import weights_sha256, write_model_card
    from specdecode.models.config import config_from_hf, read_hf_config
    from specdecode.models.loading import load_native

    folder = make_checkpoint(root / "target", seed=6, scale=4.0, tie_word_embeddings=tied,
                             **SMALL)
    write_gguf(folder, root / "target.gguf")
    native = load_native(folder, config_from_hf(read_hf_config(folder)))
    layout = DraftLayout((0, 2), SUBSET)
    gen = torch.Generator().manual_seed(1)
    own = {k: v + 0.05 * torch.randn(v.shape, generator=gen) * v.abs().mean()
           for k, v in initial_weights(native, layout).items()}
    save_distilled(build_draft(native, layout, torch.arange(SUBSET), own), root / "draft",
                   layout)
    write_model_card(root / "draft", {"kind": "distilled-draft", "target": "tiny",
                                      "target_sha256": weights_sha256(native)}, "tiny draft")
    return Tiny(root, root / "target.gguf", native, root / "draft",
                load_distilled(root / "draft", native))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Tiny]:
    root = tmp_path_factory.mktemp("distilled-hf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(root / "cache"))  # conversions and exports
        yield _make(root, tied=request.param)


def _native_logits(tiny: Tiny, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return tiny.draft(torch.tensor([tokens]), tiny.draft.new_cache(1, 32))[0]


def _hf_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def test_transformers_gives_the_native_drafts_logits(tiny: Tiny) -> None:
    dest = export_distilled_hf(tiny.draft_dir, tiny.target_gguf, tiny.root / "hf")
    config = json.loads((dest / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == SMALL["vocab_size"]
    from safetensors import safe_open

    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) != config["tie_word_embeddings"]
    assert (dest / "tokenizer.json").is_file()
    ref, out = _native_logits(tiny, PROMPT), _hf_logits(dest, PROMPT)
    assert out.shape == ref.shape
    # the native draft scores the subset only; the plain LlamaForCausalLM scores every token
    assert float((out[:, :SUBSET] - ref[:, :SUBSET]).abs().max()) < TOLERANCE
    assert bool(torch.isfinite(out[:, SUBSET:]).all())


def test_a_wrongly_mapped_export_is_caught(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """gate and up swapped (an easy slip when splitting the fused matrix): the comparison above
    sees it."""
    from specdecode.drafters import distilled_hf

    mapped = distilled_hf.hf_block_tensors

    def swapped(*args: Any) -> dict[str, torch.Tensor]:
        out = mapped(*args)
        for j in range(2):
            p = f"model.layers.{j}.mlp."
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = \
                out[p + "up_proj.weight"], out[p + "gate_proj.weight"]
        return out

    monkeypatch.setattr(distilled_hf, "hf_block_tensors", swapped)
    dest = export_distilled_hf(tiny.draft_dir, tiny.target_gguf, tiny.root / "broken")
    ref, out = _native_logits(tiny, PROMPT), _hf_logits(dest, PROMPT)
    assert float((out[:, :SUBSET] - ref[:, :SUBSET]).abs().max()) > 100 * TOLERANCE


def test_a_draft_for_another_target_is_refused_naming_its_file(tiny: Tiny,
                                                               tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "other", seed=7, scale=4.0, **SMALL)
    write_gguf(other, tmp_path / "other.gguf")
    with pytest.raises(SpecDecodeError, match=r"draft\.safetensors: these weights were trained"):
        export_distilled_hf(tiny.draft_dir, tmp_path / "other.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_cache_reuses_an_export(tiny: Tiny) -> None:
    first = cached_hf_export(tiny.draft_dir, tiny.target_gguf)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_hf_export(tiny.draft_dir, tiny.target_gguf) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if ".tmp-" in p.name]


def test_export_command_writes_the_folder_and_refuses_gguf_options(tiny: Tiny,
                                                                   tmp_path: Path) -> None:
    from tests.cli_run import run_cli

    common = ["export", "--format", "hf", "--distilled", str(tiny.draft_dir), "--model",
              str(tiny.target_gguf)]
    code, out, err = run_cli([*common, "--out", str(tmp_path / "d")])
    assert (code, out.strip(), err) == (0, str(tmp_path / "d"), "")
    assert (tmp_path / "d" / "model.safetensors").is_file()
    code, out, _ = run_cli(common)  # into the cache, as the vLLM configuration uses
    assert code == 0 and Path(out.strip()) == cached_hf_export(tiny.draft_dir, tiny.target_gguf)
    code, _, err = run_cli([*common, "--type", "q8_0"])
    assert code == 2 and "--type: GGUF options" in err
    code, _, err = run_cli([*common, "--out", str(tmp_path / "d.gguf")])
    assert code == 2 and "must be a folder" in err
    code, _, err = run_cli([*common[:2], "onnx", *common[3:]])
    assert code == 2 and "--format 'onnx'" in err


@pytest.mark.slow
def test_the_shipped_smollm2_draft_exports_for_vllm() -> None:
    """The folder the `distilled` vLLM configuration serves: transformers gives the shipped
    draft's logits (as the native runner computes them on the fp32 target) on its subset."""
    from scripts.vllm_server import distilled_folder, speculative_config
    from specdecode.drafters.distilled import DEFAULT_DIR, load_distilled, read_config
    from specdecode.models.backends import load_model

    folder = distilled_folder()
    spec = speculative_config("distilled")
    assert spec is not None and spec["method"] == "draft_model" and spec["model"] == str(folder)
    subset = int(read_config(DEFAULT_DIR)["vocab_size"])
    draft = load_distilled(DEFAULT_DIR, load_model(precision="fp32").model)
    tokens = [1, 9690, 198, 2683, 359, 253, 5356, 30, 2, 198, 1, 4093, 198, 504, 3458]
    with torch.inference_mode():
        ref = draft(torch.tensor([tokens]), draft.new_cache(1, 32))[0]
    out = _hf_logits(folder, tokens)
    assert float((out[:, :subset] - ref[:, :subset]).abs().max()) < 1e-3
