"""How closely a target precision follows fp32: teacher-forced top-1 agreement and mean KL.

Both models read the same token ids (teacher forcing: every position is conditioned on the
reference text, never on the candidate's own choices), in blocks of `chunk` positions over a KV
cache, the way speculative decoding scores drafts. At each position we compare the next-token
distributions: top-1 agreement is the share of positions whose argmax is the same; KL is
KL(p_fp32 || p_candidate) in nats, averaged over positions.

Free-running greedy agreement (how many generated tokens match) is lower than top-1 agreement:
one disagreement sends the two continuations apart for good.

`python scripts/agreement.py` prints each precision's agreement with fp32 on a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

BUILTIN_TEXT = (
    "The lighthouse keeper's daughter learned to read the weather before she learned to read "
    "books. Every morning she climbed the one hundred and twelve steps to the lamp room, wiped "
    "the salt from the windows, and wrote three numbers in a green notebook: the pressure, the "
    "direction of the wind, and the height of the swell against the north rocks. Her father "
    "said the notebook was a waste of ink, because the sea would do what it wanted anyway.\n\n"
    "\"Then why do you light the lamp?\" she asked him once.\n\n"
    "\"Because ships are not the sea,\" he said. \"Ships listen.\"\n\n"
    "Years later, when the lamp was replaced by an automatic beacon and the keeper's cottage "
    "became a small museum, the green notebooks were found in a wooden chest under the stairs. "
    "There were forty-one of them. A meteorologist from the university spent a winter copying "
    "the numbers into a spreadsheet and discovered that the girl had recorded, without knowing "
    "it, the slow northward drift of the autumn storms over three decades.\n\n"
    "To make bread the way her grandmother did, mix five hundred grams of flour with ten grams "
    "of salt, add three hundred and fifty millilitres of warm water and a spoonful of starter, "
    "and leave the dough covered overnight. In the morning, fold it four times, shape it into a "
    "round loaf, and bake it in a hot oven for forty minutes, until the crust sounds hollow "
    "when you knock on it.\n\n"
    "Question: If a train leaves the station at nine fifteen and the journey takes two hours "
    "and fifty minutes, when does it arrive?\nAnswer: It arrives at twelve oh five, because "
    "two hours after nine fifteen is eleven fifteen, and fifty minutes later is twelve oh five."
)


@dataclass(frozen=True)
class Agreement:
    precision: str
    positions: int  # next-token distributions compared
    top1: float  # share of positions whose argmax agrees with the reference's
    mean_kl: float  # mean KL(p_reference || p_candidate), nats
    max_kl: float
    chunk: int  # positions scored per forward pass

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def teacher_forced_logits(model: Any, ids: Sequence[int], chunk: int) -> torch.Tensor:
    """Logits (T, V) of `ids` scored `chunk` positions per forward pass over one KV cache."""
    cache = model.new_cache(1, len(ids))
    parts = []
    with torch.inference_mode():
        for i in range(0, len(ids), chunk):
            # a copy: a runner may return a view of a buffer its next call overwrites (the
            # llama.cpp backend's logits are llama.cpp's own output buffer)
            parts.append(model(torch.tensor([list(ids[i : i + chunk])]), cache)[0].clone())
    return torch.cat(parts).float()


def compare_logits(
    reference: torch.Tensor, candidate: torch.Tensor
) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL(p_ref || p_cand), max KL) over rows of (T, V) logits."""
    if reference.shape != candidate.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference.shape)} vs "
                         f"{tuple(candidate.shape)}")
    logp = torch.log_softmax(reference.double(), dim=-1)
    logq = torch.log_softmax(candidate.double(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(dim=-1)  # (T,)
    top1 = (reference.argmax(dim=-1) == candidate.argmax(dim=-1)).double().mean()
    return float(top1), float(kl.mean()), float(kl.max())


def agreement(
    reference: Any, candidate: Any, ids: Sequence[int], chunk: int = 8, precision: str = ""
) -> Agreement:
    """Teacher-forced agreement of `candidate` with `reference` on `ids` (see module doc).

    The last position has no next token in `ids` but its distribution is compared too.
    """
    if len(ids) < 2:
        raise ValueError("agreement needs at least two tokens")
    ref = teacher_forced_logits(reference, ids, chunk)
    cand = teacher_forced_logits(candidate, ids, chunk)
    top1, mean_kl, max_kl = compare_logits(ref, cand)
    name = precision or str(getattr(candidate, "precision", "?"))
    return Agreement(name, len(ids), top1, mean_kl, max_kl, chunk)


def precision_agreement(
    model: Any, tokenizer: Any, precisions: Sequence[str] | None = None,
    text: str = BUILTIN_TEXT, chunk: int = 8,
) -> list[Agreement]:
    """Each precision's agreement with `model` (an fp32 native runner) on `text`; default:
    every native precision but the reference that this build and CPU can run (their records,
    models.precision)."""
    from specdecode.models.precision import NATIVE, apply_precision, of_backend

    if precisions is None:
        precisions = [p.name for p in of_backend(NATIVE) if not p.reference
                      and p.missing() is None]
    ids = tokenizer.encode(text)
    ref = teacher_forced_logits(model, ids, chunk)
    results = []
    for precision in precisions:
        candidate = apply_precision(model, precision)
        top1, mean_kl, max_kl = compare_logits(ref, teacher_forced_logits(candidate, ids, chunk))
        results.append(Agreement(precision, len(ids), top1, mean_kl, max_kl, chunk))
    return results
