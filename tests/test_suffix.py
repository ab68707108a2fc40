"""The suffix index (specdecode.suffix) and the tree lookup drafters (drafters.suffix, issue 24):
the trie against brute-force search on random token sequences, candidate trees (well formed,
best-first, frequencies right), the store's caps, isolation, size and lock, and the drafters.

Each property is checked by a `check_*` function that is also run against a deliberately
broken variant and must fail there: a check that cannot fail proves nothing.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import tracemalloc
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.control import Controller
from specdecode.drafters.base import Draft, Drafter, DraftRequest
from specdecode.drafters.ngram import GREEDY_PRIOR, RegimeStats
from specdecode.drafters.registry import DRAFTERS, DrafterOptions, drafter_factory
from specdecode.drafters.suffix import (
    SuffixDrafter,
    SuffixFactory,
    TreeLookupDrafter,
    followed,
)
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models.cache import KVCache
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from specdecode.sampling import SamplingParams
from specdecode.suffix import (
    NONE,
    CandidateTree,
    Match,
    SuffixStore,
    SuffixTrie,
    _Document,
    candidate_tree,
)
from specdecode.verify import check_tree, tree_depths
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint
from tests.fakes import LookupTarget
from tests.identity import assert_identical
from tests.test_engine_sampled import (
    FALSE_ALARM,
    PARAMS,
    PROMPT,
    SAMPLES,
    exact_pairs,
    gof_p_value,
    models,  # noqa: F401  (fixture)
    observed_pairs,
)
from tests.test_engine_trees import _no_compaction as no_compaction

# ---------------------------------------------------------------------------------------------
# Brute force
# ---------------------------------------------------------------------------------------------


def occurrences(docs: Sequence[Sequence[int]], s: Sequence[int]) -> int:
    """How many times `s` occurs in the documents (overlaps counted)."""
    n = len(s)
    return sum(list(d[i : i + n]) == list(s) for d in docs for i in range(len(d) - n + 1))


def followers(docs: Sequence[Sequence[int]], s: Sequence[int]) -> Counter[int]:
    """The tokens that follow the occurrences of `s`, counted."""
    n = len(s)
    return Counter(d[i + n] for d in docs for i in range(len(d) - n)
                   if list(d[i : i + n]) == list(s))


def longest_match(docs: Sequence[Sequence[int]], context: Sequence[int], max_len: int) -> int:
    """The longest m <= max_len whose suffix of `context` occurs followed by a token; -1 if
    none does, not even the empty suffix."""
    for m in range(min(max_len, len(context)), -1, -1):
        if followers(docs, context[len(context) - m :]):
            return m
    return -1


def dump(trie: SuffixTrie, root: int) -> dict[tuple[int, ...], int]:
    """Every path below `root` with its count (the trie's whole content)."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[int, tuple[int, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        for child in trie.children(node):
            key = (*path, trie.token[child])
            assert key not in out, f"two children with one token under {path}"
            out[key] = trie.count[child]
            stack.append((child, key))
    return out


def brute_dump(docs: Sequence[Sequence[int]], depth: int) -> dict[tuple[int, ...], int]:
    """What `dump` must give: every substring of at most `depth` tokens, counted."""
    out: Counter[tuple[int, ...]] = Counter()
    for d in docs:
        for i in range(len(d)):
            for n in range(1, min(depth, len(d) - i) + 1):
                out[tuple(d[i : i + n])] += 1
    return dict(out)


def random_docs(rng: random.Random, vocab: int, count: int, longest: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(longest + 1))]
            for _ in range(count)]


def add_in_chunks(trie: SuffixTrie, root: int, doc: list[int], rng: random.Random) -> None:
    """Append `doc` as a growing request context does: a few tokens at a time."""
    open_nodes: list[int] = []
    i = 0
    while i < len(doc):
        step = rng.randrange(1, 5)
        open_nodes = trie.extend(root, doc[i : i + step], open_nodes)
        i += step


# ---------------------------------------------------------------------------------------------
# The trie against brute force
# ---------------------------------------------------------------------------------------------


class ShallowTrie(SuffixTrie):
    """BROKEN: closes a growing document's suffixes one token early."""

    def extend(self, root: int, tokens: Sequence[int], open_nodes: list[int]) -> list[int]:
        out = super().extend(root, tokens, open_nodes)
        return out[1:] if len(out) == self.depth - 1 else out


class LeakyTrie(SuffixTrie):
    """BROKEN: removal decrements counts but never unlinks a node that reaches zero."""

    def _unlink(self, parent: int, child: int) -> None:
        return


def check_index(make: Callable[[int], SuffixTrie], seed: int, trials: int = 40) -> None:
    """Counts, children and longest matches against brute force, documents added whole or a
    few tokens at a time, several per root."""
    rng = random.Random(seed)
    for _ in range(trials):
        depth = rng.randrange(2, 7)
        trie = make(depth)
        root = trie.new_root()
        docs = random_docs(rng, rng.randrange(2, 6), rng.randrange(1, 5), 30)
        for doc in docs:
            if rng.random() < 0.5:
                trie.extend(root, doc, [])
            else:
                add_in_chunks(trie, root, doc, rng)
        assert dump(trie, root) == brute_dump(docs, depth)
        assert trie.count[root] == sum(len(d) for d in docs)
        for _ in range(10):
            context = [rng.randrange(6) for _ in range(rng.randrange(12))]
            max_len = rng.randrange(10)
            node, m = trie.longest_match(root, context, max_len)
            expected = longest_match(docs, context, min(max_len, depth - 1))
            assert m == max(expected, 0) and (node == NONE) == (expected < 0)
            if node != NONE:
                got = Counter({trie.token[c]: trie.count[c] for c in trie.children(node)})
                assert got == followers(docs, context[len(context) - m :])


