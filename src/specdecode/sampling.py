"""The one sampling pipeline: the single place where the target's p and the draft's q are computed.

Speculative decoding is lossless only if the target's p and the drafter's q come out of the SAME
processing (docs/design.md): both call `probs_from_logits` here, and sample with `sample`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_SEED, MIN_SEED, RULES

MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; prompt + output tokens (HF / vLLM convention)
    presence_penalty: float = 0.0  # OpenAI convention; output tokens only
    frequency_penalty: float = 0.0  # OpenAI convention; output tokens only
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    seed: int | None = None
    # How a sampled draft is verified (greedy ignores it): "invariant" draws every output
    # position's token by the Gumbel-max trick from noise keyed by (seed, position), so a seed
    # gives the same tokens whatever was drafted (Daliri, Musco and Suresh 2024); "residual" is
    # the standard rejection rule (Leviathan et al. 2023), with the higher acceptance for a
    # drafter that reports q, but tokens that depend on what was drafted. docs/design.md.
    rule: str = "invariant"
    max_tokens: int = 128
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SpecDecodeError naming the first invalid field and its value."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecDecodeError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / t would overflow float32
            raise SpecDecodeError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if self.top_k < 0:
            raise SpecDecodeError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise SpecDecodeError(f"min_p must be in [0, 1), got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 10:
            raise SpecDecodeError(
                f"repetition_penalty must be in [0.01, 10], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not (-2.0 <= value <= 2.0):
                raise SpecDecodeError(f"{name} must be in [-2, 2], got {value}")
        if self.max_tokens < 1:
            raise SpecDecodeError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.rule not in RULES:
            raise SpecDecodeError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise SpecDecodeError(f"seed must be in {MIN_SEED}..{MAX_SEED}, got {self.seed}")
        if any(s == "" for s in self.stop):
            raise SpecDecodeError("stop strings must be non-empty")
        for token, bias in self.logit_bias:
            if vocab_size is not None and not (0 <= token < vocab_size):
                raise SpecDecodeError(
                    f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})"
                )
            if not math.isfinite(bias):
                raise SpecDecodeError(f"logit_bias for token {token} must be finite, got {bias}")


# ---------------------------------------------------------------------------------------------
# Logits processing. Order (fixed; p and q both go through exactly this code):
#   0. constraint mask                (structured output: tokens the grammar forbids -> -inf;
#                                      a row that allows none is left as it is, see
#                                      _apply_allowed)
#   1. logit_bias                     (added to the raw logits)
#   2. repetition penalty             (HF: logit > 0 -> logit / r, else logit * r; every history
#                                      token, prompt included)
#   3. presence / frequency penalties (OpenAI: logit -= presence * [count > 0] + frequency * count,
#                                      counts over OUTPUT tokens only: history[prompt_len:])
#   -- greedy stops here: the argmax of these logits is the token --
#   4. temperature                    (logit / temperature)
#   5. top-k                          (keep logits >= the k-th largest; ties at the edge kept)
#   6. top-p                          (nucleus over the top-k-filtered distribution)
#   7. min-p                          (drop prob < min_p * max prob)
# Masked entries are -inf. Row t of a (T, V) block is scored with history context ++ extra[:t].
# ---------------------------------------------------------------------------------------------

_TOP_P_FIRST_K = 64  # top-p first looks at this many candidates per row (see _apply_top_p)


def process_logits(
    logits: torch.Tensor,  # (T, V) float
    params: SamplingParams,
    context: torch.Tensor,  # (L,) int64: prompt + committed output
    prompt_len: int,
    extra: torch.Tensor,  # (n,) int64, n >= T - 1: draft tokens scored after context
    allowed: torch.Tensor | None = None,  # (T, V) bool: the constraint's mask per row
) -> torch.Tensor:
    """Return the processed float32 logits (T, V) of `logits`, in the order listed above.

    Row t is the distribution of the token that follows ``context ++ extra[:t]``; that history is
    what the penalties count. `prompt_len` splits context into prompt and output (presence and
    frequency penalties count output tokens only; the repetition penalty counts both). For greedy
    params (temperature 0) steps 4-7 are skipped: they cannot move the argmax. Features that are
    off cost nothing; the all-off case is one float32 copy (plus a division when sampling).
    The input tensor is never modified.
    """
    _check_shapes(logits, context, prompt_len, extra)
    x = logits.to(dtype=torch.float32, copy=True)  # (T, V)
    if allowed is not None:
        _apply_allowed(x, allowed)
    if params.logit_bias:
        _apply_logit_bias(x, params.logit_bias)
    drafted = extra[: max(x.shape[0] - 1, 0)]  # (T-1,): extra[s] is in rows t > s
    if params.repetition_penalty != 1.0:
        _apply_repetition_penalty(x, context, drafted, params.repetition_penalty)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        pres, freq = params.presence_penalty, params.frequency_penalty
        _apply_presence_frequency(x, context[prompt_len:], drafted, pres, freq)
    if params.greedy:
        return x
    x.div_(params.temperature)
    if 0 < params.top_k < x.shape[-1]:
        _apply_top_k(x, params.top_k)
    if params.top_p < 1.0:
        _apply_top_p(x, params.top_p)
    if params.min_p > 0.0:
        _apply_min_p(x, params.min_p)
    return x


def probs_from_logits(
    logits: torch.Tensor,  # (T, V) float
    params: SamplingParams,
    context: torch.Tensor,  # (L,) int64
    prompt_len: int,
    extra: torch.Tensor,  # (n,) int64, n >= T - 1
    allowed: torch.Tensor | None = None,  # (T, V) bool: the constraint's mask per row
) -> torch.Tensor:
    """Return the (T, V) float32 sampling distributions: p for the target, q for a drafter.

    Sampling params: softmax of `process_logits`. Greedy params: one-hot rows at the argmax of the
    bias- and penalty-processed logits (ties go to the lowest token id, as torch.argmax does).
    """
    x = process_logits(logits, params, context, prompt_len, extra, allowed)  # (T, V)
    if params.greedy:
        return _one_hot_rows(argmax_rows(x), x.shape[-1])
    return torch.softmax(x, dim=-1)


def greedy_tokens(
    logits: torch.Tensor,  # (T, V) float
    params: SamplingParams,
    context: torch.Tensor,  # (L,) int64
    prompt_len: int,
    extra: torch.Tensor,  # (n,) int64, n >= T - 1
    allowed: torch.Tensor | None = None,  # (T, V) bool: the constraint's mask per row
) -> torch.Tensor:
    """Return the (T,) int64 argmax of the bias- and penalty-processed logits (lowest id on ties).

    The same token `probs_from_logits` puts its one-hot mass on for greedy params; temperature and
    filters in `params` are ignored (greedy decoding is the argmax whatever they are).
    """
    if not uses_history(params) and not params.logit_bias and allowed is None:  # nothing
        # moves the argmax: skip
        if logits.dim() != 2:  # the copy and the context (a step's hot path)
            raise ValueError(f"logits must be (T, V), got shape {tuple(logits.shape)}")
        return argmax_rows(logits)
    greedy = dataclasses.replace(params, temperature=0.0)
    return argmax_rows(process_logits(logits, greedy, context, prompt_len, extra, allowed))


def restrict_probs(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Distributions (T, V) already computed, restricted to the constraint's mask (T, V) and
    renormalised: a draft's q as the engine verifies it (a q drawn through the mask is
    unchanged; one drawn without it becomes the conditional law of a draft token the grammar
    allows, which with forbidden tokens cut before verification keeps any drafter exact, see
    docs/structured-output.md). Rows with no mass inside the mask are left as they are."""
    kept = probs * allowed
    mass = kept.sum(dim=-1, keepdim=True)  # (T, 1)
    return torch.where(mass > 0, kept / mass.clamp(min=1e-30), probs)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The (T,) int64 argmax of each row (lowest id on ties, as torch.argmax). On the CPU through
    numpy, whose vectorized argmax is ~20x faster than torch's over a 49k vocabulary: a plain
    step's largest cost outside the forward pass on a fast runtime (llama.cpp)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and \
            not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=-1).astype("int64", copy=False))
    return x.argmax(dim=-1)


