"""Token trees in the engine: scored under a tree mask in one forward, verified, the accepted
path's KV compacted. Greedy output is token-identical to plain decoding at batch 1 and in a
BatchEngine; sampled output has the target's exact distribution (chi-square against the
enumerated first two tokens); broken variants (KV not compacted, siblings verified as
independent chains, residual not updated after a rejected sibling) fail."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch

import specdecode.verification as verification
from specdecode.drafters.base import EMPTY, Draft, Drafter, DraftRequest
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import BatchEngine, Generation, fit_width, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models.cache import KVCache
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from specdecode.sampling import SamplingParams, probs_from_logits, sample
from specdecode.trees import best_path, chain_confidences, keep_best, layout
from specdecode.verify import without_replacement
from tests.conftest import make_checkpoint
from tests.identity import assert_identical
from tests.test_engine_sampled import (
    FALSE_ALARM,
    PARAMS,
    PROMPT,
    SAMPLES,
    SMALL,
    exact_pairs,
    gof_p_value,
)
from tests.test_verify_tree import independent_chains_verifier, not_updated, rule_tree_verifier

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ([5, 7, 3, 8, 11, 2], [1, 2, 3], [40, 41, 9, 9, 9, 17, 30, 2, 5, 60])
TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(tiny target, tiny draft) of vocabulary 96 for greedy; (target, draft) of vocabulary
    16 for the distribution tests."""
    root = tmp_path_factory.mktemp("tree-models")
    out = []
    for name, seed, overrides in (("t96", 3, {}), ("d96", 4, {"num_hidden_layers": 1}),
                                  ("t16", 6, {**SMALL, "num_hidden_layers": 2, "scale": 4.0}),
                                  ("d16", 7, {**SMALL, "num_hidden_layers": 1, "scale": 8.0})):
        folder = make_checkpoint(root / name, seed=seed, **overrides)
        out.append(load_native(folder, config_from_hf(read_hf_config(folder))))
    return out


class OracleTree(Drafter):
    """A tree built around a known continuation: at every depth a wrong sibling FIRST, then the
    right token, whose subtree continues (a wrong leaf under it too). The accepted path is never
    the first branch, so its nodes are not contiguous: a wrong commit of the KV shows."""

    name = "oracle-tree"
    max_nodes = 24

    def __init__(self, script: list[int], prompt_len: int, vocab: int) -> None:
        self.script, self.prompt_len, self.vocab = script, prompt_len, vocab
        self.branched = 0

    def propose(self, request: DraftRequest) -> Draft:
        done = len(request.context) - self.prompt_len
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for d in range(min(request.k, 5)):
            right = self.script[done + d] if done + d < len(self.script) else 0
            tokens += [(right + 1 + d) % self.vocab, right]
            parents += [parent, parent]
            parent = len(tokens) - 1
        self.branched += 1
        return Draft(torch.tensor(tokens), None, None, torch.tensor(parents))


