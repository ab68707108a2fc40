"""Drafters by name, as the CLI, the benchmark and the server ask for them.

`drafter_factory` loads whatever weights a drafter needs once and returns a function that makes
a fresh per-request drafter sharing them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from specdecode.drafters.base import Drafter, require_native
from specdecode.drafters.hybrid import PREFIX, SUFFIX_PREFIX, lookup_part, model_part
from specdecode.errors import SpecDecodeError
from specdecode.limits import SUFFIX_STORE_MIB, SUFFIX_STORE_REQUESTS

TREE_SUFFIX = "-tree"  # X-tree: draft model X proposing sibling leaves where unsure (trees)
TREE_MODELS = ("w4a16", "int8", "distilled", "draft-model")
DRAFTERS = ("none", "draft-model", "int8", "w4a16", "ngram", "layerskip", "heads", "distilled",
            "xtok", "suffix", "ngram-tree", *(m + TREE_SUFFIX for m in TREE_MODELS),
            *(prefix + m for prefix in (PREFIX, SUFFIX_PREFIX)
              for m in ("w4a16", "int8", "distilled", "draft-model", "layerskip")))

DrafterFactory = Callable[[], Drafter]


# Targets whose logits for a position depend on what else is scored with it, and why.
NOT_BATCH_INVARIANT = {
    "int8": "its kernels quantize each call's activations with one scale, so a position scored "
            "with draft tokens gets different logits than scored alone",
    "w8a16": "its products round activations and outputs to bf16, which turns the float-rounding "
             "differences of attention between batch shapes into differences of 0.1-0.5 of a "
             "logit (greedy speculative output differed from plain on 4-5 of 24 built-in "
             "prompts)",
}
NOT_BATCH_INVARIANT["w4a16"] = NOT_BATCH_INVARIANT["w8a16"]


def check_batch_invariant(precision: str) -> None:
    """Refuse speculation on a target whose logits for a position depend on what else is scored
    with it: then no drafter can be token-identical to plain decoding of that target.

    int8: its fbgemm kernels quantize the activations of a whole call with one scale (on
    SmolLM2, greedy speculative output differed from plain int8 decoding on 4 of 4 prompts). A
    fixed activation range would restore invariance but cost most of the int8 target's
    agreement with fp32 (top-1 0.34 against 0.74, measured). w8a16 / w4a16: their products are
    row-invariant bit for bit, but attention is not (MKL's GEMMs and the fused attention kernel
    pick kernels by shape: ~3e-7 between one and five scored rows), and bf16 rounding of every
    product's input and output amplifies that (0.2 in the final hidden state): with n-gram
    drafts at k=4, 19 of 24 built-in prompts (48 tokens, greedy) came out identical at batch 1
    and 20 at batch 8, against 24 and 24 at fp32. Bit-exact row-invariant attention kernels
    would lift this. The int8 and w4a16 copies stay available as drafters, where invariance
    does not matter.
    """
    why = NOT_BATCH_INVARIANT.get(precision)
    if why is not None:
        raise SpecDecodeError(
            f"speculative decoding needs a batch-invariant target, and --precision {precision} "
            f"is not: {why}; the output could not be token-identical to plain {precision} "
            "decoding. Use --precision fp32 or bf16 for speculation (e.g. with --drafter w4a16, "
            "the 4-bit copy of the target, as the draft), or --drafter none")


def check_measured_invariance(target: Any) -> None:
    """Refuse speculation on a target whose load-time invariance check (models.llamacpp
    .batch_invariance) saw a position's logits move with the batch shape, unless the
    environment sets SPECDECODE_ALLOW_INEXACT=1 (then a warning: the output distribution is
    still the target's up to those rounding differences, but not token-identical)."""
    import os
    import sys

    measured = getattr(target, "invariance", None)
    if measured is None or measured.exact:
        return
    message = (f"this llama.cpp build is not batch-invariant ({measured.describe()}), so "
               "speculative output could not be token-identical to its plain decoding. Rebuild "
               "llama-cpp-python with CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" (scripts/"
               "install_llamacpp.sh does), or set SPECDECODE_ALLOW_INEXACT=1 to speculate anyway")
    if os.environ.get("SPECDECODE_ALLOW_INEXACT") == "1":
        print(f"warning: {message}", file=sys.stderr)
        return
    raise SpecDecodeError(message)


def drafter_factory(
    name: str,
    target: Any,
    draft_model: str | None = None,
    capacity: int = 4096,
    *,
    ngram_max: int = 8,
    ngram_min: int = 1,
    layers: Sequence[int] | None = None,
    tokenizer: Any | None = None,
    heads: str | None = None,
    distilled: str | None = None,
    suffix_mib: float = SUFFIX_STORE_MIB,
    suffix_requests: int = SUFFIX_STORE_REQUESTS,
    tree_nodes: int = 0,
) -> DrafterFactory | None:
    """A maker of per-request drafters for `target` (a runner); None for 'none'.

    ngram: n-gram sizes tried, ngram_max down to ngram_min. layerskip: the blocks the draft runs
    (`layers`), else the calibrated default for this model, cached, or calibrated now with
    `tokenizer` (once per model; see drafters.layerskip). heads: the folder of trained heads
    (default: the weights shipped for the default target; refused if made for another target).
    distilled: the folder of a distilled draft (default: the one shipped for the default target;
    refused if made for another target). ngram+X: prompt lookup where it expects to pay, else
    drafter X (drafters.hybrid). suffix, ngram-tree: token trees from a suffix index
    (drafters.suffix) matching up to ngram_max tokens (at least ngram_min), of at most
    `tree_nodes` nodes (0: the drafter's default); suffix: the factory (a
    drafters.suffix.SuffixFactory) shares one store of earlier requests, capped at `suffix_mib`
    MiB and `suffix_requests` requests, among its drafters; set a drafter's `isolation_key`
    (None: the shared scope) before its request's first step to draft only from its key's text.
    """
    part = model_part(name)
    if part is not None and name in DRAFTERS:  # lookup first, then a model drafter
        from specdecode.drafters.hybrid import HybridFactory

        lookup = drafter_factory(lookup_part(name), target, ngram_max=ngram_max,
                                 ngram_min=ngram_min, suffix_mib=suffix_mib,
                                 suffix_requests=suffix_requests, tree_nodes=tree_nodes)
        model = drafter_factory(part, target, draft_model, capacity, layers=layers,
                                tokenizer=tokenizer, distilled=distilled)
        if lookup is None or model is None:
            raise SpecDecodeError(f"--drafter {name} needs a model drafter after the '+'")
        return HybridFactory(lookup, model, name)
    if name == "none":
        return None
    base = name.removesuffix(TREE_SUFFIX)
    if base != name and base in TREE_MODELS:  # the model drafter with sibling leaves: trees
        from specdecode.drafters.draft_model import with_siblings

        make = drafter_factory(base, target, draft_model, capacity, distilled=distilled)
        assert make is not None
        return lambda: with_siblings(make(), name)
    check_batch_invariant(getattr(target, "precision", "fp32"))
    check_measured_invariance(target)
    if name == "ngram":
        return _ngram(ngram_max, ngram_min)
    if name in ("suffix", "ngram-tree"):
        return _tree_lookup(name, ngram_max, ngram_min, tree_nodes, suffix_mib, suffix_requests)
    if name == "layerskip":
        return _layerskip(target, layers, tokenizer, capacity)
    if name == "heads":
        return _heads(target, heads, capacity)
    if name == "distilled":
        return _distilled(target, distilled, capacity)
    if name in ("int8", "w4a16"):
        return _quantized_copy(name, target, capacity)
    if name == "draft-model":
        return _draft_model(target, draft_model, capacity)
    if name == "xtok":
        if not draft_model:
            raise SpecDecodeError(
                "--drafter xtok needs --draft-model PATH (a draft with its own tokenizer)"
            )
        from specdecode.drafters.xtok import xtok_factory

        return xtok_factory(tokenizer, draft_model, capacity)
    raise SpecDecodeError(f"unknown drafter '{name}' (known: {', '.join(DRAFTERS)})")


def _ngram(ngram_max: int, ngram_min: int) -> DrafterFactory:
    from specdecode.drafters.ngram import NgramDrafter, RegimeStats

    NgramDrafter(ngram_max, ngram_min)  # check the sizes now, not at the first request
    stats = RegimeStats()  # acceptance by match length and sampling regime, learned across
    # this factory's requests
    return lambda: NgramDrafter(ngram_max, ngram_min, stats=stats)


def _tree_lookup(name: str, ngram_max: int, ngram_min: int, tree_nodes: int, suffix_mib: float,
                 suffix_requests: int) -> DrafterFactory:
    from specdecode.drafters.ngram import RegimeStats
    from specdecode.drafters.suffix import (
        MAX_DEPTH,
        NGRAM_TREE_NODES,
        SUFFIX_NODES,
        SuffixFactory,
        TreeLookupDrafter,
    )
    from specdecode.suffix import SuffixStore

    if name == "suffix":
        try:
            store = SuffixStore(suffix_mib, suffix_requests, ngram_max + MAX_DEPTH)
        except ValueError as e:
            raise SpecDecodeError(str(e)) from None
        return SuffixFactory(store, tree_nodes or SUFFIX_NODES, ngram_max, ngram_min)
    nodes = tree_nodes or NGRAM_TREE_NODES
    TreeLookupDrafter(name, nodes, max_match=ngram_max, min_match=ngram_min)  # check now
    stats = RegimeStats()  # learned across this factory's requests, as the n-gram drafter's
    return lambda: TreeLookupDrafter(name, nodes, max_match=ngram_max, min_match=ngram_min,
                                     stats=stats)


def _layerskip(target: Any, layers: Sequence[int] | None, tokenizer: Any | None,
               capacity: int) -> DrafterFactory:
    from specdecode.drafters.layerskip import (
        LayerSkipDrafter,
        cached_calibration,
        check_layers,
        default_budget,
    )

    require_native(target, "layerskip")
    kept = tuple(layers) if layers is not None else cached_calibration(
        target, tokenizer, default_budget(target)
    ).layers
    check_layers(target, kept)
    return lambda: LayerSkipDrafter(target, kept, capacity)


def _heads(target: Any, heads: str | None, capacity: int) -> DrafterFactory:
    from pathlib import Path

    from specdecode.drafters.heads import HeadsDrafter, default_heads_dir, load_heads

    require_native(target, "heads")
    model = load_heads(target, Path(heads).expanduser() if heads else default_heads_dir())
    return lambda: HeadsDrafter(model, capacity)


def _distilled(target: Any, distilled: str | None, capacity: int) -> DrafterFactory:
    from pathlib import Path

    from specdecode.drafters.distilled import DEFAULT_DIR, load_distilled
    from specdecode.drafters.draft_model import DraftModelDrafter

    folder = Path(distilled).expanduser() if distilled else DEFAULT_DIR
    if getattr(target, "backend", "") == "llama.cpp":  # exported to GGUF once, then cached
        from specdecode.drafters.distilled_gguf import llamacpp_distilled_factory

        return llamacpp_distilled_factory(target, folder, capacity)
    draft = load_distilled(folder, target)
    return lambda: DraftModelDrafter(draft, "distilled", capacity)


def _quantized_copy(name: str, target: Any, capacity: int) -> DrafterFactory:
    """A quantized copy of the target (int8, or w4a16: 4-bit blocks, bf16 ends; the target's
    norms shared, unchanged), drafting in the target's cache."""
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.models.precision import apply_precision, quantize_int8

    require_native(target, name)
    if name == "int8":
        weights = quantize_int8(copy.deepcopy(target))
    else:
        weights = apply_precision(target, "w4a16")
    return lambda: DraftModelDrafter(weights, name, capacity, in_cache=True)


def _draft_model(target: Any, draft_model: str | None, capacity: int) -> DrafterFactory:
    from specdecode.drafters.draft_model import DraftModelDrafter, check_vocab
    from specdecode.models.loading import load_model

    if not draft_model:
        raise SpecDecodeError("--drafter draft-model needs --draft-model PATH")
    on_llamacpp = getattr(target, "backend", "") == "llama.cpp"  # a GGUF draft there too
    if on_llamacpp and draft_model.endswith(".gguf"):
        from pathlib import Path

        from specdecode.drafters.distilled_gguf import load_gguf_draft, sidecar_path

        if sidecar_path(Path(draft_model).expanduser()).is_file():  # a subset-head export
            sub = load_gguf_draft(Path(draft_model).expanduser(), target)
            return lambda: DraftModelDrafter(sub, "draft-model", capacity)
    draft = load_model(draft_model, backend="llama.cpp" if on_llamacpp else "auto").model
    check_vocab(target, draft, draft_model)
    return lambda: DraftModelDrafter(draft, "draft-model", capacity)
