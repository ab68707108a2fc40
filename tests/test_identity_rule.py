"""The identity tests' rule (tests/identity.py): speculative output equals plain output AND tokens
were drafted and accepted. The helper's broken variants (nothing drafted, nothing accepted, an
output that differs) fail it; and every test whose name says it compares speculation with plain
decoding uses the helper (an identity check written without it is found, the scan's own broken
variant), except the tests listed below, each with the reason it is not such a comparison.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.identity import assert_identical, assert_identical_outputs

TESTS = Path(__file__).resolve().parent
# a test named like this claims speculative output == plain decoding's output
IDENTITY_NAME = re.compile(r"identical|equals_plain|is_plain|plain_decoding|plain_output|"
                           r"plain_seeded|plain_sampling|plain_constrained|lossless")
HELPERS = {"assert_identical", "assert_identical_outputs"}
NOT_SPECULATION_VS_PLAIN = {
    # streamed replies against non-streamed ones of the same server
    "test_server.py::test_completions_streamed_equals_plain": "streamed vs not streamed",
    "test_server.py::test_chat_streamed_equals_plain": "streamed vs not streamed",
    # the audit of two servers, and bench's recommendation rules (fake runners)
    "test_audit_endpoint.py::test_identical_servers_pass_and_every_reply_is_kept": "an audit",
    "test_bench_inprocess.py::test_sampled_audit_passes_a_config_that_is_plain_decoding":
        "the audit's verdict on a configuration that is plain decoding",
    "test_bench_targets.py::test_the_fastest_lossless_config_the_fidelity_admits_is_recommended":
        "recommendation rules",
    "test_bench_targets.py::test_a_faster_config_that_is_not_lossless_is_never_recommended":
        "recommendation rules",
    "test_bench_targets.py::test_each_speculative_config_is_measured_against_its_own_targets_plain":
        "bench planning",
    # distributions and verifier unit tests (no engine run to count drafts in)
    "test_engine_sampled.py::test_plain_sampling_matches_target_distribution": "a distribution",
    "test_invariant.py::test_plain_and_speculative_seeded_sampling_match_the_target_distribution":
        "a distribution",
    "test_verify_tree.py::test_tree_greedy_is_plain_greedy_decoding_on_random_trees":
        "the verifier alone, on random trees",
    "test_verify_tree.py::test_tree_invariant_is_plain_seeded_decoding":
        "the verifier alone, on random trees",
    "test_server_speculation.py::test_plain_decoding_is_never_called_not_paying": "cost rules",
    "test_llamacpp_smollm.py::test_plain_matches_llama_cpp_pythons_own_greedy_decoding":
        "plain decoding against llama-cpp-python's, no speculation",
    "test_llamacpp_distilled.py::test_full_export_is_a_plain_gguf_llamacpp_loads": "an export",
    "test_bench_workloads.py::test_plain_format_with_defaults_and_overrides": "a file format",
    "test_bench_workloads.py::test_repeat_group_in_a_plain_workload_file": "a file format",
}


def run(output: list[int], drafted: int, accepted: int) -> SimpleNamespace:
    return SimpleNamespace(output=output, counters=SimpleNamespace(drafted=drafted,
                                                                   accepted=accepted))


def test_the_helper_passes_a_run_that_drafted_and_had_drafts_accepted() -> None:
    found = assert_identical([run([1, 2, 3], 4, 3), run([5], 2, 0)], [[1, 2, 3], [5]])
    assert (found.drafted, found.accepted, found.rate) == (6, 3, 0.5)


@pytest.mark.parametrize(("runs", "message"), [
    ([run([1, 2, 3], 0, 0)], "nothing was drafted"),  # plain decoding against itself
    ([run([1, 2, 3], 5, 0)], "no drafted token was accepted"),  # the accepted path never ran
    ([run([1, 2, 4], 5, 3)], "differs from plain on requests \\[0\\]"),
])
def test_the_helper_fails_a_vacuous_or_wrong_identity_check(runs: list[SimpleNamespace],
                                                            message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        assert_identical(runs, [[1, 2, 3]])


def test_a_rejection_path_test_says_so() -> None:
    assert assert_identical([run([1, 2, 3], 5, 0)], [[1, 2, 3]], require_accepted=False).rate == 0
    with pytest.raises(AssertionError, match="nothing was drafted"):
        assert_identical_outputs(["ab"], ["ab"], 0, 0, require_accepted=False)


def identity_tests_without_the_helper(source: str, filename: str) -> list[str]:
    """The identity-named test functions of `source` that call neither helper, directly or
    through a function of the same module."""
    tree = ast.parse(source)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

    def called(node: ast.AST, seen: set[str]) -> set[str]:
        names = {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", "")
                 for c in ast.walk(node) if isinstance(c, ast.Call)}
        for name in names & set(functions) - seen:
            seen.add(name)
            names |= called(functions[name], seen)
        return names

    return [f"{filename}::{name}" for name, node in functions.items()
            if name.startswith("test") and IDENTITY_NAME.search(name)
            and not HELPERS & called(node, set())]


def test_every_identity_test_uses_the_helper() -> None:
    missing = [name for path in sorted(TESTS.glob("test_*.py"))
               for name in identity_tests_without_the_helper(path.read_text(encoding="utf-8"),
                                                             path.name)
               if name not in NOT_SPECULATION_VS_PLAIN]
    assert not missing, ("identity tests that do not assert drafted and accepted tokens "
                         f"(use tests/identity.py): {missing}")


def test_the_scan_finds_an_identity_check_written_without_the_helper() -> None:
    """Broken variant: output equality alone (it passes when nothing is drafted)."""
    bad = ("def _run(m, d):\n    return m(d)\n\n"
           "def test_ngram_is_token_identical(m):\n    assert _run(m, 1).output == _run(m, 0)\n")
    good = bad.replace("assert _run(m, 1).output == _run(m, 0)",
                       "assert_identical([_run(m, 1)], [_run(m, 0)])")
    assert identity_tests_without_the_helper(bad, "t.py") == ["t.py::test_ngram_is_token_identical"]
    assert identity_tests_without_the_helper(good, "t.py") == []
