"""Native PyTorch runner for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2).

One forward pass takes T new tokens per row, writes their keys and values into the KV cache at
each row's length, attends over the cache with causal (or an explicit tree) masking, and returns
logits for the positions asked for. Explicit position ids serve token trees; `layers` selects a
subset of blocks for layer-skipping self-speculation.

Weights use Hugging Face names and layouts (q/k rows in rotate-half RoPE order); q/k/v and
gate/up projections are fused into one matmul each, and RoPE rotates q and k together, to cut
per-layer overhead. Activations, norms, softmax and the KV cache are fp32 at every precision;
`with_precision` swaps the weight matrices, LM head and embedding for those its precision's
record builds (models.precision, models.linears).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models import kernels
from specdecode.models.cache import KVCache
from specdecode.models.config import ModelConfig
from specdecode.models.invariance import Invariance
from specdecode.models.logits_for import is_none, logit_positions


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim / 2,), with linear or Llama-3 scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    p = cfg.rope_params
    if cfg.rope_type == "linear":
        return (inv / p["factor"]).float()
    if cfg.rope_type == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_ctx = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled).float()
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + rotate_half(x) * sin: one copy and three elementwise kernels.

    x: (B, T, heads, D); cos, sin_signed: (B, T, 1, D) with sin_signed = cat(-sin, sin) over the
    two halves, so rotate_half(x) * sin == swap_halves(x) * sin_signed bit for bit.
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)
    return x * cos + swapped * sin_signed


TALL_ROWS = range(2, 129)  # row counts that Linear computes as (W @ x^T)^T
# row counts that Linear computes padded with zero rows to a count MKL's kernels run faster
PADDED_ROWS = {3: 4, 7: 8, **{r: 16 for r in range(10, 16)}}


class Linear(nn.Linear):
    """nn.Linear on fp32 weights. On the row-invariant kernels (LlamaModel.set_exact, the default
    where they build) it multiplies with its panels (`exact_panels`). On PyTorch's kernels it
    picks MKL's faster orientation by the number of rows: for 2-128 rows sgemm computing
    y^T = W x^T beats y = x W^T on a 2-core AVX2 CPU, larger calls (prefill) run as nn.Linear,
    and some row counts run padded with zero rows to a count MKL's kernels run faster
    (PADDED_ROWS); one row can use an (in, out) copy of the weight (`weight_t`,
    `LlamaModel.add_gemv_copies`), a row-major GEMV that MKL streams faster, at the price of
    holding the matrix twice. Each row's result is computed from that row alone, but not by the
    same kernel at every row count: PyTorch's path is not bit-exact across row counts. The
    measurements behind these rules: docs/measurements/code-figures.md.
    """

    exact = False  # LlamaModel.set_exact: the row-invariant kernel (inference only)

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.weight_t: torch.Tensor | None
        self.register_buffer("weight_t", None, persistent=False)
        self._panels: kernels.Panels | None = None  # the weight in kernels.c's layout
        self._panels_of: tuple[int, int] | None = None  # (data_ptr, version) they were made of

    def exact_panels(self) -> kernels.Panels | None:
        """The weight as the row-invariant kernels use it (None unless exact), repacked if the
        weight changed since it was packed."""
        if not self.exact:
            return None
        key = (self.weight.data_ptr(), self.weight._version)
        if self._panels is None or self._panels_of != key:
            self._panels = kernels.pack_float(self.weight, torch.float32, self.bias)
            self._panels_of = key
        return self._panels

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy (memory.weight_bytes adds them to the weight's)."""
        return 0 if self._panels is None else self._panels.nbytes

    def add_gemv_copy(self) -> None:
        """Hold an (in, out) copy of the weight for one-row calls."""
        self.weight_t = self.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        panels = self.exact_panels() if not torch.is_grad_enabled() else None
        if panels is not None:
            return kernels.matmul(x, panels)
        rows = x.numel() // max(1, x.shape[-1])
        if rows == 1 and self.weight_t is not None:
            y = x.reshape(1, -1) @ self.weight_t
            y = y if self.bias is None else y + self.bias
            return y.view(*x.shape[:-1], -1)
        if rows not in TALL_ROWS:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, -1)
        padded = PADDED_ROWS.get(rows)
        if padded is None:
            y = torch.mm(self.weight, x2.t()).t()  # (rows, out), transposed layout
        else:
            y = torch.mm(self.weight, F.pad(x2, (0, 0, 0, padded - rows)).t()).t()[:rows]
        y = y.contiguous() if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], -1)


