"""v(T) of every kernel path and exact precision, and of llama.cpp, in one interleaved run.

Each configuration runs in a child process of its own (SPECDECODE_KERNEL_PATH is read once per
process), `--rounds` times round-robin so that the machine's drift spreads over all of them; a
round measures `bench.costs.forward_costs` (scoring T = 1..kmax positions after `--context`
tokens, batch 1, median of `--repeats` after warm-up). The table gives each configuration's
median ms per T over every round and v(T) = t(T) / t(1), with the spread of v over rounds.
The load-time invariance check is not run here (this measures time only; loading checks it).

    python benchmarks/kernel_paths.py [--model NAME] [--paths avx512vnni,avx512,avx2]
        [--precisions checkpoint,checkpoint-a8] [--llamacpp] [--rounds 3] [--kmax 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

CHILD = r"""
import json, sys, time, torch
from specdecode.bench.costs import forward_costs
spec, precision, context, kmax, repeats, threads, batches = json.loads(sys.argv[1])
torch.set_num_threads(threads)
if precision == "llama.cpp":
    from specdecode.models.backends import load_model
    model = load_model(spec, "auto", "llama.cpp").model
    path = "llama.cpp"
else:
    from specdecode.models import gguf_blocks, kernels, loading, precision as p
    from specdecode.models.config import config_from_hf, read_hf_config
    folder, source, _ = loading.resolve_folder(spec)
    cfg = config_from_hf(read_hf_config(folder), "config")
    record = p.get(precision)
    model = gguf_blocks.load_gguf_model(source, cfg, record.gguf_mode, record.name)
    path = kernels.path_name()
out = {"path": path, "curves": {b: forward_costs(model, b, context, kmax, repeats)
                                for b in batches}}
print("RESULT " + json.dumps(out))
"""


def run_child(spec: str | None, precision: str, path: str | None, args: argparse.Namespace
              ) -> dict[str, Any]:
    env = dict(os.environ)
    # llama.cpp holds a sequence per batch row and per prompt being prefilled
    largest = max(args.batches)
    env.setdefault("SPECDECODE_LLAMACPP_SEQUENCES", str(2 * largest + 2))
    if path:
        env["SPECDECODE_KERNEL_PATH"] = path
    payload = json.dumps([spec, precision, args.context, args.kmax, args.repeats, args.threads,
                          args.batches])
    done = subprocess.run([sys.executable, "-c", CHILD, payload], capture_output=True,
                          text=True, env=env, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{precision} on {path}: {done.stderr.strip()[-2000:]}")
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    from specdecode.bench.hardware import machine_summary

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--paths", default="avx512vnni,avx512,avx2")
    p.add_argument("--precisions", default="checkpoint,checkpoint-a8")
    p.add_argument("--llamacpp", action="store_true", help="add llama.cpp (the exact build)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--kmax", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    from specdecode.models import kernels

    configs: list[tuple[str, str | None]] = []
    for path in args.paths.split(","):
        why = kernels.cpu_runs(kernels.path_by_name(path))
        if why is not None:
            print(f"# path {path} skipped: {why}")
            continue
        configs += [(precision, path) for precision in args.precisions.split(",")]
    if args.llamacpp:
        configs.append(("llama.cpp", None))
    samples: dict[tuple[str, str | None, int], list[list[float]]] = {}
    for _ in range(args.rounds):
        for precision, path in configs:
            out = run_child(args.model, precision, path, args)
            for b, curve in out["curves"].items():
                samples.setdefault((precision, path, int(b)), []).append(
                    [r["median_s"] for r in curve])
    hw = machine_summary()
    print(f"# v(T) per kernel path: {args.model or 'SmolLM2-135M-Instruct'}, context "
          f"{args.context}, {hw['cpu']}, {args.threads} threads, {args.rounds} interleaved "
          f"rounds x {args.repeats} repeats; ms = median over rounds; v = t(T)/t(1) "
          "(min-max over rounds)")
    for (precision, path, b), rounds in samples.items():
        label = precision if path is None else f"{precision} on {path}"
        ks = range(1, len(rounds[0]) + 1)
        ms = [statistics.median(r[k - 1] for r in rounds) * 1e3 for k in ks]
        vs = [[r[k - 1] / r[0] for r in rounds] for k in ks]
        print(f"\n## {label}, batch {b}")
        print("| T | ms | v(T) | v range |\n|---|---|---|---|")
        for k in ks:
            print(f"| {k} | {ms[k - 1]:.1f} | {ms[k - 1] / ms[0]:.2f} | "
                  f"{min(vs[k - 1]):.2f}-{max(vs[k - 1]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
