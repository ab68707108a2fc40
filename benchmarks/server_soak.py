"""Benchmark (not a test): the memory of a real `specdecode serve` process over many rounds of
mixed traffic, the soak check of issue 26 item 4.

Starts `specdecode serve` on a free loopback port (the default SmolLM2-135M-Instruct, loaded
offline), then runs rounds of concurrent traffic. Each round sends, all at once:

- short chat requests, half of them streamed;
- long prompts that nearly fill the window (a long prefill, a few new tokens);
- oversized prompts (1 MB of text), refused by their byte size before any tokenizing;
- prompts just under the byte bound, tokenized (tens of thousands of tokens) then refused for
  not fitting the window: the tokenizer's heaviest allocations;
- streams the client drops after a few events (a disconnect mid-stream).

The server's RSS is read from /proc/PID/status every 0.2 s. It prints one line per round (RSS at
the round's end, its peak during the round) and a verdict: RSS after the warm-up rounds, at the
end, the growth between them and the growth per round over the second half of the rounds.
`--json FILE` writes every figure; `--env NAME=VALUE` starts the server with that environment
variable (e.g. MALLOC_ARENA_MAX=2 or SPECDECODE_MALLOC_TRIM=0, to compare allocator settings);
`--malloc-stats` starts the server through a small bootstrap that answers SIGUSR2 with one
line of glibc's `mallinfo2()` on its stderr (the log): bytes the allocator holds, bytes in use,
bytes free but kept; the script sends it after every round. In use flat while held grows is
allocator retention; in use growing is a leak.

    python benchmarks/server_soak.py [--rounds 20] [--warmup-rounds 4] [--max-seq-len 1024]
        [--drafter ngram] [--short 4] [--long 2] [--oversized 4] [--near-bound 4]
        [--disconnects 2] [--env NAME=VALUE] [--malloc-stats] [--json FILE] [--log FILE]

The server runs with OMP_NUM_THREADS=1 unless it is set (a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

START_TIMEOUT_S = 600.0
SERVING = re.compile(r"serving .* at (http://\S+)/v1")
SAMPLE_EVERY_S = 0.2
OVERSIZED_BYTES = 1_000_000  # under the 1 MiB body limit, far over any window's byte bound
WORD = "word "


def specdecode_command() -> list[str]:
    """The `specdecode` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("specdecode")
    if script.exists():
        return [str(script)]
    found = shutil.which("specdecode")
    if found is None:
        raise SystemExit("the specdecode command is not installed (pip install -e .[server])")
    return [found]


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii")
    except OSError:
        return 0
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