def plain_output(model: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    gen = Generation(model, None, prompt, params)
    for _ in gen.run():
        pass
    return gen.output


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_greedy_tree_is_token_identical_at_batch_1(models: Any, k: int) -> None:
    target = models[0]
    params = SamplingParams(max_tokens=TOKENS)
    for prompt in PROMPTS:
        expected = plain_output(target, prompt, params)
        drafter = OracleTree(expected, len(prompt), 96)
        gen = Generation(target, None, prompt, params, drafter, k)
        for _ in gen.run():
            pass
        assert_identical([gen], [expected], f"oracle tree k={k}")
        # every step accepted its whole right path (depth min(k, 5)): trees really ran
        assert gen.counters.steps <= -(-TOKENS // (min(k, 5) + 1)) + 1


def test_greedy_tree_with_penalties_reads_each_nodes_own_path(models: Any) -> None:
    """Penalties count the tokens of a node's own path, not its siblings'
    (verification.tree_logits): with a repetition penalty the oracle's wrong siblings would
    otherwise move the argmax."""
    target = models[0]
    params = SamplingParams(max_tokens=TOKENS, repetition_penalty=1.8, frequency_penalty=0.7)
    prompt = PROMPTS[2]
    expected = plain_output(target, prompt, params)
    gen = Generation(target, None, prompt, params, OracleTree(expected, len(prompt), 96), 4)
    for _ in gen.run():
        pass
    assert_identical([gen], [expected], "penalties")


def _no_compaction(self: KVCache, row: int, start: int, indices: torch.Tensor) -> None:
    """Broken variant: keep the accepted path's length but not its slots (a chain's
    rollback), leaving the first branch's KV where the path's should be."""
    self.lengths[row] = start + int(indices.numel())


def test_kv_not_compacted_breaks_identity(models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    target = models[0]
    params = SamplingParams(max_tokens=TOKENS)
    monkeypatch.setattr(KVCache, "keep", _no_compaction)
    differ = 0
    for prompt in PROMPTS:
        expected = plain_output(target, prompt, params)
        gen = Generation(target, None, prompt, params, OracleTree(expected, len(prompt), 96), 4)
        for _ in gen.run():
            pass
        differ += gen.output != expected
    assert differ >= 2


def test_greedy_trees_in_a_batch_are_token_identical(models: Any) -> None:
    """Three rows of one forward: two trees of different shapes beside a plain row and a chain
    row, with joins; no row moves another."""
    from tests.fakes import ScriptedDrafter

    target = models[0]
    params = SamplingParams(max_tokens=TOKENS)
    prompts = [*PROMPTS, [9, 8, 7, 6, 5, 4, 3]]
    expected = [plain_output(target, p, params) for p in prompts]
    drafters: list[Drafter | None] = [
        OracleTree(expected[0], len(prompts[0]), 96), None,
        ScriptedDrafter(expected[2], len(prompts[2]), "partial", right_for=2, vocab=96),
        OracleTree(expected[3], len(prompts[3]), 96)]
    ks = [4, 0, 3, 2]
    gens = [Generation(target, None, p, params, d, k)
            for p, d, k in zip(prompts, drafters, ks, strict=True)]
    run_batch(BatchEngine(target, 3, 64), gens)  # 3 rows for 4 requests: one joins later
    assert_identical(gens, expected, "trees in a batch")


def test_a_target_without_tree_masks_verifies_the_best_path(models: Any) -> None:
    target = models[0]
    params = SamplingParams(max_tokens=TOKENS)
    prompt = PROMPTS[0]
    expected = plain_output(target, prompt, params)

    class NoTrees:  # the same runner, declaring no tree support
        supports_trees = False

        def __init__(self, inner: Any) -> None:
            self.inner, self.cfg = inner, inner.cfg

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def __call__(self, tokens: torch.Tensor, cache: Any, **kw: Any) -> torch.Tensor:
            assert kw.get("tree_mask") is None
            return self.inner(tokens, cache, **kw)

    gen = Generation(NoTrees(target), None, prompt, params,
                     OracleTree(expected, len(prompt), 96), 4)
    assert not gen.trees
    for _ in gen.run():
        pass
    assert gen.output == expected


class Malformed(OracleTree):
    def __init__(self, parents: list[int], tokens: list[int], max_nodes: int = 24) -> None:
        super().__init__([], 0, 96)
        self.parents, self.tokens, self.max_nodes = parents, tokens, max_nodes

    def propose(self, request: DraftRequest) -> Draft:
        return Draft(torch.tensor(self.tokens), None, None, torch.tensor(self.parents))


@pytest.mark.parametrize("parents,tokens,max_nodes,message", [
    ([1, -1], [3, 4], 24, "parent must be -1"),
    ([-1, 0, 0], [3, 4, 999], 24, "tokens must be in 0..95"),
    ([-1, 0, 1], [3, 4, 5], 2, "exceed its max_nodes of 2"),
    ([0], [3], 24, "parent must be -1"),  # a node its own parent: a cycle
])
def test_malformed_trees_are_refused_before_scoring(
    models: Any, parents: list[int], tokens: list[int], max_nodes: int, message: str
) -> None:
    target = models[0]
    calls: list[int] = []
    gen = Generation(target, None, [1, 2, 3], SamplingParams(max_tokens=4),
                     Malformed(parents, tokens, max_nodes), 4)
    gen.prefill()
    forward = target.forward
    def counting(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return forward(*a, **kw)

    target.forward = counting
    try:
        with pytest.raises(SpecDecodeError, match=message) as e:
            gen.step()
        assert "oracle-tree drafter proposed a malformed token tree" in str(e.value)
        assert calls == []
    finally:
        del target.forward


def test_layout_positions_and_mask() -> None:
    # unfed 2 (pending + a forced token), tree: a, b (siblings), c under b; padded to 6
    offsets, block = layout(torch.tensor([-1, -1, 1]), 2, 6)
    assert offsets.tolist() == [0, 1, 2, 2, 3, 5]
    assert block[2].tolist() == [True, True, True, False, False, False]
    assert block[3].tolist() == [True, True, False, True, False, False]
    assert block[4].tolist() == [True, True, False, True, True, False]
    assert block[:2].tolist() == torch.ones(6, 6, dtype=torch.bool).tril()[:2].tolist()


def _tree(parents: list[int], conf: list[float]) -> Draft:
    return Draft(torch.arange(10, 10 + len(parents)), None, tuple(conf),
                 torch.tensor(parents))


def test_keep_best_and_best_path_follow_path_probabilities() -> None:
    # root children: 0 (0.3), 1 (0.6); under 1: 2 (0.9), 3 (0.05); under 2: 4 (0.5)
    draft = _tree([-1, -1, 1, 1, 2], [0.3, 0.6, 0.9, 0.05, 0.5])
    kept = keep_best(draft, 3)  # path probabilities 0.3, 0.6, 0.54, 0.03, 0.27
    assert kept.tokens.tolist() == [10, 11, 12] and kept.parents is not None
    assert kept.parents.tolist() == [-1, -1, 1]
    path = best_path(draft)
    assert path.parents is None and path.tokens.tolist() == [11, 12, 14]
    # the keeping order's expected gain, as best_width weighs a chain
    conf = chain_confidences(draft)
    products = torch.tensor(conf).cumprod(0).tolist()
    assert products == pytest.approx([0.6, 0.54, 0.3, 0.27, 0.03])


def test_fit_width_keeps_the_tree_nodes_that_pay() -> None:
    from specdecode.control import CostModel

    costs = CostModel({(1, t): 1.0 + 0.1 * (t - 1) for t in range(1, 40)})
    likely = _tree([-1, 0, 1, 2], [0.95, 0.95, 0.95, 0.95])
    unlikely = _tree([-1, -1, -1, 0], [0.02, 0.01, 0.01, 0.01])
    assert len(fit_width([likely], costs)[0].tokens) == 4
    assert len(fit_width([unlikely], costs)[0].tokens) == 0
    mixed = _tree([-1, -1, 0, 1, 2], [0.9, 0.05, 0.9, 0.05, 0.9])
    kept = fit_width([mixed], costs)[0]
    assert kept.tokens.tolist() == [10, 12, 14]  # the likely branch, as a chain


class TreeSampler(Drafter):
    """A sampled tree from a draft model: `branching[d]` children per node at depth d, drawn
    from the draft's q at that node WITHOUT replacement (each node's q row is its law given
    its earlier siblings: verify.without_replacement), as verify_tree requires."""

    name = "tree-sampler"

    def __init__(self, model: Any, branching: tuple[int, ...]) -> None:
        self.model, self.branching = model, branching
        self.max_nodes = sum(int(torch.tensor(branching[: d + 1]).prod())
                             for d in range(len(branching)))

    def _q(self, history: torch.Tensor, request: DraftRequest) -> torch.Tensor:
        logits = self.model(history[None], self.model.new_cache(1, len(history) + 1))[0, -1:]
        return probs_from_logits(logits, request.params, history, request.prompt_len, EMPTY)[0]

    def propose(self, request: DraftRequest) -> Draft:
        tokens: list[int] = []
        parents: list[int] = []
        qs: list[torch.Tensor] = []
        frontier = [(-1, request.context)]
        for width in self.branching[: request.k]:
            following = []
            for parent, history in frontier:
                q, drawn = self._q(history, request), list[int]()
                for _ in range(width):
                    if drawn and float(q.sum() - q[drawn].sum()) <= 1e-6:
                        break  # nothing left to draw
                    row = without_replacement(q, drawn) if drawn else q
                    tok = int(sample(row, request.generator))
                    drawn.append(tok)
                    tokens.append(tok)
                    parents.append(parent)
                    qs.append(row)
                    following.append((len(tokens) - 1, torch.cat([history, torch.tensor([tok])])))
            frontier = following
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(qs), None,
                     torch.tensor(parents))


def tree_pairs(target: Any, make: Any, k: int, n: int, params: SamplingParams = PARAMS
               ) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(n):
        p = dataclasses.replace(params, seed=20_000 + seed)
        gen = Generation(target, None, PROMPT, p, make(), k)
        for _ in gen.run():
            pass
        counts[(gen.output[0], gen.output[1])] += 1
    return counts


@pytest.mark.statistical
@pytest.mark.parametrize("branching", [(3,), (2, 2)])
def test_sampled_tree_matches_target_distribution(models: Any, branching: tuple[int, ...]
                                                  ) -> None:
    target, draft = models[2], models[3]
    counts = tree_pairs(target, lambda: TreeSampler(draft, branching), len(branching), SAMPLES)
    assert gof_p_value(counts, exact_pairs(target, PARAMS)) > FALSE_ALARM


@pytest.mark.statistical
@pytest.mark.parametrize("broken", ["independent-chains", "residual-not-updated"])
def test_broken_tree_verifiers_are_rejected(models: Any, broken: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = models[2], models[3]
    verifier = independent_chains_verifier if broken == "independent-chains" else \
        rule_tree_verifier(not_updated)
    monkeypatch.setattr(verification, "verify_tree", verifier)
    counts = tree_pairs(target, lambda: TreeSampler(draft, (3,)), 1, SAMPLES)
    assert gof_p_value(counts, exact_pairs(target, PARAMS)) < FALSE_ALARM


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, max_tokens=TOKENS),
    SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.3, max_tokens=TOKENS),
])
def test_invariant_rule_tree_is_plain_seeded_output(models: Any, params: SamplingParams) -> None:
    """Rule "invariant": a sampled tree's output is plain seeded decoding's, token for token."""
    target, draft = models[0], models[1]
    gens, expected = [], []
    for seed in range(6):
        p = dataclasses.replace(params, seed=seed)
        expected.append(plain_output(target, PROMPTS[seed % 3], p))
        gens.append(Generation(target, None, PROMPTS[seed % 3], p,
                               TreeSampler(draft, (2, 2, 1)), 3))
        for _ in gens[-1].run():
            pass
    assert_identical(gens, expected, "sampled trees, rule invariant")


