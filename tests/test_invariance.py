"""Bit-exact batch invariance of the native runner (models.kernels, models.invariance) and the
registry's refusal of targets that are not invariant, each with a broken variant it catches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.invariance import measure
from specdecode.models.llama import LlamaModel
from specdecode.models.loading import load_native
from specdecode.models.precision import apply_precision
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.identity import assert_identical

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"kernels unavailable: {kernels.build_error()}")

EXACT = ("fp32", "bf16", "w8a16", "w4a16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    folder = make_checkpoint(tmp_path_factory.mktemp("inv") / "m", tie_word_embeddings=True)
    model = load_native(folder, config_from_hf(read_hf_config(folder)))
    assert isinstance(model, LlamaModel) and model.exact  # exact by default where they build
    return model


def _packed(kind: str, w: torch.Tensor, bias: torch.Tensor) -> kernels.Panels:
    if kind in ("fp32", "bf16"):
        return kernels.pack_float(w, torch.float32 if kind == "fp32" else torch.bfloat16, bias)
    if kind == "int8":
        scales = w.abs().amax(dim=1) / 127
        return kernels.pack_int8(torch.round(w / scales[:, None]), scales, bias)
    codes = torch.randint(0, 16, w.shape)
    groups = (w.shape[0], w.shape[1] // kernels.GROUP)
    return kernels.pack_int4(codes, torch.rand(groups) * 0.1, torch.randn(groups) * 0.1, bias)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_kernel_products_are_correct_and_the_same_for_every_row_count(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 64, generator=gen)  # outputs not a multiple of the panel
    bias = torch.randn(37, generator=gen)
    x = torch.randn(70, 64, generator=gen)
    packed = _packed(kind, w, bias)
    full = kernels.matmul(x, packed)
    xin = x.bfloat16().float() if packed.round_x else x
    torch.testing.assert_close(full, F.linear(xin, kernels.weight_of(packed), bias),
                               rtol=1e-4, atol=1e-3)
    for rows in (*range(1, 10), 16, 63, 64, 65):
        assert torch.equal(kernels.matmul(x[:rows], packed), full[:rows]), rows
    for start in range(5):  # a row alone equals the same row among others
        assert torch.equal(kernels.matmul(x[start:start + 1], packed), full[start:start + 1])


def _causal(lengths: list[int], width: int, used: int) -> torch.Tensor:
    j = torch.arange(used)[None, None]
    t = torch.arange(width)[None, :, None]
    lens = torch.tensor(lengths)[:, None, None]
    return ((j - lens) <= t).reshape(len(lengths) * width, used)


def test_kernel_attention_is_correct_and_row_invariant() -> None:
    gen = torch.Generator().manual_seed(1)
    B, KVH, NH, D, cap = 3, 2, 6, 16, 40
    kc, vc = torch.randn(B, KVH, cap, D, generator=gen), torch.randn(B, KVH, cap, D, generator=gen)
    q = torch.randn(B, 8, NH + KVH, D, generator=gen)
    lengths = [20, 11, 27]
    alone = []
    for b in range(B):  # each row's first position scored alone: all slots up to it
        used = lengths[b] + 1
        out = kernels.attention(q[b, :1, :NH], kc[b:b + 1], vc[b:b + 1], torch.zeros(1),
                                None, used)
        ref = F.scaled_dot_product_attention(
            q[b, :1, :NH].transpose(0, 1)[None], kc[b:b + 1, :, :used], vc[b:b + 1, :, :used],
            enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        alone.append(out[0])
    for width in (2, 5, 8):  # the batch, ragged, at several widths
        used = max(lengths) + width
        rows = torch.arange(B).repeat_interleave(width)
        out = kernels.attention(q[:, :width, :NH].reshape(B * width, NH, D), kc, vc, rows,
                                _causal(lengths, width, used), used)
        for b in range(B):
            assert torch.equal(out[b * width], alone[b]), (width, b)


@pytest.mark.parametrize("precision", EXACT)
def test_native_targets_are_exact_and_speculation_is_allowed(
        tiny: LlamaModel, precision: str) -> None:
    model = apply_precision(tiny, precision)
    measured = measure(model)
    assert measured.exact, measured
    assert measured.trees == 0.0
    assert drafter_factory("ngram", model) is not None


def _broken(model: LlamaModel, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """Deliberately broken variants of the kernels, each of a kind seen in real libraries (the
    first two run the blocks operator by operator, so that a product or the attention can be
    swapped)."""
    from specdecode.models.llama import Block

    matmul, attention = kernels.matmul, kernels.attention
    if what == "width-dependent product":  # another kernel for one row (like MKL's GEMV)
        def product(x: torch.Tensor, packed: kernels.Panels) -> torch.Tensor:
            if x.numel() // x.shape[-1] == 1:
                return F.linear(x, kernels.weight_of(packed), packed.bias)
            return matmul(x, packed)
        monkeypatch.setattr(Block, "fused", lambda self: None)
        monkeypatch.setattr(kernels, "matmul", product)
    elif what == "row-coupled attention":  # one reduction across every query row of a call
        def coupled(q: torch.Tensor, *args: Any) -> torch.Tensor:
            out = attention(q, *args)
            return out + 1e-3 * out.mean(dim=0, keepdim=True)
        monkeypatch.setattr(Block, "fused", lambda self: None)
        monkeypatch.setattr(kernels, "attention", coupled)
    else:  # PyTorch's own kernels
        model.set_exact(False)


@pytest.mark.parametrize("what", ["width-dependent product", "row-coupled attention", "torch"])
def test_the_check_catches_broken_kernels_and_speculation_is_refused(
        tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch, what: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    model = apply_precision(tiny, "w4a16")
    _broken(model, monkeypatch, what)
    measured = measure(model)
    assert not measured.exact and measured.worst > 0, measured
    model.invariance = measured
    with pytest.raises(SpecDecodeError, match=r"needs a batch-invariant target.*w4a16 target "
                       r"is not.*SPECDECODE_ALLOW_INEXACT"):
        drafter_factory("ngram", model)
    monkeypatch.setenv("SPECDECODE_ALLOW_INEXACT", "1")
    assert drafter_factory("ngram", model) is not None
    assert "warning" in capsys.readouterr().err


def _moving_rows(monkeypatch: pytest.MonkeyPatch, moved: Callable[[int], slice | None]) -> None:
    """Run the blocks operator by operator with a product whose output rows `moved(rows)` of
    a call of `rows` rows move in the last bits (None: none)."""
    from specdecode.models.llama import Block

    matmul = kernels.matmul

    def product(x: torch.Tensor, packed: kernels.Panels) -> torch.Tensor:
        y = matmul(x, packed)
        where = moved(x.numel() // x.shape[-1])
        if where is not None:
            y = y.clone()
            y.view(-1, y.shape[-1])[where] *= 1 + 2 ** -12
        return y

    monkeypatch.setattr(Block, "fused", lambda self: None)
    monkeypatch.setattr(kernels, "matmul", product)


def test_a_product_that_moves_rows_past_the_64_row_chunk_is_caught(
        tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.c processes a call's rows in chunks of 64: a bug at the chunk edge moves only
    rows 64 and on. The check's batches put the compared positions across it (before: at most
    16 rows a call, never caught)."""
    model = apply_precision(tiny, "checkpoint")
    _moving_rows(monkeypatch, lambda rows: slice(64, None) if rows > 64 else None)
    measured = measure(model)
    assert measured.rows is not None and measured.rows > 0, measured
    assert measured.widths == measured.chunks == measured.threads == 0.0, measured