def check_removal(make: Callable[[int], SuffixTrie], seed: int, trials: int = 30) -> None:
    """Removing documents leaves exactly the trie of the others, and frees every node."""
    rng = random.Random(seed)
    for _ in range(trials):
        depth = rng.randrange(2, 7)
        trie = make(depth)
        roots = [trie.new_root(), trie.new_root()]
        docs = random_docs(rng, rng.randrange(2, 12), 6, 40)
        owner = [rng.randrange(2) for _ in docs]
        for doc, r in zip(docs, owner, strict=True):
            trie.extend(roots[r], doc, [])
        gone = set(rng.sample(range(len(docs)), rng.randrange(len(docs) + 1)))
        for i in sorted(gone):
            trie.remove(roots[owner[i]], docs[i])
        for r in range(2):
            kept = [d for i, d in enumerate(docs) if owner[i] == r and i not in gone]
            assert dump(trie, roots[r]) == brute_dump(kept, depth)
        for i in sorted(set(range(len(docs))) - gone):
            trie.remove(roots[owner[i]], docs[i])
        assert trie.live == 2 and not trie.edges and not trie.wide


def test_the_trie_counts_and_matches_as_brute_force_does() -> None:
    check_index(SuffixTrie, seed=1)
    with pytest.raises(AssertionError):
        check_index(ShallowTrie, seed=1)


def test_removal_restores_the_trie_of_the_other_documents() -> None:
    check_removal(SuffixTrie, seed=2)
    with pytest.raises(AssertionError):
        check_removal(LeakyTrie, seed=2)


def test_wide_parents_are_indexed_and_unindexed() -> None:
    """A parent with many children looks them up in the hash index, and stops using it when
    removal leaves few; lookups agree either way."""
    trie = SuffixTrie(3)
    root = trie.new_root()
    docs = [[0, t, t + 1] for t in range(1, 40)]
    for d in docs:
        trie.extend(root, d, [])
    zero = trie.find(root, 0)
    assert zero in trie.wide and trie.wide[zero] == 39
    assert all(trie.find(zero, t) != NONE for t in range(1, 40)) and trie.find(zero, 99) == NONE
    for d in docs[:36]:
        trie.remove(root, d)
    assert zero not in trie.wide and dump(trie, root) == brute_dump(docs[36:], 3)


def test_bad_depth_is_refused() -> None:
    with pytest.raises(ValueError, match="depth"):
        SuffixTrie(1)


# ---------------------------------------------------------------------------------------------
# Candidate trees
# ---------------------------------------------------------------------------------------------


TreeBuilder = Callable[[Sequence[Match], Sequence[int], int, int], CandidateTree]
MAX_MATCH = 4  # the longest match (and re-match) in the tree tests


def build(matches: Sequence[Match], context: Sequence[int], nodes: int, depth: int
          ) -> CandidateTree:
    return candidate_tree(matches, context, nodes, depth, max_match=MAX_MATCH)


def flat_tree(matches: Sequence[Match], context: Sequence[int], nodes: int, depth: int
              ) -> CandidateTree:
    """BROKEN: every occurrence's continuation a branch of its own (siblings not merged)."""
    tree = build(matches, context, nodes, depth)
    for i, parent in enumerate(list(tree.parents)):
        if parent == -1 and len(tree.tokens) < nodes:
            tree.parents.append(-1)
            tree.tokens.append(tree.tokens[i])
            tree.confidence.append(tree.confidence[i])
            break
    return tree


def breadth_first_tree(matches: Sequence[Match], context: Sequence[int], nodes: int, depth: int
                       ) -> CandidateTree:
    """BROKEN: grown level by level (every child of a level before the next), not by path
    probability."""
    full = build(matches, context, 10_000, depth)
    depths = tree_depths(torch.tensor(full.parents, dtype=torch.long)).tolist()
    keep = sorted(sorted(range(len(full.tokens)), key=lambda i: (depths[i], i))[:nodes])
    index = {old: new for new, old in enumerate(keep)}
    return CandidateTree([-1 if full.parents[i] < 0 else index[full.parents[i]] for i in keep],
                         [full.tokens[i] for i in keep], [full.confidence[i] for i in keep])


def deep_tree(matches: Sequence[Match], context: Sequence[int], nodes: int, depth: int
              ) -> CandidateTree:
    """BROKEN: ignores the depth limit."""
    return build(matches, context, nodes, depth + 2)


def no_rematch_tree(matches: Sequence[Match], context: Sequence[int], nodes: int, depth: int
                    ) -> CandidateTree:
    """BROKEN: a source whose occurrences run out stops there (no re-match)."""
    trie = matches[0].trie
    trie.longest_match = lambda *args: (NONE, 0)  # type: ignore[method-assign]
    try:
        return build(matches, context, nodes, depth)
    finally:
        del trie.longest_match