class RssSampler:
    """Reads a process's RSS every SAMPLE_EVERY_S on a thread; `peak_since_mark` per round."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def start(self) -> None:
        self._thread.start()

    def take_peak(self) -> int:
        """The highest RSS seen since the last call (or the start)."""
        peak, self.peak = max(self.peak, rss_bytes(self.pid)), 0
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# Run `specdecode serve` with a SIGUSR2 handler printing glibc's mallinfo2() (--malloc-stats).
MALLOC_BOOTSTRAP = """
import ctypes, signal, sys
class M(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = M
def report(signum, frame):
    m = libc.mallinfo2()
    print(f"mallinfo2: heap {m.arena} in_use {m.uordblks} free_kept {m.fordblks} "
          f"mmapped {m.hblkhd}", file=sys.stderr, flush=True)
signal.signal(signal.SIGUSR2, report)
from specdecode.cli import main
sys.argv = ["specdecode", *sys.argv[1:]]
sys.exit(main())
"""
MALLOC_LINES: list[tuple[int, ...]] = []  # (heap, in use, free kept, mmapped), as reported
MALLINFO = re.compile(r"mallinfo2: heap (\d+) in_use (\d+) free_kept (\d+) mmapped (\d+)")


@contextmanager
def serve(extra: list[str], env_extra: dict[str, str], log: Path,
          malloc_stats: bool = False) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`specdecode serve` on a free loopback port; yields (base URL, process) once healthy."""
    program = [sys.executable, "-c", MALLOC_BOOTSTRAP] if malloc_stats else \
        specdecode_command()
    cmd = [*program, "serve", "--port", "0", "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           **env_extra}
    with log.open("w", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=sink, text=True, env=env)
        found: list[str] = []

        def pump() -> None:  # copy stderr to the log, catching the "serving ... at URL" line
            assert proc.stderr is not None
            for line in proc.stderr:
                if not sink.closed:
                    sink.write(line)
                    sink.flush()
                match = SERVING.search(line)
                if match and not found:
                    found.append(match.group(1))
                heap = MALLINFO.search(line)
                if heap:
                    MALLOC_LINES.append(tuple(int(g) for g in heap.groups()))

        threading.Thread(target=pump, daemon=True).start()
        try:
            yield wait_ready(proc, found, log), proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(proc: subprocess.Popen[str], found: list[str], log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        if found:
            try:
                if httpx.get(f"{found[0]}/health", timeout=5).status_code == 200:
                    return found[0]
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not start in {START_TIMEOUT_S:.0f} s; see {log}")


@dataclass(frozen=True)
class Traffic:
    """What one round sends, all at once."""

    short: int = 4
    long: int = 2
    oversized: int = 4
    near_bound: int = 4
    disconnects: int = 2
    long_words: int = 800  # "word " is one token: a prompt of about this many tokens
    near_bound_fraction: float = 0.95  # of the server's byte bound (probed at start)


@dataclass
class RoundResult:
    """One round: its RSS at the end and peak, the status codes it got, its wall time."""

    index: int
    rss_end: int
    rss_peak: int
    wall_s: float
    statuses: dict[str, int] = field(default_factory=dict)
    malloc_in_use: int = 0  # --malloc-stats: glibc's bytes in use and free but kept
    malloc_free_kept: int = 0


BOUND = re.compile(r"holds at most (\d+) bytes")


def probe_byte_bound(url: str) -> int:
    """The server's prompt byte bound, read from its refusal of an oversized prompt."""
    body = chat_body(WORD * (OVERSIZED_BYTES // len(WORD)), 4, stream=False)
    response = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    match = BOUND.search(response.text)
    if response.status_code != 400 or match is None:
        raise SystemExit(f"the server did not state its prompt byte bound when refusing an "
                         f"oversized prompt ({response.status_code} {response.text[:120]}): "
                         "pass --near-bound-bytes")
    return int(match.group(1))


MODEL = {"id": ""}  # the served model's id, read from /v1/models at start


def chat_body(content: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {"model": MODEL["id"], "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


async def post(client: httpx.AsyncClient, body: dict[str, object]) -> str:
    """One request read to its end; returns its status code as text."""
    if body.get("stream"):
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass
            return str(response.status_code)
    response = await client.post("/v1/chat/completions", json=body)
    return str(response.status_code)


async def disconnect(client: httpx.AsyncClient, body: dict[str, object], events: int) -> str:
    """A stream dropped by the client after `events` lines."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += bool(line)
            if seen >= events:
                break
        return "dropped"


def round_requests(client: httpx.AsyncClient, traffic: Traffic, index: int,
                   near_bound_bytes: int) -> list[asyncio.Task[str]]:
    """The coroutines of one round, started together."""
    jobs = []
    for i in range(traffic.short):
        jobs.append(post(client, chat_body(f"Round {index}, question {i}: name a colour.", 16,
                                           stream=i % 2 == 0)))
    for i in range(traffic.long):
        jobs.append(post(client, chat_body(f"{index} {i} " + WORD * traffic.long_words, 4,
                                           stream=False)))
    for _ in range(traffic.oversized):
        jobs.append(post(client, chat_body(WORD * (OVERSIZED_BYTES // len(WORD)), 4, False)))
    for i in range(traffic.near_bound):
        words = near_bound_bytes // len(WORD)
        jobs.append(post(client, chat_body(f"{index} {i} " + WORD * words, 4, False)))
    for i in range(traffic.disconnects):
        jobs.append(disconnect(client, chat_body(f"Round {index}: count to {200 + i}.", 128,
                                                 stream=True), events=3))
    return [asyncio.ensure_future(job) for job in jobs]


async def run_round(url: str, traffic: Traffic, index: int, near_bound_bytes: int,
                    timeout_s: float) -> tuple[dict[str, int], float]:
    """One round of traffic; the count of each status code (or exception name), wall time."""
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        tasks = round_requests(client, traffic, index, near_bound_bytes)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    statuses: dict[str, int] = {}
    for outcome in outcomes:
        key = type(outcome).__name__ if isinstance(outcome, BaseException) else outcome
        statuses[key] = statuses.get(key, 0) + 1
    return statuses, time.perf_counter() - start


@dataclass
class SoakResult:
    """Every round, and the verdict figures."""

    command: str
    server_args: list[str]
    env: dict[str, str]
    rss_loaded: int  # after the model loaded, before any traffic
    rounds: list[RoundResult]
    warmup_rounds: int

    @property
    def rss_after_warmup(self) -> int:
        return self.rounds[self.warmup_rounds - 1].rss_end if self.warmup_rounds else \
            self.rss_loaded

    @property
    def rss_final(self) -> int:
        return self.rounds[-1].rss_end

    @property
    def growth_after_warmup(self) -> int:
        return self.rss_final - self.rss_after_warmup

    @property
    def growth_per_round(self) -> float:
        """Least-squares slope of the end-of-round RSS over the second half of the rounds."""
        tail = self.rounds[len(self.rounds) // 2:]
        if len(tail) < 2:
            return 0.0
        xs = [float(r.index) for r in tail]
        ys = [float(r.rss_end) for r in tail]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den

    @property
    def rss_peak(self) -> int:
        return max(r.rss_peak for r in self.rounds)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "rss_after_warmup": self.rss_after_warmup,
                "rss_final": self.rss_final, "growth_after_warmup": self.growth_after_warmup,
                "growth_per_round": self.growth_per_round, "rss_peak": self.rss_peak}


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def soak(server_args: list[str], env_extra: dict[str, str], traffic: Traffic, rounds: int,
         warmup_rounds: int, log: Path, malloc_stats: bool = False, timeout_s: float = 300.0,
         echo: bool = True, near_bound_bytes: int | None = None) -> SoakResult:
    """Start a server, run the rounds, return what was measured (the server is stopped)."""
    if not 0 <= warmup_rounds < rounds:
        raise SystemExit("--warmup-rounds must be at least 0 and below --rounds")
    env = dict(env_extra)
    with serve(server_args, env, log, malloc_stats) as (url, proc):
        rss_loaded = rss_bytes(proc.pid)
        MODEL["id"] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        near_bound = near_bound_bytes or int(probe_byte_bound(f"{url}/v1")
                                             * traffic.near_bound_fraction)
        if echo:
            print(f"server {url} (pid {proc.pid}) ready: RSS {mb(rss_loaded)}", flush=True)
        sampler = RssSampler(proc.pid)
        sampler.start()
        results: list[RoundResult] = []
        try:
            for index in range(rounds):
                statuses, wall = asyncio.run(run_round(url, traffic, index, near_bound, timeout_s))
                time.sleep(SAMPLE_EVERY_S * 2)  # let the last releases land before reading
                result = RoundResult(index, rss_bytes(proc.pid), sampler.take_peak(), wall,
                                     statuses)
                if malloc_stats:
                    result.malloc_in_use, result.malloc_free_kept = malloc_report(proc.pid)
                results.append(result)
                if echo:
                    tag = " (warm-up)" if index < warmup_rounds else ""
                    heap = (f", malloc in use {mb(result.malloc_in_use)}, free kept "
                            f"{mb(result.malloc_free_kept)}") if malloc_stats else ""
                    print(f"round {index:>3}{tag}: RSS {mb(result.rss_end)}, peak "
                          f"{mb(result.rss_peak)}{heap}, {wall:.1f} s, {statuses}", flush=True)
        finally:
            sampler.stop()
    return SoakResult(" ".join(sys.argv), server_args, env, rss_loaded, results, warmup_rounds)


def malloc_report(pid: int) -> tuple[int, int]:
    """Ask the server for its mallinfo2() line; (bytes in use, bytes free but kept)."""
    seen = len(MALLOC_LINES)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while len(MALLOC_LINES) == seen and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(MALLOC_LINES) == seen:
        return 0, 0
    _, in_use, free_kept, _ = MALLOC_LINES[-1]
    return in_use, free_kept


def parse_env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env takes NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup-rounds", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--oversized", type=int, default=4)
    ap.add_argument("--near-bound", type=int, default=4)
    ap.add_argument("--disconnects", type=int, default=2)
    ap.add_argument("--near-bound-bytes", type=int, default=None,
                    help="bytes of the tokenized-then-refused prompts (default: 95 %% of the "
                         "byte bound the server states)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--malloc-stats", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--log", type=Path, default=Path("runs") / "server-soak.log")
    args = ap.parse_args()
    window = args.max_seq_len
    traffic = Traffic(short=args.short, long=args.long, oversized=args.oversized,
                      near_bound=args.near_bound, disconnects=args.disconnects,
                      long_words=max(window - 128, 16))
    server_args = ["--drafter", args.drafter, "--k", "auto", "--max-seq-len", str(window)]
    args.log.parent.mkdir(parents=True, exist_ok=True)
    result = soak(server_args, parse_env(args.env), traffic, args.rounds, args.warmup_rounds,
                  args.log, args.malloc_stats, near_bound_bytes=args.near_bound_bytes)
    print(f"\nserver_soak: specdecode serve {' '.join(server_args)}, env {result.env or '{}'}; "
          f"{args.rounds} rounds of {asdict(traffic)}")
    print(f"RSS loaded {mb(result.rss_loaded)}; after {args.warmup_rounds} warm-up rounds "
          f"{mb(result.rss_after_warmup)}; final {mb(result.rss_final)}; growth after warm-up "
          f"{result.growth_after_warmup / 1e6:+.0f} MB; slope over the second half "
          f"{result.growth_per_round / 1e6:+.1f} MB/round; peak {mb(result.rss_peak)}")
    print(f"command: python {' '.join(sys.argv)}")
    if args.json:
        args.json.write_text(json.dumps(result.to_dict(), indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