class PositionNoise:
    """A request's Gumbel noise, one (V,) vector per output position, keyed by (seed, position).

    Counter-based: position i's noise is the Philox4x64 stream keyed by (seed mod 2**64, i)
    (numpy's bit generator, whose raw stream numpy keeps stable across versions), so it is the
    same whoever asks for it and in whatever order: plain decoding, the verifier and a model
    drafter all see the same g_i, and no draw elsewhere moves it. Uniforms v from 32 random bits
    go through E = -log1p(-v) (Exp(1), exact near E = 0 where the winning tail lies) and
    g = -log(E) (Gumbel): the winning tail is cut at probability 2**-33 per token and position,
    and the 2**-25 of uniforms that round to 1 in float32 take the largest value below it.
    The last few positions are kept, since a model drafter and then the verifier ask for them.
    """

    def __init__(self, seed: int, keep: int = 8) -> None:
        self.seed = seed % 2**64
        self._keep = keep
        self._made: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    def gumbel(self, position: int, vocab_size: int) -> torch.Tensor:
        """The (vocab_size,) float32 Gumbel noise of output position `position` (>= 0)."""
        key = (position, vocab_size)
        made = self._made.get(key)
        if made is None:
            made = _gumbel(self.seed, position, vocab_size)
            self._made[key] = made
            if len(self._made) > self._keep:
                self._made.popitem(last=False)
        return made


