"""The native runner against transformers' implementation of the same checkpoints (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from tests.conftest import make_checkpoint

TOL = 1e-4  # max |native - transformers| relative to the logit scale max |transformers|

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "linear-rope": ("llama", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": True}),
}


def _reference(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(ids).logits  # (B, T, V)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("mode", ["exact", "torch", "torch-gemv-copy"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_logits_match_transformers(tmp_path: Path, variant: str, mode: str) -> None:
    """On the row-invariant kernels (the default where they build) and on PyTorch's."""
    family, overrides = VARIANTS[variant]
    folder = make_checkpoint(tmp_path / variant, family, **overrides)
    cfg = config_from_hf(read_hf_config(folder))
    model = load_native(folder, cfg)
    if mode != "exact":
        model.set_exact(False)
    elif not model.exact:
        pytest.skip("the row-invariant kernels do not build here")
    if mode == "torch-gemv-copy":  # the one-token steps below then run on the (in, out) copies
        model.add_gemv_copies()
    ids = torch.randint(cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = _reference(folder, ids)
    with torch.inference_mode():
        whole = model(ids, model.new_cache(1, 32))
        cache = model.new_cache(1, 32)  # chunked prefill, then one token at a time
        parts = [model(ids[:, :10], cache), model(ids[:, 10:20], cache)]
        parts += [model(ids[:, t : t + 1], cache) for t in range(20, 24)]
    assert _rel_err(whole, ref) < TOL
    assert _rel_err(torch.cat(parts, dim=1), ref) < TOL


def test_ragged_batch_rows_match_single_rows(tmp_path: Path) -> None:
    """Rows of different lengths in one batch give each row's batch-1 logits."""
    folder = make_checkpoint(tmp_path / "m")
    model = load_native(folder, config_from_hf(read_hf_config(folder)))
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randint(96, (1, 7), generator=gen), torch.randint(96, (1, 12), generator=gen)
    new = torch.randint(96, (2, 3), generator=gen)
    padded = torch.cat([torch.cat([a, torch.zeros(1, 5, dtype=torch.long)], 1), b])  # (2, 12)
    with torch.inference_mode():
        cache = model.new_cache(2, 32)
        model(padded, cache, num_new=[7, 12], logits_for="none")
        batched = model(new, cache)  # ragged: rows at lengths 7 and 12
        single = []
        for row, prompt in ((0, a), (1, b)):
            c = model.new_cache(1, 32)
            model(prompt, c)
            single.append(model(new[row : row + 1], c))
    assert cache.lengths == [10, 15]
    assert _rel_err(batched, torch.cat(single)) < TOL


def test_gemv_copy_serves_one_row_only_and_is_counted(tmp_path: Path) -> None:
    """The (in, out) copy is used for one-row calls (a stale copy shows in their output, not in
    wider calls'), matches the weight's own result, and weight_bytes counts it."""
    folder = make_checkpoint(tmp_path / "m", tie_word_embeddings=True)
    model = load_native(folder, config_from_hf(read_hf_config(folder))).set_exact(False)
    before = model.weight_bytes()
    matrices = sum(m.weight.numel() * 4 for m in model.modules()
                   if isinstance(m, torch.nn.Linear))
    model.add_gemv_copies()
    assert model.weight_bytes() == before + matrices
    layer = model.layers[0].qkv
    x = torch.randn(1, 1, layer.in_features, generator=torch.Generator().manual_seed(3))
    wide = torch.randn(1, 4, layer.in_features, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want1, want4 = F.linear(x, layer.weight, layer.bias), F.linear(wide, layer.weight,
                                                                        layer.bias)
        assert torch.allclose(layer(x), want1, atol=1e-5)
        assert layer.weight_t is not None
        layer.weight_t.zero_()  # broken variant: a stale copy
        assert not torch.allclose(layer(x), want1, atol=1e-5)
        assert torch.allclose(layer(wide), want4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9, 12, 40, 200])
def test_every_row_count_gives_each_rows_own_product(tmp_path: Path, rows: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear picks a layout (and for some row counts a product padded with zero rows) by the
    row count; every choice returns, for each row, F.linear of that row, whatever the other
    rows hold, and padded counts do run padded (models.llama.PADDED_ROWS: 3 as 4, 12 as 16)."""
    folder = make_checkpoint(tmp_path / "m")
    model = load_native(folder, config_from_hf(read_hf_config(folder))).set_exact(False)
    layer = model.layers[0].gate_up
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, layer.in_features, generator=g)
    other = x.clone()
    other[1:] = torch.randn(rows - 1, layer.in_features, generator=g)
    shapes: list[tuple[int, ...]] = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: shapes.append(tuple(b.shape)) or mm(a, b))
    with torch.inference_mode():
        got, got_other = layer(x), layer(other)
    assert got.shape == (rows, layer.out_features)
    assert torch.allclose(got, F.linear(x, layer.weight), atol=1e-5)
    assert torch.allclose(got[0], got_other[0], atol=1e-6)  # row 0 alone decides row 0
    padded = {3: 4, 12: 16}.get(rows)
    if padded is not None:
        assert shapes and all(s == (layer.in_features, padded) for s in shapes), shapes
