"""Every target that can speculate passes its invariance check or is refused (models.exactness),
SPECDECODE_ALLOW_INEXACT=1 the one way past it, and what runs says which: `generate --json`,
the bench report's summary and header, the server's /metrics.

The transformers adapter runs PyTorch's own kernels: not batch-invariant (a position's logits
move ~1e-6 with the call's width), so speculation on it is refused unless allowed. Before this
check it was never measured and speculated silently (the broken variant these tests catch is
that code path: a target with no measured invariance speculating)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.drafters.registry import drafter_factory
from specdecode.errors import SpecDecodeError
from specdecode.models import exactness
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("exactness") / "tiny")


@pytest.fixture(scope="module")
def adapter(folder: Path) -> LoadedModel:
    return load_model(str(folder), backend="transformers")


@pytest.fixture(scope="module")
def native(folder: Path) -> LoadedModel:
    return load_model(str(folder), backend="native")


def test_the_transformers_target_is_measured_at_load_and_refused(
        adapter: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(exactness.ALLOW_INEXACT, raising=False)
    measured = adapter.model.invariance
    assert measured is not None and not measured.exact, measured
    assert measured.widths > 0 and measured.rows is None  # one row: no batch shapes
    assert "PyTorch's own products" in measured.cause
    with pytest.raises(SpecDecodeError, match=r"this transformers fp32 target is not .*"
                       r"across draft widths.*SPECDECODE_ALLOW_INEXACT=1"):
        drafter_factory("ngram", adapter.model)
    assert drafter_factory("none", adapter.model) is None  # plain decoding is always allowed


@pytest.mark.parametrize("value", ["0", "", " 0 "])
def test_zero_or_unset_refuses(adapter: LoadedModel, monkeypatch: pytest.MonkeyPatch,
                               value: str) -> None:
    monkeypatch.setenv(exactness.ALLOW_INEXACT, value)
    with pytest.raises(SpecDecodeError, match="needs a batch-invariant target"):
        drafter_factory("ngram", adapter.model)


def test_one_allows_it_with_a_warning(adapter: LoadedModel, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(exactness.ALLOW_INEXACT, "1")
    assert drafter_factory("ngram", adapter.model) is not None
    err = capsys.readouterr().err
    assert "warning: this transformers fp32 target is NOT batch-invariant" in err
    assert "outputs may differ from plain decoding" in err
    assert adapter.exactness().startswith("inexact (allowed by SPECDECODE_ALLOW_INEXACT=1)")


@pytest.mark.parametrize("value", ["yes", "true", "2", "on"])
def test_any_other_value_is_an_error_naming_it(adapter: LoadedModel, native: LoadedModel,
                                               monkeypatch: pytest.MonkeyPatch,
                                               value: str) -> None:
    monkeypatch.setenv(exactness.ALLOW_INEXACT, value)
    for loaded in (adapter, native):  # an exact target too: a typo is never silently ignored
        with pytest.raises(SpecDecodeError, match=rf"SPECDECODE_ALLOW_INEXACT='{value}' is "
                           r"not 0 or 1"):
            drafter_factory("ngram", loaded.model)


def test_an_exact_target_speculates_and_says_so(native: LoadedModel,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(exactness.ALLOW_INEXACT, raising=False)
    assert drafter_factory("ngram", native.model) is not None
    verdict = native.verdict()
    assert verdict.exact and verdict.speculates and verdict.status == "exact"
    assert native.exactness().startswith("exact: batch-invariant (max |logit difference|: 0 ")


def test_int8_is_refused_before_loading_unless_allowed(folder: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Row-coupled by construction: refused by the API before anything loads; the same switch
    lets it speculate (one way past every refusal)."""
    import specdecode

    monkeypatch.delenv(exactness.ALLOW_INEXACT, raising=False)
    with pytest.raises(SpecDecodeError, match=r"--precision int8 is not: its kernels quantize"):
        specdecode.load(str(folder), precision="int8", drafter="ngram")
    monkeypatch.setenv(exactness.ALLOW_INEXACT, "1")
    sd = specdecode.load(str(folder), precision="int8", drafter="ngram", k=2)
    assert sd.loaded.verdict().status.startswith("inexact (allowed")


def test_generate_json_says_which(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["generate", "t2 t3 t4 t2 t3", "--model", str(folder), "--drafter", "ngram",
            "--max-tokens", "4", "--json"]
    monkeypatch.delenv(exactness.ALLOW_INEXACT, raising=False)
    code, out, err = run_cli(args)
    assert code == 0, err
    assert json.loads(out)["exactness"]["status"] == "exact"
    code, out, err = run_cli([*args, "--backend", "transformers"])
    assert code == 2 and "Traceback" not in err
    assert "needs a batch-invariant target" in err and out == ""
    monkeypatch.setenv(exactness.ALLOW_INEXACT, "1")
    code, out, err = run_cli([*args, "--backend", "transformers"])
    assert code == 0, err
    record = json.loads(out)
    assert record["exactness"]["status"] == "inexact (allowed by SPECDECODE_ALLOW_INEXACT=1)"
    assert record["exactness"]["invariance"]["widths"] > 0 and len(record["token_ids"]) == 4
    monkeypatch.setenv(exactness.ALLOW_INEXACT, "maybe")
    code, out, err = run_cli([*args, "--backend", "transformers"])
    assert code == 2 and "SPECDECODE_ALLOW_INEXACT='maybe' is not 0 or 1" in err
    assert "Traceback" not in err and out == ""


def test_the_bench_report_says_which(folder: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "t5 t6 t7 t5 t6", "category": "code"}\n', encoding="utf-8")

    def bench(out: Path) -> tuple[int, str, str]:
        return run_cli(["bench", "--model", str(folder), "--backend", "transformers",
                        "--workload", str(wl), "--out", str(out), "--quiet", "--threads", "1",
                        "--max-tokens", "4", "--resamples", "100", "--configs", "plain;ngram:k=2"])

    monkeypatch.delenv(exactness.ALLOW_INEXACT, raising=False)
    code, out, err = bench(tmp_path / "refused")
    assert code == 2 and "needs a batch-invariant target" in err and "Traceback" not in err
    monkeypatch.setenv(exactness.ALLOW_INEXACT, "1")
    code, out, err = bench(tmp_path / "allowed")
    assert code == 0, err
    assert "target: inexact (allowed by SPECDECODE_ALLOW_INEXACT=1)" in out
    html = (tmp_path / "allowed" / "report.html").read_text(encoding="utf-8")
    assert "Target: <span class=\"fail\">inexact (allowed by SPECDECODE_ALLOW_INEXACT=1)" in html


def test_metrics_say_which(adapter: LoadedModel, native: LoadedModel,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from specdecode.server.prometheus import ServerMetrics

    monkeypatch.setenv(exactness.ALLOW_INEXACT, "1")
    for loaded, label in ((native, 'exactness="exact: batch-invariant'),
                          (adapter, 'exactness="inexact (allowed by SPECDECODE_ALLOW_INEXACT=1)')):
        metrics = ServerMetrics("tiny")
        metrics.set_backend(loaded.backend, loaded.backend_version(), loaded.exactness())
        assert label in generate_latest(metrics.registry).decode()
