"""A target's identity and the model cards of weights made for it (heads, distilled drafts),
without pickle: the drafters read them to refuse weights made for another target, the trainers
write them. Below the drafters and the trainers alike (docs/design.md, "Where the code is").

Trained weights ship with a model card (`card.json` + `MODEL_CARD.md`): data, steps, seed, time,
alpha reached on held-out text, the target's name and the sha256 of the target's weights
(`weights_sha256`); `check_target` refuses weights trained for a different target.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specdecode.errors import SpecDecodeError
from specdecode.files import atomic_write_text

CARD_JSON = "card.json"
CARD_MD = "MODEL_CARD.md"


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor],
                        metadata: dict[str, str] | None = None) -> None:
    """save_file through a temporary file renamed into place (contiguous CPU copies)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    clean = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(clean, str(tmp), metadata=metadata)
    os.replace(tmp, path)


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
