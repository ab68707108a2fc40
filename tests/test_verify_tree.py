"""Tree verification: greedy and invariant cases by hand and against plain decoding, the sampled
rule against verify_chain on chains, and its exact distribution on trees.

The sampled rule (verify.verify_tree, recursive rejection sampling over siblings) is checked two
ways, as tests/test_verify.py checks chains:

- exactly: `exact_first_token` enumerates every draft of the root's children (V^m tuples, or the
  ordered draws without replacement) and follows every accept / reject branch with its
  probability, giving the exact law of the first emitted token under a sibling rule written
  here independently of verify_tree. The correct rule gives the target's law to 1e-6; each
  broken variant is off by TV >= DESIGN_TV.
- by sampling: `audit` decodes the first two tokens of a toy bigram target many times through a
  tree drafter and a verifier, and chi-square tests the first token and the two-token sequence
  against the exact target law. verify_tree must pass; the broken variants must fail the same
  test. Sample size: required_samples(DESIGN_TV, FALSE_ALARM, POWER, V * V), so a variant at
  TV >= DESIGN_TV on the first token (so on the pair too) is caught with probability >= POWER
  and a correct verifier fails one chi-square test with probability FALSE_ALARM.
"""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from specdecode.audit_stats import chi_square_gof, required_samples, tv_distance
from specdecode.sampling import PositionNoise, gumbel_argmax, sample
from specdecode.verify import (
    TreeVerifyResult,
    check_tree,
    tree_depths,
    tree_path,
    verify_chain,
    verify_greedy,
    verify_invariant,
    verify_tree,
    verify_tree_greedy,
    verify_tree_invariant,
    without_replacement,
)

V = 5  # toy vocabulary
START = V  # row of the toy tables used before any token
FALSE_ALARM = 1e-4
POWER = 0.999
DESIGN_TV = 0.1
N_AUDIT = required_samples(DESIGN_TV, FALSE_ALARM, POWER, num_cells=V * V)

TreeVerifier = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator | None],
    TreeVerifyResult,
]


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _one_hot(tokens: list[int], vocab: int = V) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)  # (T, V)
    out[torch.arange(len(tokens)), _t(tokens)] = 1.0
    return out


# ---------------------------------------------------------------------------------------------
# Representation and validation
# ---------------------------------------------------------------------------------------------

#        root
#       /    \
#     0:a    1:b
#    /   \      \
#  2:c   3:d    4:e
#          \
#          5:f
PARENTS = _t([-1, -1, 0, 0, 1, 3])


def test_depths_and_paths() -> None:
    assert tree_depths(PARENTS).tolist() == [1, 1, 2, 2, 2, 3]
    assert tree_path(PARENTS, 5) == [0, 3, 5]
    assert tree_path(PARENTS, 4) == [1, 4]
    assert tree_path(PARENTS, -1) == []
    assert tree_depths(_t([])).tolist() == []


@pytest.mark.parametrize(
    ("parents", "tokens", "message"),
    [
        ([-1, 1], [0, 1], "parent 1"),  # its own parent (a cycle)
        ([-1, 2, 0], [0, 1, 2], "parent 2"),  # parent after its child
        ([-2], [0], "parent -2"),
        ([-1, 0], [0], "one length"),
    ],
)
def test_malformed_trees_are_refused(parents: list[int], tokens: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tree(_t(parents), _t(tokens))
    with pytest.raises(ValueError, match=message):
        verify_tree_greedy(_t([0] * (len(tokens) + 1)), _t(parents), _t(tokens))


def test_shape_dtype_and_vocabulary_checks() -> None:
    with pytest.raises(ValueError, match="integer"):
        check_tree(torch.tensor([-1.0]), _t([0]))
    with pytest.raises(ValueError, match=r"0\.\.4"):
        check_tree(_t([-1]), _t([5]), vocab_size=V)
    with pytest.raises(ValueError, match="p must be"):
        verify_tree(torch.ones(1, V), _t([-1]), _t([0]), None, None)
    with pytest.raises(ValueError, match="q must be"):
        verify_tree(torch.ones(2, V), _t([-1]), _t([0]), torch.ones(1, V + 1), None)
    with pytest.raises(ValueError, match=r"0\.\.4"):
        verify_tree(torch.ones(2, V), _t([-1]), _t([7]), None, None)
    with pytest.raises(ValueError, match="target_tokens"):
        verify_tree_greedy(_t([0]), _t([-1]), _t([0]))
    with pytest.raises(ValueError, match="x must be"):
        verify_tree_invariant(torch.zeros(1, V), _t([-1]), _t([0]), lambda d: torch.zeros(V))


def test_without_replacement_removes_the_drawn_tokens() -> None:
    q = torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0])
    assert torch.allclose(without_replacement(q, []), q)
    assert torch.allclose(without_replacement(q, [0]), torch.tensor([0, 0.5, 0.5, 0, 0]))
    with pytest.raises(ValueError):
        without_replacement(q, [0, 1, 2])


