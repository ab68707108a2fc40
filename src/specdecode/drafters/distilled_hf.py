"""The distilled draft (drafters.distilled) as a Hugging Face folder, for engines that load a
draft model by folder: vLLM's `"method": "draft_model"` (scripts/vllm_server.py's `distilled`
configuration), transformers' assisted generation.

The folder is a plain LlamaForCausalLM: the draft's own blocks and final norm (its bf16 weights,
written fp32, exact), the target's embedding and, when the target's head is untied, its LM head,
both from the target's converted folder (models.loading.converted_folder: the GGUF de-quantized as
this project's fp32 target holds it), the target's config with the draft's block count, and the
target's tokenizer files. A plain LlamaForCausalLM has no reduced head: its head scores the
target's whole vocabulary, the rows outside the draft's training subset included (never trained
down), so where the native draft's q is zero outside the subset this one's is not. Verification
is lossless either way; acceptance may differ (docs/measurements/vllm.md).

The draft was trained for one target: the export refuses a target whose weights do not have the
sha256 recorded in the draft's card (as the GGUF export does). `cached_hf_export` keys the folder
by the sha256 of its inputs in `~/.cache/specdecode/drafts/`, written under a temporary name and
renamed into place, so a folder present is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig

HF_EXPORT_VERSION = "1"  # bump when the exported folder changes
_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
           "special_tokens_map.json", "generation_config.json")


def hf_block_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, layers: int
                     ) -> dict[str, torch.Tensor]:
    """The draft's blocks and final norm (the native runner's fused qkv and gate_up names) under
    Hugging Face's Llama names, fp32: the inverse of models.loading.native_weights."""

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise SpecDecodeError(f"the distilled draft has no weight '{name}'")
        return tensors[name].float()

    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for j in range(layers):
        p, h = f"layers.{j}.", f"model.layers.{j}."
        out[h + "input_layernorm.weight"] = take(p + "attn_norm")
        for suffix in ("weight", "bias"):
            if suffix == "bias" and p + "qkv.bias" not in tensors:
                continue
            q, k, v = take(p + f"qkv.{suffix}").split([nq, nkv, nkv])
            out[h + f"self_attn.q_proj.{suffix}"] = q
            out[h + f"self_attn.k_proj.{suffix}"] = k
            out[h + f"self_attn.v_proj.{suffix}"] = v
        out[h + "self_attn.o_proj.weight"] = take(p + "o.weight")
        out[h + "post_attention_layernorm.weight"] = take(p + "mlp_norm")
        gate, up = take(p + "gate_up.weight").chunk(2)
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = take(p + "down.weight")
    out["model.norm.weight"] = take("norm")
    return {name: t.contiguous() for name, t in out.items()}


def _target_tensors(converted: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of the target's converted folder, fp32, read alone (not the blocks)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in sorted(converted.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            found.update({n: f.get_tensor(n).float() for n in names if n in present})
    missing = [n for n in names if n not in found]
    if missing:
        raise SpecDecodeError(f"{converted}: the target has no {', '.join(missing)}")
    return found


def export_distilled_hf(folder: Path, target_gguf: Path, dest: Path) -> Path:
    """Write the distilled draft in `folder` for the target `target_gguf` as the Hugging Face
    folder `dest` (through a temporary folder renamed into place). Refuses a draft trained for
    another target (SpecDecodeError naming the draft's file)."""
    from safetensors.torch import save_file

    from specdecode.drafters.distilled import VOCAB_KEY
    from specdecode.drafters.distilled_gguf import check_trained_for, draft_files
    from specdecode.models.loading import converted_folder

    raw, card, tensors = draft_files(folder)
    cfg = check_trained_for(folder, raw, card, target_gguf)
    tensors.pop(VOCAB_KEY, None)
    layers = len(raw["layers_from"])
    converted = converted_folder(target_gguf)
    hf_config = json.loads((converted / "config.json").read_text(encoding="utf-8"))
    shared = ["model.embed_tokens.weight"]
    if not hf_config.get("tie_word_embeddings", False):
        shared.append("lm_head.weight")
    weights = {**hf_block_tensors(tensors, cfg, layers), **_target_tensors(converted, shared)}
    hf_config["num_hidden_layers"] = layers
    hf_config["torch_dtype"] = "float32"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n",
                                         encoding="utf-8")
        for name in _COPIED:
            if (converted / name).is_file():
                shutil.copyfile(converted / name, tmp / name)
        (tmp / "SOURCE").write_text(
            f"distilled draft {folder} ({layers} blocks, head: the target's full vocabulary) "
            f"for target {converted}; specdecode export --format hf\n", encoding="utf-8")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def cached_hf_export(folder: Path, target_gguf: Path) -> Path:
    """The exported folder in the cache, exporting it first when no complete copy is there."""
    from specdecode.drafters.distilled_gguf import cache_key
    from specdecode.models.paths import cache_root

    key = cache_key(folder, target_gguf, f"hf-v{HF_EXPORT_VERSION}", "full")
    dest = cache_root() / "drafts" / f"distilled-{key}-hf"
    if (dest / "config.json").is_file():
        return dest
    print(f"specdecode: exporting the distilled draft {folder.name} to {dest} (once)",
          file=sys.stderr)
    return export_distilled_hf(folder, target_gguf, dest)
