"""Benchmark (not a test): how far could another drafting policy take the hybrid on this machine?

At greedy, what a step commits does not depend on how it was drafted: the output is the
target's greedy text whatever the drafter. So a policy (which drafter drafts at a step, how many
tokens, how they are checked) can be replayed offline, with the costs measured here:

- per prompt the target's greedy output is generated once through the engine (plain, batch 1),
  and the hybrid (`ngram+w4a16`, k=3) as the engine runs it, interleaved: its measured
  whole-request ratio says how far the replay is from the engine;
- the 4-bit copy's greedy predictions are teacher-forced along that output in one forward, over
  the target's keys and values of the prompt (as it reads them when it drafts in the target's
  cache), with its top probability at each position;
- the n-gram drafter (the project's own, learning its rates as in the engine) is asked at each
  replayed step what it would propose;
- a draft is accepted up to its first token that differs from the output; a step costs its copy
  forwards (by width) and the target's verification (by width): medians of forwards at the
  prompt's context length (calibration.forward_costs, the widths of each model interleaved); the
  prefill is the plain run's own.

Per policy: the predicted decoding-phase ratio to plain (the replay's plain: one width-1 target
forward per token) and the whole-request ratio with the measured prefill added to both sides.
The replay has no per-step cost beyond the forwards (sampling, bookkeeping), so it is an upper
bound for each policy; compare policies by it, and the hybrid's row against its engine figure.

Policies: the copy alone at k; the lookup alone at k; the hybrid (the lookup when it expects >=
t accepted tokens, else the copy) for a grid of k and t, and with the lookup drafting more tokens
than the copy; the copy stopping after a token it gives probability < tau (a confidence-based
draft length); staged (each copy forward also checks the lookup's guesses for the next positions
and keeps those it agrees with, Spector and Re 2023); mixed (at each draft position the lookup's
token when its match is >= n tokens long, else a copy forward).

    python benchmarks/drafter_policies.py [--categories summarization] [--per-category 12]
        [--max-tokens 128] [--threads 2] [--specbench FILE] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from drafters import SPECBENCH, run_one

from specdecode.acceptance import expected_accepted
from specdecode.bench.hardware import machine_summary
from specdecode.bench.workloads import load_workload
from specdecode.calibration import forward_costs
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.ngram import NgramDrafter, NgramIndex
from specdecode.drafters.registry import drafter_factory
from specdecode.models.backends import load_model
from specdecode.models.precision import apply_precision
from specdecode.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
MAX_TARGET_WIDTH = 9
MAX_COPY_WIDTH = 5
HYBRID = "hybrid k=3 t=0.6"  # the hybrid as the engine runs it (ngram+w4a16, k=3)


@dataclass
class Trace:
    """One prompt: its ids, the target's greedy output, the copy's teacher-forced top token and
    its probability for each output position, and the costs measured at its context (seconds)."""

    ids: list[int]
    out: list[int]
    copy_top: list[int]
    copy_prob: list[float]
    target_s: dict[int, float]  # verification width -> seconds
    copy_s: dict[int, float]  # copy forward width -> seconds
    prefill_s: float


Policy = Callable[[NgramDrafter, Trace, int], tuple[list[int], float]]


def copy_drafts(trace: Trace, m: int, drafts: list[int], n: int) -> list[int]:
    """The copy's next n greedy tokens after `drafts` at output position m. Along the output
    they are its teacher-forced predictions; after a draft token off the output the rest is
    rejected anyway and stands as -1."""
    out, top = trace.out, trace.copy_top
    made = list(drafts)
    for _ in range(n):
        j = m + len(made)
        if j >= len(out):
            break
        on_path = all(made[i] == out[m + i] for i in range(len(made)))
        made.append(top[j] if on_path else -1)
    return made[len(drafts):]


def suffix_match(tokens: list[int], max_n: int = 8) -> tuple[int, int]:
    """(the token the n-gram drafter's index would copy next after `tokens`, its match length);
    (-1, 0) when no suffix recurs."""
    index = NgramIndex(max_n, 1)
    index.extend(tokens)
    found = index.lookup()
    if found is None:
        return -1, 0
    start, n = found
    return index.continuation(start, 1)[0], n


def lookup(ngram: NgramDrafter, trace: Trace, m: int, k: int) -> tuple[list[int], float]:
    """The n-gram drafter's proposal and the tokens it expects accepted."""
    ctx = torch.tensor(trace.ids + trace.out[:m])
    draft = ngram.propose(DraftRequest(ctx, k, GREEDY, len(trace.ids)))
    expected = expected_accepted(draft.confidence) if draft.confidence else 0.0
    return draft.tokens.tolist(), expected


def plain(ngram: NgramDrafter, trace: Trace, m: int) -> tuple[list[int], float]:
    return [], 0.0


def copy_alone(k: int) -> Policy:
    def policy(ngram: NgramDrafter, trace: Trace, m: int) -> tuple[list[int], float]:
        drafts = copy_drafts(trace, m, [], k)
        return drafts, len(drafts) * trace.copy_s[1]
    return policy


def lookup_alone(k: int) -> Policy:
    def policy(ngram: NgramDrafter, trace: Trace, m: int) -> tuple[list[int], float]:
        return lookup(ngram, trace, m, k)[0], 0.0
    return policy


def hybrid(k: int, min_expected: float, lookup_k: int | None = None) -> Policy:
    def policy(ngram: NgramDrafter, trace: Trace, m: int) -> tuple[list[int], float]:
        proposal, expected = lookup(ngram, trace, m, lookup_k or k)
        if proposal and expected >= min_expected:
            return proposal, 0.0
        drafts = copy_drafts(trace, m, [], k)
        return drafts, len(drafts) * trace.copy_s[1]
    return policy


def copy_confident(k: int, tau: float) -> Policy:
    def policy(ngram: NgramDrafter, trace: Trace, m: int) -> tuple[list[int], float]:
        drafts: list[int] = []
        while len(drafts) < k and m + len(drafts) < len(trace.out):
            drafts += copy_drafts(trace, m, drafts, 1)
            if trace.copy_prob[m + len(drafts) - 1] < tau:
                break
        return drafts, len(drafts) * trace.copy_s[1]
    return policy


def staged(k: int, guesses: int, min_expected: float) -> Policy:
    """The hybrid, where each copy forward also feeds the lookup's guesses for the positions
    after its input and keeps those its own predictions agree with (plus its own next token)."""
    def policy(ngram: NgramDrafter, trace: Trace, m: int) -> tuple[list[int], float]:
        proposal, expected = lookup(ngram, trace, m, k)
        if proposal and expected >= min_expected:
            return proposal, 0.0
        drafts: list[int] = []
        spent = 0.0
        context = trace.ids + trace.out[:m]
        while len(drafts) < k and m + len(drafts) < len(trace.out):
            guess: list[int] = []
            for _ in range(min(guesses, k - len(drafts) - 1)):
                token, n = suffix_match(context + drafts + guess)
                if n == 0:
                    break
                guess.append(token)
            spent += trace.copy_s[min(1 + len(guess), MAX_COPY_WIDTH)]
            own = copy_drafts(trace, m, drafts, len(guess) + 1)
            agreed = 0
            while agreed < len(guess) and agreed < len(own) and guess[agreed] == own[agreed]:
                agreed += 1
            drafts += own[:agreed + 1]
        return drafts[:k], spent
    return policy


def mixed(k: int, min_n: int) -> Policy:
    """Per draft position: the lookup's token when its suffix match is >= min_n tokens long
    (free), else the copy's, whose forward then feeds every token added since its last one."""
    def policy(ngram: NgramDrafter, trace: Trace, m: int) -> tuple[list[int], float]:
        drafts: list[int] = []
        spent, unfed = 0.0, 1  # the pending token
        context = trace.ids + trace.out[:m]
        while len(drafts) < k and m + len(drafts) < len(trace.out):
            token, n = suffix_match(context + drafts)
            if n >= min_n:
                drafts.append(token)
                unfed += 1
                continue
            spent += trace.copy_s[min(unfed, MAX_COPY_WIDTH)]
            unfed = 1
            drafts += copy_drafts(trace, m, drafts, 1)
        return drafts, spent
    return policy


def replay(trace: Trace, policy: Policy) -> tuple[float, int]:
    """Seconds of the decoding phase under `policy`, and its steps: the output replayed step by
    step."""
    ngram = NgramDrafter()
    out, m, total, steps = trace.out, 0, 0.0, 0
    while m < len(out):
        drafts, spent = policy(ngram, trace, m)
        drafts = drafts[:MAX_TARGET_WIDTH - 1]
        accepted = 0
        while accepted < len(drafts) and m + accepted < len(out) and \
                drafts[accepted] == out[m + accepted]:
            accepted += 1
        total += spent + trace.target_s[len(drafts) + 1]
        m += accepted + 1
        steps += 1
    return total, steps


def policies() -> dict[str, Policy]:
    table: dict[str, Policy] = {"plain": plain}
    for k in (2, 3, 4, 5):
        table[f"copy k={k}"] = copy_alone(k)
    for k in (3, 5):
        table[f"lookup k={k}"] = lookup_alone(k)
    for k in (2, 3, 4):
        for t in (0.4, 0.6, 1.0, 1.5):
            table[f"hybrid k={k} t={t}"] = hybrid(k, t)
    table["hybrid k=3 t=0.6 lookup k=5"] = hybrid(3, 0.6, 5)
    for k, tau in ((4, 0.5), (6, 0.5), (6, 0.8)):
        table[f"copy k={k} stop p<{tau}"] = copy_confident(k, tau)
    for guesses in (1, 2, 3):
        table[f"staged k=3 guesses={guesses}"] = staged(3, guesses, 0.6)
    for min_n in (2, 3, 4):
        table[f"mixed k=3 n>={min_n}"] = mixed(3, min_n)
    return table


def measure_costs(target: Any, copy: Any, context: int, repeats: int
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """Median seconds of a target forward of each verification width and of a copy forward of
    each width after `context` tokens (calibration.forward_costs, each model in a cache of its own:
    a forward's time does not depend on the values it reads)."""
    target_rows = forward_costs(target, 1, context, MAX_TARGET_WIDTH, repeats)
    copy_rows = forward_costs(copy, 1, context, MAX_COPY_WIDTH, repeats)
    return ({r["k"]: r["median_s"] for r in target_rows},
            {r["k"]: r["median_s"] for r in copy_rows})


def teacher_forced(target: Any, copy: Any, ids: list[int], out: list[int]
                   ) -> tuple[list[int], list[float]]:
    """The copy's top token and its probability for each output position, given the prompt's
    keys and values from the target and the output before it."""
    seq = ids + out
    cache = target.new_cache(1, len(seq) + 1)
    target(torch.tensor([ids[:-1]]), cache, logits_for="none")
    logits = copy(torch.tensor([seq[len(ids) - 1:len(seq) - 1]]), cache, logits_for="all")[0]
    prob, top = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    return top.tolist(), prob.tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--categories", default="summarization")
    ap.add_argument("--per-category", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--specbench", default=str(SPECBENCH))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(None, "fp32")
    tok, target = loaded.tokenizer, loaded.model
    copy = apply_precision(target, "w4a16")
    hybrid_engine = drafter_factory("ngram+w4a16", target, tokenizer=tok)
    assert hybrid_engine is not None
    prompts = load_workload(args.specbench, categories=args.categories.split(","),
                            limit_per_category=args.per_category).prompts
    hw = machine_summary()
    print(f"# SmolLM2-135M-Instruct fp32 target, w4a16 copy, batch 1, greedy, {args.max_tokens} "
          f"new tokens; {hw['cpu']} ({hw['cores']} cores, {torch.get_num_threads()} threads), "
          f"load average {hw.get('load_avg_1m')}; {len(prompts)} prompts of {args.categories}")
    table = policies()
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p.turns[0]}]))
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, seed=i)
            if i == 0:
                run_one(loaded, ids, params, None, 0)  # warm-up
            plain_rate, _, counters, out = run_one(loaded, ids, params, None, 0)
            hybrid_rate, _, hybrid_counters, hybrid_out = run_one(loaded, ids, params,
                                                                  hybrid_engine(), 3)
            assert hybrid_out == out, f"prompt {p.id}: the hybrid's output is not plain's"
            top, prob = teacher_forced(target, copy, ids, out)
            target_s, copy_s = measure_costs(target, copy, len(ids) + len(out) // 2,
                                             args.repeats)
            trace = Trace(ids, out, top, prob, target_s, copy_s, counters.prefill_ns / 1e9)
            replayed = {name: replay(trace, policy) for name, policy in table.items()}
            seconds = {name: spent for name, (spent, _) in replayed.items()}
            steps = replayed[HYBRID][1]
            agree = sum(a == b for a, b in zip(top, out, strict=True)) / len(out)
            rows.append({"id": p.id, "prompt_tokens": len(ids), "new_tokens": len(out),
                         "prefill_s": trace.prefill_s, "target_s": target_s, "copy_s": copy_s,
                         "copy_agreement": agree, "engine_hybrid_ratio": hybrid_rate / plain_rate,
                         "engine_hybrid_steps": hybrid_counters.steps, "replay_hybrid_steps": steps,
                         "seconds": seconds})
            print(f"# {p.id}: {len(ids)} prompt / {len(out)} new tokens; copy agrees on "
                  f"{agree:.0%}; v(4) {target_s[4] / target_s[1]:.2f}, copy c "
                  f"{copy_s[1] / target_s[1]:.2f}; engine hybrid "
                  f"{hybrid_rate / plain_rate:.2f}x in {hybrid_counters.steps} steps, "
                  f"replayed in {steps}",
                  flush=True)
    report(rows, table)
    if args.out:
        Path(args.out).write_text(json.dumps({"hardware": hw, "prompts": rows}, indent=1))


