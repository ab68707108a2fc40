"""Every kernel path (models.kernels PATHS) computes the same bits as the portable scalar build,
for every weight kind, for attention and for a whole block; the integer-activation (a8) kinds
compute what they claim; a path is chosen, forced and refused as documented; and the trial that
admits a path catches the two ways a path could break row-invariance (deliberately broken
builds: a row-coupled activation scale, a width-dependent blocking).

A path's tests skip on a CPU without its instructions, naming them; the scalar and AVX2 paths
run wherever the CPU does.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.models.kernels import Panels

pytestmark = pytest.mark.skipif(kernels._compiler() is None, reason="no C compiler")

N, K = 40, 512  # two K-quant super-blocks


def _lib(name: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    path = kernels.path_by_name(name)
    why = kernels.cpu_runs(path)
    if why is not None:
        pytest.skip(f"the {name} path cannot run here: {why}")
    return kernels.open_library(kernels.compile_path(path, extra=extra))


@pytest.fixture(scope="module")
def scalar() -> ctypes.CDLL:
    return _lib("scalar")


def _cases() -> dict[str, Panels]:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    c4 = torch.randint(0, 16, (N, K), generator=gen)
    c8 = torch.randint(-127, 128, (N, K), generator=gen)
    c6 = torch.randint(0, 64, (N, K), generator=gen)
    s32, z32 = torch.rand(N, K // 32, generator=gen) * 0.1, torch.randn(N, K // 32, generator=gen)
    s16, z16 = torch.rand(N, K // 16, generator=gen) * 0.1, torch.randn(N, K // 16, generator=gen)
    S = K // 256
    kd = (torch.rand(N, S, generator=gen) * 0.01).half().float()
    kmin = (torch.rand(N, S, generator=gen) * 0.01).half().float()
    ksc = torch.randint(0, 64, (N, S, 8), generator=gen).to(torch.int8)
    km = torch.randint(0, 64, (N, S, 8), generator=gen).to(torch.int8)
    k6 = torch.randint(-128, 128, (N, S, 16), generator=gen).to(torch.int8)
    q4k = kernels.KScales(kd, kmin, ksc, km)
    q6k = kernels.KScales(kd, None, k6, None)
    s4, z4 = q4k.per_group()
    s6, _ = q6k.per_group()
    return {
        "q4-kscales": kernels.pack_q4(c4, s4, z4, bias, kscales=q4k),
        "q5-kscales": kernels.pack_q5(c6 >> 1, s4, z4, kscales=q4k),
        "q8-kscales-g16": kernels.pack_q8(c6, s6, None, offset=32, group=16, kscales=q6k),
        "q6-kscales-g16": kernels.pack_q6(c6, s6, None, offset=32, group=16, kscales=q6k),
        "q6-zero": kernels.pack_q6(c6, s32, z32, bias),
        "f32": kernels.pack_float(w, torch.float32, bias),
        "bf16": kernels.pack_float(w, torch.bfloat16, bias, round_x=True),
        "i8": kernels.pack_int8(c8, s32[:, 0], bias),
        "i4": kernels.pack_int4(c4, s32, z32, bias, round_x=False),
        "i4-g16": kernels.pack_int4(c4, s16, z16, group=16, round_x=False),
        "i8g": kernels.pack_int8_groups(c8, s32, bias=bias),
        "i8g-g16-zero": kernels.pack_int8_groups(c6 - 32, s16, z16, group=16),
        "q4": kernels.pack_q4(c4, s32, None, bias, offset=8),
        "q4-zero": kernels.pack_q4(c4, s32, z32),
        "q4-g16": kernels.pack_q4(c4, s16, z16, group=16),
        "q8": kernels.pack_q8(c8 + 128, s32, None, bias, offset=128),
        "q8-g16": kernels.pack_q8(c6, s16, None, offset=32, group=16),
        "q8-zero": kernels.pack_q8(c6, s32, z32),
        "q5": kernels.pack_q5(c6 >> 1, s32, None, bias, offset=16),
        "q5-zero-g16": kernels.pack_q5(c6 >> 1, s16, z16, group=16),
    }


CASES = _cases()
X = torch.randn(70, K, generator=torch.Generator().manual_seed(4)) * 2


def _matmul(lib: ctypes.CDLL, x: torch.Tensor, p: Panels) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape[0], p.n)
    mat = p.struct()
    assert lib.sd_matmul(x.data_ptr(), x.shape[0], ctypes.byref(mat), y.data_ptr()) == 0
    return y


@pytest.mark.parametrize("name", [p.name for p in kernels.PATHS])
def test_every_path_computes_the_scalar_builds_bits(name: str, scalar: ctypes.CDLL) -> None:
    lib = _lib(name)
    for case, panels in CASES.items():
        ref = _matmul(scalar, X, panels)
        for rows in (1, 2, 3, 5, 9, 13, 70):
            got = _matmul(lib, X[:rows], panels)
            assert torch.equal(got, ref[:rows]), (name, case, rows)
    q = torch.randn(9, 6, 16, generator=torch.Generator().manual_seed(5))
    kc, vc = torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    rows = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 1])
    mask = (torch.rand(9, 30) > 0.3).to(torch.uint8)
    mask[:, 0] = 1
    spec = kernels.attn_spec(kc, vc, rows, mask, 30)
    outs = []
    for lib_ in (scalar, lib):
        out = torch.empty(9, 6, 16)
        assert lib_.sd_attention(q.data_ptr(), 6 * 16, 9, 6, 16, ctypes.byref(spec),
                                 out.data_ptr()) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), name
    for a8 in (False, True):
        blk = _block_weights(a8)
        assert torch.equal(_run_block(scalar, blk), _run_block(lib, blk)), (name, a8)


def _block_weights(a8: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(6 + a8)
    H, NH, KVH, D, inter = 64, 4, 2, 16, 96

    def mat(n: int, k: int) -> Panels:
        if a8:
            codes = torch.randint(0, 16, (n, k), generator=gen)
            return kernels.pack_q4(codes, torch.rand(n, k // 32, generator=gen) * 0.05, None,
                                   offset=8)
        return kernels.pack_float(torch.randn(n, k, generator=gen) * 0.1, torch.float32)

    mats = {"qkv": mat((NH + 2 * KVH) * D, H), "o": mat(H, NH * D),
            "gate_up": mat(2 * inter, H), "down": mat(H, inter)}
    norms = (torch.rand(H, generator=gen) + 0.5, torch.rand(H, generator=gen) + 0.5)
    w = kernels.SdBlockW(H, NH, KVH, D, inter, 1e-5, norms[0].data_ptr(), norms[1].data_ptr(),
                         *(m.struct() for m in mats.values()))
    return {"w": w, "keep": (mats, norms), "x": torch.randn(5, H, generator=gen),
            "shape": (H, KVH, D)}


def _run_block(lib: ctypes.CDLL, blk: dict[str, Any]) -> torch.Tensor:
    _, KVH, D = blk["shape"]
    x = blk["x"].clone()
    kc, vc = torch.zeros(1, KVH, 8, D), torch.zeros(1, KVH, 8, D)
    rows, slots = torch.zeros(5, dtype=torch.int64), torch.arange(5, dtype=torch.int64)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.uint8))
    spec = kernels.attn_spec(kc, vc, rows, mask, 5)
    cos, sin = torch.ones(5, D), torch.zeros(5, D)
    assert lib.sd_block(x.data_ptr(), 5, ctypes.byref(blk["w"]), cos.data_ptr(), sin.data_ptr(),
                        slots.data_ptr(), ctypes.byref(spec)) == 0
    return x


def _a8_reference(x: torch.Tensor, p: Panels) -> torch.Tensor:
    """What the a8 kinds claim: each row's inputs rounded to int8 per block of 32, or of 256 where
    the scales are a K-quant's (in fp32 as the kernels do: d = max|x| / 127, codes
    x * (127 / max|x|) rounded half to even), then the exact product with (code - offset) * scale
    (+ zero), in float64."""
    xb = x.float().view(x.shape[0], -1, 256 if p.kblock else 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    q = torch.where(amax > 0, torch.round(xb * (127 / amax)), torch.zeros_like(xb))
    xq = (q.double() * d.double()).view_as(x)
    out = xq @ kernels.weight_of(p).double().T
    return out if p.bias is None else out + p.bias.double()


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("q")])
def test_a8_products_are_what_they_claim(case: str) -> None:
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.build_error()}")
    p = CASES[case]
    got = kernels.matmul(X, p).double()
    ref = _a8_reference(X, p)
    scale = ref.abs().max()
    assert float((got - ref).abs().max()) < 2e-5 * float(scale), case


def test_a8_unlike_the_float_kinds_rounds_the_activations() -> None:
    """The a8 product is not the float product of the same weights (a check that the integer
    path really runs): their difference is the activations' rounding."""
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.build_error()}")
    gen = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 16, (N, K), generator=gen)
    s, z = torch.rand(N, K // 32, generator=gen) * 0.1, torch.randn(N, K // 32, generator=gen)
    a8 = kernels.matmul(X[:4], kernels.pack_q4(codes, s, z))
    f32 = kernels.matmul(X[:4], kernels.pack_int4(codes, s, z, round_x=False))
    assert not torch.equal(a8, f32)
    torch.testing.assert_close(a8, f32, rtol=0.05, atol=0.05 * float(f32.abs().max()))


@pytest.mark.parametrize("broken", ["-DSD_BROKEN_ROW_COUPLED", "-DSD_BROKEN_WIDTH"])
def test_the_trial_refuses_a_build_that_is_not_row_invariant(broken: str) -> None:
    """The trial a path must pass before use (kernels.trial, run in a child at first use)
    catches a row-coupled activation scale and a width-dependent blocking, built on purpose;
    the same trial passes the real build of the same path."""
    name = kernels.path_name() or "scalar"
    good = _lib(name)
    assert kernels.trial(good) is None
    failure = kernels.trial(_lib(name, (broken,)))
    assert failure is not None and "differ" in failure, failure


def test_a_forced_path_is_used_or_refused_with_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_KERNEL_PATH", "avx1024")
    with pytest.raises(SpecDecodeError, match=r"avx1024: no such kernel path .*known: "
                                              r"avx512vnni, avx512, avx2, scalar"):
        kernels._load()
    monkeypatch.setenv("SPECDECODE_KERNEL_PATH", "avx512vnni")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(SpecDecodeError, match="avx512vnni path cannot run here: this CPU "
                                              "lacks avx512f, avx512bw"):
        kernels._load()
    monkeypatch.setenv("SPECDECODE_KERNEL_PATH", "scalar")
    loaded = kernels._load()
    assert loaded.path == "scalar" and loaded.lib is not None and loaded.lib.sd_isa() == 0


def test_a_path_refused_by_its_trial_falls_to_the_next_and_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("SPECDECODE_KERNEL_PATH", raising=False)
    candidates = kernels._candidates()
    if len(candidates) < 2:
        pytest.skip("this CPU runs one kernel path only")
    first = candidates[0].name
    real: Callable[[kernels.KernelPath, Path], str | None] = kernels.tried
    monkeypatch.setattr(kernels, "tried", lambda path, target: (
        "killed by SIGILL" if path.name == first else real(path, target)))
    with caplog.at_level(logging.WARNING, logger="specdecode.models.kernels"):
        loaded = kernels._load()
    assert loaded.path == candidates[1].name
    assert loaded.refused == (f"{first}: killed by SIGILL",)
    assert f"the {first} path is refused: killed by SIGILL" in caplog.text


def test_a_damaged_cached_library_is_built_again(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECDECODE_KERNEL_PATH", "scalar")
    target = kernels.compile_path(kernels.path_by_name("scalar"))
    target.write_bytes(b"not a shared library")  # as a half-written file would be
    loaded = kernels._load()
    assert loaded.lib is not None and loaded.path == "scalar"
    assert target.read_bytes()[:4] == b"\x7fELF"


def test_the_cache_folder_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECDECODE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels._cache_dir() == tmp_path / "specdecode" / "kernels"
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "own"))
    assert kernels._cache_dir() == tmp_path / "own" / "kernels"


