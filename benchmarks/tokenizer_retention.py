"""Benchmark (not a test): what tokenizing long prompts on several threads leaves resident, in
glibc's own accounting, and what `malloc_trim(0)` gives back (issue 26, item 4).

Loads only the tokenizer of the default model (SmolLM2-135M-Instruct), then runs `--rounds`
rounds; in each, `--threads` threads each tokenize one prompt of `--prompt-bytes` bytes at once
(`encode_batch`, as the server does). After every round it prints the process's RSS, glibc's
`mallinfo2()` (bytes in use by live allocations, bytes freed but kept in the arenas) and the
round's wall time; at the end it calls `malloc_trim(0)` and prints them again. Bytes in use
flat while RSS and the kept bytes grow is allocator retention; in use growing is a leak. Run it
with `MALLOC_ARENA_MAX=2` in the environment to see what capping glibc's arenas does to both
the memory and the time.

    python benchmarks/tokenizer_retention.py [--threads 16] [--prompt-bytes 1000000]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdecode.models.loading import resolve_folder
from specdecode.models.tokenizer import Tokenizer

WORD = "word "


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def rss_bytes() -> int:
    text = Path("/proc/self/status").read_text(encoding="ascii")
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def state(libc: ctypes.CDLL) -> str:
    info = libc.mallinfo2()
    return (f"RSS {rss_bytes() / 1e6:.0f} MB, malloc in use {info.uordblks / 1e6:.0f} MB, "
            f"free kept {info.fordblks / 1e6:.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--prompt-bytes", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if min(args.threads, args.prompt_bytes, args.rounds) < 1:
        raise SystemExit("--threads, --prompt-bytes and --rounds must be >= 1")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    tok = Tokenizer(resolve_folder(None)[0])
    text = WORD * (args.prompt_bytes // len(WORD))
    print(f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')}; tokenizer "
          f"loaded: {state(libc)}")

    def work(i: int) -> int:
        return len(tok._tok.encode_batch([f"{i} {text}"], add_special_tokens=False)[0].ids)

    with ThreadPoolExecutor(args.threads) as pool:
        for index in range(args.rounds):
            start = time.perf_counter()
            tokens = list(pool.map(work, range(args.threads)))
            print(f"round {index}: {args.threads} threads x {tokens[0]} tokens in "
                  f"{time.perf_counter() - start:.2f} s: {state(libc)}", flush=True)
    libc.malloc_trim(0)
    print(f"after malloc_trim(0): {state(libc)}")


if __name__ == "__main__":
    main()
