"""A short soak of a real `specdecode serve` process (issue 26, item 4): rounds of mixed traffic
(short requests, long prefills, oversized prompts refused by size, prompts tokenized then
refused, streams dropped mid-way), every reply as expected, and the server's RSS bounded after
the warm-up. The full soak, with its figures, is benchmarks/server_soak.py
(docs/measurements/server-soak.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# After the warm-up the server's RSS may move by allocator noise (a few MB a round measured);
# a leak of what one round handles (megabytes of prompt text and their tokens) or retention of
# a long prompt's tokenizing (tens of MB each, measured) would exceed these.
MAX_GROWTH_AFTER_WARMUP = 48 << 20
MAX_ROUND_PEAK_OVER_WARM = 96 << 20


def soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("server_soak",
                                                  ROOT / "benchmarks" / "server_soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["server_soak"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_a_short_soak_keeps_memory_bounded(tmp_path: Path) -> None:
    soak = soak_module()
    traffic = soak.Traffic(short=2, long=1, oversized=2, near_bound=2, disconnects=1,
                           long_words=384)
    result = soak.soak(["--drafter", "ngram", "--k", "auto", "--max-seq-len", "512"], {},
                       traffic, rounds=6, warmup_rounds=2, log=tmp_path / "server.log",
                       echo=False)
    for r in result.rounds:  # short and long answered, both oversized kinds refused, 1 dropped
        assert r.statuses == {"200": 3, "400": 4, "dropped": 1}, r
    warm = result.rss_after_warmup
    assert abs(result.growth_after_warmup) <= MAX_GROWTH_AFTER_WARMUP, result.to_dict()
    later = result.rounds[result.warmup_rounds:]
    assert max(r.rss_peak for r in later) - warm <= MAX_ROUND_PEAK_OVER_WARM, result.to_dict()