def _gumbel(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    if position < 0:
        raise ValueError(f"output position must be >= 0, got {position}")
    key = np.array([seed, position], dtype=np.uint64)
    raw = np.random.Philox(key=key).random_raw((vocab_size + 1) // 2)
    bits = raw.view(np.uint32)[:vocab_size]
    v = (bits.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-32)
    v = np.minimum(v, np.float32(1 - 2.0**-24), out=v)  # float32 rounds the top bits to 1.0
    return torch.from_numpy(-np.log(-np.log1p(-v)))


def gumbel_argmax(x: torch.Tensor, noise: torch.Tensor | None) -> int:
    """The Gumbel-max token of one row of processed logits `x` (V,): argmax(x + g), which is
    distributed as softmax(x) (masked entries, -inf, never win). No noise: the argmax."""
    if noise is None:
        return int(argmax_rows(x[None])[0])
    return int(argmax_rows((x.to(torch.float32) + noise)[None])[0])


def uses_history(params: SamplingParams) -> bool:
    """Whether the pipeline reads the context (penalties count earlier tokens)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or \
        params.frequency_penalty != 0.0


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of `probs` ((T, V) -> (T,), or (V,) -> scalar), int64.

    Rows need not be normalised but must be non-negative with positive sum. All randomness comes
    from `generator` (None: torch's global generator). One-hot rows return their token.
    """
    if probs.dim() == 1:
        return torch.multinomial(probs, 1, generator=generator)[0]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (T,)


def _check_shapes(
    logits: torch.Tensor, context: torch.Tensor, prompt_len: int, extra: torch.Tensor
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be (T, V), got shape {tuple(logits.shape)}")
    if context.dim() != 1 or extra.dim() != 1:
        raise ValueError("context and extra must be 1-D token id tensors")
    if extra.numel() < logits.shape[0] - 1:
        raise ValueError(f"extra has {extra.numel()} tokens; {logits.shape[0]} rows need >= T-1")
    if not (0 <= prompt_len <= context.numel()):
        raise ValueError(f"prompt_len {prompt_len} outside 0..{context.numel()}")


def _one_hot_rows(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    out = torch.zeros(tokens.shape[0], vocab_size, dtype=torch.float32)  # (T, V)
    out[torch.arange(tokens.shape[0]), tokens] = 1.0
    return out


def _apply_allowed(x: torch.Tensor, allowed: torch.Tensor) -> None:
    """Structured output, in place: -inf where the constraint's (T, V) mask forbids a token.
    A row that allows no token (the grammar's dead end) is left as it is: the engine ends the
    request there and never emits a token drawn from it."""
    if allowed.shape != x.shape:
        raise ValueError(f"allowed must be {tuple(x.shape)}, got {tuple(allowed.shape)}")
    blocked = ~allowed & allowed.any(dim=-1, keepdim=True)  # (T, V)
    x.masked_fill_(blocked, -math.inf)


def _apply_logit_bias(x: torch.Tensor, logit_bias: tuple[tuple[int, float], ...]) -> None:
    """Add each (token, bias) to column `token` of every row, in place (repeated ids add up)."""
    ids = torch.tensor([token for token, _ in logit_bias], dtype=torch.int64)  # (B,)
    bias = torch.tensor([value for _, value in logit_bias], dtype=torch.float32)  # (B,)
    x.index_add_(1, ids, bias.expand(x.shape[0], -1))


def _history_counts(
    base: torch.Tensor,  # (L,) int64: tokens in every row's history
    extra: torch.Tensor,  # (T-1,) int64: extra[s] is in the history of rows t > s
    num_rows: int,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cols, counts): the U distinct ids in any row's history, sorted, (U,) int64, and
    counts[t, j] = occurrences of cols[j] in ``base ++ extra[:t]``, (T, U) float32."""
    seen = torch.cat([base, extra])  # (L + T - 1,)
    cols, inverse = torch.unique(seen, return_inverse=True)  # (U,), (L + T - 1,)
    if cols.numel() and (cols[0] < 0 or cols[-1] >= vocab_size):
        raise ValueError(f"history token ids must be in 0..{vocab_size - 1}")
    n_base = base.numel()
    counts = torch.bincount(inverse[:n_base], minlength=cols.numel()).to(torch.float32)  # (U,)
    counts = counts.expand(num_rows, -1).clone()  # (T, U)
    if num_rows > 1:
        rows, src = torch.tril_indices(num_rows, num_rows - 1, offset=-1)  # pairs s < t
        ones = torch.ones(rows.numel(), dtype=torch.float32)
        counts.index_put_((rows, inverse[n_base + src]), ones, accumulate=True)
    return cols, counts


def _apply_repetition_penalty(
    x: torch.Tensor, context: torch.Tensor, extra: torch.Tensor, penalty: float
) -> None:
    """HF convention, in place: for every token in the row's history (prompt included), a
    positive logit is divided by `penalty` and a negative one multiplied by it."""
    cols, counts = _history_counts(context, extra, x.shape[0], x.shape[-1])  # (U,), (T, U)
    sub = x[:, cols]  # (T, U)
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    x[:, cols] = torch.where(counts > 0, penalised, sub)


def _apply_presence_frequency(
    x: torch.Tensor, output: torch.Tensor, extra: torch.Tensor, presence: float, frequency: float
) -> None:
    """OpenAI convention, in place: logit -= presence * [count > 0] + frequency * count, where
    count is the token's number of occurrences among the row's OUTPUT tokens."""
    cols, counts = _history_counts(output, extra, x.shape[0], x.shape[-1])  # (U,), (T, U)
    x[:, cols] -= frequency * counts + presence * (counts > 0).to(torch.float32)


def _apply_top_k(x: torch.Tensor, top_k: int) -> None:
    """Mask (in place) logits below each row's k-th largest; ties with the k-th are kept."""
    kth = torch.topk(x, top_k, dim=-1).values[:, -1:]  # (T, 1)
    x.masked_fill_(x < kth, -math.inf)


def _apply_top_p(x: torch.Tensor, top_p: float) -> None:
    """Nucleus filter, in place: keep the smallest set of most likely tokens whose probability
    sums to >= top_p (always at least the top token); tokens tied with the least likely kept
    token are kept too, so the result does not depend on sort order.

    Looks at the top 64 candidates first, then 8x more while some row's nucleus is not inside
    them (all of them once that would pass V/4): sorting a whole 49k vocabulary is ~30x slower
    than the first look, and most nuclei are small."""
    probs = torch.softmax(x, dim=-1)  # (T, V)
    vocab_size = x.shape[-1]
    k = min(_TOP_P_FIRST_K, vocab_size)
    while True:
        top = torch.topk(probs, k, dim=-1).values  # (T, k) descending
        cum = top.to(torch.float64).cumsum(dim=-1)  # (T, k)
        if k == vocab_size or bool((cum[:, -1] >= top_p).all()):
            break
        k = 8 * k if 8 * k <= vocab_size // 4 else vocab_size  # a large top-k costs a sort
    mass_before = cum - top.to(torch.float64)  # (T, k): mass of the strictly more likely ones
    n_keep = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)  # (T, 1)
    threshold = top.gather(-1, n_keep - 1)  # (T, 1)
    x.masked_fill_(probs < threshold, -math.inf)


def _apply_min_p(x: torch.Tensor, min_p: float) -> None:
    """Mask (in place) tokens with prob < min_p * max prob, compared in log space:
    x - max(x) < log(min_p), which is the same condition on the softmax."""
    top = x.max(dim=-1, keepdim=True).values  # (T, 1)
    x.masked_fill_(x < top + math.log(min_p), -math.inf)