class Block(nn.Module):
    exact = False  # LlamaModel.set_exact: row-invariant attention (kernels.attention)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv: nn.Module = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o: nn.Module = Linear(q, cfg.hidden_size, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up: nn.Module = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down: nn.Module = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles leave out the kernels' struct of raw pointers (rebuilt on use)."""
        state = dict(self.__dict__)
        state.pop("_fused", None)
        state.pop("_fused_of", None)
        return state

    def fused(self) -> kernels.SdBlockW | None:
        """The block's weights for kernels.block, if every matrix runs on the row-invariant
        kernels (not at int8); rebuilt when a matrix's panels change."""
        if not self.exact:
            return None
        mats = [getattr(self, n).exact_panels() for n in ("qkv", "o", "gate_up", "down")]
        if any(m is None for m in mats) or self.cfg.head_dim > kernels.MAX_HEAD_DIM:
            return None
        held = getattr(self, "_fused_of", None)  # the panels it was built of, kept alive
        if held is None or any(a is not b for a, b in zip(held, mats, strict=True)):
            cfg = self.cfg
            self._fused = kernels.SdBlockW(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                cfg.intermediate_size, cfg.rms_norm_eps, self.attn_norm.data_ptr(),
                self.mlp_norm.data_ptr(), *(m.struct() for m in mats if m is not None))
            self._fused_of = mats
        return self._fused

    def forward(
        self,
        x: torch.Tensor,  # (B * T, H): rows of the batch, flattened
        step: _Step,
        layer_cache: tuple[torch.Tensor, torch.Tensor],  # each (B, KVH, S, D)
    ) -> torch.Tensor:
        if step.exact is not None:
            weights = self.fused()
            if weights is not None:  # the whole block in one call, x updated in place
                ck, cv = layer_cache
                spec = kernels.attn_spec(ck, cv, step.exact.rows, step.exact.mask, step.used)
                kernels.block(x, weights, step.exact.cos, step.exact.sin, step.exact.slots, spec)
                return x
        cfg = self.cfg
        B, T = step.batch, step.new
        nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.rms_norm(x, (cfg.hidden_size,), self.attn_norm, cfg.rms_norm_eps)
        qkv = self.qkv(h)  # (B * T, (NH + 2 KVH) D)
        qk = apply_rope(qkv[:, : (nh + kvh) * d].view(B, T, nh + kvh, d), step.cos, step.sin)
        q = qk[:, :, :nh].transpose(1, 2)  # (B, NH, T, D)
        k = qk[:, :, nh:].transpose(1, 2)  # (B, KVH, T, D)
        v = qkv[:, (nh + kvh) * d :].view(B, T, kvh, d).transpose(1, 2)
        ck, cv = layer_cache
        if isinstance(step.write, slice):
            ck[:, :, step.write] = k
            cv[:, :, step.write] = v
        else:  # ragged rows: per-row destinations (B, T)
            rows, slots = step.write
            ck[rows, :, slots] = k.transpose(1, 2)
            cv[rows, :, slots] = v.transpose(1, 2)
        if step.exact is not None:  # row-invariant attention: q rows (B * T, NH, D) as they lie
            attn = kernels.attention(qk.view(B * T, nh + kvh, d)[:, :nh], ck, cv,
                                     step.exact.rows, step.exact.mask, step.used
                                     ).view(B * T, nh * d)
        else:
            attn = F.scaled_dot_product_attention(
                q, ck[:, :, : step.used], cv[:, :, : step.used], attn_mask=step.mask,
                enable_gqa=True,
            ).transpose(1, 2).reshape(B * T, nh * d)  # (B, NH, T, D) -> rows
        x = x + self.o(attn)
        h = F.rms_norm(x, (cfg.hidden_size,), self.mlp_norm, cfg.rms_norm_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


@dataclass(frozen=True)
class _Step:
    """What every block of one forward pass shares: shapes, RoPE tables, KV slots, mask."""

    batch: int
    new: int  # T: new positions per row
    cos: torch.Tensor  # (B, T, 1, D)
    sin: torch.Tensor  # (B, T, 1, D), signed: cat(-sin, sin)
    write: slice | tuple[torch.Tensor, torch.Tensor]  # cache slots of the new keys and values
    used: int  # cache slots attended over: max length + T
    mask: torch.Tensor | None  # (B, 1, T, used) bool, True = may attend; None = plain causal T=1
    exact: _ExactStep | None = None  # the same, as the row-invariant kernels take it


@dataclass(frozen=True)
class _ExactStep:
    """A step's shapes per query row (B * T of them), for the row-invariant kernels."""

    rows: torch.Tensor  # (B * T,) int64: the cache row of each query row
    slots: torch.Tensor  # (B * T,) int64: where its key and value are written in that row
    mask: torch.Tensor | None  # (B * T, used) uint8, 1 = may attend; None: every slot < used
    cos: torch.Tensor  # (B * T, D)
    sin: torch.Tensor  # (B * T, D), signed


class LlamaModel(nn.Module):
    """The native runner (a models.target.Target). `backend` names the path users see in
    reports; `precision` is fp32 unless the model came from `with_precision`."""

    backend = "native"
    supports_trees = True  # explicit positions and tree masks (engine: token-tree drafts)
    precision = "fp32"
    exact = False  # the row-invariant kernels run attention and the fp32 / bf16 products
    invariance: Invariance | None = None  # measured at load (models.invariance.measure)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head: nn.Module = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if kernels.available():  # exact by default wherever the kernels build
            self.set_exact()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and of the KV cache (fp32 at every precision)."""
        return self.norm.dtype

    @property
    def rows_independent(self) -> bool:
        """Whether a row's outputs are independent of the other rows of its forward pass: not
        at int8, whose dynamic activation quantization takes one scale for the whole input
        (fbgemm's linear_dynamic), so a batch's rows, and placeholder rows, move each other's
        rounding (engine.draft_rows then drafts such a copy one row per forward). The
        precision's record says (models.precision)."""
        from specdecode.models.precision import get

        return get(self.precision).rows_independent

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache(
            cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim,
            dtype=self.dtype, device=self.norm.device,
        )

    def set_exact(self, exact: bool = True) -> LlamaModel:
        """Run inference on the row-invariant kernels (models.kernels; True) or on PyTorch's
        (False). Training is unaffected: with autograd on, PyTorch's kernels run either way.
        The measured invariance is forgotten (it belongs to the kernels that were measured)."""
        if exact and not kernels.available():
            raise RuntimeError(f"row-invariant kernels unavailable: {kernels.build_error()}")
        from specdecode.models.linears import PackedLinear, PanelLinear, WeightOnlyLinear

        # every matrix class of models.linears that has a row-invariant layout takes set_exact

        self.exact = exact
        self.invariance = None
        for module in self.modules():
            if isinstance(module, Linear | Block):
                module.exact = exact
            elif isinstance(module, PackedLinear | WeightOnlyLinear | PanelLinear):
                module.set_exact(exact)
        return self

    def check_invariance(self, width: int) -> Invariance:
        """Measure the batch invariance up to calls of `width` positions (models.invariance),
        with its cause where it fails; recorded as `invariance`."""
        from dataclasses import replace

        from specdecode.models.invariance import measure

        measured = measure(self, width)
        if not measured.exact:
            measured = replace(measured, cause=self._inexact_cause())
        self.invariance = measured
        return measured

    def _inexact_cause(self) -> str:
        if not self.exact:
            error = kernels.build_error()
            return ("the row-invariant kernels are not in use"
                    + (f" ({error})" if error else " (LlamaModel.set_exact was not called)"))
        if not self.rows_independent:
            return "its kernels quantize each call's activations with one scale"
        return "cause unknown (please report it with the output of `specdecode costs`)"

    def with_precision(self, precision: str) -> LlamaModel:
        """A copy whose weight matrices, LM head and embedding are the ones `precision`'s
        record builds (models.precision: its `matrix` and `ends`); norms are shared with self,
        which is left unchanged."""
        from specdecode.models.linears import float_weight
        from specdecode.models.precision import get

        record = get(precision)
        if record.matrix is None or record.ends is None:
            raise ValueError(f"the native runner does not build precision {precision}")
        with torch.device("meta"):
            new = LlamaModel(self.cfg)
        new.precision = record.name
        new.norm, new.inv_freq = self.norm, self.inv_freq
        for src, dst in zip(self.layers, new.layers, strict=True):
            dst.attn_norm, dst.mlp_norm = src.attn_norm, src.mlp_norm
            for name in ("qkv", "o", "gate_up", "down"):
                w, b = float_weight(getattr(src, name))
                setattr(dst, name, record.matrix(w, b, self.exact))
        embed = float_weight(self.embed)[0]
        head = float_weight(self.lm_head)[0]
        tied = self.cfg.tie_embeddings and torch.equal(embed, head)
        new.lm_head, new.embed = record.ends(head, embed, tied, self.exact)
        return new.set_exact(self.exact).eval()

    def identity_state(self) -> dict[str, torch.Tensor]:
        """The weights that define this target, for its identity (train.checkpoint
        .weights_sha256): the state dict, except at a precision that holds the reference's
        weights bit for bit (its record's `reference_weights`: "checkpoint"): their fp32
        values under the fp32 model's names, so heads and drafts trained for the fp32 target
        are recognised as made for it."""
        from specdecode.models.linears import float_weight
        from specdecode.models.precision import get

        if not get(self.precision).reference_weights:
            return self.state_dict()

        state: dict[str, torch.Tensor] = {"norm": self.norm}
        head_w, _ = float_weight(self.lm_head)
        state["lm_head.weight"] = head_w
        embed_w = float_weight(self.embed)[0]
        state["embed.weight"] = head_w if torch.equal(embed_w, head_w) else embed_w
        for i, block in enumerate(self.layers):
            assert isinstance(block, Block)
            state[f"layers.{i}.attn_norm"] = block.attn_norm
            state[f"layers.{i}.mlp_norm"] = block.mlp_norm
            for name in ("qkv", "o", "gate_up", "down"):
                w, b = float_weight(getattr(block, name))
                state[f"layers.{i}.{name}.weight"] = w
                if b is not None:
                    state[f"layers.{i}.{name}.bias"] = b
        return state

    def add_gemv_copies(self) -> LlamaModel:
        """Give every fp32 matrix an (in, out) copy for one-row calls (see Linear): plain
        decoding and one-token drafting get faster; the matrices are held twice (counted by
        weight_bytes)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.add_gemv_copy()
        return self

    def weight_bytes(self) -> int:
        """Bytes of weights held: tensors (each once) plus packed matrices (memory.weight_bytes)."""
        from specdecode.memory import weight_bytes

        return weight_bytes(self)

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles leave out the kernels' array of raw pointers (rebuilt on use)."""
        state = dict(self.__dict__)
        state.pop("_fused_array", None)
        state.pop("_fused_blocks_of", None)
        return state

    def _fused_blocks(self) -> ctypes.Array[kernels.SdBlockW] | None:
        """Every block's weights for one kernels.blocks call (no per-layer Python), or None
        where a block does not run fused (Block.fused); rebuilt when a block's weights change."""
        structs = [block.fused() for block in self.layers]  # type: ignore[operator]
        if not structs or any(s is None for s in structs):
            return None
        held = getattr(self, "_fused_blocks_of", None)
        if held is None or any(a is not b for a, b in zip(held, structs, strict=True)):
            self._fused_array = (kernels.SdBlockW * len(structs))(*structs)
            self._fused_blocks_of = structs
        return self._fused_array

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of `return_hidden` output: forward's own last operations."""
        return self.lm_head(hidden).float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see apply_rope), each (B, T, 1, D)."""
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # (B, T, 1, D)
        cos, sin = emb.cos(), emb.sin()
        sin[..., : self.cfg.head_dim // 2].neg_()
        return cos, sin

    def _mask(
        self, lengths: list[int], T: int, used: int, tree_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Boolean attention mask (B, 1, T, used): committed prefix + causal or tree block."""
        window = self.cfg.sliding_window
        if tree_mask is None and T == 1 and len(lengths) == 1 and (
            window is None or used <= window
        ):
            return None
        dev = self.norm.device
        lens = torch.tensor(lengths, device=dev)[:, None, None]  # (B, 1, 1)
        j = torch.arange(used, device=dev)[None, None, :]  # (1, 1, S)
        t = torch.arange(T, device=dev)[None, :, None]  # (1, T, 1)
        rel = j - lens  # key slot relative to the block start
        if tree_mask is None:
            in_block = (rel >= 0) & (rel <= t)
        else:
            B = len(lengths)
            block = tree_mask.to(torch.bool)
            block = (block if block.dim() == 3 else block[None]).expand(B, T, T)
            # column j of the cache is column rel = j - length of the block, where 0 <= rel < T
            padded = F.pad(block, (0, max(0, used - T)))  # (B, T, >= used)
            picked = torch.gather(padded, 2, rel.clamp(0, T - 1).expand(B, T, used))
            in_block = (rel >= 0) & (rel < T) & picked
        mask = (rel < 0) | in_block
        if window is not None:
            mask = mask & (j > lens + t - window)
        return mask[:, None]

    def forward(
        self,
        tokens: torch.Tensor,  # (B, T) int64
        cache: KVCache,
        positions: torch.Tensor | None = None,  # (B, T); default length + arange(T)
        tree_mask: torch.Tensor | None = None,  # (T, T) or (B, T, T) bool, True = may attend
        num_new: Sequence[int] | None = None,  # per-row real tokens (ragged); lengths advance by it
        logits_for: str | torch.Tensor = "all",  # "all", "last", "none" or (n,) indices into T
        layers: Sequence[int] | None = None,  # subset of blocks to run (self-speculation)
        return_hidden: bool = False,
        embeds: torch.Tensor | None = None,  # (B, T, H) input vectors used instead of embed(tokens)
    ) -> torch.Tensor:
        """Score T new positions per row; returns logits (B, T', V) or hidden states (B, T, H).

        Hidden states are after the final norm: `lm_head(hidden)` gives the logits, bit for bit
        those of the same call without return_hidden. `embeds` feeds the blocks vectors instead
        of token embeddings (EAGLE-style feature drafters, drafters.heads); `tokens` then only
        gives the shape.
        """
        B, T = tokens.shape
        cache.check_room(T)
        lengths = list(cache.lengths)
        if positions is None:
            base = torch.tensor(lengths, device=tokens.device)[:, None]
            positions = base + torch.arange(T, device=tokens.device)[None, :]
        cos, sin = self._rope(positions)
        used = max(lengths) + T
        write: slice | tuple[torch.Tensor, torch.Tensor]
        if all(n == lengths[0] for n in lengths):
            write = slice(lengths[0], lengths[0] + T)
        else:
            slots = torch.tensor(lengths)[:, None] + torch.arange(T)[None, :]
            write = (torch.arange(B)[:, None].expand(B, T), slots)
        mask = self._mask(lengths, T, used, tree_mask)
        exact = None
        if self.exact and not torch.is_grad_enabled():
            slots = (torch.tensor(lengths)[:, None] + torch.arange(T)[None, :]).reshape(-1)
            exact = _ExactStep(
                torch.arange(B).repeat_interleave(T), slots,
                None if mask is None else mask.reshape(B * T, used).to(torch.uint8),
                cos.reshape(B * T, -1).contiguous(), sin.reshape(B * T, -1).contiguous())
        step = _Step(B, T, cos, sin, write, used, mask, exact)
        x = (self.embed(tokens) if embeds is None else embeds).reshape(B * T, -1)  # (B * T, H)
        if exact is not None:  # fused blocks update x in place: never an input of the caller's
            x = x.float().clone() if embeds is not None else x.float().contiguous()
        fused = self._fused_blocks() if exact is not None and layers is None else None
        if fused is not None and exact is not None:  # every block in one call, x in place
            specs = (kernels.SdAttn * len(self.layers))(*(
                kernels.attn_spec(cache.k[i], cache.v[i], exact.rows, exact.mask, used)
                for i in range(len(self.layers))))
            kernels.blocks(x, fused, exact.cos, exact.sin, exact.slots, specs)
        else:
            for i in layers if layers is not None else range(len(self.layers)):
                x = self.layers[i](x, step, (cache.k[i], cache.v[i]))
        for b in range(B):
            cache.lengths[b] += T if num_new is None else int(num_new[b])
        x = x.view(B, T, -1)
        if return_hidden:
            return F.rms_norm(x, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        wanted = logit_positions(logits_for)
        if is_none(wanted):
            return x[:, :0, :0]
        x = F.rms_norm(x[:, wanted], (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(x).float()  # (B, T', V)
