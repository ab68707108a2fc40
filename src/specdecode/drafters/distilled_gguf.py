"""The distilled draft (drafters.distilled) on the llama.cpp backend: exported to GGUF once,
cached, and run in a llama.cpp context of its own, as `--drafter draft-model` runs a GGUF draft.

Export (`export_distilled_gguf`): the draft's own blocks and final norm (the shipped bf16 weights,
stored f32, f16, Q8_0 or Q4_0 through the `gguf` library's quantizers), the target GGUF's
embedding and LM head as the target stores them (raw blocks, nothing re-quantized) and its
hyper-parameters and tokenizer. Two heads:

- `subset` (the default for `--drafter distilled`): the GGUF's vocabulary is the draft's reduced
  one (`vocab_ids`, the rows its head scores), so llama.cpp's output product covers 12,288 rows
  instead of 49,152. llama.cpp needs one vocabulary size for the input embedding and the head,
  so the draft is fed input *embeddings* (rows of the target's table, kept beside the GGUF in a
  safetensors sidecar) instead of token ids, and its logits are spread back over the target's
  vocabulary with -inf elsewhere: q is a proper distribution over the subset and zero outside,
  which verification handles losslessly (drafters.distilled). Measured on SmolLM2 (1 thread):
  c = 0.07-0.11 of a target step against 0.23 with the full head, the same greedy agreement
  (docs/measurements/llamacpp.md).
- `full`: one self-contained GGUF with the target's whole vocabulary, usable by llama.cpp's own
  tools or `--drafter draft-model`; its head scores every token, those outside the training
  subset included (never trained down, so q differs from the native draft's there).

The draft was trained for one target: the export refuses a target GGUF whose weights (as the
native runner loads them) do not have the sha256 recorded in the draft's card.

`cached_export` keys the file by the sha256 of its inputs (the target GGUF, the draft's files,
the options, the exporter's version) in `~/.cache/specdecode/drafts/` (`$SPECDECODE_CACHE`), written
under temporary names and renamed into place, the sidecar before the GGUF, so a GGUF present
means a complete pair. The weight type never affects losslessness (the target verifies every
token); it moves the draft's cost and how often its tokens are accepted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.drafters.base import Drafter
from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig
from specdecode.models.llamacpp import (  # import llama_cpp only when one loads
    LlamaCppCache,
    LlamaCppModel,
)
from specdecode.models.target import Cache

EXPORT_VERSION = "1"  # bump when the exported file changes
WEIGHT_TYPES = ("f32", "f16", "q8_0", "q4_0")
DEFAULT_WEIGHT_TYPE = "q8_0"  # c 0.07-0.11 (f32 0.11-0.16), agreement as f32; Q4_0 drifts
HEADS = ("subset", "full")
DEFAULT_HEAD = "subset"
SIDECAR_SUFFIX = ".embed.safetensors"
SIDECAR_FORMAT = "specdecode-gguf-draft-input"
META = "specdecode.draft."  # the exported GGUF's own metadata keys
_BATCH = 512  # positions per llama_decode call (the backend's batch size)


def sidecar_path(gguf_path: Path) -> Path:
    """Where a subset-head draft keeps its input embedding and vocabulary ids."""
    return gguf_path.with_name(gguf_path.name.removesuffix(".gguf") + SIDECAR_SUFFIX)


# --- export ----------------------------------------------------------------------------------


def _read_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise SpecDecodeError(f"{path}: no such file (the target GGUF)")
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, OSError...
        raise SpecDecodeError(f"{path}: not a readable GGUF ({exc})") from exc


def draft_files(folder: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, card.json, tensors) of a distilled draft folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specdecode.drafters.distilled import WEIGHTS_FILE, read_config
    from specdecode.models.cards import read_card

    raw = read_config(folder)
    card = read_card(folder)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as exc:
        raise SpecDecodeError(f"{folder / WEIGHTS_FILE}: missing or unreadable ({exc})") from exc
    return raw, card, tensors


def check_trained_for(folder: Path, raw: dict[str, Any], card: dict[str, Any],
                      target_gguf: Path) -> ModelConfig:
    """The target's config, after refusing a draft whose card names other target weights, or
    whose config.json (`raw`) names another width or vocabulary.

    The card records the sha256 of the target's weights as the native runner holds them
    (train.checkpoint.weights_sha256), so the check loads the target's cached fp32 conversion
    once (a few seconds for SmolLM2; an export runs once per inputs, then the cache serves).
    """
    from specdecode.drafters.distilled import CONFIG_FILE, WEIGHTS_FILE
    from specdecode.models.cards import check_target
    from specdecode.models.config import config_from_hf, read_hf_config
    from specdecode.models.loading import converted_folder, load_native

    converted = converted_folder(target_gguf)
    cfg = config_from_hf(read_hf_config(converted), str(converted / "config.json"))
    native = load_native(converted, cfg)
    check_target(card, native, folder / WEIGHTS_FILE)
    if raw.get("hidden_size") != cfg.hidden_size or \
            raw.get("target_vocab_size") != cfg.vocab_size:
        raise SpecDecodeError(f"{folder / CONFIG_FILE}: a draft of width {raw.get('hidden_size')}"
                              f" and vocabulary {raw.get('target_vocab_size')}, the target has "
                              f"{cfg.hidden_size} and {cfg.vocab_size}")
    return cfg


def _matrix(w: np.ndarray, weight_type: str) -> tuple[np.ndarray, Any]:
    """A 2-D weight stored as `weight_type`: (array, raw GGML type or None for plain floats)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    if weight_type == "f32":
        return w, None
    if weight_type == "f16":
        return w.astype(np.float16), None
    qtype = GGMLQuantizationType.Q8_0 if weight_type == "q8_0" else GGMLQuantizationType.Q4_0
    if w.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return w, None  # rows not in whole blocks cannot be quantized: kept exact
    return quants.quantize(w, qtype), qtype


