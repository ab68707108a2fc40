"""K-quant checkpoints (issue #44), on a tiny random Qwen2 stored as the Qwen2.5-Coder pair's
GGUFs are (tests/kquant_model.py: Q4_K, Q6_K, Q5_0, Q8_0, biases, an untied head):

- its K-quant codes decode as ggml specifies (an independent decoder, bit for bit);
- the native loader reads the blocks as llama.cpp does: the same greedy tokens and logits within
  the rounding of llama.cpp's 8-bit activations, and a broken block decoding is caught;
- the llama.cpp backend is batch-invariant on K-quant blocks (ggml's tiled K-quant GEMM, taken at
  8 or more rows, is kept off: models.llamacpp.TILED_ENV), so greedy speculation at k = 8 is
  token-identical to plain decoding, and a process where the tiled kernel is on fails the
  load-time check;
- a tensor type the native runner cannot read is one error naming the tensor, its type, the
  types that work and the backend that runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specdecode.errors import SpecDecodeError
from tests.identity import assert_identical
from tests.kquant_model import decode_q4_k, decode_q6_k, write_tiny_qwen2_kquant

PROMPT = [5, 70, 300, 8, 5, 70, 3, 9, 100, 200, 11, 12]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_kquant(tmp_path_factory.mktemp("kq") / "tiny-kquant.gguf")


def _need_llamacpp() -> None:
    if os.environ.get("SPECDECODE_REQUIRE_LLAMACPP") != "1":
        pytest.importorskip("llama_cpp")


def _decode(target: Any, drafter: Any, k: int) -> Any:
    """PROMPT decoded greedily for 48 tokens on `target` (drafter None, k 0: plain)."""
    from specdecode.engine import Generation
    from specdecode.sampling import SamplingParams

    gen = Generation(target, None, PROMPT, SamplingParams(max_tokens=48), drafter, k)
    for _ in gen.run():
        pass
    return gen


def test_the_codes_decode_as_ggml_specifies(gguf: Path) -> None:
    """gguf-py's de-quantization (what the native loader uses) against an independent decoder
    written from ggml's block layouts; the broken decoder (scale and min bits swapped in the
    upper sub-blocks) differs, so the comparison can fail."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    kinds = {"Q4_K": (144, decode_q4_k), "Q6_K": (210, decode_q6_k)}
    seen = set()
    for t in GGUFReader(str(gguf)).tensors:
        if t.tensor_type.name not in kinds:
            continue
        size, decode = kinds[t.tensor_type.name]
        raw = np.asarray(t.data).reshape(-1, size)
        ref = np.asarray(dequantize(t.data, t.tensor_type)).reshape(-1, 256)
        assert np.array_equal(decode(raw), ref), t.name
        if t.tensor_type.name == "Q4_K":
            assert not np.array_equal(decode_q4_k(raw, broken=True), ref)
        seen.add(t.tensor_type.name)
    assert seen == set(kinds)


def _config(folder: Path) -> Any:
    from specdecode.models.config import config_from_hf, read_hf_config

    return config_from_hf(read_hf_config(folder))


def _native_logits(path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The native runner's fp32 logits of PROMPT, converted into `cache` (no load-time checks:
    only the weights are compared here)."""
    from specdecode.models.loading import converted_folder, load_native

    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    folder = converted_folder(path)
    model = load_native(folder, _config(folder))
    with torch.inference_mode():
        return model(torch.tensor([PROMPT]), model.new_cache(1, 32)).clone()


def _agreement(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |difference| over the reference's logit spread, share of equal greedy tokens)."""
    rel = float((ours - ref).abs().max() / ref.std())
    same = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    return rel, same


def test_the_native_loader_reads_kquant_blocks_as_llamacpp_does(
        gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured: max difference 0.09 of the logits' spread (llama.cpp rounds activations to 8
    bits for K-quant products), every greedy token the same; a Q4_K decoding that reads the
    upper sub-blocks' scale and min from swapped bits: 5.3 of the spread, 1 token in 12."""
    _need_llamacpp()
    import gguf.quants as gq
    from gguf import GGMLQuantizationType

    from specdecode.models.llamacpp import load_llamacpp
    from specdecode.models.loading import converted_folder

    ours = _native_logits(gguf, tmp_path / "a", monkeypatch)
    ref_model = load_llamacpp(gguf, _config(converted_folder(gguf)), check=False)
    with torch.inference_mode():
        ref = ref_model(torch.tensor([PROMPT]), ref_model.new_cache(1, 32)).clone()
    ref_model.close()
    rel, same = _agreement(ours, ref)
    assert rel < 0.2 and same == 1.0, (rel, same)

    real = gq.dequantize

    def broken(data: Any, qtype: Any) -> Any:
        if qtype != GGMLQuantizationType.Q4_K:
            return real(data, qtype)
        rows = np.asarray(data)
        return decode_q4_k(rows.reshape(-1, 144), broken=True).reshape(rows.shape[0], -1)

    monkeypatch.setattr(gq, "dequantize", broken)
    rel, same = _agreement(_native_logits(gguf, tmp_path / "b", monkeypatch), ref)
    assert rel > 1.0 and same < 0.5, (rel, same)