def path_probability(tree: CandidateTree, i: int) -> float:
    p = 1.0
    while i >= 0:
        p *= tree.confidence[i]
        i = tree.parents[i]
    return p


def expected_after(docs: Sequence[Sequence[int]], depth: int, context: list[int],
                   state: list[int], prefix: list[int]) -> tuple[list[int], Counter[int]]:
    """Brute force of one source at a tree node: (the string it continues from, the tokens
    that follow it): `state` (the match, then the path) while that continues within the trie's
    depth, else the longest suffix of context + prefix that does (at most MAX_MATCH)."""
    if len(state) < depth and followers(docs, state):
        return state, followers(docs, state)
    full = context + prefix
    m = longest_match(docs, full, min(MAX_MATCH, depth - 1))
    if m <= 0:
        return [], Counter()
    return full[len(full) - m :], followers(docs, full[len(full) - m :])


def check_trees(grow: TreeBuilder, seed: int, trials: int = 80) -> tuple[int, int]:
    """Trees from one source on random documents: well formed (verify.check_tree), distinct
    sibling tokens, depth <= k, nodes <= budget, each confidence the brute-force frequency of
    its token after its parent's path (re-matched where the occurrences ran out), and
    best-first: no continuation left out is more probable than a node kept. Returns how many
    trees branched and how many re-matched."""
    rng = random.Random(seed)
    branched = rematched = 0
    for _ in range(trials):
        depth = rng.randrange(3, 9)
        trie = SuffixTrie(depth)
        root = trie.new_root()
        docs = random_docs(rng, rng.randrange(2, 5), rng.randrange(1, 4), 40)
        for doc in docs:
            trie.extend(root, doc, [])
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
        node, m = trie.longest_match(root, context, MAX_MATCH)
        if m == 0:
            continue
        nodes, k = rng.randrange(1, 20), rng.randrange(1, 7)
        tree = grow([Match(trie, root, node, m)], context, nodes, k)
        parents = torch.tensor(tree.parents, dtype=torch.long)
        check_tree(parents, torch.tensor(tree.tokens, dtype=torch.long))
        assert 0 < len(tree.tokens) <= nodes
        assert int(tree_depths(parents).max()) <= k
        siblings = Counter(zip(tree.parents, tree.tokens, strict=True))
        assert max(siblings.values()) == 1, "siblings with one token"
        branched += len(set(tree.parents)) < len(tree.parents)
        matched = context[len(context) - m :]
        paths: list[list[int]] = []
        states: list[list[int]] = []
        for i, parent in enumerate(tree.parents):
            prefix, state = ([], matched) if parent < 0 else (paths[parent], states[parent])
            used, after = expected_after(docs, depth, context, state, prefix)
            rematched += used != state
            paths.append([*prefix, tree.tokens[i]])
            states.append([*used, tree.tokens[i]])
            assert 0.0 <= tree.confidence[i] <= 1.0
            assert tree.confidence[i] == pytest.approx(after[tree.tokens[i]] / sum(after.values()))
        kept = min(path_probability(tree, i) for i in range(len(tree.tokens)))
        for parent in [-1, *range(len(tree.tokens))]:
            prefix, state = ([], matched) if parent < 0 else (paths[parent], states[parent])
            if len(prefix) >= k:
                continue
            _, after = expected_after(docs, depth, context, state, prefix)
            base = 1.0 if parent < 0 else path_probability(tree, parent)
            for token, n in after.items():
                if [*prefix, token] not in paths:
                    assert base * n / sum(after.values()) <= kept + 1e-12, "not best-first"
    return branched, rematched


def test_candidate_trees_are_well_formed_best_first_and_weighted_by_frequency() -> None:
    branched, rematched = check_trees(build, seed=3)
    assert branched > 10 and rematched > 10  # both were really checked
    for broken in (flat_tree, breadth_first_tree, deep_tree, no_rematch_tree):
        with pytest.raises(AssertionError):
            check_trees(broken, seed=3)


def test_width_one_gives_the_most_probable_chain() -> None:
    trie = SuffixTrie(6)
    root = trie.new_root()
    for doc in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [1, 7]):
        trie.extend(root, doc, [])
    node, m = trie.longest_match(root, [9, 1], 5)
    match = [Match(trie, root, node, m)]
    tree = candidate_tree(match, [9, 1], 8, 3, width=1)
    assert tree.parents == [-1, 0, 1] and tree.tokens == [2, 3, 4]
    assert tree.confidence == pytest.approx([0.75, 2 / 3, 1.0])
    full = candidate_tree(match, [9, 1], 8, 3)
    assert sorted(full.tokens) == [2, 3, 4, 5, 6, 7]
    low = candidate_tree(match, [9, 1], 8, 3, min_probability=0.3)
    assert sorted(low.tokens) == [2, 3, 4]  # 7 and 2 -> 5 (path probability 0.25) are not