def _put(writer: Any, name: str, w: np.ndarray, weight_type: str) -> None:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim == 1:  # norms and biases stay f32, as llama.cpp's converters keep them
        writer.add_tensor(name, w)
        return
    data, qtype = _matrix(w, weight_type)
    if qtype is None:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def _raw_rows(tensor: Any, rows: np.ndarray | None) -> np.ndarray:
    """A GGUF tensor's rows as stored (bytes per row: blocks of whatever type), some or all."""
    data = np.asarray(tensor.data)
    data = data if rows is None else data[rows]
    return np.ascontiguousarray(data).view(np.uint8)


def _field_value(field: Any) -> Any:
    return field.contents()


def _copy_field(writer: Any, key: str, field: Any, value: Any = None) -> None:
    """Copy a metadata field with its own GGUF types (an array's element type included)."""
    from gguf import GGUFValueType

    types = field.types
    value = field.contents() if value is None else value
    if types[0] == GGUFValueType.ARRAY:
        if len(value):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, types[-1])
    else:
        writer.add_key_value(key, value, types[0])


def _write_tokenizer(writer: Any, fields: dict[str, Any], ids: np.ndarray | None) -> None:
    """The target's tokenizer fields; with `ids`, cut to those tokens (ids renumbered by their
    place in `ids`; merges kept only where both parts and the result remain). The cut tokenizer
    never tokenizes text here (the draft is fed embeddings); llama.cpp only needs it loadable."""
    tokenizer = {k: f for k, f in fields.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in tokenizer:
        raise SpecDecodeError("the target GGUF has no tokenizer to copy")
    if ids is None:
        for key, field in tokenizer.items():
            _copy_field(writer, key, field)
        return
    place = {int(t): i for i, t in enumerate(ids.tolist())}
    tokens = _field_value(tokenizer["tokenizer.ggml.tokens"])
    kept = [tokens[i] for i in ids.tolist()]
    kept_set = set(kept)
    for key, field in tokenizer.items():
        if key == "tokenizer.ggml.tokens":
            _copy_field(writer, key, field, kept)
        elif key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            values = _field_value(field)
            _copy_field(writer, key, field, [values[i] for i in ids.tolist()])
        elif key == "tokenizer.ggml.merges":
            merges = [m for m in _field_value(field)
                      if len(parts := m.split(" ")) == 2 and parts[0] in kept_set
                      and parts[1] in kept_set and parts[0] + parts[1] in kept_set]
            _copy_field(writer, key, field, merges)
        elif key.endswith("_token_id"):
            old = int(_field_value(field))
            if old in place:
                _copy_field(writer, key, field, place[old])
        else:
            _copy_field(writer, key, field)


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}