def report(rows: list[dict[str, Any]], table: dict[str, Policy]) -> None:
    """Per policy: predicted ratios over all prompts' summed times (decoding phase, and whole
    requests with the measured prefills), and the per-prompt whole-request range."""
    prefill = sum(r["prefill_s"] for r in rows)
    plain = sum(r["seconds"]["plain"] for r in rows)
    engine = [r["engine_hybrid_ratio"] for r in rows]
    print(f"\n{'policy':<30}{'decode x':>10}{'whole x':>10}{'per prompt (min-max)':>24}")
    for name in table:
        spent = sum(r["seconds"][name] for r in rows)
        each = [(r["prefill_s"] + r["seconds"]["plain"]) / (r["prefill_s"] + r["seconds"][name])
                for r in rows]
        print(f"{name:<30}{plain / spent:>10.2f}{(prefill + plain) / (prefill + spent):>10.2f}"
              f"{min(each):>14.2f}-{max(each):.2f}")
    engine_steps = sum(r["engine_hybrid_steps"] for r in rows)
    replay_steps = sum(r["replay_hybrid_steps"] for r in rows)
    print(f"\nthe hybrid k=3 t=0.6 in the engine: {engine_steps} steps (replayed: {replay_steps}), "
          f"measured median "
          f"{statistics.median(engine):.2f}x ({min(engine):.2f}-{max(engine):.2f}) whole-request")


if __name__ == "__main__":
    main()
