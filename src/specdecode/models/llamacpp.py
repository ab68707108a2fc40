"""The llama.cpp backend: a GGUF target run by llama.cpp's kernels (through llama-cpp-python's
low-level C API), behind the same interface as the native runner, so the engine drives it
unchanged: score explicit positions for several rows, return the logits asked for, roll back by
length.

Rows are llama.cpp sequences of one context. A cache (`LlamaCppCache`) holds sequence ids from
the context's pool; scoring a batch is one `llama_decode` over every row's new tokens, each with
its sequence id and absolute position; rolling back is `llama_memory_seq_rm` from the kept
length; copying a prefilled prompt into a batch row is `llama_memory_seq_cp` (cells are shared,
nothing is copied); a row that leaves hands its sequence id over instead of moving data.

Exactness: speculation is token-identical to plain decoding only if a position's logits do not
depend on what else is scored with it. Stock llama.cpp builds are not batch-invariant on CPU
(the llamafile sgemm kernels pick blockings by shape), so `batch_invariance` runs the shared
load-time check (models.invariance) plus a shape of its own, and speculation on a target that
fails it is refused (models.exactness).
docs/llamacpp.md gives the build flags that pass (`-DGGML_LLAMAFILE=OFF`, flash attention off).

The logits returned are a zero-copy view of llama.cpp's output buffer at batch 1 (the engine
uses them before its next call; anything kept must be copied); padded batches are gathered.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.cache import check_room
from specdecode.models.config import ModelConfig
from specdecode.models.invariance import DEFAULT_WIDTH, Invariance, Threads, measure
from specdecode.models.llamacpp_probe import require_runs
from specdecode.models.logits_for import is_last, logit_positions
from specdecode.models.target import Cache, Target

EXTRA = "llamacpp"  # pip install "specdecode[llamacpp]"
PINNED = "0.3.36"
BUILD_FLAGS = "-DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF -DLLAMA_OPENSSL=OFF"
FLASH_ATTN_DISABLED = 0  # llama_flash_attn_type: -1 auto, 0 disabled, 1 enabled
DEFAULT_SEQUENCES = 10  # llama.cpp sequences per context: batch rows + prompts being prefilled
SEQUENCES_ENV = "SPECDECODE_LLAMACPP_SEQUENCES"
DEFAULT_ROW_TOKENS = 2048  # KV cells of each sequence (llama.cpp allocates them all at once)
# ggml sends products of K-quant and IQ weights (Q2_K..Q6_K, IQ*) with 8 or more activation rows
# to its tiled GEMM (ggml-cpu/tiled/tiled.cpp) and fewer rows to the vector-dot kernels: on the
# Qwen2.5-Coder 1.5B Q4_K_M file a position scored alone and first of 8 differed by 0.37
# (benchmarks/llamacpp_tiled.py). No build flag removes the switch; this variable, read once
# per process at its first matrix product, keeps every width on the vector-dot kernels (0.0 at
# widths 1-16 and chunkings of 4, 8, 16). A user's own setting wins (the load-time check then
# judges it). GGML_CPU_TILED_MM_FORCE=1 (tiled at every width) is exact too.
TILED_ENV = "GGML_CPU_TILED_MM"
# Extra buffer types (ggml's CPU-specific weight layouts: AMX tiles, repacked Q4_0/Q4_K/IQ4_NL/
# Q8_0 interleavings) are off: their kernels take one path for a single row and another for
# several, so a position's logits depend on the draft width (docs/llamacpp.md), and the AMX one
# is what dies on Xeons when GCC 12 built it (models.llamacpp_probe). Weights stay as the file
# stores them and every width runs ggml's plain vector-dot kernels.
EXTRA_BUFFER_TYPES = False


def import_llama_cpp() -> Any:
    """The llama_cpp module, or one clear error saying how to install it. Every use of
    llama-cpp-python here (the backend, its peers) imports it through this function, so the
    tiled-GEMM choice is set before the process's first matrix product."""
    os.environ.setdefault(TILED_ENV, "0")
    try:
        import llama_cpp
    except ImportError as exc:
        raise SpecDecodeError(
            "the llama.cpp backend needs llama-cpp-python: install the extra with "
            f"CMAKE_ARGS=\"{BUILD_FLAGS}\" pip install \"specdecode[{EXTRA}]\" "
            "(or run scripts/install_llamacpp.sh; see docs/llamacpp.md)"
        ) from exc
    return llama_cpp


