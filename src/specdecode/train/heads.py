"""`specdecode train heads`: train the EAGLE-style feature drafter (drafters.heads) on the frozen
target's own hidden states and predictions over an offline corpus.

Recipe (after EAGLE, Li et al. 2024):
1. corpus -> token stream (train.corpus); the draft vocabulary S is the `draft_vocab` most frequent
   tokens of the training stream (FR-Spec, Zhao et al. 2025), plus the end-of-sequence ids;
2. the target runs once over every training sequence; its features (hidden states after the
   final norm) are stored in shards under OUT/features/<target sha256 prefix> (bf16), so a
   resumed run never recomputes them and training can take several passes over them;
3. the drafter is trained teacher-forced on (token_{j+1}, f_j) -> f_{j+1}: smooth-L1 regression
   to the target's next feature plus `kl_weight` x cross-entropy to the target's distribution over
   S (softmax of its LM head rows of S at f_{j+1}), with uniform noise on the input features
   (EAGLE's remedy for the drafter's own errors when it drafts several tokens);
4. checkpoints every `checkpoint_every` steps (train.checkpoint; no pickle), resumable; batches
   and noise are seeded per step, so an interrupted run resumes to the same weights;
5. held-out evaluation: per draft position, the top-1 agreement of the draft with the target
   (`heldout_alpha`); the weights, bf16, go to OUT/heads.safetensors with a model card.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.drafters.heads import WEIGHTS_FILE, FeatureDrafterModel
from specdecode.errors import SpecDecodeError
from specdecode.models.cards import atomic_save_tensors, weights_sha256, write_model_card
from specdecode.models.llama import LlamaModel
from specdecode.train.checkpoint import (
    latest_checkpoint,
    load_optimizer_state,
    optimizer_state,
    save_checkpoint,
)
from specdecode.train.corpus import Corpus, load_corpus, sequences


@dataclass(frozen=True)
class HeadsTrainConfig:
    steps: int = 500  # optimizer steps
    batch: int = 8  # sequences per step
    seq_len: int = 128  # tokens per sequence
    train_tokens: int = 80_000  # training tokens the target extracts features for
    heldout_tokens: int = 2_048  # held-out tokens for the alpha evaluation
    draft_vocab: int = 8_192  # size of the draft vocabulary S
    lr: float = 3e-3
    warmup: int = 50  # linear warm-up steps, then cosine decay to lr / 10
    weight_decay: float = 0.0
    kl_weight: float = 1.0  # weight of the cross-entropy to the target's distribution
    noise: float = 0.1  # uniform noise on input features, times the feature RMS
    checkpoint_every: int = 100
    shard_sequences: int = 16  # sequences per feature shard
    eval_positions: int = 5  # draft positions evaluated on held-out text
    seed: int = 0

    def check(self) -> None:
        for name in ("steps", "batch", "seq_len", "train_tokens", "heldout_tokens", "draft_vocab",
                     "checkpoint_every", "shard_sequences", "eval_positions"):
            if getattr(self, name) < 1:
                raise SpecDecodeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < self.eval_positions + 3:
            raise SpecDecodeError(f"seq_len must be >= eval_positions + 3, got {self.seq_len}")


# Fields that may change when resuming (everything else must match the checkpoint).
_RESUMABLE_CHANGES = frozenset(("steps", "checkpoint_every"))


# ---------------------------------------------------------------------------------------------
# Data: draft vocabulary and target features
# ---------------------------------------------------------------------------------------------


def frequent_vocab(stream: torch.Tensor, size: int, vocab_size: int,
                   always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent ids of `stream` (ties: lower id first) plus `always`, sorted."""
    counts = torch.bincount(stream, minlength=vocab_size).double()  # (V,)
    counts[list(always)] = math.inf
    order = sorted(range(vocab_size), key=lambda i: (-float(counts[i]), i))[: min(size, vocab_size)]
    return torch.tensor(sorted(order), dtype=torch.long)


