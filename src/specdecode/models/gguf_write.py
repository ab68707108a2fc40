"""Write a Llama-family Hugging Face checkpoint (safetensors) as a GGUF that llama.cpp loads:
the inverse of models.gguf_convert. Used to put the tests' small random models (and drafts made
here) on the llama.cpp backend.

Weights are stored in f32 (exact; quantize with llama.cpp's own tools if wanted); attn_q / attn_k
rows are permuted into llama.cpp's RoPE layout. The tokenizer is copied from another GGUF (a
draft of the shipped target takes the target's), or, for test models whose vocabulary has no
text, a byte-level stand-in: 256 byte tokens, then placeholders, with one merge (llama.cpp
needs a loadable tokenizer even where nothing is ever tokenized).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig, config_from_hf, read_hf_config
from specdecode.models.gguf_convert import _LAYER_NAMES, _TOP_NAMES
from specdecode.models.gguf_vocab import byte_vocab

_GGUF_NAMES = {hf: gg for gg, hf in _TOP_NAMES.items()}
_GGUF_LAYER = {hf: gg for gg, hf in _LAYER_NAMES.items()}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotate-half rows -> llama.cpp's interleaved RoPE pairs (gguf_convert._unpermute undone)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    parts = hf.split(".", 3)  # model.layers.N.rest
    if len(parts) == 4 and parts[1] == "layers" and parts[3] in _GGUF_LAYER:
        return f"blk.{parts[2]}.{_GGUF_LAYER[parts[3]]}"
    raise SpecDecodeError(f"tensor '{hf}' has no GGUF name")


def _copy_tokenizer(writer: Any, source: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in fields:
        raise SpecDecodeError(f"{source}: no tokenizer in this GGUF to copy")
    writer.add_tokenizer_model(fields.pop("tokenizer.ggml.model"))
    writer.add_token_list(fields.pop("tokenizer.ggml.tokens"))
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)


def write_gguf(folder: Path, dest: Path, tokenizer_from: Path | None = None) -> ModelConfig:
    """Write the Llama checkpoint in `folder` to the GGUF file `dest`; returns its config."""
    from gguf import GGUFWriter, LlamaFileType

    from specdecode.models.loading import load_state_dict

    raw = read_hf_config(folder)
    cfg = config_from_hf(raw, str(folder / "config.json"))
    if cfg.family != "llama":
        raise SpecDecodeError(f"{folder}: only Llama checkpoints can be written as GGUF here")
    state = load_state_dict(folder)
    tmp = dest.with_name(dest.name + ".tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(folder.name)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer_from is not None:
        _copy_tokenizer(writer, tokenizer_from)
    else:
        byte_vocab(writer, cfg.vocab_size, cfg.eos_token_ids[0] if cfg.eos_token_ids else 2)
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        w = tensor.float().numpy()
        if name.endswith("self_attn.q_proj.weight"):
            w = _permute(w, cfg.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = _permute(w, cfg.num_kv_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dest)
    return cfg
