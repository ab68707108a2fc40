"""An EAGLE-style feature drafter trained on the frozen target (Li et al. 2024, "EAGLE:
Speculative Sampling Requires Rethinking Feature Uncertainty").

The target's last hidden state f_t (after its final norm: the vector its LM head reads) carries
most of what the next tokens will be. The drafter predicts the NEXT feature from the current one
and the token that was actually chosen, with one decoder layer of its own:

    x_j = fc(concat(rms(embed(token_{j+1})), f_j / g))  # (2H -> H), embed = the target's, frozen
    h_j = norm(block(x_j | x_0..x_{j-1}))           # one Llama block with its own KV cache
    q(token_{j+2}) = softmax(lm_head_S(h_j))        # the target's LM head rows of S, frozen

and drafts autoregressively by feeding its own predicted feature h_j back as f_{j+1}. Both inputs
enter fc at unit scale: the embedding RMS-normalised, the feature divided by the target's final
norm gain g. The block starts from a small random initialisation: started from a copy of the
target's last block it got stuck predicting the most frequent tokens (measured:
docs/measurements/code-figures.md). Features of
committed positions come from the target (the engine passes them to `observe` after each step);
predicted ones only live for the current proposal.

Reduced draft vocabulary (as FR-Spec, Zhao et al. 2025, and EAGLE-3 do): the draft's LM head keeps
only the rows of a frequent-token subset S (`vocab`), so its cost stays a fraction of the
target's 49k-row head. q is then zero outside S: still a distribution, computed by the same
sampling pipeline as the target's p from logits that are -inf outside S, so verification stays
lossless (a token outside S is simply never drafted; the target can still emit it).

Trained weights (fc, block, norm and the subset ids) live in a folder with a model card that
names the target by the sha256 of its weights; weights made for another target are refused.
`specdecode train heads` (train.heads) makes them; the default folder ships in the package.
"""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from specdecode.drafters.base import EMPTY, Draft, Drafter, DraftRequest, draw, ids_tensor
from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.models.cache import KVCache
    from specdecode.models.config import ModelConfig
    from specdecode.models.llama import LlamaModel

WEIGHTS_FILE = "heads.safetensors"
DEFAULT_HEADS = "smollm2-135m"  # folder under specdecode/data/heads


def default_heads_dir() -> Path:
    """The shipped weights for the default target (may be absent from a source checkout)."""
    return Path(str(resources.files("specdecode") / "data" / "heads" / DEFAULT_HEADS))