_LOG_CALLBACK: Any = None  # kept alive: llama.cpp calls it for as long as the process runs


def _quiet(L: Any) -> None:
    """Route llama.cpp's log lines to nowhere unless SPECDECODE_LLAMACPP_LOG is set."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None or os.environ.get("SPECDECODE_LLAMACPP_LOG"):
        return

    def drop(level: int, text: bytes, user: Any) -> None:
        return None

    _LOG_CALLBACK = L.llama_log_callback(drop)
    L.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaCppCache:
    """Rows of a llama.cpp context: a sequence id and a committed length per row (the
    models.target.Cache protocol)."""

    copies_rows = True
    holds_tensors = False  # the keys and values live in llama.cpp

    def __init__(self, model: LlamaCppModel, batch: int, capacity: int) -> None:
        self.model = model
        self.capacity = capacity
        self.seq_ids = model.take_sequences(batch)
        self.lengths = [0] * batch
        self._owned = list(self.seq_ids)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def nbytes(self) -> int:
        """KV bytes of the positions this cache's rows hold (llama.cpp allocates every row's
        cells once, with the context)."""
        return sum(self.lengths) * self.model.kv_bytes_per_token

    def check_room(self, new_tokens: int, rows: list[int] | None = None) -> None:
        check_room(self.lengths, self.capacity, new_tokens, rows)

    def rollback(self, row: int, length: int) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"rollback to {length} but row {row} holds {self.lengths[row]}")
        if length < self.lengths[row]:
            self.model.forget(self.seq_ids[row], length)
        self.lengths[row] = length

    def reset_row(self, row: int) -> None:
        self.rollback(row, 0)

    def keep(self, row: int, start: int, indices: torch.Tensor) -> None:
        raise SpecDecodeError("token trees need the native runner (--backend native)")

    def copy_row(self, dst: int, src_cache: Cache, src: int, n: int) -> None:
        """Make row `dst` hold the first `n` positions of `src_cache`'s row `src` (a copy
        between KV streams)."""
        if not isinstance(src_cache, LlamaCppCache) or src_cache.model is not self.model:
            raise SpecDecodeError("a llama.cpp cache copies rows of its own context only")
        self.model.forget(self.seq_ids[dst], 0)
        self.model.share(src_cache.seq_ids[src], self.seq_ids[dst], n)
        self.lengths[dst] = n

    def move_row(self, src: int, dst: int) -> None:
        """Row `src` becomes row `dst` (whose contents are dropped); `src` is left empty."""
        self.model.forget(self.seq_ids[dst], 0)
        self.seq_ids[dst], self.seq_ids[src] = self.seq_ids[src], self.seq_ids[dst]
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0

    def view(self, first: int, n: int) -> LlamaCppCache:
        """Rows first..first+n-1 (the same sequences) with a copy of their lengths."""
        out = object.__new__(LlamaCppCache)
        out.model, out.capacity = self.model, self.capacity
        out.seq_ids = self.seq_ids[first:first + n]
        out.lengths = self.lengths[first:first + n]
        out._owned = []
        return out

    def release(self) -> None:
        if self._owned:
            self.model.return_sequences(self._owned)
            self._owned = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at exit the context may already be gone
            self.release()


class LlamaCppModel:
    """A GGUF target on llama.cpp (a models.target.Target). `cfg` is the checkpoint's config
    as the native runner reads it (vocabulary, context length, EOS ids); everything runs in
    llama.cpp."""

    backend = "llama.cpp"
    rows_independent = True
    supports_trees = False  # no tree masks: a tree is verified as its most likely path

    def __init__(self, path: Path, cfg: ModelConfig, *, threads: int | None = None,
                 row_tokens: int = DEFAULT_ROW_TOKENS, sequences: int | None = None,
                 flash_attn: bool = False, unified_kv: bool = False,
                 extra_bufts: bool = EXTRA_BUFFER_TYPES) -> None:
        L = import_llama_cpp()
        # a binary that dies on this CPU must not take the interpreter with it
        require_runs("backend" if not extra_bufts else "default", str(path))
        _quiet(L)
        L.llama_backend_init()
        self.L, self.cfg, self.path = L, cfg, path
        cores = os.cpu_count() or 1
        self.threads = threads or min(cores, torch.get_num_threads())
        if self.threads > cores:
            raise SpecDecodeError(f"--threads {self.threads} is more than this machine's "
                                  f"{cores} cores")
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts
        self._model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise SpecDecodeError(f"{path}: llama.cpp cannot load this GGUF")
        vocab = L.llama_model_get_vocab(self._model)
        n_vocab = int(L.llama_vocab_n_tokens(vocab))
        if n_vocab != cfg.vocab_size:
            raise SpecDecodeError(f"{path}: llama.cpp reads a vocabulary of {n_vocab} tokens, "
                                  f"the checkpoint's config {cfg.vocab_size}")
        self.vocab_size = n_vocab
        if sequences is None:
            sequences = int(os.environ.get(SEQUENCES_ENV, DEFAULT_SEQUENCES))
        sequences = max(sequences, 4)  # the load-time check takes 4
        row_tokens = min(row_tokens, cfg.max_position)
        n_ctx = row_tokens if unified_kv else sequences * row_tokens
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = 512
        cp.n_ubatch = 512
        cp.n_seq_max = sequences
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.flash_attn_type = 1 if flash_attn else FLASH_ATTN_DISABLED
        # one KV stream per sequence: a row's cells then sit at the same indices whatever the
        # other rows hold, which keeps its attention's SIMD reductions (and so its logits) the
        # same alone and in any batch; a unified cache interleaves rows' cells and does not
        cp.kv_unified = unified_kv
        cp.no_perf = True
        self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            L.llama_model_free(self._model)
            raise SpecDecodeError(f"{path}: llama.cpp could not create a context of {n_ctx} "
                                  "tokens")
        self.n_ctx = int(L.llama_n_ctx(self._ctx))
        self.flash_attn = flash_attn
        self._mem = L.llama_get_memory(self._ctx)
        self._free = list(range(sequences))
        self.capacity_per_row = self.n_ctx if unified_kv else self.n_ctx // sequences
        self._batch_size = 512
        self._batch = L.llama_batch_init(self._batch_size, 0, 1)
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        self.invariance: Invariance | None = None

    # --- sequences --------------------------------------------------------------------------

    def take_sequences(self, n: int) -> list[int]:
        if n > len(self._free):
            raise SpecDecodeError(
                f"the llama.cpp context has {len(self._free)} free sequences, {n} asked for "
                f"(a batch row, or a prompt being prefilled, takes one): set {SEQUENCES_ENV} "
                "to twice the largest batch size, plus 2")
        taken, self._free = self._free[:n], self._free[n:]
        for s in taken:
            self.forget(s, 0)
        return taken

    def return_sequences(self, ids: list[int]) -> None:
        for s in ids:
            self.forget(s, 0)
        self._free.extend(ids)

    def forget(self, seq: int, start: int) -> None:
        if self._ctx:  # a cache outliving a closed model has nothing left to free
            self.L.llama_memory_seq_rm(self._mem, seq, start, -1)

    def share(self, src: int, dst: int, n: int) -> None:
        """Sequence `dst` holds the first `n` positions of `src`. Between KV streams llama.cpp
        copies only whole sequences: copy it all, then drop the tail."""
        self.L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self.forget(dst, n)

    # --- the runner interface ---------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def precision(self) -> str:
        return "gguf"

    def new_cache(self, batch: int, capacity: int) -> LlamaCppCache:
        # llama.cpp's KV is allocated once with the context: a cache is sequence ids, and its
        # capacity the most a row can hold (a grown cache would only have to be refilled)
        return LlamaCppCache(self, batch, self.capacity_per_row)

    def weight_bytes(self) -> int:
        return int(self.L.llama_model_size(self._model))

    def version(self) -> str:
        return str(getattr(self.L, "__version__", "unknown"))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise SpecDecodeError("hidden states need the native runner (--backend native)")

    def check_invariance(self, width: int) -> Invariance:
        """Measure the batch invariance up to calls of `width` positions (batch_invariance);
        recorded as `invariance`."""
        self.invariance = batch_invariance(self, width)
        return self.invariance

    def __call__(
        self,
        tokens: torch.Tensor,  # (B, T) int64
        cache: Cache,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        num_new: Sequence[int] | None = None,
        logits_for: str | torch.Tensor = "all",
        layers: Sequence[int] | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Score T new positions per row (row b: its first num_new[b]); logits (B, T', V)."""
        if not isinstance(cache, LlamaCppCache):
            raise SpecDecodeError("a llama.cpp target scores in its own caches only")
        if tree_mask is not None or layers is not None or return_hidden or positions is not None:
            raise SpecDecodeError("token trees, explicit positions, layer skipping and hidden "
                                  "states need the native runner (--backend native)")
        B, T = tokens.shape
        news = [T] * B if num_new is None else [int(n) for n in num_new]
        cache.check_room(T)
        asked = logit_positions(logits_for)
        last = is_last(asked)  # -1: each row's own last position, whatever its length
        wanted = [int(i) for i in asked.tolist()] if isinstance(asked, torch.Tensor) else \
            [-1] if last else list(range(T))[asked]
        ids = tokens.tolist()
        outputs: list[list[int]] = []  # per row, the output index of each wanted position
        total = sum(news)
        if total > self._batch_size:  # a long prompt: in chunks, outputs from the last only
            return self._chunked(tokens, cache, news, wanted)
        batch, n_out, i = self._batch, 0, 0
        for b in range(B):
            n, start, seq = news[b], cache.lengths[b], cache.seq_ids[b]
            want = {w % n if n else 0 for w in wanted if n and -n <= w < max(n, T)}
            row: list[int] = []
            for t in range(n):
                batch.token[i] = ids[b][t]
                batch.pos[i] = start + t
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                out = t in want
                batch.logits[i] = out
                if out:
                    row.append(n_out)
                    n_out += 1
                i += 1
            outputs.append(row)
        batch.n_tokens = i
        if i:
            self._decode(batch)
        for b in range(B):
            cache.lengths[b] += news[b]
        if not wanted:
            return torch.zeros(B, 0, 0)
        flat = self._logits(n_out)  # (n_out, V), a view of llama.cpp's buffer
        width = 1 if last else T
        if B == 1 and len(outputs[0]) == width:
            return flat[None]
        padded = torch.zeros(B, width, self.vocab_size)
        for b, row in enumerate(outputs):
            if row:
                padded[b, : len(row)] = flat[row[0]: row[0] + len(row)]
        return padded

    def _chunked(self, tokens: torch.Tensor, cache: LlamaCppCache, news: list[int],
                 wanted: list[int]) -> torch.Tensor:
        B = tokens.shape[0]
        if B > 1 and not wanted:  # several rows' prompts: in slices of the columns
            step = max(1, self._batch_size // B)
            for s in range(0, max(news), step):
                self(tokens[:, s:s + step], cache,
                     num_new=[max(0, min(n, s + step) - s) for n in news], logits_for="none")
            return torch.zeros(B, 0, 0)
        if B != 1 or any(w not in (-1, news[0] - 1) for w in wanted):
            raise SpecDecodeError(f"llama.cpp backend: at most {self._batch_size} positions per "
                                  "call with logits, or one row's prompt")
        n = news[0]
        out = torch.zeros(1, 0, 0)
        for s in range(0, n, self._batch_size):
            e = min(n, s + self._batch_size)
            last = e == n and bool(wanted)
            out = self(tokens[:, s:e], cache, logits_for="last" if last else "none")
        return out.clone() if wanted else out

    def _decode(self, batch: Any) -> None:
        rc = self.L.llama_decode(self._ctx, batch)
        if rc != 0:
            raise SpecDecodeError(f"llama_decode failed (code {rc}): the context of "
                                  f"{self.n_ctx} tokens is full or the batch is malformed")

    def _logits(self, n: int) -> torch.Tensor:
        ptr = self.L.llama_get_logits(self._ctx)
        arr = np.ctypeslib.as_array(ptr, shape=(n, self.vocab_size))
        return torch.from_numpy(arr)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self.L.llama_batch_free(self._batch)
            self.L.llama_free(self._ctx)
            self.L.llama_model_free(self._model)
            self._ctx = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def llamacpp_target(target: Target) -> LlamaCppModel | None:
    """`target` when it runs on llama.cpp (what llama-cpp-python's own generation, loading the
    same GGUF, can be compared with), else None."""
    return target if isinstance(target, LlamaCppModel) else None


def batch_invariance(model: LlamaCppModel, width: int = DEFAULT_WIDTH, context: int = 48
                     ) -> Invariance:
    """The shared check (models.invariance.measure: every position of calls up to `width`
    wide, batches crossing 64 rows, llama.cpp's own thread count against another), plus one
    shape of llama.cpp's own: the same prefix scored again after another sequence took the
    first free KV cells (in a unified KV cache its cells then sit elsewhere, which moves its
    logits), counted under rows."""
    start = time.perf_counter()

    def set_threads(n: int) -> None:
        model.L.llama_set_n_threads(model._ctx, n, n)
        model.threads = n

    measured = measure(model, width, context, threads=Threads(lambda: model.threads,
                                                              set_threads))
    moved = _moved_cells(model, context)
    measured = replace(measured, rows=max(measured.rows or 0.0, moved),
                       seconds=round(time.perf_counter() - start, 3))
    if not measured.exact:
        measured = replace(measured, cause=(
            "this llama.cpp build's kernels pick their arithmetic by batch shape (llamafile's "
            "sgemm unless built with CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\", as "
            "scripts/install_llamacpp.sh does; some quantized types' kernels switch at a width "
            "whatever the build: docs/llamacpp.md)"))
    return measured


def _moved_cells(model: LlamaCppModel, context: int) -> float:
    """A position scored after `context` tokens, then again with the same prefix re-fed after
    another sequence took the first free cells."""
    rng = np.random.default_rng(0)
    prefix = torch.tensor(rng.integers(100, model.vocab_size, size=(1, context + 1)))
    solo, other = model.new_cache(1, context + 2), model.new_cache(1, context + 2)
    try:
        with torch.inference_mode():
            alone = model(prefix, solo, logits_for="last")[0, -1].clone()
            solo.rollback(0, 0)
            model(torch.flip(prefix, [1])[:, : context // 2 + 5], other, logits_for="none")
            again = model(prefix, solo, logits_for="last")[0, -1]
            return float((again - alone).abs().max())
    finally:
        for cache in (solo, other):
            cache.release()


def load_llamacpp(path: Path, cfg: ModelConfig, threads: int | None = None,
                  check: bool = True, sequences: int | None = None) -> LlamaCppModel:
    """Load a GGUF on llama.cpp and measure its batch invariance (see the module docstring)."""
    model = LlamaCppModel(path, cfg, threads=threads, sequences=sequences)
    if check:
        model.check_invariance(DEFAULT_WIDTH)
    return model
