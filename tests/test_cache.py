"""KV cache for speculation: rollback by length, tree masks with explicit positions, keep()."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from tests.conftest import make_checkpoint


def _model(tmp_path: Path) -> torch.nn.Module:
    folder = make_checkpoint(tmp_path / "m")
    return load_native(folder, config_from_hf(read_hf_config(folder)))


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]), model.new_cache(1, 64))[0]  # (T, V)


def test_rollback_then_rewrite_equals_fresh_run(tmp_path: Path) -> None:
    model = _model(tmp_path)
    prefix, wrong, right = [5, 9, 13, 2], [40, 41, 42], [7, 8]
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(torch.tensor([prefix]), cache)
        model(torch.tensor([wrong]), cache)
        cache.rollback(0, len(prefix))  # reject the whole draft: no copy, just the length
        after = model(torch.tensor([right]), cache)[0]
    assert cache.lengths == [6]
    torch.testing.assert_close(after, _logits(model, prefix + right)[-2:], rtol=0, atol=1e-4)


def test_tree_mask_scores_every_branch_in_one_pass_and_keep_compacts(tmp_path: Path) -> None:
    model = _model(tmp_path)
    prefix = [3, 17, 29, 4, 50]
    # tree: r -> a -> c, r -> b; flattened [r, a, b, c], parents [-1, 0, 0, 1]
    r, a, b, c = 11, 22, 33, 44
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2])
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(torch.tensor([prefix]), cache)
        scored = model(torch.tensor([[r, a, b, c]]), cache, positions=(len(prefix) + depth)[None],
                       tree_mask=tree)[0]
        path_ac = _logits(model, [*prefix, r, a, c])[-3:]
        path_b = _logits(model, [*prefix, r, b])[-1]
        torch.testing.assert_close(scored[[0, 1, 3]], path_ac, rtol=0, atol=1e-4)
        torch.testing.assert_close(scored[2], path_b, rtol=0, atol=1e-4)
        cache.keep(0, len(prefix), torch.tensor([0, 1, 3]))  # accept the path r, a, c
        nxt = model(torch.tensor([[60]]), cache)[0, -1]
    assert cache.lengths == [len(prefix) + 4]
    torch.testing.assert_close(nxt, _logits(model, [*prefix, r, a, c, 60])[-1], rtol=0, atol=1e-4)


def test_tree_mask_is_not_ignored(tmp_path: Path) -> None:
    """Sanity of the test above: causal masking of the same block gives other logits for b."""
    model = _model(tmp_path)
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(torch.tensor([[3, 17, 29]]), cache)
        causal = model(torch.tensor([[11, 22, 33]]), cache)[0]
    assert (causal[2] - _logits(model, [3, 17, 29, 11, 33])[-1]).abs().max() > 1e-2
