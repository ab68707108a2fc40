"""The cross-tokenizer drafter (xtok): text sync and boundary rules on SmolLM2's tokenizer, greedy
identity with plain decoding for k = 1..8 on small checkpoints with different tokenizers,
acceptance of a drafter that is right and of deliberately broken variants, and the sampled-mode
distribution audit (shared with test_drafters_ngram.py).

The tiny pair: the target is test_drafters_ngram's random checkpoint (vocabulary 96) under a
word-level tokenizer over the words t0..t95 (text like "t10 t45 t7"); drafts tokenize the same
text differently: a character-level BPE ("t4", "5", " ", ...; 23 tokens, a different vocabulary
size) or the target's own words under permuted ids (the target's weights permuted to match, so the
draft proposes the target's greedy continuation through a different tokenizer).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from specdecode.drafters.base import Draft, Drafter, DraftRequest
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.drafters.xtok import (
    MAX_TAIL_CHARS,
    DraftText,
    XtokDrafter,
    last_word_start,
    splits_at_spaces,
    text_increment,
)
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel, converted_folder
from specdecode.models.paths import default_model_path
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.identity import assert_identical
from tests.test_drafters_ngram import FALSE_ALARM, V, audit, tiny_model

PROMPT = [10, 20, 30, 40, 50]  # "t10 t20 t30 t40 t50"
Model = Any  # a native runner (models.llama.LlamaModel)
CHARS = [" ", "t"] + [str(d) for d in range(10)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


# ---------------------------------------------------------------------------------------------
# Tokenizers and checkpoints of the tiny pair
# ---------------------------------------------------------------------------------------------


def save_tokenizer(tok: HFTokenizer, folder: Path, eos: str | None) -> Tokenizer:
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": eos} if eos else {}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(folder)


def word_tokenizer(folder: Path, order: list[int] | None = None) -> Tokenizer:
    """Words t0..t{V-1}; word ti has id order[i] (default i). Decoding joins words with spaces."""
    ids = order if order is not None else list(range(V))
    tok = HFTokenizer(models.WordLevel(vocab={f"t{i}": ids[i] for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return save_tokenizer(tok, folder, None)


def char_tokenizer(folder: Path) -> Tokenizer:
    """Character-level BPE over ' ', 't', '0'..'9' with merges 't1'..'t9' and ' t', plus '<eos>':
    23 tokens; ' t45' is ' ', 't4', '5'. Decoding concatenates."""
    vocab = {c: i for i, c in enumerate(CHARS)}
    merges = [("t", str(d)) for d in range(1, 10)] + [(" ", "t")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<eos>"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.decoder = decoders.Fuse()
    return save_tokenizer(tok, folder, "<eos>")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Tokenizer]:
    folder = tmp_path_factory.mktemp("target")
    model = tiny_model(folder)
    return model, word_tokenizer(folder)


@pytest.fixture(scope="module")
def char_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random checkpoint over the character tokenizer (its own vocabulary of 23)."""
    folder = make_checkpoint(tmp_path_factory.mktemp("chars"), seed=1, vocab_size=23)
    char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def permuted_draft(
    target: tuple[Model, Tokenizer], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Model, Tokenizer]:
    """The target's weights under a word tokenizer with permuted ids: same text, other ids."""
    model, _ = target
    order = list(range(V))
    random.Random(7).shuffle(order)  # word ti has draft id order[i]
    inverse = torch.tensor(sorted(range(V), key=lambda i: order[i]))  # draft id -> target id
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.embed.weight = torch.nn.Parameter(model.embed.weight[inverse].clone())
        draft.lm_head.weight = torch.nn.Parameter(model.lm_head.weight[inverse].clone())
    return draft, word_tokenizer(tmp_path_factory.mktemp("permuted"), order)


def plain(model: Model, max_tokens: int) -> list[int]:
    return generate(model, max_tokens, None, 0).output


def generate(
    model: Model, max_tokens: int, drafter: Drafter | None, k: int
) -> Generation:
    gen = Generation(model, None, PROMPT, SamplingParams(max_tokens=max_tokens), drafter, k)
    for _ in gen.run():
        pass
    return gen


# ---------------------------------------------------------------------------------------------
# Text sync and boundaries on a real byte-level BPE (SmolLM2's tokenizer)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tok() -> Tokenizer:
    return Tokenizer(converted_folder(default_model_path()))


TEXT = "Héllo wörld — 日本語のテキスト 😀 and  two  spaces,\n\nnew lines; x=12345 ok."


