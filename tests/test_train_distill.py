"""`specdecode train draft` on a small random target: a short run lowers the held-out divergence,
a run interrupted and resumed ends exactly where an uninterrupted one does, the written draft
loads and drafts, and bad corpora or output folders are clear errors."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from specdecode.cli import main
from specdecode.drafters.distilled import load_distilled
from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.errors import SpecDecodeError
from specdecode.models.cards import read_card, weights_sha256
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from specdecode.models.tokenizer import Tokenizer
from specdecode.train import distill as distill_module
from specdecode.train.distill import DistillConfig, batch_rows, distill, learning_rate
from tests.conftest import make_checkpoint

CFG = DistillConfig(layers=2, init="spaced", vocab=48, steps=12, batch=4, seq_len=16, lr=3e-3,
                    warmup=2, corpus_tokens=4_000, eval_tokens=64, eval_every=6,
                    checkpoint_every=4)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Tokenizer, Path]:
    folder = make_checkpoint(tmp_path_factory.mktemp("target"), scale=4.0)
    return load_native(folder, config_from_hf(read_hf_config(folder))), Tokenizer(folder), folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twenty documents of words t2..t95 with a little repeated structure."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for d in range(20):
        words = []
        for _ in range(60):
            w = rng.randrange(2, 60)
            words += [f"t{w}", f"t{(w * 7) % 94 + 2}"]
        (root / f"doc{d}.txt").write_text(" ".join(words) + "\n", encoding="utf-8")
    return root


def run(target: tuple[Any, Tokenizer, Path], corpus: Path, out: Path,
        cfg: DistillConfig = CFG, resume: bool = False) -> dict[str, Any]:
    model, tok, _ = target
    return distill(model, tok, [str(corpus)], cfg, out, resume=resume, target_name="tiny",
                   recipe="test", progress=False)


def test_a_short_run_lowers_the_heldout_divergence(target: Any, corpus: Path, tmp_path: Path
                                                   ) -> None:
    card = run(target, corpus, tmp_path)
    assert card["heldout_kl"] < 0.8 * card["heldout_kl_before"]
    assert card["heldout_alpha"] > card["heldout_alpha_before"]
    assert card["target_sha256"] == weights_sha256(target[0])
    assert card["layers_from"] == [0, 2] and card["vocab_size"] == 48
    assert [h["step"] for h in card["history"]] == [6, 12]
    assert read_card(tmp_path) == card
    draft = load_distilled(tmp_path, target[0])
    factory = drafter_factory(DrafterOptions("distilled", distilled=str(tmp_path)), target[0])
    assert factory is not None and draft.cfg.num_layers == 2
    with pytest.raises(SpecDecodeError, match="holds checkpoints of an earlier run"):
        run(target, corpus, tmp_path)


def test_the_tvd_loss_raises_alpha_too(target: Any, corpus: Path, tmp_path: Path) -> None:
    card = run(target, corpus, tmp_path, replace(CFG, loss="tvd", vocab=0))
    assert card["heldout_alpha"] > card["heldout_alpha_before"] + 0.05
    assert card["loss"] == "tvd" and card["vocab_size"] is None


def test_resumed_run_equals_an_uninterrupted_one(
    target: Any, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = run(target, corpus, tmp_path / "whole")
    real_step = distill_module.train_step
    calls = {"n": 0}

    def interrupted(*args: Any) -> float:
        calls["n"] += 1
        if calls["n"] == 7:  # after the checkpoint at step 4 and two more steps
            raise KeyboardInterrupt
        return real_step(*args)

    monkeypatch.setattr(distill_module, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(target, corpus, tmp_path / "split")
    monkeypatch.setattr(distill_module, "train_step", real_step)
    with pytest.raises(SpecDecodeError, match="other settings"):
        run(target, corpus, tmp_path / "split", replace(CFG, lr=1e-3), resume=True)
    resumed = run(target, corpus, tmp_path / "split", resume=True)
    a = load_file(str(tmp_path / "whole" / "draft.safetensors"))
    b = load_file(str(tmp_path / "split" / "draft.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed["history"] == whole["history"]


def test_batch_order_and_schedule_depend_only_on_their_arguments() -> None:
    rows = [batch_rows(s, 4, 10, 0).tolist() for s in range(5)]  # two epochs and a half
    assert sorted(rows[0] + rows[1] + rows[2][:2]) == list(range(10))
    assert rows == [batch_rows(s, 4, 10, 0).tolist() for s in range(5)]
    assert rows != [batch_rows(s, 4, 10, 1).tolist() for s in range(5)]
    assert learning_rate(CFG, 0) == pytest.approx(CFG.lr / 2)
    assert learning_rate(CFG, CFG.steps) == pytest.approx(CFG.lr * CFG.min_lr_ratio)


def test_missing_or_empty_corpus_is_a_clear_error(target: Any, tmp_path: Path) -> None:
    with pytest.raises(SpecDecodeError, match="corpus path does not exist"):
        run(target, tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(SpecDecodeError, match="holds no text"):
        run(target, tmp_path / "empty", tmp_path / "out")


def test_bad_settings_are_refused(target: Any, corpus: Path, tmp_path: Path) -> None:
    for bad, message in ((replace(CFG, layers=4), "--layers must be in 1..3"),
                         (replace(CFG, loss="mse"), "--loss must be one of"),
                         (replace(CFG, init="last"), "--init must be")):
        with pytest.raises(SpecDecodeError, match=message):
            run(target, corpus, tmp_path, bad)


def test_cli_trains_and_reports_bad_input_in_one_line(
    target: Any, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = str(target[2])
    common = ["train", "draft", "--model", folder, "--steps", "2", "--batch", "2",
              "--seq-len", "16", "--vocab", "0", "--corpus-tokens", "2000", "--threads", "1"]
    assert main([*common, "--corpus", str(corpus), "--out", str(tmp_path / "d")]) == 0
    card = read_card(tmp_path / "d")
    assert card["steps"] == 2 and card["vocab_size"] is None
    assert "held-out alpha" in capsys.readouterr().out
    assert main([*common, "--corpus", str(tmp_path / "none"), "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip()
    assert "corpus path does not exist" in err and len(err.splitlines()) == 1
