"""Drafters by name, as the CLI, the benchmark and the server ask for them.

`drafter_factory` reads a `DrafterOptions` (drafters.options: every front end builds one),
loads whatever weights the drafter needs once and returns a `DrafterFactory` that makes a fresh
per-request drafter sharing them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from specdecode.drafters.base import DrafterFactory, native
from specdecode.drafters.options import (
    AUTO,
    DRAFTERS,
    QUANTIZED_COPIES,
    DrafterOptions,
    lookup_part,
    model_part,
    parts,
    reads,
    tree_base,
)
from specdecode.errors import SpecDecodeError
from specdecode.limits import SUFFIX_ISOLATION, SUFFIX_STORE_MIB, SUFFIX_STORE_REQUESTS
from specdecode.models.exactness import require_speculation
from specdecode.models.llamacpp import llamacpp_target
from specdecode.models.target import Target
from specdecode.models.tokenizer import Tokenizer

__all__ = ["DRAFTERS", "DrafterFactory", "DrafterOptions", "drafter_factory"]

NGRAM_MAX = 8  # the longest n-gram a lookup matches by default (ngram_max)


def drafter_factory(options: DrafterOptions | str, target: Target, *, capacity: int = 4096,
                    tokenizer: Tokenizer | None = None) -> DrafterFactory | None:
    """A maker of per-request drafters for `target` (a runner) as `options` say (a bare name:
    that drafter with its defaults); None for "none". The options are checked first
    (DrafterOptions.check: an option the drafter does not read is an error naming it).

    `capacity` bounds a request's context for drafters with their own KV cache; `tokenizer` is
    the target's (xtok drafts through text; layerskip calibrates with it). ngram: n-gram sizes
    tried, ngram_max down to ngram_min. layerskip: the blocks the draft runs (`layers`), else the
    calibrated default for this model, cached, or calibrated now (once per model; see
    drafters.layerskip). heads, distilled: the folder of trained heads or of a distilled draft
    (default: the ones shipped for the default target; refused if made for another target).
    ngram+X: prompt lookup where it expects to pay, else drafter X (drafters.hybrid); X = auto:
    the model part measured at load to pay best here, or none (drafters.auto). suffix,
    ngram-tree: token trees from a suffix index (drafters.suffix) of at most `tree_nodes` nodes;
    suffix: the factory's drafters share one store of earlier requests (`DrafterFactory.store`,
    capped at suffix_mib MiB and suffix_requests requests) under `suffix_isolation`.
    """
    opts = DrafterOptions(options) if isinstance(options, str) else options
    opts.check()
    if opts.speculates:  # the one decision (models.exactness), at the widest call it scores
        require_speculation(target, widest_call(opts))
    return _factory(opts, target, capacity, tokenizer)


def _factory(opts: DrafterOptions, target: Target, capacity: int, tokenizer: Tokenizer | None
             ) -> DrafterFactory | None:
    name = opts.name
    part = model_part(name)
    if part is not None:  # lookup first, then a model drafter
        from specdecode.drafters.hybrid import HybridFactory

        lookup = _factory(_only(opts, lookup_part(name)), target, capacity, tokenizer)
        assert lookup is not None
        if part == AUTO:  # the model part chosen by measurement (drafters.auto)
            from specdecode.drafters.auto import auto_factory

            return auto_factory(lookup, target, tokenizer, capacity, name)
        model = _factory(_only(opts, part), target, capacity, tokenizer)
        assert lookup is not None and model is not None
        return HybridFactory(lookup, model, name)
    if name == "none":
        return None
    base = tree_base(name)
    if base is not None:  # the model drafter with sibling leaves: trees
        from specdecode.drafters.draft_model import with_siblings

        make = _factory(dataclasses.replace(opts, name=base), target, capacity, tokenizer)
        assert make is not None
        return DrafterFactory(lambda: with_siblings(make(), name))
    ngram_max = opts.ngram_max if opts.ngram_max is not None else NGRAM_MAX
    ngram_min = opts.ngram_min if opts.ngram_min is not None else 1
    if name == "ngram":
        return _ngram(ngram_max, ngram_min)
    if name in ("suffix", "ngram-tree"):
        return _tree_lookup(opts, ngram_max, ngram_min)
    if name == "layerskip":
        return _layerskip(target, opts.layers, tokenizer, capacity, opts.draft_vocab)
    if name == "heads":
        return _heads(target, opts.heads, capacity)
    if name == "distilled":
        return _distilled(target, opts.distilled, capacity)
    if name in QUANTIZED_COPIES:  # drafters named like precisions (drafters.options)
        return _quantized_copy(name, target, capacity, opts.draft_vocab)
    assert opts.draft_model is not None  # DrafterOptions.check: both need one
    if name == "draft-model":
        return _draft_model(target, opts.draft_model, capacity, tokenizer, opts.draft_vocab)
    from specdecode.drafters.xtok import xtok_factory

    return DrafterFactory(xtok_factory(tokenizer, opts.draft_model, capacity))


def widest_call(opts: DrafterOptions) -> int:
    """The most positions a step of this drafter scores in one call: the pending token and a
    chain of draft_length; a model tree adds a sibling per draft token; a lookup tree scores
    its node budget (the invariance check measures up to this width)."""
    from specdecode.drafters.suffix import NGRAM_TREE_NODES, SUFFIX_NODES

    chain = opts.draft_length + 1
    widths = [2 * opts.draft_length + 1 if tree_base(opts.name) else chain]
    for part in parts(opts.name):
        if part in ("suffix", "ngram-tree"):
            nodes = opts.tree_nodes or (SUFFIX_NODES if part == "suffix" else NGRAM_TREE_NODES)
            widths.append(nodes + 1)
    return max(widths)


def _only(opts: DrafterOptions, name: str) -> DrafterOptions:
    """The options of one part of a hybrid: `name`, with only the options it reads."""
    used = reads(name)
    unused: dict[str, Any] = {option: None for option in opts.given() if option not in used}
    return dataclasses.replace(opts, name=name, **unused)


def _ngram(ngram_max: int, ngram_min: int) -> DrafterFactory:
    from specdecode.drafters.ngram import NgramDrafter, RegimeStats

    NgramDrafter(ngram_max, ngram_min)  # check the sizes now, not at the first request
    stats = RegimeStats()  # acceptance by match length and sampling regime, learned across
    # this factory's requests
    return DrafterFactory(lambda: NgramDrafter(ngram_max, ngram_min, stats=stats))


def _tree_lookup(opts: DrafterOptions, ngram_max: int, ngram_min: int) -> DrafterFactory:
    from specdecode.drafters.ngram import RegimeStats
    from specdecode.drafters.suffix import (
        MAX_DEPTH,
        NGRAM_TREE_NODES,
        SUFFIX_NODES,
        SuffixFactory,
        TreeLookupDrafter,
    )
    from specdecode.suffix import SuffixStore

    if opts.name == "suffix":
        mib = opts.suffix_mib if opts.suffix_mib is not None else SUFFIX_STORE_MIB
        requests = opts.suffix_requests if opts.suffix_requests is not None else \
            SUFFIX_STORE_REQUESTS
        try:
            store = SuffixStore(mib, requests, ngram_max + MAX_DEPTH)
        except ValueError as e:
            raise SpecDecodeError(str(e)) from None
        return SuffixFactory(store, opts.tree_nodes or SUFFIX_NODES, ngram_max, ngram_min,
                             isolation=opts.suffix_isolation or SUFFIX_ISOLATION[0])
    nodes = opts.tree_nodes or NGRAM_TREE_NODES
    name = opts.name
    TreeLookupDrafter(name, nodes, max_match=ngram_max, min_match=ngram_min)  # check now
    stats = RegimeStats()  # learned across this factory's requests, as the n-gram drafter's
    return DrafterFactory(lambda: TreeLookupDrafter(name, nodes, max_match=ngram_max,
                                                    min_match=ngram_min, stats=stats))


def _layerskip(target: Target, layers: Sequence[int] | None, tokenizer: Tokenizer | None,
               capacity: int, draft_vocab: int | None = None) -> DrafterFactory:
    from specdecode.drafters.draft_head import draft_head
    from specdecode.drafters.layerskip import (
        LayerSkipDrafter,
        cached_calibration,
        check_layers,
        default_budget,
    )

    model = native(target, "layerskip")
    kept = tuple(layers) if layers is not None else cached_calibration(
        model, tokenizer, default_budget(model)
    ).layers
    check_layers(model, kept)
    head = None if draft_vocab is None else draft_head(model, draft_vocab)  # shared
    return DrafterFactory(lambda: LayerSkipDrafter(model, kept, capacity, head))


def _heads(target: Target, heads: str | None, capacity: int) -> DrafterFactory:
    from pathlib import Path

    from specdecode.drafters.heads import HeadsDrafter, default_heads_dir, load_heads

    folder = Path(heads).expanduser() if heads else default_heads_dir()
    model = load_heads(native(target, "heads"), folder)
    return DrafterFactory(lambda: HeadsDrafter(model, capacity))


def _distilled(target: Target, distilled: str | None, capacity: int) -> DrafterFactory:
    from pathlib import Path

    from specdecode.drafters.distilled import DEFAULT_DIR, load_distilled
    from specdecode.drafters.draft_model import DraftModelDrafter

    folder = Path(distilled).expanduser() if distilled else DEFAULT_DIR
    gguf_target = llamacpp_target(target)
    if gguf_target is not None:  # exported to GGUF once, then cached
        from specdecode.drafters.distilled_gguf import llamacpp_distilled_factory

        return DrafterFactory(llamacpp_distilled_factory(gguf_target, folder, capacity))
    draft = load_distilled(folder, target)
    return DrafterFactory(lambda: DraftModelDrafter(draft, "distilled", capacity))


def _quantized_copy(name: str, target: Target, capacity: int, draft_vocab: int | None = None
                    ) -> DrafterFactory:
    """A quantized copy of the target (drafters.draft_model.quantized_copy), drafting in the
    target's cache; with `draft_vocab`, through the lowest draft_vocab ids of its head
    (drafters.draft_head)."""
    from specdecode.drafters.draft_head import with_draft_head
    from specdecode.drafters.draft_model import DraftModelDrafter, quantized_copy

    model = with_draft_head(quantized_copy(name, native(target, name)), draft_vocab)
    return DrafterFactory(lambda: DraftModelDrafter(model, name, capacity, in_cache=True))


def _draft_model(target: Target, draft_model: str, capacity: int,
                 tokenizer: Tokenizer | None, draft_vocab: int | None = None) -> DrafterFactory:
    """A separate draft model; with `draft_vocab`, drafting through the lowest draft_vocab ids of
    its head (drafters.draft_head: only where the draft runs on the native runner)."""
    from specdecode.drafters.draft_head import with_draft_head
    from specdecode.drafters.draft_model import DraftModelDrafter, check_tokenizer, check_vocab
    from specdecode.models.backends import load_model

    gguf_target = llamacpp_target(target)  # on llama.cpp, a GGUF draft runs there too
    if gguf_target is not None and draft_model.endswith(".gguf"):
        from pathlib import Path

        from specdecode.drafters.distilled_gguf import load_gguf_draft, sidecar_path

        if sidecar_path(Path(draft_model).expanduser()).is_file():  # a subset-head export
            if draft_vocab is not None:
                raise SpecDecodeError(f"draft_vocab does not apply to {draft_model}: it is a "
                                      "subset-head export, whose vocabulary is fixed")
            sub = load_gguf_draft(Path(draft_model).expanduser(), gguf_target)
            return DrafterFactory(lambda: DraftModelDrafter(sub, "draft-model", capacity))
    # the draft on the target's own backend (llama.cpp), else where its family runs ("auto" of
    # a draft: the cheapest step, models.precision.draft_default); its exactness does not
    # matter (the target verifies every token), so it is not checked at load
    loaded = load_model(draft_model, precision="auto",
                        backend=target.backend if gguf_target else "auto", as_draft=True)
    check_vocab(target, loaded.model, draft_model)
    if tokenizer is not None:  # same size is not the same tokens
        check_tokenizer(tokenizer, loaded.tokenizer, draft_model)
    draft = loaded.model
    if draft_vocab is not None:  # the native runner's head panels (drafters.draft_head)
        draft = with_draft_head(native(draft, "draft-model drafter with draft_vocab"), draft_vocab)
    return DrafterFactory(lambda: DraftModelDrafter(draft, "draft-model", capacity))
