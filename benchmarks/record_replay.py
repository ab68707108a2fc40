"""Benchmark (not a test): issue 47's loop on the default model. Record the traffic a script
sends to `specdecode serve --record`, replay it open loop at 1x and 2x its rate with plain
decoding and the recommended configuration side by side, and measure what recording costs.

1. **Record**: `serve --drafter ngram --k auto --record` (the configuration bench recommends on
   the default checkpoint target), and a client sending `--requests` chat requests (first turns
   of Spec-Bench prompts, its categories in turn, `metadata.category` set) at a Poisson rate of
   `--rate` requests/s (seeded), each from its own thread when due. The recording server's
   batch sizes are read from its /metrics (engine_steps_total) after the traffic.
2. **Replay**: `specdecode bench --workload recorded.jsonl --arrivals recorded --speed S` for
   each of `--speeds`, in process, configurations plain and ngram:k=auto at the server's max
   batch, with `--slo`. Per speed and configuration: the replay's scheduled and measured
   arrival rates against the recording's, its batch-size distribution beside the recording's,
   TTFT and TPOT p50 / p99, the goodput, and the speedup with its interval.
3. **Recording overhead**: two servers of the same configuration, recording on and off, fed
   alternately (ABBA, `--overhead-pairs` pairs) with blocks of `--overhead-block` requests at
   the recording's rate; per block the output tokens per second of wall time (first send to last
   reply) and the mean latency; the on/off ratio of each pair, its median and a bootstrap 95 %
   interval of the mean. And the recorder's own cost per request, timed directly (encode and
   queue on the event loop's side, and the writer's write), against the mean request latency.
4. With `--large-mib N`: a recording of N MiB read with a selection, in a process of its own:
   the seconds and the peak RSS (the reader holds one line at a time and the requests kept).

    python benchmarks/record_replay.py --specbench ../shared/data/specbench/question.jsonl
        [--requests 200] [--rate 0.5] [--speeds 1,2] [--max-tokens 64] [--threads 2]
        [--max-batch 8] [--overhead-pairs 6] [--overhead-block 10] [--large-mib 1024]
        [--out DIR]

Everything is written to --out (default runs/record-replay-<time>): the recording, each replay's
report, the servers' logs and summary.json; the tables are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from specdecode.bench.hardware import describe_hardware, detect_hardware
from specdecode.bench.http_metrics import read_steps
from specdecode.bench.workloads import read_prompts

sys.path.insert(0, str(Path(__file__).parent))
from endpoint_sweep import serve  # a sibling script

CATEGORIES = ("summarization", "rag", "qa", "translation", "math_reasoning", "coding", "writing")
CONFIGS = "plain;ngram:k=auto"


def traffic(specbench: Path, n: int, max_tokens: int) -> list[dict[str, Any]]:
    """n chat request bodies: Spec-Bench first turns, one category after another."""
    prompts, _ = read_prompts(specbench)
    by_category = {c: [p for p in prompts if p.category == c] for c in CATEGORIES}
    bodies = []
    for i in range(n):
        category = CATEGORIES[i % len(CATEGORIES)]
        p = by_category[category][(i // len(CATEGORIES)) % len(by_category[category])]
        bodies.append({"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens,
                       "temperature": 0, "metadata": {"category": category},
                       "messages": [{"role": "user", "content": p.turns[0]}]})
    return bodies


def poisson(n: int, rate: float, seed: int) -> list[float]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [0.0, *np.cumsum(gaps[1:]).tolist()]


def send_all(url: str, bodies: list[dict[str, Any]], times: list[float]
             ) -> list[tuple[float, float, int]]:
    """Send each body when due, each from its own thread: (sent, latency, output tokens) of
    the requests served; a refused one (a full server's 429) is counted, not fatal."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=64)
    with httpx.Client(limits=limits, timeout=1800) as client:
        start = time.monotonic()

        def one(item: tuple[dict[str, Any], float]) -> tuple[float, float, int] | None:
            body, at = item
            time.sleep(max(0.0, start + at - time.monotonic()))
            sent = time.monotonic()
            reply = client.post(f"{url}/v1/chat/completions", json=body)
            if reply.status_code != 200:
                print(f"request refused: HTTP {reply.status_code} {reply.text[:120]}",
                      file=sys.stderr)
                return None
            return sent - start, time.monotonic() - sent, reply.json()["usage"][
                "completion_tokens"]

        with ThreadPoolExecutor(min(len(bodies), 256)) as pool:
            got = list(pool.map(one, zip(bodies, times, strict=True)))
    return [x for x in got if x is not None]


def steps_by_batch(url: str) -> dict[int, int]:
    return read_steps(httpx.get(f"{url}/metrics", timeout=30).text) or {}


def shares(steps: dict[int, int] | list[float]) -> dict[int, float]:
    counts = steps if isinstance(steps, dict) else {i + 1: n for i, n in enumerate(steps)}
    total = sum(counts.values())
    return {b: n / total for b, n in sorted(counts.items()) if total and n}


def fmt_shares(s: dict[int, float]) -> str:
    return " ".join(f"{b}:{v:.0%}" for b, v in s.items() if v >= 0.005)


def record(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Step 1: the recording, its arrival rate and the server's batch sizes."""
    recorded = out / "recorded.jsonl"
    bodies = traffic(args.specbench, args.requests, args.max_tokens)
    times = poisson(args.requests, args.rate, args.seed)
    with serve("record", server_flags(args, ["--record", str(recorded)]),
               out / "server-record.log") as url:
        before = steps_by_batch(url)
        sent = send_all(url, bodies, times)
        after = steps_by_batch(url)
    lines = [json.loads(x) for x in recorded.read_text().splitlines()]
    arrivals = sorted(x["arrival_s"] for x in lines if "request" in x)
    steps = {b: after[b] - before.get(b, 0) for b in after}
    return {"path": str(recorded), "requests": len(arrivals),
            "rate": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
            "client_rate": (len(sent) - 1) / (max(s for s, _, _ in sent)),
            "batch_shares": shares(steps), "mean_latency_s":
                statistics.mean(latency for _, latency, _ in sent)}


def server_flags(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return ["--drafter", "ngram", "--k", "auto", "--max-batch", str(args.max_batch),
            "--threads", str(args.threads), *extra]


def replay(args: argparse.Namespace, out: Path, recorded: str, speed: float) -> dict[str, Any]:
    """Step 2: one in-process replay; its traffic section and speedups, by configuration."""
    folder = out / f"replay-{speed:g}x"
    cmd = [sys.executable, "-m", "specdecode.cli", "bench", "--workload", recorded,
           "--arrivals", "recorded", "--speed", str(speed), "--configs", CONFIGS,
           "--batch-sizes", str(args.max_batch), "--threads", str(args.threads),
           "--out", str(folder), "--quiet", "--slo", args.slo]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    (out / f"replay-{speed:g}x.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"replay at {speed:g}x failed; see {out}/replay-{speed:g}x.log")
    report = json.loads((folder / "report.json").read_text())
    traffic_by = {c["config"]: c for c in report["traffic"]["configs"]}
    rows = {}
    for c in report["analysis"]["configs"]:
        name = c["spec"]["name"]
        t = traffic_by[name]
        speedup = (c.get("speedup") or {}).get("total_ratio")
        rows[name] = {"scheduled_rate": t["scheduled_rate"], "measured_rate": t["measured_rate"],
                      "late_p99_s": t["late"]["p99"], "batch_shares": shares(t["batch_shares"]),
                      "mean_batch": t["mean_batch"], "ttft": t["ttft"], "tpot": t["tpot"],
                      "goodput": t["goodput"], "speedup": speedup,
                      "alpha": c["acceptance"]["alpha"]}
    return {"speed": speed, "configs": rows, "recommendation": report["recommendation"],
            "disturbed": [c["config"] for c in report["load"].get("configs", [])
                          if c.get("n_disturbed")]}


def overhead(args: argparse.Namespace, out: Path, rate: float) -> dict[str, Any]:
    """Step 3: recording on against off, interleaved ABBA, and the recorder's direct cost."""
    bodies = traffic(args.specbench, args.overhead_block, args.max_tokens)
    ratios, lat_ratios = [], []
    with serve("on", server_flags(args, ["--record", str(out / "overhead.jsonl")]),
               out / "server-on.log") as on, \
            serve("off", server_flags(args, []), out / "server-off.log") as off:
        for pair in range(args.overhead_pairs):
            order = (on, off) if pair % 2 == 0 else (off, on)
            got = {}
            for url in order:
                times = poisson(len(bodies), rate, args.seed + 100 + pair)
                sent = send_all(url, bodies, times)
                wall = max(s + lat for s, lat, _ in sent) - min(s for s, _, _ in sent)
                got[url] = (sum(n for _, _, n in sent) / wall,
                            statistics.mean(lat for _, lat, _ in sent))
            ratios.append(got[on][0] / got[off][0])
            lat_ratios.append(got[on][1] / got[off][1])
    rng = np.random.default_rng(0)
    means = [float(np.mean(rng.choice(ratios, len(ratios)))) for _ in range(2000)]
    return {"pairs": len(ratios), "throughput_ratios": ratios,
            "median": statistics.median(ratios), "mean": statistics.mean(ratios),
            "ci": [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))],
            "latency_ratio_median": statistics.median(lat_ratios),
            "recorder_us_per_request": recorder_cost(out)}


def recorder_cost(out: Path, n: int = 2000) -> dict[str, float]:
    """Microseconds per request the recorder costs: the event loop's part (encode, queue) and
    the writer's (a write and a flush), for lines the size of the recording's."""
    from specdecode.server.record import Recorder, RecordOptions

    lines = [json.loads(x) for x in (out / "recorded.jsonl").read_text().splitlines()]
    entries = [x for x in lines if "request" in x][:50]
    rec = Recorder(RecordOptions(out / "cost.jsonl"), {"id": "cost"})
    start = time.perf_counter()
    for i in range(n):
        rec.record(entries[i % len(entries)])
    loop_side = (time.perf_counter() - start) / n
    start = time.perf_counter()
    rec.start()
    rec.close()
    writer = (time.perf_counter() - start) / n
    (out / "cost.jsonl").unlink()
    return {"loop_us": loop_side * 1e6, "writer_us": writer * 1e6,
            "dropped": float(rec.counts["dropped"])}


def large_file(out: Path, mib: int, limit: int = 200) -> dict[str, float]:
    """A recording of `mib` MiB (the recorded lines repeated, new ids, later arrivals), read
    with --limit-per-category `limit` in a process of its own: seconds and peak RSS."""
    lines = [json.loads(x) for x in (out / "recorded.jsonl").read_text().splitlines()]
    header, entries = lines[0], [x for x in lines if "request" in x]
    big = out / "large.jsonl"
    with big.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        n = 0
        while f.tell() < mib * 2**20:
            entry = entries[n % len(entries)]
            f.write(json.dumps({**entry, "id": f"large-{n}",
                                "arrival_s": n * 0.5}) + "\n")
            n += 1
    code = ("import resource, sys, time; from specdecode.bench.workloads import load_workload; "
            "t = time.perf_counter(); w = load_workload(sys.argv[1], limit_per_category="
            f"{limit}); print(len(w.prompts), time.perf_counter() - t, "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True,
                          text=True, check=True)
    kept, seconds, rss_kib = done.stdout.split()
    size = big.stat().st_size
    big.unlink()
    return {"bytes": float(size), "lines": float(n), "kept": float(kept),
            "seconds": float(seconds), "peak_rss_mib": float(rss_kib) / 1024}


def print_tables(summary: dict[str, Any]) -> None:
    rec = summary["recording"]
    print(f"\nrecording: {rec['requests']} requests at {rec['rate']:.3f} req/s (client sent "
          f"{rec['client_rate']:.3f}); server batch sizes {fmt_shares(rec['batch_shares'])}")
    print("| speed | config | scheduled / measured req/s | vs recording x speed | late p99 (ms) "
          "| batch sizes (share of steps) | mean batch | TTFT p50 / p99 (ms) | TPOT p50 / p99 "
          "(ms) | goodput | speedup (95% CI) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in summary["replays"]:
        for name, c in r["configs"].items():
            target = rec["rate"] * r["speed"]
            s = c["speedup"]
            speed = "-" if not s else f"{s['estimate']:.2f}x [{s['low']:.2f}, {s['high']:.2f}]"
            g = c["goodput"] or {}
            print(f"| {r['speed']:g}x | {name} | {c['scheduled_rate']:.3f} / "
                  f"{c['measured_rate']:.3f} | {c['measured_rate'] / target - 1:+.1%} | "
                  f"{c['late_p99_s'] * 1000:.0f} | {fmt_shares(c['batch_shares'])} | "
                  f"{c['mean_batch']:.2f} | {c['ttft']['p50'] * 1000:.0f} / "
                  f"{c['ttft']['p99'] * 1000:.0f} | {c['tpot']['p50'] * 1000:.1f} / "
                  f"{c['tpot']['p99'] * 1000:.1f} | {g.get('met')}/{g.get('requests')} "
                  f"({g.get('share', math.nan):.0%}) | {speed} |")
        print(f"  {r['speed']:g}x recommendation: enable={r['recommendation']['enable']} "
              f"{r['recommendation'].get('config')}; disturbed: {r['disturbed'] or 'none'}")
    big = summary.get("large")
    if big:
        print(f"a {big['bytes'] / 2**30:.2f} GiB recording ({big['lines']:.0f} lines) read with "
              f"a limit: {big['kept']:.0f} requests kept in {big['seconds']:.0f} s, peak RSS "
              f"{big['peak_rss_mib']:.0f} MiB")
    o = summary.get("overhead")
    if o:
        cost = o["recorder_us_per_request"]
        print(f"recording on / off throughput: median {o['median']:.4f}, mean {o['mean']:.4f} "
              f"[{o['ci'][0]:.4f}, {o['ci'][1]:.4f}] over {o['pairs']} ABBA pairs; latency "
              f"ratio median {o['latency_ratio_median']:.4f}; recorder {cost['loop_us']:.1f} us "
              f"on the event loop + {cost['writer_us']:.1f} us in its writer per request, "
              f"against a mean request of {rec['mean_latency_s']:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--specbench", type=Path, required=True)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--speeds", default="1,2")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--slo", default="ttft=2,tpot=0.1")
    p.add_argument("--overhead-pairs", type=int, default=6)
    p.add_argument("--overhead-block", type=int, default=10)
    p.add_argument("--large-mib", type=int, default=0,
                   help="also read a recording of this many MiB (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path("runs") / f"record-replay-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    summary: dict[str, Any] = {"hardware": describe_hardware(detect_hardware(args.threads, None)),
                               "args": {k: str(v) for k, v in vars(args).items()}}
    summary["recording"] = record(args, out)
    summary["replays"] = [replay(args, out, summary["recording"]["path"], float(s))
                          for s in args.speeds.split(",")]
    if args.overhead_pairs > 0:
        summary["overhead"] = overhead(args, out, summary["recording"]["rate"])
    if args.large_mib > 0:
        summary["large"] = large_file(out, args.large_mib)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"{summary['hardware']}")
    print_tables(summary)


if __name__ == "__main__":
    main()
