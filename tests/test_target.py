"""The backend interface (models/target.py): every backend's model and cache declare the whole
protocol, and the engine drives each through it alone.

mypy checks the conformance statically (models/loading.py assigns every backend to the
protocols); these tests check it at run time, and that a backend the engine used to probe for
methods it lacked now runs: the transformers adapter under `--k auto` (its one-row cache had no
copy_row or view, and a batch-1 engine crashed on adopting it).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from specdecode.models.target import Cache, Target
from specdecode.sampling import SamplingParams
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint
from tests.identity import assert_identical


def members(protocol: type) -> set[str]:
    """The names a protocol declares (attributes, properties, methods)."""
    names = {n for n, _ in inspect.getmembers(protocol) if not n.startswith("_")}
    return names | set(protocol.__annotations__)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target") / "tiny")


@pytest.fixture(scope="module", params=["native", "transformers"])
def loaded(request: pytest.FixtureRequest, folder: Path) -> LoadedModel:
    return load_model(str(folder), backend=request.param)


def test_every_backend_declares_the_whole_interface(loaded: LoadedModel) -> None:
    model, cache = loaded.model, loaded.model.new_cache(1, 16)
    for name in members(Target):
        assert hasattr(model, name), f"{loaded.backend} target lacks {name}"
    for name in members(Cache):
        assert hasattr(cache, name), f"{loaded.backend} cache lacks {name}"
    assert callable(model) and isinstance(model.supports_trees, bool)
    assert model.invariance is None or isinstance(model.invariance.exact, bool)


def test_a_missing_member_is_found() -> None:
    """Broken variant: a cache without `view` fails the check above."""

    class NoView:
        def __getattr__(self, name: str) -> object:
            if name == "view":
                raise AttributeError(name)
            return None

    assert not all(hasattr(NoView(), name) for name in members(Cache))


def test_a_cache_copies_a_prefilled_row(loaded: LoadedModel) -> None:
    """copy_row and view, which batching needs, keep a row's logits on every backend."""
    model = loaded.model
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    src = model.new_cache(1, 16)
    with torch.inference_mode():
        model(ids[:, :4], src, logits_for="none")
    dst = model.new_cache(1, 16)
    dst.copy_row(0, src, 0, 4)  # outside inference mode, as BatchEngine adopts a row
    view = dst.view(0, 1)
    with torch.inference_mode():
        copied = model(ids[:, 4:], view)[0, -1]
        whole = model(ids, model.new_cache(1, 16))[0, -1]
    assert view.lengths == [5] and dst.lengths == [4]
    assert torch.allclose(copied, whole, atol=1e-3)


def test_speculation_under_the_controller_on_each_backend(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch-1 engine (what --k auto runs) with a prompt-lookup drafter: plain greedy's
    tokens on the native runner; the transformers adapter fails its invariance check (PyTorch's
    kernels), so it speculates only where SPECDECODE_ALLOW_INEXACT=1 lets it, and then runs."""
    from specdecode.drafters.registry import drafter_factory

    model, prompt = loaded.model, [5, 9, 14, 5, 9, 14, 5, 9]
    params = SamplingParams(max_tokens=12)
    plain = Generation(model, None, prompt, params)
    for _ in plain.run():
        pass
    monkeypatch.delenv("SPECDECODE_ALLOW_INEXACT", raising=False)
    assert model.invariance is not None  # every backend is measured at load
    if not model.invariance.exact:
        with pytest.raises(SpecDecodeError, match="needs a batch-invariant target"):
            drafter_factory("ngram", model)
        monkeypatch.setenv("SPECDECODE_ALLOW_INEXACT", "1")
    make = drafter_factory("ngram", model)
    assert make is not None
    gen = Generation(model, None, prompt, params, make(), 4)
    run_batch(BatchEngine(model, 1, gen.capacity), [gen])
    if model.invariance.exact:
        assert_identical([gen], [plain.output], loaded.backend)
    else:  # allowed inexact: it runs and drafts; its tokens are not promised
        assert len(gen.output) == len(plain.output) and gen.counters.drafted > 0


def test_generate_on_the_transformers_backend_under_k_auto(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`specdecode generate --backend transformers` with a drafter at the default --k auto:
    a traceback before the cache declared the interface."""
    monkeypatch.setenv("SPECDECODE_ALLOW_INEXACT", "1")  # PyTorch's kernels: not invariant
    code, out, err = run_cli(["generate", "t2 t3 t4", "--model", str(folder), "--backend",
                              "transformers", "--drafter", "ngram", "--max-tokens", "6",
                              "--json"])
    assert code == 0 and "Traceback" not in err, err
    assert '"k": "auto"' in out
