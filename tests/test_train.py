"""Training infrastructure on a small random checkpoint: corpora (HTML stripping, held-out split,
clear errors for a missing or empty path), checkpoints without pickle (optimizer state round
trip, atomic folders), `specdecode train heads` (an interrupted run resumes to the weights of an
uninterrupted one, training raises held-out alpha over the untrained heads, model card)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.models.backends import load_model
from specdecode.models.cards import weights_sha256
from specdecode.models.loading import LoadedModel
from specdecode.train.checkpoint import (
    latest_checkpoint,
    load_optimizer_state,
    optimizer_state,
    save_checkpoint,
)
from specdecode.train.corpus import html_to_text, load_corpus
from specdecode.train.heads import HeadsTrainConfig, train_heads
from tests.conftest import make_checkpoint

CFG = HeadsTrainConfig(steps=8, batch=4, seq_len=32, train_tokens=3000, heldout_tokens=256,
                       draft_vocab=64, checkpoint_every=3, shard_sequences=8, warmup=2,
                       eval_positions=3, lr=3e-3)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(make_checkpoint(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Documents of the tiny tokenizer's words: each repeats a cycle of 8 words, with noise."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for d in range(16):
        cycle = [rng.randrange(2, 96) for _ in range(8)]
        words = [f"t{cycle[i % 8] if rng.random() < 0.85 else rng.randrange(2, 96)}"
                 for i in range(240)]
        (folder / f"doc{d:02d}.txt").write_text(" ".join(words), encoding="utf-8")
    return folder


# ---------------------------------------------------------------------------------------------
# Corpora
# ---------------------------------------------------------------------------------------------


def test_html_is_stripped_to_the_main_text() -> None:
    page = ("<html><head><title>T</title><style>p {}</style></head><body><div class='nav'>"
            "Index</div><div class='body' role='main'><h1>os &mdash; files\xb6</h1>"
            "<p>Use <code>os.path</code>.</p><script>x()</script></div></body></html>")
    assert html_to_text(page) == "os — files\n\nUse os.path."  # blank runs become one


def test_missing_corpus_path_is_a_clear_error(tiny: LoadedModel, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(SpecDecodeError, match=re.escape(f"{missing}: corpus path does not exist")):
        load_corpus([missing], tiny.tokenizer)


def test_corpus_without_text_is_a_clear_error(tiny: LoadedModel, tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(SpecDecodeError, match=re.escape(f"{tmp_path}: corpus path holds no text")):
        load_corpus([tmp_path], tiny.tokenizer)


def test_heldout_documents_are_not_in_training(tiny: LoadedModel, corpus: Path) -> None:
    data = load_corpus([corpus], tiny.tokenizer, max_tokens=10_000, heldout_fraction=0.2, seed=3)
    assert data.train.dtype == torch.long and data.heldout.dtype == torch.long
    assert data.documents == 16 and data.heldout.numel() > 0
    train = set(map(tuple, data.train.unfold(0, 6, 1).tolist()))
    held = data.heldout.unfold(0, 6, 1).tolist()
    assert sum(tuple(w) in train for w in held) < 0.2 * len(held)  # different documents
    again = load_corpus([corpus], tiny.tokenizer, max_tokens=10_000, heldout_fraction=0.2, seed=3)
    assert torch.equal(again.train, data.train)


def test_a_single_file_corpus_holds_out_its_tail(tiny: LoadedModel, corpus: Path) -> None:
    data = load_corpus([corpus / "doc00.txt"], tiny.tokenizer, max_tokens=200)
    assert data.train.numel() == 200 and data.heldout.numel() > 0


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def test_optimizer_state_round_trips_without_pickle(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        layer(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    tensors, meta = optimizer_state(opt)
    save_checkpoint(tmp_path, 3, tensors, {"optimizer": meta})
    (tmp_path / ".ckpt-00000004.tmp-1").mkdir()  # a half-written checkpoint is ignored
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 3
    fresh = torch.optim.AdamW(layer.parameters(), lr=0.5)
    load_optimizer_state(fresh, ckpt.tensors, ckpt.meta["optimizer"])
    for a, b in zip(opt.state.values(), fresh.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"],
                                                                       b["exp_avg_sq"])
    assert fresh.param_groups[0]["lr"] == 0.01


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"x": torch.zeros(1)}, {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002", "ckpt-00000003"]


# ---------------------------------------------------------------------------------------------
# Training heads
# ---------------------------------------------------------------------------------------------


class Interrupt(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_same_weights(
    tiny: LoadedModel, corpus: Path, tmp_path: Path
) -> None:
    straight = train_heads(tiny, [str(corpus)], CFG, tmp_path / "a", progress=False)

    def stop_at_5(step: int) -> None:
        if step == 5:
            raise Interrupt

    with pytest.raises(Interrupt):
        train_heads(tiny, [str(corpus)], CFG, tmp_path / "b", progress=False, on_step=stop_at_5)
    assert latest_checkpoint(tmp_path / "b" / "checkpoints").step == 3  # type: ignore[union-attr]
    ran: list[int] = []
    resumed = train_heads(tiny, [str(corpus)], CFG, tmp_path / "b", resume=True, progress=False,
                          on_step=ran.append)
    assert ran == [4, 5, 6, 7, 8]  # from the checkpoint of step 3, not from scratch
    assert resumed.steps == straight.steps == CFG.steps
    a = load_file(str(tmp_path / "a" / "heads.safetensors"))
    b = load_file(str(tmp_path / "b" / "heads.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_other_settings_is_refused(
    tiny: LoadedModel, corpus: Path, tmp_path: Path
) -> None:
    cfg = HeadsTrainConfig(**{**CFG.__dict__, "steps": 3})
    train_heads(tiny, [str(corpus)], cfg, tmp_path, progress=False)
    other = HeadsTrainConfig(**{**CFG.__dict__, "seq_len": 16})
    with pytest.raises(SpecDecodeError, match="seq_len=32"):
        train_heads(tiny, [str(corpus)], other, tmp_path, resume=True, progress=False)


def test_training_raises_heldout_alpha_and_writes_a_model_card(
    tiny: LoadedModel, corpus: Path, tmp_path: Path
) -> None:
    cfg = HeadsTrainConfig(**{**CFG.__dict__, "steps": 120, "checkpoint_every": 60})
    result = train_heads(tiny, [str(corpus)], cfg, tmp_path, progress=False, recipe="R")
    before, after = result.alpha_untrained["agreement"], result.alpha["agreement"]
    assert after[0] > before[0] + 0.1, (before, after)
    card = json.loads((tmp_path / "card.json").read_text(encoding="utf-8"))
    assert card["target_sha256"] == weights_sha256(tiny.model)
    assert card["steps"] == 120 and card["seed"] == 0 and card["recipe"] == "R"
    assert card["alpha_heldout"] == [round(a, 4) for a in after]
    assert card["data"]["sources"] == [str(corpus)]
    assert "target_sha256" in (tmp_path / "MODEL_CARD.md").read_text(encoding="utf-8")


def test_cli_trains_heads_and_reports_alpha(
    tiny: LoadedModel, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "heads"
    argv = ["train", "heads", "--model", str(tiny.source), "--corpus", str(corpus),
            "--steps", "2", "--tokens", "1000", "--seq-len", "32", "--out", str(out),
            "--threads", "1"]
    assert main(argv) == 0
    assert "held-out alpha per position" in capsys.readouterr().out
    assert (out / "heads.safetensors").is_file() and (out / "MODEL_CARD.md").is_file()
    assert main([*argv[:-2], "--corpus", str(tmp_path / "missing")]) == 2
    assert "corpus path does not exist" in capsys.readouterr().err
