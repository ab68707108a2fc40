"""A one-token prompt (`specdecode generate "hi"` without --chat) leaves nothing to prefill, yet
its request still needs a cache: `Generation.prefilled` is true only once the cache exists, so
the request's own decoding loop allocates it, as the batch engine's admission does. Before, the
loop skipped the prefill and died with "the request has no cache: it was released". Both paths
give the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.models.backends import load_model
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint


def test_a_one_token_prompt_decodes_alone_and_in_a_batch(tmp_path: Path) -> None:
    model = load_model(str(make_checkpoint(tmp_path / "m")), precision="fp32").model
    params = SamplingParams(max_tokens=6)
    alone = Generation(model, None, [5], params)
    assert not alone.prefilled  # nothing to feed, but no cache yet
    for _ in alone.run():
        pass
    assert alone.prefilled_tokens == 0 and len(alone.output) == 6
    batched = run_batch(BatchEngine(model, 2, 64), [Generation(model, None, [5], params)])
    assert batched[0].output == alone.output


def test_a_request_without_a_cache_is_not_prefilled(tmp_path: Path) -> None:
    """The property itself: a two-token prompt needs one token fed, and a cache."""
    model = load_model(str(make_checkpoint(tmp_path / "m")), precision="fp32").model
    gen = Generation(model, None, [5, 6], SamplingParams(max_tokens=2))
    assert not gen.prefilled
    assert gen.prefill() and gen.prefilled and gen.cache is not None
    with pytest.raises(Exception, match="no cache"):
        Generation(model, None, [5], SamplingParams()).kv  # noqa: B018