def test_sources_are_mixed_by_match_length_own_context_first_on_ties() -> None:
    """Two sources: a path's probability is the match-length-weighted mixture of theirs; where
    one source has nothing further, its share is lost; on a tie the first source's branch comes
    first."""
    own, shared = SuffixTrie(6), SuffixTrie(6)
    a, b = own.new_root(), shared.new_root()
    own.extend(a, [3, 5, 1, 2, 3, 5, 1], [])  # own: after (5, 1), and (3, 5, 1), comes 2
    shared.extend(b, [5, 1, 4, 4, 8], [])  # shared: after (5, 1) comes 4
    first = Match(own, a, *own.longest_match(a, [5, 1], 4))
    second = Match(shared, b, *shared.longest_match(b, [5, 1], 4))
    assert first.length == second.length == 2
    tree = candidate_tree([first, second], [5, 1], 8, 2)
    assert tree.tokens[:2] == [2, 4] and tree.parents[:2] == [-1, -1]
    assert tree.confidence[:2] == pytest.approx([0.5, 0.5])
    swapped = candidate_tree([second, first], [5, 1], 8, 2)
    assert swapped.tokens[:2] == [4, 2]
    longer = Match(own, a, *own.longest_match(a, [9, 3, 5, 1], 4))  # (3, 5, 1): length 3
    mixed = candidate_tree([longer, second], [9, 3, 5, 1], 8, 1)
    assert dict(zip(mixed.tokens, mixed.confidence, strict=True)) == pytest.approx(
        {2: 0.6, 4: 0.4})


# ---------------------------------------------------------------------------------------------
# The store: caps, isolation, size, lock
# ---------------------------------------------------------------------------------------------


class HoardingStore(SuffixStore):
    """BROKEN: never evicts."""

    def _add(self, tokens: array[int], key: str | None) -> None:
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = self._trie.new_root()
        self._trie.extend(root, tokens, [])
        self._documents.append(_Document(key, tokens))


class NewestFirstStore(SuffixStore):
    """BROKEN: evicts the newest document instead of the oldest."""

    def _evict(self) -> None:
        self._documents.rotate(1)  # the newest to the front, where _evict takes from
        super()._evict()


def unique_doc(i: int, length: int = 60) -> list[int]:
    """Document i: tokens nobody else uses (ids from 1000 * (i + 1))."""
    return [1000 * (i + 1) + j % 37 for j in range(length)]


def sees(store: SuffixStore, doc: Sequence[int], key: str | None = None) -> bool:
    """Whether a lookup under `key` matches the start of `doc` (its first 3 tokens)."""
    with store.view(key) as view:
        if view is None:
            return False
        trie, root = view
        return trie.longest_match(root, list(doc[:3]), 3)[1] == 3


def check_caps(make: Callable[[float, int], SuffixStore]) -> None:
    """Under a memory cap and under a count cap: after every add the store is within both, and
    what it kept is the newest documents."""
    for mib, requests in ((0.2, 10_000), (64.0, 7)):
        store = make(mib, requests)
        for i in range(40):
            store.add(unique_doc(i, 40 + i % 50))
            assert len(store) <= requests and store.nbytes() <= store.max_bytes
        kept = len(store)
        assert 0 < kept < 40
        assert all(sees(store, unique_doc(i)) for i in range(40 - kept, 40))
        assert not any(sees(store, unique_doc(i)) for i in range(40 - kept))


def test_the_store_never_exceeds_its_caps_and_evicts_the_oldest_first() -> None:
    check_caps(SuffixStore)
    for broken in (HoardingStore, NewestFirstStore):
        with pytest.raises(AssertionError):
            check_caps(broken)


def test_a_document_larger_than_the_store_keeps_its_last_tokens() -> None:
    store = SuffixStore(0.05, 10)
    big = [i % 5000 for i in range(20_000)]
    store.add(big)
    assert 0 < store.tokens() < len(big) and store.nbytes() <= store.max_bytes
    with store.view(None) as view:
        assert view is not None
        trie, root = view
        assert trie.longest_match(root, big[-4:-1], 3)[1] == 3  # the tail is there


def test_bad_caps_are_refused() -> None:
    for mib, requests in ((0.0, 10), (64.0, 0)):
        with pytest.raises(ValueError, match="suffix store"):
            SuffixStore(mib, requests)
    with pytest.raises(SpecDecodeError, match="suffix store"):
        drafter_factory(DrafterOptions("suffix", suffix_mib=0.0), LookupTarget())


class SharedViewStore(SuffixStore):
    """BROKEN: a lookup sees whichever key's documents were stored first."""

    @contextmanager
    def view(self, key: str | None) -> Iterator[tuple[SuffixTrie, int] | None]:
        with self._lock:
            roots = list(self._roots.values())
            yield (self._trie, roots[0]) if roots else None


def check_isolation(make: Callable[[], SuffixStore]) -> None:
    """Key A's lookups see A's documents and never B's (nor the shared scope's), both ways."""
    store = make()
    docs = {key: [unique_doc(3 * i + j) for j in range(3)]
            for i, key in enumerate(("alice", "bob", None))}
    for j in range(3):
        for key, mine in docs.items():
            store.add(mine[j], key)
    for key in docs:
        for other, theirs in docs.items():
            for doc in theirs:
                assert sees(store, doc, key) == (key == other), (key, other)


def test_isolation_keys_never_see_each_others_text() -> None:
    check_isolation(SuffixStore)
    with pytest.raises(AssertionError):
        check_isolation(SharedViewStore)