class Branches(DraftModelDrafter):
    """A draft model with sibling leaves, counting the drafts that branched."""

    def __init__(self, model: Any, in_cache: bool = False) -> None:
        super().__init__(model, "draft-model", 256, in_cache=in_cache, siblings=True,
                         sibling_range=(0.0, 0.6))  # the tiny models are near uniform
        self.branched = 0

    def observe_result(self, draft: Draft, num_accepted: int, committed: list[int]) -> None:
        self.branched += draft.parents is not None


def test_draft_model_sibling_leaves_are_token_identical(models: Any) -> None:
    """Greedy: a draft model proposing its second choice beside every token it is unsure of,
    drafting in its own cache (batch 1) and in the target's (a batch's rows, one forward per
    draft position), is plain greedy decoding token for token; branching really occurred."""
    target = models[0]
    params = SamplingParams(max_tokens=TOKENS)
    expected = [plain_output(target, p, params) for p in PROMPTS]
    # the target's weights drafting in a cache of their own: a draft that agrees with the
    # target, so accepted paths run (the tiny random draft model has nothing accepted here)
    made = [Branches(target) for _ in PROMPTS]
    alone = [Generation(target, None, prompt, params, d, 4)
             for prompt, d in zip(PROMPTS, made, strict=True)]
    for gen in alone:
        for _ in gen.run():
            pass
    assert_identical(alone, expected, "sibling leaves, batch 1")
    in_cache = [Branches(target, in_cache=True) for _ in PROMPTS]
    gens = [Generation(target, None, p, params, d, 3)
            for p, d in zip(PROMPTS, in_cache, strict=True)]
    run_batch(BatchEngine(target, 3, 64), gens)
    assert_identical(gens, expected, "sibling leaves in the target's cache, batch 3")
    assert sum(d.branched for d in made) > 5 and sum(d.branched for d in in_cache) > 0


