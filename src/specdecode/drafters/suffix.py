"""Token-tree lookup drafters over a suffix index (specdecode.suffix): `ngram-tree` (the
request's own context) and `suffix` (its own context and a store of earlier requests).

Both match the longest suffix of the context (up to `max_match` tokens, at least `min_match`)
and propose the tree of continuations that followed its occurrences, each distinct next token a
branch, grown best-first by path probability up to the step's node budget
(DraftRequest.nodes, at most `max_nodes`) and depth k. With no node budget (a chain asked for)
they propose the most probable path. Drafts are deterministic (q=None: verified one-hot,
lossless whatever they propose); siblings carry distinct tokens.

**Confidences.** A branch's frequency among its siblings says which continuation is likelier,
not how often the lookup is right at all: after a 1-token match a continuation seen once has
frequency 1 but is accepted about a fifth of the time (drafters.ngram's measurements). So node
i's confidence is rate(m + d_i - 1) x frequency_i, where rate is the n-gram drafter's acceptance
rate by match length (drafters.ngram.MatchStats, per sampling regime), m the match length and d_i
the node's depth: the siblings' confidences sum to the rate, the probability that some branch is
right. The rates are learned as the n-gram drafter learns them, from the drafter's own
proposals against the committed text, counting a level as right when the committed token is
any of its branches (which is what the siblings' sum estimates).

**The store** (`suffix`): on `reset` (the request's end) the drafter adds its prompt + output
to the shared SuffixStore under its `isolation_key`, and it drafts only from documents of that
key. Isolation does not change the output (drafts never do), but it changes timing: a request
whose text another user sent earlier is answered faster, which tells that user's text apart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specdecode.drafters.base import EMPTY, Draft, Drafter, DrafterFactory, DraftRequest
from specdecode.drafters.ngram import MatchStats, RegimeStats
from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_TREE_NODES
from specdecode.suffix import NONE, CandidateTree, Match, SuffixStore, SuffixTrie, candidate_tree
from specdecode.verify import tree_depths

MAX_MATCH = 8  # the longest suffix matched (as the n-gram drafter's max_n)
MAX_DEPTH = 8  # the deepest continuation indexed beyond a full-length match
# Node budgets: ngram-tree's tokens per target step stop growing near 16 nodes on SmolLM2
# (docs/measurements/code-figures.md). The store adds other requests' continuations as
# branches, so suffix gets more room. (Under --k auto the
# engine keeps only the nodes that pay, so a budget is a cap, not a cost.)
NGRAM_TREE_NODES = 16
SUFFIX_NODES = 24


class TreeLookupDrafter(Drafter):
    """Candidate trees from the request's own context (`ngram-tree`); one per request."""

    fits_width = True  # proposing costs ~nothing and drafts carry confidences

    def __init__(self, name: str = "ngram-tree", max_nodes: int = NGRAM_TREE_NODES, *,
                 max_match: int = MAX_MATCH, min_match: int = 1, max_depth: int = MAX_DEPTH,
                 stats: RegimeStats | None = None, min_probability: float = 0.0) -> None:
        if not 1 <= min_match <= max_match:
            raise SpecDecodeError(f"match lengths need 1 <= min_match <= max_match, got "
                                  f"min_match={min_match}, max_match={max_match}")
        if not 1 <= max_nodes <= MAX_TREE_NODES or max_depth < 1:
            raise SpecDecodeError(f"a tree drafter needs 1..{MAX_TREE_NODES} nodes and depth "
                                  f">= 1, got {max_nodes} nodes, depth {max_depth}")
        self.name, self.max_nodes = name, max_nodes
        self.max_match, self.min_match, self.max_depth = max_match, min_match, max_depth
        self.min_probability = min_probability
        # acceptance by match length and sampling regime, shared by a factory's drafters
        self.stats = stats if stats is not None else RegimeStats()
        self._forget()

    def _forget(self) -> None:
        """A fresh index of the request's own context."""
        self.trie = SuffixTrie(self.max_match + self.max_depth)
        self.root = self.trie.new_root()
        self.tokens: list[int] = []  # the context indexed so far
        self.committed: list[int] = []  # tokens committed since the last propose
        self._open: list[int] = []  # the context's open suffixes (SuffixTrie.extend)
        # the last proposal, scored at the next propose: (context length, match length, tree,
        # the rates it is scored into)
        self._last: tuple[int, int, CandidateTree, MatchStats] | None = None

    def reset(self) -> None:
        self._forget()

    def observe_result(self, draft: Draft, num_accepted: int, committed: list[int]) -> None:
        self.committed.extend(committed)  # the request's text after the last propose

    def propose(self, request: DraftRequest) -> Draft:
        """The tree of continuations after the longest suffix match; empty when nothing
        matches (or k is 0). The last proposal is scored first, against the text committed
        since, as the n-gram drafter scores its own."""
        context = request.context.tolist()
        self._sync(context)
        self._score_last(context)
        if request.k <= 0:
            return Draft(EMPTY, None)
        own = self.trie.longest_match(self.root, context, self.max_match)
        tree, length = self._tree(request, context, Match(self.trie, self.root, *own))
        if not tree.tokens:
            return Draft(EMPTY, None)
        stats = self.stats.for_params(request.params)
        self._last = (len(context), length, tree, stats)
        return _draft(tree, length, stats, chain=request.nodes <= 0)

    def _tree(self, request: DraftRequest, context: list[int], own: Match
              ) -> tuple[CandidateTree, int]:
        """The candidate tree and the match length its confidences are rated at."""
        return self._grow(request, context, [own])

    def _grow(self, request: DraftRequest, context: list[int], matches: Sequence[Match]
              ) -> tuple[CandidateTree, int]:
        """The tree over the matches at least min_match long (the longest's length)."""
        usable = [m for m in matches if m.node != NONE and m.length >= self.min_match]
        if not usable:
            return CandidateTree([], [], []), 0
        chain = request.nodes <= 0
        nodes = request.k if chain else min(request.nodes, self.max_nodes)
        tree = candidate_tree(usable, context, nodes, request.k, 1 if chain else 0,
                              self.min_probability, self.max_match)
        return tree, max(m.length for m in usable)

    def _sync(self, context: list[int]) -> None:
        """Index the tokens new since the last call; a context that does not extend the last
        one starts a new request (as `reset`). The prompt's indexing is catch-up time."""
        known = len(self.tokens)
        if len(context) < known or context[:known] != self.tokens:
            self.reset()
            known = 0
        start = time.perf_counter_ns()
        new = context[known:]
        self._open = self.trie.extend(self.root, new, self._open)
        self.tokens.extend(new)
        self.committed = []
        self.catch_up_ns = time.perf_counter_ns() - start if known == 0 else 0

    def _score_last(self, context: list[int]) -> None:
        """Score the last proposal against the tokens committed after it (MatchStats.record on
        the path the committed text takes through the tree, plus one missed level)."""
        if self._last is not None and len(context) > self._last[0]:
            at, length, tree, stats = self._last
            stats.record(length, followed(tree, context[at:]), context[at:])
        self._last = None


