"""Convert a GGUF checkpoint of a supported family into a Hugging Face-layout folder.

Weights are de-quantized exactly (the GGUF's values, in fp32) and written as safetensors with
Hugging Face names; attn_q / attn_k rows are un-permuted from llama.cpp's RoPE layout back to the
rotate-half layout. The tokenizer and chat template are read from the GGUF metadata through
transformers' GGUF tokenizer converter. The caller writes into a temporary folder and renames it.

Gemma 3 GGUFs (no native runner) are de-quantized by transformers' own GGUF loader instead and
written as a folder that `load_model` runs on the transformers adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from specdecode.errors import SpecDecodeError

GGUF_FAMILIES = ("llama", "qwen2")
ADAPTER_FAMILIES = ("gemma3",)  # converted through transformers' GGUF loader, run on the adapter

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config_from_gguf(reader: Any, path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise SpecDecodeError(
            f"{path}: GGUF architecture '{arch}' is not supported "
            f"(supported: {', '.join(GGUF_FAMILIES + ADAPTER_FAMILIES)}); convert it to a "
            "Hugging Face folder and use --backend transformers"
        )
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    rope: dict[str, Any] = {"rope_type": "default"}
    rope["rope_theta"] = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(_field(reader, f"{arch}.rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise SpecDecodeError(f"{path}: rope scaling '{scaling}' is not supported")
    return {
        "model_type": "llama" if arch == "llama" else "qwen2",
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    pairs = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def readable_types() -> list[str]:
    """The GGUF tensor types the converter de-quantizes (gguf-py's, plus F32 and F16)."""
    from gguf.quants import _type_traits

    return ["F32", "F16", *(t.name for t in _type_traits)]


def gguf_state_dict(reader: Any, config: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    permute_q = config["model_type"] == "llama"  # llama.cpp permutes q/k only for llama
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            if tensor.name.startswith("rope_freqs"):
                continue
            raise SpecDecodeError(f"{path}: unexpected tensor '{tensor.name}'")
        try:
            w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as exc:
            raise SpecDecodeError(
                f"{path}: tensor '{tensor.name}' is stored as {tensor.tensor_type.name}, which "
                f"the native runner cannot read (it reads {', '.join(readable_types())}); run "
                "this file with --backend llama.cpp, or re-quantize it to one of those types"
            ) from exc
        if permute_q and tensor.name.endswith("attn_q.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif permute_q and tensor.name.endswith("attn_k.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return out


def convert_gguf(path: Path, dest: Path) -> None:
    """Write config.json, model.safetensors and tokenizer files for `path` into folder `dest`."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, OSError...
        raise SpecDecodeError(f"{path}: not a readable GGUF file ({exc})") from exc
    if _field(reader, "general.architecture") in ADAPTER_FAMILIES:
        _convert_with_transformers(path, dest)
        return
    config = hf_config_from_gguf(reader, path)
    state = gguf_state_dict(reader, config, path)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    _convert_tokenizer(path, dest)


def _convert_with_transformers(path: Path, dest: Path) -> None:
    """A family without a native runner (Gemma 3): transformers de-quantizes the GGUF, and its
    weights, config and tokenizer are written as a folder for the transformers adapter."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises ValueError, KeyError, RuntimeError...
        raise SpecDecodeError(f"{path}: transformers cannot read this GGUF ({exc})") from exc
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(dest))
    _convert_tokenizer(path, dest)


def _convert_tokenizer(path: Path, dest: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise SpecDecodeError(f"{path}: cannot read the tokenizer from the GGUF ({exc})") from exc
    tok.save_pretrained(str(dest))