def test_isolation_holds_through_the_drafter() -> None:
    """A `suffix` drafter of key B proposes nothing from key A's request; one of key A does."""
    factory = drafter_factory("suffix", LookupTarget())
    assert isinstance(factory, SuffixFactory)
    secret = unique_doc(5, 80)
    writer = factory()
    writer.isolation_key = "A"
    request(writer, secret[:40], 4, 8)
    writer.reset()  # the request ends: its text goes to the store under A
    for key, expect in (("B", 0), (None, 0), ("A", 1)):
        reader = factory()
        reader.isolation_key = key
        draft = request(reader, [7, 7, *secret[:10]], 4, 8)
        assert (len(draft.tokens) > 0) == bool(expect), key


class BloatedTrie(SuffixTrie):
    """BROKEN: reports only its token array (as if the other arrays and the index were free)."""

    def nbytes(self) -> int:
        return len(self.token) * 4


def check_size(make: Callable[[int], SuffixTrie]) -> None:
    """nbytes grows as documents are added and is within 20% of what tracemalloc sees the
    index allocate."""
    rng = random.Random(7)
    docs = random_docs(rng, 30, 25, 400) + random_docs(rng, 3000, 25, 400)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trie = make(12)
        root = trie.new_root()
        sizes = [trie.nbytes()]
        for doc in docs:
            trie.extend(root, doc, [])
            sizes.append(trie.nbytes())
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sizes[-1] > 100 * sizes[0]
    assert all(b >= a for a, b in itertools.pairwise(sizes))
    assert 0.8 < sizes[-1] / traced < 1.2, (sizes[-1], traced)


def test_nbytes_grows_with_content_and_is_what_python_allocates() -> None:
    check_size(SuffixTrie)
    with pytest.raises(AssertionError):
        check_size(BloatedTrie)


def test_store_nbytes_counts_its_documents_too() -> None:
    store = SuffixStore()
    empty = store.nbytes()
    store.add(unique_doc(0, 500))
    trie_only = store._trie.nbytes()
    assert store.nbytes() >= trie_only + 4 * 500 and store.nbytes() > empty


class UnlockedStore(SuffixStore):
    """BROKEN: no lock (a lookup could read nodes that another thread is freeing)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = _NoLock()  # type: ignore[assignment]


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def check_lock(make: Callable[[], SuffixStore]) -> None:
    """While one thread reads the trie through `view`, another thread's add waits."""
    store = make()
    store.add(unique_doc(0))
    done = threading.Event()

    def add() -> None:
        store.add(unique_doc(1))
        done.set()

    writer = threading.Thread(target=add)
    with store.view(None):
        writer.start()
        assert not done.wait(0.3), "an add ran while a lookup was reading"
    assert done.wait(10)
    writer.join()
    assert len(store) == 2


def test_the_store_is_locked_while_a_lookup_reads_it() -> None:
    check_lock(SuffixStore)
    with pytest.raises(AssertionError):
        check_lock(UnlockedStore)


# ---------------------------------------------------------------------------------------------
# The drafters
# ---------------------------------------------------------------------------------------------


def request(drafter: TreeLookupDrafter, context: list[int], k: int, nodes: int,
            params: SamplingParams | None = None) -> Draft:
    return drafter.propose(DraftRequest(torch.tensor(context, dtype=torch.long), k,
                                        params or SamplingParams(), len(context), nodes=nodes))


def check_drafts(make: Callable[[], TreeLookupDrafter], seed: int) -> None:
    """On random growing contexts: drafts are trees (parents set) or empty, well formed, with
    distinct siblings, depth <= k, at most min(nodes, max_nodes) nodes, no q, confidences in
    [0, 1]; with no node budget, chains of at most k."""
    rng = random.Random(seed)
    for _ in range(20):
        drafter = make()
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        for _ in range(8):
            k, nodes = rng.randrange(1, 9), rng.choice([0, 1, 4, 16, 64])
            draft = request(drafter, context, k, nodes)
            n = len(draft.tokens)
            assert draft.q is None
            if n:
                assert draft.confidence is not None and len(draft.confidence) == n
                assert all(0.0 <= c <= 1.0 for c in draft.confidence)
            if nodes == 0 or n == 0:
                assert draft.parents is None and n <= k
            else:
                assert draft.parents is not None
                check_tree(draft.parents, draft.tokens)
                assert n <= min(nodes, drafter.max_nodes)
                assert int(tree_depths(draft.parents).max()) <= k
                pairs = list(zip(draft.parents.tolist(), draft.tokens.tolist(), strict=True))
                assert len(set(pairs)) == n
            context += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


class OverfullDrafter(TreeLookupDrafter):
    """BROKEN: ignores the step's node budget (uses its own max_nodes)."""

    def propose(self, request: DraftRequest) -> Draft:
        import dataclasses

        wide = dataclasses.replace(request, nodes=self.max_nodes if request.nodes else 0)
        return super().propose(wide)


def test_drafts_are_well_formed_trees_within_the_budget() -> None:
    factory = drafter_factory("suffix", LookupTarget())
    assert factory is not None
    for make in (factory, lambda: TreeLookupDrafter()):
        check_drafts(make, seed=11)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        check_drafts(lambda: OverfullDrafter(max_nodes=64), seed=11)