def test_incremental_text_is_the_full_decode(smol_tok: Tokenizer) -> None:
    ids = smol_tok.encode(TEXT)
    rng = random.Random(0)
    for _ in range(20):
        text, done, held = "", 0, 0
        end = 0
        while end < len(ids):
            end = min(len(ids), end + rng.randint(1, 4))
            inc = text_increment(smol_tok, ids[:end], done)
            if inc is None:  # inside a multi-byte character: wait for its last bytes
                held += 1
                continue
            text, done = text + inc, end
        assert done == len(ids) and text == TEXT
    assert held > 0  # the emoji and CJK characters span several byte tokens


def test_draft_text_is_encoded_in_pieces_as_a_whole(smol_tok: Tokenizer) -> None:
    assert splits_at_spaces(smol_tok)
    english = "The quick brown fox jumps over the lazy dog, and then it runs away.\n" * 3
    rng = random.Random(1)
    dt, pos = DraftText(smol_tok, incremental=True), 0
    while pos < len(english):
        step = rng.randint(1, 9)
        dt.extend(english[pos : pos + step])
        pos += step
        assert smol_tok.decode(dt.ids) == english[:pos]
    assert dt.ids == smol_tok.encode(english)
    assert dt.stable_chars > len(english) - 10  # only the last word is re-encoded


def test_a_tail_without_whitespace_is_split_and_stays_exact(smol_tok: Tokenizer) -> None:
    text = "".join(str(i % 10) + chr(97 + i % 26) for i in range(400))  # 800 characters
    dt = DraftText(smol_tok, incremental=True)
    for i in range(0, len(text), 7):
        dt.extend(text[i : i + 7])
    assert smol_tok.decode(dt.ids) == text
    assert dt.stable_chars > 0 and len(text) - dt.stable_chars <= MAX_TAIL_CHARS


def test_a_tokenizer_that_prepends_a_space_is_re_encoded_whole(tmp_path: Path) -> None:
    """Llama-2-style normalizers prepend '▁' to every encoded string, so pieces cut before a
    space encode differently: the draft side then re-encodes its whole text."""
    chars = sorted(set("Hello world, it is 12 o'clock.the quick brown fox".replace(" ", "▁")))
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    prepending = save_tokenizer(tok, tmp_path, None)
    assert not splits_at_spaces(prepending)
    drafter = XtokDrafter(DraftModelDrafter(None), prepending, prepending)
    assert not drafter.incremental
    for piece in ("the quick", " brown", " fox"):
        drafter.draft.extend(piece)
    assert drafter.draft.ids == prepending.encode("the quick brown fox")


class ShoutingTokenizer:
    """Characters a..z as ids 0..25, whose decode upper-cases the text once it is longer than 5
    characters: a decoder that is not prefix-stable (tests only)."""

    eos_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 97 for c in text.lower() if c.isalpha()]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        text = "".join(chr(97 + i) for i in ids)
        return text.upper() if len(text) > 5 else text


def test_a_decoder_that_rewrites_earlier_text_restarts_the_draft_text() -> None:
    tok = cast(Tokenizer, ShoutingTokenizer())
    drafter = XtokDrafter(DraftModelDrafter(None), tok, tok, incremental=True)
    for n in (3, 4, 8):
        assert drafter._sync(list(range(n)))
        assert drafter.draft.text == tok.decode(list(range(n)))


def test_boundary_keeps_only_final_target_tokens(smol_tok: Tokenizer) -> None:
    drafter = XtokDrafter(DraftModelDrafter(None), smol_tok, smol_tok)
    ctx = smol_tok.encode("The cat")
    enc = smol_tok.encode
    # cut at the last whitespace run: " mat" may go on (" matter"), " the" may not
    assert drafter.target_tokens(ctx, " sat on the mat", False) == enc(" sat on the")
    # no whitespace: drop the last target token (" unbelievable" may be " unbelievably")
    assert drafter.target_tokens(ctx, " unbelievable", False) == enc(" unbelievable")[:-1]
    # the draft ended its text: nothing is cut, and the target's EOS follows
    assert drafter.target_tokens(ctx, " sat.", True) == enc(" sat.") + list(smol_tok.eos_ids[:1])
    assert last_word_start(" a b  c") == 4 and last_word_start(" abc") == 0


def test_a_token_merging_across_the_seam_is_tokenised_as_the_target_would(
    smol_tok: Tokenizer,
) -> None:
    drafter = XtokDrafter(DraftModelDrafter(None), smol_tok, smol_tok)
    ctx = smol_tok.encode("x = 12")  # digits: the target would have continued its number
    proposal = drafter.target_tokens(ctx, "345 + 1", False)
    assert smol_tok.decode(ctx + proposal) == "x = 12345 +"


