"""A suffix index over token sequences, the candidate trees it drafts, and a bounded store of
earlier requests (issue 24, suffix decoding).

The idea is SuffixDecoding's (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding
for Emerging AI Applications", arXiv 2411.04975): index the prompts and outputs of earlier
requests and the current one by their suffixes; match the longest suffix of the current context;
the tokens that followed its occurrences, weighted by how often each followed, form a tree of
candidate continuations, grown greedily by path probability up to a node budget.

**Why a bounded-depth suffix trie with occurrence counts** (and not a suffix automaton, a
compressed suffix tree or an n-gram table):

- *Counts are the weights.* A node's count is the number of occurrences of its path, so the
  frequency of a continuation is read off its children, which is what a candidate tree needs.
  A suffix automaton merges strings by their end positions; occurrence counts there are sums
  over its suffix-link tree, which appending one token can change along a long chain.
- *Eviction.* Removing a document replays its insertion with decrements, freeing the nodes that
  reach zero. A suffix automaton cannot forget a document (its states mix the documents' end
  positions), and a compressed suffix tree's edge labels point into documents, which eviction
  invalidates; both could only evict by rebuilding.
- *Incremental appends.* Appending a token extends the document's open suffixes (at most
  `depth` of them) by one node each: O(depth) per token, which a growing request context needs.
- *The price* is up to `depth` nodes per token instead of O(1). Depth is bounded by what a
  lookup walks: the longest suffix matched plus the deepest continuation drafted. Nodes are
  therefore rows of flat int32 arrays (20 bytes a node, plus a hash entry for the few nodes
  whose parent has many children) rather than Python objects (hundreds of bytes each).

Layout: node i has token[i], count[i], first[i] (first child), next[i] / prev[i] (its
siblings, doubly linked so that a child is unlinked in O(1) even under a root with thousands of
children). A parent with more than WIDE children also indexes them in `edges` ((parent << 32) |
token -> child), so a lookup never walks a long sibling list. One trie holds several roots: the
store keeps one root per isolation key, so documents of different keys share no node.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from specdecode.limits import SUFFIX_STORE_MIB, SUFFIX_STORE_MIN_MIB, SUFFIX_STORE_REQUESTS

NONE = -1  # no node
WIDE = 8  # a parent with more children than this indexes them in SuffixTrie.edges
NARROW = WIDE // 2  # ... and stops at this many or fewer (a gap: no flipping back and forth)
INT_BYTES = 32  # a Python int as the edges dict holds it (28-36 bytes; keys >= 2^30 take 32)


class SuffixTrie:
    """Every substring of at most `depth` tokens of the documents added under a root, with the
    number of its occurrences (node count = occurrences of the node's path)."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2 (a match and a token), got {depth}")
        self.depth = depth
        self.token = array("i")
        self.count = array("i")
        self.first = array("i")
        self.next = array("i")
        self.prev = array("i")
        self.free = array("i")  # released node rows, reused first
        self.edges: dict[int, int] = {}  # (parent << 32) | token -> child, for wide parents
        self.wide: dict[int, int] = {}  # wide parent -> its number of children
        self.live = 0  # nodes in use (roots included)

    # ----------------------------------------------------------------------- nodes and edges

    def new_root(self) -> int:
        """A new empty root (its count will be the number of positions indexed under it)."""
        return self._alloc(NONE)

    def free_root(self, root: int) -> None:
        """Release an empty root (every document under it removed)."""
        if self.count[root] != 0 or self.first[root] != NONE:
            raise ValueError("only an empty root can be freed")
        self._release(root)

    def _alloc(self, token: int) -> int:
        self.live += 1
        if self.free:
            node = self.free.pop()
            self.token[node], self.count[node] = token, 0
            self.first[node] = self.next[node] = self.prev[node] = NONE
            return node
        self.token.append(token)
        self.count.append(0)
        self.first.append(NONE)
        self.next.append(NONE)
        self.prev.append(NONE)
        return len(self.token) - 1

    def _release(self, node: int) -> None:
        self.live -= 1
        self.free.append(node)

    def find(self, node: int, token: int) -> int:
        """The child of `node` with `token`, or NONE."""
        if node in self.wide:
            return self.edges.get(node << 32 | token, NONE)
        child = self.first[node]
        while child != NONE and self.token[child] != token:
            child = self.next[child]
        return child

    def children(self, node: int) -> list[int]:
        """The children of `node` (most recently created first)."""
        out: list[int] = []
        child = self.first[node]
        while child != NONE:
            out.append(child)
            child = self.next[child]
        return out

    def _child_or_new(self, parent: int, token: int) -> int:
        """The child of `parent` with `token`, created (count 0) if absent."""
        if parent in self.wide:
            key = parent << 32 | token
            child = self.edges.get(key, NONE)
            if child == NONE:
                child = self._link(parent, token)
                self.edges[key] = child
                self.wide[parent] += 1
            return child
        seen = 0
        child = self.first[parent]
        while child != NONE:
            if self.token[child] == token:
                return child
            seen += 1
            child = self.next[child]
        child = self._link(parent, token)
        if seen + 1 > WIDE:  # too many to walk on every lookup: index them
            self.wide[parent] = seen + 1
            for c in self.children(parent):
                self.edges[parent << 32 | self.token[c]] = c
        return child

    def _link(self, parent: int, token: int) -> int:
        """A new child of `parent`, at the head of its sibling list."""
        child = self._alloc(token)
        head = self.first[parent]
        self.next[child] = head
        if head != NONE:
            self.prev[head] = child
        self.first[parent] = child
        return child

    def _unlink(self, parent: int, child: int) -> None:
        """Detach `child` (count 0) from `parent` and release its row."""
        before, after = self.prev[child], self.next[child]
        if before != NONE:
            self.next[before] = after
        else:
            self.first[parent] = after
        if after != NONE:
            self.prev[after] = before
        if parent in self.wide:
            del self.edges[parent << 32 | self.token[child]]
            self.wide[parent] -= 1
            if self.wide[parent] <= NARROW:
                for c in self.children(parent):
                    del self.edges[parent << 32 | self.token[c]]
                del self.wide[parent]
        self._release(child)

    # ----------------------------------------------------------------------- documents

    def extend(self, root: int, tokens: Sequence[int], open_nodes: list[int]) -> list[int]:
        """Append `tokens` to a document under `root` and return its open suffixes.

        `open_nodes`: the document's suffixes still shorter than `depth` (oldest first), as the
        previous call returned them; [] for a new document. Each token extends every open suffix
        by one node and starts a new one at the root; a suffix reaching `depth` is closed."""
        keep = self.depth - 1
        count = self.count
        for token in tokens:
            count[root] += 1
            extended: list[int] = []
            for node in (*open_nodes, root):
                child = self._child_or_new(node, token)
                count[child] += 1
                extended.append(child)
            open_nodes = extended[-keep:]
        return open_nodes

    def remove(self, root: int, tokens: Sequence[int]) -> None:
        """Remove a document added whole under `root` (`extend` from []): every suffix's path
        is decremented and the nodes reaching zero are released. A node of count 1 has at most
        one child, so the nodes released below it are exactly the rest of this path."""
        count = self.count
        for start in range(len(tokens)):
            count[root] -= 1
            node = root
            for token in tokens[start : start + self.depth]:
                child = self.find(node, token)
                if child == NONE:
                    raise ValueError("removing a document that was not added")
                count[child] -= 1
                if count[child] == 0:
                    self._unlink(node, child)
                node = child

    # ----------------------------------------------------------------------- lookups

    def walk(self, node: int, tokens: Sequence[int]) -> int:
        """The node of path `tokens` below `node`, or NONE."""
        for token in tokens:
            node = self.find(node, token)
            if node == NONE:
                return NONE
        return node

    def longest_match(self, root: int, context: Sequence[int], max_len: int) -> tuple[int, int]:
        """(node, m): the longest suffix of `context`, m <= max_len (and < depth, so that a
        continuation fits), that occurs under `root` followed by at least one token; its node
        has children. (root, 0) when only the empty suffix does; (NONE, 0) for an empty root.

        Binary search on m: if the suffix of length m occurs with a continuation, so does the
        one of length m - 1 (the same occurrence, one token shorter)."""
        if self.first[root] == NONE:
            return NONE, 0
        low, high, best = 0, min(max_len, self.depth - 1, len(context)), root
        while low < high:
            mid = (low + high + 1) // 2
            node = self.walk(root, context[len(context) - mid :])
            if node != NONE and self.first[node] != NONE:
                low, best = mid, node
            else:
                high = mid - 1
        return best, low

    def nbytes(self) -> int:
        """Bytes held: the node arrays as allocated (sys.getsizeof counts their spare capacity),
        the free list, and the hash index with its int objects."""
        arrays = (self.token, self.count, self.first, self.next, self.prev, self.free)
        held = sum(sys.getsizeof(a) for a in arrays) + sys.getsizeof(self)
        held += sys.getsizeof(self.edges) + 2 * INT_BYTES * len(self.edges)
        held += sys.getsizeof(self.wide) + 2 * INT_BYTES * len(self.wide)
        return held


# --------------------------------------------------------------------------- candidate trees


@dataclass(frozen=True)
class Match:
    """Where one source matched the context: its trie and root, the matched suffix's node and
    length."""

    trie: SuffixTrie
    root: int
    node: int
    length: int


@dataclass(frozen=True)
class CandidateTree:
    """parents[i]: node i's parent (-1 for a child of the pending token), in topological order;
    tokens[i]: its token; confidence[i]: the estimated probability that it follows its parent
    (its path probability divided by its parent's). Siblings carry distinct tokens."""

    parents: list[int]
    tokens: list[int]
    confidence: list[float]


@dataclass(frozen=True)
class _Grow:
    """What growing one tree reads: the sources, the context's last tokens (re-matching looks
    at no more), the longest re-match, and the limits."""

    matches: Sequence[Match]
    tail: list[int]
    max_match: int
    width: int
    min_probability: float


# A candidate node in the heap: (-path probability, tie-break, parent index, path from the
# root (its tokens), confidence, per source: its trie node or NONE, per source: its share of
# the path probability)
_Entry = tuple[float, int, int, tuple[int, ...], float, tuple[int, ...], tuple[float, ...]]


def candidate_tree(matches: Sequence[Match], context: Sequence[int], nodes: int, depth: int,
                   width: int = 0, min_probability: float = 0.0, max_match: int = 8
                   ) -> CandidateTree:
    """The tree of continuations after the matched suffixes of `context`, grown best-first by
    path probability (EAGLE-2's and SuffixDecoding's greedy expansion) up to `nodes` nodes and
    `depth` levels; `width` > 0 keeps at most that many children per node (1: the most likely
    chain); paths less probable than `min_probability` are left out.

    One source: a child's probability is its count over the sum of its siblings' counts (the
    occurrences that continue at all: the context's own trailing occurrence, and occurrences
    cut by the end of their document or by the trie's depth, say nothing about what follows).
    Where a source's node has no children (its occurrences ran out: a match a few tokens back
    in a repeating pattern, or the trie's depth), the source re-matches: it continues from the
    longest suffix (at most `max_match`) of the context followed by the path, as a lookup
    drafting one token at a time would (for a repeating pattern, the pattern goes on).

    Several sources (the request's own context, the store): the tree of their mixture, each
    source weighted by the length of its match (a longer match is more often right: the n-gram
    drafter's measurements): a path's probability is sum_s w_s P_s(path), and where a source
    has nothing further even after re-matching its share is lost, which lowers the children's
    confidence. Ties go to the earlier source, so the request's own context comes first."""
    matches = [m for m in matches if m.node != NONE and m.length > 0]
    total = sum(m.length for m in matches)
    tree = CandidateTree([], [], [])
    if not matches or nodes <= 0 or depth <= 0:
        return tree
    grow = _Grow(matches, list(context[len(context) - max_match :]), max_match, width,
                 min_probability)
    order = itertools.count()
    heap: list[_Entry] = []
    root = (tuple(m.node for m in matches), tuple(m.length / total for m in matches))
    _push_children(heap, order, grow, -1, (), 1.0, root, nodes)
    while heap and len(tree.tokens) < nodes:
        negative, _, parent, path, confidence, at, shares = heapq.heappop(heap)
        index = len(tree.tokens)
        tree.parents.append(parent)
        tree.tokens.append(path[-1])
        tree.confidence.append(confidence)
        if len(path) < depth:
            _push_children(heap, order, grow, index, path, -negative, (at, shares),
                           nodes - len(tree.tokens))
    return tree


def _push_children(heap: list[_Entry], order: Iterator[int], grow: _Grow, parent: int,
                   path: tuple[int, ...], probability: float,
                   where: tuple[tuple[int, ...], tuple[float, ...]], room: int) -> None:
    """Push the children of a tree node (its sources' nodes and path-probability shares in
    `where`), the `room` most probable at most (no more could be added)."""
    found = _continuations(grow, path, *where)
    ranked = sorted(found.items(), key=lambda item: -sum(item[1][1]))  # stable: ties keep order
    limit = min(room, grow.width) if grow.width > 0 else room
    for token, (at, shares) in ranked[:limit]:
        mass = sum(shares)
        if mass <= 0.0 or mass < grow.min_probability:
            break  # ranked: the rest are less probable still
        confidence = min(1.0, mass / probability)
        heapq.heappush(heap, (-mass, next(order), parent, (*path, token), confidence, at,
                              shares))


def _continuations(grow: _Grow, path: tuple[int, ...], at: tuple[int, ...],
                   shares: tuple[float, ...]
                   ) -> dict[int, tuple[tuple[int, ...], tuple[float, ...]]]:
    """token -> (per source: its child node or NONE, per source: its share of the child path's
    probability), over every source that continues here (re-matched if its node ran out), in
    source order."""
    sources = len(grow.matches)
    out: dict[int, tuple[list[int], list[float]]] = {}
    for s, (match, node, share) in enumerate(zip(grow.matches, at, shares, strict=True)):
        if node == NONE or share <= 0.0:
            continue
        trie = match.trie
        if trie.first[node] == NONE:
            node, length = trie.longest_match(match.root, [*grow.tail, *path], grow.max_match)
            if length == 0:
                continue
        kids = trie.children(node)
        total = sum(trie.count[c] for c in kids)
        for child in kids:
            token = trie.token[child]
            if token not in out:
                out[token] = ([NONE] * sources, [0.0] * sources)
            out[token][0][s] = child
            out[token][1][s] = share * trie.count[child] / total
    return {t: (tuple(nodes), tuple(sh)) for t, (nodes, sh) in out.items()}


# --------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class _Document:
    key: str | None
    tokens: array[int]  # int32


DOCUMENT_BYTES = 200  # a stored document's record and deque slot, beyond its token array
MIN_MIB = SUFFIX_STORE_MIN_MIB
GROWTH_PER_NODE = 24  # the bytes a new trie node adds, about (arrays ~20, hash entries, spare)


class SuffixStore:
    """Earlier requests' prompts + outputs, indexed in one SuffixTrie with one root per isolation
    key, bounded by `max_mib` MiB (nbytes) and `max_requests` documents: adding evicts the
    oldest documents first, of any key, until the new one fits.

    A lookup under key K sees only documents added under K (None is one more key, the shared
    scope). Thread-safe: every method holds the store's lock, and `view` holds it while the
    caller reads the trie (a server's worker thread drafts and adds while another thread reads
    nbytes for its metrics).

    The memory cap holds after every `add`: before inserting, the oldest documents are evicted
    until the estimated growth fits; after, until the measured size does. Arrays keep their
    capacity when nodes are freed (freed rows are reused), so if evicting every other document
    cannot bring the size under the cap (a burst grew the arrays), the index is rebuilt from
    the documents kept. A document alone over half the cap keeps only its last tokens."""

    def __init__(self, max_mib: float = SUFFIX_STORE_MIB, max_requests: int = SUFFIX_STORE_REQUESTS,
                 depth: int = 16) -> None:
        if max_mib < MIN_MIB or max_requests <= 0:
            raise ValueError(f"the suffix store needs at least {MIN_MIB} MiB and 1 request, got "
                             f"{max_mib} MiB and {max_requests} requests")
        self.max_bytes = int(max_mib * 2**20)
        self.max_requests = max_requests
        self.depth = depth
        self._lock = threading.Lock()
        self._trie = SuffixTrie(depth)
        self._roots: dict[str | None, int] = {}
        self._documents: deque[_Document] = deque()
        self.evicted = 0  # documents evicted since creation

    def __len__(self) -> int:
        with self._lock:
            return len(self._documents)

    def nbytes(self) -> int:
        """Bytes the store holds: its trie, the stored documents' tokens and records."""
        with self._lock:
            return self._nbytes()

    def tokens(self) -> int:
        """Tokens stored, over all documents."""
        with self._lock:
            return sum(len(d.tokens) for d in self._documents)

    def add(self, tokens: Sequence[int], key: str | None = None) -> None:
        """Store a finished request's prompt + output under isolation `key`."""
        with self._lock:
            self._add(array("i", tokens[-self._max_document_tokens() :]), key)

    @contextmanager
    def view(self, key: str | None) -> Iterator[tuple[SuffixTrie, int] | None]:
        """(trie, root) of key's documents while the lock is held, or None if it has none."""
        with self._lock:
            root = self._roots.get(key)
            yield None if root is None else (self._trie, root)

    # ----------------------------------------------------------------------- under the lock

    def _nbytes(self) -> int:
        documents = sum(sys.getsizeof(d.tokens) + DOCUMENT_BYTES for d in self._documents)
        roots = sys.getsizeof(self._roots) + 2 * INT_BYTES * len(self._roots)
        return self._trie.nbytes() + documents + roots + sys.getsizeof(self._documents)

    def _max_document_tokens(self) -> int:
        """The most tokens one document may keep: half the cap by the growth estimate."""
        return max(1, self.max_bytes // 2 // (self.depth * GROWTH_PER_NODE + 4))

    def _growth(self, n: int) -> int:
        """Estimated bytes that indexing n more tokens adds: at most depth nodes a token, less
        the free rows they reuse, and the token array."""
        new_rows = max(0, n * self.depth - len(self._trie.free))
        return new_rows * GROWTH_PER_NODE + 4 * n + DOCUMENT_BYTES

    def _add(self, tokens: array[int], key: str | None) -> None:
        if not tokens:
            return
        while self._documents and (len(self._documents) >= self.max_requests
                                   or self._nbytes() + self._growth(len(tokens)) > self.max_bytes):
            self._evict()
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = self._trie.new_root()
        self._trie.extend(root, tokens, [])
        self._documents.append(_Document(key, tokens))
        while len(self._documents) > 1 and self._nbytes() > self.max_bytes:
            self._evict()
        if self._nbytes() > self.max_bytes:
            self._rebuild()

    def _evict(self) -> None:
        """Remove the oldest document (and its key's root once empty)."""
        oldest = self._documents.popleft()
        root = self._roots[oldest.key]
        self._trie.remove(root, oldest.tokens)
        if self._trie.count[root] == 0:
            self._trie.free_root(root)
            del self._roots[oldest.key]
        self.evicted += 1

    def _rebuild(self) -> None:
        """Index the kept documents afresh (arrays sized to them), dropping the oldest until
        the store fits."""
        kept = list(self._documents)
        while True:
            self._trie, self._roots, self._documents = SuffixTrie(self.depth), {}, deque()
            for document in kept:
                root = self._roots.get(document.key)
                if root is None:
                    root = self._roots[document.key] = self._trie.new_root()
                self._trie.extend(root, document.tokens, [])
                self._documents.append(document)
            if not kept or self._nbytes() <= self.max_bytes:
                return
            self.evicted += 1
            kept.pop(0)