class FeatureDrafterModel(nn.Module):
    """fc + one Llama block + norm over the target's features; LM head = target rows of `vocab`.

    The block runs through the native runner itself (a one-block LlamaModel fed `embeds`), so
    training and drafting share one forward. The token embedding and the LM head are the
    target's, frozen and never saved.
    """

    def __init__(self, target: LlamaModel, vocab: torch.Tensor) -> None:
        super().__init__()
        from specdecode.models.llama import Linear, LlamaModel

        cfg = target.cfg
        self.vocab: torch.Tensor
        self.register_buffer("vocab", vocab.to(torch.long).clone())  # (S,) token ids
        self.target_vocab = cfg.vocab_size
        dcfg = dataclasses.replace(cfg, num_layers=1, vocab_size=int(vocab.numel()),
                                   tie_embeddings=True)
        with torch.device("meta"):
            self.core = LlamaModel(dcfg)
        head = target_head_weight(target)[self.vocab].clone()  # (S, H)
        embedding = nn.Embedding.from_pretrained(head, freeze=True)  # unused: embeds given
        lm = Linear(cfg.hidden_size, head.shape[0], bias=False)
        lm.weight = embedding.weight
        self.core.embed = embedding
        self.core.lm_head = lm
        self.core.inv_freq = target.inv_freq.clone()
        self.core.norm = nn.Parameter(target.norm.detach().clone())
        self.core.layers[0] = init_block(dcfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.feat_scale: torch.Tensor
        self.register_buffer("feat_scale", 1.0 / target.norm.detach().float().clone(),
                             persistent=False)  # (H,): undoes the target's final norm gain
        self._embed = [target.embed]  # a list: not a submodule (frozen, never saved)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return self.core.new_cache(batch, capacity)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Predicted next features (B, T, H) for entries (tokens[:, j], feats[:, j]).

        tokens: (B, T) the token at position j+1; feats: (B, T, H) the feature at position j.
        """
        with torch.no_grad():
            emb = self._embed[0](tokens).float()  # (B, T, H)
            emb = F.rms_norm(emb, (emb.shape[-1],))
        x = self.fc(torch.cat([emb, feats * self.feat_scale], dim=-1))  # (B, T, H)
        return self.core(tokens, cache, embeds=x, return_hidden=True)  # type: ignore[no-any-return]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the subset: (..., S)."""
        return self.core.lm_head(hidden).float()  # type: ignore[no-any-return]

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the whole vocabulary, -inf outside the subset: (T, V)."""
        sub = self.logits(hidden)  # (T, S)
        out = torch.full((sub.shape[0], self.target_vocab), -math.inf)
        out[:, self.vocab] = sub
        return out

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors training changes (and the subset): what a weights file holds."""
        block = self.core.layers[0]
        out = {f"fc.{k}": v for k, v in self.fc.state_dict().items()}
        out.update({f"block.{k}": v for k, v in block.state_dict().items()})
        out["norm"] = self.core.norm.detach()
        out["vocab"] = self.vocab
        return out

    def load_trained_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        expect = self.trained_state()
        if set(state) != set(expect) or any(state[k].shape != expect[k].shape for k in expect):
            raise SpecDecodeError(f"{source}: heads weights do not fit this target's shapes")
        with torch.no_grad():
            self.fc.load_state_dict({k[3:]: state[k].float() for k in state if k[:3] == "fc."})
            self.core.layers[0].load_state_dict(
                {k[6:]: state[k].float() for k in state if k.startswith("block.")})
            self.core.norm.copy_(state["norm"].float())
        if not torch.equal(self.vocab, state["vocab"].to(torch.long)):
            raise SpecDecodeError(f"{source}: heads vocabulary differs from the model's")


def target_head_weight(target: LlamaModel) -> torch.Tensor:
    """The target's LM head as an fp32 (V, H) matrix."""
    from specdecode.models.linears import float_weight

    return float_weight(target.lm_head)[0].detach().float()


def init_block(cfg: ModelConfig, std: float = 0.02) -> nn.Module:
    """The draft block: matrices ~ N(0, std^2), biases zero, norm gains one (from torch's RNG)."""
    from specdecode.models.llama import Block

    block = Block(cfg)
    with torch.no_grad():
        for p in block.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
            elif p is not block.attn_norm and p is not block.mlp_norm:
                p.zero_()
    return block


def load_heads(target: LlamaModel, folder: Path) -> FeatureDrafterModel:
    """Trained heads from `folder` (heads.safetensors + card.json) for `target`; refused with a
    clear message if they were trained for another target."""
    from specdecode.models.cards import check_target, read_card

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise SpecDecodeError(f"{folder}: no {WEIGHTS_FILE} (train heads with "
                              "`specdecode train heads` or pass --heads PATH)")
    check_target(read_card(folder), target, folder)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise SpecDecodeError(f"{path}: corrupt or unreadable safetensors ({exc})") from exc
    if "vocab" not in state:
        raise SpecDecodeError(f"{path}: no 'vocab' tensor (not a heads weights file)")
    model = FeatureDrafterModel(target, state["vocab"])
    model.load_trained_state(state, str(path))
    return model.eval()


class HeadsDrafter(Drafter):
    """Per-request EAGLE drafter: target features in, one draft block with its own KV cache.

    Draft-cache entry j holds (token_{j+1}, f_j); entries built from the target's features stay
    valid across steps (re-synced by common prefix), entries from predicted features are
    overwritten at the next proposal.
    """

    name = "heads"
    wants_hidden = True  # the engine passes the target's features to `observe`

    def __init__(self, model: FeatureDrafterModel, capacity: int = 4096) -> None:
        self.model = model
        self.capacity = capacity
        self.feats = torch.zeros(0, model.fc.out_features)  # (n, H): target features, pos 0..
        self.num_feats = 0
        self.cache: KVCache | None = None
        self.fed: list[int] = []  # token of each valid draft-cache entry (token_{j+1})

    def reset(self) -> None:
        self.feats, self.num_feats, self.cache, self.fed = self.feats[:0], 0, None, []

    def weights(self) -> FeatureDrafterModel:
        return self.model

    def kv_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """The target's features (n, H) of context positions start..start+n-1 (after its final
        norm). Later positions are forgotten; draft entries that used them become invalid."""
        n = hidden.shape[0]
        if start > self.num_feats:  # a gap: features of the positions in between are unknown
            return
        with torch.inference_mode():
            if self.feats.shape[0] < start + n:
                size = max(start + n, 2 * self.feats.shape[0], 128)
                grown = torch.zeros(size, self.feats.shape[1])
                grown[: self.num_feats] = self.feats[: self.num_feats]
                self.feats = grown
            self.feats[start : start + n] = hidden.float()
        self.num_feats = start + n
        del self.fed[start:]

    def _reserve(self, entries: int) -> KVCache:
        """The draft cache, holding `entries` positions: allocated, or grown (doubling)."""
        old = self.cache
        if old is not None and old.capacity >= entries:
            return old
        size = min(self.capacity, max(entries, 128, 2 * (old.capacity if old else 0)))
        self.cache = self.model.new_cache(1, size)
        if old is not None:
            self.cache.copy_row(0, old, 0, old.lengths[0])
        return self.cache

    def _sync(self, ctx: list[int], cache: KVCache) -> torch.Tensor:
        """Entries 0..L-2 for context `ctx` (L tokens) from the target's features; the predicted
        feature of position L-1 (1, H)."""
        last = len(ctx) - 2  # the last entry: (token L-1, feature L-2)
        n = 0
        while n < min(len(self.fed), last) and self.fed[n] == ctx[n + 1]:
            n += 1
        cache.rollback(0, n)
        tokens = torch.tensor([ctx[n + 1 :]])  # (1, L-1-n)
        hidden = self.model(tokens, self.feats[n : last + 1][None], cache)[0]
        self.fed = ctx[1:]
        return hidden[-1:]  # (1, H)

    def propose(self, request: DraftRequest) -> Draft:
        with torch.inference_mode():
            return self._propose(request.context.tolist(), request.k, request)

    def _propose(self, ctx: list[int], k: int, request: DraftRequest) -> Draft:
        if len(ctx) < 2 or self.num_feats < len(ctx) - 1 or len(ctx) + k > self.capacity:
            return Draft(EMPTY, None)  # no target features for this context (yet)
        cache = self._reserve(len(ctx) + k)
        hidden = self._sync(ctx, cache)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            logits = self.model.full_logits(hidden)  # (1, V)
            tok, q = draw(logits, request, ids_tensor(ctx + tokens), i, request.allowed(tokens))
            qs += [] if q is None else [q]
            tokens.append(tok)
            if i + 1 < k:
                hidden = self.model(torch.tensor([[tok]]), hidden[None], cache)[0]
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(qs) if qs else None)
