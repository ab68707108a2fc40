"""Resumable training state, without pickle.

A checkpoint is a folder `ckpt-<step>` holding `state.safetensors` (parameters, optimizer moments,
the torch generator state as uint8) and `state.json` (step, seed, config, optimizer
hyper-parameters, anything JSON-able). It is written into a temporary folder and renamed into
place, so an interrupted run never leaves a half-written checkpoint; `latest_checkpoint` resumes
from the newest complete one. The last `keep` checkpoints are kept. (The model cards of trained
weights and the target identity check are models.cards: the drafters read them.)
"""

from __future__ import annotations

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
_PREFIX = "ckpt-"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: Path


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
