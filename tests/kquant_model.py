"""A tiny random Qwen2 checkpoint stored the way the Qwen2.5-Coder pair's GGUFs are: K-quant
blocks (Q4_K, Q6_K) for most matrices, Q5_0 and Q8_0 where the draft's file uses them, F32 norms
and attention biases, an untied head. The tests of the loaders, the llama.cpp backend and the
native K-quant path share it (issue #44).

The K-quant blocks are random *codes* (gguf-py 0.19 de-quantizes Q4_K/Q6_K but cannot quantize
them): every bit of every field is drawn, so a decoder that misreads any bit pattern (the
6-bit scales packed across the 12 scale bytes of Q4_K, the 2 high bits of Q6_K) gives other
values. Their scales are chosen so activations stay of order one through the blocks. Q5_0 and
Q8_0 blocks come from gguf-py's own quantizer. Written with the stand-in byte tokenizer of
models.gguf_write.

Block layouts (ggml-common.h): Q4_K, 256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of
eight 6-bit scales and eight 6-bit mins, 128 bytes of 4-bit codes; w = d * scale * q - dmin *
min. Q6_K, 256 weights in 210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8
scales, fp16 d; w = d * scale * (q - 32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

QK_K = 256
Q4_K_BYTES = 144
Q6_K_BYTES = 210

# hidden 256: K-quant rows need a multiple of 256 inputs; GQA 4 query / 2 KV heads of 64
TINY_QWEN2 = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
              "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "context": 512}


def q4_k_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """(rows, cols/256*144) uint8 of random Q4_K blocks whose weights have about `std`."""
    nb = rows * cols // QK_K
    raw = rng.integers(0, 256, size=(nb, Q4_K_BYTES), dtype=np.uint8)
    # weights = d*sc*q - dmin*m with q uniform in 0..15 and sc, m uniform 6-bit: d = std/252
    # gives a spread near std (measured), dmin = 6.75 d a mean near zero
    d = np.full(nb, std / 252, dtype=np.float16)
    dmin = np.full(nb, std / 252 * 6.75, dtype=np.float16)
    raw[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    raw[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, cols // QK_K * Q4_K_BYTES)


def q6_k_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """(rows, cols/256*210) uint8 of random Q6_K blocks whose weights have about `std`."""
    nb = rows * cols // QK_K
    raw = rng.integers(0, 256, size=(nb, Q6_K_BYTES), dtype=np.uint8)
    scales = rng.integers(-48, 48, size=(nb, 16), dtype=np.int8)  # signed, like real files
    raw[:, 192:208] = scales.view(np.uint8)
    # (q - 32) has std ~18.5 and |scale| ~24: d ~ std / (18.5 * 28)
    d = np.full(nb, std / (18.5 * 28), dtype=np.float16)
    raw[:, 208:210] = d.view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, cols // QK_K * Q6_K_BYTES)


def _kinds(layer: int) -> dict[str, str]:
    """The weight type of each matrix of `layer`: Q4_K_M's choice (Q6_K for attn_v and
    ffn_down), and in the second layer Q5_0 / Q8_0 matrices as in the draft's file."""
    kinds = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
             "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
    if layer == 1:
        kinds.update(attn_k="Q5_0", attn_v="Q8_0")
    return kinds


