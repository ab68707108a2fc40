"""Benchmark (not a test): drafters against the fast native targets (issue 34, item 3). For each
target precision (w4a16, bf16 by default), in one process:

1. Forward costs and first-token acceptance of every model drafter family, measured the way
   `ngram+auto` measures its candidates (drafters.auto.measure: the target and every draft
   interleaved round by round, medians; c = a draft token's forward over the target's plain
   step, v(T) = the target's forward over T positions over its plain step; alpha = greedy
   agreement with the target on the calibration chat, a copy drafting in the target's cache),
   plus the families ngram+auto does not consider: layer skipping (27 of 30 blocks, the
   calibration of docs/drafters.md) with and without a draft head, and the EAGLE-style heads
   shipped for the fp32 target (alpha teacher-forced on the calibration chat with the target's
   own features; c = one draft step: fc, block, head, argmax). Each row gets the bound
   max_k E(alpha, k) / (k c + v(k + 1)).
2. Decoding: plain and every configuration interleaved per prompt (batch 1, greedy), alpha
   (Counters.alpha) and c (drafting time per draft token over the plain step of the same
   prompts) from the engine's counters, speedups of whole requests and after the first token
   (median over prompts, min-max), and plain tokens/s.

    python benchmarks/fast_target_drafters.py --targets w4a16,bf16 --threads 1 \
        --per-category 1 --max-tokens 64 [--specbench FILE --categories summarization,rag,...]
        [--configs "ngram:auto;suffix:auto;ngram+auto:auto;w4a16,draft_vocab=16384:3"]
        [--out F.json]

A configuration is `name[,option=value...]:k` (k a number, or auto: the controller, kmax 8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from drafters import timed_decode  # benchmarks/drafters.py, beside this script

from specdecode.bench.hardware import machine_summary
from specdecode.bench.workloads import Prompt, load_default_workload, load_workload
from specdecode.calibration import calibrated_costs
from specdecode.control import CostModel
from specdecode.drafters import auto
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.registry import drafter_factory
from specdecode.models.backends import load_model
from specdecode.models.loading import make_exact
from specdecode.models.precision import apply_precision
from specdecode.sampling import SamplingParams

SPECBENCH = Path(__file__).resolve().parents[2] / "shared/data/specbench/question.jsonl"
DROPPED = (7, 14, 17)  # layerskip's calibrated drop on SmolLM2 at 27 of 30 blocks
CONFIGS = {
    "w4a16": "ngram:auto;suffix:auto;ngram+auto:auto;w4a16,draft_vocab=16384:2",
    "bf16": "ngram:auto;suffix:auto;ngram+w4a16:auto;ngram+auto:auto;w4a16:3;"
            "w4a16,draft_vocab=16384:3;int8:3",
}


def options_of(spec: str) -> tuple[DrafterOptions, int, bool]:
    """'w4a16,draft_vocab=16384:3' -> (options, k, False); 'ngram:auto' -> (.., 8, True)."""
    head, _, k_text = spec.rpartition(":")
    name, *pairs = head.split(",")
    values: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        values[key] = int(value) if value.isdigit() else value
    auto_k = k_text == "auto"
    k = 8 if auto_k else int(k_text)
    return DrafterOptions.from_mapping(name, values, "auto" if auto_k else k), k, auto_k


def prompts(args: argparse.Namespace) -> list[Prompt]:
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    for p in load_default_workload(None).prompts:
        if (p.temperature or 0) == 0 and seen.get(p.category, 0) < args.per_category:
            seen[p.category] = seen.get(p.category, 0) + 1
            out.append(p)
    if args.specbench and Path(args.specbench).exists() and args.categories:
        out += load_workload(args.specbench, categories=args.categories.split(","),
                             limit_per_category=args.specbench_per_category).prompts
    return out


# --- part 1: costs and first-token acceptance --------------------------------------------------


def heads_row(target: Any, ids: list[int], want: torch.Tensor, plain_s: float,
              v: tuple[float, ...], rounds: int) -> auto.Candidate:
    """The shipped heads (trained on the fp32 target's features) on `target`'s own features:
    alpha of the first draft token, teacher-forced, and c of one draft step."""
    from safetensors.torch import load_file

    from specdecode.drafters.heads import WEIGHTS_FILE, FeatureDrafterModel, default_heads_dir

    state = load_file(str(default_heads_dir() / WEIGHTS_FILE))
    heads = FeatureDrafterModel(target, state["vocab"])  # bypasses the card's target check
    heads.load_trained_state(state, "shipped heads")
    heads.eval()
    x = torch.tensor([ids])
    n = len(ids)
    with torch.inference_mode():
        feats = target(x, target.new_cache(1, n), return_hidden=True)  # (1, n, H)
        pred = heads(x[:, 1:], feats[:, :-1], heads.new_cache(1, n))[0]  # entry j -> token j+2
        got = heads.full_logits(pred).argmax(dim=-1)[: n - 2]  # predicts position j + 1's next
        alpha = float((got == want[1 : n - 1]).float().mean())
        cache = heads.new_cache(1, n + 2)
        heads(x[:, 1:], feats[:, :-1], cache)
        times = []
        for r in range(rounds + 1):
            cache.lengths[0] = n - 1
            start = time.perf_counter()
            h = heads(x[:, -1:], feats[:, -1:], cache)[0]
            heads.full_logits(h).argmax()
            if r:
                times.append(time.perf_counter() - start)
    c = statistics.median(times) / plain_s
    s, k = auto.predicted_speedup(alpha, c, v)
    return auto.Candidate("heads (shipped, fp32-trained)", c, alpha, k, s)


def cost_table(target: Any, tokenizer: Any, rounds: int) -> dict[str, Any]:
    from specdecode.drafters.draft_head import with_draft_head
    from specdecode.drafters.layerskip import LayerSubset

    parts = auto.candidates(target, 4096)
    kept = [i for i in range(target.cfg.num_layers) if i not in DROPPED]
    for vocab in (None, target.cfg.vocab_size // 3):
        model = with_draft_head(LayerSubset(target, kept), vocab)
        name = "layerskip 27/30" + ("" if vocab is None else f":draft_vocab={vocab}")
        parts[name] = auto._Part(model, True, lambda: None)  # type: ignore[arg-type,return-value]
    ids = auto.calibration(tokenizer)
    selection = auto.measure(target, ids, parts, rounds=rounds)
    with torch.inference_mode():
        want = target(torch.tensor([ids]), target.new_cache(1, len(ids)))[0].argmax(dim=-1)
    rows = [*selection.candidates,
            heads_row(target, ids, want, selection.plain_step_s, selection.v, rounds)]
    return {"v": selection.v, "plain_step_s": selection.plain_step_s,
            "auto_chosen": selection.chosen, "rows": rows}


def print_costs(precision: str, table: dict[str, Any]) -> None:
    v = ", ".join(f"{x:.2f}" for x in table["v"])
    print(f"\n## {precision} target: plain step {table['plain_step_s'] * 1e3:.1f} ms, "
          f"v(1..) = {v}; ngram+auto picks {table['auto_chosen']}")
    print(f"{'drafter':<40}{'c':>7}{'alpha':>7}{'bound':>8}{'at k':>6}")
    for row in table["rows"]:
        if row.c is None:
            print(f"{row.name:<40}  ({row.note[:90]})")
        else:
            print(f"{row.name:<40}{row.c:>7.3f}{row.alpha:>7.3f}{row.predicted:>7.2f}x"
                  f"{row.k:>6}")


# --- part 2: decoding ----------------------------------------------------------------------------


def run_one(model: Any, eos: list[int], ids: list[int], params: SamplingParams, drafter: Any,
            k: int, costs: Any) -> tuple[float, float, Any]:
    """(tokens/s of the whole request, tokens/s after its first token, counters)."""
    whole, after, counters, _ = timed_decode(model, eos, ids, params, drafter, k, costs)
    return whole, after, counters


def decode(target: Any, tokenizer: Any, configs: str, workload: list[Prompt],
           max_tokens: int) -> dict[str, Any]:
    specs = {spec: options_of(spec) for spec in configs.split(";")}
    factories = {spec: drafter_factory(o, target, tokenizer=tokenizer)
                 for spec, (o, _, _) in specs.items()}
    costs = CostModel(target_s=calibrated_costs(target, [1], 8, context=256))
    eos = list(tokenizer.eos_ids)
    rates: dict[str, list[tuple[float, float]]] = {"plain": []}
    counters: dict[str, list[Any]] = {spec: [] for spec in specs}
    plain_step: list[float] = []
    params = SamplingParams(max_tokens=max_tokens)
    for i, p in enumerate(workload):
        ids = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": p.turns[0]}]))
        if i == 0:
            run_one(target, eos, ids, params, None, 0, None)  # warm-up
        whole, after, c0 = run_one(target, eos, ids, params, None, 0, None)
        rates["plain"].append((whole, after))
        plain_step.append(c0.target_ns / max(1, c0.steps))
        line = []
        for spec, (_, k, auto_k) in specs.items():
            factory = factories[spec]
            w, a, c = run_one(target, eos, ids, params, factory() if factory else None, k,
                              costs if auto_k else None)
            rates.setdefault(spec, []).append((w, a))
            counters[spec].append(c)
            line.append(f"{spec} {w / whole:.2f}x")
        print(f"# {p.category}/{p.id}: {len(ids)} prompt tokens, plain {whole:.1f} tok/s; "
              + ", ".join(line), flush=True)
    step = statistics.median(plain_step)
    rows = []
    for spec in specs:
        cs = counters[spec]
        drafted = sum(c.drafted for c in cs)
        positions = sum(c.alpha_positions for c in cs)
        whole = [s[0] / b[0] for s, b in zip(rates[spec], rates["plain"], strict=True)]
        after = [s[1] / b[1] for s, b in zip(rates[spec], rates["plain"], strict=True)]
        rows.append({
            "config": spec, "drafted": drafted,
            "alpha": sum(c.alpha_micro for c in cs) / 1e6 / positions if positions else None,
            "accepted_per_drafted": sum(c.accepted for c in cs) / max(1, drafted),
            "mean_acceptance_length": (sum(c.accepted for c in cs) + sum(c.steps for c in cs))
            / max(1, sum(c.steps for c in cs)),
            "c": sum(c.draft_ns for c in cs) / max(1, drafted) / step if drafted else None,
            "whole": statistics.median(whole), "whole_min": min(whole), "whole_max": max(whole),
            "after": statistics.median(after), "after_min": min(after), "after_max": max(after),
            "choice": None if factories[spec] is None or factories[spec].selection is None
            else factories[spec].selection.chosen})
    plain_tps = statistics.median(r[0] for r in rates["plain"])
    return {"plain_tok_s": plain_tps, "plain_step_s": step / 1e9, "rows": rows,
            "prompts": len(workload)}


def print_decode(precision: str, result: dict[str, Any]) -> None:
    print(f"\n## {precision} target, {result['prompts']} prompts: plain "
          f"{result['plain_tok_s']:.1f} tok/s (median, whole requests), plain step "
          f"{result['plain_step_s'] * 1e3:.1f} ms")
    print(f"{'config':<34}{'alpha':>7}{'acc/dr':>7}{'len':>6}{'c':>7}"
          f"{'whole (min-max)':>22}{'after 1st (min-max)':>24}")
    for r in result["rows"]:
        alpha = "-" if r["alpha"] is None else f"{r['alpha']:.2f}"
        c = "-" if r["c"] is None else f"{r['c']:.3f}"
        choice = "" if r["choice"] is None else f" [{r['choice']}]"
        print(f"{r['config'] + choice:<34}{alpha:>7}{r['accepted_per_drafted']:>7.2f}"
              f"{r['mean_acceptance_length']:>6.2f}{c:>7}"
              f"{r['whole']:>9.2f}x ({r['whole_min']:.2f}-{r['whole_max']:.2f})"
              f"{r['after']:>11.2f}x ({r['after_min']:.2f}-{r['after_max']:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="w4a16,bf16")
    ap.add_argument("--configs", default=None,
                    help="';'-separated name[,option=value...]:k (default per target)")
    ap.add_argument("--per-category", type=int, default=1, help="built-in prompts per category")
    ap.add_argument("--specbench", default=str(SPECBENCH))
    ap.add_argument("--categories", default="", help="Spec-Bench categories (default none)")
    ap.add_argument("--specbench-per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds of the cost table")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hw = machine_summary()
    print(f"# SmolLM2-135M-Instruct, batch 1, greedy, {hw['cpu']} ({hw['cores']} cores, "
          f"{torch.get_num_threads()} threads), load average {hw.get('load_avg_1m')}; "
          f"command: {' '.join(sys.argv)}")
    base = load_model(None, "fp32")
    workload = prompts(args)
    out: dict[str, Any] = {"hardware": hw, "argv": sys.argv, "targets": {}}
    for precision in args.targets.split(","):
        target = base.model if precision == "fp32" else apply_precision(base.model, precision)
        make_exact(target)
        table = cost_table(target, base.tokenizer, args.rounds)
        print_costs(precision, table)
        record: dict[str, Any] = {"costs": {**table, "rows": [r.__dict__ for r in table["rows"]]}}
        if not args.skip_decode:
            result = decode(target, base.tokenizer, args.configs or CONFIGS[precision],
                            workload, args.max_tokens)
            print_decode(precision, result)
            record["decode"] = result
        out["targets"][precision] = record
        print(f"# load average now {machine_summary().get('load_avg_1m')}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
