"""Token-tree drafts in the engine: checking them, cutting them, and laying them out for one
target forward (docs/design.md, "Trees"). Pure functions over `Draft`; verification is
verify.verify_tree*.

A tree draft of n nodes is scored after the step's unfed tokens (the pending token, then any
tokens a constraint forced): the forward feeds T = unfed + n tokens; unfed token t sits at
position L + t (L the row's cache length) and attends causally; node i sits at position
L + unfed - 1 + depth(i) and attends to the unfed tokens, its ancestors and itself. The logits
row of the pending token is the tree's root row and row unfed + i follows node i, as the
verifiers expect. After verification the accepted path's keys and values are compacted behind
the unfed tokens (models.cache.KVCache.keep): its nodes need not be contiguous.
"""

from __future__ import annotations

import torch

from specdecode.drafters.base import Draft, path_probabilities, path_sums
from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_TREE_NODES
from specdecode.verify import check_tree, tree_depths, tree_path


def check_tree_draft(draft: Draft, vocab_size: int, max_nodes: int, drafter: str) -> None:
    """Refuse a malformed tree from a drafter with one clear error, before anything is scored:
    parents not in topological order (a cycle, a parent after its child), a token outside the
    vocabulary, more nodes than the drafter declared (Drafter.max_nodes, at most
    MAX_TREE_NODES), or q / confidences not one per node."""
    assert draft.parents is not None
    n = int(draft.tokens.numel())
    cap = min(max_nodes, MAX_TREE_NODES)
    try:
        check_tree(draft.parents, draft.tokens, vocab_size)
        if n > cap:
            raise ValueError(f"{n} nodes exceed its max_nodes of {cap}")
        if draft.q is not None and tuple(draft.q.shape) != (n, vocab_size):
            raise ValueError(f"q must be ({n}, {vocab_size}), got {tuple(draft.q.shape)}")
        if draft.confidence is not None and len(draft.confidence) != n:
            raise ValueError(f"{len(draft.confidence)} confidences for {n} nodes")
    except ValueError as e:
        raise SpecDecodeError(f"the {drafter} drafter proposed a malformed token tree: {e}") \
            from None


def is_chain(parents: torch.Tensor) -> bool:
    """Whether the tree is one path in index order (parents -1, 0, 1, ...)."""
    n = int(parents.numel())
    return bool(torch.equal(parents.to(torch.long), torch.arange(-1, n - 1)))


def as_chain(draft: Draft) -> Draft:
    """A tree that is one path, as the chain it is (the engine's cheaper chain path)."""
    return Draft(draft.tokens, draft.q, draft.confidence)


def keep_nodes(draft: Draft, keep: list[int]) -> Draft:
    """The sub-tree of the nodes `keep` (ascending, closed under ancestors), renumbered."""
    assert draft.parents is not None
    new_index = {old: new for new, old in enumerate(keep)}
    parents = [draft.parents[i].item() for i in keep]
    renumbered = [-1 if p < 0 else new_index[int(p)] for p in parents]
    index = torch.tensor(keep, dtype=torch.long)
    out = Draft(draft.tokens[index], None if draft.q is None else draft.q[index],
                None if draft.confidence is None else tuple(draft.confidence[i] for i in keep),
                torch.tensor(renumbered, dtype=torch.long))
    return as_chain(out) if is_chain(out.parents) else out  # type: ignore[arg-type]


def cut_depth(draft: Draft, depth: int) -> Draft:
    """The tree without its nodes deeper than `depth` (the step's draft budget)."""
    assert draft.parents is not None
    depths = tree_depths(draft.parents).tolist()
    return keep_nodes(draft, [i for i, d in enumerate(depths) if d <= depth])


def keeping_order(draft: Draft) -> list[int]:
    """The nodes in the order a node budget keeps them: most likely accepted path first, ties by
    index. Every prefix of this order is closed under ancestors (a node's path probability is
    at most its parent's, and its parent comes first on a tie)."""
    probs = path_probabilities(draft)
    return sorted(range(len(probs)), key=lambda i: (-probs[i], i))


def chain_confidences(draft: Draft) -> tuple[float, ...]:
    """Confidences of the chain that best_width can weigh for this tree: keeping the first j
    nodes of `keeping_order` is expected to accept the sum of their path probabilities, which
    is what a chain whose cumulative products are those path probabilities, in that order,
    is expected to accept. (For a chain it gives the chain's own confidences.)"""
    probs = sorted(path_probabilities(draft), reverse=True)
    out: list[float] = []
    previous = 1.0
    for p in probs:
        out.append(p / previous if previous > 0 else 0.0)
        previous = p
    return tuple(out)


def keep_best(draft: Draft, nodes: int) -> Draft:
    """The `nodes` nodes most likely to be accepted (keeping_order), as a tree."""
    return keep_nodes(draft, sorted(keeping_order(draft)[:nodes]))


def best_path(draft: Draft) -> Draft:
    """The tree's most likely root-to-leaf path, as a chain: what a target that cannot score
    trees (or a request under a constraint) verifies instead."""
    assert draft.parents is not None
    expected = path_sums(draft)
    depths = tree_depths(draft.parents).tolist()
    if not expected:
        return as_chain(draft)
    # the path expected to get the most tokens accepted; the deepest, then the first, on ties
    leaf = max(range(len(expected)), key=lambda i: (expected[i], depths[i], -i))
    return keep_nodes(draft, tree_path(draft.parents, leaf))


def layout(parents: torch.Tensor, unfed: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position offsets (width,) int64 from the row's cache length, and the (width, width) bool
    attention block (True = may attend), of a row feeding `unfed` tokens then a tree with
    `parents`, padded causally to `width` columns. A chain row is parents None: use causal."""
    n = int(parents.numel())
    offsets = torch.arange(width, dtype=torch.long)
    block = torch.ones(width, width, dtype=torch.bool).tril()
    if n:
        depths = tree_depths(parents)
        offsets[unfed:unfed + n] = unfed - 1 + depths
        nodes = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(parents.tolist()):
            if parent >= 0:
                nodes[i] = nodes[parent]
            nodes[i, i] = True
        block[unfed:unfed + n, unfed:unfed + n] = nodes
    return offsets, block


def kept_slots(unfed: int, path: torch.Tensor) -> torch.Tensor:
    """The step's slots (from the row's length before it) that hold committed tokens after a
    tree step: the unfed tokens, then the accepted path's nodes."""
    return torch.cat([torch.arange(unfed), unfed + path.to(torch.long)])
