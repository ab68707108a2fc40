"""GGUF blocks read into the kernels' panels bit for bit (models.gguf_blocks): for every block
type, random raw blocks decode to exactly what gguf-py's de-quantizer computes from the same
bytes, and the panels of both arithmetic modes hold exactly that weight; a decoder with a
deliberately wrong bit layout is caught by the same comparison; joined matrices of mixed types
stay exact; an unknown type is a clear error."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from specdecode.errors import SpecDecodeError
from specdecode.models import gguf_blocks, kernels

QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# where each type keeps its fp16 scales (byte offsets in a block): random bytes there would make
# NaN and infinity, which a real file does not hold
F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def raw_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random but well-formed blocks of `type_name` for an (n, k) matrix, as gguf-py reads
    them: (n, bytes per row) uint8."""
    qtype = GGMLQuantizationType[type_name]
    size, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // size, nbytes), dtype=np.uint8)
    for at in F16_AT[type_name]:
        scales = (rng.random((n, k // size)) * 0.02 + 1e-3).astype(np.float16)
        raw[..., at:at + 2] = scales[..., None].view(np.uint8).reshape(n, k // size, 2)
    return raw.reshape(n, k // size * nbytes)


def reference(raw: np.ndarray, type_name: str, n: int, k: int) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, GGMLQuantizationType[type_name]),
                      dtype=np.float32).reshape(n, k)


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_every_block_type_decodes_to_ggmls_weights_bit_for_bit(type_name: str) -> None:
    n, k = 48, 512
    raw = raw_blocks(type_name, n, k)
    want = reference(raw, type_name, n, k)
    blocks = gguf_blocks.decode(raw, type_name, n, k, "t")
    assert np.array_equal(blocks.weight(), want)
    for mode in gguf_blocks.MODES:
        p = gguf_blocks.panels(blocks, mode)
        assert torch.equal(kernels.weight_of(p), torch.from_numpy(want)), mode
        if mode == "a8":
            assert p.kind in kernels.QUANT_KINDS
        else:
            assert p.kind not in kernels.QUANT_KINDS


def test_a_wrong_bit_layout_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above fails for a decoder that reads Q4_K's nibbles in the wrong halves
    (low and high swapped) or Q6_K's scales off by one sub-block: the broken variants."""
    def swapped(qs: np.ndarray) -> np.ndarray:
        chunks = qs.reshape(*qs.shape[:-1], 4, 32)
        return np.stack([chunks >> 4, chunks & 0xF], axis=-2).reshape(*qs.shape[:-1], 256)

    n, k = 16, 256
    raw = raw_blocks("Q4_K", n, k)
    monkeypatch.setattr(gguf_blocks, "_k_nibbles", swapped)
    assert not np.array_equal(gguf_blocks.decode(raw, "Q4_K", n, k, "t").weight(),
                              reference(raw, "Q4_K", n, k))
    monkeypatch.undo()
    raw6 = raw_blocks("Q6_K", n, k)
    real: Callable[..., gguf_blocks.Blocks] = gguf_blocks._q6_k

    def shifted(b: np.ndarray, n_: int, k_: int) -> gguf_blocks.Blocks:
        out = real(b, n_, k_)
        assert out.scale is not None
        return gguf_blocks.Blocks(out.n, out.k, out.codes, np.roll(out.scale, 1, axis=1), None,
                                  out.offset, out.group, out.bits)

    monkeypatch.setitem(gguf_blocks._DECODERS, "Q6_K", shifted)
    assert not np.array_equal(gguf_blocks.decode(raw6, "Q6_K", n, k, "t").weight(),
                              reference(raw6, "Q6_K", n, k))


def test_mixed_types_join_exactly_in_both_modes() -> None:
    """q|k|v of a Q4_K_M file: attn_q and attn_k in Q4_K, attn_v in Q6_K (and a Q8_0 and a Q4_0
    part for good measure): one matrix, every row as its own type de-quantizes."""
    k = 256
    parts = [("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16), ("Q8_0", 16), ("Q4_0", 16)]
    blocks, wants = [], []
    for i, (t, n) in enumerate(parts):
        raw = raw_blocks(t, n, k, seed=i)
        blocks.append(gguf_blocks.decode(raw, t, n, k, t))
        wants.append(reference(raw, t, n, k))
    joined = gguf_blocks.join(blocks)
    want = np.concatenate(wants)
    assert np.array_equal(joined.weight(), want)
    for mode in gguf_blocks.MODES:
        assert torch.equal(kernels.weight_of(gguf_blocks.panels(joined, mode)),
                           torch.from_numpy(want)), mode


def test_products_of_decoded_blocks_are_close_to_the_float_product() -> None:
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.build_error()}")
    n, k = 40, 512
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    for t in QUANTIZED:
        raw = raw_blocks(t, n, k)
        want = x.double() @ torch.from_numpy(reference(raw, t, n, k)).double().T
        blocks = gguf_blocks.decode(raw, t, n, k, t)
        fp = kernels.matmul(x, gguf_blocks.panels(blocks, "fp")).double()
        a8 = kernels.matmul(x, gguf_blocks.panels(blocks, "a8")).double()
        scale = float(want.abs().max())
        assert float((fp - want).abs().max()) < 1e-4 * scale, t
        assert float((a8 - want).abs().max()) < 0.05 * scale, t  # int8 activations


def test_an_unheld_type_names_the_type_the_tensor_and_what_works() -> None:
    with pytest.raises(SpecDecodeError, match=r"m.gguf: tensor 'blk.0.ffn_up.weight': stored "
                                              r"as IQ2_XS, which the exact native path cannot "
                                              r"hold \(it holds F32, .*Q6_K\); run this file "
                                              r"with --backend llama.cpp"):
        gguf_blocks.decode(np.zeros((4, 66), np.uint8), "IQ2_XS", 4, 256,
                           "m.gguf: tensor 'blk.0.ffn_up.weight'")