def test_a_product_that_moves_with_the_thread_count_is_caught(
        tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reduction split by thread count moves every row when the count changes (before: one
    count only, never caught)."""
    model = apply_precision(tiny, "checkpoint")
    own = torch.get_num_threads()
    _moving_rows(monkeypatch, lambda rows: slice(None) if torch.get_num_threads() != own
                 else None)
    measured = measure(model)
    assert measured.threads is not None and measured.threads > 0, measured
    assert measured.widths == measured.rows == measured.chunks == 0.0, measured


def test_every_position_up_to_the_drafters_widest_call_is_checked(
        tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that handles the first 9 rows of a call one way and the rest another (calls of
    10 to 32 rows): invisible at the default width (9: --kmax 8 + 1), seen in every position
    of a call of 17, so --k 16 is refused where --k 8 is not: the registry measures again up
    to the drafter's widest call (before: the first position of widths 2, 3, 4, 8 and 16 only,
    never caught)."""
    from specdecode.drafters.options import DrafterOptions
    from specdecode.models.invariance import DEFAULT_WIDTH

    model = apply_precision(tiny, "checkpoint")
    _moving_rows(monkeypatch, lambda rows: slice(9, None) if 9 < rows <= 32 else None)
    model.invariance = measure(model)
    assert model.invariance.exact and model.invariance.width == DEFAULT_WIDTH
    assert drafter_factory(DrafterOptions("ngram", k=8), model) is not None
    with pytest.raises(SpecDecodeError, match=r"across draft widths up to 17"):
        drafter_factory(DrafterOptions("ngram", k=16), model)
    assert model.invariance.width == 17 and model.invariance.widths > 0


def test_a_tree_drafter_is_checked_up_to_its_node_budget(
        tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """suffix scores up to its node budget + 1 positions in one call (24 + 1 by default)."""
    model = apply_precision(tiny, "checkpoint")
    _moving_rows(monkeypatch, lambda rows: slice(20, None) if 20 < rows <= 32 else None)
    model.invariance = measure(model)
    assert model.invariance.exact
    with pytest.raises(SpecDecodeError, match=r"across draft widths up to 25"):
        drafter_factory("suffix", model)


def test_int8_is_refused_before_measuring(tiny: LlamaModel) -> None:
    model = apply_precision(tiny, "int8")
    with pytest.raises(SpecDecodeError, match="int8 target is not: its kernels quantize"):
        drafter_factory("ngram", model)
    assert model.invariance is None  # refused by construction, nothing measured
    assert drafter_factory("none", model) is None


def _run(model: LlamaModel, prompts: list[list[int]], drafter: Callable[[], Any] | None,
         k: int, batch: int) -> list[Generation]:
    engine = BatchEngine(model, batch, 256)
    gens = [Generation(model, None, p, SamplingParams(max_tokens=40),
                       None if drafter is None else drafter(), k, [1]) for p in prompts]
    return run_batch(engine, gens)


@pytest.mark.parametrize("precision", ["checkpoint", "w4a16", "bf16"])
def test_greedy_speculation_on_fast_targets_is_token_identical(
        tiny: LlamaModel, precision: str) -> None:
    model = apply_precision(tiny, precision)
    gen = torch.Generator().manual_seed(3)
    # repetitive prompts, so the lookup drafts and some drafts are accepted
    prompts = [(torch.randint(2, 20, (6,), generator=gen).tolist()) * 3 for _ in range(5)]
    make = drafter_factory("ngram", model)
    for batch in (1, 4):
        plain = [g.output for g in _run(model, prompts, None, 0, batch)]
        assert_identical(_run(model, prompts, make, 4, batch), plain, f"{precision} b{batch}")


def test_load_model_reports_the_measured_invariance(tmp_path: Path) -> None:
    from specdecode.models.backends import load_model

    folder = make_checkpoint(tmp_path / "m")
    loaded = load_model(str(folder), precision="w4a16")
    assert loaded.model.invariance is not None and loaded.model.invariance.exact


def test_the_portable_scalar_build_is_row_invariant_too(tmp_path: Path) -> None:
    """kernels.c without AVX2 (as on other CPUs) keeps the same rules: built here for plain
    x86-64, every kind's rows are the same bit for bit at every row count, and close to the
    vector build's products."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    flags = [f for f in kernels.FLAGS if f != "-march=native"]
    lib_path = tmp_path / "portable.so"
    subprocess.run([cc, *flags, "-march=x86-64", "-o", str(lib_path), str(kernels.SOURCE), "-lm"],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    assert lib.sd_has_avx2() == 0
    lib.sd_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(kernels.SdMat),
                              ctypes.c_void_p]
    gen = torch.Generator().manual_seed(5)
    w, bias, x = (torch.randn(37, 64, generator=gen), torch.randn(37, generator=gen),
                  torch.randn(12, 64, generator=gen))
    for kind in ("fp32", "bf16", "int8", "int4"):
        packed = _packed(kind, w, bias)
        mat = packed.struct()
        xin = x.bfloat16().float().contiguous() if packed.round_x else x

        def run(rows: torch.Tensor, mat: kernels.SdMat = mat) -> torch.Tensor:
            y = torch.empty(rows.shape[0], 37)
            lib.sd_matmul(rows.data_ptr(), rows.shape[0], ctypes.byref(mat), y.data_ptr())
            return y

        full = run(xin)
        for rows in (1, 2, 3, 7, 12):
            assert torch.equal(run(xin[:rows].contiguous()), full[:rows]), (kind, rows)
        torch.testing.assert_close(full, kernels.matmul(x, packed), rtol=1e-4, atol=1e-3)


def test_grouped_int8_head_reproduces_q8_0_blocks_and_the_tied_rows(tiny: LlamaModel) -> None:
    """The weight-only precisions' head on the kernels: int8 per group of 32 inputs. A matrix
    built as GGUF's Q8_0 de-quantizes (code * d, the largest |code| of a block 127, d an fp16)
    comes back bit for bit; the tied embedding reads its rows from the same panels; products
    are row-invariant like every kind's."""
    from specdecode.models.linears import GroupedInt8Linear, TiedEmbedding, quantize_row_groups

    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(-127, 128, (48, 64), generator=gen)
    codes[:, ::32] = 127  # every block holds its largest code
    d = (torch.rand(48, 2, generator=gen) * 0.01).half().float()
    w = codes.float() * d.repeat_interleave(32, dim=1)
    got_codes, got_scales = quantize_row_groups(w)
    assert torch.equal(got_scales, d) and torch.equal(got_codes.long(), codes)
    head = GroupedInt8Linear(w)
    assert torch.equal(kernels.weight_of(head.panels), w)
    assert torch.equal(head.rows(torch.tensor([[3, 17, 40]]))[0], w[[3, 17, 40]])
    x = torch.randn(9, 64, generator=gen)
    full = head(x)
    assert all(torch.equal(head(x[:r]), full[:r]) for r in range(1, 9))
    torch.testing.assert_close(full, F.linear(x, w), rtol=1e-5, atol=1e-4)
    model = apply_precision(tiny, "w4a16")
    assert isinstance(model.lm_head, GroupedInt8Linear) and isinstance(model.embed, TiedEmbedding)
    assert measure(model).exact


def _q4_1(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A matrix as GGUF's Q4_1 de-quantizes: code * d + m per group of 32, d and m fp16."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15  # each block spans its range
    d = (torch.rand(rows, cols // 32, generator=gen) * 0.02).half().float()
    m = (-torch.rand(rows, cols // 32, generator=gen) * 0.1).half().float()
    return codes * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)


def test_checkpoint_precision_holds_q4_1_blocks_exactly(tiny: LlamaModel) -> None:
    """precision "checkpoint": every matrix in the smallest panels that hold it bit for bit. A
    model whose matrices are Q4_1-de-quantized gets 4-bit panels with the blocks' own d and m and
    matches the fp32 model up to summation order; a perturbed weight (the broken variant) is not
    taken for a block; random weights stay fp32."""
    import copy

    from specdecode.models.linears import PanelLinear, recover_q4_1

    gen = torch.Generator().manual_seed(11)
    w = _q4_1(32, 64, gen)
    blocks = recover_q4_1(w)
    assert blocks is not None
    codes, d, m = blocks
    assert torch.equal(codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1), w)
    broken = w.clone()
    broken[3, 5] += 1e-4
    assert recover_q4_1(broken) is None
    model = copy.deepcopy(tiny)
    with torch.no_grad():
        for block in model.layers:
            for name in ("qkv", "gate_up"):
                lin = getattr(block, name)
                lin.weight.copy_(_q4_1(*lin.weight.shape, gen))
    ck = apply_precision(model, "checkpoint")
    kinds = [m.panels.kind for b in ck.layers for m in (b.qkv, b.gate_up, b.o, b.down)
             if isinstance(m, PanelLinear)]
    assert kinds.count(kernels.KIND_I4) == 2 * len(ck.layers)  # qkv, gate_up: their blocks
    assert kinds.count(kernels.KIND_F32) == 2 * len(ck.layers)  # o, down: random, fp32
    assert measure(ck).exact
    ids = torch.randint(2, 90, (2, 12), generator=gen)
    with torch.inference_mode():
        ref = model(ids, model.new_cache(2, 16))
        got = ck(ids, ck.new_cache(2, 16))
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    assert drafter_factory("ngram", ck) is not None


def test_smollm_checkpoint_precision_is_the_gguf_at_4_bits(smollm: Any) -> None:
    """On SmolLM2 (a Q4_1 GGUF with a Q8_0 table) "checkpoint" holds every block matrix as 4-bit
    panels and the tied head as grouped int8, under a quarter of fp32's weight bytes (counted
    once: the fp32 target on the kernels holds them twice, its weights and their panels), and
    agrees with fp32 on every teacher-forced position (KL ~1e-10); w4a16 (bf16-rounded inputs)
    does not (the broken variant of "the same weights": top-1 below 1). Every matrix's weight
    is fp32's bit for bit (the arithmetic is not: that is what the agreement measures)."""
    from specdecode.agreement import precision_agreement
    from specdecode.models.linears import PanelLinear, float_weight

    ck = apply_precision(smollm.model, "checkpoint")
    kinds = [m.panels.kind for m in ck.modules() if isinstance(m, PanelLinear)]
    assert kinds.count(kernels.KIND_I4) == 4 * smollm.model.cfg.num_layers
    assert kinds.count(kernels.KIND_I8G) == 1
    fp32_bytes = 4 * sum(p.numel() for p in smollm.model.parameters())  # a tied table once
    assert ck.weight_bytes() < fp32_bytes / 4
    pairs = [(getattr(a, n), getattr(b, n)) for a, b in zip(ck.layers, smollm.model.layers,
                                                           strict=True)
             for n in ("qkv", "o", "gate_up", "down")] + [(ck.lm_head, smollm.model.lm_head)]
    assert all(torch.equal(float_weight(mine)[0], float_weight(ref)[0]) for mine, ref in pairs)
    got = {a.precision: a for a in precision_agreement(smollm.model, smollm.tokenizer,
                                                       ("checkpoint", "w4a16"))}
    assert got["checkpoint"].top1 == 1.0 and got["checkpoint"].mean_kl < 1e-8, got
    assert got["w4a16"].top1 < 1.0, got