def test_nothing_to_match_gives_an_empty_draft_and_one_path_a_chain_with_parents() -> None:
    drafter = TreeLookupDrafter()
    empty = request(drafter, [1, 2, 3], 4, 8)
    assert len(empty.tokens) == 0 and empty.parents is None
    one = request(drafter, [1, 2, 3, 4, 1, 2], 4, 8)
    assert one.tokens.tolist() == [3, 4, 1, 2] and one.parents is not None
    assert one.parents.tolist() == [-1, 0, 1, 2]
    assert one.confidence == pytest.approx([GREEDY_PRIOR[2], *GREEDY_PRIOR[3:6]])
    branched = request(drafter, [1, 2, 3, 4, 1, 2, 5, 1, 2], 2, 8)
    assert sorted(branched.tokens.tolist()) == [1, 3, 4, 5]
    assert branched.parents is not None and branched.parents.tolist().count(-1) == 2


def test_a_repeating_pattern_goes_on_past_the_end_of_the_context() -> None:
    """The match a period back runs into the end of the context after two tokens; re-matching
    continues the pattern, as the chain n-gram drafter's periodic copy does."""
    draft = request(TreeLookupDrafter(), [1, 2, 1, 2, 1, 2, 1, 2], 6, 8)
    assert draft.tokens.tolist() == [1, 2, 1, 2, 1, 2]


def test_confidences_are_the_match_length_rate_split_by_frequency() -> None:
    drafter = TreeLookupDrafter()
    draft = request(drafter, [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], 1, 8)
    got = dict(zip(draft.tokens.tolist(), draft.confidence or (), strict=True))
    assert got == pytest.approx({3: GREEDY_PRIOR[2] * 2 / 3, 4: GREEDY_PRIOR[2] / 3})


def test_followed_scores_a_level_right_when_any_branch_was_committed() -> None:
    tree = CandidateTree([-1, -1, 0, 1], [5, 6, 7, 8], [0.5, 0.5, 1.0, 1.0])
    assert followed(tree, [6, 8, 9]) == [6, 8]  # the second branch, then its leaf
    assert followed(tree, [6, 9]) == [6, 8]  # ... then a miss under it
    assert followed(tree, [9]) == [5]  # a miss at the first level
    assert followed(tree, []) == []


def test_rates_are_learned_from_the_branch_the_text_took() -> None:
    """The second branch was committed: the level counts as right, so the rate after a 2-token
    match rises, as a chain drafter's would only if its single guess had been right."""
    stats = RegimeStats()
    drafter = TreeLookupDrafter(stats=stats)
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    request(drafter, context, 1, 8)
    request(drafter, [*context, 3, 9], 1, 8)  # 3 was a branch: right
    greedy = stats.for_params(SamplingParams())
    assert greedy.proposed[2] == 1 and greedy.accepted[2] == 1


def test_the_suffix_drafter_stores_its_request_and_drafts_from_earlier_ones() -> None:
    factory = drafter_factory(DrafterOptions("suffix", suffix_mib=8.0, suffix_requests=3),
                              LookupTarget())
    assert isinstance(factory, SuffixFactory)
    assert factory.store.max_bytes == 8 * 2**20 and factory.store.max_requests == 3
    first = factory()
    prompt, output = unique_doc(1, 30), unique_doc(2, 12)
    request(first, prompt, 4, 8)
    first.observe_result(Draft(torch.zeros(0, dtype=torch.long), None), 0, output[:1])
    first.observe_result(Draft(torch.zeros(0, dtype=torch.long), None), 0, output[1:])
    assert len(factory.store) == 0
    first.reset()
    assert len(factory.store) == 1 and factory.store.tokens() == 42
    second = factory()
    draft = request(second, [9, *prompt[-5:]], 6, 8)  # a new request that ends like the first
    assert draft.tokens.tolist()[:6] == output[:6]
    assert isinstance(second, SuffixDrafter) and second.store is factory.store
    lone = drafter_factory("ngram-tree", LookupTarget())
    assert lone is not None
    alone = lone()
    assert isinstance(alone, TreeLookupDrafter) and not isinstance(alone, SuffixDrafter)
    assert len(request(alone, [9, *prompt[-5:]], 6, 8).tokens) == 0  # (its own context only)


def test_drafts_are_deterministic() -> None:
    rng = random.Random(5)
    context = [rng.randrange(4) for _ in range(60)]
    first, second = (request(TreeLookupDrafter(), context, 5, 16) for _ in range(2))
    assert first.parents is not None and second.parents is not None and len(first.tokens) > 5
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.parents,
                                                                    second.parents)
    assert first.confidence == second.confidence


# ---------------------------------------------------------------------------------------------
# Registry and CLI
# ---------------------------------------------------------------------------------------------


