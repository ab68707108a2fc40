"""A draft model must share the target's tokenizer, not only its vocabulary size: a draft whose
token ids mean other strings is refused with one error naming the first differing token and
the cross-tokenizer drafter (--drafter xtok); a draft with the same tokens loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.errors import SpecDecodeError
from specdecode.models.backends import load_model
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint


def _rename_token(folder: Path, old: str, new: str) -> None:
    """The checkpoint's tokenizer with token `old` renamed `new` (same size, same ids)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("tok")
    target = make_checkpoint(root / "target", seed=0)
    same = make_checkpoint(root / "same", seed=1)
    other = make_checkpoint(root / "other", seed=1)
    _rename_token(other, "t5", "x5")
    return target, same, other


def test_a_draft_of_another_tokenizer_of_the_same_size_is_refused(
        folders: tuple[Path, Path, Path]) -> None:
    target, same, other = folders
    loaded = load_model(str(target), precision="fp32")
    ok = DrafterOptions("draft-model", draft_model=str(same))
    assert drafter_factory(ok, loaded.model, tokenizer=loaded.tokenizer) is not None
    bad = DrafterOptions("draft-model", draft_model=str(other))
    with pytest.raises(SpecDecodeError, match=r"another tokenizer.*token 5 is 't5' in the "
                                              r"target, 'x5' in the draft.*--drafter xtok"):
        drafter_factory(bad, loaded.model, tokenizer=loaded.tokenizer)


def test_the_cli_says_it_in_one_line(folders: tuple[Path, Path, Path]) -> None:
    target, _, other = folders
    code, _, err = run_cli(["generate", "t2 t3", "--model", str(target), "--precision", "fp32",
                            "--drafter", "draft-model", "--draft-model", str(other),
                            "--max-tokens", "2"])
    assert code == 2 and err.count("\n") == 1 and "another tokenizer" in err
