"""The `generate --k auto` calibration is measured once per model, precision, backend and machine
and then read from the cache (calibration_cache); a change of any of these measures again."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode import calibration_cache
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty $SPECDECODE_CACHE for the test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(folder))
    return folder


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every calibration actually run: (batches..., kmax)."""
    calls: list[tuple[int, ...]] = []
    real = calibration_cache.calibrated_costs

    def counting(model: Any, batches: list[int], kmax: int) -> dict[tuple[int, int], float]:
        calls.append((*batches, kmax))
        return real(model, batches, kmax)

    monkeypatch.setattr(calibration_cache, "calibrated_costs", counting)
    return calls


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("calib") / "tiny")


@pytest.fixture(scope="module")
def tiny(ckpt: Path) -> LoadedModel:
    return load_model(str(ckpt))


def test_the_second_run_reads_the_cache(cache: Path, measured: list[tuple[int, ...]],
                                        tiny: LoadedModel) -> None:
    first = calibration_cache.cached_costs(tiny, [1], 3)
    assert measured == [(1, 3)]
    files = list((cache / "calibration").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text(encoding="utf-8"))
    assert stored["key"]["precision"] == "fp32" and stored["key"]["backend"] == "native"
    assert stored["key"]["machine"]["torch_threads"] == 1
    second = calibration_cache.cached_costs(tiny, [1], 3)
    assert measured == [(1, 3)]  # not measured again
    assert second == first and sorted(first) == [
        (1, 1), (1, 2), (1, 3), (1, 4)]


@pytest.mark.parametrize("change", ["precision", "backend", "machine", "weights", "kmax"])
def test_a_changed_key_measures_again(cache: Path, measured: list[tuple[int, ...]],
                                      tiny: LoadedModel, ckpt: Path, change: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calibration_cache.cached_costs(tiny, [1], 3)
    kmax = 3
    if change == "precision":
        monkeypatch.setattr(tiny, "precision", "bf16")
    elif change == "backend":
        monkeypatch.setattr(LoadedModel, "backend", property(lambda self: "transformers"))
    elif change == "machine":
        torch.set_num_threads(2)  # (restored by one_thread)
    elif change == "weights":
        weights = ckpt / "model.safetensors"
        stat = weights.stat()  # the same path, rewritten: a new modification time
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    else:
        kmax = 4
    calibration_cache.cached_costs(tiny, [1], kmax)
    assert measured == [(1, 3), (1, kmax)]
    assert len(list((cache / "calibration").glob("*.json"))) == 2


def test_a_corrupt_or_foreign_file_is_measured_over(cache: Path, measured: list[tuple[int, ...]],
                                                    tiny: LoadedModel) -> None:
    key = calibration_cache.cache_key(tiny, [1], 2)
    path = calibration_cache.cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text("{not json", encoding="utf-8")
    calibration_cache.cached_costs(tiny, [1], 2)
    other = dict(key, precision="int8")
    path.write_text(json.dumps({"key": other, "target_s": [[1, 1, 1.0]]}), encoding="utf-8")
    calibration_cache.cached_costs(tiny, [1], 2)
    assert measured == [(1, 2), (1, 2)]
    assert calibration_cache.read_costs(path, key) is not None  # rewritten under its own key


def test_generate_k_auto_twice_calibrates_once(cache: Path, measured: list[tuple[int, ...]],
                                               ckpt: Path) -> None:
    argv = ["generate", "t5 t6 t7 t5 t6", "--model", str(ckpt), "--max-tokens", "6",
            "--drafter", "ngram", "--k", "auto", "--kmax", "3", "--json"]
    outputs = []
    for _ in range(2):
        code, out, err = run_cli(argv)
        assert code == 0, err
        outputs.append(json.loads(out)["token_ids"])
    assert measured == [(1, 3)]
    assert outputs[0] == outputs[1]
    code, _, err = run_cli([*argv[:-1], "--precision", "bf16", "--json"])
    assert code == 0, err
    assert measured == [(1, 3), (1, 3)]  # another precision: measured for it
