"""`specdecode train draft`: distil a small draft model from the frozen target (DistillSpec).

The draft (specdecode.drafters.distilled) is a few decoder blocks of the target's family, first
copied from the target's blocks, sharing the target's embedding and tied LM head, optionally
scoring only a subset of the vocabulary. Only its blocks and final norm are trained.

Recipe (Zhou et al. 2024, "DistillSpec: Improving Speculative Decoding via Knowledge
Distillation"): the draft is trained to match the target's next-token distribution at every
position of an offline corpus, with the target's logits computed on the fly per batch (frozen
target, inference mode). The loss is the forward KL(p || q) over the draft's vocabulary subset,
p renormalised on it (`fkl`), or the total variation distance (`tvd`), which is 1 - alpha at
temperature 1 (Leviathan et al. 2023). DistillSpec finds on-policy data (sequences sampled from
the draft) best, but on 2 CPU cores generating them token by token would cost about ten times
the target forward passes that a fixed corpus needs for the same number of training positions;
we use the fixed corpus and forward KL, which gives dense gradients on every token, and report
alpha at temperature 1 and greedy agreement on held-out text.

Everything is deterministic given the seed: the batch order is a function of (seed, step), so a
run resumed from a checkpoint (parameters, Adam moments, step) takes the same steps as an
uninterrupted one.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdecode.drafters.distilled import (
    DraftLayout,
    build_draft,
    evenly_spaced,
    head_weight,
    save_distilled,
)
from specdecode.errors import SpecDecodeError
from specdecode.models import cards
from specdecode.train import checkpoint as ckpt
from specdecode.train.corpus import load_corpus, sequences

DEFAULT_OUT = "runs/distilled"
LOSSES = ("fkl", "tvd")


# Defaults: the blocks and learning rate that reached the lowest held-out KL in short runs on
# SmolLM2-135M (the runs and a full run's time: docs/measurements/code-figures.md).
@dataclass(frozen=True)
class DistillConfig:
    layers: int = 2  # draft blocks
    init: str = "spaced"  # which target blocks they start from: "spaced" or "first"
    vocab: int = 12288  # tokens the draft's head scores (the lowest ids); 0 = all
    loss: str = "fkl"
    steps: int = 120
    batch: int = 4
    seq_len: int = 256
    lr: float = 2e-3
    warmup: int = 10
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    seed: int = 0
    corpus_tokens: int = 400_000  # training tokens read from the corpus (at most)
    eval_tokens: int = 2048  # held-out positions scored by `evaluate`
    eval_every: int = 25
    checkpoint_every: int = 25

    def check(self) -> None:
        if self.init not in ("first", "spaced"):
            raise SpecDecodeError(f"--init must be first or spaced, got {self.init}")
        if self.loss not in LOSSES:
            raise SpecDecodeError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss}")
        for name in ("layers", "steps", "batch", "seq_len"):
            if getattr(self, name) < 1:
                raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1")
        if self.vocab < 0:
            raise SpecDecodeError(f"--vocab must be >= 0 (0 = all tokens), got {self.vocab}")


def draft_layout(cfg: DistillConfig, target_layers: int, vocab_size: int) -> DraftLayout:
    if not 1 <= cfg.layers <= target_layers:
        raise SpecDecodeError(f"--layers must be in 1..{target_layers}, got {cfg.layers}")
    blocks = tuple(range(cfg.layers)) if cfg.init == "first" else \
        evenly_spaced(target_layers, cfg.layers)
    subset = cfg.vocab if 0 < cfg.vocab < vocab_size else None
    return DraftLayout(blocks, subset)


def vocab_ids(layout: DraftLayout, vocab_size: int) -> torch.Tensor | None:
    """The lowest `layout.vocab_size` token ids: byte-level BPE ids follow the merge order,
    which follows pair frequency in the tokenizer's training text (on SmolLM2 the lowest 12,288
    ids hold the target's argmax at 96% of the positions of the built-in workload's prompts)."""
    if layout.vocab_size is None:
        return None
    return torch.arange(min(layout.vocab_size, vocab_size), dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Losses and metrics
# ---------------------------------------------------------------------------------------------


class LayerwiseCache:
    """Key/value slots for one training forward pass, a separate tensor per layer: the runner's
    KVCache keeps all layers in one tensor, whose in-place writes by a later layer would
    invalidate what autograd saved for an earlier one."""

    def __init__(self, cfg: Any, batch: int, length: int) -> None:
        shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
        self.k = [torch.zeros(shape) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape) for _ in range(cfg.num_layers)]
        self.lengths = [0] * batch
        self.capacity = length

    def check_room(self, new: int) -> None:
        if max(self.lengths) + new > self.capacity:
            raise ValueError(f"no room for {new} positions in a cache of {self.capacity}")


def hidden(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states (B, T, H) of `model` over `tokens` (B, T), from position 0."""
    B, T = tokens.shape
    out: torch.Tensor = model(tokens, LayerwiseCache(model.cfg, B, T), return_hidden=True)
    return out


