"""The drafter interface (drafters.base.Drafter): the example of docs/drafters.md, "Writing a
drafter", run through the engine, and the feedback hook the engine calls after verification."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.control import Controller
from specdecode.drafters.base import Draft, Drafter, DraftRequest
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.identity import assert_identical

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread

DOC = Path(__file__).resolve().parents[1] / "docs" / "drafters.md"
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 4, 9, 3, 9], [11, 12, 13, 14]]


def example_drafter() -> type[Drafter]:
    """The first Python block of the docs' "Writing a drafter" section, executed."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Writing a drafter"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    assert len(code.group(1).splitlines()) <= 40  # a short example
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), str(DOC), "exec"), namespace)
    cls = namespace["FollowerDrafter"]
    assert issubclass(cls, Drafter)
    return cls  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(make_checkpoint(tmp_path_factory.mktemp("tiny"))))


def run(model: Any, prompt: list[int], drafter: Drafter | None, k: int,
        params: SamplingParams) -> Generation:
    gen = Generation(model, None, prompt, params, drafter, k)
    for _ in gen.run():
        pass
    return gen


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_documented_example_drafter_is_greedy_identical_to_plain_decoding(
        tiny: LoadedModel, prompt: list[int]) -> None:
    cls = example_drafter()
    params = SamplingParams(max_tokens=40)
    plain = run(tiny.model, prompt, None, 0, params)
    drafter = cls()
    spec = run(tiny.model, prompt, drafter, 4, params)
    assert_identical([spec], [plain.output], str(prompt))
    c = spec.counters  # its own feedback counts agree with the engine's
    assert (drafter.proposed, drafter.accepted) == (c.drafted, c.accepted)  # type: ignore[attr-defined]


class Recorder(Drafter):
    """Proposes the last context token k times; records every feedback call."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], int, list[int]]] = []
        self.requests: list[DraftRequest] = []

    def propose(self, request: DraftRequest) -> Draft:
        self.requests.append(request)
        return Draft(request.context[-1:].repeat(request.k), None)

    def observe_result(self, draft: Draft, num_accepted: int, committed: list[int]) -> None:
        self.calls.append((draft.tokens.tolist(), num_accepted, committed))


def check_feedback(gen: Generation, drafter: Recorder) -> None:
    """One call per step; the committed tokens, in order, are the context after the prompt; the
    accepted tokens are the draft's prefix and the counts match the engine's counters."""
    assert len(drafter.calls) == gen.counters.steps
    committed = [t for _, _, step in drafter.calls for t in step]
    assert committed == gen.context[gen.prompt_len:]
    for draft, accepted, step in drafter.calls:
        assert 0 <= accepted <= len(draft) and len(step) == accepted + 1
        assert step[:accepted] == draft[:accepted]
    assert sum(a for _, a, _ in drafter.calls) == gen.counters.accepted
    assert sum(len(d) for d, _, _ in drafter.calls) == gen.counters.drafted


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_engine_reports_what_was_accepted_after_every_step(
        tiny: LoadedModel, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=30, seed=3)
    drafter = Recorder()
    gen = run(tiny.model, PROMPTS[0], drafter, 3, params)
    check_feedback(gen, drafter)
    request = drafter.requests[0]
    assert request.k == 3 and request.prompt_len == len(PROMPTS[0])
    assert request.params is params and request.generator is gen.verifier.generator
    assert request.model_k is None  # no controller


def test_a_batch_under_the_controller_reports_every_row(tiny: LoadedModel) -> None:
    params = SamplingParams(max_tokens=24)
    drafters = [Recorder() for _ in PROMPTS]
    gens = [Generation(tiny.model, None, p, params, d, 3) for p, d in zip(PROMPTS, drafters,
                                                                          strict=True)]
    run_batch(BatchEngine(tiny.model, 3, 64, controller=Controller(kmax=3)), gens)
    for gen, drafter, prompt in zip(gens, drafters, PROMPTS, strict=True):
        check_feedback(gen, drafter)
        assert gen.output == run(tiny.model, prompt, None, 0, params).output
        assert all(r.model_k is not None and r.model_k <= 3 for r in drafter.requests)


def test_a_drafter_must_implement_propose() -> None:
    class Nothing(Drafter):
        pass

    with pytest.raises(TypeError):
        Nothing()  # type: ignore[abstract]
    defaults = Recorder()
    assert not defaults.fits_width and defaults.cache_model is None
    assert not defaults.wants_hidden and defaults.catch_up_ns == 0
    # what the server and the reports use, declared with defaults: no probing of drafters
    assert defaults.isolation_key is None and defaults.weights() is None
    assert defaults.kv_bytes() == 0 and defaults.discard() is None
    rounds = defaults.rounds(DraftRequest(torch.tensor([4, 5]), 2, SamplingParams(), 2))
    with pytest.raises(StopIteration) as done:  # the default rounds: the proposal at once
        next(rounds)
    assert done.value.value.tokens.tolist() == [5, 5]


def test_a_hybrid_forwards_what_the_server_sets_and_asks() -> None:
    """The server sets a drafter's isolation scope and may discard its request; a hybrid
    passes both to its parts (its lookup holds any store), and reports its model part's
    memory."""
    from specdecode.drafters.hybrid import HybridDrafter

    class Part(Recorder):
        discarded = False

        def discard(self) -> None:
            self.discarded = True

        def kv_bytes(self) -> int:
            return 7

    lookup, model = Part(), Part()
    hybrid = HybridDrafter(lookup, model, "ngram+part")
    hybrid.isolation_key = "scope"
    assert lookup.isolation_key == "scope" == hybrid.isolation_key
    hybrid.discard()
    assert lookup.discarded and model.discarded and hybrid.kv_bytes() == 7