def test_the_registry_and_the_cli_know_the_tree_drafters(tmp_path: Path) -> None:
    assert {"suffix", "ngram-tree"} <= set(DRAFTERS)
    factory = drafter_factory(DrafterOptions("suffix", tree_nodes=5, ngram_max=4), LookupTarget())
    assert isinstance(factory, SuffixFactory)
    made = [factory(), factory()]
    assert made[0].store is made[1].store and made[0].max_nodes == 5  # one store per factory
    assert made[0].max_match == 4
    ngram_tree = drafter_factory("ngram-tree", LookupTarget())
    assert ngram_tree is not None and ngram_tree().max_nodes == 16
    ckpt = make_checkpoint(tmp_path / "tiny")
    for name in ("suffix", "ngram-tree"):
        code, out, err = run_cli(["generate", "t2 t3 t4 t2 t3 t4 t2 t3", "--model", str(ckpt),
                                  "--drafter", name, "--k", "3", "--max-tokens", "6", "--json"])
        assert code == 0, err
        assert len(json.loads(out)["token_ids"]) == 6


# ---------------------------------------------------------------------------------------------
# Greedy identity through the engine (trees scored under a tree mask, KV compacted)
# ---------------------------------------------------------------------------------------------

PROMPTS = ([5, 7, 3, 8, 11, 2], [1, 2, 3], [40, 41, 9, 9, 9, 17, 30, 2, 5, 60],
           [9, 8, 7, 6, 5, 4, 3])