class SuffixDrafter(TreeLookupDrafter):
    """`suffix`: candidate trees from the request's own context and from the shared store's
    documents of its `isolation_key` (None: the shared scope), merged; the request is added to
    the store when it ends. Set `isolation_key` before the request's first step."""

    def __init__(self, store: SuffixStore, name: str = "suffix", max_nodes: int = SUFFIX_NODES,
                 *, isolation_key: str | None = None, max_match: int = MAX_MATCH,
                 min_match: int = 1, stats: RegimeStats | None = None,
                 min_probability: float = 0.0) -> None:
        if store.depth < max_match + 1:
            raise SpecDecodeError(f"the suffix store's depth {store.depth} leaves no room after "
                                  f"a match of {max_match}")
        super().__init__(name, max_nodes, max_match=max_match, min_match=min_match,
                         max_depth=store.depth - max_match, stats=stats,
                         min_probability=min_probability)
        self.store = store
        self.isolation_key = isolation_key

    def reset(self) -> None:
        """Add the finished request (prompt + output) to the store, then forget it."""
        document = self.tokens + self.committed
        if document:
            self.store.add(document, self.isolation_key)
        self._forget()

    def discard(self) -> None:
        """Forget the request without storing it (a caller ending it unfinished: cancelled,
        failed), so that its `reset` adds nothing: the store then holds only text that was
        generated to its end, never the partial or inconsistent text of a failed step."""
        self._forget()

    def _tree(self, request: DraftRequest, context: list[int], own: Match
              ) -> tuple[CandidateTree, int]:
        """Own context first, then the store; the store is read under its lock."""
        with self.store.view(self.isolation_key) as view:
            if view is None:
                return self._grow(request, context, [own])
            trie, root = view
            shared = Match(trie, root, *trie.longest_match(root, context, self.max_match))
            return self._grow(request, context, [own, shared])


def followed(tree: CandidateTree, committed: Sequence[int]) -> list[int]:
    """The tree as the chain MatchStats.record scores: the committed tokens as far as the
    tree's branches contain them, then (if the tree goes on there) one of the branches that
    missed; so a level counts as proposed where the tree had branches and as right where one
    of them was committed."""
    chain: list[int] = []
    parent = -1
    for real in committed:
        branches = [i for i, p in enumerate(tree.parents) if p == parent]
        if not branches:
            break
        hit = [i for i in branches if tree.tokens[i] == real]
        if not hit:
            chain.append(tree.tokens[branches[0]])  # a miss: the level was proposed, wrong
            break
        chain.append(real)
        parent = hit[0]
    return chain


def _draft(tree: CandidateTree, length: int, stats: MatchStats, chain: bool) -> Draft:
    """The Draft of a candidate tree: confidences rated by match length and depth."""
    depths = tree_depths(torch.tensor(tree.parents, dtype=torch.long)).tolist()
    confidence = tuple(stats.rate(length + d - 1) * c
                       for d, c in zip(depths, tree.confidence, strict=True))
    tokens = torch.tensor(tree.tokens, dtype=torch.long)
    parents = None if chain else torch.tensor(tree.parents, dtype=torch.long)
    return Draft(tokens, None, confidence, parents)


class SuffixFactory(DrafterFactory):
    """Makes `suffix` drafters that share one SuffixStore (one per factory: per server, per
    bench run) and one set of acceptance rates. A caller isolating users sets each drafter's
    `isolation_key` after making it (or this factory's `isolation_key`, the default of the
    drafters it makes afterwards); `isolation` says whether a server does ("user") or not
    ("shared"); `store` is there for memory reports (`store.nbytes()`)."""

    def __init__(self, store: SuffixStore, max_nodes: int = SUFFIX_NODES,
                 max_match: int = MAX_MATCH, min_match: int = 1, isolation: str = "user"
                 ) -> None:
        self.store: SuffixStore = store
        self.isolation = isolation
        self.max_nodes, self.max_match, self.min_match = max_nodes, max_match, min_match
        self.stats = RegimeStats()
        self.isolation_key: str | None = None
        self().reset()  # check the options now, not at the first request (stores nothing)

    def __call__(self) -> SuffixDrafter:
        return SuffixDrafter(self.store, max_nodes=self.max_nodes,
                             isolation_key=self.isolation_key, max_match=self.max_match,
                             min_match=self.min_match, stats=self.stats)
