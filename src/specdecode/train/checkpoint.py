"""Resumable training state, model cards and the target identity check, without pickle.

A checkpoint is a folder `ckpt-<step>` holding `state.safetensors` (parameters, optimizer moments,
the torch generator state as uint8) and `state.json` (step, seed, config, optimizer
hyper-parameters, anything JSON-able). It is written into a temporary folder and renamed into
place, so an interrupted run never leaves a half-written checkpoint; `latest_checkpoint` resumes
from the newest complete one. The last `keep` checkpoints are kept.

Trained weights ship with a model card (`card.json` + `MODEL_CARD.md`): data, steps, seed, time,
alpha reached on held-out text, the target's name and the sha256 of the target's weights
(`weights_sha256`); `check_target` refuses weights trained for a different target.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdecode.errors import SpecDecodeError

STATE_FILE = "state.safetensors"
META_FILE = "state.json"
CARD_JSON = "card.json"
CARD_MD = "MODEL_CARD.md"
_PREFIX = "ckpt-"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor],
                        metadata: dict[str, str] | None = None) -> None:
    """save_file through a temporary file renamed into place (contiguous CPU copies)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    clean = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(clean, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def checkpoint_folders(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints in `out_dir`, oldest first."""
    if not out_dir.is_dir():
        return []
    found = []
    for d in out_dir.iterdir():
        if d.is_dir() and d.name.startswith(_PREFIX) and d.name[len(_PREFIX):].isdigit() and \
                (d / STATE_FILE).is_file() and (d / META_FILE).is_file():
            found.append((int(d.name[len(_PREFIX):]), d))
    return sorted(found)


def save_checkpoint(out_dir: Path, step: int, tensors: dict[str, torch.Tensor],
                    meta: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint `step` atomically (temp folder + rename); keep the newest `keep`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{_PREFIX}{step:08d}"
    tmp = out_dir / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              str(tmp / STATE_FILE))
    (tmp / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=1), encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for _, old in checkpoint_folders(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint in `out_dir`, or None."""
    folders = checkpoint_folders(out_dir)
    if not folders:
        return None
    step, folder = folders[-1]
    try:
        tensors = load_file(str(folder / STATE_FILE))
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise SpecDecodeError(f"{folder}: unreadable checkpoint ({exc})") from exc
    return Checkpoint(step, tensors, meta, folder)


# ---------------------------------------------------------------------------------------------
# Optimizer and generator state as tensors + JSON
# ---------------------------------------------------------------------------------------------


def optimizer_state(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's state_dict split into tensors ('opt.<param>.<name>') and JSON-able groups."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt.{idx}.{name}"] = value
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                         meta: dict[str, Any]) -> None:
    """Restore what `optimizer_state` saved into `opt` (built over the same parameters)."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    for idx, extra in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(extra)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def generator_tensor(gen: torch.Generator) -> torch.Tensor:
    return gen.get_state().clone()  # (n,) uint8


def restore_generator(gen: torch.Generator, state: torch.Tensor) -> None:
    gen.set_state(state.to(torch.uint8).clone())


# ---------------------------------------------------------------------------------------------
# Target identity and model cards
# ---------------------------------------------------------------------------------------------


def weights_sha256(model: Any) -> str:
    """sha256 of the model's weights as the runner holds them: every tensor of its state_dict
    (tied tensors once), by name, with shape and dtype. Cached on the model object."""
    cached = getattr(model, "_specdecode_weights_sha256", None)
    if isinstance(cached, str):
        return cached
    from specdecode.models.llama import LlamaModel

    h = hashlib.sha256()
    seen: set[int] = set()
    state = model.identity_state() if isinstance(model, LlamaModel) else model.state_dict()
    for name, t in sorted(state.items()):
        if not isinstance(t, torch.Tensor) or t.is_quantized or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digest = h.hexdigest()
    with contextlib.suppress(AttributeError):
        model._specdecode_weights_sha256 = digest
    return digest


def check_target(card: dict[str, Any], target: Any, weights: Path) -> None:
    """Refuse weights whose card names a different target than `target` (by weights sha256)."""
    trained = str(card.get("target_sha256", ""))
    actual = weights_sha256(target)
    if trained != actual:
        name = card.get("target", "another model")
        raise SpecDecodeError(
            f"{weights}: these weights were trained for a different target ({name}, weights "
            f"sha256 {trained or 'not recorded'}) than the model loaded (weights sha256 "
            f"{actual}, precision {getattr(target, 'precision', 'fp32')}); train them for this "
            "model with `specdecode train` or pass weights made for it"
        )


def read_card(folder: Path) -> dict[str, Any]:
    path = folder / CARD_JSON
    if not path.is_file():
        raise SpecDecodeError(f"{folder}: no {CARD_JSON} (model card) next to the weights")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecDecodeError(f"{path}: unreadable model card ({exc})") from exc
    if not isinstance(data, dict):
        raise SpecDecodeError(f"{path}: the model card is not a JSON object")
    return data


def _md_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return "`" + json.dumps(value) + "`"
    return str(value)


def write_model_card(folder: Path, card: dict[str, Any], title: str, notes: str = "") -> None:
    """Write card.json (the record) and MODEL_CARD.md (the same, for people) atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / CARD_JSON, json.dumps(card, indent=1, sort_keys=True) + "\n")
    lines = [f"# {title}", ""]
    if notes:
        lines += [notes.strip(), ""]
    lines += ["| field | value |", "| --- | --- |"]
    lines += [f"| {k} | {_md_value(v)} |" for k, v in card.items() if k != "recipe"]
    if "recipe" in card:
        lines += ["", "## Recipe", "", "```bash", str(card["recipe"]), "```"]
    atomic_write_text(folder / CARD_MD, "\n".join(lines) + "\n")