# ---------------------------------------------------------------------------------------------
# Greedy identity and acceptance on the tiny pair
# ---------------------------------------------------------------------------------------------


def xtok_maker(
    draft: Model, draft_tok: Tokenizer, target_tok: Tokenizer,
    cls: type[XtokDrafter] = XtokDrafter,
) -> Callable[[], XtokDrafter]:
    return lambda: cls(DraftModelDrafter(draft), draft_tok, target_tok)


def test_greedy_identity_for_every_k_with_a_character_level_draft(
    target: tuple[Model, Tokenizer], char_draft: Path
) -> None:
    model, target_tok = target
    loaded = load_model(str(char_draft))
    assert loaded.tokenizer.vocab_size == 23 != model.cfg.vocab_size
    make = xtok_maker(loaded.model, loaded.tokenizer, target_tok)
    expected = plain(model, 24)
    drafted = 0
    for k in range(1, 9):
        gen = generate(model, 24, make(), k)
        assert gen.output == expected, f"k={k}"
        drafted += gen.counters.drafted
    assert drafted > 0


def test_greedy_identity_and_acceptance_with_the_target_under_another_tokenizer(
    target: tuple[Model, Tokenizer],
    permuted_draft: tuple[Model, Tokenizer],
) -> None:
    model, target_tok = target
    make = xtok_maker(*permuted_draft, target_tok)
    expected = plain(model, 24)
    for k in range(1, 9):
        gen = generate(model, 24, make(), k)
        assert gen.output == expected, f"k={k}"
        c = gen.counters
        assert c.accepted >= 0.9 * c.drafted and c.drafted >= 0.5 * 24, f"k={k}"


class NoRetokenising(XtokDrafter):
    """BROKEN: proposes the draft's token ids as if they were the target's."""

    def propose(self, request: DraftRequest) -> Draft:
        context, k = request.context, request.k
        if not self._sync(context.tolist()):
            return Draft(torch.zeros(0, dtype=torch.long), None)
        ids = self.draft.ids
        draft = self.inner.propose(DraftRequest(torch.tensor(ids), k, SamplingParams(), len(ids)))
        return Draft(draft.tokens[:k], None)


def test_a_drafter_skipping_the_re_tokenisation_is_rarely_accepted(
    target: tuple[Model, Tokenizer],
    permuted_draft: tuple[Model, Tokenizer],
) -> None:
    model, target_tok = target
    gen = generate(model, 24, xtok_maker(*permuted_draft, target_tok, NoRetokenising)(), 4)
    assert gen.output == plain(model, 24)  # verification keeps it lossless...
    assert gen.counters.accepted <= 0.2 * gen.counters.drafted  # ...but the ids are wrong


class TextOracle(Drafter):
    """A draft-side drafter that knows the text the target will write: it proposes the draft
    tokens of that text's next 1..12 characters (a random number), so its text often ends inside
    a target word (tests only)."""

    name = "text-oracle"

    def __init__(self, tok: Tokenizer, script: str) -> None:
        self.tok, self.script = tok, script
        self.rng = random.Random(3)

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Draft:
        context, k = request.context, request.k
        done = self.tok.decode(context.tolist())
        assert self.script.startswith(done)
        text = self.script[len(done) : len(done) + self.rng.randint(1, 12)]
        return Draft(torch.tensor(self.tok.encode(text)[:k]), None)


class NoBoundary(XtokDrafter):
    """BROKEN: keeps every target token of the draft text, the last one possibly cut short."""

    def target_tokens(self, ctx: list[int], text: str, ended: bool) -> list[int]:
        return self.target_tok.encode(text)


def oracle_run(
    model: Model, target_tok: Tokenizer, chars: Tokenizer, cls: type[XtokDrafter],
    k: int,
) -> Generation:
    script = target_tok.decode(PROMPT + plain(model, 40))
    drafter = cls(TextOracle(chars, script), chars, target_tok)
    return generate(model, 40, drafter, k)


@pytest.mark.parametrize("k", [3, 5, 8])
def test_boundary_handling_makes_a_right_draft_always_accepted(
    target: tuple[Model, Tokenizer], char_draft: Path, k: int,
) -> None:
    model, target_tok = target
    chars = Tokenizer(char_draft)
    right = oracle_run(model, target_tok, chars, XtokDrafter, k)
    assert right.output == plain(model, 40)
    assert right.counters.rejections == 0 and right.counters.accepted > 10
    broken = oracle_run(model, target_tok, chars, NoBoundary, k)
    assert broken.output == plain(model, 40)
    assert broken.counters.rejections >= 0.4 * broken.counters.steps