def target_features(target: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The target's hidden states after its final norm for (B, T) tokens: (B, T, H) fp32."""
    with torch.inference_mode():
        return target(tokens, target.new_cache(tokens.shape[0], tokens.shape[1]),
                      return_hidden=True).float().clone()


def feature_shards(target: Any, seqs: torch.Tensor, folder: Path, per_shard: int,
                   desc: str, progress: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (N, T), features (N, T, H) bf16) for `seqs`, computed shard by shard and stored
    under `folder`; shards already there with the same tokens are reused."""
    from safetensors.torch import load_file
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    feats: list[torch.Tensor] = []
    starts = range(0, seqs.shape[0], per_shard)
    bar = tqdm(total=seqs.shape[0] * seqs.shape[1], desc=desc, unit="tok", disable=not progress,
               file=sys.stderr)
    for i in starts:
        chunk = seqs[i : i + per_shard]
        path = folder / f"shard-{i // per_shard:05d}.safetensors"
        stored = load_file(str(path)) if path.is_file() else {}
        if "tokens" in stored and torch.equal(stored["tokens"], chunk):
            feats.append(stored["feats"])
        else:
            f = target_features(target, chunk).to(torch.bfloat16)
            atomic_save_tensors(path, {"tokens": chunk, "feats": f})
            feats.append(f)
        bar.update(chunk.numel())
    bar.close()
    return seqs, torch.cat(feats)


# ---------------------------------------------------------------------------------------------
# Loss, schedule, evaluation
# ---------------------------------------------------------------------------------------------


def heads_loss(model: FeatureDrafterModel, tokens: torch.Tensor, feats: torch.Tensor,
               cfg: HeadsTrainConfig, gen: torch.Generator | None) -> torch.Tensor:
    """Teacher-forced EAGLE loss on (B, T) tokens and their (B, T, H) target features."""
    inp = feats[:, :-1]  # (B, T-1, H): f_j
    if gen is not None and cfg.noise > 0:
        scale = cfg.noise * float(inp.pow(2).mean().sqrt())
        inp = inp + (torch.rand(inp.shape, generator=gen) * 2 - 1) * scale
    pred = model(tokens[:, 1:], inp, model.new_cache(tokens.shape[0], tokens.shape[1]))
    goal = feats[:, 1:]  # (B, T-1, H): f_{j+1}
    reg = F.smooth_l1_loss(pred, goal)
    with torch.no_grad():
        p = torch.softmax(model.logits(goal), dim=-1)  # (B, T-1, S): target over S
    ce = -(p * torch.log_softmax(model.logits(pred), dim=-1)).sum(-1).mean()
    return reg + cfg.kl_weight * ce


def learning_rate(step: int, cfg: HeadsTrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr / 10 at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def batch_rows(step: int, n: int, batch: int, seed: int) -> torch.Tensor:
    """Sequence indices of `step`: epochs are seeded permutations of the n sequences."""
    per_epoch = max(1, n // batch)
    epoch, slot = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return perm[slot * batch : slot * batch + batch]


def heldout_alpha(model: FeatureDrafterModel, target: Any, tokens: torch.Tensor,
                  feats: torch.Tensor, positions: int) -> dict[str, list[float]]:
    """Top-1 agreement of the draft with the target per draft position on held-out sequences.

    For every start j of every sequence, the draft chains `positions` steps as in decoding:
    position 1 from the target's feature f_j (teacher-forced entries 0..j in its cache), later
    positions from its own predicted features, each fed the text's next token. Position i agrees
    when the draft's argmax (over S) equals the target's argmax (over the whole vocabulary) of
    the same token. "agreement": per position over all starts; "conditional": over the starts
    whose earlier positions all agreed (what chain acceptance needs).
    """
    from specdecode.drafters.heads import target_head_weight

    head = target_head_weight(target)  # (V, H)
    hits = torch.zeros(positions)
    chain = torch.zeros(positions)
    alive = torch.zeros(positions)
    total = 0
    with torch.inference_mode():
        for seq, f in zip(tokens, feats.float(), strict=True):
            T = seq.numel()
            top = (f @ head.T).argmax(-1)  # (T,): target's prediction of token t+1
            starts = T - 1 - positions  # starts j = 0..starts-1 keep every position in range
            single = model.new_cache(1, T)
            h = model(seq[None, 1:], f[None, :-1], single)[0]  # (T-1, H): teacher-forced
            cache = model.new_cache(starts, T)
            cache.k[:], cache.v[:] = single.k, single.v  # every row: the teacher-forced entries
            j = torch.arange(starts)
            cur = h[j]  # (starts, H): entry j's prediction of f_{j+1}
            cache.lengths = [b + 1 for b in range(starts)]  # row b keeps entries 0..b only
            ok = torch.ones(starts, dtype=torch.bool)
            for i in range(positions):
                match = model.full_logits(cur).argmax(-1) == top[j + 1 + i]
                alive[i] += float(ok.sum())
                ok = ok & match
                hits[i] += float(match.sum())
                chain[i] += float(ok.sum())
                if i + 1 < positions:
                    nxt = seq[j + 2 + i][:, None]  # (starts, 1): token j+2+i
                    cur = model(nxt, cur[:, None], cache)[:, 0]
            total += starts
    return {"agreement": (hits / total).tolist(),
            "conditional": (chain / alive.clamp(min=1)).tolist()}


# ---------------------------------------------------------------------------------------------
# The training run
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    seconds: float
    alpha: dict[str, list[float]]
    alpha_untrained: dict[str, list[float]]
    card: dict[str, Any]


def _check_resume(meta: dict[str, Any], cfg: HeadsTrainConfig, folder: Path) -> None:
    saved = meta.get("config", {})
    for key, value in dataclasses.asdict(cfg).items():
        if key not in _RESUMABLE_CHANGES and key in saved and saved[key] != value:
            raise SpecDecodeError(
                f"{folder}: cannot resume: the checkpoint was trained with {key}={saved[key]}, "
                f"this run asks for {value} (use another --out or the same settings)"
            )


def _prepare(loaded: Any, corpus: Corpus, cfg: HeadsTrainConfig, out_dir: Path,
             progress: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training and held-out (tokens, features), extracted or read from out_dir/features."""
    target = loaded.model
    train = sequences(corpus.train, cfg.seq_len)
    held = sequences(corpus.heldout, cfg.seq_len)[: max(1, cfg.heldout_tokens // cfg.seq_len)]
    folder = out_dir / "features" / weights_sha256(target)[:16]  # shards of this target only
    tr_tok, tr_feat = feature_shards(target, train, folder / "train", cfg.shard_sequences,
                                     "target features (train)", progress)
    ho_tok, ho_feat = feature_shards(target, held, folder / "heldout", cfg.shard_sequences,
                                     "target features (held-out)", progress)
    return tr_tok, tr_feat, ho_tok, ho_feat


def train_heads(
    loaded: Any,
    corpus_paths: list[str] | None,
    cfg: HeadsTrainConfig,
    out_dir: Path,
    resume: bool = False,
    progress: bool = True,
    recipe: str = "",
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train heads for `loaded` (a LoadedModel) into `out_dir`; see the module docstring.

    `on_step(step)` is called after every optimizer step (tests interrupt a run with it).
    """
    from tqdm import tqdm

    cfg.check()
    if not isinstance(loaded.model, LlamaModel):
        raise SpecDecodeError("training heads needs a target on the native runner")
    target = loaded.model
    start_time = time.perf_counter()
    ckpt = latest_checkpoint(out_dir / "checkpoints") if resume else None
    if ckpt is not None:
        _check_resume(ckpt.meta, cfg, ckpt.path)
    elif (out_dir / "checkpoints").is_dir():  # a fresh run: older checkpoints would mix in
        shutil.rmtree(out_dir / "checkpoints")
    corpus = load_corpus(corpus_paths, loaded.tokenizer, cfg.train_tokens,
                         cfg.heldout_tokens / (cfg.train_tokens + cfg.heldout_tokens), cfg.seed)
    tr_tok, tr_feat, ho_tok, ho_feat = _prepare(loaded, corpus, cfg, out_dir, progress)
    eos = loaded.eos_ids
    vocab = frequent_vocab(corpus.train, cfg.draft_vocab, target.cfg.vocab_size, eos)
    torch.manual_seed(cfg.seed)  # the fc initialisation
    model = FeatureDrafterModel(target, vocab)
    untrained = heldout_alpha(model, target, ho_tok, ho_feat, cfg.eval_positions)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step, spent = 0, 0.0
    if ckpt is not None:
        model.load_trained_state({k[6:]: v for k, v in ckpt.tensors.items()
                                  if k.startswith("model.")}, str(ckpt.path))
        load_optimizer_state(opt, ckpt.tensors, ckpt.meta["optimizer"])
        step, spent = ckpt.step, float(ckpt.meta.get("train_seconds", 0.0))
    bar = tqdm(total=cfg.steps, initial=step, desc="train heads", unit="step",
               disable=not progress, file=sys.stderr)
    model.train()
    run_start = time.perf_counter()
    while step < cfg.steps:
        rows = batch_rows(step, tr_tok.shape[0], cfg.batch, cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg)
        loss = heads_loss(model, tr_tok[rows], tr_feat[rows].float(), cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _save(out_dir, step, model, opt, cfg, spent + time.perf_counter() - run_start)
        if on_step is not None:
            on_step(step)
    bar.close()
    model.eval()
    alpha = heldout_alpha(model, target, ho_tok, ho_feat, cfg.eval_positions)
    seconds = time.perf_counter() - start_time
    card = _card(loaded, corpus, cfg, step, spent + time.perf_counter() - run_start, seconds,
                 alpha, untrained, vocab, recipe)
    write_heads(out_dir, model, card)
    return TrainResult(out_dir, step, seconds, alpha, untrained, card)


def _save(out_dir: Path, step: int, model: FeatureDrafterModel, opt: torch.optim.Optimizer,
          cfg: HeadsTrainConfig, train_seconds: float) -> None:
    opt_tensors, opt_meta = optimizer_state(opt)
    tensors = {f"model.{k}": v for k, v in model.trained_state().items()}
    tensors.update(opt_tensors)
    meta = {"config": dataclasses.asdict(cfg), "seed": cfg.seed, "optimizer": opt_meta,
            "train_seconds": train_seconds,
            "rng": "per step: torch.Generator seeded seed * 1000003 + step (noise); "
                   "batches: randperm seeded seed * 7919 + epoch"}
    save_checkpoint(out_dir / "checkpoints", step, tensors, meta)


def _card(loaded: Any, corpus: Corpus, cfg: HeadsTrainConfig, steps: int, train_seconds: float,
          seconds: float, alpha: dict[str, list[float]], untrained: dict[str, list[float]],
          vocab: torch.Tensor, recipe: str) -> dict[str, Any]:
    return {
        "kind": "heads (EAGLE-style feature drafter: fc + 1 Llama block, frozen target head)",
        "target": loaded.name,
        "target_sha256": weights_sha256(loaded.model),
        "target_precision": loaded.model.precision,
        "data": corpus.describe(),
        "steps": steps,
        "seed": cfg.seed,
        "config": dataclasses.asdict(cfg),
        "draft_vocab": int(vocab.numel()),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(seconds, 1),
        "threads": torch.get_num_threads(),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "alpha_heldout": [round(a, 4) for a in alpha["agreement"]],
        "alpha_heldout_conditional": [round(a, 4) for a in alpha["conditional"]],
        "alpha_heldout_untrained": [round(a, 4) for a in untrained["agreement"]],
        "recipe": recipe,
    }


CARD_NOTES = """Trained by `specdecode train heads` (see the recipe below). alpha_heldout[i] is the
top-1 agreement of the draft with the target at draft position i+1 on held-out corpus text
(position 1 from the target's feature, later positions from the draft's own features, inputs
the text's tokens); alpha_heldout_conditional[i] counts only starts whose earlier positions
agreed. The weights are refused for any target whose weights sha256 differs from target_sha256."""


def write_heads(out_dir: Path, model: FeatureDrafterModel, card: dict[str, Any]) -> None:
    """heads.safetensors (float tensors in bf16, the subset ids int32) and the model card."""
    state = {k: (v.to(torch.int32) if k == "vocab" else v.detach().to(torch.bfloat16))
             for k, v in model.trained_state().items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_save_tensors(out_dir / WEIGHTS_FILE, state)
    write_model_card(out_dir, card, "Heads (EAGLE-style feature drafter)", CARD_NOTES)
