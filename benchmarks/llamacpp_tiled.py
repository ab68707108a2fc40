"""Which ggml kernel makes llama.cpp's logits depend on the draft width on K-quant GGUFs, and
what turning it off costs (issue #44 item 4).

ggml's CPU backend (the llama.cpp that llama-cpp-python 0.3.36 vendors) sends a matrix product
of K-quant or IQ weights (Q2_K..Q6_K, IQ*) to its tiled kernel (ggml-cpu/tiled/tiled.cpp) when
the activations have 8 rows or more (`ggml_tiled_min_batch`: "profitable at rows >= 8"), and to
the per-row vector-dot kernels below that: a position scored alone and inside a width-8 pass
gets different logits. Two environment variables, each read once per process, choose the path:
GGML_CPU_TILED_MM=0 (the vector-dot kernels at every width) and GGML_CPU_TILED_MM_FORCE=1 (the
tiled kernel at every width). This script runs each mode in a child process (so the variable
is read fresh) and prints, per mode, the largest logit difference of a position scored alone
against the same position first in a pass of T = 2..16, between 16 positions scored one at a
time and in chunks of 4 and 8, and the median time of scoring T = 1..16 positions after
`--context` tokens (v(T) = t(T) / t(1)).

Usage: python benchmarks/llamacpp_tiled.py MODEL.gguf [--threads 2] [--context 256] [--reps 7]
(MODEL may be a catalog name: qwen2.5-coder-1.5b). Extra buffer types off, flash attention off,
as the backend opens models.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MODES = {"default (tiled at >= 8 rows)": {},
         "GGML_CPU_TILED_MM=0": {"GGML_CPU_TILED_MM": "0"},
         "GGML_CPU_TILED_MM_FORCE=1": {"GGML_CPU_TILED_MM_FORCE": "1"}}
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)


def child(path: str, threads: int, context: int, reps: int) -> dict[str, Any]:
    """Measure in this process (the mode's variable already set by the parent)."""
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 2048, 512, 512
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = 0
    ctx = L.llama_init_from_model(model, cp)
    nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], pos0: int) -> None:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        assert L.llama_decode(ctx, batch) == 0

    def rows(n: int) -> np.ndarray:
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n, nv)).copy()

    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(100, min(nv, 30000), size=context + 16)]
    batch.n_tokens = context
    for i in range(context):  # the context, no logits
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = toks[i], i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, 0
    assert L.llama_decode(ctx, batch) == 0
    new = toks[context:]
    decode(new[:1], context)
    alone = rows(1)[0]
    L.llama_memory_seq_rm(mem, 0, context, -1)
    widths = {}
    for w in WIDTHS[1:]:
        decode(new[:w], context)
        widths[w] = float(np.abs(rows(w)[0] - alone).max())
        L.llama_memory_seq_rm(mem, 0, context, -1)
    chunks = {}
    singles = []
    for t in range(16):
        decode(new[t:t + 1], context + t)
        singles.append(rows(1)[0])
    L.llama_memory_seq_rm(mem, 0, context, -1)
    for c in (4, 8, 16):
        got = []
        for s in range(0, 16, c):
            decode(new[s:s + c], context + s)
            got.extend(rows(c))
        chunks[c] = float(np.abs(np.array(got) - np.array(singles)).max())
        L.llama_memory_seq_rm(mem, 0, context, -1)
    ms = {}
    for w in WIDTHS:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            decode(new[:w], context)
            times.append(time.perf_counter() - t0)
            L.llama_memory_seq_rm(mem, 0, context, -1)
        ms[w] = float(np.median(times) * 1e3)
    return {"widths": widths, "chunks": chunks, "ms": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = args.model
    if not path.endswith(".gguf"):
        from specdecode.models.install import resolve

        found = resolve(path)
        path = str(found) if found else path
    if args.child:
        print(json.dumps(child(path, args.threads, args.context, args.reps)))
        return
    print(f"{Path(path).name}, {args.threads} threads, context {args.context}, median of "
          f"{args.reps}; extra buffer types off, flash attention off")
    for mode, env in MODES.items():
        out = subprocess.run(
            [sys.executable, __file__, path, "--child", "--threads", str(args.threads),
             "--context", str(args.context), "--reps", str(args.reps)],
            env={**os.environ, **env}, capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        t1 = got["ms"]["1"]
        print(f"\n{mode}")
        print("  max |logit diff| alone vs first of width T: " + " ".join(
            f"{w}:{d:.2g}" for w, d in got["widths"].items()))
        print("  16 positions one at a time vs chunks of 4/8/16: " + " ".join(
            f"{c}:{d:.2g}" for c, d in got["chunks"].items()))
        print("  ms (v(T)): " + " ".join(
            f"{w}:{m:.1f} ({m / t1:.2f})" for w, m in got["ms"].items()))


if __name__ == "__main__":
    main()
