"""Finding, converting and loading checkpoints: the default SmolLM2 GGUF, any GGUF of a supported
family, and any Hugging Face causal-LM folder (config.json + *.safetensors + tokenizer files)."""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig
from specdecode.models.paths import cache_root, default_model_path
from specdecode.models.target import Target
from specdecode.models.tokenizer import Tokenizer

if TYPE_CHECKING:  # every backend implements the interface (mypy checks these assignments)
    from specdecode.models.cache import KVCache
    from specdecode.models.exactness import Verdict
    from specdecode.models.hf_adapter import AdapterCache, TransformersModel
    from specdecode.models.llama import LlamaModel
    from specdecode.models.llamacpp import LlamaCppCache, LlamaCppModel
    from specdecode.models.target import Cache

    _TARGETS: tuple[type[Target], ...] = (LlamaModel, LlamaCppModel, TransformersModel)
    _CACHES: tuple[type[Cache], ...] = (KVCache, LlamaCppCache, AdapterCache)

CONVERTED_VERSION = "1"  # bump when the conversion's output changes


@dataclass
class LoadedModel:
    model: Target  # the native runner, the llama.cpp backend or the transformers adapter
    tokenizer: Tokenizer
    name: str
    source: Path
    precision: str
    load_seconds: float

    @property
    def backend(self) -> str:
        return str(self.model.backend)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The tokens that end a generation: the tokenizer's and the checkpoint config's."""
        return tuple(sorted(set(self.tokenizer.eos_ids) | set(self.model.cfg.eos_token_ids)))

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def backend_version(self) -> str:
        """The version of the library behind the backend (llama-cpp-python, else torch)."""
        return self.model.version()

    def verdict(self) -> Verdict:
        """Whether the target passed its invariance check and may speculate (models.exactness)."""
        from specdecode.models.exactness import verdict

        return verdict(self.model)

    def exactness(self) -> str:
        """The verdict in the words every report uses: "exact: batch-invariant (...)", or
        "inexact (allowed by SPECDECODE_ALLOW_INEXACT=1): ..." / "inexact (speculation
        refused): ..." with what was measured and why."""
        return self.verdict().describe()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "source": str(self.source), "backend": self.backend,
            "precision": self.precision, "weight_bytes": self.weight_bytes(),
        }


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def converted_folder(gguf_path: Path) -> Path:
    """The cached Hugging Face-layout copy of a GGUF, converting it first if needed.

    The conversion is written under a temporary name and renamed into place, so an interrupted
    conversion never leaves a half-written model behind.
    """
    from specdecode.models.gguf_convert import convert_gguf

    if not gguf_path.is_file():
        raise SpecDecodeError(f"{gguf_path}: no such file")
    key = f"{file_digest(gguf_path)[:24]}-v{CONVERTED_VERSION}"
    dest = cache_root() / "gguf" / key
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / "SOURCE").write_text(f"{gguf_path}\n", encoding="utf-8")
        os.replace(tmp, dest) if not dest.exists() else shutil.rmtree(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_folder(spec: str | None) -> tuple[Path, Path, str]:
    """(checkpoint folder, the path the user named, display name) for a --model value: a
    folder, a .gguf file, or the name of a model installed by `specdecode models install`
    (models.catalog; a file or folder of that name wins)."""
    from specdecode.models.install import resolve

    if spec is None:
        source = default_model_path()
        return converted_folder(source), source, "SmolLM2-135M-Instruct"
    path = Path(spec).expanduser()
    named = None if path.exists() else resolve(spec)
    if named is not None:
        return converted_folder(named), named, spec
    if not path.exists():
        raise SpecDecodeError(f"{path}: no such file or folder (--model; or a model name: "
                              "`specdecode models list`)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise SpecDecodeError(f"{path}: expected a .gguf file or a checkpoint folder")
        return converted_folder(path), path, path.stem
    return path, path, path.name


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: pickle files are refused)" if pickles else ""
        raise SpecDecodeError(f"{folder}: no *.safetensors weights{hint}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise SpecDecodeError(f"{f}: corrupt or unreadable safetensors ({exc})") from exc
    return state


def native_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor], folder: Path) -> dict[str, Any]:
    """Map Hugging Face tensor names onto the native runner's fused layout."""

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise SpecDecodeError(f"{folder}: weight '{name}' is missing from the checkpoint")
        return hf[name].float()

    out: dict[str, torch.Tensor] = {"embed.weight": take("model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        p, n = f"model.layers.{i}.", f"layers.{i}."
        out[n + "attn_norm"] = take(p + "input_layernorm.weight")
        proj = [p + f"self_attn.{x}_proj." for x in "qkv"]
        out[n + "qkv.weight"] = torch.cat([take(x + "weight") for x in proj])
        if cfg.qkv_bias:
            out[n + "qkv.bias"] = torch.cat([take(x + "bias") for x in proj])
        out[n + "o.weight"] = take(p + "self_attn.o_proj.weight")
        out[n + "mlp_norm"] = take(p + "post_attention_layernorm.weight")
        out[n + "gate_up.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        out[n + "down.weight"] = take(p + "mlp.down_proj.weight")
    out["norm"] = take("model.norm.weight")
    tied = cfg.tie_embeddings or "lm_head.weight" not in hf
    out["lm_head.weight"] = out["embed.weight"] if tied else take("lm_head.weight")
    return out


def load_native(folder: Path, cfg: ModelConfig) -> torch.nn.Module:
    from specdecode.models.llama import LlamaModel, rope_inv_freq

    with torch.device("meta"):
        model = LlamaModel(cfg)
    weights = native_weights(cfg, load_state_dict(folder), folder)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as exc:
        raise SpecDecodeError(f"{folder}: weights do not match config.json ({exc})") from exc
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(cfg)  # a buffer built on the meta device: rebuild it
    return model.eval()


def make_exact(model: Any) -> bool:
    """Put a native model on the row-invariant kernels where they build here (models.kernels);
    True if it runs on them. (Its batch invariance is measured by the caller, once the kernels
    it runs on are final: Target.check_invariance.)"""
    from specdecode.models import kernels
    from specdecode.models.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        return False
    if kernels.available() and not model.exact:
        model.set_exact()
    return model.exact
