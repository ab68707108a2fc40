"""The transformers adapter: families without a native runner (e.g. Gemma 3) behind the same
interface as the native runner. Slower, batch 1 only, no token trees or layer subsets; reports
itself as backend "transformers" so every figure says which path produced it."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig
from specdecode.models.logits_for import is_none, logit_positions

if TYPE_CHECKING:
    from specdecode.models.invariance import Invariance
    from specdecode.models.target import Cache


class AdapterCache:
    """A transformers DynamicCache as a models.target.Cache (one row; rollback = crop)."""

    copies_rows = True  # its one row: a prefilled prompt is copied, a batch-1 engine adopts it
    holds_tensors = False  # transformers' own layout: no drafter drafts in it

    def __init__(self, capacity: int) -> None:
        from transformers import DynamicCache

        self.hf = DynamicCache()
        self.capacity = capacity
        self.lengths = [0]

    @property
    def batch(self) -> int:
        return 1

    def nbytes(self) -> int:
        total = 0
        for layer in getattr(self.hf, "layers", []):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def check_room(self, new_tokens: int, rows: list[int] | None = None) -> None:
        if self.lengths[0] + new_tokens > self.capacity:
            raise SpecDecodeError(
                f"context overflow: {self.lengths[0]} + {new_tokens} tokens exceed the cache "
                f"capacity of {self.capacity}"
            )

    def rollback(self, row: int, length: int) -> None:
        if not 0 <= length <= self.lengths[0]:
            raise ValueError(f"rollback to {length} but the cache holds {self.lengths[0]}")
        self.lengths[0] = length
        self.crop()

    def crop(self) -> None:
        """Drop the transformers cache's states past `lengths[0]`. A negative argument to `crop`
        removes that many tokens in every transformers version (transformers 5 refuses the
        older absolute length)."""
        extra = self.hf.get_seq_length() - self.lengths[0]
        if extra > 0:
            self.hf.crop(-extra)

    def keep(self, row: int, start: int, indices: torch.Tensor) -> None:
        raise SpecDecodeError("token trees need the native runner (--backend native)")

    def reset_row(self, row: int) -> None:
        self.rollback(0, 0)

    def copy_row(self, dst: int, src_cache: Cache, src: int, n: int) -> None:
        """Hold the first `n` positions of another adapter cache's row (a copy of its states)."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        if not isinstance(src_cache, AdapterCache) or dst != 0 or src != 0:
            raise SpecDecodeError("the transformers backend copies its one row only")
        self.hf = DynamicCache()
        for i, layer in enumerate(src_cache.hf.layers):
            if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
                raise SpecDecodeError("the transformers backend copies plain attention caches "
                                      "only")
            self.hf.update(layer.keys[..., :n, :].clone(), layer.values[..., :n, :].clone(), i)
        self.lengths[0] = n

    def move_row(self, src: int, dst: int) -> None:
        if src != dst:
            raise SpecDecodeError("the transformers backend runs batch 1 only")

    def view(self, first: int, n: int) -> AdapterCache:
        """The one row (first 0, n 1) sharing its states, with a copy of its length."""
        if (first, n) != (0, 1):
            raise SpecDecodeError("the transformers backend runs batch 1 only")
        out = copy.copy(self)
        out.lengths = list(self.lengths)
        return out


def _adapter_config(hf_config: Any) -> ModelConfig:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    eos = text.eos_token_id if text.eos_token_id is not None else ()
    return ModelConfig(
        family=str(text.model_type),
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(text, "head_dim", 0) or text.hidden_size // heads),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6),
        rope_theta=0.0,
        max_position=int(getattr(text, "max_position_embeddings", 2048) or 2048),
        tie_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else (int(eos),),
    )


class TransformersModel(nn.Module):
    """A transformers causal LM as a models.target.Target (fp32, batch 1, chains only)."""

    backend = "transformers"
    precision = "fp32"  # loaded in float32 (load_transformers)
    supports_trees = False
    rows_independent = True  # one row per forward
    invariance: Invariance | None = None

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.cfg = _adapter_config(hf_model.config)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def weight_bytes(self) -> int:
        from specdecode.memory import weight_bytes

        return weight_bytes(self)

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise SpecDecodeError("hidden states need the native runner (--backend native)")

    def check_invariance(self, width: int) -> Invariance:
        """Measure the batch invariance up to calls of `width` positions (models.invariance;
        widths, chunkings and thread counts: it runs one row); recorded as `invariance`."""
        from dataclasses import replace

        from specdecode.models.invariance import measure

        measured = measure(self, width)
        if not measured.exact:
            measured = replace(measured, cause=(
                "the transformers backend runs PyTorch's own products and attention, which "
                "pick their kernels and blockings by shape; a checkpoint of a native family "
                "(Llama, Mistral, Qwen2) runs on the row-invariant kernels (--backend native)"))
        self.invariance = measured
        return measured

    def new_cache(self, batch: int, capacity: int) -> AdapterCache:
        if batch != 1:
            raise SpecDecodeError(
                f"the transformers backend runs batch 1 only (asked for {batch}); "
                "use a native family for batching"
            )
        return AdapterCache(capacity)

    def forward(
        self,
        tokens: torch.Tensor,  # (1, T)
        cache: AdapterCache,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        num_new: Sequence[int] | None = None,
        logits_for: str | torch.Tensor = "all",
        layers: Sequence[int] | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        if tree_mask is not None or layers is not None or return_hidden:
            raise SpecDecodeError(
                "token trees, layer skipping and hidden states need the native runner"
            )
        T = tokens.shape[1]
        cache.check_room(T)
        start = cache.lengths[0]
        if positions is None:
            positions = torch.arange(start, start + T)[None]
        out = self.hf(
            input_ids=tokens, past_key_values=cache.hf, position_ids=positions, use_cache=True
        )
        cache.lengths[0] += T if num_new is None else int(num_new[0])
        cache.crop()
        logits = out.logits.float()  # (1, T, V)
        wanted = logit_positions(logits_for)
        if is_none(wanted):
            return logits[:, :0, :0]
        return logits[:, wanted]


def load_transformers(folder: Path) -> TransformersModel:
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, trust_remote_code=False, use_safetensors=True
        )
    except (OSError, ValueError, KeyError) as exc:
        msg = f"{folder}: transformers cannot load this checkpoint ({exc})"
        raise SpecDecodeError(msg) from exc
    return TransformersModel(hf.eval())