def export_distilled_gguf(folder: Path, target_gguf: Path, dest: Path, *,
                          weight_type: str = DEFAULT_WEIGHT_TYPE, head: str = DEFAULT_HEAD
                          ) -> Path:
    """Write the distilled draft in `folder` for the target `target_gguf` as the GGUF `dest`
    (and, for the subset head, its sidecar), each through a temporary file renamed into place.
    Refuses a draft trained for another target (SpecDecodeError naming the draft's file)."""
    from gguf import GGUFWriter, LlamaFileType

    from specdecode.drafters.distilled import VOCAB_KEY

    if weight_type not in WEIGHT_TYPES:
        raise SpecDecodeError(f"weight type {weight_type!r}: one of {', '.join(WEIGHT_TYPES)}")
    if head not in HEADS:
        raise SpecDecodeError(f"head {head!r}: one of {', '.join(HEADS)}")
    raw, card, tensors = draft_files(folder)
    reader = _read_gguf(target_gguf)
    fields = dict(reader.fields)
    arch = _field_value(fields["general.architecture"]) if "general.architecture" in fields \
        else None
    if arch != "llama":
        raise SpecDecodeError(f"{target_gguf}: the distilled draft's GGUF export covers the "
                              f"llama architecture, this target is {arch!r}")
    cfg = check_trained_for(folder, raw, card, target_gguf)
    vocab = tensors.pop(VOCAB_KEY, None)
    ids = None if vocab is None or head == "full" else vocab.numpy().astype(np.int64)
    layers = len(raw["layers_from"])
    by_name = {t.name: t for t in reader.tensors}
    embed = by_name["token_embd.weight"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    side, side_tmp = sidecar_path(dest), sidecar_path(dest).with_name(
        f".{sidecar_path(dest).name}.tmp-{os.getpid()}")
    try:
        writer = GGUFWriter(str(tmp), arch)
        skip = {"general.architecture", "general.name", "general.file_type",
                f"{arch}.block_count", f"{arch}.vocab_size"}
        for key, field in fields.items():
            if key.startswith("GGUF.") or key.startswith("tokenizer.") or key in skip:
                continue
            _copy_field(writer, key, field)
        writer.add_name(f"{card.get('target', 'target')} distilled draft ({layers} blocks)")
        writer.add_file_type(LlamaFileType[_FILE_TYPES[weight_type]])
        writer.add_block_count(layers)
        writer.add_vocab_size(cfg.vocab_size if ids is None else len(ids))
        _write_tokenizer(writer, fields, ids)
        writer.add_string(META + "kind", "distilled")
        writer.add_string(META + "head", head if ids is not None else "full")
        writer.add_string(META + "weight_type", weight_type)
        writer.add_string(META + "target_sha256", str(card.get("target_sha256", "")))
        writer.add_uint32(META + "target_vocab_size", cfg.vocab_size)
        writer.add_string(META + "export_version", EXPORT_VERSION)
        rows = _raw_rows(embed, ids)
        writer.add_tensor("token_embd.weight", rows, raw_shape=rows.shape,
                          raw_dtype=embed.tensor_type)
        if "output.weight" in by_name:  # an untied head: its rows, as stored
            out = by_name["output.weight"]
            head_rows = _raw_rows(out, ids)
            writer.add_tensor("output.weight", head_rows, raw_shape=head_rows.shape,
                              raw_dtype=out.tensor_type)
        _write_blocks(writer, tensors, cfg, layers, weight_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if ids is not None:
            _write_sidecar(side_tmp, embed, ids, cfg, layers, target_gguf)
            os.replace(side_tmp, side)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)
    return dest


def _write_blocks(writer: Any, tensors: dict[str, torch.Tensor], cfg: ModelConfig, layers: int,
                  weight_type: str) -> None:
    """The draft's blocks (native runner names, fused qkv and gate_up) under llama.cpp's names;
    q and k rows permuted into llama.cpp's RoPE layout, as gguf_write does."""
    from specdecode.models.gguf_write import _permute

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise SpecDecodeError(f"the distilled draft has no weight '{name}'")
        return tensors[name].float().numpy()

    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for j in range(layers):
        p, g = f"layers.{j}.", f"blk.{j}."
        qkv = take(p + "qkv.weight")
        _put(writer, g + "attn_norm.weight", take(p + "attn_norm"), weight_type)
        _put(writer, g + "attn_q.weight", _permute(qkv[:nq], cfg.num_heads), weight_type)
        _put(writer, g + "attn_k.weight", _permute(qkv[nq:nq + nkv], cfg.num_kv_heads),
             weight_type)
        _put(writer, g + "attn_v.weight", qkv[nq + nkv:], weight_type)
        if p + "qkv.bias" in tensors:
            bias = take(p + "qkv.bias")
            _put(writer, g + "attn_q.bias", _permute(bias[:nq], cfg.num_heads), weight_type)
            _put(writer, g + "attn_k.bias", _permute(bias[nq:nq + nkv], cfg.num_kv_heads),
                 weight_type)
            _put(writer, g + "attn_v.bias", bias[nq + nkv:], weight_type)
        _put(writer, g + "attn_output.weight", take(p + "o.weight"), weight_type)
        _put(writer, g + "ffn_norm.weight", take(p + "mlp_norm"), weight_type)
        gate_up = take(p + "gate_up.weight")
        half = gate_up.shape[0] // 2
        _put(writer, g + "ffn_gate.weight", gate_up[:half], weight_type)
        _put(writer, g + "ffn_up.weight", gate_up[half:], weight_type)
        _put(writer, g + "ffn_down.weight", take(p + "down.weight"), weight_type)
    _put(writer, "output_norm.weight", take("norm"), weight_type)


def _write_sidecar(path: Path, embed: Any, ids: np.ndarray, cfg: ModelConfig, layers: int,
                   target_gguf: Path) -> None:
    """The subset draft's input side: the target's whole embedding table as stored (raw rows),
    the vocabulary ids its head scores, and what it was made from."""
    from safetensors.numpy import save_file

    from specdecode.models.loading import file_digest

    save_file({"token_embd": _raw_rows(embed, None), "vocab_ids": ids.astype(np.int64)},
              str(path), metadata={
                  "format": SIDECAR_FORMAT, "ggml_type": str(int(embed.tensor_type)),
                  "n_embd": str(cfg.hidden_size), "layers": str(layers),
                  "target_vocab_size": str(cfg.vocab_size),
                  "target_gguf_sha256": file_digest(target_gguf)})


# --- the cache -------------------------------------------------------------------------------


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256, per process


def _digest(path: Path) -> str:
    """file_digest, remembered per process for a file unchanged in size and mtime (a bench makes
    several factories for one target: hash its GGUF once)."""
    from specdecode.models.loading import file_digest

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = file_digest(path)
    return _DIGESTS[key]


def cache_key(folder: Path, target_gguf: Path, weight_type: str, head: str) -> str:
    """sha256 of everything the exported file depends on."""
    from specdecode.drafters.distilled import CONFIG_FILE, WEIGHTS_FILE
    from specdecode.models.cards import CARD_JSON

    h = hashlib.sha256(f"v{EXPORT_VERSION};{weight_type};{head};".encode())
    for path in (target_gguf, folder / WEIGHTS_FILE, folder / CONFIG_FILE, folder / CARD_JSON):
        if not path.is_file():
            raise SpecDecodeError(f"{path}: no such file")
        h.update(f"{path.name}:{_digest(path)};".encode())
    return h.hexdigest()[:32]


def cached_export(folder: Path, target_gguf: Path, *, weight_type: str = DEFAULT_WEIGHT_TYPE,
                  head: str = DEFAULT_HEAD) -> Path:
    """The exported draft in the cache, exporting it first when no complete copy is there."""
    from specdecode.models.paths import cache_root

    key = cache_key(folder, target_gguf, weight_type, head)
    dest = cache_root() / "drafts" / f"distilled-{key}.gguf"
    if dest.is_file() and (head == "full" or sidecar_path(dest).is_file()):
        return dest
    # the first use waits for the target's identity check and the quantization (seconds)
    print(f"specdecode: exporting the distilled draft {folder.name} to {dest} (once)",
          file=sys.stderr)
    return export_distilled_gguf(folder, target_gguf, dest, weight_type=weight_type, head=head)


# --- running a subset-head draft on llama.cpp ------------------------------------------------


class EmbeddingRows:
    """Rows of an embedding table kept as stored in a GGUF (raw blocks), de-quantized on
    demand: exactly the values llama.cpp's own lookup would give."""

    def __init__(self, raw: np.ndarray, ggml_type: int, n_embd: int) -> None:
        from gguf import GGMLQuantizationType

        self.raw, self.n_embd = raw, n_embd
        self.qtype = GGMLQuantizationType(ggml_type)

    def __call__(self, ids: Sequence[int]) -> np.ndarray:
        """(len(ids), n_embd) float32."""
        from gguf import GGMLQuantizationType, quants

        rows = self.raw[np.asarray(ids, dtype=np.int64)]
        if self.qtype == GGMLQuantizationType.F32:
            return rows.view(np.float32)
        if self.qtype == GGMLQuantizationType.Q8_0:  # 3x faster than the generic path
            blocks = rows.reshape(len(rows), -1, 34)  # f16 scale, then 32 int8 values
            scale = blocks[..., :2].copy().view(np.float16).astype(np.float32)
            return (scale * blocks[..., 2:].view(np.int8)).reshape(len(rows), self.n_embd)
        return np.asarray(quants.dequantize(rows, self.qtype), dtype=np.float32).reshape(
            len(rows), self.n_embd)


def load_gguf_draft(path: Path, target: LlamaCppModel) -> SubsetDraft:
    """A GGUF draft for a llama.cpp target: a subset-head export (with its sidecar) as a
    SubsetDraft, fed embeddings; refused if it was exported for another target GGUF."""
    from safetensors import SafetensorError, safe_open

    side = sidecar_path(path)
    try:
        with safe_open(str(side), framework="numpy") as f:
            meta = f.metadata() or {}
            raw, ids = f.get_tensor("token_embd"), f.get_tensor("vocab_ids")
    except (SafetensorError, OSError, ValueError) as exc:
        raise SpecDecodeError(f"{side}: missing or unreadable draft sidecar ({exc})") from exc
    if meta.get("format") != SIDECAR_FORMAT:
        raise SpecDecodeError(f"{side}: not a draft sidecar (format != {SIDECAR_FORMAT})")
    if meta.get("target_gguf_sha256") != _digest(Path(target.path)):
        raise SpecDecodeError(f"{path}: this draft was exported for another target GGUF than "
                              f"{target.path} (its input embedding is that target's); export it "
                              "for this one (`specdecode export`)")
    if int(meta["target_vocab_size"]) != target.cfg.vocab_size:
        raise SpecDecodeError(f"{path}: a draft for a vocabulary of {meta['target_vocab_size']} "
                              f"tokens, the target has {target.cfg.vocab_size}")
    embed = EmbeddingRows(raw, int(meta["ggml_type"]), int(meta["n_embd"]))
    sequences = max(4, target.n_ctx // target.capacity_per_row)  # as many rows as the target
    return SubsetDraft(path, target.cfg, ids, embed, int(meta["layers"]),
                       threads=target.threads, sequences=sequences)


class SubsetDraft(LlamaCppModel):
    """A llama.cpp draft whose vocabulary is a subset `ids` of the target's: fed input
    embeddings (the target's rows), it returns logits over the target's whole vocabulary, -inf
    outside the subset. One row per call (a draft model drafts in its own cache, row by row)."""

    def __init__(self, path: Path, target_cfg: ModelConfig, ids: np.ndarray, embed: EmbeddingRows,
                 layers: int, *, threads: int | None = None, sequences: int | None = None
                 ) -> None:
        own = dataclasses.replace(target_cfg, num_layers=layers, vocab_size=len(ids))
        super().__init__(path, own, threads=threads, sequences=sequences)
        self.cfg = dataclasses.replace(own, vocab_size=target_cfg.vocab_size)
        self.ids = torch.as_tensor(ids, dtype=torch.long)
        # the subset is the lowest ids as training picks them: then a slice, not a scatter
        self.prefix = bool(torch.equal(self.ids, torch.arange(len(ids))))
        self.embed = embed
        self._embd_batch = self.L.llama_batch_init(_BATCH, embed.n_embd, 1)
        self._embd = np.ctypeslib.as_array(self._embd_batch.embd, shape=(_BATCH, embed.n_embd))
        # one drafting step's logits, returned as a view (the caller uses them before its next
        # call, as with the base class's view of llama.cpp's buffer): only the subset's columns
        # are written each step; a fresh -inf fill of the whole vocabulary crosses torch's
        # parallel grain and was slow (docs/measurements/code-figures.md)
        self._row = torch.full((1, 1, target_cfg.vocab_size), float("-inf"))

    def __call__(
        self,
        tokens: torch.Tensor,  # (1, T) int64
        cache: Cache,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        num_new: Sequence[int] | None = None,
        logits_for: str | torch.Tensor = "all",
        layers: Sequence[int] | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Score T new positions of one row; logits (1, T', target vocabulary). One position's
        logits are a view the next call overwrites (copy what is kept)."""
        B, T = tokens.shape
        if B != 1 or num_new is not None or positions is not None or tree_mask is not None \
                or layers is not None or return_hidden:
            raise SpecDecodeError("a subset-head GGUF draft scores one row of new tokens")
        if not isinstance(cache, LlamaCppCache):
            raise SpecDecodeError("a llama.cpp draft scores in its own caches only")
        cache.check_room(T)
        if isinstance(logits_for, torch.Tensor):
            wanted = sorted(int(i) % T for i in logits_for.tolist())
        else:
            wanted = {"all": list(range(T)), "last": [T - 1], "none": []}[logits_for]
        if wanted and wanted[0] < (T - 1) // _BATCH * _BATCH:  # llama.cpp keeps the last
            # call's outputs only: the logits asked for must all lie in the last chunk
            raise SpecDecodeError(f"at most {_BATCH} positions per call with logits")
        ids, start, seq, batch = tokens[0].tolist(), cache.lengths[0], cache.seq_ids[0], \
            self._embd_batch
        want = set(wanted)
        for s in range(0, T, _BATCH):
            e = min(T, s + _BATCH)
            self._embd[: e - s] = self.embed(ids[s:e])
            for i, t in enumerate(range(s, e)):
                batch.pos[i] = start + t
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = t in want
            batch.n_tokens = e - s
            self._decode(batch)
        cache.lengths[0] += T
        if not wanted:
            return torch.zeros(1, 0, 0)
        sub = self._logits(len(wanted))  # (T', n): a view of llama.cpp's buffer
        if len(wanted) == 1:  # a drafting step: the reused row, -inf outside the subset
            out = self._row
        else:
            out = torch.full((1, len(wanted), self.cfg.vocab_size), float("-inf"))
        if self.prefix:
            out[0, :, : sub.shape[1]] = sub
        else:
            out[0][:, self.ids] = sub
        return out

    def weight_bytes(self) -> int:
        return super().weight_bytes() + int(self.embed.raw.nbytes)  # + the input table

    def close(self) -> None:
        if self._ctx:
            self.L.llama_batch_free(self._embd_batch)
        super().close()


# --- the drafter -----------------------------------------------------------------------------


def llamacpp_distilled_factory(target: LlamaCppModel, folder: Path, capacity: int
                               ) -> Callable[[], Drafter]:
    """`--drafter distilled` on a llama.cpp target: the export (cached), drafting as
    `--drafter draft-model` does, in the draft's own llama.cpp context."""
    from specdecode.drafters.draft_model import DraftModelDrafter

    path = cached_export(folder, Path(target.path))
    draft = load_gguf_draft(path, target)
    return lambda: DraftModelDrafter(draft, "distilled", capacity)