def divergence(p_log: torch.Tensor, q_log: torch.Tensor, loss: str) -> torch.Tensor:
    """Mean over positions of KL(p || q) ("fkl") or TV(p, q) ("tvd"); both (N, n) log-probs."""
    if loss == "fkl":
        return (p_log.exp() * (p_log - q_log)).sum(-1).mean()
    return 0.5 * (p_log.exp() - q_log.exp()).abs().sum(-1).mean()


@dataclass(frozen=True)
class EvalSet:
    """Held-out positions with the target's side precomputed once."""

    tokens: torch.Tensor  # (B, T) int64
    p_sub: torch.Tensor  # (B * T, n) target probabilities (full softmax) on the draft's tokens
    argmax: torch.Tensor  # (B * T,) the target's greedy token over the whole vocabulary


def eval_set(target: Any, stream: torch.Tensor, cfg: DistillConfig,
             ids: torch.Tensor | None) -> EvalSet:
    rows = max(1, cfg.eval_tokens // cfg.seq_len)
    tokens = sequences(stream, cfg.seq_len)[:rows]  # (B, T)
    with torch.inference_mode():
        logits = (hidden(target, tokens) @ head_weight(target).t()).flatten(0, 1)  # (B * T, V)
        p = torch.softmax(logits, dim=-1)
        argmax = logits.argmax(-1)
        p_sub = p if ids is None else p[:, ids]
    return EvalSet(tokens, p_sub.clone(), argmax.clone())


def evaluate(draft: Any, head: torch.Tensor, ids: torch.Tensor | None, data: EvalSet
             ) -> dict[str, float]:
    """alpha at temperature 1 (E sum_x min(p, q)), greedy agreement, and KL(p_sub || q)."""
    with torch.inference_mode():
        q_log = torch.log_softmax((hidden(draft, data.tokens) @ head.t()).flatten(0, 1), dim=-1)
        q = q_log.exp()
        alpha = torch.minimum(data.p_sub, q).sum(-1).mean()
        best = q.argmax(-1) if ids is None else ids[q.argmax(-1)]
        agree = (best == data.argmax).float().mean()
        p_log = torch.log(data.p_sub / data.p_sub.sum(-1, keepdim=True)).clamp_min(-1e4)
        kl = divergence(p_log, q_log, "fkl")
    return {"alpha": float(alpha), "agreement": float(agree), "kl": float(kl)}


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def batch_rows(step: int, batch: int, n_rows: int, seed: int) -> torch.Tensor:
    """Row indices of training batch `step`: epoch e visits the rows in a permutation seeded by
    (seed, e), so the order depends on nothing but the arguments."""
    flat = torch.arange(step * batch, (step + 1) * batch)
    out = torch.empty(batch, dtype=torch.long)
    for j, i in enumerate(flat.tolist()):
        epoch, pos = divmod(i, n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        out[j] = perm[pos]
    return out


def learning_rate(cfg: DistillConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    t = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train_step(target: Any, draft: Any, head: torch.Tensor, tokens: torch.Tensor,
               opt: torch.optim.Optimizer, cfg: DistillConfig) -> float:
    """One optimizer step on `tokens` (B, T): the divergence of the draft from the target."""
    with torch.inference_mode():
        p_log = torch.log_softmax(hidden(target, tokens) @ head.t(), dim=-1)  # (B, T, n)
    p_log = p_log.clone().flatten(0, 1)
    q_log = torch.log_softmax(hidden(draft, tokens) @ head.t(), dim=-1).flatten(0, 1)
    loss = divergence(p_log, q_log, cfg.loss)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.clip)
    opt.step()
    return float(loss.detach())


def trainable(draft: Any) -> dict[str, torch.nn.Parameter]:
    """The draft's own parameters (blocks and final norm); the shared embedding stays frozen."""
    return {n: p for n, p in draft.named_parameters()
            if n.startswith("layers.") or n == "norm"}


def save_state(out: Path, step: int, draft: Any, opt: torch.optim.Optimizer,
               meta: dict[str, Any]) -> None:
    tensors = {f"draft.{n}": p.detach() for n, p in trainable(draft).items()}
    opt_tensors, opt_meta = ckpt.optimizer_state(opt)
    ckpt.save_checkpoint(out / "checkpoints", step, {**tensors, **opt_tensors},
                         {**meta, "optimizer": opt_meta})


def restore_state(found: ckpt.Checkpoint, draft: Any, opt: torch.optim.Optimizer,
                  cfg: DistillConfig) -> dict[str, Any]:
    """Load a checkpoint into `draft` and `opt`; it must come from the same configuration."""
    if found.meta.get("config") != asdict(cfg):
        raise SpecDecodeError(
            f"{found.path}: the checkpoint was made with other settings "
            f"({found.meta.get('config')}); rerun with those, or without --resume into a new --out"
        )
    with torch.no_grad():
        for n, p in trainable(draft).items():
            p.copy_(found.tensors[f"draft.{n}"])
    ckpt.load_optimizer_state(opt, found.tensors, found.meta["optimizer"])
    return found.meta


def prepare_draft(target: Any, layout: DraftLayout, ids: torch.Tensor | None
                  ) -> tuple[Any, torch.Tensor]:
    """The draft to train (its own parameters trainable, the embedding frozen) and its head
    matrix (n, H): the target's LM head rows of the draft's vocabulary."""
    draft = build_draft(target, layout, ids)
    for name, p in draft.named_parameters():
        p.requires_grad_(name in trainable(draft))
    head = head_weight(target)
    return draft, (head if ids is None else head[ids]).contiguous()


def start_state(out: Path, resume: bool, draft: Any, opt: torch.optim.Optimizer,
                cfg: DistillConfig) -> dict[str, Any] | None:
    """The metadata of the checkpoint to resume from (loaded into draft and opt), or None."""
    found = ckpt.latest_checkpoint(out / "checkpoints")
    if found is None:
        return None
    if not resume:
        raise SpecDecodeError(
            f"{out}: holds checkpoints of an earlier run; pass --resume to continue it, "
            "or choose another --out"
        )
    return restore_state(found, draft, opt, cfg)


def distill(target: Any, tokenizer: Any, corpus_paths: list[str] | None, cfg: DistillConfig,
            out: Path, *, resume: bool = False, target_name: str = "target",
            recipe: str = "", progress: bool = True) -> dict[str, Any]:
    """Train a draft for `target`, write it to `out` with its card; returns the card."""
    from tqdm import tqdm

    cfg.check()
    layout = draft_layout(cfg, target.cfg.num_layers, target.cfg.vocab_size)
    ids = vocab_ids(layout, target.cfg.vocab_size)
    corpus = load_corpus(corpus_paths, tokenizer, cfg.corpus_tokens, seed=cfg.seed)
    rows = sequences(corpus.train, cfg.seq_len)  # (N, T)
    held = eval_set(target, corpus.heldout, cfg, ids)
    draft, head = prepare_draft(target, layout, ids)
    opt = torch.optim.AdamW(list(trainable(draft).values()), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    meta = start_state(out, resume, draft, opt, cfg)
    step = int(meta["step"]) if meta else 0
    before = meta["before"] if meta else evaluate(draft, head, ids, held)
    history: list[dict[str, Any]] = list(meta["history"]) if meta else []
    seconds = float(meta["train_seconds"]) if meta else 0.0
    bar = tqdm(total=cfg.steps, initial=step, desc="train draft", unit="step",
               disable=not progress, dynamic_ncols=True)
    while step < cfg.steps:
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        tokens = rows[batch_rows(step, cfg.batch, rows.shape[0], cfg.seed)]  # (B, T)
        loss = train_step(target, draft, head, tokens, opt, cfg)
        step += 1
        seconds += time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            history.append({"step": step, "loss": loss, **evaluate(draft, head, ids, held)})
            bar.set_postfix(loss=f"{loss:.3f}", alpha=f"{history[-1]['alpha']:.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_state(out, step, draft, opt, {"config": asdict(cfg), "before": before,
                                               "history": history, "train_seconds": seconds})
    bar.close()
    after = evaluate(draft, head, ids, held)
    save_distilled(draft, out, layout)
    card = model_card(target, target_name, corpus.describe(), cfg, layout, before, after,
                      seconds, history, recipe)
    cards.write_model_card(out, card, "Distilled draft model", CARD_NOTES)
    return card


CARD_NOTES = """A draft model for speculative decoding, distilled from the target named below with
`specdecode train draft` (specdecode.train.distill). It holds only its own decoder blocks and final
norm (bf16); the embedding and the tied LM head are the target's, taken at load time, so it loads
only onto the target whose weights sha256 is recorded here. alpha is E[sum_x min(p(x), q(x))] at
temperature 1 on held-out corpus text; agreement is the share of held-out positions where the
draft's greedy token is the target's."""


def model_card(target: Any, target_name: str, corpus: dict[str, Any], cfg: DistillConfig,
               layout: DraftLayout, before: dict[str, float], after: dict[str, float],
               seconds: float, history: list[dict[str, Any]], recipe: str) -> dict[str, Any]:
    return {
        "kind": "distilled-draft", "target": target_name,
        "target_sha256": cards.weights_sha256(target),
        "layers_from": list(layout.layers_from), "vocab_size": layout.vocab_size,
        "data": corpus, "steps": cfg.steps, "seed": cfg.seed, "loss": cfg.loss,
        "tokens_seen": cfg.steps * cfg.batch * cfg.seq_len, "train_seconds": round(seconds, 1),
        "threads": torch.get_num_threads(),
        "heldout_alpha_before": before["alpha"], "heldout_alpha": after["alpha"],
        "heldout_agreement_before": before["agreement"], "heldout_agreement": after["agreement"],
        "heldout_kl_before": before["kl"], "heldout_kl": after["kl"],
        "config": asdict(cfg), "history": history, "recipe": recipe,
    }