@pytest.mark.statistical
def test_draft_model_sibling_leaves_match_target_distribution(models: Any) -> None:
    target, draft = models[2], models[3]
    counts = tree_pairs(target, lambda: Branches(draft), 2, SAMPLES)
    assert gof_p_value(counts, exact_pairs(target, PARAMS)) > FALSE_ALARM


def test_draft_model_sibling_leaves_invariant_rule_is_plain_seeded(models: Any) -> None:
    target, draft = models[0], models[1]
    params = SamplingParams(temperature=0.9, max_tokens=TOKENS)
    gens, expected = [], []
    for seed in range(4):
        p = dataclasses.replace(params, seed=seed)
        expected.append(plain_output(target, PROMPTS[seed % 3], p))
        gens.append(Generation(target, None, PROMPTS[seed % 3], p, Branches(draft), 3))
        for _ in gens[-1].run():
            pass
    assert_identical(gens, expected, "sampled sibling leaves, rule invariant")


def test_suffix_hybrid_is_token_identical_and_forwards_its_store(models: Any) -> None:
    """suffix+X: the suffix lookup's trees where it expects to pay, else the model's chain;
    greedy output is plain's, both parts draft (the second round of prompts finds the first in
    the store), and the factory exposes the store while drafters forward their scope and
    discard to the lookup (server isolation, memory reports)."""
    from specdecode.drafters.hybrid import HybridDrafter, HybridFactory
    from specdecode.drafters.suffix import SuffixFactory
    from specdecode.suffix import SuffixStore

    target, draft = models[0], models[1]
    lookups = SuffixFactory(SuffixStore(1.0, 100))
    factory = HybridFactory(lookups, lambda: DraftModelDrafter(draft), "suffix+draft-model")
    assert factory.store is lookups.store
    params = SamplingParams(max_tokens=TOKENS)
    used = [0, 0]
    for _ in range(2):
        for prompt in PROMPTS:
            expected = plain_output(target, prompt, params)
            hybrid = factory()
            hybrid.isolation_key = "alice"
            assert hybrid.lookup.isolation_key == "alice"  # type: ignore[attr-defined]
            assert hybrid.tree_nodes(4) == hybrid.lookup.tree_nodes(4) > 0
            gen = Generation(target, None, prompt, params, hybrid, 4)
            assert gen.trees
            for _ in gen.run():
                pass
            assert_identical([gen], [expected], "suffix+draft-model", require_accepted=False)
            used = [u + v for u, v in zip(used, hybrid.used, strict=True)]
            gen.release()  # stores the request under "alice"
    assert used[0] > 0 and used[1] > 0
    assert len(lookups.store) == len(PROMPTS) * 2
    discarded = factory()
    assert isinstance(discarded, HybridDrafter)
    gen = Generation(target, None, PROMPTS[0], params, discarded, 4)
    gen.step()
    discarded.discard()
    gen.release()
    assert len(lookups.store) == len(PROMPTS) * 2  # a discarded request is not stored
