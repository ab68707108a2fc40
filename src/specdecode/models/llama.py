"""Native PyTorch runner for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2).

One forward pass takes T new tokens per row, writes their keys and values into the KV cache at
each row's length, attends over the cache with causal (or an explicit tree) masking, and returns
logits for the positions asked for. Explicit position ids serve token trees; `layers` selects a
subset of blocks for layer-skipping self-speculation.

Weights use Hugging Face names and layouts (q/k rows in rotate-half RoPE order); q/k/v and
gate/up projections are fused into one matmul each to cut per-layer overhead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.cache import KVCache
from specdecode.models.config import ModelConfig


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (B, H, T, D); cos, sin: (B, 1, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o = nn.Linear(q, cfg.hidden_size, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, H)
        cos: torch.Tensor,  # (B, 1, T, D)
        sin: torch.Tensor,
        layer_cache: tuple[torch.Tensor, torch.Tensor],  # each (B, KVH, S, D)
        write: tuple[slice, ...] | tuple[torch.Tensor, torch.Tensor],
        used: int,
        mask: torch.Tensor | None,  # (B, 1, T, used) bool
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        h = F.rms_norm(x, (cfg.hidden_size,), self.attn_norm, cfg.rms_norm_eps)
        qkv = self.qkv(h)  # (B, T, (NH + 2 KVH) D)
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = qkv[..., :nq].view(B, T, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = qkv[..., nq : nq + nkv].view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = qkv[..., nq + nkv :].view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ck, cv = layer_cache
        if isinstance(write[0], slice):
            ck[:, :, write[0]] = k
            cv[:, :, write[0]] = v
        else:  # ragged rows: per-row destinations (B, T)
            rows, slots = write
            ck[rows, :, slots] = k.transpose(1, 2)
            cv[rows, :, slots] = v.transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            q, ck[:, :, :used], cv[:, :, :used], attn_mask=mask, enable_gqa=True
        )  # (B, NH, T, D)
        x = x + self.o(attn.transpose(1, 2).reshape(B, T, nq))
        h = F.rms_norm(x, (cfg.hidden_size,), self.mlp_norm, cfg.rms_norm_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    """The native runner. `backend` names the path users see in reports."""

    backend = "native"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache(
            cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim,
            dtype=self.dtype, device=self.norm.device,
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

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
    ) -> torch.Tensor:
        """Score T new positions per row; returns logits (B, T', V) or hidden states (B, T, H)."""
        B, T = tokens.shape
        cache.check_room(T)
        lengths = list(cache.lengths)
        if positions is None:
            base = torch.tensor(lengths, device=tokens.device)[:, None]
            positions = base + torch.arange(T, device=tokens.device)[None, :]
        cos, sin = self._rope(positions)
        used = max(lengths) + T
        mask = self._mask(lengths, T, used, tree_mask)
        write: tuple[slice, ...] | tuple[torch.Tensor, torch.Tensor]
        if all(n == lengths[0] for n in lengths):
            write = (slice(lengths[0], lengths[0] + T),)
        else:
            slots = torch.tensor(lengths)[:, None] + torch.arange(T)[None, :]
            write = (torch.arange(B)[:, None].expand(B, T), slots)
        x = self.embed(tokens)  # (B, T, H)
        for i in layers if layers is not None else range(len(self.layers)):
            x = self.layers[i](x, cos, sin, (cache.k[i], cache.v[i]), write, used, mask)
        for b in range(B):
            cache.lengths[b] += T if num_new is None else int(num_new[b])
        x = F.rms_norm(x, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        if return_hidden:
            return x
        if isinstance(logits_for, torch.Tensor):
            x = x[:, logits_for]
        elif logits_for == "last":
            x = x[:, -1:]
        elif logits_for == "none":
            return x[:, :0, :0]
        return self.lm_head(x).float()  # (B, T', V)
