"""A distilled draft model: a few decoder blocks trained to match the target (DistillSpec).

The draft is a small model of the target's own family and width. Its blocks start as copies of
evenly spaced blocks of the target (`evenly_spaced`: first and last included) and are then
trained with `specdecode train draft` (specdecode.train.distill) to match the target's
next-token distributions. It shares the target's token embedding and LM head (tied in SmolLM2),
taken from the target at load time; so the shipped files hold only
the draft's own blocks and final norm (`draft.safetensors`, bf16), `config.json` (which blocks,
which vocabulary) and a model card (specdecode.train.checkpoint). The target must therefore be
the one the draft was trained for: the sha256 of its weights, recorded in the card, is checked
(`load_distilled`).

Reduced vocabulary: the LM head may score only a subset of the tokens (`SubsetHead`; training
picks the lowest ids, see train.distill.vocab_ids). The draft's logits are -inf elsewhere, so q
is zero there: verification stays lossless (a draft token always has q > 0, and the residual
max(0, p - q) simply keeps p's mass outside the subset), and drafting skips most of the head's
matrix product, which on SmolLM2 is about two thirds of a 2-block draft's forward pass.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from specdecode.drafters.base import native
from specdecode.errors import SpecDecodeError
from specdecode.models import kernels

if TYPE_CHECKING:
    from specdecode.models.llama import LlamaModel
    from specdecode.models.target import Target

FORMAT = "specdecode-distilled-draft"
FORMAT_VERSION = 1
WEIGHTS_FILE = "draft.safetensors"
CONFIG_FILE = "config.json"
VOCAB_KEY = "vocab_ids"  # int64 (n,) ascending: the tokens the draft's head scores
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "data" / "distilled" / "smollm2-135m"


@dataclass(frozen=True)
class DraftLayout:
    """What a distilled draft is, apart from its trained weights."""

    layers_from: tuple[int, ...]  # target blocks the draft's blocks were initialised from
    vocab_size: int | None  # tokens its head scores (None: the target's whole vocabulary)

    def to_dict(self) -> dict[str, Any]:
        return {"layers_from": list(self.layers_from), "vocab_size": self.vocab_size}


class SubsetHead(nn.Module):
    """An LM head scoring only `ids` (n,) of a vocabulary of `vocab_size`: -inf elsewhere.

    The rows are `weight[ids]` at `dtype` (fp32, or bf16: half the bytes a step streams), or
    `panels`, rows the row-invariant kernels already hold (drafters.draft_head: a prefix of a
    model's own head, shared with it, whatever its kind). At inference, where the kernels build
    (models.kernels), they multiply the rows (bf16 panels are read as bf16, where PyTorch
    converts a bf16 matrix on every call on CPUs without native bf16 products); with autograd
    on (training a draft through it) PyTorch does, from the same values."""

    def __init__(self, weight: torch.Tensor | None, ids: torch.Tensor, vocab_size: int,
                 dtype: torch.dtype = torch.float32,
                 panels: kernels.Panels | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ids: torch.Tensor
        self.weight: torch.Tensor | None
        ids = ids.to(torch.long)
        self.register_buffer("ids", ids, persistent=False)
        self.shared = panels is not None  # rows another module holds: none of its own bytes
        if panels is None:
            assert weight is not None
            rows = weight.detach()[ids].to(dtype).contiguous()  # (n, H)
            # held once: as the kernels' panels where they build, else as a buffer
            panels = kernels.pack_float(rows, dtype) if kernels.available() else None
            self.register_buffer("weight", None if panels is not None else rows,
                                 persistent=False)
        else:
            self.register_buffer("weight", None, persistent=False)
        self.panels = panels
        # the lowest ids (what training and draft_head pick): a slice, not a scatter
        self.prefix = bool(torch.equal(ids, torch.arange(len(ids))))

    @property
    def nbytes(self) -> int:
        """Bytes of rows it holds itself (memory.weight_bytes adds them: not buffers)."""
        return 0 if self.panels is None or self.shared else self.panels.nbytes

    def rows(self) -> torch.Tensor:
        """The (n, H) rows it multiplies by, fp32."""
        if self.panels is not None:
            return kernels.weight_of(self.panels)
        assert self.weight is not None
        return self.weight.float()

    def subset_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the subset only: (..., H) -> (..., n)."""
        if self.panels is not None and kernels.available() and not torch.is_grad_enabled():
            return kernels.matmul(x, self.panels)
        return x @ self.rows().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.subset_logits(x)  # (..., n)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))  # (..., V)
        if self.prefix:
            out[..., : sub.shape[-1]] = sub
        else:
            out[..., self.ids] = sub
        return out


def evenly_spaced(num_layers: int, n: int) -> tuple[int, ...]:
    """n block indices spread over 0..num_layers-1, first and last included (n=1: the first)."""
    if not 1 <= n <= num_layers:
        raise SpecDecodeError(f"a draft needs 1..{num_layers} layers, got {n}")
    if n == 1:
        return (0,)
    return tuple(round(i * (num_layers - 1) / (n - 1)) for i in range(n))


def embedding_weight(target: LlamaModel) -> torch.Tensor:
    """The target's token embedding (V, H) as float32 (whatever its precision)."""
    from specdecode.models.linears import float_weight

    return float_weight(target.embed)[0].float()


def head_weight(target: LlamaModel) -> torch.Tensor:
    """The target's LM head matrix (V, H) as float32 (its embedding when they are tied)."""
    from specdecode.models.linears import float_weight

    return float_weight(target.lm_head)[0].float()


def initial_weights(target: LlamaModel, layout: DraftLayout) -> dict[str, torch.Tensor]:
    """The draft's own weights before training: copies of the target's chosen blocks and norm."""
    from specdecode.models.precision import REFERENCE, is_reference

    if not is_reference(target.precision):
        raise SpecDecodeError(f"a draft is initialised from an {REFERENCE.name} target "
                              f"(--precision {REFERENCE.name})")
    state = target.state_dict()
    out = {"norm": state["norm"].detach().clone()}
    for j, i in enumerate(layout.layers_from):
        prefix = f"layers.{i}."
        for name, t in state.items():
            if name.startswith(prefix):
                out[f"layers.{j}.{name[len(prefix):]}"] = t.detach().clone()
    return out


def build_draft(model: Target, layout: DraftLayout, vocab_ids: torch.Tensor | None,
                own: dict[str, torch.Tensor] | None = None) -> LlamaModel:
    """A draft LlamaModel with weights `own` (blocks and final norm; default: the target's blocks
    `layout.layers_from`) and the target's embedding and LM head (or the rows `vocab_ids` of
    it)."""
    from specdecode.models.llama import LlamaModel, rope_inv_freq

    target = native(model, "distilled")
    cfg = dataclasses.replace(target.cfg, num_layers=len(layout.layers_from))
    weights = own if own is not None else initial_weights(target, layout)
    with torch.device("meta"):
        draft = LlamaModel(cfg)
    embed = nn.Embedding.from_pretrained(embedding_weight(target), freeze=True)
    draft.embed = embed
    head = embed.weight if cfg.tie_embeddings else nn.Parameter(head_weight(target), False)
    if vocab_ids is None:
        draft.lm_head.weight = head
    else:
        draft.lm_head = SubsetHead(head.detach(), vocab_ids, cfg.vocab_size)
    try:
        draft.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False,
                              assign=True)
    except RuntimeError as exc:
        raise SpecDecodeError(f"draft weights do not fit the target's shapes ({exc})") from exc
    left = [n for n, t in draft.state_dict().items() if t.is_meta]
    if left:
        raise SpecDecodeError(f"draft weights are missing {', '.join(left[:4])}")
    draft.inv_freq = rope_inv_freq(cfg)
    return draft.eval()