def test_required_kernels_make_a_failure_an_error(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails every build
    monkeypatch.setattr(kernels, "_compiler", lambda: "/bin/false")
    monkeypatch.delenv("SPECDECODE_KERNEL_PATH", raising=False)
    kernels._loaded.cache_clear()
    try:
        monkeypatch.delenv("SPECDECODE_REQUIRE_KERNELS", raising=False)
        assert kernels.library() is None and "failed to build" in (kernels.build_error() or "")
        kernels._loaded.cache_clear()
        monkeypatch.setenv("SPECDECODE_REQUIRE_KERNELS", "1")
        with pytest.raises(SpecDecodeError, match="SPECDECODE_REQUIRE_KERNELS=1 and the kernels "
                                                  "are unavailable"):
            kernels.library()
    finally:
        kernels._loaded.cache_clear()


def test_the_no_kernels_switch_makes_auto_fp32_and_says_so() -> None:
    """SPECDECODE_NO_KERNELS=1 (in a fresh process, as a user sets it): precision auto becomes
    the reference, with one warning naming the switch; with SPECDECODE_REQUIRE_KERNELS=1 beside
    it, one clear error instead. Broken variant: the switch ignored (auto stays checkpoint)."""
    code = ("from specdecode.models.precision import native_default; "
            "print(native_default())")
    env = {k: v for k, v in os.environ.items() if k != "SPECDECODE_REQUIRE_KERNELS"}
    off = subprocess.run([sys.executable, "-c", code], env={**env, "SPECDECODE_NO_KERNELS": "1"},
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and off.stdout.split() == ["fp32"], off.stderr
    assert "SPECDECODE_NO_KERNELS=1 is set" in off.stderr and "auto is fp32" in off.stderr
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=600)
    assert on.returncode == 0 and on.stdout.split() == ["checkpoint"], on.stderr
    required = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, "SPECDECODE_NO_KERNELS": "1",
                                   "SPECDECODE_REQUIRE_KERNELS": "1"}, timeout=120)
    assert required.returncode != 0
    assert "SPECDECODE_REQUIRE_KERNELS=1 and the kernels are unavailable: SPECDECODE_NO_KERNELS" \
        in required.stderr