# ---------------------------------------------------------------------------------------------
# Sampled mode: lossless (deterministic draft, q = None); the audit of test_drafters_ngram.py
# ---------------------------------------------------------------------------------------------


class ReportsAQ(XtokDrafter):
    """BROKEN: reports a uniform q for its deterministic tokens (verify then over-accepts)."""

    def propose(self, request: DraftRequest) -> Draft:
        draft = super().propose(request)
        return Draft(draft.tokens, torch.full((len(draft.tokens), V), 1.0 / V))


@pytest.mark.statistical
def test_sampled_output_is_distributed_as_the_target(
    target: tuple[Model, Tokenizer],
    permuted_draft: tuple[Model, Tokenizer],
) -> None:
    model, target_tok = target
    make = xtok_maker(*permuted_draft, target_tok)
    first_p, pair_p, drafted, accepted = audit(model, PROMPT, make, 2, seed=30_000)
    assert first_p > FALSE_ALARM and pair_p > FALSE_ALARM
    assert 0 < accepted < drafted  # both the accepted and the rejected paths were exercised


@pytest.mark.statistical
def test_audit_catches_an_xtok_drafter_that_reports_a_q(
    target: tuple[Model, Tokenizer],
    permuted_draft: tuple[Model, Tokenizer],
) -> None:
    model, target_tok = target
    make = xtok_maker(*permuted_draft, target_tok, ReportsAQ)
    first_p, pair_p, _, _ = audit(model, PROMPT, make, 2, seed=40_000)
    assert first_p < FALSE_ALARM and pair_p < FALSE_ALARM


# ---------------------------------------------------------------------------------------------
# Registry and errors
# ---------------------------------------------------------------------------------------------


def test_registry_makes_xtok_drafters_from_a_draft_path(
    target: tuple[Model, Tokenizer], char_draft: Path
) -> None:
    model, target_tok = target
    factory = drafter_factory(DrafterOptions("xtok", draft_model=str(char_draft)), model,
                              tokenizer=target_tok)
    assert factory is not None
    drafter = factory()
    assert isinstance(drafter, XtokDrafter) and drafter.name == "xtok"
    assert generate(model, 12, drafter, 3).output == plain(model, 12)


def test_errors_name_the_fix(
    target: tuple[Model, Tokenizer], char_draft: Path
) -> None:
    model, _ = target
    with pytest.raises(SpecDecodeError, match="--drafter xtok"):
        drafter_factory(DrafterOptions("draft-model", draft_model=str(char_draft)), model)
    with pytest.raises(SpecDecodeError, match="--draft-model PATH"):
        drafter_factory("xtok", model)
    with pytest.raises(SpecDecodeError, match="target's tokenizer"):
        drafter_factory(DrafterOptions("xtok", draft_model=str(char_draft)), model,
                        tokenizer=None)


# ---------------------------------------------------------------------------------------------
# SmolLM2 drafting for itself through text
# ---------------------------------------------------------------------------------------------


def test_smollm_through_text_is_plain_decoding_and_mostly_accepted(smollm: LoadedModel) -> None:
    tok = smollm.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "List three facts about the Moon."}]
    ))

    def run(drafter: Drafter | None, k: int) -> Generation:
        gen = Generation(smollm.model, tok, prompt, SamplingParams(max_tokens=24), drafter, k,
                         tok.eos_ids)
        for _ in gen.run():
            pass
        return gen

    spec = run(XtokDrafter(DraftModelDrafter(smollm.model), tok, tok), 4)
    assert assert_identical([spec], [run(None, 0).output], "xtok through text").rate >= 0.8


# ---------------------------------------------------------------------------------------------
# A target on the transformers adapter (the path Gemma 3 takes): rollback after rejections
# ---------------------------------------------------------------------------------------------


def test_greedy_identity_on_the_transformers_adapter(tmp_path: Path, char_draft: Path) -> None:
    """A tiny Gemma 3 target on the adapter, drafted through text by the oracle without the
    boundary cut: drafts are accepted and rejected, so the adapter's cache is rolled back after
    rejections, and the output stays plain decoding's."""
    folder = make_checkpoint(tmp_path / "gemma", "gemma3_text", seed=2, head_dim=16,
                             sliding_window=4, layer_types=["sliding_attention",
                                                            "sliding_attention", "full_attention"])
    target_tok = word_tokenizer(folder)
    model = load_model(str(folder)).model
    assert model.backend == "transformers"
    for k in (1, 3, 6):
        gen = oracle_run(model, target_tok, Tokenizer(char_draft), NoBoundary, k)
        assert gen.output == plain(model, 40), f"k={k}"
        assert gen.counters.rejections > 0 and gen.counters.accepted > 0, f"k={k}"