# ---------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------

A, B, C, D, E, F = 0, 1, 2, 3, 4, 0  # node tokens of PARENTS (F reuses token 0)
TOKENS = _t([A, B, C, D, E, F])


def _greedy(target: list[int]) -> tuple[list[int], list[int]]:
    result = verify_tree_greedy(_t(target), PARENTS, TOKENS)
    assert result.num_accepted == result.path.numel() == result.tokens.numel() - 1
    return result.path.tolist(), result.tokens.tolist()


def test_tree_greedy_by_hand() -> None:
    # target rows: [root, after 0:a, after 1:b, after 2:c, after 3:d, after 4:e, after 5:f]
    assert _greedy([A, D, 4, 4, F, 4, 2]) == ([0, 3, 5], [A, D, F, 2])  # deepest path + bonus
    assert _greedy([A, D, 4, 4, 1, 4, 2]) == ([0, 3], [A, D, 1])  # 5:f rejected: recovered 1
    assert _greedy([B, 4, E, 4, 4, 3, 4]) == ([1, 4], [B, E, 3])  # second branch
    assert _greedy([B, 4, 2, 4, 4, 3, 4]) == ([1], [B, 2])
    assert _greedy([C, 4, 4, 4, 4, 4, 4]) == ([], [C])  # no child of the root matches
    assert _greedy([A, C, 4, 1, 4, 4, 4]) == ([0, 2], [A, C, 1])  # leaf 2:c: bonus after it


def test_tree_greedy_empty_tree_emits_the_root_token() -> None:
    result = verify_tree_greedy(_t([3]), _t([]), _t([]))
    assert (result.path.tolist(), result.tokens.tolist()) == ([], [3])


def test_tree_greedy_duplicate_siblings_longest_then_lowest_index() -> None:
    parents = _t([-1, -1, 1, 2])  # two root children with token 1; only node 1 has a subtree
    tokens = _t([1, 1, 2, 3])
    result = verify_tree_greedy(_t([1, 2, 2, 3, 4]), parents, tokens)
    assert result.path.tolist() == [1, 2, 3]  # the longer matching path, though node 0 is first
    assert result.tokens.tolist() == [1, 2, 3, 4]
    result = verify_tree_greedy(_t([1, 0, 0, 3, 4]), parents, tokens)
    assert result.path.tolist() == [0]  # equally long (1): the lowest index
    assert result.tokens.tolist() == [1, 0]