def draft_tensors(draft: LlamaModel) -> dict[str, torch.Tensor]:
    """The draft's own weights (blocks and final norm) in bf16, plus its head's token ids."""
    own = {name: t.detach().to(torch.bfloat16).contiguous()
           for name, t in draft.state_dict().items()
           if name.startswith("layers.") or name == "norm"}
    if isinstance(draft.lm_head, SubsetHead):
        own[VOCAB_KEY] = draft.lm_head.ids.clone()
    return own


def save_distilled(draft: LlamaModel, folder: Path, layout: DraftLayout) -> None:
    """Write draft.safetensors and config.json into `folder` (the card is written by training)."""
    from specdecode.files import atomic_write_text
    from specdecode.models.cards import atomic_save_tensors

    folder.mkdir(parents=True, exist_ok=True)
    atomic_save_tensors(folder / WEIGHTS_FILE, draft_tensors(draft))
    config = {
        "format": FORMAT, "format_version": FORMAT_VERSION, **layout.to_dict(),
        "hidden_size": draft.cfg.hidden_size, "target_vocab_size": draft.cfg.vocab_size,
    }
    atomic_write_text(folder / CONFIG_FILE, json.dumps(config, indent=2) + "\n")


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise SpecDecodeError(f"{folder}: no such folder (a distilled draft is a folder)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecDecodeError(f"{path}: not found (not a distilled draft folder)") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise SpecDecodeError(f"{path}: not a distilled draft config (format != {FORMAT})")
    return raw


def load_distilled(folder: Path, target: Target) -> LlamaModel:
    """Load the draft in `folder` onto `target` (the card must name its weights sha256)."""
    from specdecode.models.cards import check_target as check_trained_for
    from specdecode.models.cards import read_card

    native(target, "distilled")
    raw = read_config(folder)
    check_trained_for(read_card(folder), target, folder)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as exc:
        raise SpecDecodeError(f"{folder / WEIGHTS_FILE}: missing or unreadable ({exc})") from exc
    ids = tensors.pop(VOCAB_KEY, None)
    layout = DraftLayout(tuple(int(i) for i in raw["layers_from"]), raw.get("vocab_size"))
    try:
        draft = build_draft(target, layout, ids, tensors)
    except SpecDecodeError as exc:
        raise SpecDecodeError(f"{folder}: {exc}") from exc
    return draft