def write_tiny_qwen2_kquant(dest: Path, seed: int = 0, std: float = 0.06,
                            head_kind: str = "Q6_K") -> Path:
    """Write the tiny K-quant Qwen2 GGUF to `dest`; returns `dest`. `head_kind`: the LM head's
    type (I8: a type no loader here de-quantizes, for the tests of that refusal)."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    from specdecode.models.gguf_vocab import byte_vocab

    c = TINY_QWEN2
    rng = np.random.default_rng(seed)
    hidden, ff, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = hidden // c["num_heads"]
    kv = c["num_kv_heads"] * head_dim
    w = GGUFWriter(str(dest), "qwen2")
    w.add_name("tiny-qwen2-kquant")
    w.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    w.add_context_length(c["context"])
    w.add_embedding_length(hidden)
    w.add_block_count(c["num_layers"])
    w.add_feed_forward_length(ff)
    w.add_head_count(c["num_heads"])
    w.add_head_count_kv(c["num_kv_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_vocab_size(vocab)
    byte_vocab(w, vocab, eos=vocab - 1)

    def matrix(name: str, kind: str, rows: int, cols: int, scale: float = 1.0) -> None:
        s = std * scale
        if kind == "Q4_K":
            w.add_tensor(name, q4_k_blocks(rng, rows, cols, s), raw_dtype=GGMLQuantizationType.Q4_K)
        elif kind == "Q6_K":
            w.add_tensor(name, q6_k_blocks(rng, rows, cols, s), raw_dtype=GGMLQuantizationType.Q6_K)
        elif kind == "I8":
            w.add_tensor(name, rng.integers(-8, 8, size=(rows, cols), dtype=np.int8))
        else:
            qtype = GGMLQuantizationType[kind]
            values = rng.normal(0.0, s, size=(rows, cols)).astype(np.float32)
            w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, mean: float, spread: float) -> None:
        w.add_tensor(name, (mean + spread * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", "Q4_K", vocab, hidden, scale=8.0)
    for i in range(c["num_layers"]):
        kinds, p = _kinds(i), f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0, 0.1)
        for part, rows in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            matrix(p + part + ".weight", kinds[part], rows, hidden)
            vector(p + part + ".bias", rows, 0.0, 0.2)  # Qwen2's q/k/v biases
        matrix(p + "attn_output.weight", kinds["attn_output"], hidden, hidden)
        vector(p + "ffn_norm.weight", hidden, 1.0, 0.1)
        matrix(p + "ffn_gate.weight", kinds["ffn_gate"], ff, hidden)
        matrix(p + "ffn_up.weight", kinds["ffn_up"], ff, hidden)
        matrix(p + "ffn_down.weight", kinds["ffn_down"], hidden, ff)
    vector("output_norm.weight", hidden, 1.0, 0.1)
    matrix("output.weight", head_kind, vocab, hidden, scale=4.0)  # untied, as in the pair
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def decode_q4_k(raw: np.ndarray, broken: bool = False) -> np.ndarray:
    """Q4_K blocks (n, 144) uint8 -> weights (n, 256) float32, as ggml's dequantize_row_q4_K
    computes them. `broken`: the upper four sub-blocks read their scale and min from the wrong
    bits (a decoding bug the tests must catch)."""
    f16 = np.float16
    d = raw[:, 0:2].copy().view(f16).astype(np.float32)
    dmin = raw[:, 2:4].copy().view(f16).astype(np.float32)
    sc = raw[:, 4:16].astype(np.uint32)
    qs = raw[:, 16:144]
    scales = np.empty((len(raw), 8), np.float32)
    mins = np.empty((len(raw), 8), np.float32)
    for j in range(4):
        scales[:, j], mins[:, j] = sc[:, j] & 63, sc[:, j + 4] & 63
    for j in range(4, 8):
        low, high = (sc[:, j + 4] & 0xF, sc[:, j + 4] >> 4) if not broken else \
            (sc[:, j + 4] >> 4, sc[:, j + 4] & 0xF)
        scales[:, j] = low | ((sc[:, j - 4] >> 6) << 4)
        mins[:, j] = high | ((sc[:, j] >> 6) << 4)
    out = np.empty((len(raw), QK_K), np.float32)
    for c in range(4):
        q = qs[:, 32 * c:32 * c + 32]
        for half, codes in ((0, q & 0xF), (1, q >> 4)):
            s = 2 * c + half
            d1 = d[:, 0:1] * scales[:, s:s + 1]
            m1 = dmin[:, 0:1] * mins[:, s:s + 1]
            out[:, 64 * c + 32 * half:64 * c + 32 * half + 32] = d1 * codes.astype(np.float32) - m1
    return out


def decode_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K blocks (n, 210) uint8 -> weights (n, 256) float32 (ggml's dequantize_row_q6_K)."""
    ql, qh = raw[:, 0:128].astype(np.int32), raw[:, 128:192].astype(np.int32)
    sc = raw[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = raw[:, 208:210].copy().view(np.float16).astype(np.float32)
    out = np.empty((len(raw), QK_K), np.float32)
    for half in range(2):
        lo, hi, s = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32], 8 * half
        quads = (((lo[:, :32] & 0xF) | ((hi & 3) << 4)) - 32,
                 ((lo[:, 32:] & 0xF) | (((hi >> 2) & 3) << 4)) - 32,
                 ((lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4)) - 32,
                 ((lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)) - 32)
        for k, q in enumerate(quads):
            for part in range(2):  # each 32 values take two 16-wide scales
                cols = slice(128 * half + 32 * k + 16 * part, 128 * half + 32 * k + 16 * part + 16)
                scale = sc[:, s + 2 * k + part:s + 2 * k + part + 1]
                out[:, cols] = d * scale * q[:, 16 * part:16 * part + 16].astype(np.float32)
    return out
