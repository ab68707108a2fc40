"""The load-time invariance check, remembered (models.invariance_cache): a second identical load
reads the verdict instead of measuring it; a change to the weights, the thread count, the
precision or the kernels measures again; a corrupt record or an inexact verdict is never
trusted; SPECDECODE_INVARIANCE_CACHE=0 always measures. The broken variant (a key blind to the
weights) is shown to fail the weights test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specdecode.models import invariance_cache, kernels
from specdecode.models.backends import load_model
from specdecode.models.invariance import Invariance
from tests.conftest import make_checkpoint

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"kernels unavailable: {kernels.build_error()}")


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(invariance_cache.ENV, raising=False)
    return make_checkpoint(tmp_path / "m")


def _load(folder: Path, precision: str = "checkpoint") -> Invariance:
    inv = load_model(str(folder), precision=precision).model.invariance
    assert inv is not None and inv.exact, inv
    return inv


def _touch(folder: Path) -> None:
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_second_load_of_the_same_files_reads_the_verdict(folder: Path) -> None:
    first = _load(folder)
    assert not first.cached
    second = _load(folder)
    assert second.cached and "(cached)" in second.describe()
    assert (second.widths, second.rows, second.chunks, second.width) == \
        (first.widths, first.rows, first.chunks, first.width)


def test_changed_weights_threads_precision_or_kernels_measure_again(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _load(folder)
    assert _load(folder).cached
    _touch(folder)
    assert not _load(folder).cached  # the weights' file changed
    assert _load(folder).cached
    assert not _load(folder, "fp32").cached  # another precision
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert not _load(folder).cached
    finally:
        torch.set_num_threads(threads)
    model = load_model(str(folder), precision="checkpoint").model
    mine = invariance_cache.key(model, folder, 9)

    # another kernels library (another source, flags, compiler or CPU)
    monkeypatch.setattr(kernels, "library_name", lambda: "libspecdecode-avx2-0123456789abcdef.so")
    assert mine is not None and invariance_cache.key(model, folder, 9) != mine
    assert invariance_cache.key(model, folder, 17) != invariance_cache.key(model, folder, 9)


def test_a_key_blind_to_the_weights_would_trust_a_stale_verdict(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: without the weights in the key, a changed file reads the old verdict,
    which the weights test above would catch."""
    monkeypatch.setattr(invariance_cache, "weights_identity", lambda source: [])
    _load(folder)
    _touch(folder)
    assert _load(folder).cached  # stale: what the real key prevents


def test_corrupt_or_inexact_records_are_not_trusted(folder: Path) -> None:
    _load(folder)
    files = list((Path(os.environ["SPECDECODE_CACHE"]) / "invariance").glob("*.json"))
    assert len(files) == 1
    files[0].write_text("{not json", encoding="utf-8")
    assert not _load(folder).cached  # measured again, and stored again
    assert _load(folder).cached
    inexact = Invariance(0.5, 0.0, 0.0, cached_at=1.0)
    invariance_cache.write("k-inexact", inexact)
    assert invariance_cache.read("k-inexact") is None
    assert not (files[0].parent / "k-inexact.json").exists()


def test_the_switch_turns_the_memory_off(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _load(folder)
    monkeypatch.setenv(invariance_cache.ENV, "0")
    assert not _load(folder).cached