def _random_tree(rng: random.Random, n: int, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    parents = [rng.randrange(-1, i) if rng.random() < 0.8 else -1 for i in range(n)]
    return _t(parents), _t([rng.randrange(vocab) for _ in range(n)])


def _bigram_logits(seed: int) -> torch.Tensor:
    return torch.randn(V + 1, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _plain_tokens(logits: torch.Tensor, count: int, noise: PositionNoise | None) -> list[int]:
    """Plain decoding of the bigram target from START: the argmax, or the Gumbel-max token of
    each output position."""
    out, previous = [], START
    for position in range(count):
        g = None if noise is None else noise.gumbel(position, V)
        previous = gumbel_argmax(logits[previous], g)
        out.append(previous)
    return out


def _longest_matching_depth(
    parents: torch.Tensor, tokens: torch.Tensor, plain: list[int]
) -> int:
    """Brute force: the deepest node whose path spells a prefix of the plain tokens."""
    best = 0
    for node in range(tokens.numel()):
        path = tree_path(parents, node)
        if [int(tokens[j]) for j in path] == plain[: len(path)]:
            best = max(best, len(path))
    return best


def _tree_rows(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The target's rows of a tree over the bigram target: root (START), then after each node."""
    return logits[[START, *tokens.tolist()]]  # (n + 1, V)


def verify_tree_greedy_depth_rows(
    target_tokens: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor
) -> TreeVerifyResult:
    """BROKEN: verify_greedy ported to trees with chain indexing: a node of depth d is compared
    with target_tokens[d - 1] (the chain's row), not with its parent's row."""
    target, draft = target_tokens.tolist(), tokens.tolist()
    node, path = -1, list[int]()
    while True:
        depth = len(path)
        match = [
            j for j, parent in enumerate(parents.tolist())
            if parent == node and draft[j] == target[depth]
        ]
        if not match:
            return TreeVerifyResult(_t(path), _t([*(draft[j] for j in path), target[depth]]))
        node = match[0]
        path.append(node)


@pytest.mark.parametrize(
    ("verifier", "correct"),
    [(verify_tree_greedy, True), (verify_tree_greedy_depth_rows, False)],
)
def test_tree_greedy_is_plain_greedy_decoding_on_random_trees(
    verifier: Callable[..., TreeVerifyResult], correct: bool
) -> None:
    """Whatever the tree, the emitted tokens are plain greedy decoding's, and the accepted path
    is the longest that matches it (brute force over every node). The chain-indexed variant
    breaks it."""
    rng = random.Random(0)
    mismatches = 0
    for trial in range(300):
        logits = _bigram_logits(trial % 7)
        plain = _plain_tokens(logits, 12, None)
        parents, tokens = _random_tree(rng, rng.randrange(0, 10))
        if trial % 3 == 0 and tokens.numel() > 2:  # plant part of the plain path
            tokens[0], parents[0] = plain[0], -1
            tokens[1], parents[1] = plain[1], 0
        target = logits[[START, *tokens.tolist()]].argmax(dim=-1)  # (n + 1,)
        result = verifier(target, parents, tokens)
        emitted = result.tokens.tolist()
        mismatches += emitted != plain[: len(emitted)]
        if correct:
            assert result.num_accepted == _longest_matching_depth(parents, tokens, plain)
    assert (mismatches == 0) == correct, mismatches


def test_chain_shaped_tree_greedy_is_verify_greedy() -> None:
    rng = random.Random(1)
    for _ in range(100):
        k = rng.randrange(0, 6)
        draft = _t([rng.randrange(3) for _ in range(k)])
        target = _t([rng.randrange(3) for _ in range(k + 1)])
        chain = verify_greedy(target, draft)
        tree = verify_tree_greedy(target, _t(list(range(-1, k - 1))), draft)
        assert tree.tokens.tolist() == chain.tokens.tolist()
        assert tree.path.tolist() == list(range(chain.num_accepted))


# ---------------------------------------------------------------------------------------------
# The invariant rule
# ---------------------------------------------------------------------------------------------


def verify_tree_invariant_row_keyed(
    x: torch.Tensor,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    noise: Callable[[int], torch.Tensor],
) -> TreeVerifyResult:
    """BROKEN: verify_invariant ported to trees with the noise keyed by ROW (node index + 1), as
    a chain's rows are its positions; in a tree they are not."""
    children: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents.tolist()):
        children[i] = []
        children[parent].append(i)
    node, path = -1, []
    while True:
        target = gumbel_argmax(x[node + 1], noise(node + 1))
        match = [j for j in children[node] if int(tokens[j]) == target]
        if not match:
            break
        node = match[0]
        path.append(node)
    return TreeVerifyResult(_t(path), _t([*(int(tokens[j]) for j in path), target]))


@pytest.mark.parametrize(
    ("verifier", "correct"),
    [(verify_tree_invariant, True), (verify_tree_invariant_row_keyed, False)],
)
def test_tree_invariant_is_plain_seeded_decoding(
    verifier: Callable[..., TreeVerifyResult], correct: bool
) -> None:
    """Token identity with plain seeded decoding for every tree; the row-keyed variant breaks
    it (on trees only: on a chain rows are positions)."""
    rng = random.Random(2)
    mismatches = 0
    for trial in range(300):
        logits = _bigram_logits(trial % 5)
        noise = PositionNoise(seed=trial)
        plain = _plain_tokens(logits, 12, noise)
        n = rng.randrange(0, 10)
        parents, tokens = _random_tree(rng, n)
        for i in range(n):  # plant the plain path on some branch, so long matches happen
            depth = len(tree_path(parents, i))
            if rng.random() < 0.6:
                tokens[i] = plain[depth - 1]
        g = functools.partial(noise.gumbel, vocab_size=V)
        result = verifier(_tree_rows(logits, tokens), parents, tokens, g)
        emitted = result.tokens.tolist()
        mismatches += emitted != plain[: len(emitted)]
        if correct:
            assert result.num_accepted == _longest_matching_depth(parents, tokens, plain)
    assert (mismatches == 0) == correct, mismatches


def test_tree_invariant_asks_noise_only_for_the_depths_reached() -> None:
    logits = _bigram_logits(0)
    noise = PositionNoise(seed=5)
    plain = _plain_tokens(logits, 4, noise)
    wrong = (plain[1] + 1) % V
    parents, tokens = _t([-1, -1, 1]), _t([(plain[0] + 1) % V, plain[0], wrong])
    asked: list[int] = []

    def traced(d: int) -> torch.Tensor:
        asked.append(d)
        return noise.gumbel(d, V)

    result = verify_tree_invariant(_tree_rows(logits, tokens), parents, tokens, traced)
    assert result.tokens.tolist() == plain[:2]
    assert result.path.tolist() == [1]
    assert asked == [0, 1]


def test_chain_shaped_tree_invariant_is_verify_invariant() -> None:
    rng = random.Random(3)
    for trial in range(100):
        logits, noise = _bigram_logits(trial % 5), PositionNoise(seed=trial)
        k = rng.randrange(0, 6)
        plain = _plain_tokens(logits, k, noise)
        draft = _t([t if rng.random() < 0.7 else rng.randrange(V) for t in plain])
        x = _tree_rows(logits, draft)
        g = functools.partial(noise.gumbel, vocab_size=V)
        chain = verify_invariant(x, draft, g)
        tree = verify_tree_invariant(x, _t(list(range(-1, k - 1))), draft, g)
        assert tree.tokens.tolist() == chain.tokens.tolist()


# ---------------------------------------------------------------------------------------------
# The sampled rule: exact cases, and verify_chain on chains
# ---------------------------------------------------------------------------------------------


def test_verify_tree_on_one_hot_rows_is_greedy() -> None:
    target = [A, D, 4, 4, 1, 4, 2]
    p = _one_hot(target)  # (7, V)
    for q in (None, _one_hot(TOKENS.tolist())):
        for seed in range(5):
            result = verify_tree(p, PARENTS, TOKENS, q, torch.Generator().manual_seed(seed))
            assert (result.path.tolist(), result.tokens.tolist()) == ([0, 3], [A, D, 1])


def test_verify_tree_empty_tree_draws_from_p0() -> None:
    result = verify_tree(_one_hot([4]), _t([]), _t([]), None, None)
    assert (result.path.tolist(), result.tokens.tolist()) == ([], [4])


def test_verify_tree_zero_mass_residual_keeps_the_residual() -> None:
    """p <= q everywhere for the first sibling (p == q up to rounding): a rejection keeps r = p
    and the second sibling is verified against it, instead of dividing by zero."""
    p = torch.tensor([[0.4, 0.5, 0, 0, 0], [1.0, 0, 0, 0, 0], [0, 1.0, 0, 0, 0]])  # row 0: 0.9
    q = torch.tensor([[0.5, 0.5, 0, 0, 0], [0.5, 0.5, 0, 0, 0]])
    seen = set()
    for seed in range(100):
        result = verify_tree(p, _t([-1, -1]), _t([0, 1]), q, torch.Generator().manual_seed(seed))
        seen.add(tuple(result.path.tolist()))
        assert result.tokens.tolist()[0] in (0, 1)
    assert (1,) in seen  # the first sibling was rejected and the fallback residual used


def test_verify_tree_q_zero_on_a_node_uses_the_one_hot_rule() -> None:
    """q_j(x_j) = 0 for the first sibling: accepted with probability r(x_j) (0 here), its
    residual is r without x_j, and the second sibling is verified against that."""
    p = torch.tensor([[0, 0, 1.0, 0, 0], [1.0, 0, 0, 0, 0], [0, 1.0, 0, 0, 0]])
    q = torch.tensor([[0, 0.5, 0.5, 0, 0], [0, 0, 1.0, 0, 0]])
    for seed in range(10):
        result = verify_tree(p, _t([-1, -1]), _t([0, 2]), q, torch.Generator().manual_seed(seed))
        assert (result.path.tolist(), result.tokens.tolist()) == ([1], [2, 1])


def _random_rows(gen: torch.Generator, rows: int, scale: float) -> torch.Tensor:
    logits = torch.randn(rows, V, generator=gen) * scale  # (rows, V)
    logits[torch.rand(rows, V, generator=gen) < 0.2] = -torch.inf  # some zeros
    logits[:, 0] = logits[:, 0].clamp(min=-10.0)  # every row keeps some mass
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("q_kind", ["q", "none", "q_partly_zero", "q_equals_p"])
def test_chain_shaped_tree_is_verify_chain_draw_for_draw(q_kind: str) -> None:
    """On a chain, verify_tree consumes the same randomness and decides the same way as
    verify_chain: the same result for every seed (hence exactly verify_chain's law)."""
    gen = torch.Generator().manual_seed(4)
    for trial in range(150):
        k = trial % 5
        p = _random_rows(gen, k + 1, 2.0)  # (k + 1, V)
        q: torch.Tensor | None = _random_rows(gen, k, 2.0)  # (k, V)
        draft = torch.multinomial(p[:k] + 0.2, 1, generator=gen).squeeze(-1)  # (k,)
        if q_kind == "none":
            q = None
        elif q_kind == "q_partly_zero":
            assert q is not None
            q[torch.arange(k), draft] = 0.0
        elif q_kind == "q_equals_p":
            q = p[:k].clone()
        seed = 1000 + trial
        chain = verify_chain(p, q, draft, torch.Generator().manual_seed(seed))
        chain_tree = _t(list(range(-1, k - 1)))
        tree = verify_tree(p, chain_tree, draft, q, torch.Generator().manual_seed(seed))
        assert tree.tokens.tolist() == chain.tokens.tolist()
        assert tree.num_accepted == chain.num_accepted


def test_verify_tree_is_reproducible_with_a_seed() -> None:
    gen = torch.Generator().manual_seed(5)
    p = _random_rows(gen, 7, 1.0)
    q = _random_rows(gen, 6, 1.0)
    runs = []
    for seed in (7, 7, 8):
        g = torch.Generator().manual_seed(seed)
        runs.append([verify_tree(p, PARENTS, TOKENS, q, g).tokens.tolist() for _ in range(50)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# ---------------------------------------------------------------------------------------------
# Sibling rules (test-only), written independently of verify_tree: the exact oracle's and the
# broken verifiers'. A rule is how the residual r changes after a rejected sibling; acceptance
# is always min(1, r(x) / q(x)) (one-hot rule at q None or q(x) = 0), and the last token is
# drawn from r.
# ---------------------------------------------------------------------------------------------

# (p at the node, r, q of the rejected sibling or None, its token) -> the next r (normalised)
Update = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


def _normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = float(weights.sum())
    return weights / total if total > 0 else fallback / float(fallback.sum())


def _chain_residual(r: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    if q is None or float(q[x]) <= 0:
        rest = r.clone()
        rest[x] = 0.0
        return _normalise(rest, r)
    return _normalise(torch.clamp(r - q, min=0.0), r)


def correct_update(
    p: torch.Tensor, r: torch.Tensor, q: torch.Tensor | None, x: int
) -> torch.Tensor:
    """The rule verify_tree implements: r <- norm(max(0, r - q_j))."""
    return _chain_residual(r, q, x)


def not_updated(p: torch.Tensor, r: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """BROKEN: the residual is not updated after a rejected sibling (every sibling is tested
    against p, and p is drawn from when all are rejected)."""
    return r


def residual_from_p(
    p: torch.Tensor, r: torch.Tensor, q: torch.Tensor | None, x: int
) -> torch.Tensor:
    """BROKEN: the residual is not carried: each rejected sibling's residual is taken from p,
    norm(max(0, p - q_j)), instead of from the current r."""
    return _chain_residual(p, q, x)


def _acceptance(r: torch.Tensor, q: torch.Tensor | None, x: int) -> float:
    if q is None or float(q[x]) <= 0:
        return float(r[x])
    return min(1.0, float(r[x] / q[x]))


def sibling_law(
    update: Update, p: torch.Tensor, qs: list[torch.Tensor | None], xs: list[int]
) -> torch.Tensor:
    """Exact law of the token emitted at a node whose children drew xs (reported qs), (V,)."""
    out = torch.zeros(V, dtype=torch.float64)
    reach, r = 1.0, p.double() / float(p.sum())
    for q, x in zip(qs, xs, strict=True):
        q64 = None if q is None else q.double()
        accept = _acceptance(r, q64, x)
        out[x] += reach * accept
        reach *= 1.0 - accept
        r = update(p.double(), r, q64, x)
    return out + reach * r


def independent_chains_law(
    p: torch.Tensor, qs: list[torch.Tensor | None], xs: list[int]
) -> torch.Tensor:
    """Exact first-token law of `independent_chains_verifier` when the children are leaves:
    each child is accepted on its own against p; the first accepted wins; if none is, the first
    chain's recovered token."""
    out = torch.zeros(V, dtype=torch.float64)
    reach, p64 = 1.0, p.double() / float(p.sum())
    for q, x in zip(qs, xs, strict=True):
        accept = _acceptance(p64, None if q is None else q.double(), x)
        out[x] += reach * accept
        reach *= 1.0 - accept
    first_q = qs[0]
    return out + reach * _chain_residual(p64, None if first_q is None else first_q.double(), xs[0])


def rule_tree_verifier(update: Update) -> TreeVerifier:
    """A tree verifier built from a sibling rule (same contract as verify_tree)."""

    def verify(
        p: torch.Tensor,
        parents: torch.Tensor,
        tokens: torch.Tensor,
        q: torch.Tensor | None,
        generator: torch.Generator | None,
    ) -> TreeVerifyResult:
        parent_list, draft = parents.tolist(), tokens.tolist()
        node, path = -1, list[int]()
        while True:
            p_node = p[node + 1].double()
            r = p_node / float(p_node.sum())
            accepted = -1
            for j in (i for i, parent in enumerate(parent_list) if parent == node):
                q_j = None if q is None else q[j].double()
                u = float(torch.rand(1, generator=generator, dtype=torch.float64))
                if u < _acceptance(r, q_j, draft[j]):
                    accepted = j
                    break
                r = update(p_node, r, q_j, draft[j])
            if accepted < 0:
                last = int(sample(r, generator))
                return TreeVerifyResult(_t(path), _t([*(draft[j] for j in path), last]))
            node = accepted
            path.append(node)

    return verify


def independent_chains_verifier(
    p: torch.Tensor,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """BROKEN: siblings verified as if independent chains: verify_chain on every root-to-leaf
    path (each against p, its own uniforms, no residual carried between them), the longest
    accepted kept (the first on ties)."""
    parent_list = parents.tolist()
    leaves = [i for i in range(len(parent_list)) if i not in parent_list]
    best: TreeVerifyResult | None = None
    for leaf in leaves:
        path = tree_path(parents, leaf)
        rows = [0, *(j + 1 for j in path)]
        chain = verify_chain(p[rows], None if q is None else q[path], tokens[path], generator)
        if best is None or chain.num_accepted > best.num_accepted:
            best = TreeVerifyResult(_t(path[: chain.num_accepted]), chain.tokens)
    if best is None:  # no nodes
        return TreeVerifyResult(_t([]), sample(p[0], generator).reshape(1))
    return best


# ---------------------------------------------------------------------------------------------
# Toy tree drafters over bigram tables, row START is the distribution of the first token
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeCase:
    """A target, a tree drafter of one shape, and what it reports.

    mode "independent": every node drawn from sampled[its parent's token]; "without_replacement":
    siblings drawn in order without replacement from that row; "top": the children are the most
    likely distinct tokens of that row (no randomness). reported None: no q is reported (q =
    None); conditional=False (BROKEN with without_replacement): the unconditional row is reported
    for every sibling."""

    target: torch.Tensor  # (V + 1, V)
    sampled: torch.Tensor  # (V + 1, V)
    reported: torch.Tensor | None  # (V + 1, V)
    parents: tuple[int, ...]
    mode: str = "independent"
    conditional: bool = True

    def sibling_q(self, parent_token: int, earlier: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the row a sibling is drawn from, the row reported for it) after `earlier` siblings."""
        row = self.sampled[parent_token]
        reported = row if self.reported is None else self.reported[parent_token]
        if self.mode != "without_replacement":
            return row, reported
        return (
            without_replacement(row, earlier),
            without_replacement(reported, earlier) if self.conditional else reported,
        )

    def draft(
        self, previous: int, rng: random.Random
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (n,) and reported q (n, V) or None of one tree after the token `previous`."""
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i, parent in enumerate(self.parents):
            parent_token = previous if parent < 0 else tokens[parent]
            earlier = [tokens[j] for j in range(i) if self.parents[j] == parent]
            row, reported = self.sibling_q(parent_token, earlier)
            if self.mode == "top":
                order = torch.argsort(row, descending=True, stable=True).tolist()
                tokens.append(order[len(earlier)])
            else:
                tokens.append(_inverse_cdf(row.tolist(), rng.random()))
            rows.append(reported)
        q = None if self.reported is None or not rows else torch.stack(rows)
        if q is None and self.reported is not None:
            q = torch.zeros(0, V)
        return _t(tokens), q


def _inverse_cdf(weights: list[float], u: float) -> int:
    cumulative, total = [], 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    last_positive = max(i for i, w in enumerate(weights) if w > 0)
    return min(bisect.bisect_right(cumulative, u * total), last_positive)


def root_draws(case: TreeCase) -> list[tuple[float, list[int], list[torch.Tensor | None]]]:
    """Every draft of the root's children: (probability, tokens, reported q rows)."""
    m = sum(1 for parent in case.parents if parent < 0)
    draws: list[tuple[float, list[int], list[torch.Tensor | None]]] = [(1.0, [], [])]
    for _ in range(m):
        grown = []
        for prob, xs, qs in draws:
            row, reported = case.sibling_q(START, xs)
            q_row = None if case.reported is None else reported
            if case.mode == "top":
                order = torch.argsort(row, descending=True, stable=True).tolist()
                grown.append((prob, [*xs, order[len(xs)]], [*qs, q_row]))
                continue
            for x in range(V):
                if float(row[x]) > 0:
                    grown.append((prob * float(row[x]), [*xs, x], [*qs, q_row]))
        draws = grown
    return draws


SiblingLaw = Callable[[torch.Tensor, list[torch.Tensor | None], list[int]], torch.Tensor]


def exact_first_token(case: TreeCase, law: SiblingLaw) -> torch.Tensor:
    """Exact law of the first emitted token, (V,): the root's children's drafts enumerated."""
    p = case.target[START]
    out = torch.zeros(V, dtype=torch.float64)
    for prob, xs, qs in root_draws(case):
        out += prob * law(p, qs, xs)
    return out


def _law(update: Update) -> SiblingLaw:
    return lambda p, qs, xs: sibling_law(update, p, qs, xs)


@dataclass(frozen=True)
class Audit:
    first_p_value: float  # chi-square GOF of the first token against the target
    pair_p_value: float  # chi-square GOF of the first two tokens against the target
    first_step_accept_rate: float  # fraction of first steps accepting >= 1 node


def audit(case: TreeCase, verifier: TreeVerifier, n: int, seed: int) -> Audit:
    """Decode the first two tokens n times (tree steps until two are emitted)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    parents = _t(list(case.parents))
    pair_counts = [0] * (V * V)
    first_step_accepts = 0
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            previous = out[-1] if out else START
            tokens, q = case.draft(previous, rng)
            p = case.target[[previous, *tokens.tolist()]]  # (n + 1, V)
            result = verifier(p, parents, tokens, q, gen)
            first_step_accepts += int(not out and result.num_accepted > 0)
            out += result.tokens.tolist()
        pair_counts[out[0] * V + out[1]] += 1
    counts = torch.tensor(pair_counts, dtype=torch.float64)
    first = case.target[START]  # (V,)
    joint = (first[:, None] * case.target[:V]).reshape(-1)  # (V * V,)
    return Audit(
        chi_square_gof(counts.view(V, V).sum(dim=1), first).p_value,
        chi_square_gof(counts, joint).p_value,
        first_step_accepts / n,
    )


def _table(
    seed: int, scale: float, start: list[float], zero_columns: tuple[int, ...] = ()
) -> torch.Tensor:
    """A (V + 1, V) table of random rows (softmax of N(0, scale^2) logits) with `zero_columns`
    impossible everywhere and the hand-built first-token distribution `start`."""
    logits = torch.randn(V + 1, V, generator=torch.Generator().manual_seed(seed)) * scale
    logits[:, list(zero_columns)] = -torch.inf
    table = torch.softmax(logits, dim=-1)
    table[START] = torch.tensor(start)
    return table


# hand-built first-token distributions: the broken variants' first-token gaps depend on these
P_START = [0.3, 0.3, 0.3, 0.05, 0.05]
Q_FAR_START = [0.0, 0.05, 0.15, 0.3, 0.5]  # little mass where p has much, and the reverse
Q_NEAR_START = [0.3, 0.2, 0.3, 0.1, 0.1]
TARGET = _table(1, 1.5, P_START)
FAR = _table(2, 1.5, Q_FAR_START)
NEAR = _table(3, 1.0, Q_NEAR_START)
WIDE = (-1, -1, -1)
TWO_BY_TWO = (-1, -1, 0, 0, 1, 1)
RAGGED = (-1, -1, -1, 0, 0, 2)

CORRECT_CASES: dict[str, TreeCase] = {
    "wide_far": TreeCase(TARGET, FAR, FAR, WIDE),
    "two_by_two_near": TreeCase(TARGET, NEAR, NEAR, TWO_BY_TWO),
    "ragged_far": TreeCase(TARGET, FAR, FAR, RAGGED),
    "wide_without_replacement_far": TreeCase(TARGET, FAR, FAR, WIDE, "without_replacement"),
    "two_by_two_without_replacement_near": TreeCase(
        TARGET, NEAR, NEAR, TWO_BY_TWO, "without_replacement"
    ),
    # deterministic trees (e.g. several n-gram matches): no q, the one-hot rule per sibling
    "top_tokens_no_q_ragged": TreeCase(TARGET, FAR, None, RAGGED, "top"),
    "sampled_but_no_q_reported_two_by_two": TreeCase(TARGET, FAR, None, TWO_BY_TWO),
    "q_equals_p_wide": TreeCase(TARGET, TARGET, TARGET, WIDE),
    "q_zero_where_p_has_mass_ragged": TreeCase(
        TARGET, _table(4, 1.0, [0, 0, 0.3, 0.3, 0.4], (0, 1)), None, RAGGED
    ),
}

BROKEN_CASES: dict[str, tuple[TreeCase, TreeVerifier, SiblingLaw]] = {
    "siblings_as_independent_chains": (
        TreeCase(TARGET, FAR, FAR, WIDE),
        independent_chains_verifier,
        independent_chains_law,
    ),
    "residual_not_updated_after_rejection": (
        TreeCase(TARGET, FAR, FAR, WIDE),
        rule_tree_verifier(not_updated),
        _law(not_updated),
    ),
    "residual_from_p_not_carried": (
        TreeCase(TARGET, FAR, FAR, WIDE),
        rule_tree_verifier(residual_from_p),
        _law(residual_from_p),
    ),
    # siblings drawn without replacement, but the unconditional q reported for each
    "without_replacement_unconditional_q": (
        TreeCase(TARGET, FAR, FAR, WIDE, "without_replacement", conditional=False),
        verify_tree,
        _law(correct_update),
    ),
}


def test_audit_sample_size_is_moderate() -> None:
    assert 1000 < N_AUDIT < 5000  # keeps the file fast; see the module docstring


@pytest.mark.parametrize("name", sorted(CORRECT_CASES))
def test_verify_tree_output_distribution_is_the_targets(name: str) -> None:
    case = CORRECT_CASES[name]
    exact = exact_first_token(case, _law(correct_update))  # the rule: exactly lossless
    assert torch.allclose(exact, case.target[START].double(), atol=1e-6)
    result = audit(case, verify_tree, N_AUDIT, seed=1000 + len(name))
    assert result.first_p_value > FALSE_ALARM
    assert result.pair_p_value > FALSE_ALARM


@pytest.mark.parametrize("name", sorted(BROKEN_CASES))
def test_audit_catches_broken_tree_variant(name: str) -> None:
    case, verifier, law = BROKEN_CASES[name]
    gap = tv_distance(exact_first_token(case, law), case.target[START])
    assert gap >= DESIGN_TV  # so N_AUDIT gives the audit power >= POWER on this variant
    result = audit(case, verifier, N_AUDIT, seed=2000 + len(name))
    assert result.first_p_value < FALSE_ALARM
    assert result.pair_p_value < FALSE_ALARM


def test_rule_tree_verifier_with_the_correct_rule_passes_the_audit() -> None:
    """The broken variants fail because of their rule, not because of the harness."""
    result = audit(CORRECT_CASES["wide_far"], rule_tree_verifier(correct_update), N_AUDIT, 3000)
    assert min(result.first_p_value, result.pair_p_value) > FALSE_ALARM


def test_acceptance_rises_with_siblings() -> None:
    """What a tree is for: with three siblings drawn from the same q the first step accepts
    more often than a chain (one child). Exact: 1 - P(all rejected) from the oracle."""
    one = exact_first_token(TreeCase(TARGET, FAR, FAR, (-1,)), _law(correct_update))
    assert torch.allclose(one, TARGET[START].double(), atol=1e-6)

    def accept_rate(parents: tuple[int, ...]) -> float:
        case = TreeCase(TARGET, FAR, FAR, parents)
        total = 0.0
        for prob, xs, qs in root_draws(case):
            reach, r = 1.0, TARGET[START].double()
            for q, x in zip(qs, xs, strict=True):
                assert q is not None
                reach *= 1.0 - _acceptance(r, q.double(), x)
                r = correct_update(r, r, q.double(), x)
            total += prob * (1.0 - reach)
        return total

    assert accept_rate(WIDE) > accept_rate((-1,)) + 0.1