def test_llamacpp_speculation_on_kquant_blocks_is_token_identical(gguf: Path) -> None:
    """k = 8 scores 9 positions a call: the width where ggml's tiled K-quant GEMM would take
    over from the vector-dot kernels of a plain step."""
    _need_llamacpp()
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.drafters.ngram import NgramDrafter
    from specdecode.models.backends import load_model

    target = load_model(str(gguf), backend="llama.cpp").model
    assert target.invariance is not None and target.invariance.exact, target.invariance
    draft = load_model(str(gguf), backend="llama.cpp").model

    plain = _decode(target, None, 0).output
    assert_identical([_decode(target, DraftModelDrafter(draft), 8),
                      _decode(target, NgramDrafter(4, 1), 8)],
                     [plain, plain], "K-quant blocks on llama.cpp, k = 8")


_PROBE = """
import json, sys
from pathlib import Path
from specdecode.models.backends import load_model
m = load_model(sys.argv[1], backend="llama.cpp").model
print(json.dumps({"exact": m.invariance.exact, "widths": m.invariance.widths}))
"""


def _invariance_in_child(gguf: Path, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf)], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_tiled_kquant_kernel_is_what_the_check_catches(gguf: Path) -> None:
    """Broken variant: a process whose environment turns ggml's tiled K-quant GEMM on fails
    the load-time check at width 8+ (so speculation is refused there); the backend's default
    passes it."""
    _need_llamacpp()
    from specdecode.models.llamacpp import TILED_ENV

    on = _invariance_in_child(gguf, {TILED_ENV: "1"})
    assert not on["exact"] and on["widths"] > 0, on
    default = {k: v for k, v in os.environ.items() if k != TILED_ENV}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf)], cwd=ROOT, env=default,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["exact"]


def test_a_type_the_native_runner_cannot_read_is_named(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode.models.backends import load_model

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    path = write_tiny_qwen2_kquant(tmp_path / "i8-head.gguf", head_kind="I8")
    with pytest.raises(SpecDecodeError) as err:
        load_model(str(path), precision="fp32", backend="native")
    message = str(err.value)
    assert "tensor 'output.weight' is stored as I8" in message
    assert "Q4_K" in message and "Q6_K" in message and "--backend llama.cpp" in message
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing half-converted


def test_a_draft_model_with_a_pruned_head_drafts_inside_it_and_changes_nothing(
        gguf: Path) -> None:
    """`--draft-vocab N` on a K-quant draft (issue #44's cheap draft): the draft's logits of the
    lowest N ids are its full head's bit for bit (the head's own panels, cut), -inf above, so it
    only drafts tokens below N, and greedy speculation stays token-identical to plain. Broken
    variant: the same rows scattered one id off, which the comparison sees."""
    from specdecode.drafters import draft_head
    from specdecode.drafters.base import DraftRequest
    from specdecode.drafters.distilled import SubsetHead
    from specdecode.drafters.options import DrafterOptions
    from specdecode.drafters.registry import drafter_factory
    from specdecode.models import kernels
    from specdecode.models.backends import load_model
    from specdecode.sampling import SamplingParams

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.build_error()}")
    n = 2 * kernels.PANEL * 4  # of 512 ids
    target = load_model(str(gguf), precision="checkpoint-a8").model
    full = load_model(str(gguf), precision="checkpoint-a8", as_draft=True).model
    pruned = draft_head.with_draft_head(full, n)
    tokens = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = full(tokens, full.new_cache(1, 32))[0]
        got = pruned(tokens, pruned.new_cache(1, 32))[0]
    assert torch.equal(got[:, :n], want[:, :n]) and torch.isneginf(got[:, n:]).all()
    rows = draft_head.first_rows(full.lm_head.exact_panels(), n)
    bad = draft_head.WithHead(full, SubsetHead(None, torch.arange(1, n + 1), 512, panels=rows))
    with torch.inference_mode():
        wrong = bad(tokens, bad.new_cache(1, 32))[0]
    assert not torch.equal(wrong[:, :n], want[:, :n])

    make = drafter_factory(DrafterOptions("draft-model", draft_model=str(gguf), draft_vocab=n),
                           target)
    assert make is not None
    drafter = make()
    with torch.inference_mode():  # as the engine proposes
        proposed = drafter.propose(DraftRequest(tokens[0], 6, SamplingParams(), len(PROMPT)))
    assert len(proposed.tokens) == 6 and int(proposed.tokens.max()) < n

    plain = _decode(target, None, 0).output
    assert_identical([_decode(target, make(), 4)], [plain], f"draft_vocab {n} on a K-quant draft")