TOKENS = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A random checkpoint of vocabulary 96 (its greedy text repeats itself: lookups match)."""
    folder = make_checkpoint(tmp_path_factory.mktemp("suffix-tiny") / "t96", seed=3)
    return load_native(folder, config_from_hf(read_hf_config(folder)))


class Watch:
    """Counts, over the steps a drafter verified: tree drafts with siblings, and accepted paths
    that left the first branch somewhere (a sibling other than the lowest-index one)."""

    def __init__(self, drafter: TreeLookupDrafter) -> None:
        self.branched = self.off_first = self.accepted = 0
        observe = drafter.observe_result

        def watched(draft: Draft, num_accepted: int, committed: list[int]) -> None:
            self.accepted += num_accepted
            if draft.parents is not None:
                parents = draft.parents.tolist()
                self.branched += len(set(parents)) < len(parents)
                self.off_first += left_first_branch(parents, draft.tokens.tolist(),
                                                    committed[:num_accepted])
            observe(draft, num_accepted, committed)

        drafter.observe_result = watched  # type: ignore[method-assign]


def left_first_branch(parents: list[int], tokens: list[int], accepted: list[int]) -> bool:
    """Whether the accepted tokens' path through the tree takes, at some node, a child that is
    not the first (lowest-index) one."""
    parent = -1
    for token in accepted:
        children = [i for i, p in enumerate(parents) if p == parent]
        chosen = next(i for i in children if tokens[i] == token)
        if chosen != children[0]:
            return True
        parent = chosen
    return False


def plain(target: Any, prompt: list[int], tokens: int = TOKENS) -> list[int]:
    gen = Generation(target, None, prompt, SamplingParams(max_tokens=tokens))
    for _ in gen.run():
        pass
    return gen.output


def speculate(target: Any, prompt: list[int], drafter: TreeLookupDrafter, k: int) -> Generation:
    gen = Generation(target, None, prompt, SamplingParams(max_tokens=TOKENS), drafter, k)
    for _ in gen.run():
        pass
    gen.release()  # the request ends: a suffix drafter stores it
    return gen


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["suffix", "ngram-tree"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_plain_decodings_at_batch_1(tiny: Any, name: str, k: int) -> None:
    """Every prompt twice (the suffix drafter's store then holds the first run)."""
    factory = drafter_factory(name, tiny)
    assert factory is not None
    assert tiny.supports_trees
    branched = 0
    gens, expected = [], []
    for prompt in (*PROMPTS, *PROMPTS):
        drafter = factory()
        assert isinstance(drafter, TreeLookupDrafter)
        watch = Watch(drafter)
        gens.append(speculate(tiny, prompt, drafter, k))
        expected.append(plain(tiny, prompt))
        branched += watch.branched
    assert_identical(gens, expected, f"{name} k={k}")
    assert k == 1 or branched > 0


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("auto", [False, True])
def test_greedy_output_is_plain_decodings_in_a_batch(tiny: Any, auto: bool) -> None:
    """Suffix and ngram-tree rows beside a plain row in a BatchEngine of 3 rows (requests join
    as others finish, and finished suffix requests feed the store the later ones read), at
    fixed k and under the controller (--k auto keeps the nodes that pay)."""
    suffix, ngram_tree = drafter_factory("suffix", tiny), drafter_factory("ngram-tree", tiny)
    assert isinstance(suffix, SuffixFactory) and ngram_tree is not None
    prompts = [*PROMPTS, *PROMPTS, PROMPTS[0]]
    makers: list[Callable[[], Drafter] | None] = [suffix, ngram_tree, None, suffix, suffix,
                                                   ngram_tree, suffix, suffix, suffix]
    ks = [4, 3, 0, 2, 5, 4, 3, 4, 6]
    gens = [Generation(tiny, None, p, SamplingParams(max_tokens=TOKENS),
                       make() if make else None, k)
            for p, make, k in zip(prompts, makers, ks, strict=True)]
    engine = BatchEngine(tiny, 3, 128, controller=Controller(kmax=6) if auto else None)
    run_batch(engine, gens)
    assert_identical(gens, [plain(tiny, p) for p in prompts], f"trees in a batch, auto {auto}")
    assert len(suffix.store) == makers.count(suffix)  # every suffix request was stored


def related_store(target: Any, factory: SuffixFactory, prompt: list[int]) -> list[int]:
    """Fill the store as if `prompt` had been asked three times before: once going the target's
    greedy way, twice another way (as sampled requests may): a lookup at the prompt's end then
    ranks the other way FIRST (2 of 3) and the target's second. Returns the greedy output."""
    expected = plain(target, prompt)
    detour = [(expected[0] + 1) % 96, *expected[1:]]
    for output in (detour, expected, detour):
        factory.store.add([*prompt, *output], factory.isolation_key)
    return expected


@pytest.mark.usefixtures("one_thread")
def test_a_related_earlier_request_gives_branching_trees_off_the_first_branch(tiny: Any) -> None:
    """The store holds related earlier requests: drafts branch, and the accepted path leaves
    the first branch, at batch 1 and in a batch; the output is still plain decoding's."""
    factory = drafter_factory("suffix", tiny)
    assert isinstance(factory, SuffixFactory)
    factory.isolation_key = "user"
    prompt = [*PROMPTS[2], 33, 71]
    expected = related_store(tiny, factory, prompt)
    drafter = factory()
    watch = Watch(drafter)
    gen = speculate(tiny, prompt, drafter, 4)
    assert gen.output == expected
    assert watch.branched > 0 and watch.off_first > 0
    assert gen.counters.steps < TOKENS // 2  # the store's continuation was accepted
    others = [PROMPTS[0], prompt, PROMPTS[1], prompt]
    gens = [Generation(tiny, None, p, SamplingParams(max_tokens=TOKENS), factory(), k)
            for p, k in zip(others, [3, 4, 2, 6], strict=True)]
    watches = [Watch(g.drafter) for g in gens]  # type: ignore[arg-type]
    run_batch(BatchEngine(tiny, 4, 128), gens)
    assert [g.output for g in gens] == [plain(tiny, p) for p in others]
    assert sum(w.off_first for w in watches) > 0 and sum(w.branched for w in watches) > 0
    stranger = factory()
    stranger.isolation_key = "someone else"  # sees none of the store: drafts from its own text
    alone = speculate(tiny, prompt, stranger, 4)
    assert alone.output == expected and alone.counters.steps > gen.counters.steps


@pytest.mark.usefixtures("one_thread")
def test_the_branching_case_catches_an_engine_that_does_not_compact_the_kv(
        tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity test above can fail: with the accepted path's KV left uncompacted (the
    first branch's KV where the path's should be), its output differs from plain decoding."""
    factory = drafter_factory("suffix", tiny)
    assert isinstance(factory, SuffixFactory)
    prompt = [*PROMPTS[2], 33, 71]
    expected = related_store(tiny, factory, prompt)
    monkeypatch.setattr(KVCache, "keep", no_compaction)
    assert speculate(tiny, prompt, factory(), 4).output != expected


# ---------------------------------------------------------------------------------------------
# Sampled: the output distribution is the target's (chi-square on the first two tokens)
# ---------------------------------------------------------------------------------------------


def sampled_factory(target: Any) -> SuffixFactory:
    """A suffix factory whose store holds the audit prompt followed by likely and unlikely
    first tokens: each step's draft is a tree with several siblings at the root (q None)."""
    factory = drafter_factory("suffix", target)
    assert isinstance(factory, SuffixFactory)
    exact = exact_pairs(target, PARAMS)
    first: dict[int, float] = {}
    for (a, _), p in exact.items():
        first[a] = first.get(a, 0.0) + p
    ranked = sorted(first, key=first.__getitem__, reverse=True)
    for a in [*ranked[:3], *ranked[-2:], ranked[0]]:
        factory.store.add([*PROMPT, a, ranked[0]])
    return factory


class LyingSuffix(SuffixDrafter):
    """BROKEN: reports a uniform q for its deterministic nodes (verify_tree over-accepts)."""

    def propose(self, request: DraftRequest) -> Draft:
        draft = super().propose(request)
        n = len(draft.tokens)
        return Draft(draft.tokens, torch.full((n, 16), 1 / 16) if n else None,
                     draft.confidence, draft.parents)


@pytest.mark.statistical
@pytest.mark.parametrize("lying", [False, True])
def test_sampled_suffix_trees_keep_the_targets_distribution(
        models: Any, lying: bool) -> None:  # noqa: F811  (fixture)
    """Rule "residual", trees of several siblings with q None (verified one-hot): the first two
    tokens pass the chi-square test against the enumerated target; the same trees reported
    with a uniform q are rejected."""
    target = models[0]
    factory = sampled_factory(target)
    tree = request(factory(), PROMPT, 1, 8, PARAMS)
    assert tree.parents is not None and len(tree.tokens) >= 4  # siblings at the root

    def make() -> SuffixDrafter:
        if not lying:
            return factory()
        return LyingSuffix(factory.store, max_nodes=factory.max_nodes, stats=factory.stats)

    counts = observed_pairs(target, make, 1, SAMPLES)
    p_value = gof_p_value(counts, exact_pairs(target, PARAMS))
    assert (p_value < FALSE_ALARM) if lying else (p_value > FALSE_ALARM)