def test_kernels_c_and_kernels_py_agree_on_their_constants(
        monkeypatch: pytest.MonkeyPatch, scalar: ctypes.CDLL) -> None:
    target = kernels.compile_path(kernels.path_by_name("scalar"))
    kernels.open_library(target)  # agrees
    monkeypatch.setattr(kernels, "MAX_HEAD_DIM", 256)
    with pytest.raises(SpecDecodeError, match=r"constants .* differ"):
        kernels.open_library(target)


def test_q6_panels_compute_the_byte_panels_bits_from_fewer_bytes() -> None:
    """Q6_K's codes in 4-bit panels plus their high bits (pack_q6) give the products of the same
    codes as bytes (pack_q8) bit for bit, at every width, from 0.75 bytes a weight instead of
    1; the broken variant (two vectors' high bits exchanged) is caught."""
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.build_error()}")
    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 64, (N, K), generator=gen)
    s16 = torch.rand(N, K // 16, generator=gen) * 0.1
    q6 = kernels.pack_q6(codes, s16, None, offset=32, group=16)
    q8 = kernels.pack_q8(codes, s16, None, offset=32, group=16)
    assert torch.equal(kernels.codes_of(q6), codes.to(torch.uint8))
    padded = -(-N // kernels.PANEL) * kernels.PANEL  # columns in whole panels
    assert q6.scale is not None
    assert q6.nbytes - q6.scale.numel() * 4 == padded * K * 3 // 4 < q8.w.numel() == padded * K
    for rows in (1, 4, 5, 9, 16, 70):  # from 16 rows the panels are decoded to bytes once
        assert torch.equal(kernels.matmul(X[:rows], q6), kernels.matmul(X[:rows], q8)), rows
    assert q6.hbits is not None
    h = q6.hbits
    swapped = dataclasses.replace(q6, hbits=(h & 0xC3) | ((h & 0x0C) << 2) | ((h & 0x30) >> 2))
    assert not torch.equal(kernels.matmul(X[:4], swapped), kernels.matmul(X[:4], q8))
    assert not torch.equal(kernels.matmul(X[:16], swapped), kernels.matmul(X[:16], q8))


def test_q5_high_bits_round_trip_and_a_misplaced_bit_is_caught() -> None:
    """pack_q5's fifth bits (16 bytes an octet, kernels.c's shift-friendly order) give back the
    codes and the byte panels' products at every width; a layout with the two lanes' bits
    exchanged is caught."""
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.build_error()}")
    gen = torch.Generator().manual_seed(12)
    codes = torch.randint(0, 32, (N, K), generator=gen)
    s32 = torch.rand(N, K // 32, generator=gen) * 0.1
    q5 = kernels.pack_q5(codes, s32, None, offset=16)
    q8 = kernels.pack_q8(codes, s32, None, offset=16)
    assert torch.equal(kernels.codes_of(q5), codes.to(torch.uint8))
    for rows in (1, 2, 4, 5, 9, 16, 70):
        assert torch.equal(kernels.matmul(X[:rows], q5), kernels.matmul(X[:rows], q8)), rows
    assert q5.hbits is not None
    h = q5.hbits
    swapped = dataclasses.replace(q5, hbits=((h & 0x55) << 1) | ((h & 0xAA) >> 1))
    assert not torch.equal(kernels.matmul(X[:1], swapped), kernels.matmul(X[:1], q8))


def _largest_sums() -> dict[str, Panels]:
    """Each nibble kind's largest code everywhere, for activations that all round to +-127: the
    largest integer sums a group can have (the AVX2 build adds 4-bit products in int16 across
    a whole group, Q5's and Q6's per octet)."""
    s32, s16 = torch.full((N, K // 32), 0.01), torch.full((N, K // 16), 0.01)
    full = torch.full((N, K), 1)
    # K-quant scales at their extremes: a super-block's int32 sum is then at its largest
    S, d = K // 256, torch.full((N, K // 256), 2.0 ** -7)
    q4k = kernels.KScales(d, d, torch.full((N, S, 8), 63, dtype=torch.int8),
                          torch.full((N, S, 8), 63, dtype=torch.int8))
    q6k = kernels.KScales(d, None, torch.full((N, S, 16), -128, dtype=torch.int8), None)
    s4, z4 = q4k.per_group()
    s6, _ = q6k.per_group()
    return {"q4": kernels.pack_q4(full * 15, s32, None, offset=8),
            "q4-g16": kernels.pack_q4(full * 15, s16, None, offset=8, group=16),
            "q5": kernels.pack_q5(full * 31, s32, None, offset=16),
            "q6-g16": kernels.pack_q6(full * 63, s16, None, offset=32, group=16),
            "q4-kscales": kernels.pack_q4(full * 15, s4, z4, kscales=q4k),
            "q5-kscales": kernels.pack_q5(full * 31, s4, z4, kscales=q4k),
            "q6-kscales-g16": kernels.pack_q6(full * 63, s6, None, offset=32, group=16,
                                              kscales=q6k),
            "q8-kscales-g16": kernels.pack_q8(full * 63, s6, None, offset=32, group=16,
                                              kscales=q6k)}


X_EXTREME = torch.cat([torch.ones(3, K), -torch.ones(3, K), X[:3]])


@pytest.mark.parametrize("name", [p.name for p in kernels.PATHS])
def test_the_largest_integer_sums_are_exact_on_every_path(name: str,
                                                          scalar: ctypes.CDLL) -> None:
    lib = _lib(name)
    for case, panels in _largest_sums().items():
        ref = _matmul(scalar, X_EXTREME, panels)
        assert torch.equal(ref[0], -ref[3]) and float(ref[0].abs().min()) > 0, case
        want = _a8_reference(X_EXTREME, panels)  # a wrapped sum would be far from it
        assert float((ref.double() - want).abs().max()) < 2e-5 * float(want.abs().max()), case
        for rows in (1, 4, 9):
            assert torch.equal(_matmul(lib, X_EXTREME[:rows], panels), ref[:rows]), (case, rows)


def test_int16_sums_wider_than_their_bound_are_caught(scalar: ctypes.CDLL) -> None:
    """The broken variant keeps Q5's and Q6's sums in int16 across a group as Q4's are kept;
    the largest sums then wrap, and the comparison above would see it (Q4's stay exact)."""
    broken, scalar_lib = _lib("avx2", ("-DSD_BROKEN_INT16",)), scalar
    cases = _largest_sums()
    for case in ("q5", "q6-g16", "q8-kscales-g16"):
        assert not torch.equal(_matmul(broken, X_EXTREME, cases[case]),
                               _matmul(scalar_lib, X_EXTREME, cases[case])), case
    assert torch.equal(_matmul(broken, X_EXTREME, cases["q4"]),
                       _matmul(scalar_lib, X_EXTREME, cases["q4"]))


def test_k_quant_byte_codes_wider_than_six_bits_are_refused() -> None:
    """kernels.c keeps an octet of byte codes beside K-quant scales in int16, which holds
    6-bit codes only: pack_q8 refuses wider ones with one clear error."""
    codes = torch.full((N, K), 64)
    S = K // 256
    k = kernels.KScales(torch.ones(N, S), None, torch.ones(N, S, 16, dtype=torch.int8), None)
    scale, _ = k.per_group()
    with pytest.raises(ValueError, match=r"0\.\.63"):
        kernels.pack_q8(codes, scale, None, offset=32, group=16, kscales=k)
